"""What the GPU benchmarks share: the scenarios (engines on GPUs, transport), the model and its layouts, the
engine-native parameters each rank holds, the canonical values a step writes and the check that every received
view equals them bit for bit, and the launcher of worker processes. ``bench_gpu``, ``bench_checkpoint_engine``,
``bench_upstream_awex`` and the GPU tests import these from here (no benchmark imports another's helpers)."""

from __future__ import annotations

import math
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

MODELS = Path(__file__).resolve().parents[2] / "models"
GIB = 1 << 30


@dataclass(frozen=True)
class Engine:
    instance: str
    kind: str  # "megatron" (trainer) or "vllm" (receiver)
    tp: int
    gpus: tuple[int, ...]
    dp: int = 1  # trainer data-parallel replicas (Megatron ranks: TP fastest)


@dataclass(frozen=True)
class Scenario:
    name: str
    what: str
    engines: tuple[Engine, ...]
    transport: str  # "nccl", "ipc" or "shm"
    gpus: int


SCENARIOS = [
    Scenario(
        "1gpu_to_1gpu",
        "1 trainer GPU -> 1 inference GPU, separate processes",
        (Engine("trainer", "megatron", 1, (0,)), Engine("vllm-0", "vllm", 1, (1,))),
        "nccl",
        2,
    ),
    Scenario(
        "mcore_tp2_to_vllm_tp2",
        "Megatron TP=2 -> vLLM TP=2",
        (Engine("trainer", "megatron", 2, (0, 1)), Engine("vllm-0", "vllm", 2, (2, 3))),
        "nccl",
        4,
    ),
    Scenario(
        "mcore_tp2_to_2x_vllm_tp1",
        "Megatron TP=2 -> two vLLM TP=1 instances (resharding + fan-out)",
        (
            Engine("trainer", "megatron", 2, (0, 1)),
            Engine("vllm-0", "vllm", 1, (2,)),
            Engine("vllm-1", "vllm", 1, (3,)),
        ),
        "nccl",
        4,
    ),
    Scenario(
        "1gpu_to_3_instances",
        "1 trainer GPU -> 3 vLLM TP=1 instances (fan-out)",
        (
            Engine("trainer", "megatron", 1, (0,)),
            Engine("vllm-0", "vllm", 1, (1,)),
            Engine("vllm-1", "vllm", 1, (2,)),
            Engine("vllm-2", "vllm", 1, (3,)),
        ),
        "nccl",
        4,
    ),
    # the same host, separate GPUs, through CUDA IPC: receivers pull with their copy engines over NVLink
    Scenario(
        "1gpu_to_1gpu_ipc",
        "1 trainer GPU -> 1 inference GPU, separate processes, CUDA IPC pull",
        (Engine("trainer", "megatron", 1, (0,)), Engine("vllm-0", "vllm", 1, (1,))),
        "ipc",
        2,
    ),
    Scenario(
        "mcore_tp2_to_vllm_tp2_ipc",
        "Megatron TP=2 -> vLLM TP=2 on other GPUs of the host, CUDA IPC pull",
        (Engine("trainer", "megatron", 2, (0, 1)), Engine("vllm-0", "vllm", 2, (2, 3))),
        "ipc",
        4,
    ),
    Scenario(
        "mcore_tp2_to_2x_vllm_tp1_ipc",
        "Megatron TP=2 -> two vLLM TP=1 instances on other GPUs, CUDA IPC pull",
        (
            Engine("trainer", "megatron", 2, (0, 1)),
            Engine("vllm-0", "vllm", 1, (2,)),
            Engine("vllm-1", "vllm", 1, (3,)),
        ),
        "ipc",
        4,
    ),
    # the same host through page-locked host shared memory: device-to-host into the segment, host-to-device out
    Scenario(
        "1gpu_to_1gpu_shm",
        "1 trainer GPU -> 1 inference GPU, separate processes, through pinned /dev/shm (public path only)",
        (Engine("trainer", "megatron", 1, (0,)), Engine("vllm-0", "vllm", 1, (1,))),
        "shm",
        2,
    ),
    Scenario(
        "colocated_1gpu_ipc",
        "colocated on one GPU, CUDA IPC, in place",
        (Engine("trainer", "megatron", 1, (0,)), Engine("vllm-0", "vllm", 1, (0,))),
        "ipc",
        1,
    ),
    Scenario(
        "colocated_tp2_to_tp1_per_gpu",
        "colocated Megatron TP=2 with a vLLM TP=1 engine on each of the two GPUs",
        (
            Engine("trainer", "megatron", 2, (0, 1)),
            Engine("vllm-0", "vllm", 1, (0,)),
            Engine("vllm-1", "vllm", 1, (1,)),
        ),
        "ipc",
        2,
    ),
    # the common RL colocation: a data-parallel trainer over all GPUs, one engine replica per GPU; every engine
    # reads the trainer replica on its own GPU (planner locality), nothing crosses NVLink
    Scenario(
        "colocated_dp2_to_2x_tp1",
        "colocated Megatron TP=1 x DP=2 with a vLLM TP=1 engine on each of the two GPUs",
        (
            Engine("trainer", "megatron", 1, (0, 1), dp=2),
            Engine("vllm-0", "vllm", 1, (0,)),
            Engine("vllm-1", "vllm", 1, (1,)),
        ),
        "ipc",
        2,
    ),
]


