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


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    base = load_json(MODELS / "qwen2-tiny.json")
    root = tmp_path_factory.mktemp("models")
    q3_untied = {**base, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32, "num_hidden_layers": 4}
    moe = load_json(MODELS / "qwen3-moe-tiny.json")
    moe2 = load_json(MODELS / "qwen2-moe-tiny.json")
    deepseek = load_json(MODELS / "deepseek-v3-tiny.json")
    glm = load_json(MODELS / "glm4-moe-tiny.json")
    return {
        "glm-4.5": (make_tiny_model(root / "glm-4.5", glm), glm),
        "deepseek-v3": (make_tiny_model(root / "deepseek-v3", deepseek), deepseek),
        "qwen3-moe": (make_tiny_model(root / "qwen3-moe", moe), moe),
        "qwen2-moe": (make_tiny_model(root / "qwen2-moe", moe2), moe2),
        "qwen2": (make_tiny_model(root / "qwen2", base), base),
        "qwen3": (make_tiny_model(root / "qwen3-untied", q3_untied), q3_untied),
        "qwen3-tied": (
            make_tiny_model(
                root / "qwen3",
                q3 := {
                    **base,
                    "architectures": ["Qwen3ForCausalLM"],
                    "head_dim": 32,
                    "tie_word_embeddings": True,
                    "num_hidden_layers": 4,
                    "vocab_size": 997,
                },
            ),
            q3,
        ),
    }


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
    model_dir, config = models[model]
    world = parallel.world_size
    port = free_port()
    jobs = [(r, check_conversion, (r, world, port, parallel, config, str(model_dir))) for r in range(world)]
    out = run_processes(jobs, timeout=180)
    failures = {r: v for r, (s, v) in out.items() if s != "ok"}
    assert not failures, failures
    assert len(out) == world
