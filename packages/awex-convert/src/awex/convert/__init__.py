"""awex.convert: views of each engine's native parameters, addressed by canonical (HF-style) tensor boxes.

A converter answers, for one rank, "where in my native memory is box B of canonical tensor T": one view, or
several pieces when the native layout interleaves (Megatron's fused QKV per query group). Senders read from
these views and receivers write into them, so nothing is gathered and nothing is copied twice.

- :mod:`awex.convert.megatron`: Megatron-core ``GPTModel`` (fused QKV by query group, fused gate/up,
  TP/PP/VPP, padded vocabulary, tied embeddings, local and Transformer-Engine layer specs).
- :mod:`awex.convert.hf`: HF models (identity).
- :mod:`awex.convert.vllm`: vLLM's fused ``qkv_proj`` / ``gate_up_proj``, padded vocabulary, TP/PP, for the
  in-place path on plain (GPU) parameters; on CPU, vLLM prepacks its linear weights, so the CPU receiver goes
  through vLLM's own weight loaders instead (``awex.engines.vllm_backend``).

Which rank holds which box (the layout) is torch-free arithmetic in ``awex.meta.layouts``.
"""

from awex.convert.hf import hf_views
from awex.convert.megatron import MegatronNames, megatron_param_shapes, megatron_views
from awex.convert.vllm import vllm_param_shapes, vllm_views

__version__ = "0.1.0"

__all__ = [
    "MegatronNames", "hf_views", "megatron_param_shapes", "megatron_views", "vllm_param_shapes", "vllm_views",
]