def scenario_devices(scenario: Scenario) -> tuple[tuple[str, int, str], ...]:
    """Each rank's GPU, for plans that take pieces from the same GPU where it holds them (CUDA IPC)."""
    return tuple((e.instance, r, f"gpu{g}") for e in scenario.engines for r, g in enumerate(e.gpus))


# ----------------------------------------------------------------------------------------------- model side


def auto_transport(scenario: Scenario, sources, dests, fp8: bool = False) -> str:
    """What ``transport="auto"`` (the writers' default) picks for this scenario's GPUs: "ipc" or "nccl" (``fp8``:
    the trainer quantises wave by wave, as the writer does with ``refresh_by_wave``)."""
    from awex.meta import PlanOptions, plan_transfers
    from awex.meta.transport_choice import choose_transport

    devices = tuple((i, r, f"host/GPU-{g.removeprefix('gpu')}") for i, r, g in scenario_devices(scenario))
    ipc = plan_transfers(sources, dests, PlanOptions(relay=False, devices=devices))
    p2p = plan_transfers(sources, dests, PlanOptions(relay=True))
    return {"ipc": "ipc", "p2p": "nccl"}[choose_transport(ipc, p2p, devices, refresh_by_wave=fp8).transport]


def model_tensors(model: str, layers: int | None):
    import dataclasses

    from awex.meta import canonical_tensors, load_config
    from awex.meta.models import model_dims

    dims = model_dims(load_config(MODELS / f"{model}.json"), "bfloat16")
    if layers:
        dims = dataclasses.replace(dims, layers=layers)
    return dims, canonical_tensors(dims)


def layouts_of(scenario: Scenario, tensors):
    from awex.meta.layouts import MegatronParallel, VllmParallel, megatron_layout, vllm_layout

    out = []
    for e in scenario.engines:
        if e.kind == "megatron":
            out.append(megatron_layout(tensors, MegatronParallel(tp=e.tp, dp=e.dp), instance=e.instance))
        else:
            out.append(vllm_layout(tensors, VllmParallel(tp=e.tp), instance=e.instance))
    return out


class NamedParams:
    """Just enough of a module for ``megatron_views``: named parameters over a dict, and no buffers (the benchmark's
    models have no MoE router score bias)."""

    def __init__(self, params):
        self._params = params

    def named_parameters(self):
        return iter(self._params.items())

    def named_buffers(self):
        return iter(())


