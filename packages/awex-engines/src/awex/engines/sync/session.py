"""One sync between named engine instances: what a rank keeps between versions (the steady-state cache).

Per weight version the trainer's first rank publishes a :class:`~awex.engines.sync.manifest.SyncManifest` (which
instances send and receive, where the sync group meets, wave size, deadline). Every rank of every instance then
fetches the manifest and the layouts, computes the plan itself, and proves through the MetaServer that all ranks
computed the same plan before any byte moves. Plans, process groups, staging buffers and every copy's views are built
once and reused while the manifest's layouts and rendezvous do not change (steady state). The session picks a
transport (``awex.transport.registry``) and drives it. A version's route through a rank is one call, from its
manifest to the outcomes: :meth:`SyncSession.send` (a trainer rank) or :meth:`SyncSession.receive`. Where a rank
reads manifests is in :mod:`awex.engines.sync.manifest_reading`, where ranks run in :mod:`awex.engines.sync.places`,
what a transport says to its peers in :mod:`awex.engines.sync.peer_link`, every MetaServer key in
:mod:`awex.engines.sync.keys`.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from awex.engines.outcome import all_applied
from awex.engines.sync import keys, outcomes, places
from awex.engines.sync.board import HostBoard
from awex.engines.sync.channel import VersionChannel
from awex.engines.sync.device_places import DevicePlaces
from awex.engines.sync.fp8_sender import Fp8Sender
from awex.engines.sync.manifest import Attempt, SyncManifest, group_secret
from awex.engines.sync.manifest_reading import ManifestReading
from awex.engines.sync.peer_link import SyncPeerLink
from awex.engines.sync.phases import Phases
from awex.engines.sync.relay import HostGroups, HostRelay
from awex.engines.sync.relayed import with_relays
from awex.engines.sync.signals import Signals, signals_for
from awex.engines.sync.verify import Verifier
from awex.engines.sync.version_plan import PlanKey, fp8_quantizer, plan_version
from awex.meta import Fp8BlockQuant, Layout, Plan
from awex.meta.client import MetaClient
from awex.meta.errors import AgreementAbortedError, AwexValueError
from awex.transport import LocalShards
from awex.transport.base import Setup, TransferStats, Transport
from awex.transport.registry import make_transport

Region = tuple[str, tuple[int, ...], tuple[int, ...]]  # (canonical tensor, offsets, sizes)

log = logging.getLogger("awex.engines")


@dataclass(frozen=True)
class Sent:
    """What one version's route left a trainer rank (:meth:`SyncSession.send`): its stats, every receiving rank's
    outcome (``None``: did not report by the deadline), and what the writer reports and logs."""

    stats: TransferStats
    outcomes: outcomes.Outcomes
    plan: Plan
    transport: str
    medium: str | None  # where the version's signals went ("board", "channel", "meta")
    line: str  # the version's log line


@dataclass(frozen=True)
class Received:
    """What one version's route left a receiving rank (:meth:`SyncSession.receive`)."""

    stats: TransferStats
    manifest: SyncManifest
    line: str  # the version's log line


