"""Helpers shared by the engine layout modules."""

from __future__ import annotations


def pad_to(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


def check_divides(what: str, part: int, whole: int) -> None:
    if part <= 0 or whole % part:
        raise ValueError(f"{what}: {whole} is not divisible by {part}")


def refuse_unplaced(tensors, engine: str) -> None:
    """``ValueError`` for models whose tensors this engine's layout does not place yet: multi-head latent attention
    (DeepSeek-V3, R1, Kimi-K2) and DeepSeek-style MoE (shared experts, FP32 router bias; also GLM-4.5). Their
    canonical tables and HF layouts exist; guessing how an engine shards them would move bytes to wrong places."""
    names = [t.name for t in tensors]
    if any(n.endswith("kv_a_proj_with_mqa.weight") for n in names):
        raise ValueError(f"{engine}: multi-head latent attention (DeepSeek-V3 / Kimi-K2) has no {engine} layout yet")
    if any(n.endswith("e_score_correction_bias") for n in names):
        raise ValueError(f"{engine}: DeepSeek-style MoE (shared experts, router score bias) has no {engine} layout yet")
