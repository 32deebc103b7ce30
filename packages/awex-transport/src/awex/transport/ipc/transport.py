"""The CUDA IPC transport: trainers export their memory (once, again if their storages move) and say ready;
receivers copy straight from it."""

from __future__ import annotations

import time
from collections.abc import MutableMapping

import torch

from awex.meta import Plan
from awex.transport.base import PeerLink, RefreshByWave, Setup, TransferStats, TransferTimeout, Transport, timed
from awex.transport.deadline import wait_event
from awex.transport.ipc.delta import IpcDeltaReceiver, IpcDeltaSender
from awex.transport.ipc.executor import IpcExecutor
from awex.transport.ipc.mapping import MappedShards, open_export
from awex.transport.ipc.pairing import rebased
from awex.transport.ipc.wire import IpcExport, export_shards
from awex.transport.shards import LocalShards


class IpcTransport(Transport):
    """Engines on one host over CUDA IPC (sharing GPUs or not). Receivers report their outcome and the trainers
    wait for it (the writer does), so trainers do not change their weights while they are read."""

    name = "ipc"
    carries_delta = True
    quantizes_on_receive = True
    needs_cuda = True

    def __init__(self) -> None:
        self.plan: Plan | None = None
        self.rank = -1
        # a trainer's export, what it was made from (same object: same storages) and how often it was re-made
        self.export: IpcExport | None = None
        self.exported_from: object = None
        self.generation = 0
        self.bytes_sent: int | None = None
        # a receiver's opened exports per source rank (with the generation they came from) and its executor
        self.opened: dict[tuple[str, int], tuple[int, MappedShards, dict]] = {}  # generation, mapping, descriptor
        self._recheck = False
        self.executor: IpcExecutor | IpcDeltaReceiver | None = None
        self._built_from: LocalShards | None = None  # the views the executor (or delta sender) was built from
        self.peers: list[int] = []
        self.quantize = None  # a receiver's FP8 quantiser, for plans that quantise on receive
        # delta syncs (awex.transport.ipc.delta): whether, a sender's budget, its encoder and what it exports
        self.delta, self.delta_budget_bytes = False, None
        self.sender: IpcDeltaSender | None = None
        self._board_shards: tuple[object, LocalShards] | None = None  # (the shards it was made from, with board)

    def prepare(self, plan: Plan, rank: int, setup: Setup, phases: MutableMapping[str, float]) -> None:
        self.plan, self.rank = plan, rank
        self.quantize = setup.quantize
        self.executor = None
        self.sender, self._board_shards = None, None  # a new plan: its buckets differ, nothing kept applies
        self.delta, self.delta_budget_bytes = setup.delta, setup.delta_budget_bytes
        self._recheck = True  # a new plan may mean a restarted trainer, whose generations start again at 1
        schedule = plan.schedule(rank)
        self.peers = sorted({s.peer for s in schedule})
        self.bytes_sent = sum(s.bucket.nbytes for s in schedule)

    def run(
        self,
        shards: LocalShards,
        link: PeerLink,
        deadline: float,
        phases: MutableMapping[str, float],
        refresh_by_wave: RefreshByWave | None = None,
    ) -> TransferStats:
        self._prepared(self.plan)
        if self.plan.ranks[self.rank].role.value == "trainer":
            self._ready(shards, link, deadline, phases)
            if self.sender is not None:
                stats = TransferStats(bytes_sent=self.sender.bytes_read)
                stats.bytes_dense = self.sender.bytes_dense
                return stats
            return TransferStats(bytes_sent=self.bytes_sent or 0)
        plan, changed = self.plan, self.executor is None or self._built_from is not shards  # views re-bound
        digest = bool(link.digests) and not self.delta  # verify mode: digest as the copies write
        changed = changed or (getattr(self.executor, "digest", None) is not None) != digest
        with timed(phases, "ready_wait"):  # until every sender said this version's bytes are ready
            generations = link.await_ready(self.peers, deadline)
        with timed(phases, "open"):
            sources = {}
            for peer, generation in zip(self.peers, generations):
                src = plan.ranks[peer]
                key = (src.instance, src.local_rank)  # sync ranks may be renumbered by a new plan
                held = self.opened.get(key)
                doc = None
                if held is not None and held[0] == generation and self._recheck:
                    doc = link.descriptor(peer, generation, deadline)
                    if doc == held[2]:  # the same export: keep what is open
                        doc = None
                    else:
                        held = None  # another process's export under the same generation
                if held is None or held[0] != generation:
                    doc = doc if doc is not None else link.descriptor(peer, generation, deadline)
                    stale = self.opened.pop(key, None)
                    if stale is not None:
                        stale[1].close()
                    # an export of views equal to the last one's (memory that moved whole) is checked by its bounds
                    export = IpcExport.from_wire(doc, stale[1].export if stale is not None else None)
                    held = self.opened[key] = (generation, open_export(export), doc)
                    changed = True
                sources[peer] = held[1]
            self._recheck = False
        if changed:
            with timed(phases, "executor"):
                if self.delta:
                    self.executor = IpcDeltaReceiver(plan, self.rank, shards, sources)
                else:
                    self.executor = self._executor(shards, sources, digest, phases)
                self._built_from = shards
        executor = self.executor
        link.moving()
        with timed(phases, "transfer"):
            if self.delta:
                stats = executor.run(timeout=max(0.1, deadline - time.monotonic()))
            else:
                stats = executor.run(timeout=max(0.1, deadline - time.monotonic()), meanwhile=link.meanwhile)
        if executor.capture_seconds:  # the first run captured the sync as a CUDA graph
            phases["capture"] = executor.capture_seconds
            phases["transfer"] -= executor.capture_seconds
            executor.capture_seconds = 0.0
        return stats

    def _executor(
        self, shards: LocalShards, sources: dict[int, MappedShards], digest: bool, phases: MutableMapping[str, float]
    ) -> IpcExecutor:
        """A new executor over ``sources`` and ``shards``: where only memory moved since the last one (the same plan
        and kind of copies, the sources and this rank's views holding the same views as before, at new addresses),
        its pairs re-pointed at the new memory (:func:`~awex.transport.ipc.pairing.rebased`; phase ``rebase``), else
        paired anew."""
        old, pairs = self.executor, None
        if isinstance(old, IpcExecutor) and old.pairs is not None and old.plan is self.plan and not digest:
            started = time.perf_counter()
            pairs = rebased(old.pairs, old.sources, sources, (self._built_from, shards))
            if pairs is not None:
                phases["rebase"] = time.perf_counter() - started
        return IpcExecutor(self.plan, self.rank, shards, sources, quantize=self.quantize, digest=digest, pairs=pairs)

    def _ready(self, shards: LocalShards, link: PeerLink, deadline: float, phases: MutableMapping[str, float]) -> None:
        """A trainer: this version's weights are in memory; export them where they moved, and say ready."""
        stream = torch.cuda.current_stream(shards.device)
        if not stream.query():  # idle (the usual case, after an optimizer step): nothing to wait for
            done = torch.cuda.Event()  # this version's weights are in memory once the work queued so far ran
            done.record(stream)
            wait_event(
                done,
                deadline,
                lambda: TransferTimeout(
                    f"sync rank {self.rank}: the GPU work before this version (the weights' last update) did not "
                    "finish before the deadline"
                ),
            )
        if self.delta:
            if self.sender is None or self._built_from is not shards:  # views re-bound: encode from the new ones
                self.sender = IpcDeltaSender(self.plan, self.rank, shards, self.delta_budget_bytes)
                self._built_from = shards
            with timed(phases, "encode"):
                self.sender.encode()
                encoded = torch.cuda.Event()  # receivers in other processes read the board once this rank is ready
                encoded.record(stream)
                wait_event(
                    encoded,
                    deadline,
                    lambda: TransferTimeout(f"sync rank {self.rank}: delta encoding not done before the deadline"),
                )
            if self._board_shards is None or self._board_shards[0] is not shards:
                self._board_shards = (shards, self.sender.board_shards(shards))
            shards = self._board_shards[1]
        # the same views as last time alias the same storages: only other views need checking
        if self.export is None or (self.exported_from is not shards and not self.export.matches(shards)):
            with timed(phases, "export"):
                self.export = export_shards(shards, self.export)
                self.generation += 1
                link.publish(self.generation, self.export.to_wire())
        self.exported_from = shards
        with timed(phases, "ready"):
            link.ready(self.generation)

    def applied(self) -> None:
        """Every receiver applied this version: a delta sender's encoded words become its baseline."""
        if self.sender is not None:
            self.sender.confirm()

    def received_digests(self) -> dict[int, tuple[int, int]] | None:
        executor = self.executor
        return executor.received_digests() if isinstance(executor, IpcExecutor) else None

    @property
    def held_bytes(self) -> int:
        held = self.sender.held_bytes if self.sender is not None else 0
        return held + (int(getattr(self.executor, "staging_bytes", 0) or 0) if self.executor is not None else 0)

    def abort(self) -> None:
        """Keep the export and the opened exports (still valid, and their generations tell peers what is new);
        the next plan builds a new executor."""
        self.plan = self.executor = None

    def let_go(self) -> None:
        """A receiver closes the trainers' memory it opened and drops its executor (its copies address that memory);
        a trainer drops its export (the next version exports anew, under a new generation) and a delta sender."""
        opened = [source for _, source, _ in self.opened.values()]
        self.opened, self.executor, self._built_from = {}, None, None
        self.export, self.exported_from, self.sender, self._board_shards = None, None, None, None
        for source in opened:
            source.close()

    def close(self) -> None:
        """Drop the executor and close the other processes' memory opened here. A receiver must close (or exit)
        before the trainers whose memory it opened exit: PyTorch counts those references in the trainer's
        memory."""
        opened = [source for _, source, _ in self.opened.values()]
        self.opened, self.executor, self.plan, self.export, self.exported_from = {}, None, None, None, None
        self.sender, self._board_shards = None, None
        for source in opened:
            source.close()