@dataclass
class SyncSession(ManifestReading, DevicePlaces):
    """One rank's side of the sync: caches what does not change between versions.

    Layouts are fetched once per session: an engine whose layout changes (resharding, a new instance) makes a
    new writer or reader.
    """

    client: MetaClient
    instance: str
    local_rank: int
    _key: PlanKey | None = None
    _plan: Plan | None = None
    planned: bool = False  # the last sync planned anew (first sync, or after a change)
    device: object = None  # torch.device of this rank's views: cuda -> NCCL, cpu -> gloo
    _layouts: dict[str, Layout] = field(default_factory=dict)
    _transports: dict[str, Transport] = field(default_factory=dict)  # made once per name, kept while open
    device_key: str | None = None  # physical device ("host/GPU-uuid"); from `device` when None and on CUDA
    transport: str | None = None  # what the current plan runs on (the manifest's, or auto's choice)
    send_quant: Fp8BlockQuant | None = None  # what the current plan has the trainers quantise (version_plan.Planned)
    sent_shards: LocalShards | None = None  # what this rank's last transfer moved (a quantising sender: FP8 views)
    device_reach: tuple[str, ...] | None = None  # devices this rank reads over CUDA IPC; found out when None
    closed: bool = False
    phases: Phases = field(default_factory=Phases)  # seconds per phase of the last transfer
    channel: VersionChannel | None = None  # the sync's version channel (per-version signals), once known
    board: HostBoard | None = None  # the sync's host board, when this rank is on the writer's host
    signals: Signals | None = None  # where this plan's per-version signals go (awex.engines.sync.signals)
    relay: HostRelay | None = None  # this rank's part in its host's relays (awex.engines.sync.relay), by plan
    host_groups: HostGroups | None = None  # the plan's ranks by host, over the version channel
    delta_budget_bytes: int | None = None  # a sender of delta syncs: what it may keep of the last version
    _signals: str = "meta"  # what every rank can use, as the last device exchange found
    _parsed: tuple[dict, SyncManifest] | None = None  # the last manifest read (with version and count blanked)
    _link: SyncPeerLink | None = None  # the last transfer's link to its peers
    _last_attempt: Attempt | None = None  # the last attempt this rank took part in
    _processes: dict[tuple[str, int], tuple[str, int, int | None]] = field(default_factory=dict)  # of the plan's ranks
    _verifier: Verifier | None = None  # verify mode, made at its first version
    attempt: SyncManifest | None = None  # the manifest of the version this rank is inside (None between versions)

    def close(self) -> None:
        """End this rank's part in syncing (idempotent): drop the plan and every transport's state (executors,
        staging, segments, other processes' memory opened over CUDA IPC: a receiver must close or exit before the
        trainers whose memory it opened). A sync group is dropped, not shut down (that is collective)."""
        if self.closed:
            return
        self.closed = True
        self._plan = self._key = self.channel = None
        if self.board is not None and not self.board.owner:
            self.board.close()
        if self.relay is not None:
            self.relay.close()
        self.board = self.relay = None
        transports, self._transports = list(self._transports.values()), {}
        for transport in transports:
            transport.close()
        gc.collect()  # views into opened memory may sit in reference cycles (executors' closures)

    def held_bytes(self) -> int:
        """Bytes of buffers this rank keeps between syncs (p2p staging, CUDA IPC bounce rings), read from them."""
        return sum(t.held_bytes for t in self._transports.values())

    def steady_for(self, manifest: SyncManifest) -> bool:
        """Whether ``manifest`` needs nothing new: the same rendezvous, wave size and casts as the plan in use."""
        return self._plan is not None and self._key is not None and self._key.same_options(manifest)

    def note_failure(self, manifest: SyncManifest | None) -> None:
        """This rank failed ``manifest``'s attempt: forget the plan and group (:meth:`reset`), and do not take that
        attempt's manifest again. Without a manifest no attempt began on this rank: plan and group stay, as the
        other side keeps them (dropping one side's alone leaves both waiting for each other until the deadline)."""
        self.attempt = None
        if manifest is not None:
            self.reset()
            self._last_attempt = manifest.attempt

    def prepare(self, manifest: SyncManifest, timeout: float) -> tuple[Plan, int, bool]:
        """Plan (or reuse the plan), agree on it with every rank, join (or reuse) the group.

        With ``transport="auto"`` the ranks also choose, all alike, between CUDA IPC and point to point
        (:attr:`transport` says which).
        Returns the plan, this rank's sync rank, and whether anything was (re)built.
        """
        deadline = time.monotonic() + timeout
        names = (*manifest.sources, *manifest.destinations)
        phase = self.phases
        with phase("layouts"):  # those not read before, their references in one request
            layouts = {name: self._layouts[name] for name in names if name in self._layouts}
            missing = [name for name in names if name not in layouts]
            if missing:
                left = max(0.1, deadline - time.monotonic())
                layouts.update(self.client.fetch_layouts(missing, "current", timeout=left))
            layouts = {name: layouts[name] for name in names}  # in the manifest's order, as before
        key = PlanKey.of(manifest, tuple(id(layouts[n]) for n in names))
        if key == self._key and self._plan is not None:
            return self._plan, self._plan.rank(self.instance, self.local_rank).rank, False
        try:  # the writer's own rules, alone and together, as its check() applied them
            manifest.options.check()
        except ValueError as e:
            raise AwexValueError(f"sync {manifest.version!r}: {e}") from None
        with phase("devices"):  # also finds where every rank can take per-version signals (all transports)
            where = self._devices(manifest.attempt.name, names, layouts, deadline, manifest.options.transport != "p2p")
        self._processes = where.processes

        plan_started = time.perf_counter()
        plan, transport, reason, send_quant = plan_version(manifest, layouts, where)
        if reason:
            log.info("%s:%d sync %s over %s: %s", self.instance, self.local_rank, manifest.version, transport, reason)
        phase["plan"] = time.perf_counter() - plan_started
        me = plan.rank(self.instance, self.local_rank)
        self.signals = signals_for(self._signals, self.client, self.channel, self.board)
        self._relay_for(plan, me.rank)  # listening before it agrees: a peer past the agreement may signal it
        with phase("agreement"):
            try:
                self.client.agree(
                    keys.plan_agreement(manifest.version, manifest.seq),
                    f"{self.instance}:{self.local_rank}",
                    plan.world_size,
                    f"{transport}:{plan.digest}",
                    timeout=max(0.1, deadline - time.monotonic()),
                )
            except AgreementAbortedError as e:  # a rank failed the attempt first (places.abandon)
                raise places.given_up(manifest.attempt.name, e) from None
        if transport not in self._transports:
            self._transports[transport] = make_transport(transport)
        setup = Setup(
            manifest.host,
            manifest.port,
            deadline,
            self.device,
            manifest.rendezvous(),
            delta=manifest.options.delta,
            delta_budget_bytes=self.delta_budget_bytes,
            quantize=fp8_quantizer() if plan.quantized else None,
            job=self.client.job,
            secret=group_secret(manifest.channel_secret),
        )
        self._transports[transport].prepare(plan, me.rank, setup, phase)
        self._layouts = layouts
        self._key, self._plan, self.transport, self.send_quant = key, plan, transport, send_quant
        log.info(
            "%s:%d planned %d buckets (digest %s), sync rank %d of %d",
            self.instance,
            self.local_rank,
            len(plan.schedule(me.rank)),
            plan.digest[:12],
            me.rank,
            plan.world_size,
        )
        return plan, me.rank, True

    def _relay_for(self, plan: Plan, rank: int) -> None:
        """This rank's relays in a new plan, and its signals through them (:func:`~.relayed.with_relays`)."""
        if self.relay is not None:
            self.relay.close()
        found = with_relays(plan, rank, self._processes, self.signals, self.channel)
        self.host_groups, self.relay, self.signals = found

    # -- one version's route: a writer and a reader enter the session once a version -------------------------------
    def send(
        self,
        version: str,
        manifest: SyncManifest | None,
        shards: LocalShards,
        started: float,
        timeout: float,
        *,
        control: dict[str, float],
        refresh: Callable[[], None] | None = None,
        refresh_by_wave: Callable[[Sequence[Sequence[Region]]], Callable[[int], None]] | None = None,
        beside: Callable[[], None] | None = None,
        confirm: Callable[[], None] | None = None,
        fp8: Fp8Sender | None = None,
    ) -> Sent:
        """A trainer rank's version from its manifest (``None``: read it, as every rank but the first does) until
        every receiving rank's outcome: the transfer (``beside`` while the bytes move), ``confirm`` once this rank's
        part is out (the first rank reads its claim's answer there, before the receivers' outcomes), verify mode's
        digests, the outcomes. ``control``: the seconds of what the writer did before (its phases). The caller
        raises where an outcome is not ``ok``; :attr:`attempt` is the manifest while the version is in progress."""
        self.attempt = None
        if manifest is None:
            manifest = self.fetch_manifest(version, timeout)
        self.attempt = manifest
        announced = time.monotonic()
        deadline = started + timeout
        stats = self.transfer(manifest, shards, deadline - announced, refresh, refresh_by_wave, beside, fp8)
        shards = self.sent_shards
        if confirm is not None:
            confirming = time.monotonic()
            confirm()
            self.phases["confirm"] = time.monotonic() - confirming
        if manifest.options.verify:  # what this rank sent, digested while the receivers digest what they got
            self.verify(manifest, shards, deadline)
        got = self.await_outcomes(manifest, deadline)
        if all_applied(got):
            self.applied()
            self.attempt = None
        self.phases.update(control, manifest=announced - started, total=time.monotonic() - started)
        stats.phases, stats.planned = dict(self.phases), self.planned
        line = self.describe_sync("sent", version, stats.bytes_sent, stats.seconds)
        return Sent(stats, got, self._plan, self.transport, getattr(self.signals, "medium", None), line)

    def receive(
        self,
        version: str,
        shards: LocalShards,
        started: float,
        timeout: float,
        *,
        bound: float,
        admit: Callable[[SyncManifest], None],
        beside: Callable[[], None] | None = None,
        land: Callable[[], None] | None = None,
    ) -> Received:
        """A receiving rank's version: its manifest (``admit`` raises where this rank must not take it), the transfer
        (``beside`` while the bytes move), verify mode's check, ``land`` (validation, the engine's load step), then
        its outcome (:meth:`finish`). ``bound``: when the caller's own check of its views ended. What ``land`` or
        anything before it raises fails the version on this rank (the caller reports it, with :attr:`attempt`)."""
        self.attempt = None
        manifest = self.attempt = self.fetch_manifest(version, timeout)
        fetched = time.monotonic()
        admit(manifest)
        stats = self.transfer(manifest, shards, timeout - (time.monotonic() - started), beside=beside)
        if manifest.options.verify:  # before validation and the load step: nothing unverified is applied
            self.verify(manifest, shards, started + timeout)
        transferred = time.monotonic() - started
        self.phases.update(fingerprint=bound - started, manifest=fetched - bound, transferred=transferred)
        if land is not None:
            land()
        if not manifest.options.hold_trainer_memory:  # before the outcome: the trainer frees it once all reported
            self.let_go()
        self.finish(manifest, ok=True, deadline=started + timeout)
        self.attempt = None
        self.phases["total"] = time.monotonic() - started
        stats.phases, stats.planned = dict(self.phases), self.planned
        line = self.describe_sync("received", version, stats.bytes_received, stats.seconds)
        return Received(stats, manifest, line)

    def transfer(
        self,
        manifest: SyncManifest,
        shards: LocalShards,
        timeout: float,
        refresh: Callable[[], None] | None = None,
        refresh_by_wave: Callable[[Sequence[Sequence[Region]]], Callable[[int], None]] | None = None,
        beside: Callable[[], None] | None = None,
        fp8: Fp8Sender | None = None,
    ) -> TransferStats:
        """Move this rank's share of the version; ``refresh`` / ``refresh_by_wave`` (senders): see
        ``WeightsWriter`` (per wave only over p2p; once the transport is known, before any byte moves); a sender
        whose plan has the trainers quantise sends ``fp8``'s views instead (:attr:`sent_shards`). ``beside``
        runs while the bytes move (where the transport lets it: CUDA IPC once the copies are enqueued) or after
        the transport returns; what it raises is raised once the transfer ended."""
        started = time.monotonic()
        if self.closed:
            raise RuntimeError(f"{self.instance}:{self.local_rank}: this reader or writer is closed")
        self.phases = phase = Phases()
        self._link = None
        plan, rank, self.planned = self.prepare(manifest, timeout)
        if fp8 is not None and self.send_quant is not None:
            shards, refresh, refresh_by_wave = fp8.views(self.send_quant, refresh)
        self.sent_shards = shards
        transport = self._transports[self.transport]
        if not transport.refreshes_by_wave:
            refresh_by_wave = None
        if refresh is not None and refresh_by_wave is None:
            with phase("refresh"):
                refresh()
        link = self._link = SyncPeerLink(
            plan, rank, self.signals, self.client, manifest, self.transport, self._processes, beside=beside
        )
        stats = transport.run(shards, link, started + timeout, phase, refresh_by_wave)
        link.meanwhile()  # where the transport did not
        if link.beside_error is not None:
            raise link.beside_error
        if transport.signals_ready:
            stats.seconds = time.monotonic() - started
        return stats

    def verify(self, manifest: SyncManifest, shards: LocalShards, deadline: float) -> None:
        """Verify mode, after this rank's transfer (``awex.engines.sync.verify``): a trainer rank publishes the
        digests of what it sent, a receiving rank compares what it got with them (``VerifyError`` where it differs)."""
        if (link := self._link) is None:
            raise RuntimeError(f"{self.instance}:{self.local_rank}: verify before any transfer")
        self._verifier = self._verifier or Verifier(self.client)
        with self.phases("verify"):
            transport, plan = self._transports[link.kind], link.plan  # with what it digested as bytes moved, if it did
            if plan.ranks[link.rank].role.value == "trainer":
                self._verifier.publish(plan, link.rank, manifest, shards, transport.sent_digests())
            else:
                got, check = transport.received_digests(), link.check_senders
                self._verifier.check(plan, link.rank, manifest, shards, deadline, check, got)

    @property
    def plan(self) -> Plan | None:
        """The plan in use (``None`` before the first version or after a failure)."""
        return self._plan

    def layout_of(self, instance: str) -> Layout | None:
        return self._layouts.get(instance)  # the layout of ``instance`` this session planned with, if it did

    @property
    def touched(self) -> bool:
        """A receiver: the last transfer began moving bytes into its views."""
        return self._link is not None and self._link.touched

    # -- outcomes: a version counts as applied only when every receiving rank said so (awex.engines.sync.outcomes) ---
    def finish(
        self, manifest: SyncManifest, ok: bool, cause: str | None = None, partial: bool = False, deadline: float = 0.0
    ) -> None:
        """A receiving rank's outcome of ``manifest``'s version: :func:`awex.engines.sync.outcomes.report`; an
        instance's first rank then collects its instance's until ``deadline`` (:func:`~.outcomes.aggregate`)."""
        self._last_attempt = manifest.attempt
        with self.phases("done"):
            me = (self.instance, self.local_rank)
            outcomes.report(self.client, self._plan, me, self.signals, manifest, ok, cause, partial)
            if self._plan is not None and self.signals is not None:
                outcomes.aggregate(self._plan, self.signals, manifest, me, deadline)

    def await_outcomes(self, manifest: SyncManifest, deadline: float) -> outcomes.Outcomes:
        """A trainer rank: every receiving rank's outcome: :func:`awex.engines.sync.outcomes.collect`."""
        with self.phases("done"):
            me = self._plan.rank(self.instance, self.local_rank).rank
            return outcomes.collect(self._plan, self.signals, manifest, deadline, self._processes, me, self.relay)

    def describe_sync(self, verb: str, version: str, nbytes: int, seconds: float) -> str:
        """One log line for a sync this rank finished; a sync that planned anew also lists its phases and the
        plan's size (where the first sync's time goes: planning, agreement, group set-up, export/open, transfer)."""
        line = f"{self.instance}:{self.local_rank} {verb} {version}: {nbytes:,} bytes in {seconds:.3f} s"
        if not self.planned or self._plan is None:
            return line
        plan, me = self._plan, self._plan.rank(self.instance, self.local_rank).rank
        return (
            f"{line} (new plan: {plan.world_size} ranks, {len(plan.tensors)} tensors, {len(plan.schedule(me))} "
            f"buckets for this rank, over {self.transport}; {self.phases.summary()})"
        )

    def reset(self) -> None:
        """After a failed sync: forget plan, group and executors (:meth:`abort_transport`): the next one plans anew."""
        self._key = self._plan = None
        self.abort_transport()
        self.transport = None

    def abort_transport(self) -> None:
        """Drop what this rank's transport holds that peers may wait on (``Transport.abort``: a group is dropped, gloo
        peers' receives fail at once; an NCCL one is aborted, its kernels end); the plan stays until :meth:`reset`."""
        self._in_use("abort")

    def applied(self) -> None:
        """A sender, once every receiver applied a version (over shared memory: each has mapped this plan's
        segment, so its name can go)."""
        self._in_use("applied")

    def let_go(self) -> None:
        """After a version whose writer holds no trainer memory between versions (``hold_trainer_memory=False``):
        what the transport and the last transfer hold of this rank's views and of other processes' memory goes
        (``Transport.let_go``, every transport's: after a failure none is in use). Not collected: none of it sits in
        a reference cycle (a full collection cost 0.1 s a version in the GPU benchmark's processes; the GPU test
        measures the memory given back)."""
        for transport in self._transports.values():
            try:
                transport.let_go()
            except Exception as e:  # the version stands: memory let go late (at the next version) fails nothing
                log.warning("%s:%d could not let go over %s: %s", self.instance, self.local_rank, transport.name, e)
        self.sent_shards = self._link = None

    def _in_use(self, what: str) -> None:
        transport = self._transports.get(self.transport) if self.transport else None
        if transport is not None:
            getattr(transport, what)()
