"""What a transport says to its peers in one version (:class:`awex.transport.base.PeerLink`): descriptors through
the MetaServer (``awex.engines.sync.keys.descriptor``), ready signals through the plan's
:class:`~awex.engines.sync.signals.Signals`. Built per version from ``(plan, rank, signals)``; nothing here reads
a sync session."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from awex.engines.outcome import Outcome
from awex.engines.sync import keys
from awex.engines.sync.board import host_identity
from awex.engines.sync.manifest import SyncManifest
from awex.engines.sync.signals import WITHHELD, Signals
from awex.meta import Plan, RankDescriptor
from awex.meta.client import MetaClient
from awex.meta.errors import AwexValueError
from awex.transport.base import TransferError
from awex.transport.pull.segments import alive

LIVENESS_SECONDS = 1.0  # a receiver waiting for senders checks this often that those on its host still run

Process = tuple[str, int, "int | None"]  # (host, pid, start time) of a rank, as the device exchange found it


def exited_here(processes: Mapping[tuple[str, int], Process], instance: str, local_rank: int) -> int | None:
    """The pid of rank ``instance:local_rank`` if it ran on this host and has exited (its pid gone, or reused by a
    process that started later); ``None`` while it runs, or where this host cannot tell (another host)."""
    host, pid, started = processes.get((instance, local_rank), (None, 0, None))
    if host == host_identity() and started is not None and not alive(pid, started):
        return pid
    return None


@dataclass
class SyncPeerLink:
    """One rank's link to its peers for one version of one plan over transport ``kind``."""

    plan: Plan
    rank: int
    signals: Signals
    client: MetaClient
    manifest: SyncManifest
    kind: str  # the transport's name
    processes: Mapping[tuple[str, int], Process]  # where each rank of the plan runs (liveness checks)
    touched: bool = False  # a receiver: bytes began moving into its views
    beside: Callable[[], None] | None = None  # the session's work while the bytes move (see meanwhile)
    beside_error: Exception | None = None  # what it raised: the version fails once the transfer ended
    _senders: list[int] | None = field(default=None, repr=False)  # the ranks it receives from (watch)
    _receivers: list[int] = field(default_factory=list, repr=False)  # and those it sends to

    @property
    def count(self) -> int:
        return self.manifest.seq

    @property
    def version(self) -> str:
        return self.manifest.version

    @property
    def digests(self) -> bool:
        return self.manifest.options.verify

    def _key(self, rank: int, generation: int) -> str:
        r = self.plan.ranks[rank]
        return keys.descriptor(self.kind, r.instance, r.local_rank, generation)

    def publish(self, generation: int, doc: dict) -> None:
        self.client.put(self._key(self.rank, generation), doc)
        if generation > 1:  # every receiver of the earlier versions is done with the one before
            self.client.delete(self._key(self.rank, generation - 1))

    def descriptor(self, peer: int, generation: int, deadline: float) -> Any:
        return self.client.get(self._key(peer, generation), timeout=max(0.1, deadline - time.monotonic()))

    def ready(self, generation: int) -> None:
        self.signals.ready(self.kind, self.manifest, self.plan.ranks[self.rank], generation)

    def moving(self) -> None:
        self.touched = True

    def meanwhile(self) -> None:
        work, self.beside = self.beside, None
        if work is not None:
            try:
                work()
            except Exception as e:  # raised by the session after the transfer (the copies under way end first)
                self.beside_error = e

    def await_ready(self, peers: Sequence[int], deadline: float) -> list[int]:
        """Wait until every sender in ``peers`` said this version is ready (before ``deadline``); their generations.
        Every second it checks that the senders on this host still run: one that exited fails the wait at once
        instead of at the deadline (across hosts only the deadline tells)."""
        senders = [self.plan.ranks[p] for p in peers]
        while True:
            left = deadline - time.monotonic()
            try:
                generations = self.signals.wait_ready(
                    self.kind, self.manifest, senders, max(0.001, min(LIVENESS_SECONDS, left))
                )
                break
            except TimeoutError:
                if left <= LIVENESS_SECONDS:
                    raise
                self.check_senders(peers)
        for src, generation in zip(senders, generations):
            if generation == WITHHELD:
                raise self._withheld(src, "; nothing moved into this rank")
            if not isinstance(generation, int) or isinstance(generation, bool) or generation < 1:
                raise AwexValueError(
                    f"ready signal of {src.instance}:{src.local_rank} for {self.manifest.version!r}: {generation!r} "
                    "is not an export generation"
                )
        return list(generations)

    def watch(self) -> None:
        """:meth:`awex.transport.base.PeerLink.watch`: the senders this rank receives from (its schedule's, worked
        out at the first call) that withheld the version, or exited on this host, fail it now; so do the receivers
        it sends to that failed the version (their failures are on the MetaServer: one request), or exited."""
        if self._senders is None:
            steps = self.plan.schedule(self.rank)  # a broadcast's root among them
            peers = {s.peer for s in steps if s.op == "recv"} | {s.bucket.src for s in steps}
            self._senders = sorted(peers - {self.rank})
            self._receivers = sorted({s.peer for s in steps if s.op == "send"} - {self.rank})
        senders = [self.plan.ranks[p] for p in self._senders]
        for src in self.signals.withheld(self.kind, self.manifest, senders) if senders else ():
            raise self._withheld(src)
        self.check_senders(self._senders)
        if self._receivers and self.client is not None:
            self._check_receivers()

    def _withheld(self, src: RankDescriptor, more: str = "") -> TransferError:
        return TransferError(
            f"the bytes of version {self.manifest.version!r} from sender {src.instance}:{src.local_rank} were "
            "withheld: a trainer rank (this sender, or the one that relays its signals) failed the version before "
            f"they were ready (the trainers' logs say why){more}"
        )

    def _check_receivers(self) -> None:
        v, seq = self.manifest.version, self.manifest.seq
        said = self.client.values(keys.attempt_outcomes(self.manifest.attempt.name))
        for peer in self._receivers:
            r = self.plan.ranks[peer]
            key = keys.outcome(v, seq, r.instance, r.local_rank)
            doc = said.get(key) if said is not None else self.client.try_get(key)  # None: it said nothing yet
            if doc is not None and not (outcome := Outcome.from_wire(doc)).ok:
                raise TransferError(f"receiver {r.instance}:{r.local_rank} failed version {v!r}: {outcome.cause}")
        self._exited(self._receivers, "receiver", f"while its part of version {v!r} moved")

    def check_senders(self, peers: Sequence[int]) -> None:
        """Raise if a sender in ``peers`` that runs on this host has exited."""
        self._exited(peers, "sender", f"before its part of version {self.manifest.version!r} arrived")

    def _exited(self, peers: Sequence[int], role: str, when: str) -> None:
        me = self.plan.ranks[self.rank]
        for peer in peers:
            r = self.plan.ranks[peer]
            pid = exited_here(self.processes, r.instance, r.local_rank)
            if pid is not None:
                raise TransferError(
                    f"{me.instance}:{me.local_rank}: {role} {r.instance}:{r.local_rank} (pid {pid}, this host) exited "
                    f"{when}"
                )
