"""Counting what one steady version costs each rank, in operations rather than seconds (so the count cannot flake on
a loaded machine): MetaServer requests, host-board and version-channel operations, and the Python work of the
version's route (function calls, and calls into C), for a real ``WeightsWriter`` and ``WeightsReader`` in two
threads of one process over the CPU transport ``auto`` picks on one host (shared memory).

What is counted on a rank's thread: every Python call and every call into C, except inside the operations that
wait or move bytes (a MetaServer request, a board or channel operation, the transport's copies): those count as
one operation each, whatever they do inside, since how often they poll depends on timing, not on the code. A
background thread's MetaServer requests (events, version reports, dropping old records) are counted apart.

Used by ``test_steady_budget.py`` (the CI guard) and runnable alone to print the counts:

    python packages/awex-engines/tests/steady_counts.py
"""

from __future__ import annotations

import collections
import json
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from test_moved_memory import module_of

from awex.convert.live import LiveTensors, fingerprinted
from awex.engines.reader import WeightsReader
from awex.engines.sync import board as host_board
from awex.engines.sync.background import Background
from awex.engines.sync.board import HostBoard
from awex.engines.sync.channel import VersionChannel
from awex.engines.writer import WeightsWriter
from awex.meta import canonical_tensors
from awex.meta.client import MetaClient
from awex.meta.layouts import hf_layout
from awex.meta.server import start_embedded
from awex.transport.pull import segments
from awex.transport.pull.shm import ShmReceiver, ShmSender

CONFIG = json.loads((Path(__file__).resolve().parents[3] / "integration" / "models" / "qwen2-tiny.json").read_text())
STEADY_VERSIONS = 3  # versions before the counted one (the first plans; the next ones must be steady already)

# operations counted as one each, their inside not counted: (class, method) -> category
OPERATIONS = {
    (MetaClient, "_request"): "meta",
    (MetaClient, "put_sent"): "meta",  # a request sent now, its answer read later (one request, both counted once)
    (MetaClient, "_put_answered"): "meta answer",
    (MetaClient, "report_versions_sent"): "meta",  # the version's report, sent before write returns
    (MetaClient, "_versions_answered"): "meta answer",  # its answer, read as the next version starts
    **{(HostBoard, m): "board" for m in ("heads_up", "post", "manifest", "ring", "wait", "signalled")},
    **{(VersionChannel, m): "channel" for m in ("put", "wait", "get", "delete")},
    (Background, "submit"): "handover",  # a wake-up of the rank's background thread
    (ShmSender, "fill"): "copies",
    (ShmReceiver, "run"): "copies",
    # which host this is, whether a rank's process still runs: each reads /proc (tens of microseconds a call in a
    # sandboxed container), for a board not joined yet or a rank still silent, never in a steady version
    (host_board, "host_identity"): "probe",
    (segments, "alive"): "probe",
}


@dataclass
class RankCounts:
    """One rank's thread in one version."""

    python_calls: int = 0  # Python function calls (a generator's resumption counts as one)
    c_calls: int = 0  # calls into C (builtins, methods of C types)
    ops: collections.Counter = field(default_factory=collections.Counter)  # category -> operations
    requests: list = field(default_factory=list)  # (method, path) of each MetaServer request
    hottest: collections.Counter = field(default_factory=collections.Counter)  # (file, function) -> Python calls
    order: list = field(default_factory=list)  # (category, method) of each operation, in the order made
    entered: collections.Counter = field(default_factory=collections.Counter)  # (from file, into file) -> calls


@dataclass
class VersionCounts:
    tensors: int
    medium: str  # where the per-version signals went
    writer: RankCounts
    reader: RankCounts
    background: list  # (thread, method, path) of requests made off the ranks' threads


def views_of(module: torch.nn.Module):
    """Views as ``awex.convert`` makes them: looked up live, with a fingerprint of where the parameters are."""
    params = LiveTensors(module)
    return fingerprinted(lambda name, box: params[name][box.slices()], params)


def counted(view_of) -> tuple:
    """``view_of`` recording the name of every view asked of it (a list, returned with it), with its fingerprint and
    sources: a test tells a version that derived views from one that checked the fingerprint alone."""
    calls: list[str] = []

    def counting(name, box):
        calls.append(name)
        return view_of(name, box)

    for part in ("fingerprint", "addresses", "forms", "sources"):
        setattr(counting, part, getattr(view_of, part))
    return counting, calls


class _Profiler:
    """``sys.setprofile`` for one thread: counts calls outside :data:`OPERATIONS`, and those operations."""

    def __init__(self, counts: RankCounts):
        self.counts = counts
        self.skip = 0  # depth inside an operation
        self.codes = {getattr(cls, name).__code__: (what, name) for (cls, name), what in OPERATIONS.items()}

    def __call__(self, frame, event, arg):
        if self.skip:
            if event == "call":
                self.skip += 1
            elif event == "return":
                self.skip -= 1
            return
        if event == "call":
            what, name = self.codes.get(frame.f_code, (None, None))
            if what is not None:
                self.counts.ops[what] += 1
                self.counts.order.append((what, name))
                if what == "meta":
                    f = frame.f_locals
                    if name == "report_versions_sent":
                        self.counts.requests.append(("POST", "versions"))
                    else:
                        self.counts.requests.append((f.get("method", "PUT"), f.get("path", f.get("key"))))
                self.skip = 1
                return
            self.counts.python_calls += 1
            into = Path(frame.f_code.co_filename).name
            self.counts.hottest[(into, frame.f_code.co_name)] += 1
            caller = frame.f_back
            if caller is not None and caller.f_code.co_filename != frame.f_code.co_filename:
                self.counts.entered[(Path(caller.f_code.co_filename).name, into)] += 1
        elif event == "c_call":
            self.counts.c_calls += 1


