"""The one interface every transport implements, and what a transport may ask of the ranks around it.

A :class:`Transport` moves one rank's share of a plan. The sync session (``awex.engines.sync.session``) picks one by
name (:func:`awex.transport.registry.make_transport`), calls :meth:`Transport.prepare` once per plan, then
:meth:`Transport.run` once per version under that version's deadline, and :meth:`Transport.close` at the end.
After a failed version it calls :meth:`Transport.abort` (the next version prepares again).

Transports that need more than the plan talk to their peers through a :class:`PeerLink` the session hands them
per version: *descriptors* published once per plan (CUDA IPC handles, a segment's name, registered memory), and
a per-version *ready* signal from each sender to the receivers that read from it. The session decides where
those go (the MetaServer, the host board, the version channel); transports never see MetaServer keys.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from awex.meta import Plan
from awex.meta.errors import AwexError
from awex.transport.shards import LocalShards

Region = tuple[str, tuple[int, ...], tuple[int, ...]]  # (canonical tensor, offsets, sizes)
RefreshByWave = Callable[[Sequence[Sequence[Region]]], Callable[[int], None]]


class TransferError(AwexError, RuntimeError):
    """A send or receive failed (peer gone, connection closed, backend error)."""


class TransferTimeout(TransferError, TimeoutError):
    """The sync did not finish before its deadline."""


@dataclass
class TransferStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    buckets: int = 0
    waves: int = 0
    staging_bytes: int = 0
    seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds per phase of the whole sync (filled by the writer and reader: ``layouts``, ``devices``, ``plan``,
    ``agreement``, ``group``, ``export``/``open``, ``transfer``, ``done``, ``total``, ...; a steady version's control
    step by step: the writer's ``fingerprint``, ``claim``, ``post`` and ``confirm`` (reading the claim's answer once
    its own part of the transfer is done, while the receivers copy), the reader's ``fingerprint``, ``manifest`` and
    ``ready_wait``)."""
    planned: bool = False
    """This sync planned (and agreed, and set up its transport) anew: the first sync, or one after a change."""
    bytes_dense: int = 0
    """Delta syncs: the bytes a dense sync would have moved for this rank's buckets (0 otherwise)."""
    buckets_resent: int = 0
    """Delta syncs: buckets sent again whole because the receiver's words did not check out."""


class PeerLink(Protocol):
    """What one transport's ranks say to each other in one version (given by the session per version)."""

    count: int  # the writer's count of versions written: the same on every rank, larger for every new attempt
    version: str  # the version's name
    digests: bool  # verify mode: the transport may digest what moves as it moves (Transport.received_digests, ...)

    def publish(self, generation: int, doc: dict[str, Any]) -> None:
        """This rank's descriptor, generation ``generation`` (1, 2, ...: a new one when what it describes
        changed); replaces the one before."""

    def descriptor(self, peer: int, generation: int, deadline: float) -> Any:
        """Sync rank ``peer``'s descriptor of ``generation``, waiting until ``deadline`` (``time.monotonic()``).
        Untrusted: the transport checks it against its own plan before use."""

    def ready(self, generation: int) -> None:
        """A sender: this version's bytes can be read (``generation``: of the descriptor that describes them)."""

    def await_ready(self, peers: Sequence[int], deadline: float) -> list[int]:
        """A receiver: wait until every sender in ``peers`` said this version is ready; their generations."""

    def check_senders(self, peers: Sequence[int]) -> None:
        """A receiver: raise at once if a sender in ``peers`` that runs on this host has exited (across hosts only
        the deadline tells)."""

    def moving(self) -> None:
        """A receiver: bytes start moving into its views now (a failure from here on leaves them partly
        changed; before it, untouched)."""

    def watch(self) -> None:
        """A rank while its bytes are on the wire (p2p: the senders push, no ready signal): raise ``TransferError``
        if a sender it receives from failed the version before sending (it withheld it), or a receiver it sends to
        failed it (it will not take them), so that the wait ends now, not at the deadline. Asks once a call:
        called about once a second."""

    def meanwhile(self) -> None:
        """The session's work beside the transfer (its last checks of this rank's memory): a transport calls it
        once its copies are under way and its thread would only wait for them; the session runs it after the
        transport otherwise. Runs once; never raises (the session raises its failure after the transfer)."""


