"""The limits a GPU benchmark's syncs are measured against: the link and copy lower bound of a plan and the bound
of one fused copy kernel (``bench_gpu``'s ratios are to these, measured in the same run)."""

from __future__ import annotations


def sources_ranks(plan):
    return [r for r in plan.ranks if r.role.value == "trainer"]


def dest_ranks(plan):
    return [r for r in plan.ranks if r.role.value != "trainer"]


def lower_bound(plan, gpu_of: dict[int, int], link_bps: float, copy_bps: float) -> tuple[float, dict]:
    """Seconds the busiest GPU needs at the measured limits (see the module docstring); plan without relay."""
    inbound: dict[int, int] = {}
    outbound: dict[int, int] = {}
    local: dict[int, int] = {}
    unique_out: set = set()
    for b in plan.buckets:
        gs, gd = gpu_of[b.src], gpu_of[b.dst]
        if gs == gd:
            local[gd] = local.get(gd, 0) + b.nbytes
            continue
        inbound[gd] = inbound.get(gd, 0) + b.nbytes
        for t in b.transfers:
            if (gs, t) not in unique_out:  # what only this GPU holds leaves it at least once
                unique_out.add((gs, t))
                outbound[gs] = outbound.get(gs, 0) + t.nbytes
    worst = 0.0
    for g in set(inbound) | set(outbound) | set(local):
        remote = max(inbound.get(g, 0), outbound.get(g, 0))
        worst = max(worst, remote / link_bps if remote else 0.0, local.get(g, 0) / copy_bps)
    return worst, {"inbound": inbound, "outbound": outbound, "local": local}


def fused_bound(plan, gpu_of: dict[int, int], copy_bps: float) -> float | None:
    """Seconds the busiest GPU needs to quantise on the copy (``plan``: quantising on receive, every piece read on
    its own GPU): each quantised weight's bytes read once and half of them (FP8) written, the rest copied, at the
    device's memory rate (twice ``copy_bps``, which counts each byte copied once); ``None`` where a piece crosses
    GPUs."""
    quantised = {i for i, t in enumerate(plan.tensors) if t.name in {q[0] for q in plan.quantized}}
    traffic: dict[int, float] = {}
    for b in plan.buckets:
        if gpu_of[b.src] != gpu_of[b.dst]:
            return None
        for t in b.transfers:
            traffic[gpu_of[b.dst]] = traffic.get(gpu_of[b.dst], 0) + t.nbytes * (1.5 if t.tensor in quantised else 2)
    return max(traffic.values(), default=0.0) / (2 * copy_bps)
