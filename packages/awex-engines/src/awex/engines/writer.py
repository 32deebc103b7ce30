"""The trainer side: :class:`WeightsWriter` sends this rank's shards to every inference instance that needs them.

    writer = WeightsWriter(client, layout, local_rank, view_of=hf_views(model))
    writer.write("step-12", destinations=["vllm-0", "vllm-1"])   # on every trainer rank

``view_of(name, box)`` returns views of the trainer's own parameters (no gather, no copy of the model);
``awex.engines.megatron`` and ``awex.engines.hf`` provide it for Megatron-core and HF models.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from functools import partial
from typing import Any, Callable, Sequence

import torch

from awex.engines.errors import ClaimRefusedError, SyncFailedError, instance_verdicts
from awex.engines.outcome import all_applied
from awex.engines.source import TrainerSource
from awex.engines.sync import keys, places
from awex.engines.sync.announcer import Announcer
from awex.engines.sync.background import Background
from awex.engines.sync.channel import lanes_for
from awex.engines.sync.fp8_sender import Fp8Sender
from awex.engines.sync.lease import DEFAULT_SECONDS as DEFAULT_LEASE
from awex.engines.sync.lease import checked as checked_lease
from awex.engines.sync.manifest import SyncManifest
from awex.engines.sync.options import SyncOptions
from awex.engines.sync.outcomes import to_record
from awex.engines.sync.session import Region, SyncSession
from awex.meta import Box, Layout
from awex.meta.client import MetaClient
from awex.meta.errors import AwexValueError
from awex.transport.base import TransferStats
from awex.transport.rebind import confirm_bound, rebound, taken_again
from awex.transport.registry import transport_class
from awex.transport.shards import LocalShards

log = logging.getLogger("awex.engines")

OUTCOME_GRACE_SECONDS = 10.0  # after a failed write, how long the first rank waits for the receivers' outcomes


class _Option:
    """A writer attribute kept in its :class:`SyncOptions` (``writer.timeout = 30`` replaces the record, checked:
    a change applies from the next :meth:`WeightsWriter.write`)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, writer: Any, owner: type | None = None) -> Any:
        return self if writer is None else getattr(writer.options, self.name)

    def __set__(self, writer: Any, value: Any) -> None:
        writer.options = replace(writer.options, **{self.name: value}).check()


