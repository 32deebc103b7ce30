"""The transfer plan: what every rank sends and receives, in which order.

A plan is computed independently on every rank by :func:`awex.meta.planner.plan_transfers` (a pure function of
the layouts and options) and is identical everywhere; :attr:`Plan.digest` lets ranks check that they agree.

Regions are in canonical coordinates: the source and destination box of a transfer are the same region of the
canonical tensor. Each side turns it into a view of its own native memory by subtracting the offset of the box
it holds (:meth:`awex.meta.box.Box.relative_to`); native addressing never crosses the wire.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import NamedTuple

from awex.meta.box import Box
from awex.meta.spec import RankDescriptor, Role, TensorSpec

RELAY_LAG = 2
"""Waves between a relay destination receiving a region and forwarding it.

A transport double-buffers waves (it packs wave ``w + 1`` while wave ``w`` is on the wire and unpacks wave
``w`` while wave ``w + 1`` is), so what arrives in wave ``w`` is in the receiver's memory before it packs wave
``w + 2``.
"""


class Transfer(NamedTuple):
    """One region of one canonical tensor moved from a source rank to a destination rank."""

    tensor: int  # index into Plan.tensors
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    nbytes: int

    @property
    def region(self) -> Box:
        return Box(self.offsets, self.sizes)


@dataclass(frozen=True, slots=True)
class Bucket:
    """Transfers between one (source, destination) pair in one wave, moved together (one message, or a few
    where transfers of at least ``PlanOptions.direct_bytes`` travel alone).

    ``wave`` is the global step the bucket belongs to: every rank posts all its buckets of a wave together
    and waves run in increasing order (:mod:`awex.meta.schedule`). ``seq`` numbers the pair's buckets.
    A bucket whose ``src`` is an inference rank is a relay: that rank received the same regions at least
    :data:`RELAY_LAG` waves earlier. In a ``PlanOptions.broadcast`` plan, buckets one source sends alike to
    several destinations in one wave go as one broadcast (a pair may then have two buckets in a wave).
    """

    wave: int
    src: int
    dst: int
    seq: int
    transfers: tuple[Transfer, ...]
    nbytes: int


class Step(NamedTuple):
    """One entry of a rank's schedule: send or receive ``bucket`` to or from ``peer`` (in ``bucket.wave``)."""

    op: str  # "send" or "recv"
    peer: int
    bucket: Bucket


@dataclass(frozen=True)
class PlanStats:
    """Summary numbers of a plan (all byte counts are payload bytes)."""

    total_bytes: int
    tensors: int
    ops: int
    buckets: int
    waves: int
    max_rank_send_bytes: int
    max_rank_recv_bytes: int
    lower_bound_send_bytes: int
    lower_bound_recv_bytes: int
    redundant_bytes: int
    plan_seconds: float
    relayed_bytes: int = 0
    nic_bound_bytes: int = 0  # with PlanOptions.topology: the least the busiest NIC must move (else 0)

    @property
    def lower_bound_bytes(self) -> int:
        """The least the busiest rank must send or receive for these layouts (sources sending, no relay)."""
        return max(self.lower_bound_send_bytes, self.lower_bound_recv_bytes)

    @property
    def send_balance(self) -> float:
        """Achieved busiest-sender volume over its lower bound (1.0 is perfect)."""
        return self.max_rank_send_bytes / self.lower_bound_send_bytes if self.lower_bound_send_bytes else 1.0


