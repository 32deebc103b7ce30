"""Model features whose engine-native parameters this package does not map yet, refused before any view is made.

The planner's layouts place multi-head latent attention and DeepSeek-style MoE for Megatron-core and vLLM
(``awex-meta plan`` dry runs), but views of a live engine's parameters need the engine's own names and fusions
(Megatron's ``linear_q_down_proj``/``linear_kv_up_proj``; vLLM's GLM-4.5 experts); until they are written and
tested against the real engines, a sync refuses such a model. vLLM's DeepSeek-V3 (R1, Kimi-K2) is mapped.
"""

from __future__ import annotations

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
    raise ValueError(
        f"{engine}: {dims.architecture}: Awex does not map {engine}'s parameters of {what} yet; "
        f"plans and dry runs work (awex-meta plan), a live {engine} sync does not (HF engines and trainers do)"
    )
