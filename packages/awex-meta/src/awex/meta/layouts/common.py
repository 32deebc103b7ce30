"""Helpers shared by the engine layout modules."""

from __future__ import annotations


def pad_to(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


def check_divides(what: str, part: int, whole: int) -> None:
    if part <= 0 or whole % part:
        raise ValueError(f"{what}: {whole} is not divisible by {part}")
