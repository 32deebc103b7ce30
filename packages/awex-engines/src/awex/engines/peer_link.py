"""What a transport says to its peers in one version (:class:`awex.transport.base.PeerLink`), over what the sync
session has: descriptors through the MetaServer (``awex.engines.keys.descriptor``), ready signals where every
rank of the sync can take them (the host board, the version channel, or the MetaServer)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from awex.engines import keys
from awex.engines.board import host_identity
from awex.engines.manifest import SyncManifest
from awex.meta import Plan
from awex.transport.base import TransferError
from awex.transport.segments import alive

if TYPE_CHECKING:
    from awex.engines.session import SyncSession

LIVENESS_SECONDS = 1.0  # a receiver waiting for senders checks this often that those on its host still run


@dataclass
class PeerLinkOfSession:
    session: SyncSession
    manifest: SyncManifest
    plan: Plan
    rank: int

    @property
    def count(self) -> int:
        return self.manifest.seq

    def _key(self, rank: int, generation: int) -> str:
        r = self.plan.ranks[rank]
        return keys.descriptor(self.session.transport, r.instance, r.local_rank, generation)

    def publish(self, generation: int, doc: dict) -> None:
        client = self.session.client
        client.put(self._key(self.rank, generation), doc)
        if generation > 1:  # every receiver of the earlier versions is done with the one before
            client.delete(self._key(self.rank, generation - 1))

    def descriptor(self, peer: int, generation: int, deadline: float) -> Any:
        return self.session.client.get(self._key(peer, generation), timeout=max(0.1, deadline - time.monotonic()))

    def ready(self, generation: int) -> None:
        self.session._ring_ready(self.session.transport, self.manifest, self.plan.ranks[self.rank], generation)

    def moving(self) -> None:
        self.session.touched = True

    def _ready_key(self, peer: int) -> str:
        src = self.plan.ranks[peer]
        return keys.ready(
            self.session.transport, self.manifest.version, self.manifest.seq, src.instance, src.local_rank
        )

    def _wait(self, peers: list[int], timeout: float) -> list:
        s = self.session
        if s.signals == "board":
            return s.board.wait(peers, self.manifest.seq, timeout)
        if s.signals == "channel":
            return s.channel.wait([self._ready_key(p) for p in peers], timeout)
        return [s.client.get(self._ready_key(p), timeout=timeout) for p in peers]

    def await_ready(self, peers: Sequence[int], deadline: float) -> list[int]:
        """Wait until every sender in ``peers`` said this version is ready (before ``deadline``); their generations.
        Every second it checks that the senders on this host still run: one that exited fails the wait at once
        instead of at the deadline (across hosts only the deadline tells)."""
        peers = list(peers)
        while True:
            left = deadline - time.monotonic()
            try:
                generations = self._wait(peers, max(0.001, min(LIVENESS_SECONDS, left)))
                break
            except TimeoutError:
                if left <= LIVENESS_SECONDS:
                    raise
                self.check_senders(peers)
        for peer, generation in zip(peers, generations):
            if not isinstance(generation, int) or isinstance(generation, bool) or generation < 1:
                raise ValueError(f"{self._ready_key(peer)}: {generation!r} is not an export generation")
        return list(generations)

    def check_senders(self, peers: Sequence[int]) -> None:
        """Raise if a sender in ``peers`` that runs on this host has exited."""
        s, here = self.session, host_identity()
        for peer in peers:
            src = self.plan.ranks[peer]
            host, pid, started = s._processes.get((src.instance, src.local_rank), (None, 0, None))
            if host == here and started is not None and not alive(pid, started):
                raise TransferError(
                    f"{s.instance}:{s.local_rank}: sender {src.instance}:{src.local_rank} (pid {pid}, this host) "
                    f"exited before its part of version {self.manifest.version!r} arrived"
                )
