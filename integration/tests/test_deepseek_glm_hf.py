"""DeepSeek-V3 (also R1 and Kimi-K2) and GLM-4.5 with real HF transformers models on CPU: the canonical tables
name exactly what transformers saves (multi-head latent attention, dense first layers, routed and shared experts,
the router's FP32 score bias), and an HF trainer syncs into an HF engine bit-exact with greedy output equal to a
reference with the same weights, in float32 and in bfloat16 (the score bias stays FP32). Megatron-core and vLLM
for these models: test_megatron_convert.py and test_deepseek_glm_vllm.py."""

from __future__ import annotations

import pytest
from conftest import MODELS
from scenario_run import run_scenario

pytest.importorskip("transformers", reason="transformers is not installed in this environment")

TINY = ["deepseek-v3-tiny.json", "glm4-moe-tiny.json"]


def _needs_architecture(model: str) -> None:
    """Skip where this transformers has no class for the model (GLM-4.5 came in 4.55; older floors lack it)."""
    import json

    import transformers

    arch = json.loads((MODELS / model).read_text())["architectures"][0]
    if not hasattr(transformers, arch):
        pytest.skip(f"transformers {transformers.__version__} has no {arch}")


@pytest.mark.parametrize("model", TINY)
def test_the_table_names_exactly_what_transformers_saves(model, tmp_path):
    from safetensors.torch import load_file

    from awex.meta import canonical_tensors
    from awex_integration.engines.tiny_model import load_json, make_tiny_model

    _needs_architecture(model)
    config = load_json(MODELS / model)
    saved = load_file(str(make_tiny_model(tmp_path / "m", config, dtype="bfloat16") / "model.safetensors"))
    tensors = {t.name: t for t in canonical_tensors(config, dtype="bfloat16")}
    assert set(tensors) == set(saved)
    for name, t in tensors.items():
        assert tuple(saved[name].shape) == t.spec.shape, name
        assert str(saved[name].dtype).removeprefix("torch.") == t.spec.dtype, name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model", TINY)
def test_hf_trainer_to_hf_engine_is_bit_exact(model, dtype):
    _needs_architecture(model)
    import transformers
    from packaging.version import Version

    if dtype == "bfloat16" and Version(transformers.__version__) < Version("4.56"):
        pytest.skip(
            f"transformers {transformers.__version__} loads the FP32 router score bias in bfloat16: the sync moves it "
            "as bfloat16 (both sides hold that), but the check's FP32 reference checkpoint then differs by the rounding"
        )
    result = run_scenario(
        ["--trainer", "hf", "--inference", "hf", "--model-config", str(MODELS / model), "--dtype", dtype]
    )
    assert result["ok"], result.get("error") or result.get("trainer_errors") or result
    assert result["tensors_checked"] > 0 and result["tensors_mismatched"] == 0
    assert result["greedy_match"] is True
