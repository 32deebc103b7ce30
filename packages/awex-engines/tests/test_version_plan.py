"""What a version is planned with (``awex.engines.sync.version_plan.plan_version``, pure, alike on every rank): with
``quantize_on_receive=True`` an engine on another GPU than its source is refused with what to do instead, before
any byte moves; on the source's GPU the plan quantises on receive."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from awex.engines.sync.manifest import SyncManifest
from awex.engines.sync.options import SyncOptions
from awex.engines.sync.places import Places
from awex.engines.sync.version_plan import plan_version
from awex.meta import Fp8BlockQuant, canonical_tensors, quantize_layout
from awex.meta.layouts import MegatronParallel, VllmParallel, megatron_layout, vllm_layout
from awex.meta.transport_choice import TransportError

TINY = json.loads((Path(__file__).resolve().parents[3] / "integration" / "models" / "qwen2-tiny.json").read_text())


@pytest.mark.parametrize("engine_gpu", ["GPU-0", "GPU-1"])
def test_quantising_on_receive_is_planned_only_on_the_sources_gpu(engine_gpu):
    tensors = canonical_tensors(TINY)
    layouts = {
        "trainer": megatron_layout(tensors, MegatronParallel(tp=1), instance="trainer"),
        "vllm-0": quantize_layout(
            vllm_layout(tensors, VllmParallel(tp=1), instance="vllm-0"), Fp8BlockQuant(block=(16, 16))
        ),
    }
    manifest = SyncManifest(
        version="v1",
        sources=("trainer",),
        destinations=("vllm-0",),
        host="127.0.0.1",
        port=1,
        options=SyncOptions(transport="ipc", quantize_on_receive=True),
    )
    where = Places(
        devices=[("trainer", 0, "h/GPU-0"), ("vllm-0", 0, f"h/{engine_gpu}")],
        reach={("vllm-0", 0): ["h/GPU-0", "h/GPU-1"]},
        hosts={"h"},
        processes={("trainer", 0): ("h", 1, None), ("vllm-0", 0): ("h", 2, None)},
    )
    if engine_gpu == "GPU-0":
        plan, transport, _ = plan_version(manifest, layouts, where)
        assert transport == "ipc" and plan.quantized
    else:
        with pytest.raises(TransportError, match=r"vllm-0:0 would quantise .* on h/GPU-0.*Fp8Views"):
            plan_version(manifest, layouts, where)
