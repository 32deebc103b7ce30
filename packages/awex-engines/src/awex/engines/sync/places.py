"""Where a sync's ranks run: each rank publishes its device, the devices it reaches, its host and process through
the MetaServer, per attempt at a version (an engine restarted elsewhere never leaves a stale answer), and reads
everyone's. Plans for CUDA IPC take from the same GPU; ``auto`` chooses the transport from it; shared memory is
refused across hosts; a receiver notices a sender on its host that exited."""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from awex.engines.errors import SyncFailedError
from awex.engines.outcome import Outcome
from awex.engines.sync import keys
from awex.engines.sync.board import host_identity
from awex.engines.sync.manifest import SyncManifest
from awex.meta import Layout
from awex.meta.client import MetaClient, MetaTimeoutError
from awex.meta.errors import AgreementAbortedError, AwexValueError
from awex.transport.pull.segments import SEGMENT_DIR, start_time

log = logging.getLogger("awex.engines")

# a rank waiting for another's record checks this often whether it failed meanwhile (a rank that fails gives the
# gather up and every rank learns it at once: this is for a give-up that did not arrive)
WAIT_SLICE_SECONDS = 10.0


@dataclass
class Places:
    """What the ranks of one attempt published."""

    devices: list[tuple[str, int, str]] = field(default_factory=list)  # (instance, local rank, host/GPU-uuid)
    reach: dict[tuple[str, int], list[str]] = field(default_factory=dict)  # devices each CUDA rank reads
    hosts: set[str] = field(default_factory=set)
    processes: dict[tuple[str, int], tuple[str, int, int | None]] = field(default_factory=dict)  # host, pid, start
    shm_ok: bool = False  # every rank a CPU rank copying in place, all on one host with a writable /dev/shm
    signals: str = "meta"  # where per-version signals go: what every rank can use ("board", "channel", "meta")


def physical_device(device: Any) -> str | None:
    """A CUDA device as ``host/GPU-uuid``; ``None`` for other devices (or without a uuid: then plans just do not
    prefer the same GPU)."""
    if getattr(device, "type", "cpu") != "cuda":
        return None
    import torch

    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return f"{socket.gethostname()}/GPU-{uuid}" if uuid is not None else None


def reachable_devices(device: Any, mine: str | None) -> tuple[str, ...]:
    """The devices (``host/GPU-uuid``) whose memory a rank on ``device`` (``mine``) can read over CUDA IPC: its own
    and every GPU visible in this process with peer access from it. A process that sees one GPU
    (``CUDA_VISIBLE_DEVICES``) reaches only its own."""
    if not mine or getattr(device, "type", "cpu") != "cuda":
        return (mine,) if mine else ()
    import torch

    host = mine.split("/", 1)[0]
    out = [mine]
    for i in range(torch.cuda.device_count()):
        other = torch.device("cuda", i)
        if other.index == device.index or not torch.cuda.can_device_access_peer(device, other):
            continue
        uuid = getattr(torch.cuda.get_device_properties(other), "uuid", None)
        if uuid is not None:
            out.append(f"{host}/GPU-{uuid}")
    return tuple(out)


