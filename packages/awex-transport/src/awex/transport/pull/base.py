"""Transports whose receivers pull: a sender stages each version where its receivers can read it (a shared-memory
segment, a registered buffer) and says ready; each receiver reads its own ranges and copies them into its views.

:class:`PullTransport` keeps what such transports share: a new staging area per plan, described to the receivers
under a new generation (so a receiver never reads a stale one: a restarted or re-planned sender publishes a new
generation), receivers that reopen when any of their senders' generations changed, and the release of both sides.
Subclasses (``shm``, ``rdma``) say how a sender and a receiver are built and how one version moves.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping, MutableMapping
from typing import Any, Protocol

from awex.meta import Plan
from awex.transport.base import PeerLink, RefreshByWave, Setup, TransferStats, Transport, timed
from awex.transport.shards import LocalShards


class StagingSender(Protocol):
    def wire(self) -> dict[str, Any]:
        """The descriptor receivers open (plain data, checked on arrival)."""

    def close(self) -> None: ...


class StagingReceiver(Protocol):
    """A receiver may also have ``rebind(shards)``: copy into new views out of the areas it has open (when the
    engine re-allocated its weights); without it, the areas are opened again."""

    def close(self) -> None: ...


class PullTransport(Transport):
    """One rank's side of a pull transport: the staging area and its generation (sender) or the opened senders
    (receiver), rebuilt when the plan changes."""

    def __init__(self) -> None:
        self.sender: Any = None
        self.receiver: Any = None
        self.generation = 0  # of this rank's staging area: a new one per plan
        self.plan: Plan | None = None  # what the staging area or the receiver was built for
        self._built_from: LocalShards | None = None  # and from which views
        self.opened: dict[int, int] = {}  # a receiver's senders -> generation opened
        self._next: tuple[Plan, int] | None = None
        self._senders: list[int] = []
        self.job = ""  # the job the plan's ranks sync in (Setup.job)

    def prepare(self, plan: Plan, rank: int, setup: Setup, phases: MutableMapping[str, float]) -> None:
        self._next = (plan, rank)
        self.job = setup.job
        self._senders = sorted({s.peer for s in plan.schedule(rank) if s.op == "recv"})

    @abstractmethod
    def _new_sender(self, plan: Plan, rank: int, shards: LocalShards) -> StagingSender:
        """This rank's staging area for ``plan`` (its descriptor is published once, under a new generation)."""

    @abstractmethod
    def _send(self, link: PeerLink, deadline: float, phases: MutableMapping[str, float]) -> TransferStats:
        """Stage one version in :attr:`sender`'s area and say ready (``link.ready(self.generation)``)."""

    @abstractmethod
    def _descriptor(self, wire: Any, plan: Plan, sender: int) -> Any:
        """Sender ``sender``'s published descriptor, checked against ``plan`` (a clear error if it does not fit)."""

    @abstractmethod
    def _new_receiver(
        self, plan: Plan, rank: int, shards: LocalShards, descriptors: Mapping[int, Any]
    ) -> StagingReceiver:
        """This rank's reads of its senders' staging areas for ``plan``."""

    @abstractmethod
    def _receive(self, link: PeerLink, deadline: float) -> TransferStats:
        """Pull one version with :attr:`receiver` (the senders said ready)."""

    def run(
        self,
        shards: LocalShards,
        link: PeerLink,
        deadline: float,
        phases: MutableMapping[str, float],
        refresh_by_wave: RefreshByWave | None = None,
    ) -> TransferStats:
        plan, rank = self._prepared(self._next)
        if plan.ranks[rank].role.value == "trainer":
            # a new staging area per plan, and for views of memory that moved (the writer re-bound them): its new
            # generation makes every receiver open it afresh
            if self.sender is None or self.plan is not plan or self._built_from is not shards:
                with timed(phases, "executor"):
                    self._release()
                    self.sender, self.plan, self._built_from = self._new_sender(plan, rank, shards), plan, shards
                    self.generation += 1
                    link.publish(self.generation, self.sender.wire())
            return self._send(link, deadline, phases)
        senders = self._senders
        with timed(phases, "ready_wait"):  # until every sender said this version's bytes are ready
            generations = link.await_ready(senders, deadline)
        with timed(phases, "open"):
            reopen = self.receiver is None or self.plan is not plan
            reopen = reopen or any(self.opened.get(p) != g for p, g in zip(senders, generations))
            if not reopen and self._built_from is not shards:  # the engine re-allocated its weights
                if callable(getattr(self.receiver, "rebind", None)):
                    self.receiver.rebind(shards)  # the same senders' areas, copies into the new views
                    self._built_from = shards
                else:
                    reopen = True
            if reopen:
                descriptors = {
                    peer: self._descriptor(link.descriptor(peer, generation, deadline), plan, peer)
                    for peer, generation in zip(senders, generations)
                }
                self._release()
                self.receiver, self.plan = self._new_receiver(plan, rank, shards, descriptors), plan
                self._built_from = shards
                self.opened = dict(zip(senders, generations))
        link.moving()
        with timed(phases, "transfer"):
            return self._receive(link, deadline)

    def abort(self) -> None:
        """A failed version: a receiver opens its senders again next time (one may have restarted with a new
        staging area); a sender keeps its area and generation."""
        if self.receiver is not None:
            self._release()
        self._next = None

    def let_go(self) -> None:
        """Both sides: the staging area or the opened ones, and the views they were built from (the next version
        stages under a new generation, and receivers open it)."""
        self._release()
        self._built_from = None

    def close(self) -> None:
        self._release()
        self._next = None

    def _release(self) -> None:
        for side in (self.sender, self.receiver):
            if side is not None:
                side.close()
        self.sender = self.receiver = self.plan = None
        self.opened = {}
