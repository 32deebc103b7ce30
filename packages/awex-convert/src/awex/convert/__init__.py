"""awex.convert: views of each engine's native parameters, addressed by canonical (HF-style) tensor boxes.

A converter answers, for one rank, "where in my native memory is box B of canonical tensor T": one view, or
several pieces when the native layout interleaves (Megatron's fused QKV per query group). Senders read from
these views and receivers write into them, so nothing is gathered and nothing is copied twice.

- :mod:`awex.convert.megatron`: Megatron-core ``GPTModel`` (fused QKV by query group, fused gate/up,
  TP/PP/VPP, padded vocabulary, tied embeddings, local and Transformer-Engine layer specs).
- :mod:`awex.convert.hf`: HF models (identity).
- vLLM: the receiver goes through vLLM's own weight loaders (``awex.engines.vllm_backend``), so vLLM's native
  layout is whatever its loaders do; the layout arithmetic is in ``awex.meta.layouts.vllm``.

Which rank holds which box (the layout) is torch-free arithmetic in ``awex.meta.layouts``.
"""

from awex.convert.hf import hf_views
from awex.convert.megatron import MegatronNames, megatron_views

__version__ = "0.1.0"

__all__ = ["MegatronNames", "hf_views", "megatron_views"]
