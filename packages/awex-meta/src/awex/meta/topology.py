"""Where ranks run and how fast their links are: nodes of GPUs, a NIC per GPU between nodes, NVLink inside one.

A :class:`Topology` places the ranks of a sync world on nodes (trainer and inference ranks on nodes of their own,
or inference ranks on the trainer's nodes) and gives each link class a rate. The planner uses it
(``PlanOptions(topology=...)``) to send bytes that several GPUs of one node need into that node once, over one
GPU's NIC, and fan them out over NVLink; :func:`estimate_seconds` prices a plan on it.

The cost model: every GPU has one NIC (sends and receives at ``nic`` bytes/s at once), one NVLink port
(``nvlink`` bytes/s each way) and a copy engine for bytes that stay on the GPU (``copy`` bytes/s). A wave lasts
as long as its busiest port; the sync is the sum of its waves (see :mod:`awex.meta.schedule`). Rates are inputs:
nominal ones for a dry run, the ones measured on the machine to check the model against a benchmark.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, Hashable, Sequence

from awex.meta.errors import AwexValueError
from awex.meta.spec import RankDescriptor, Role

PLACEMENTS = ("apart", "shared")
LINKS = ("nic", "nvlink", "copy")


@dataclass(frozen=True)
class Topology:
    """Nodes of ``gpus_per_node`` GPUs; link rates in gigabits per second per GPU and direction.

    ``placement``: ``apart`` puts trainer ranks on the first nodes and inference ranks on the nodes after them;
    ``shared`` puts inference rank ``i`` (in sync-world order) on the node of trainer rank ``i`` (colocated RL).
    Ranks fill nodes in sync-world order (instances sorted by name, local ranks in order), so a TP group of
    consecutive ranks shares a node. ``nvlink_gbps`` defaults to 3600 (450 GB/s each way, H100/H200 NVLink 4);
    ``copy_gbps`` is a device-to-device copy on one GPU.
    """

    gpus_per_node: int = 8
    nic_gbps: float = 400.0
    nvlink_gbps: float = 3600.0
    copy_gbps: float = 16000.0
    placement: str = "apart"

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1:
            raise AwexValueError("topology: gpus-per-node must be positive")
        for name in ("nic_gbps", "nvlink_gbps", "copy_gbps"):
            if not getattr(self, name) > 0:
                raise AwexValueError(f"topology: {name.replace('_', '-')} must be positive")
        if self.placement not in PLACEMENTS:
            raise AwexValueError(f"topology: placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}")

    @classmethod
    def parse(cls, text: str) -> Topology:
        """``gpus-per-node=8,nic-gbps=400,nvlink-gbps=3600,placement=apart`` (every key optional)."""
        known = {f.name.replace("_", "-"): f for f in fields(cls)}
        values: dict[str, object] = {}
        for item in filter(None, (s.strip() for s in text.split(","))):
            key, eq, value = item.partition("=")
            key = key.strip().lower()
            if not eq or key not in known:
                raise AwexValueError(f"topology: expected one of {', '.join(known)} as key=value, got {item!r}")
            f = known[key]
            try:
                values[f.name] = value.strip() if f.name == "placement" else (int if f.type == "int" else float)(value)
            except ValueError:
                raise AwexValueError(f"topology: {key} must be a number, got {value!r}") from None
        return cls(**values)

    def rate(self, link: str) -> float:
        """Bytes per second of one GPU's ``link`` (``nic``, ``nvlink`` or ``copy``) in one direction."""
        return {"nic": self.nic_gbps, "nvlink": self.nvlink_gbps, "copy": self.copy_gbps}[link] * 1e9 / 8

    def nodes(self, ranks: Sequence[RankDescriptor]) -> list[int]:
        """The node of every sync-world rank (indexed by rank)."""
        out = [0] * len(ranks)
        trainer = [r.rank for r in ranks if r.role == Role.TRAINER]
        inference = [r.rank for r in ranks if r.role != Role.TRAINER]
        g = self.gpus_per_node
        for i, rank in enumerate(trainer):
            out[rank] = i // g
        first = 0 if self.placement == "shared" else -(-len(trainer) // g)
        for i, rank in enumerate(inference):
            out[rank] = first + i // g
        return out


@dataclass(frozen=True)
class Placement:
    """Where each sync-world rank runs: its node and its GPU (``(node, gpu)`` names one physical GPU)."""

    node: tuple[int, ...]
    gpu: tuple[int, ...]

    @classmethod
    def of(
        cls, topology: Topology, ranks: Sequence[RankDescriptor], hosts: Sequence[tuple[str, int, str]] = ()
    ) -> Placement:
        """Every rank on a GPU of its own, on the node :meth:`Topology.nodes` gives it; ``shared`` placement puts
        inference rank ``i`` on the GPU of trainer rank ``i``.

        ``hosts`` (``(instance, local_rank, host)``, as the ranks of a job report them) overrides that: ranks on one
        host share a node, numbered in the order of their hosts' names; a rank whose host is not given has a node
        of its own; GPUs are numbered per host in sync-world order."""
        if hosts:
            known = {(i, r): h for i, r, h in hosts}
            names = sorted(set(known.values()))
            node_of = {h: n for n, h in enumerate(names)}
            node, gpu, count = [], [], {}
            for rank in ranks:
                host = known.get((rank.instance, rank.local_rank))
                n = node_of[host] if host is not None else len(names) + rank.rank
                node.append(n)
                gpu.append(count.get(n, 0))
                count[n] = count.get(n, 0) + 1
            return cls(tuple(node), tuple(gpu))
        node = topology.nodes(ranks)
        trainer = [r.rank for r in ranks if r.role == Role.TRAINER]
        gpu = [0] * len(ranks)
        for i, rank in enumerate(trainer):
            gpu[rank] = i % topology.gpus_per_node
        for i, rank in enumerate(r.rank for r in ranks if r.role != Role.TRAINER):
            gpu[rank] = i % topology.gpus_per_node
        return cls(tuple(node), tuple(gpu))

    def link(self, src: int, dst: int) -> str:
        """The link class between two ranks: ``copy`` on one GPU, ``nvlink`` in one node, ``nic`` across nodes."""
        if self.node[src] != self.node[dst]:
            return "nic"
        return "copy" if self.gpu[src] == self.gpu[dst] else "nvlink"

    def ports(self, topology: Topology) -> Callable[[int, int], tuple[Hashable, Hashable, float]]:
        """``(src, dst) -> (sending port, receiving port, seconds per byte)`` as :func:`estimate_seconds` prices
        them: a GPU's NIC or NVLink port in each direction, or its copy engine (one port) for a copy on one GPU
        (what the planner levels the waves with, ``awex.meta.schedule.assign_waves``)."""
        cost = {link: 1.0 / topology.rate(link) for link in LINKS}

        def port(src: int, dst: int) -> tuple[Hashable, Hashable, float]:
            link = self.link(src, dst)
            into = (self.node[dst], self.gpu[dst], link, "both" if link == "copy" else "in")
            if link == "copy":
                return into, into, cost[link]
            return (self.node[src], self.gpu[src], link, "out"), into, cost[link]

        return port


@dataclass(frozen=True)
class Estimate:
    """What a plan costs on a topology (seconds are estimates from the cost model, not measurements).

    ``busiest_nic_bytes``: the most one GPU's NIC sends or receives; ``nic_bound_bytes``: the least the busiest
    NIC must move (:attr:`awex.meta.plan.PlanStats.nic_bound_bytes`, 0 for a plan made without this topology;
    the bound's fields are then ``None``); ``useful_bytes_per_s_per_receiver``: the
    bytes an inference GPU ends up holding, on average, over the estimated seconds.
    """

    seconds: float
    nic_lower_bound_seconds: float
    busiest_nic_bytes: int
    nic_bound_bytes: int
    useful_bytes_per_s_per_receiver: float
    link_bytes: dict[str, int]

    def as_dict(self) -> dict:
        return {
            "estimated_seconds": round(self.seconds, 6),
            "nic_lower_bound_seconds": round(self.nic_lower_bound_seconds, 6) if self.nic_bound_bytes else None,
            "busiest_nic_bytes": self.busiest_nic_bytes,
            "nic_bound_bytes": self.nic_bound_bytes or None,
            "busiest_nic_over_bound": round(self.busiest_nic_bytes / self.nic_bound_bytes, 4)
            if self.nic_bound_bytes
            else None,
            "useful_gbps_per_receiver": round(self.useful_bytes_per_s_per_receiver / 1e9, 2),
            "link_bytes": dict(self.link_bytes),
        }


def estimate_seconds(
    plan, topology: Topology, placement: Placement | None = None, wave_seconds: float = 0.0
) -> Estimate:
    """Price ``plan`` on ``topology``: each wave lasts as long as its busiest port (a GPU's NIC, NVLink or copy
    engine, each direction apart), plus ``wave_seconds`` of fixed cost per wave; the sum over waves."""
    place = placement or Placement.of(topology, plan.ranks)
    port_of = place.ports(topology)  # the ports the planner levels its waves over (the same keys and costs)
    cost: dict[tuple, float] = {}  # seconds per byte of each port
    per_wave: dict[int, dict[tuple, int]] = {}  # per wave: (node, GPU, link, direction) -> bytes
    totals: dict[tuple, int] = {}
    link_bytes = dict.fromkeys(LINKS, 0)
    received = [0] * plan.world_size
    for b in plan.buckets:
        out, into, per_byte = port_of(b.src, b.dst)
        link_bytes[into[2]] += b.nbytes
        received[b.dst] += b.nbytes
        ports = per_wave.setdefault(b.wave, {})
        for key in (into,) if out == into else (out, into):
            cost[key] = per_byte
            ports[key] = ports.get(key, 0) + b.nbytes
            totals[key] = totals.get(key, 0) + b.nbytes
    seconds = sum(max(n * cost[k] for k, n in ports.items()) + wave_seconds for ports in per_wave.values())
    busiest_nic = max((n for k, n in totals.items() if k[2] == "nic"), default=0)
    bound = plan.stats.nic_bound_bytes
    receivers = [r.rank for r in plan.ranks if r.role != Role.TRAINER]
    useful = sum(received[r] for r in receivers) / len(receivers) / seconds if seconds and receivers else 0.0
    return Estimate(seconds, bound / topology.rate("nic"), busiest_nic, bound, useful, link_bytes)
