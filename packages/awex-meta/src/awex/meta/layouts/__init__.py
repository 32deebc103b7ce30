"""Layout arithmetic of each engine, without torch: where each canonical tensor lives on which rank.

These functions turn an engine's parallel configuration (Megatron TP/PP/EP/DP, vLLM TP/PP/DP/EP, SGLang
TP/PP/EP with DP attention, a single HF model) and the model's canonical tensors (:mod:`awex.meta.models`) into
:class:`~awex.meta.layout.Layout`s.
The planner CLI uses them for dry runs; the engine bindings in ``awex-engines`` use the same functions, and
``awex-convert``'s tests check them against the real engines' parameters.
"""

from awex.meta.layouts.hf import hf_layout
from awex.meta.layouts.megatron import MegatronParallel, megatron_layout
from awex.meta.layouts.sglang import SglangParallel, sglang_engine_layout, sglang_layout
from awex.meta.layouts.spec import EngineSpec, layouts_for, parse_engine_spec
from awex.meta.layouts.vllm import VllmParallel, vllm_engine_layout, vllm_layout

__all__ = [
    "EngineSpec",
    "MegatronParallel",
    "SglangParallel",
    "VllmParallel",
    "hf_layout",
    "layouts_for",
    "megatron_layout",
    "parse_engine_spec",
    "sglang_engine_layout",
    "sglang_layout",
    "vllm_engine_layout",
    "vllm_layout",
]
