"""awex.convert.megatron against real Megatron-core GPTModels on CPU (gloo): HF -> native -> HF bit-exact,
every native parameter reached, logits equal to HF transformers' (dense models; MoE routing numerics differ).
DeepSeek-V3's latent attention is built with Megatron's local spec and a harness core attention that takes its
per-part head sizes (``awex_integration.engines.megatron_cpu``)."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed in this environment")
pytest.importorskip("transformers", reason="transformers is not installed in this environment")

from conftest import MODELS, full_only  # noqa: E402

from awex.meta.layouts import MegatronParallel  # noqa: E402
from awex_integration.engines.megatron_workers import check_conversion  # noqa: E402
from awex_integration.engines.tiny_model import load_json, make_tiny_model  # noqa: E402
from awex_integration.scenarios.spawn import free_port, run_processes  # noqa: E402


def _configs() -> dict[str, dict]:
    base = load_json(MODELS / "qwen2-tiny.json")
    qwen3 = {**base, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32, "num_hidden_layers": 4}
    return {
        "glm-4.5": load_json(MODELS / "glm4-moe-tiny.json"),
        "deepseek-v3": load_json(MODELS / "deepseek-v3-tiny.json"),
        "qwen3-moe": load_json(MODELS / "qwen3-moe-tiny.json"),
        "qwen2-moe": load_json(MODELS / "qwen2-moe-tiny.json"),
        "qwen2": base,
        "qwen3": qwen3,
        "qwen3-tied": {**qwen3, "tie_word_embeddings": True, "vocab_size": 997},
    }


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Each case's tiny HF model (directory, config), built the first time a case asks for it; a case whose model
    this transformers has no class for is skipped (GLM-4.5 came in 4.55: the floors session runs 4.51)."""
    import transformers

    root, configs, built = tmp_path_factory.mktemp("models"), _configs(), {}

    def model(name: str):
        if name not in built:
            config = configs[name]
            arch = config["architectures"][0]
            if not hasattr(transformers, arch):
                pytest.skip(f"transformers {transformers.__version__} has no {arch}")
            built[name] = (make_tiny_model(root / name, config), config)
        return built[name]

    return model


@pytest.mark.parametrize(
    "model, parallel",
    [
        ("qwen2", MegatronParallel(tp=1, vocab_pad=1)),
        pytest.param(
            "qwen2", MegatronParallel(tp=2, vocab_pad=128), marks=full_only("qwen3-tied-tp2 (TP=2, a padded vocab)")
        ),
        ("qwen2", MegatronParallel(tp=2, pp=2)),
        ("qwen3-tied", MegatronParallel(tp=2, vocab_pad=128)),
        # tied embeddings with pp > 1 make Megatron call .cuda() while building: not runnable on a CPU machine
        ("qwen3", MegatronParallel(pp=2, vpp=2)),
        # MoE (SequentialMLP experts): expert parallel over data-parallel ranks, and over tensor-parallel ones
        ("qwen3-moe", MegatronParallel(dp=2, ep=2, vocab_pad=128)),
        pytest.param(
            "qwen3-moe",
            MegatronParallel(tp=2, ep=2, vocab_pad=128),
            marks=full_only("qwen2-moe-tp2-ep2 (experts over tensor-parallel ranks)"),
        ),
        # Qwen2-MoE: a TP-split shared expert with its sigmoid gate next to the routed experts
        ("qwen2-moe", MegatronParallel(tp=2, ep=2, vocab_pad=128)),
        # DeepSeek-V3: latent attention (the local spec splits its down-projections over TP), a dense first layer,
        # routed experts beside shared ones, the router's FP32 score bias (a buffer)
        ("deepseek-v3", MegatronParallel(tp=2, ep=2, vocab_pad=128, latent_down_split=True)),
        # GLM-4.5: biased QKV and q/k norms, a dense first layer, routed and shared experts, the FP32 score bias
        ("glm-4.5", MegatronParallel(tp=2, ep=2, vocab_pad=128)),
    ],
    ids=[
        "qwen2-tp1",
        "qwen2-tp2",
        "qwen2-tp2-pp2",
        "qwen3-tied-tp2",
        "qwen3-pp2-vpp2",
        "qwen3-moe-dp2-ep2",
        "qwen3-moe-tp2-ep2",
        "qwen2-moe-tp2-ep2",
        "deepseek-v3-tp2-ep2",
        "glm-4.5-tp2-ep2",
    ],
)
def test_megatron_views_round_trip(models, model, parallel):
    model_dir, config = models(model)
    world = parallel.world_size
    port = free_port()
    jobs = [(r, check_conversion, (r, world, port, parallel, config, str(model_dir))) for r in range(world)]
    out = run_processes(jobs, timeout=180)
    failures = {r: v for r, (s, v) in out.items() if s != "ok"}
    assert not failures, failures
    assert len(out) == world
