"""Helpers shared by the engine layout modules."""

from __future__ import annotations

from awex.meta.errors import AwexValueError
from awex.meta.layout import Shard


def pad_to(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


def check_divides(what: str, part: int, whole: int) -> None:
    if part <= 0 or whole % part:
        raise AwexValueError(f"{what}: {whole} is not divisible by {part}")


def kv_head_shard(what: str, kv_heads: int, tp: int, tp_name: str = "tp") -> Shard:
    """The split of a K or V projection's rows over ``tp`` ranks as vLLM and SGLang build it: by heads when the
    ranks do not outnumber the KV heads, else each head replicated on ``tp / kv_heads`` consecutive ranks.
    ``what`` and ``tp_name`` word the ``ValueError`` for sizes that do not fit."""
    if tp <= kv_heads:
        check_divides(f"{what}: KV heads must divide by {tp_name}", tp, kv_heads)
        return Shard(0)
    check_divides(f"{what}: {tp_name} must be a multiple of the KV heads", kv_heads, tp)
    return Shard(0, parts=kv_heads)