@dataclass(frozen=True)
class Plan:
    """A complete, deterministic transfer plan for one sync world."""

    ranks: tuple[RankDescriptor, ...]
    tensors: tuple[TensorSpec, ...]
    buckets: tuple[Bucket, ...]  # sorted by (wave, src, dst)
    stats: PlanStats
    options: object
    casts: tuple[tuple[str, str, str], ...] = ()  # (tensor, source dtype, destination dtype) converted on the way
    # (weight, FP8 dtype, scale tensor, tile block) that receivers quantise from the source's dtype
    # (PlanOptions.quantize_on_receive)
    quantized: tuple[tuple[str, str, str, tuple[int, int]], ...] = ()
    _by_rank: dict[int, tuple[int, ...]] = field(default=None, init=False, repr=False, compare=False)  # type: ignore[assignment]
    _digest: str = field(default="", init=False, repr=False, compare=False)
    _index: dict = field(default=None, init=False, repr=False, compare=False)  # type: ignore[assignment]

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def ranks_of(self, role: Role) -> list[RankDescriptor]:
        """The ranks of one side, in sync-rank order (indexed once: a sync asks every version)."""
        return list(self._indexed()[1].get(Role(role), ()))

    def rank(self, instance: str, local_rank: int) -> RankDescriptor:
        """The sync-world descriptor of ``local_rank`` of engine instance ``instance``."""
        found = self._indexed()[0].get((instance, local_rank))
        if found is None:
            raise KeyError(f"no rank {local_rank} of instance {instance!r} in this plan")
        return found

    def instance_ranks(self, instance: str) -> list[RankDescriptor]:
        """The ranks of engine (or trainer) instance ``instance``, in sync-rank order."""
        return list(self._indexed()[2].get(instance, ()))

    def _indexed(self) -> tuple[dict, dict, dict]:
        """``(by (instance, local rank), by role, by instance)``, built once."""
        if self._index is None:
            by_name: dict[tuple[str, int], RankDescriptor] = {}
            by_role: dict[Role, list[RankDescriptor]] = {}
            by_instance: dict[str, list[RankDescriptor]] = {}
            for r in self.ranks:
                by_name.setdefault((r.instance, r.local_rank), r)  # the first, as a search in order finds
                by_role.setdefault(r.role, []).append(r)
                by_instance.setdefault(r.instance, []).append(r)
            frozen = [{k: tuple(v) for k, v in d.items()} for d in (by_role, by_instance)]
            object.__setattr__(self, "_index", (by_name, *frozen))
        return self._index

    def schedule(self, rank: int) -> list[Step]:
        """The operations of one rank, wave by wave (within a wave, in bucket order)."""
        if self._by_rank is None:
            index: dict[int, list[int]] = {}
            for i, b in enumerate(self.buckets):
                index.setdefault(b.src, []).append(i)
                index.setdefault(b.dst, []).append(i)
            object.__setattr__(self, "_by_rank", {k: tuple(v) for k, v in index.items()})
        steps = []
        for i in self._by_rank.get(rank, ()):
            b = self.buckets[i]
            steps.append(Step("send", b.dst, b) if b.src == rank else Step("recv", b.src, b))
        return steps

    @property
    def digest(self) -> str:
        """SHA-256 of the plan's canonical encoding: equal on every rank that planned the same inputs."""
        if not self._digest:
            object.__setattr__(self, "_digest", plan_digest(self))
        return self._digest

    def summary(self) -> dict:
        """The plan's numbers as one JSON-ready mapping."""
        s = self.stats
        return {
            "total_bytes": s.total_bytes,
            "tensors": s.tensors,
            "ops": s.ops,
            "buckets": s.buckets,
            "waves": s.waves,
            "relayed_bytes": s.relayed_bytes,
            **({"nic_bound_bytes": s.nic_bound_bytes} if s.nic_bound_bytes else {}),
            "ranks": self.world_size,
            "trainer_ranks": len(self.ranks_of(Role.TRAINER)),
            "inference_ranks": len(self.ranks_of(Role.INFERENCE)),
            "max_rank_send_bytes": s.max_rank_send_bytes,
            "max_rank_recv_bytes": s.max_rank_recv_bytes,
            "lower_bound_send_bytes": s.lower_bound_send_bytes,
            "lower_bound_recv_bytes": s.lower_bound_recv_bytes,
            "lower_bound_bytes": s.lower_bound_bytes,
            "send_balance": round(s.send_balance, 4),
            "redundant_bytes": s.redundant_bytes,
            "plan_seconds": round(s.plan_seconds, 3),
            "digest": self.digest,
            "casts": [list(c) for c in self.casts],
            **({"quantized_on_receive": len(self.quantized)} if self.quantized else {}),
        }


def plan_digest(plan: Plan) -> str:
    h = hashlib.sha256()
    h.update(b"awex-plan/3\n")
    h.update(f"D{plan.options.direct_bytes},{plan.options.broadcast}\n".encode())
    for r in plan.ranks:
        h.update(f"R{r.rank},{r.instance},{r.role.value},{r.local_rank}\n".encode())
    for t in plan.tensors:
        h.update(f"T{t.name},{t.shape},{t.dtype}\n".encode())
    for name, src, dst in plan.casts:
        h.update(f"C{name},{src},{dst}\n".encode())
    for name, fp8, scale, block in plan.quantized:
        h.update(f"Q{name},{fp8},{scale},{block}\n".encode())
    text: dict[int, str] = {}  # transfers are shared between destinations: format each once
    for b in plan.buckets:
        parts = [f"B{b.wave},{b.src},{b.dst},{b.seq},{b.nbytes}\n"]
        for t in b.transfers:
            s = text.get(id(t))
            if s is None:
                s = text[id(t)] = f"{t.tensor},{t.offsets},{t.sizes};"
            parts.append(s)
        h.update("".join(parts).encode())
    return h.hexdigest()
