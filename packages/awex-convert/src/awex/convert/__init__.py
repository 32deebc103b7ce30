"""awex.convert: views of each engine's native parameters, addressed by canonical (HF-style) tensor boxes.

A converter answers, for one rank, "where in my native memory is box B of canonical tensor T": one view, or
several pieces when the native layout interleaves (Megatron's fused QKV per query group). Senders read from
these views and receivers write into them, so nothing is gathered and nothing is copied twice.

- :mod:`awex.convert.megatron`: Megatron-core ``GPTModel`` (fused QKV by query group, fused gate/up,
  TP/PP/VPP, padded vocabulary, tied embeddings, local and Transformer-Engine layer specs).
- :mod:`awex.convert.hf`: HF models (identity).
- :mod:`awex.convert.fp8`: block-quantised FP8 (128x128 tiles, ``weight_scale_inv``): quantise (one weight, or
  many pieces in one launch), dequantise, and a sender's FP8 views of its own weights (quantised on the fly
  before each write).
- :mod:`awex.convert.vllm`: vLLM's fused ``qkv_proj`` / ``gate_up_proj``, experts, padded vocabulary, TP/PP:
  the in-place path into vLLM's live parameters (``awex.engines.vllm_backend``; parameters vLLM transforms
  after loading, such as vLLM-CPU's prepacked linears, go through vLLM's weight loaders instead).

Which rank holds which box (the layout) is torch-free arithmetic in ``awex.meta.layouts``.
"""

from awex.convert.fp8 import BatchedFp8Quantizer, Fp8Views, dequantize_fp8_blocks, quantize_fp8_blocks
from awex.convert.hf import hf_views
from awex.convert.megatron import MegatronNames, megatron_param_shapes, megatron_views
from awex.convert.vllm import vllm_param_dtypes, vllm_param_name, vllm_param_shapes, vllm_views

__version__ = "0.1.0"

__all__ = [
    "BatchedFp8Quantizer",
    "Fp8Views",
    "MegatronNames",
    "dequantize_fp8_blocks",
    "hf_views",
    "megatron_param_shapes",
    "megatron_views",
    "quantize_fp8_blocks",
    "vllm_param_dtypes",
    "vllm_param_name",
    "vllm_param_shapes",
    "vllm_views",
]
