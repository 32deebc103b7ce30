"""One rank of a GPU benchmark scenario (``bench_gpu --worker``): builds the trainer's or engine's weights, runs
the syncs on the path asked for and the baselines, and checks every view bit for bit."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from awex_integration.benchmarks.bench_baselines import baselines
from awex_integration.benchmarks.bench_common import (
    SCENARIOS,
    fill,
    layouts_of,
    model_tensors,
    native_params,
)
from awex_integration.benchmarks.bench_paths import _executor_path, _public_path

# ----------------------------------------------------------------------------------------------- worker


@dataclass
class WorkerArgs:
    scenario: str
    model: str
    layers: int | None
    rank: int  # sync-world rank (plan order)
    world: int
    instance: str
    local_rank: int
    gpu: int
    ports: list[int]
    workdir: str
    iters: int
    baseline_iters: int
    wave_mb: float
    fp8: bool = False
    trainer_buffer: str = "per-param"
    extra: dict = field(default_factory=dict)


def worker(a: WorkerArgs) -> dict:
    import torch
    import torch.distributed as dist

    from awex.convert import Fp8Views
    from awex.meta import Fp8BlockQuant, Role, quantize_layout
    from awex.transport import LocalShards

    torch.cuda.set_device(a.gpu)
    device = torch.device("cuda", a.gpu)
    scenario = next(s for s in SCENARIOS if s.name == a.scenario)
    dims, tensors = model_tensors(a.model, a.layers)
    base_layouts = layouts_of(scenario, tensors)
    quant = Fp8BlockQuant() if a.fp8 else None
    on_receive = bool(a.extra.get("fp8_on_receive"))  # receivers quantise from the trainer's bf16 (CUDA IPC)
    layouts = (
        [quantize_layout(lay, quant) if lay.role == Role.INFERENCE or not on_receive else lay for lay in base_layouts]
        if quant
        else base_layouts
    )
    sources = [lay for lay in layouts if lay.role == Role.TRAINER]
    dests = [lay for lay in layouts if lay.role == Role.INFERENCE]
    engine = next(e for e in scenario.engines if e.instance == a.instance)
    layout = next(lay for lay in layouts if lay.instance == a.instance)
    trainer = engine.kind == "megatron"

    # control group (gloo): barriers and timing only
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.ports[0]}", rank=a.rank, world_size=a.world)

    def barrier():
        dist.barrier()

    def span(t0: float, t1: float) -> float:
        x = torch.tensor([t0, t1], dtype=torch.float64)
        out = [torch.zeros(2, dtype=torch.float64) for _ in range(a.world)]
        dist.all_gather(out, x)
        return max(float(o[1]) for o in out) - min(float(o[0]) for o in out)

    own: list[float] = []  # this rank's seconds in each timed call (diagnosis: start skew between ranks)
    late: list[float] = []  # how late this rank reached the common start, where it did

    def start_together() -> float:
        """A barrier, then every rank waits for one instant rank 0 picked a few milliseconds ahead: the ranks of a
        benchmark share one host's monotonic clock (which ``span`` relies on too), so every timed call starts on
        all ranks within microseconds instead of the barrier's release skew (0.1-0.5 ms over gloo)."""
        barrier()
        torch.cuda.synchronize()
        instant = torch.tensor([time.perf_counter() + 0.005], dtype=torch.float64)
        dist.broadcast(instant, 0)
        start = float(instant)
        now = time.perf_counter()
        if now > start:
            late.append(now - start)
        while now < start:
            now = time.perf_counter()
        return now

    def timed(fn, pause: float = 0.0, starts: bool = True) -> float:
        """Seconds from the common start of ``fn`` on every rank to the last rank finishing it. ``pause``: this rank
        first pauses that long after the common start (a trainer's step: the time runs from its call of ``fn``);
        ``starts=False``: this rank's start is not the span's (a receiver already waiting when that step ends)."""
        t0 = start_together()
        if pause:
            time.sleep(pause)
            t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        own.append(t1 - t0)
        return span(t0 if starts else math.inf, t1)

    params, view_of = native_params(
        engine, a.local_rank, dims, device, None if trainer else quant, flat=a.trainer_buffer == "flat"
    )
    base_layout = next(lay for lay in base_layouts if lay.instance == a.instance)
    quantize = None
    if trainer:
        weights = LocalShards.from_layout(base_layout, a.local_rank, view_of)  # the bf16 weights themselves
        fill(weights, base_layout, 1, device)
        if quant and not on_receive:  # FP8 receivers: this rank quantises into FP8 tiles before each sync (timed)
            fp8_views = Fp8Views(layout, a.local_rank, view_of, quant)
            view_of, quantize = fp8_views.view_of, fp8_views.quantize
            quantize()
    shards = LocalShards.from_layout(layout, a.local_rank, view_of)
    torch.cuda.synchronize()
    result: dict = {"rank": a.rank, "instance": a.instance, "gpu": a.gpu, "trainer": trainer}
    result["_base_alloc"] = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)

    # ---- Awex: first sync (everything built) and steady state
    if a.extra.get("path", "public") == "public":
        plan, shards = _public_path(
            a,
            scenario,
            layout,
            trainer,
            view_of,
            weights if trainer else None,
            base_layout,
            quantize,
            fp8_views if trainer and quant and not on_receive else None,
            result,
            barrier,
            span,
            timed,
            device,
            quant,
        )
    else:
        plan = _executor_path(
            a,
            scenario,
            sources,
            dests,
            layout,
            shards,
            trainer,
            quantize,
            fp8_views if trainer and quant else None,
            weights if trainer else None,
            base_layout,
            result,
            barrier,
            span,
            timed,
            device,
            quant,
        )
    result["plan"] = {
        "waves": plan.stats.waves,
        "relayed_bytes": plan.stats.relayed_bytes,
        "total_bytes": plan.stats.total_bytes,
    }

    # ---- baselines
    result["own_seconds"] = own[:]
    result["late_starts"] = late[:]
    result["baselines"] = (
        baselines(a, scenario, plan, layouts, shards, layout, trainer, device, barrier, timed, quant)
        if a.baseline_iters
        else {}
    )
    dist.barrier()
    return result
