"""What a version is planned with (``awex.engines.sync.version_plan.plan_version``, pure, alike on every rank): with
``quantize_on_receive=True`` an engine on another GPU than its source is refused with what to do instead, before
any byte moves; on the source's GPU the plan quantises on receive. With ``quantize_on_receive="auto"`` the receivers
quantise where every one of them reads on its own GPU over CUDA IPC, and the trainers everywhere else (other GPUs,
p2p, CPU ranks, verify mode)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from awex.engines.sync.manifest import SyncManifest
from awex.engines.sync.options import SyncOptions
from awex.engines.sync.places import Places
from awex.engines.sync.version_plan import plan_version
from awex.meta import Fp8BlockQuant, canonical_tensors, quantize_layout, sender_quant
from awex.meta.layouts import MegatronParallel, VllmParallel, megatron_layout, vllm_layout
from awex.meta.transport_choice import TransportError

TINY = json.loads((Path(__file__).resolve().parents[3] / "integration" / "models" / "qwen2-tiny.json").read_text())


def _setup(engine_gpu: str, fp8: bool = True, **options):
    tensors = canonical_tensors(TINY)
    engine = vllm_layout(tensors, VllmParallel(tp=1), instance="vllm-0")
    layouts = {
        "trainer": megatron_layout(tensors, MegatronParallel(tp=1), instance="trainer"),
        "vllm-0": quantize_layout(engine, Fp8BlockQuant(block=(16, 16))) if fp8 else engine,
    }
    manifest = SyncManifest(
        version="v1",
        sources=("trainer",),
        destinations=("vllm-0",),
        host="127.0.0.1",
        port=1,
        options=SyncOptions(**options),
    )
    devices = [("trainer", 0, "h/GPU-0" if engine_gpu else ""), ("vllm-0", 0, f"h/{engine_gpu}" if engine_gpu else "")]
    where = Places(
        devices=devices,
        reach={("vllm-0", 0): ["h/GPU-0", "h/GPU-1"]} if engine_gpu else {},
        hosts={"h"},
        processes={("trainer", 0): ("h", 1, None), ("vllm-0", 0): ("h", 2, None)},
        shm_ok=not engine_gpu,
    )
    return manifest, layouts, where


@pytest.mark.parametrize("engine_gpu", ["GPU-0", "GPU-1"])
def test_quantising_on_receive_is_planned_only_on_the_sources_gpu(engine_gpu):
    manifest, layouts, where = _setup(engine_gpu, transport="ipc", quantize_on_receive=True)
    if engine_gpu == "GPU-0":
        plan, transport, _, _ = plan_version(manifest, layouts, where)
        assert transport == "ipc" and plan.quantized
    else:
        with pytest.raises(TransportError, match=r"vllm-0:0 would quantise .* on h/GPU-0.*Fp8Views"):
            plan_version(manifest, layouts, where)


@pytest.mark.parametrize(
    "engine_gpu, options, transport, on_receive",
    [
        ("GPU-0", {}, "ipc", True),  # colocated: the receivers quantise as they copy
        ("GPU-0", {"transport": "ipc"}, "ipc", True),
        ("GPU-0", {"verify": True}, "ipc", False),  # verify mode: the trainer's FP8 bytes are what is compared
        ("GPU-1", {}, "p2p", False),  # another GPU: the trainer quantises, wave by wave over NCCL
        ("GPU-1", {"transport": "ipc"}, "ipc", False),  # over CUDA IPC too, all at once
        ("GPU-0", {"transport": "p2p"}, "p2p", False),
        ("", {}, "p2p", False),  # CPU ranks: no CUDA IPC, never quantised on receive
        ("", {"transport": "shm"}, "shm", False),
    ],
)
def test_fp8_auto_quantises_on_receive_only_where_every_receiver_reads_on_its_own_gpu(
    engine_gpu, options, transport, on_receive
):
    manifest, layouts, where = _setup(engine_gpu, quantize_on_receive="auto", **options)
    planned = plan_version(manifest, layouts, where)
    assert planned.transport == transport
    fp8 = {t.spec.name for t in layouts["vllm-0"].tensors if t.spec.dtype == "float8_e4m3fn"}
    assert len(fp8) == 14
    if on_receive:
        assert planned.send_quant is None and {q[0] for q in planned.plan.quantized} == fp8
    else:  # the plan moves the trainer's FP8 tiles and scales, exactly the receivers' quantised weights
        assert not planned.plan.quantized and planned.send_quant == sender_quant(
            [layouts["trainer"]], [layouts["vllm-0"]]
        )
        assert planned.send_quant.names == fp8 and planned.send_quant.block == (16, 16)
        moved = {planned.plan.tensors[t.tensor].name for b in planned.plan.buckets for t in b.transfers}
        assert {f"{n}_scale_inv" for n in fp8} <= moved
        assert all(planned.plan.tensors[i].dtype == "float8_e4m3fn" for i, s in enumerate(planned.plan.tensors)
                   if s.name in fp8)  # fmt: skip


def test_fp8_auto_with_bf16_receivers_quantises_nothing():
    manifest, layouts, where = _setup("GPU-0", fp8=False, quantize_on_receive="auto")
    planned = plan_version(manifest, layouts, where)
    assert planned.send_quant is None and not planned.plan.quantized and planned.transport == "ipc"