def _profiled(counts: RankCounts, fn):
    profiler = _Profiler(counts)
    sys.setprofile(profiler)
    try:
        return fn()
    finally:
        sys.setprofile(None)


def measure(layers: int, board: bool = True, extra=None, views=views_of, lease: float | None = 3.0) -> VersionCounts:
    """Counts of one steady version of a Qwen2-shaped model of ``layers`` layers (12 tensors a layer and 3 more),
    after :data:`STEADY_VERSIONS` versions; ``board=False``: no host board (signals over the version channel).
    ``extra(writer)``, if given, is called on the writer's thread in the counted version (a deliberate extra cost,
    to see the guard fail); ``views(module)`` makes each side's views; ``lease``: the writer's ``claim_lease`` (the
    counted version waits until it is granted)."""
    specs = canonical_tensors(dict(CONFIG, num_hidden_layers=layers), dtype="float32")
    sent, got = (module_of({t.name: torch.zeros(t.spec.shape) for t in specs}) for _ in range(2))
    server = start_embedded()
    background: list = []
    request = MetaClient._request

    def recorded(self, method, path, *args, **kwargs):
        name = threading.current_thread().name
        if name.startswith("awex-background"):
            background.append((name, method, path))
        return request(self, method, path, *args, **kwargs)

    create = HostBoard.create
    try:
        MetaClient._request = recorded
        if not board:
            HostBoard.create = staticmethod(_no_board)
        client = MetaClient(server.address, job="steady", timeout=60)
        layout = hf_layout(specs, "trainer", "out")
        writer = WeightsWriter(client, layout, 0, views(sent), timeout=60, claim_lease=lease)
        reader = WeightsReader(
            MetaClient(server.address, job="steady", timeout=60), hf_layout(specs, "inference", "in"), 0, views(got)
        )
        w, r = RankCounts(), RankCounts()
        for step in range(1, STEADY_VERSIONS + 2):
            counted = step == STEADY_VERSIONS + 1
            if counted and lease is not None:
                _lease_held(writer)
            for p in sent.parameters():
                p.data.fill_(float(step))
            writer.flush(), reader.flush()
            background.clear()
            errors: list = []

            def receive(version=f"v{step}", counted=counted):
                try:
                    _profiled(r, lambda: reader.receive(version)) if counted else reader.receive(version)
                except Exception as e:  # raised below
                    errors.append(e)

            thread = threading.Thread(target=receive)
            thread.start()

            def write(version=f"v{step}", counted=counted):
                if counted and extra is not None:
                    extra(writer)
                return writer.write(version, ["in"])

            stats = _profiled(w, write) if counted else write()
            thread.join(60)
            if errors or thread.is_alive():
                raise RuntimeError(f"version v{step} failed: {errors}")
            assert not stats.planned or step == 1, "a steady version planned anew"
            assert all(torch.equal(a, b) for a, b in zip(sent.parameters(), got.parameters())), step
        writer.flush(), reader.flush()
        medium = writer._session.signals.medium
        writer.close(), reader.close()
        return VersionCounts(len(specs), medium, w, r, list(background))
    finally:
        MetaClient._request = request
        HostBoard.create = create
        server.stop()


def _lease_held(writer: WeightsWriter, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not writer._announcer.lease.held:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the writer's claim lease was not granted within {timeout:g} s")
        time.sleep(0.01)


def _no_board():
    raise OSError("no /dev/shm here")


def per_tensor(small: VersionCounts, large: VersionCounts, side: str, what: str) -> float:
    """How much of ``what`` one more tensor costs ``side`` (the slope between the two models)."""
    a, b = getattr(getattr(small, side), what), getattr(getattr(large, side), what)
    return (b - a) / (large.tensors - small.tensors)


if __name__ == "__main__":
    for board in (True, False):
        small, large = measure(3, board), measure(33, board)
        for c in (small, large):
            print(f"{c.tensors} tensors, signals on the {c.medium}; background requests: {c.background}")
            for side in ("writer", "reader"):
                rc = getattr(c, side)
                print(f"  {side}: {rc.python_calls} Python calls, {rc.c_calls} C calls, {dict(rc.ops)}, {rc.requests}")
                print(f"    hottest: {rc.hottest.most_common(8)}")
        for side in ("writer", "reader"):
            py, cc = per_tensor(small, large, side, "python_calls"), per_tensor(small, large, side, "c_calls")
            print(f"per tensor, {side}: {py:.2f} Python calls, {cc:.2f} C calls")
