"""Awex's Megatron views of ``GroupedMLP`` experts (``weight1`` / ``weight2``), checked against Megatron-core 0.12's
own module: the Megatron MindSpeed patches for Ascend NPUs (its ``--moe-grouped-gemm`` experts are this class);
and that Megatron-core 0.12's local-spec ``GPTModel`` has the parameter names and shapes Awex's views expect.

Megatron-core 0.19 (what the rest of Awex's Megatron tests run) no longer has ``GroupedMLP``, so this runs with
megatron-core 0.12.1 first on ``sys.path`` (``--megatron`` DIR: it installed there with ``pip install --no-deps
--target DIR``). It builds Megatron's ``GroupedMLP`` on CPU, writes random canonical (HF) expert weights into it
through :func:`awex.convert.megatron.megatron_views`, runs Megatron's own ``forward`` and compares it with each
expert computed from the canonical weights (``down(silu(gate(x)) * up(x))``). The grouped GEMM kernel itself
(``grouped_gemm``, CUDA) is replaced, for this check only, by the same product in plain torch (``x_e @ w[e]``,
``trans_b=False``, as Megatron calls it); everything else is Megatron's code.

    python -m awex_integration.checks.grouped_mlp_check --megatron DIR

Prints the largest difference (relative to the largest output); exits non-zero when an expert's output differs
(with ``--self-test``: when views that swap gate and up go unnoticed).
"""

from __future__ import annotations

import argparse
import os
import sys


def grouped_gemm(x, w, batch_sizes, trans_b=False):
    """What ``grouped_gemm.ops.gmm`` computes: rows of ``x`` in expert order, each block times its expert's ``w``."""
    import torch

    out, start = [], 0
    for e, n in enumerate(batch_sizes.tolist()):
        out.append(x[start : start + n] @ (w[e].t() if trans_b else w[e]))
        start += n
    return torch.cat(out)


def check(experts: int = 4, hidden: int = 16, ffn: int = 8, tokens_per_expert: int = 3, swap: bool = False) -> float:
    """The largest difference between Megatron's forward and the canonical experts, relative to the largest output
    (``swap``: write gate where up goes and up where gate goes, the self-test's deliberate bug)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.moe import experts as megatron_experts
    from megatron.core.transformer.moe import grouped_gemm_util
    from megatron.core.transformer.transformer_config import TransformerConfig

    from awex.convert.megatron import MegatronNames, megatron_views
    from awex.meta import canonical_tensors
    from awex.meta.layouts import MegatronParallel, megatron_layout
    from awex.meta.models import model_dims

    grouped_gemm_util.grouped_gemm_is_available = lambda: True
    grouped_gemm_util.assert_grouped_gemm_is_available = lambda: None
    grouped_gemm_util.ops = type("ops", (), {"gmm": staticmethod(grouped_gemm)})
    config = TransformerConfig(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=2,
        ffn_hidden_size=4 * hidden,
        moe_ffn_hidden_size=ffn,
        num_moe_experts=experts,
        gated_linear_unit=True,
        activation_func=F.silu,
        moe_grouped_gemm=True,
        use_cpu_initialization=True,
        add_bias_linear=False,
        bias_activation_fusion=False,
    )
    grouped = megatron_experts.GroupedMLP(experts, config)
    model = torch.nn.Module()  # the names a GPTModel gives it: decoder.layers.0.mlp.experts.*
    model.decoder = torch.nn.Module()
    model.decoder.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.decoder.layers[0].mlp = torch.nn.Module()
    model.decoder.layers[0].mlp.experts = grouped
    hf = dict(
        architectures=["Qwen3MoeForCausalLM"],
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        moe_intermediate_size=ffn,
        num_experts=experts,
        num_experts_per_tok=2,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=hidden // 2,
        vocab_size=128,
        tie_word_embeddings=False,
    )
    dims = model_dims(hf, "float32")
    parallel = MegatronParallel()
    layout = megatron_layout(canonical_tensors(dims), parallel, instance="trainer")
    view_of = megatron_views(model, dims, MegatronNames(0, 0, parallel))
    g = torch.Generator().manual_seed(0)
    canonical = {}
    with torch.no_grad():
        for name, boxes in layout.rank_boxes(0).items():
            if ".experts." not in name:
                continue
            full = canonical[name] = torch.randn(layout.tensor(name).spec.shape, generator=g)
            target = name
            if swap and name.endswith(("gate_proj.weight", "up_proj.weight")):
                target = name.replace("gate_proj", "\0").replace("up_proj", "gate_proj").replace("\0", "up_proj")
            for box in boxes:
                view_of(target, box).copy_(full[box.slices()])
        x = torch.randn(experts * tokens_per_expert, hidden, generator=g)
        counts = torch.full((experts,), tokens_per_expert)
        ours, _ = grouped(x, counts, torch.ones(x.shape[0]))
    worst, scale = 0.0, 0.0
    for e in range(experts):
        pre = f"model.layers.0.mlp.experts.{e}."
        xe = x[e * tokens_per_expert : (e + 1) * tokens_per_expert]
        gate, up, down = (canonical[pre + f"{p}_proj.weight"] for p in ("gate", "up", "down"))
        want = (F.silu(xe @ gate.t()) * (xe @ up.t())) @ down.t()
        got = ours[e * tokens_per_expert : (e + 1) * tokens_per_expert]
        worst = max(worst, float((got - want).abs().max()))
        scale = max(scale, float(want.abs().max()))
    return worst / scale


def dense_names_differ() -> dict:
    """Megatron-core 0.12's local-spec GPTModel (Qwen3 shape, QK norms) against the names and shapes Awex's
    Megatron views expect (:func:`~awex.convert.megatron.megatron_param_shapes`); empty when equal."""
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from awex.convert.megatron import MegatronNames, megatron_param_shapes
    from awex.meta.layouts import MegatronParallel
    from awex.meta.models import model_dims

    hf = dict(
        architectures=["Qwen3ForCausalLM"],
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=1000,
        tie_word_embeddings=False,
    )
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=96,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=16,
        use_cpu_initialization=True,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        qk_layernorm=True,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=True),
        vocab_size=1024,
        max_sequence_length=64,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )
    theirs = {n: tuple(p.shape) for n, p in model.named_parameters()}
    ours = megatron_param_shapes(model_dims(hf, "float32"), MegatronNames(0, 0, MegatronParallel()))[0]
    return {n: (theirs.get(n), ours.get(n)) for n in set(theirs) | set(ours) if theirs.get(n) != ours.get(n)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--megatron", required=True, help="a directory holding megatron-core 0.12.1 (pip --target)")
    ap.add_argument("--self-test", action="store_true", help="check instead that swapped gate/up weights are caught")
    args = ap.parse_args(argv)
    sys.path.insert(0, args.megatron)
    import megatron.core
    import torch.distributed as dist
    from megatron.core import parallel_state

    print(f"megatron-core {megatron.core.__version__} from {os.path.dirname(megatron.core.__file__)}")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29591")
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    differ = dense_names_differ()
    print(f"local-spec GPTModel parameters vs Awex's names and shapes: {'equal' if not differ else differ}")
    worst = check(swap=args.self_test)
    ok = worst < 1e-5
    what = "gate and up swapped (must differ)" if args.self_test else "Awex-written weights"
    print(f"GroupedMLP forward with {what} vs each canonical expert: max |diff| / max |out| = {worst:.3g}")
    dist.destroy_process_group()
    return 0 if ok != args.self_test and not differ else 1


if __name__ == "__main__":
    sys.exit(main())