@dataclass(frozen=True)
class DeviceRecord:
    """Where one rank of an attempt runs and what it can do, as it publishes it (once per plan): ``device`` its GPU
    (``host/GPU-uuid``; empty where it cannot copy in place or is not on a GPU), the GPUs it ``reach``es over CUDA
    IPC, its host and process, whether it is a CPU rank, has a writable ``/dev/shm`` and copies in place, and the
    per-version ``signals`` it can take (``board``, ``channel``)."""

    device: str = ""
    reach: tuple[str, ...] = ()
    host: str = ""
    pid: int | None = None
    started: int | None = None
    cpu: bool = False
    shm: bool = False
    in_place: bool = False
    signals: tuple[str, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        return {
            **{f.name: getattr(self, f.name) for f in fields(self)},
            "reach": list(self.reach),
            "signals": list(self.signals),
        }

    @classmethod
    def from_wire(cls, doc: Any) -> DeviceRecord:
        """Another rank's record, untrusted: a field of the wrong type takes its default (which claims nothing: no
        device, no shared memory, no signals but the MetaServer); a bare string is a device (older records)."""
        if not isinstance(doc, dict):
            return cls(device=doc) if isinstance(doc, str) and len(doc) <= 1024 else cls()

        def text(v: Any) -> bool:
            return isinstance(v, str) and len(v) <= 1024

        def whole(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def texts(v: Any) -> tuple[str, ...]:
            return tuple(v) if isinstance(v, list) and len(v) <= 4096 and all(text(x) for x in v) else ()

        return cls(
            device=doc["device"] if text(doc.get("device")) else "",
            reach=texts(doc.get("reach")),
            host=doc["host"] if text(doc.get("host")) else "",
            pid=doc["pid"] if whole(doc.get("pid")) else None,
            started=doc["started"] if whole(doc.get("started")) else None,
            cpu=doc.get("cpu") is True,
            shm=doc.get("shm") is True,
            in_place=doc.get("in_place") is True,
            signals=texts(doc.get("signals")),
        )


def describe(device: Any, mine: str, reach: Sequence[str], in_place: bool, signals: Sequence[str]) -> DeviceRecord:
    """This rank's record: ``mine`` its device (empty where it cannot copy in place or is not on a GPU)."""
    pid = os.getpid()
    return DeviceRecord(
        device=mine,
        reach=tuple(reach),
        host=host_identity(),
        pid=pid,
        started=start_time(pid),
        cpu=getattr(device, "type", "cpu") == "cpu",
        shm=SEGMENT_DIR.is_dir() and os.access(SEGMENT_DIR, os.W_OK),
        in_place=bool(in_place),
        signals=tuple(signals),
    )


def exchange(
    client: MetaClient,
    attempt: str,
    me: tuple[str, int],
    mine: DeviceRecord,
    names: Sequence[str],
    layouts: dict[str, Layout],
    deadline: float,
) -> Places:
    """Contribute ``mine`` as rank ``me``'s record of ``attempt`` (``<version>/<count>``) and read every rank's of the
    instances ``names`` (waiting until ``deadline``): one gather on the MetaServer, one request per rank (a rank
    reading every other's record took N requests each). Records are untrusted (:meth:`DeviceRecord.from_wire`).
    A rank that failed the attempt before contributing (it reported its outcome: a receiver that refused the
    manifest) fails the wait at once with :class:`SyncFailedError`, instead of at the deadline."""
    everyone = [(name, rank) for name in names for rank in range(layouts[name].world_size)]
    records = _gather(client, attempt, me, mine.to_wire(), len(everyone), deadline)
    found = Places()
    common = {"board", "channel"}
    cpu_in_place = True
    for name, rank in everyone:
        if (name, rank) == tuple(me):
            got = mine  # this rank's own, as it gave it
        elif f"{name}:{rank}" in records:
            got = DeviceRecord.from_wire(records[f"{name}:{rank}"])
        else:
            raise AwexValueError(
                f"the device records of {attempt} have none of {name}:{rank} (another rank took its place)"
            )
        common &= set(got.signals)
        found.hosts.add(got.host)
        if got.pid is not None:
            found.processes[(name, rank)] = (got.host, got.pid, got.started)
        cpu_in_place &= got.cpu and got.in_place and got.shm
        if got.device:
            found.devices.append((name, rank, got.device))
            found.reach[(name, rank)] = list(got.reach)
    found.shm_ok = cpu_in_place and len(found.hosts) == 1
    found.signals = "board" if "board" in common else "channel" if "channel" in common else "meta"
    return found


def _gather(client: MetaClient, attempt: str, me: tuple[str, int], doc: dict, expected: int, deadline: float) -> dict:
    """Every rank's device record of ``attempt`` by ``instance:rank``, waiting until ``deadline`` in slices; between
    them, the attempt's reported outcomes: a failure one reported ends the wait."""
    while True:
        left = deadline - time.monotonic()
        try:
            return client.gather(
                keys.devices_gather(attempt),
                f"{me[0]}:{me[1]}",
                expected,
                doc,
                timeout=max(0.1, min(WAIT_SLICE_SECONDS, left)),
            )
        except AgreementAbortedError as e:  # a rank failed the attempt first (abandon)
            raise given_up(attempt, e) from None
        except MetaTimeoutError:
            if left <= WAIT_SLICE_SECONDS:
                raise
        for key in client.keys(keys.attempt_outcomes(attempt)):
            doc = client.try_get(key)
            if isinstance(doc, dict) and doc.get("ok") is False:
                outcome = Outcome.from_wire(doc)
                raise failed_by(attempt, key.rsplit("/", 1)[1], str(outcome.cause), outcome.partial)


def abandon(client: MetaClient, manifest: SyncManifest, who: tuple[str, int], cause: str | None) -> None:
    """Rank ``who`` failed ``manifest``'s attempt: give up its device gather and plan agreement, so that every rank
    waiting in either fails at once naming it (not at its deadline). A complete one is final: nothing changes there.
    Never raises (the failure's own error is what the caller must see)."""
    for name in (keys.devices_gather(manifest.attempt.name), keys.plan_agreement(manifest.version, manifest.seq)):
        try:
            client.abort_agreement(name, f"{who[0]}:{who[1]}", cause or "failed")
        except Exception as e:  # the others' wait checks the attempt's outcomes too
            log.debug("%s:%d could not give up %s: %s", *who, name, e)


def given_up(attempt: str, e: AgreementAbortedError) -> SyncFailedError:
    """The error of a rank whose device gather or plan agreement another rank gave up (:func:`abandon`)."""
    return failed_by(attempt, e.by, e.cause, partial=False)


def failed_by(attempt: str, who: str, cause: str, partial: bool) -> SyncFailedError:
    """``attempt`` (``<version>/<count>``) failed because rank ``who`` (``instance:rank``) did, with ``cause``."""
    instance, _, rank = who.rpartition(":")
    failed = {(instance, int(rank) if rank.isdigit() else -1): Outcome.failed(cause, partial)}
    return SyncFailedError(attempt.rpartition("/")[0], failed)
