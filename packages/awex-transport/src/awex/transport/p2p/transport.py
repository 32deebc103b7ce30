"""The point-to-point transport (:class:`P2pTransport`): a process group of the sync's own, each version run by a
:class:`~awex.transport.p2p.waves.WaveExecutor` (or, for delta syncs, a
:class:`~awex.transport.p2p.delta.DeltaExecutor`) built once per plan and views."""

from __future__ import annotations

import time
from collections.abc import MutableMapping

from awex.meta import Plan
from awex.meta.errors import AwexValueError
from awex.transport.accelerator import GROUPED, p2p_backend
from awex.transport.base import PeerLink, RefreshByWave, Setup, TransferStats, Transport, timed
from awex.transport.group import SyncGroup, create_sync_group
from awex.transport.p2p.delta import DeltaExecutor
from awex.transport.p2p.digesting import WaveDigests
from awex.transport.p2p.waves import WaveExecutor
from awex.transport.shards import LocalShards


class P2pTransport(Transport):
    """Point to point over a process group of the sync's own: NCCL for CUDA views, HCCL for Ascend NPU views
    (torch-npu), gloo for CPU views. Relayed plans, waves through staging buffers."""

    name = "p2p"
    signals_ready = False
    refreshes_by_wave = True
    carries_delta = True

    def __init__(self) -> None:
        self.group: SyncGroup | None = None
        self._rendezvous: tuple | None = None
        self.plan: Plan | None = None
        self.rank = -1
        self._executor: WaveExecutor | None = None
        self._built_from: LocalShards | None = None  # the views the executor was built from
        self._before_pack: tuple | None = None  # (refresh_by_wave, executor, its per-wave callable)
        self._delta: tuple[bool, int | None] = (False, None)  # delta syncs, and what a sender may keep
        self._digests: tuple[WaveExecutor, WaveDigests] | None = None  # verify mode: built per executor

    def prepare(self, plan: Plan, rank: int, setup: Setup, phases: MutableMapping[str, float]) -> None:
        rendezvous = (setup.host, setup.port, plan.world_size, rank, setup.rendezvous, setup.secret)
        if self.group is None or self._rendezvous != rendezvous:
            backend = p2p_backend(setup.device)
            self._drop_group()
            with timed(phases, "group"):
                self.group = create_sync_group(
                    rank,
                    plan.world_size,
                    setup.host,
                    setup.port,
                    backend=backend,
                    timeout=max(1.0, setup.deadline - time.monotonic()),
                    prefix=f"awex/{setup.host}:{setup.port}",
                    device=setup.device if backend in GROUPED else None,
                    secret=setup.secret,
                )
            self._rendezvous = rendezvous
        self.plan, self.rank = plan, rank
        self._executor = self._before_pack = None
        self._delta = (setup.delta, setup.delta_budget_bytes)

    def run(
        self,
        shards: LocalShards,
        link: PeerLink,
        deadline: float,
        phases: MutableMapping[str, float],
        refresh_by_wave: RefreshByWave | None = None,
    ) -> TransferStats:
        self._prepared(self.plan if self.group is not None else None)
        if self._delta[0]:
            return self._run_delta(shards, link, deadline, phases, refresh_by_wave)
        if self._executor is None or self._built_from is not shards:  # built once per plan, and again for views
            with timed(phases, "executor"):  # of memory that moved (the writer or reader re-bound them)
                self._executor, self._built_from = WaveExecutor(self.plan, self.rank, shards, self.group), shards
        executor = self._executor
        before_pack = None
        if refresh_by_wave is not None:
            cached = self._before_pack
            if cached is None or cached[0] is not refresh_by_wave or cached[1] is not executor:
                cached = self._before_pack = (refresh_by_wave, executor, refresh_by_wave(executor.sent_regions))
            before_pack = cached[2]
        digests = None
        if link.digests:  # verify mode: both sides digest each wave's regions while later waves move
            if self._digests is None or self._digests[0] is not executor:
                with timed(phases, "executor"):
                    self._digests = (executor, WaveDigests(self.plan, self.rank, shards))
            digests = self._digests[1]
        link.moving()
        with timed(phases, "transfer"):  # the session's work beside runs once the first waves are on the wire
            return executor.run(
                timeout=max(0.1, deadline - time.monotonic()),
                before_pack=before_pack,
                meanwhile=link.meanwhile,
                digests=digests,
                watch=link.watch,
            )

    def received_digests(self) -> dict[int, tuple[int, int]] | None:
        return self._read_digests(1)

    def sent_digests(self) -> dict[int, tuple[int, int]] | None:
        return self._read_digests(0)

    def _read_digests(self, side: int) -> dict[int, tuple[int, int]] | None:
        found = self._digests
        if found is None or found[0] is not self._executor or not found[1].fresh or self._delta[0]:
            return None
        return found[1].read()[side]

    def _run_delta(self, shards, link: PeerLink, deadline: float, phases, refresh_by_wave) -> TransferStats:
        if refresh_by_wave is not None:
            raise AwexValueError("delta syncs need no FP8 on the fly")
        if self._executor is None or self._built_from is not shards:
            with timed(phases, "executor"):
                self._executor = DeltaExecutor(self.plan, self.rank, shards, self.group, self._delta[1])
                self._built_from = shards
        link.moving()
        with timed(phases, "transfer"):
            return self._executor.run(timeout=max(0.1, deadline - time.monotonic()), watch=link.watch)

    @property
    def held_bytes(self) -> int:
        return self._executor.staging_bytes if self._executor is not None else 0

    def let_go(self) -> None:
        """The executor and what it built over the views (staging, digests); the group stays."""
        self._executor = self._built_from = self._before_pack = self._digests = None

    def abort(self) -> None:
        """Abort an NCCL group (local: its kernels waiting on a dead peer end, its watchdog stops); the next
        plan joins a new one."""
        self._drop_group()
        self.plan = self._executor = self._before_pack = self._digests = None

    def close(self) -> None:
        """Drop the group without shutting it down: shutting NCCL communicators down gracefully is collective,
        and a closing rank must not wait for peers that are not closing (released with the process)."""
        self.group = self._rendezvous = None
        self.plan = self._executor = self._before_pack = self._digests = None

    def _drop_group(self) -> None:
        group, self.group, self._rendezvous = self.group, None, None
        if group is not None and group.backend in GROUPED:
            group.abort()
