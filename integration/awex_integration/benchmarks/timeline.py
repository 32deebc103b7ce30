"""Where a steady version's time goes between the processes (``bench_gpu --timeline``): every step of the public path
that :data:`STEPS` names is timed as it runs on each rank (the ranks of one host share its monotonic clock), and the
first trainer rank's and the first receiver's steps are put on one time line per version, from the trainer's call of
``write``, then the median of each step's start and end over the steady versions.

The sub-phases (``WeightsWriter.last_phases``) say how long each part of one rank took; the time line also shows the
gaps between the processes (how long the receiver took to see the manifest, the trainer to see the outcome) and
what a phase hides (a step inside ``done`` that runs after the outcomes arrived). Each wrapped step costs its rank a
few microseconds: a run with ``--timeline`` says where the time goes, not how much there is.
"""

from __future__ import annotations

import functools
import importlib
import statistics
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Sequence

START = "WeightsWriter.write"  # each version's time line starts when the trainer's write does
STEPS = (  # (module, class or None for a module's function, names)
    ("awex.engines.writer", "WeightsWriter", ("write", "_beside")),
    ("awex.engines.writer", None, ("rebound", "confirm_bound")),
    ("awex.engines.reader", "WeightsReader", ("receive", "_admit")),
    ("awex.engines.reader", None, ("rebound", "confirm_bound")),
    ("awex.engines.sync.announcer", "Announcer", ("announce", "report_sent", "confirm", "send_claim")),
    ("awex.engines.sync.board", "HostBoard", ("heads_up", "post", "manifest", "ring", "wait")),
    ("awex.engines.sync.channel", "VersionChannel", ("put", "wait")),
    ("awex.engines.sync.manifest_reading", "ManifestReading", ("fetch_manifest", "_parse", "_adopt")),
    ("awex.engines.sync.session", "SyncSession", ("send", "receive", "transfer", "prepare")),
    ("awex.engines.sync.session", "SyncSession", ("finish", "await_outcomes", "applied")),
    ("awex.engines.sync.peer_link", "SyncPeerLink", ("await_ready", "ready", "meanwhile")),
    ("awex.engines.sync.outcomes", None, ("collect", "report")),
    ("awex.engines.sync.background", "Background", ("submit", "log_line")),
    ("awex.transport.ipc.transport", "IpcTransport", ("run", "_ready")),
    ("awex.transport.ipc.executor", "IpcExecutor", ("run",)),
    ("awex.transport.p2p.transport", "P2pTransport", ("run",)),
    ("awex.transport.pull.base", "PullTransport", ("run",)),
)


class Timeline:
    """The steps of :data:`STEPS`, timed in this process while installed: ``events`` holds ``(step, start, end,
    thread)`` (``time.perf_counter()``). A step that no longer exists (renamed) raises at :meth:`install`."""

    def __init__(self, steps: Sequence = STEPS):
        self.steps = steps
        self.events: list[tuple[str, float, float, str]] = []
        self._undo: list[tuple[object, str, object]] = []

    def install(self) -> None:
        for module, owner, names in self.steps:
            where = importlib.import_module(module)
            if owner is not None:
                where = getattr(where, owner)
            for name in names:
                original = where.__dict__[name] if owner is not None else getattr(where, name)
                step = f"{owner or module.rsplit('.', 1)[-1]}.{name}"
                self._undo.append((where, name, original))
                setattr(where, name, self._timed(original, step))

    def uninstall(self) -> None:
        for where, name, original in reversed(self._undo):
            setattr(where, name, original)
        self._undo.clear()

    def _timed(self, fn, step: str):
        events, clock, current = self.events, time.perf_counter, threading.current_thread

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            began = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                events.append((step, began, clock(), current().name))

        return timed


def merged(trainer: Sequence, receiver: Sequence, skip: int = 1) -> list[dict]:
    """One time line of the first trainer rank's and a receiver's events (each ``(step, start, end, thread)``):
    for each steady version (every :data:`START` but the first ``skip``), every step of the trainer's within its
    write and every step of the receiver's that overlaps it, numbered by its order in the version on its rank;
    then per step, in order of start, the medians over the versions of its start and end in milliseconds from the
    version's start, and in how many versions it ran."""
    sides = [
        (side, sorted(events, key=lambda e: e[1])) for side, events in (("trainer", trainer), ("receiver", receiver))
    ]
    writes = [e for e in sides[0][1] if e[0] == START][skip:]
    rows: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
    for began, ended in ((w[1], w[2]) for w in writes):
        for side, events in sides:
            seen: Counter = Counter()
            for step, start, end, thread in events:
                # a step within the write, or (a receiver's) one it had begun before, as its wait for the manifest
                if start <= ended and end >= began and (side == "receiver" or start >= began):
                    key = (side, step, seen[step], thread)
                    seen[step] += 1
                    rows[key].append(((start - began) * 1e3, (end - began) * 1e3))
    out = [
        {
            "side": side,
            "step": step if n == 0 else f"{step}#{n + 1}",
            "thread": thread,
            "start_ms": round(statistics.median(s for s, _ in spans), 3),
            "end_ms": round(statistics.median(e for _, e in spans), 3),
            "versions": len(spans),
        }
        for (side, step, n, thread), spans in rows.items()
    ]
    return sorted(out, key=lambda r: (r["start_ms"], r["end_ms"]))


def describe(rows: Sequence[dict]) -> str:
    """The time line as lines of text (start, end, length in ms, side and step)."""
    return "\n".join(
        f"    {r['start_ms']:8.3f} {r['end_ms']:8.3f} {r['end_ms'] - r['start_ms']:7.3f}  {r['side']:8s} {r['step']}"
        for r in rows
    )