def native_params(engine: Engine, local_rank: int, dims, device, quant=None, flat: bool = False):
    """An engine rank's parameters: trainers in bf16 (they quantise on the fly for FP8 receivers), receivers in
    vLLM's layout, with FP8 weights and their scales when ``quant`` is given.

    ``flat``: the trainer's parameters are views of one contiguous buffer, as Megatron-core's DDP keeps them
    (its param-and-grad buffers); otherwise each parameter is its own allocation (as under FSDP2)."""
    import torch

    from awex.convert import (
        MegatronNames,
        megatron_param_shapes,
        megatron_views,
        vllm_param_dtypes,
        vllm_param_shapes,
        vllm_views,
    )
    from awex.meta.layouts import MegatronParallel, VllmParallel

    if engine.kind == "megatron":
        where = MegatronNames(local_rank % engine.tp, 0, MegatronParallel(tp=engine.tp, dp=engine.dp))
        shapes = megatron_param_shapes(dims, where)[0]
        if flat:
            sizes = {n: -(-math.prod(s) // 64) * 64 for n, s in shapes.items()}  # starts 128-byte aligned
            buffer = torch.zeros(sum(sizes.values()), dtype=torch.bfloat16, device=device)
            params, at = {}, 0
            for n, s in shapes.items():
                params[n] = buffer[at : at + math.prod(s)].view(s)
                at += sizes[n]
        else:
            params = {n: torch.zeros(s, dtype=torch.bfloat16, device=device) for n, s in shapes.items()}
        return params, megatron_views(NamedParams(params), dims, where)
    parallel = VllmParallel(tp=engine.tp)
    shapes = vllm_param_shapes(dims, parallel, local_rank, quant=quant)
    dtypes = vllm_param_dtypes(shapes, "bfloat16", quant)
    params = {n: torch.zeros(s, dtype=dtypes[n], device=device) for n, s in shapes.items()}
    return params, vllm_views(params, dims, parallel, tp_rank=local_rank)


def canonical_value(name: str, shape, step: int, device):
    """The trainer's value of a canonical tensor at ``step`` (deterministic, generated on the GPU)."""
    import torch

    g = torch.Generator(device=device)
    g.manual_seed(zlib.crc32(name.encode()) * 1000 + step)
    return torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)


def sparse_value(name: str, shape, step: int, device, fraction: float = 0.01):
    """Like :func:`canonical_value` at step 1; each later step changes about ``fraction`` of the elements of the
    step before (by about 1%, most of them by a few units in the last place): what an RL step looks like to a
    delta sync."""
    import torch

    value = canonical_value(name, shape, 1, device)
    for s in range(2, step + 1):
        g = torch.Generator(device=device)
        g.manual_seed(zlib.crc32(name.encode()) * 1000 + 500 + s)
        mask = torch.rand(value.shape, generator=g, device=device) < fraction
        value = torch.where(mask, (value.float() * 1.01 + 1e-3).to(torch.bfloat16), value)
    return value


def expected_value(layout, name: str, step: int, device, quant=None):
    """What a receiver must hold: the trainer's value, or for FP8 receivers that value quantised (weight or
    scale) by the same rule the trainer applies."""
    from awex.convert import quantize_fp8_blocks
    from awex.meta.quant import SCALE_SUFFIX

    spec = layout.tensor(name).spec
    if quant is not None and name.endswith(SCALE_SUFFIX):
        base = name.removesuffix(SCALE_SUFFIX)
        return quantize_fp8_blocks(canonical_value(base, layout.tensor(base).spec.shape, step, device), quant.block)[1]
    if quant is not None and spec.dtype == quant.dtype:
        return quantize_fp8_blocks(canonical_value(name, spec.shape, step, device), quant.block)[0]
    return canonical_value(name, spec.shape, step, device)


def fill(shards, layout, step, device, value=None):
    """Each view of ``shards`` gets its box of ``value(name, shape, step, device)`` (:func:`canonical_value`)."""
    value = value or canonical_value
    for name in shards.names():
        full = value(name, layout.tensor(name).spec.shape, step, device)
        for box, view in shards.pairs(name):
            view.copy_(full[box.slices()])


def bits(t):
    import torch

    return t.view(torch.uint8) if t.element_size() == 1 else t


def mismatches(shards, layout, step, device, quant=None, value=None) -> list[str]:
    """The boxes of ``shards`` that differ from what the trainer held at ``step`` (``value``: as :func:`fill`)."""
    import torch

    bad = []
    for name in shards.names():
        if value is not None:
            full = value(name, layout.tensor(name).spec.shape, step, device)
        else:
            full = expected_value(layout, name, step, device, quant)
        for box, view in shards.pairs(name):
            if not torch.equal(bits(view), bits(full[box.slices()])):
                bad.append(f"{name} {box}")
    return bad


# ----------------------------------------------------------------------------------------------- limits


def launch_workers(
    argv: list[list[str]], timeout: float, env, module: str = "awex_integration.benchmarks.bench_gpu"
) -> list[tuple[int, str]]:
    """Run ``python -m module *args`` for every ``args`` at once; ``(return code, output)`` of each, all killed
    once ``timeout`` seconds have passed."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", module, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for args in argv
    ]
    deadline = time.monotonic() + timeout
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            out = (out or "") + "\n[timed out]"
        outs.append((p.returncode, out))
    return outs
