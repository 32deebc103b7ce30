"""Model features whose engine-native parameters an engine's views do not map, refused before any view is made.

Latent attention and DeepSeek-style MoE need each engine's own names and fusions (Megatron's
``linear_q_down_proj``, vLLM's ``fused_qkv_a_proj``, routers held in float32); an architecture with them is synced
only once its views are written and tested against the real engine, and listed in that engine's ``MAPPED``
(DeepSeek-V3 / R1 / Kimi-K2 and GLM-4.5 in vLLM and Megatron-core today). Any other such architecture is refused,
naming the feature, while plans and dry runs still place it.
"""

from __future__ import annotations

from awex.meta.errors import AwexValueError
from awex.meta.models import ARCHITECTURES, ModelDims


def refuse_unconverted(dims: ModelDims, engine: str, mapped: tuple[str, ...] = ()) -> None:
    """``ValueError`` naming the feature when ``engine``'s views cannot map this model's parameters; ``mapped``:
    the architectures with such features that ``engine``'s views do map."""
    arch = ARCHITECTURES[dims.architecture]
    if dims.architecture in mapped:
        return
    if arch.attention == "mla":
        what = "multi-head latent attention (DeepSeek-V3 / Kimi-K2)"
    elif arch.moe == "deepseek":
        what = "DeepSeek-style MoE (shared experts, router score bias)"
    else:
        return
    raise AwexValueError(
        f"{engine}: {dims.architecture}: Awex does not map {engine}'s parameters of {what} yet; "
        f"plans and dry runs work (awex-meta plan), a live {engine} sync does not (HF engines and trainers do)"
    )
