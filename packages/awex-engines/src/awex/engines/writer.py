"""The trainer side: :class:`WeightsWriter` sends this rank's shards to every inference instance that needs them.

    writer = WeightsWriter(client, layout, local_rank, view_of=hf_views(model))
    writer.write("step-12", destinations=["vllm-0", "vllm-1"])   # on every trainer rank

``view_of(name, box)`` returns views of the trainer's own parameters (no gather, no copy of the model);
``awex.engines.megatron`` and ``awex.engines.hf`` provide it for Megatron-core and HF models.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from functools import partial
from typing import Any, Callable, Sequence

import torch

from awex.engines.errors import SyncFailedError, instance_verdicts
from awex.engines.source import TrainerSource
from awex.engines.sync import keys
from awex.engines.sync.background import Background
from awex.engines.sync.board import HostBoard, host_identity
from awex.engines.sync.channel import VersionChannel
from awex.engines.sync.keys import version_records
from awex.engines.sync.manifest import SyncManifest
from awex.engines.sync.session import Region, SyncSession
from awex.engines.writer_options import check_options
from awex.meta import Box, Layout, Plan
from awex.meta.client import MetaClient
from awex.meta.errors import MetaConflictError, MetaNotRegisteredError, MetaServerError
from awex.transport.base import TransferStats
from awex.transport.net import free_port
from awex.transport.registry import TRANSPORTS
from awex.transport.shards import LocalShards, rebound

log = logging.getLogger("awex.engines")

OUTCOME_GRACE_SECONDS = 10.0  # after a failed write, how long the first rank waits for the receivers' outcomes


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

    After each write, rank 0 drops the MetaServer records (manifest, agreements, validation reports) of versions
    older than the last ``keep_versions``, so a run of any length stays within the server's key limit.
    """

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
        host: str = "127.0.0.1",
        wave_bytes: int = 256 << 20,
        timeout: float = 300.0,
        transport: str = "auto",
        allow_cast: Sequence[str] = (),
        refresh: Callable[[], None] | None = None,
        refresh_by_wave: Callable[[Sequence[Sequence[Region]]], Callable[[int], None]] | None = None,
        keep_versions: int = 2,
        delta: bool = False,
        delta_budget_bytes: int | None = None,
        quantize_on_receive: bool = False,
    ):
        check_options(
            transport, refresh, refresh_by_wave, keep_versions, delta, delta_budget_bytes, quantize_on_receive
        )
        self.client = client
        self.layout = layout
        self.local_rank = local_rank
        self.host = host
        self.wave_bytes = wave_bytes
        self.timeout = timeout
        self.transport = transport
        self.allow_cast = tuple(allow_cast)
        self.refresh = refresh
        self.refresh_by_wave = refresh_by_wave
        self.delta = delta
        self.quantize_on_receive = quantize_on_receive
        self.keep_versions = keep_versions
        self._written: deque[tuple[str, int]] = deque()  # (version, attempt count) written, oldest first
        self.last_stats: TransferStats | None = None  # this rank's stats of the last write
        self._view_of = view_of  # asked again before each write: memory that moved is re-bound, never read stale
        self._shards = LocalShards.from_layout(layout, local_rank, view_of)  # checked before any byte moves
        if transport == "ipc" and self._shards.device.type != "cuda":
            raise ValueError(
                f"transport='ipc' needs CUDA views; {layout.instance} holds its weights on {self._shards.device}"
            )
        self._session = SyncSession(client, layout.instance, local_rank, device=self._shards.device)
        self._session.delta_budget_bytes = delta_budget_bytes
        self._background = Background(f"{layout.instance}-{local_rank}")  # events, dropping old records
        self._port: int | None = None
        self._channel: VersionChannel | None = None  # rank 0 hosts the version channel (awex.engines.sync.channel)
        self._cleaner: VersionChannel | None = None  # the background thread's connection to it
        self._board: HostBoard | None = None  # rank 0: the host board (awex.engines.sync.board), where /dev/shm allows
        self._seq = 0  # attempts announced (rank 0): the manifest's count
        self._applied: set[str] = set()  # versions this writer wrote (names are written once)
        self._pending_forget: list[str] = []  # failed versions whose records go with the next successful write
        self._manifest: SyncManifest | None = None  # rank 0: the last manifest, and as JSON
        self._manifest_doc: dict | None = None
        if local_rank == 0:
            client.register(layout.instance, role="trainer", instance=layout.instance, world_size=layout.world_size)
            client.publish_layout(layout, "current")

    def close(self) -> None:
        """Release what syncing holds on this rank: plan and staging buffers (idempotent; no further syncs). Over
        CUDA IPC, keep this process alive until every reader has closed (see ``WeightsReader.close``)."""
        self._background.flush()
        self._session.close()
        self._channel = self._cleaner = None  # stops the version channel once the session dropped it too
        if self._board is not None:
            self._board.close()  # removes it
            self._board = None

    def __enter__(self) -> "WeightsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def shards(self) -> LocalShards:
        """This rank's views (what it sends)."""
        return self._shards

    @property
    def transport_in_use(self) -> str | None:
        """``"p2p"``, ``"ipc"`` or ``"shm"``: what the last :meth:`write` used (``auto``'s choice); ``None`` before
        one."""
        return self._session.transport

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
            raise ValueError(
                f"version {version!r} was already written by this writer: version names are written once "
                "(name each version anew, e.g. after the training step)"
            )
        started = time.monotonic()
        deadline = started + self.timeout
        later: list[tuple[str, Callable[[], object]]] = []  # requests sent after the transfer (off its path)
        manifest = outcomes = None
        # memory that moved (offloaded and reloaded, param.data replaced, resharded): new views, and the transports
        # rebuild what they built from the old ones (CUDA IPC: a new export); bad views raise here, nothing begun
        self._shards, _ = rebound(self.layout, self.local_rank, self._view_of, self._shards)
        try:
            if self.local_rank == 0:
                manifest = self._announce(version, destinations, later)
            else:
                manifest = self._session.fetch_manifest(version, self.timeout)
            announced = time.monotonic()
            stats = self._session.transfer(
                manifest,
                self._shards,
                self.timeout - (time.monotonic() - started),
                refresh=self.refresh,
                refresh_by_wave=self.refresh_by_wave,
            )
            outcomes = self._session.await_outcomes(manifest, deadline)
            failed = {rank: o for rank, o in outcomes.items() if not (o and o.get("ok"))}
            if failed:
                raise SyncFailedError(version, failed)
        except BaseException as e:
            self._failed(version, manifest, e, outcomes, deadline)
            raise
        self._applied.add(version)
        self._session.applied()
        self._session.phases.update(manifest=announced - started, total=time.monotonic() - started)
        stats.phases, stats.planned = dict(self._session.phases), self._session.planned
        self.last_stats = stats
        log.info("%s", self._session.describe_sync("sent", version, stats.bytes_sent, stats.seconds))
        if self.local_rank == 0:
            verdicts, total = instance_verdicts(outcomes), self._session.phases["total"]
            plan = self._session._plan
            later.append((f"reporting {version} applied", partial(self._report, version, verdicts, plan, total)))
            later.append(
                (
                    f"dropping the records of versions before {version}",
                    partial(self._forget_old, version, manifest.seq, self._session._plan),
                )
            )
        if later:  # one hand-over: one wake-up of the background thread
            self._background.submit(f"after {version}", self._background.run_each, later)
        return stats

    def _failed(
        self, version: str, manifest: SyncManifest | None, error: BaseException, outcomes: dict | None, deadline: float
    ) -> None:
        """After a failed attempt: on the first rank, learn what the receivers did (waiting a little for their
        outcomes where the transfer may have begun), report every destination's version, publish the failure,
        and drop the attempt's records and signals; on every rank, forget plan and group (fresh next time)."""
        where = f"{self.layout.instance}:{self.local_rank}"
        log.error("%s failed to write %s: %s", where, version, error)
        if self.local_rank == 0 and manifest is not None:
            if outcomes is None and self._session._plan is not None and isinstance(error, Exception):
                try:  # the receivers report within moments what they did (a dead one does not)
                    outcomes = self._session.await_outcomes(
                        manifest, min(deadline, time.monotonic() + OUTCOME_GRACE_SECONDS)
                    )
                except Exception as e:
                    log.warning("%s: receivers' outcomes of %s unknown: %s", where, version, e)
            self._background.flush()
            if outcomes:
                self._report(version, instance_verdicts(outcomes))
            try:
                self.client.publish_event(
                    "sync_failed", where, version=version, data=f"{type(error).__name__}: {error}"[:2000]
                )
            except Exception as e:
                log.warning("%s could not publish the failure of %s: %s", where, version, e)
            self._withdraw(manifest)
        self._session.note_failure(manifest)

    def _withdraw(self, manifest: SyncManifest) -> None:
        """Rank 0: take a failed attempt's manifest back (board, channel, MetaServer records), so that a retry
        announces afresh, on a new rendezvous."""
        version = manifest.version
        self._manifest = self._manifest_doc = None
        self._port = None
        if self._board is not None:
            self._board.post({"version": None, "withdrawn": version, "seq": manifest.seq})
        try:
            if self._channel is not None:
                self._channel.delete([keys.channel_manifest(version)])
        except Exception as e:
            log.warning("could not withdraw %s from the version channel: %s", version, e)
        names, prefixes = keys.withdrawn_records(version)
        self._pending_forget.append(version)  # the rest, with the next successful write
        try:
            self.client.forget(names, prefixes)
        except MetaServerError as e:
            log.warning("could not drop the MetaServer records of the failed version %s: %s", version, e)

    def _report(self, version: str, verdicts: dict[str, str], plan=None, seconds: float | None = None) -> None:
        """Tell the MetaServer which version each destination instance serves now, with the bytes its ranks
        received and the sync's time (as this rank saw it)."""
        for instance, verdict in sorted(verdicts.items()):
            if verdict == "unchanged":
                continue
            serves = version if verdict == "applied" else None
            nbytes = None
            if plan is not None and serves is not None:
                ranks = [r.rank for r in plan.ranks if r.instance == instance]
                nbytes = sum(s.bucket.nbytes for r in ranks for s in plan.schedule(r) if s.op == "recv")
            moved = {"nbytes": nbytes, "seconds": seconds} if nbytes is not None else {}
            try:
                try:
                    self.client.report_version(instance, serves, **moved)
                except MetaNotRegisteredError:
                    layout = self._session._layouts.get(instance)
                    if layout is None:
                        raise
                    # a MetaServer restarted while the instance had nothing to tell it: register it on its behalf
                    self.client.register(instance, role="inference", instance=instance, world_size=layout.world_size)
                    self.client.report_version(instance, serves, **moved)
            except MetaServerError as e:  # reporting must not mask the sync's own outcome
                log.warning("could not report version %s of %s to the MetaServer: %s", version, instance, e)

    def _announce(self, version: str, destinations: Sequence[str], later: list) -> SyncManifest:
        """Rank 0: publish version ``version``'s manifest (host board, version channel, MetaServer); appends what
        can wait until after the transfer to ``later``. On the host board the manifest goes out first: receivers
        read it and check their plan while this rank makes sure its weights are in memory and signals "ready"."""
        if self._port is None:
            self._port = free_port(self.host)
        if self._channel is None:
            self._channel = self._session.channel = VersionChannel.host(self.host, self.timeout)
            try:
                self._board = self._session.board = HostBoard.create()
            except OSError as e:  # no /dev/shm here: the channel carries every signal
                log.info("no host board (%s); per-version signals go over the version channel", e)
        self._seq += 1
        last = self._manifest
        steady = (
            last is not None and last.destinations == tuple(sorted(destinations)) and self._session.steady_for(last)
        )  # every rank of this plan already saw a manifest of ours
        if steady:
            doc = dict(self._manifest_doc, version=version, seq=self._seq)
        else:
            last = SyncManifest(
                version,
                (self.layout.instance,),
                tuple(sorted(destinations)),
                self.host,
                self._port,
                self.wave_bytes,
                self.timeout,
                self.transport,
                self.allow_cast,
                refresh_by_wave=self.refresh_by_wave is not None,
                channel=self._channel.address,
                channel_secret=self._channel.secret,
                seq=self._seq,
                board=self._board.path if self._board else None,
                board_host=host_identity() if self._board else None,
                delta=self.delta,
                quantize_on_receive=self.quantize_on_receive,
            )
            doc = last.to_json()
        if self._board is not None:  # ranks on this host read it here, the others on the channel
            self._board.post(doc)
        manifest = last.renamed(version, self._seq)
        self._manifest, self._manifest_doc = manifest, doc
        if not steady or getattr(self._session.signals, "medium", "meta") != "board":  # not every rank maps the board
            self._channel.put(keys.channel_manifest(version), doc)
        if steady:  # the MetaServer's copy is for observers and late joiners
            later.append(
                (f"manifest of {version}", partial(self.client.put, keys.manifest(version), doc, create_only=True))
            )
        else:  # ranks that do not know the channel yet (first write, new destinations) look there
            try:
                self.client.put(keys.manifest(version), doc, create_only=True)
            except MetaConflictError:
                raise ValueError(
                    f"version {version!r} was already announced on the MetaServer (by another writer, "
                    "or an earlier run of this job): version names are written once"
                ) from None
        later.append(
            (
                f"event weights_ready {version}",
                partial(self.client.publish_event, "weights_ready", self.layout.instance, version=version),
            )
        )
        return manifest

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until the requests a write leaves for afterwards (the MetaServer's copy of the manifest, events,
        dropping old records) were sent; whether they were within ``timeout``."""
        return self._background.flush(timeout)

    def held_bytes(self) -> int:
        """Bytes of sync buffers (staging) this writer keeps between versions."""
        return self._session.held_bytes()

    @property
    def last_phases(self) -> dict[str, float]:
        """Seconds of each phase of this rank's last write (plan, agreement, group, export, transfer, ...)."""
        return dict(self._session.phases)

    def _forget_old(self, version: str, seq: int, plan: Plan | None = None) -> None:
        """Drop the MetaServer records of versions older than the last ``keep_versions`` (a long RL run writes
        thousands; the server's key store is bounded). This version's bytes reached every receiver (p2p) or every
        receiver said it is done (ipc), and a receiver finishes a version, validation report included, before it
        receives the next: the older versions' records are final and nobody waits on them (assuming, as training
        does, that this instance's ranks write versions in step, never ``keep_versions`` apart)."""
        self._written.append((version, seq))
        ranks = [(r.instance, r.local_rank) for r in plan.ranks] if plan is not None else []
        while self._pending_forget:  # failed attempts: records their ranks may have left after the first drop
            failed = self._pending_forget.pop()
            if failed != version:
                names, prefixes = version_records(failed)
                try:
                    self.client.forget(names, prefixes)
                except MetaServerError as e:
                    log.warning("could not drop the MetaServer records of the failed version %s: %s", failed, e)
        while len(self._written) > self.keep_versions:
            old, old_seq = self._written.popleft()
            self._forget_signals(old, old_seq, ranks)
            names, prefixes = version_records(old)
            try:
                gone = self.client.forget(names, prefixes)
                log.debug("forgot version %s: %s", old, gone)
            except MetaServerError as e:  # the write itself succeeded; the records only cost server memory
                log.warning("could not drop the MetaServer records of version %s: %s", old, e)

    def _forget_signals(self, version: str, seq: int, ranks: Sequence[tuple[str, int]]) -> None:
        """Drop version ``version``'s keys from the version channel (from the background thread, on a connection
        of its own)."""
        channel = self._channel
        if channel is None:
            return
        if self._cleaner is None or self._cleaner.address != channel.address:
            self._cleaner = channel.clone()
        names = [keys.channel_manifest(version)]
        for instance, rank in ranks:
            names += [keys.ready(t, version, seq, instance, rank) for t in sorted(TRANSPORTS)]
            names.append(keys.channel_outcome(version, seq, instance, rank))
        self._cleaner.delete(names)