@dataclass(frozen=True)
class Setup:
    """Where a plan's ranks meet, for transports that build a process group of their own."""

    host: str
    port: int
    deadline: float  # time.monotonic() by which the group must exist
    device: Any = None  # torch.device of this rank's views
    rendezvous: tuple = ()  # what identifies the meeting: a group is reused while it is the same
    delta: bool = False  # p2p: buckets as the words changed since the last version (awex.transport.delta)
    delta_budget_bytes: int | None = None  # a delta sender: what it may keep of the last version (None: all)
    # ipc receivers of plans that quantise on receive: quantize([(source, fp8 out, scale_inv out)], block) -> run()
    quantize: Any = None
    job: str = ""  # the job the ranks sync in (its MetaServer's): what shared-memory segments are sealed for
    secret: str = ""  # p2p: what every member of the sync group proves it holds (awex.transport.group_auth)


class Transport(ABC):
    """One rank's side of a transport. Implementations: ``p2p`` (NCCL/gloo), ``ipc`` (CUDA IPC), ``shm`` (host
    shared memory), ``rdma`` (Mooncake's transfer engine)."""

    name: ClassVar[str]
    signals_ready: ClassVar[bool] = True
    """Senders say per version that their bytes are ready (receivers read): the session must give it a link."""

    @abstractmethod
    def prepare(self, plan: Plan, rank: int, setup: Setup, phases: MutableMapping[str, float]) -> None:
        """Get ready to run ``plan`` as sync rank ``rank`` (called when the plan or its rendezvous changed)."""

    @abstractmethod
    def run(
        self,
        shards: LocalShards,
        link: PeerLink,
        deadline: float,
        phases: MutableMapping[str, float],
        refresh_by_wave: RefreshByWave | None = None,
    ) -> TransferStats:
        """Move this rank's share of one version between ``shards`` (the engine's own views, in place) and its
        peers before ``deadline`` (``time.monotonic()``); seconds per phase
        go to ``phases`` (``ready_wait``, ``open``, ``executor``, ``transfer``, ...). ``refresh_by_wave`` only where
        :attr:`refreshes_by_wave`."""

    refreshes_by_wave: ClassVar[bool] = False
    """A sender may derive each wave's bytes just before it is sent (FP8 quantised on the fly)."""
    carries_delta: ClassVar[bool] = False
    """Buckets may travel as the 16-bit words that changed since the last version (``Setup.delta``)."""
    quantizes_on_receive: ClassVar[bool] = False
    """Receivers may quantise to FP8 as they copy (``Setup.quantize``)."""
    needs_cuda: ClassVar[bool] = False
    """Every rank's views are CUDA memory."""

    def applied(self) -> None:
        """A sender, once every receiver applied a version (release what only the first version needed)."""

    def received_digests(self) -> dict[int, tuple[int, int]] | None:
        """A receiver in verify mode (``PeerLink.digests``), after :meth:`run`: per origin sync rank, the digest
        (``awex.transport.digest``) of what the run wrote into its views, where the transport took it as it
        copied; once per run. ``None``: the caller digests the views itself."""
        return None

    def sent_digests(self) -> dict[int, tuple[int, int]] | None:
        """A sender in verify mode (``PeerLink.digests``), after :meth:`run`: per receiving sync rank, the digest of
        the regions this rank originates for it (``awex.meta.origins``), where the transport took it while the
        bytes moved; once per run. ``None``: the caller digests the views itself."""
        return None

    @property
    def held_bytes(self) -> int:
        """Bytes of buffers this transport keeps between versions."""
        return 0

    @abstractmethod
    def let_go(self) -> None:
        """Between versions, where the writer asked (``hold_trainer_memory=False``: its trainer frees the memory after
        a version, offloading its weights): drop what holds the rank's views or another process's memory beyond the
        version (exports, opened mappings, executors, staging areas built over them). The plan stays; the next
        version builds them anew, as after memory that moved."""

    @abstractmethod
    def abort(self) -> None:
        """After a failed version: drop what may be broken (a group with a dead peer); keep what stays valid
        (descriptors and their generations, so peers never mistake an old one for a new one)."""

    @abstractmethod
    def close(self) -> None:
        """Release everything this rank holds (idempotent); never waits for peers."""

    def _prepared(self, state: Any) -> Any:
        """``state`` (what :meth:`prepare` left for :meth:`run`), or the error for a run before prepare."""
        if state is None:
            raise RuntimeError(f"{type(self).__name__}.run before prepare")
        return state


@contextmanager
def timed(phases: MutableMapping[str, float], name: str) -> Iterator[None]:
    """Add the seconds the block takes to ``phases[name]``."""
    started = time.perf_counter()
    try:
        yield
    finally:
        phases[name] = phases.get(name, 0.0) + time.perf_counter() - started
