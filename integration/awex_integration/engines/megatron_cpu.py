"""Build and run a Megatron-core GPTModel on CPU over gloo, shaped like an HF config (test harness)."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.nn.functional as F

from awex.meta.layouts import MegatronParallel
from awex.meta.models import ARCHITECTURES, ModelDims


def _latent_core_attention():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class LatentCoreAttention(DotProductAttention):
        """Megatron's local core attention, taking MLA's ``k_channels`` / ``v_channels`` (test harness: building
        the model for its parameters; not used for logits)."""

        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)

    return LatentCoreAttention


def init_distributed(rank: int, world: int, port: int, parallel: MegatronParallel) -> None:
    import torch.distributed as dist

    from awex_integration.engines import megatron_cpu_patches

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    megatron_cpu_patches.apply()
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp if parallel.vpp > 1 else None,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.etp,
    )


def build_gpt(dims: ModelDims, parallel: MegatronParallel, dtype: torch.dtype = torch.float32):
    """A GPTModel (local layer spec) for this rank's pipeline stage, or the list of its VPP chunks."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from awex.meta.layouts.common import pad_to

    kwargs = {}
    if dims.num_experts:  # MoE: SequentialMLP experts, allgather dispatcher (the alltoall one needs CUDA streams)
        kwargs.update(
            num_moe_experts=dims.num_experts,
            moe_ffn_hidden_size=dims.moe_intermediate,
            moe_router_topk=2,
            expert_model_parallel_size=parallel.ep,
            expert_tensor_parallel_size=parallel.etp,
            moe_grouped_gemm=False,
            moe_token_dispatcher_type="allgather",
            moe_layer_freq=[1 if i in dims.sparse_layers else 0 for i in range(dims.layers)],
        )
        if dims.shared_expert_intermediate:  # Qwen2-MoE: a shared expert with a sigmoid gate
            kwargs.update(
                moe_shared_expert_intermediate_size=dims.shared_expert_intermediate, moe_shared_expert_gate=True
            )
    arch = ARCHITECTURES[dims.architecture]
    if arch.moe == "deepseek" and dims.num_experts:  # sigmoid router with an FP32 score bias, shared experts
        kwargs.update(
            moe_shared_expert_intermediate_size=dims.shared_expert_intermediate or None,
            moe_shared_expert_gate=False,
            moe_router_enable_expert_bias=True,
            moe_router_score_function="sigmoid",
        )
    if parallel.first or parallel.last:
        kwargs.update(
            num_layers_in_first_pipeline_stage=parallel.first or None,
            num_layers_in_last_pipeline_stage=parallel.last or None,
        )
    if dims.kv_lora_rank:  # DeepSeek-V3's multi-head latent attention
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        config_class = MLATransformerConfig
        kwargs.update(
            q_lora_rank=dims.q_lora_rank or None,
            kv_lora_rank=dims.kv_lora_rank,
            qk_head_dim=dims.qk_nope_dim,
            qk_pos_emb_head_dim=dims.qk_rope_dim,
            v_head_dim=dims.v_head_dim,
            rope_type="rope",
        )
    else:
        config_class = TransformerConfig
    config = config_class(
        num_layers=dims.layers,
        hidden_size=dims.hidden,
        ffn_hidden_size=dims.intermediate,
        num_attention_heads=dims.heads,
        num_query_groups=dims.kv_heads,
        kv_channels=dims.head_dim,
        use_cpu_initialization=True,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp if parallel.vpp > 1 else None,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=dims.attention_bias,
        qk_layernorm=dims.qk_norm or bool(dims.kv_lora_rank),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        **kwargs,
    )
    spec = get_gpt_layer_local_spec(
        normalization="RMSNorm",
        qk_layernorm=config.qk_layernorm,
        num_experts=dims.num_experts or None,
        moe_grouped_gemm=False,
        multi_latent_attention=bool(dims.kv_lora_rank),
    )
    mixed = bool(dims.num_experts) and len(dims.sparse_layers) < dims.layers  # dense first layers (DeepSeek)

    def layer_spec(vp_stage=None):
        if not mixed:
            chosen = spec
        else:
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

            chosen = get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=vp_stage)
        if dims.kv_lora_rank:  # Megatron's local DotProductAttention does not take MLA's per-part head sizes
            for one_spec in getattr(chosen, "layer_specs", [chosen]):
                one_spec.submodules.self_attention.submodules.core_attention = _latent_core_attention()
        return chosen

    vocab = pad_to(dims.vocab, parallel.vocab_pad * parallel.tp)

    def one(vp_stage=None):
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        return GPTModel(
            config=config,
            transformer_layer_spec=layer_spec(vp_stage),
            vocab_size=vocab,
            max_sequence_length=512,
            pre_process=pre,
            post_process=post,
            position_embedding_type="rope",
            rotary_base=10000,
            share_embeddings_and_output_weights=dims.tie_embeddings,
            vp_stage=vp_stage,
        )

    # Without Transformer Engine or Apex, Megatron's torch norms keep fp32 weights; TE keeps every parameter
    # in params_dtype, which is what RL trainers run: match it.
    chunks = [one(v).to(dtype) for v in range(parallel.vpp)] if parallel.vpp > 1 else [one().to(dtype)]
    for chunk in chunks:  # as Megatron's router does before every forward: its score bias stays float32
        for module in chunk.modules():
            if hasattr(module, "_maintain_float32_expert_bias"):
                module._maintain_float32_expert_bias()
    return chunks if parallel.vpp > 1 else chunks[0]


def expert_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_rank()


def coordinates(parallel: MegatronParallel) -> tuple[int, int]:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    seq = ids.shape[1]
    pos = torch.arange(seq)[None]
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)[None, None]
    return model(input_ids=ids, position_ids=pos, attention_mask=mask)