class WeightsWriter:
    """One trainer rank's writer. Every trainer rank calls :meth:`write` with the same version.

    ``transport="p2p"`` moves weights over a sync group (NCCL for CUDA views, gloo for CPU views), in waves
    of about ``wave_bytes`` per rank (staging about twice that). ``transport="ipc"`` is for inference engines
    on the trainer's host (on its GPUs or others): they copy straight from this rank's CUDA memory (IPC
    handles exported once, reused while the parameters do not move); :meth:`write` returns once every
    receiver has finished reading. ``transport="shm"`` is for CPU engines on the trainer's host that share its
    ``/dev/shm``: this rank writes each version once into a shared-memory segment laid out by the plan, and the
    receivers copy out of it (``awex.transport.pull.shm``). ``transport="rdma"`` works across hosts: receivers read
    this rank's registered buffer one-sided through Mooncake's transfer engine (RDMA NICs where the host has
    them, TCP elsewhere; ``awex.transport.pull.rdma``). ``transport="auto"`` (the default) lets the ranks choose when
    they first plan: CUDA IPC when every rank is a CUDA rank on one host and no GPU would move more than with relayed
    point to point (fan-out), and, with ``refresh_by_wave``, only where engines share GPUs (only p2p overlaps the
    quantising with the transfer); else p2p (``awex.meta.transport_choice``; the choice is logged and kept in
    :attr:`transport_in_use`).

    The receivers' dtypes decide what arrives; a narrowing cast (fp32 -> bf16) is refused before any byte moves
    unless the tensor's name matches one of the ``allow_cast`` glob patterns (see ``awex.meta.PlanOptions``).

    ``refresh`` runs in every :meth:`write`, before any byte moves: it recomputes views derived from the
    weights, such as FP8 tiles quantised on the fly (``awex.convert.Fp8Views.quantize``). With
    ``refresh_by_wave`` as well (``Fp8Views.by_wave``), the p2p transport refreshes wave by wave instead, each
    wave's part just before it is packed, overlapping the waves already on the wire; ``ipc`` always uses
    ``refresh``.

    ``delta=True`` (``transport="p2p"`` or ``"ipc"``): after the first version each bucket travels as the 16-bit
    words that changed since the last version where that is smaller (RL steps change few bf16 values), checked by
    checksums at every receiver, taken whole where a receiver's words do not match (``awex.transport.delta``; over
    CUDA IPC the receivers read the changes from a board this rank exports, ``awex.transport.ipc.delta``). This
    rank keeps what its receivers confirmed last, up to ``delta_budget_bytes`` (default: all of it, on the views'
    device); buckets beyond the budget always go whole. Buckets run one after another without relays: it pays
    where bytes cost more than the copies (across nodes, or over NVLink). Write stats then carry ``bytes_dense``,
    what a dense sync would have moved.

    ``quantize_on_receive=True`` (``transport="ipc"``): this rank publishes its weights unquantised and the FP8
    engines reading them on the same GPU quantise them straight into their FP8 weights and scales, all pieces in
    one kernel launch (``awex.transport.ipc.fp8_on_copy``): the trainer neither quantises nor holds FP8 buffers.
    ``quantize_on_receive="auto"``: the same where every FP8 receiver reads its sources on its own GPU over CUDA IPC
    (and verify mode is off); everywhere else this rank quantises its weights to the receivers' tiles, wave by wave
    over p2p (``awex.engines.sync.fp8_sender``: FP8 buffers of its own, built at the first such plan). The ranks
    decide alike when they plan; ``layout`` and ``view_of`` are the bf16 weights (no FP8 views of your own).

    ``verify=True``: every receiving rank digests what it got (as it lands over CUDA IPC and p2p, else after the
    transfer; always before its load step) and compares it with the digests this rank took of the same regions in
    its own memory (as its waves leave over p2p, else after its transfer; ``awex.engines.sync.verify``, a
    hash of every 16-bit word at its place in its tensor, one pass over memory; one Triton kernel on CUDA); a
    receiver whose bytes differ fails the version, so :meth:`write` raises instead of returning. For every transport
    and plan (relays included), with ``delta`` too; not with ``quantize_on_receive=True`` (the receivers then hold
    other bytes than this rank; with ``"auto"`` this rank quantises). Costs a pass over the weights on both sides
    (``docs/performance.md``).

    ``hold_trainer_memory=False``: for a trainer that offloads its weights after each version (colocated RL).
    Once every receiving rank has the version it lets go of this rank's memory (over CUDA IPC it closes its mapping of
    it) and reports, and :meth:`write` then drops this rank's views and what its transport built over them (a CUDA
    IPC export, a staging area), so the GPU memory goes when the trainer frees it. The next version takes the views,
    exports and opens anew, as after memory that moved (``docs/usage.md`` has the cost). Not with ``delta``.

    ``claim_lease`` (seconds, default 10): rank 0 holds its job's claim lease on the MetaServer while it can, so a
    fresh version name's claim is sent without waiting for its answer (``awex.engines.sync.lease``); a writer of this
    instance that replaces this one without :meth:`close` waits up to that long. ``None``: every claim waits for its
    answer before any byte moves.

    After each write, rank 0 drops the MetaServer records (manifest, agreements, validation reports) of versions
    older than the last ``keep_versions`` (eight versions a request, the rest on :meth:`close`:
    ``awex.engines.sync.forgetting``), so a run of any length stays within the server's key limit.
    """

    options: SyncOptions
    """What this writer asks of every version (frozen, checked; the attributes named after its fields read it)."""
    host = _Option()
    wave_bytes = _Option()
    timeout = _Option()
    transport = _Option()
    allow_cast = _Option()
    refresh = _Option()
    refresh_by_wave = _Option()
    keep_versions = _Option()
    delta = _Option()
    delta_budget_bytes = _Option()
    quantize_on_receive = _Option()
    verify = _Option()
    hold_trainer_memory = _Option()

    @classmethod
    def from_source(cls, client: MetaClient, source: TrainerSource, **options: Any) -> WeightsWriter:
        """A writer for a :class:`~awex.engines.source.TrainerSource` (Megatron-core, FSDP2 or HF, built alike);
        ``options`` as for the constructor (its ``refresh``, where set, unless given)."""
        if source.refresh is not None:
            options.setdefault("refresh", source.refresh)
        return cls(client, source.layout, source.local_rank, source.view_of, **options)

    def __init__(
        self,
        client: MetaClient,
        layout: Layout,
        local_rank: int,
        view_of: Callable[[str, Box], torch.Tensor | Sequence[tuple[Box, torch.Tensor]]],
        *,
        host: str = SyncOptions.host,  # the defaults are SyncOptions' (one set, shared with AwexTrainerInitInfo)
        wave_bytes: int = SyncOptions.wave_bytes,
        timeout: float = SyncOptions.timeout,
        transport: str = SyncOptions.transport,
        allow_cast: Sequence[str] = SyncOptions.allow_cast,
        refresh: Callable[[], None] | None = None,
        refresh_by_wave: Callable[[Sequence[Sequence[Region]]], Callable[[int], None]] | None = None,
        keep_versions: int = SyncOptions.keep_versions,
        delta: bool = SyncOptions.delta,
        delta_budget_bytes: int | None = SyncOptions.delta_budget_bytes,
        quantize_on_receive: bool | str = SyncOptions.quantize_on_receive,
        verify: bool = SyncOptions.verify,
        hold_trainer_memory: bool = SyncOptions.hold_trainer_memory,
        claim_lease: float | None = DEFAULT_LEASE,
    ):
        self.options = SyncOptions(
            host=host,
            wave_bytes=wave_bytes,
            timeout=timeout,
            transport=transport,
            allow_cast=allow_cast,
            refresh=refresh,
            refresh_by_wave=refresh_by_wave,
            keep_versions=keep_versions,
            delta=delta,
            delta_budget_bytes=delta_budget_bytes,
            quantize_on_receive=quantize_on_receive,
            verify=verify,
            hold_trainer_memory=hold_trainer_memory,
        ).check()
        if claim_lease is not None:
            claim_lease = checked_lease(claim_lease)
        self.client = client
        self.layout = layout
        self.local_rank = local_rank
        self.last_stats: TransferStats | None = None  # this rank's stats of the last write
        self._view_of = view_of  # asked again before each write: memory that moved is re-bound, never read stale
        self._shards = LocalShards.from_layout(layout, local_rank, view_of)  # checked before any byte moves
        if transport != "auto" and transport_class(transport).needs_cuda and self._shards.device.type != "cuda":
            raise AwexValueError(
                f"transport={transport!r} needs CUDA views; {layout.instance} holds its weights on "
                f"{self._shards.device}"
            )
        self._session = SyncSession(client, layout.instance, local_rank, device=self._shards.device)
        self._fp8 = Fp8Sender(layout, local_rank, view_of)  # views of its own only where a plan has it quantise
        self._background = Background(f"{layout.instance}-{local_rank}")  # events, dropping old records
        self._report_answer: Callable[[], None] | None = None  # the last version's report: sent, answer unread
        self._applied: set[str] = set()  # versions this writer wrote (names are written once)
        # rank 0 alone announces versions, reports them and drops old records (awex.engines.sync.announcer), through
        # a client fenced with this writer's epoch: once a newer writer of this instance starts, every write of this
        # one is refused (MetaFencedError) and changes nothing, however long it was frozen
        self._announcer = None
        self._meta = client
        if local_rank == 0:
            epoch = client.take_fence(layout.instance)
            self._meta = client.fenced(layout.instance, epoch)
            self._meta.register(layout.instance, role="trainer", instance=layout.instance, world_size=layout.world_size)
            self._meta.publish_layout(layout, "current")
            self._announcer = Announcer(
                self._meta,
                self._session,
                layout.instance,
                keep_versions,
                epoch,
                lease=claim_lease,
                lanes=lanes_for(layout.world_size),
                ranks=layout.world_size,
            )

    def close(self) -> None:
        """Release what syncing holds on this rank: plan and staging buffers (idempotent; no further syncs). Over
        CUDA IPC, keep this process alive until every reader has closed (see ``WeightsReader.close``)."""
        self._read_report()
        self._background.flush()
        self._background.say_last_word()  # before the version channel goes
        self._session.close()
        if self._announcer is not None:
            self._announcer.close()
        if self._meta is not self.client:
            self._meta.close()

    def __enter__(self) -> "WeightsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def shards(self) -> LocalShards:
        """This rank's views (what it sends); ``None`` between versions with ``hold_trainer_memory=False``."""
        return self._shards

    @property
    def transport_in_use(self) -> str | None:
        """``"p2p"``, ``"ipc"`` or ``"shm"``: what the last :meth:`write` used (``auto``'s choice); ``None`` before
        one."""
        return self._session.transport

    @property
    def quantizing(self) -> bool:
        """Whether the last :meth:`write`'s plan has this rank quantise its weights to FP8 (``quantize_on_receive=
        "auto"`` with FP8 receivers that cannot quantise on receive)."""
        return self._session.send_quant is not None

    def write(self, version: str, destinations: Sequence[str]) -> TransferStats:
        """Send weight version ``version`` to the named inference instances; returns this rank's stats once every
        receiving rank of every destination applied it. Otherwise raises :class:`SyncFailedError` (naming each
        rank that failed, with its cause, or did not report by the deadline) or the error that stopped this rank.

        A version name is written once: a name this writer already wrote is refused before any byte moves, as is
        one another writer announced on the MetaServer. After a failure the next ``write`` (a retry of the same
        version, or the next one) starts afresh: a new rendezvous, plan and group on every rank, nothing of the
        failed attempt trusted. The first rank reports each destination's version to the MetaServer: the new one
        where every rank applied it, none (no consistent version) where some ranks changed their weights and
        others did not finish, and publishes a ``sync_failed`` event naming who failed and why."""
        if version in self._applied:
            raise AwexValueError(
                f"version {version!r} was already written by this writer: version names are written once "
                "(name each version anew, e.g. after the training step)"
            )
        self._read_report()  # before this thread's first request of the version
        started = time.monotonic()
        deadline = started + self.timeout
        self._session.delta_budget_bytes = self.options.delta_budget_bytes
        later: list[tuple[str, Callable[[], object]]] = []  # requests sent after the transfer (off its path)
        manifest = outcomes = None
        control: dict[str, float] = {}  # sub-phases before the transfer (its phases reset)

        def rebind() -> None:
            # memory that moved (offloaded and reloaded, param.data replaced, resharded): new views, and the
            # transports rebuild what they built from the old ones (CUDA IPC: a new export); bad views raise here,
            # before any byte moves (the first rank checks while its claim travels, and takes the claim back)
            checking = time.monotonic()
            if self._shards is None:  # let go after the last version (hold_trainer_memory=False): taken anew
                self._shards = taken_again(self.layout, self.local_rank, self._view_of, self._session.device)
            else:
                self._shards, _ = rebound(self.layout, self.local_rank, self._view_of, self._shards, quick=True)
            control["fingerprint"] = time.monotonic() - checking

        try:
            if self._announcer is not None:
                manifest = self._announcer.announce(version, destinations, self.options, meanwhile=rebind)
                control.update(self._announcer.last_phases)
            else:
                rebind()  # then the session reads the manifest
            sent = self._session.send(
                version,
                manifest,
                self._shards,
                started,
                self.timeout,
                control=control,
                refresh=self.refresh,
                refresh_by_wave=self.refresh_by_wave,
                beside=partial(self._beside, self._shards),
                # a claim sent under the lease (as the bytes began to move): its answer, read while the receivers
                # still copy or report, before their outcomes
                confirm=self._announcer.confirm if self._announcer is not None else None,
                fp8=self._fp8,
            )
            outcomes = sent.outcomes
            if not all_applied(outcomes):
                raise SyncFailedError(version, {rank: o for rank, o in outcomes.items() if o is None or not o.ok})
        except BaseException as e:
            attempt = manifest if manifest is not None else self._session.attempt  # the manifest another rank read
            self._failed(version, attempt, e, outcomes, deadline)
            self._let_go()
            raise
        self._applied.add(version)
        self._let_go()
        stats = self.last_stats = sent.stats
        if self._announcer is not None:
            verdicts, total, plan = instance_verdicts(outcomes), stats.phases["total"], sent.plan
            announcer = self._announcer
            if sent.medium == "channel":  # for ranks that find the channel gone: it goes at close or exit, with this
                # writer (a MetaServer request a version fewer), so only its last version's record is ever needed
                record = partial(self._meta.put, keys.outcomes(version, manifest.seq), to_record(outcomes), timeout=2.0)
                self._background.last_word(f"the outcomes of {version} on the MetaServer", record)
            # sent now, before write returns (the report travels with the outcome); its answer read before this
            # thread's next request
            self._report_answer = announcer.report_sent(version, verdicts, plan, total)
            later.append(
                (
                    f"dropping the records of versions before {version}",
                    partial(announcer.forget_old, version, manifest.seq, plan, sent.transport, sent.medium),
                )
            )
        if stats.planned:
            self._background.log_line(sent.line, now=True)
        else:  # a steady version's line once write returned, with the rest
            later += self._background.log_calls(sent.line)
        if later:  # one hand-over: one wake-up of the background thread
            self._background.submit(f"after {version}", self._background.run_each, later)
        self._session.phases["report"] = time.monotonic() - started - stats.phases["total"]
        return stats

    def _let_go(self) -> None:
        """After a version, where the writer holds no trainer memory between versions (``hold_trainer_memory=False``):
        its views, what its transport built over them and its FP8 sender's (the receivers let go before they
        reported), so the memory goes once the trainer frees it; the next version takes them anew."""
        if not self.options.hold_trainer_memory:
            self._shards, self._fp8 = None, Fp8Sender(self.layout, self.local_rank, self._view_of)
            self._session.let_go()

    def _beside(self, shards: LocalShards) -> None:
        """While the version's bytes move: the claim sent under the lease, and the rest of the moved-memory check
        (``confirm_bound``: a tensor changed in place at the same address fails the version)."""
        if self._announcer is not None:
            self._announcer.send_claim()
        confirm_bound(self.layout, self.local_rank, self._view_of, shards)
        if self._session.send_quant is not None:  # this rank quantises: the FP8 views' unquantised tensors too
            self._fp8.confirm()

    def _failed(
        self, version: str, manifest: SyncManifest | None, error: BaseException, outcomes: dict | None, deadline: float
    ) -> None:
        """After a failed attempt: on the first rank, learn what the receivers did (waiting a little for their
        outcomes where the transfer may have begun), report every destination's version, publish the failure,
        and drop the attempt's records and signals; on every rank, forget plan and group (fresh next time)."""
        where = f"{self.layout.instance}:{self.local_rank}"
        log.error("%s failed to write %s: %s", where, version, error)
        self._withhold(manifest)
        if self._announcer is not None and manifest is not None:
            if outcomes is None and self._session.plan is not None and isinstance(error, Exception):
                try:  # the receivers report within moments what they did (a dead one does not)
                    outcomes = self._session.await_outcomes(
                        manifest, min(deadline, time.monotonic() + OUTCOME_GRACE_SECONDS)
                    )
                except Exception as e:
                    log.warning("%s: receivers' outcomes of %s unknown: %s", where, version, e)
            self._background.flush()
            if outcomes:
                verdicts = instance_verdicts(outcomes)
                if isinstance(error, ClaimRefusedError):  # the name is not this writer's: no engine serves it
                    verdicts = {i: v if v == "unchanged" else "inconsistent" for i, v in verdicts.items()}
                self._announcer.report(version, verdicts)
            try:
                self._meta.publish_event(
                    "sync_failed", where, version=version, data=f"{type(error).__name__}: {error}"[:2000]
                )
            except Exception as e:
                log.warning("%s could not publish the failure of %s: %s", where, version, e)
            self._announcer.withdraw(manifest)
        if manifest is not None:  # ranks still in the attempt's device gather or plan agreement learn it at once
            places.abandon(
                self._meta, manifest, (self.layout.instance, self.local_rank), f"{type(error).__name__}: {error}"
            )
        self._session.note_failure(manifest)

    def _withhold(self, manifest: SyncManifest | None) -> None:
        """This rank failed the attempt: its receivers still waiting for its bytes learn it now, so that they report at
        once and the outcomes the first rank waits for come in moments, not at the receivers' deadline: where the
        signals can say it (:meth:`~awex.engines.sync.signals.Signals.withhold`), and by dropping what its transport
        holds that they wait on (a gloo group: their receives fail)."""
        session = self._session
        if manifest is None:
            return
        if session.plan is not None and session.signals is not None and session.transport is not None:
            try:
                me = session.plan.rank(self.layout.instance, self.local_rank)
                session.signals.withhold(session.transport, manifest, me)
            except Exception as e:  # the receivers then fail at their deadline, as before
                log.warning("%s:%d could not tell its receivers: %s", self.layout.instance, self.local_rank, e)
        session.abort_transport()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until the requests a write leaves for afterwards (the MetaServer's copy of the manifest, events,
        dropping old records) were sent, and read the answer to the last version's report; whether they were
        within ``timeout``."""
        self._read_report()
        return self._background.flush(timeout)

    def _read_report(self) -> None:
        """Read the answer to the report the last write sent (this thread's next request waits for it)."""
        answer, self._report_answer = self._report_answer, None
        if answer is not None:
            answer()

    def held_bytes(self) -> int:
        """Bytes of sync buffers (staging) this writer keeps between versions."""
        return self._session.held_bytes()

    @property
    def last_phases(self) -> dict[str, float]:
        """Seconds of each phase of this rank's last write (plan, agreement, group, export, transfer, ...)."""
        return dict(self._session.phases)
