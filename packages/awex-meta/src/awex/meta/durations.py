"""Durations as the MetaClient and the sync's options accept them."""

from __future__ import annotations

import math
from typing import Any

from awex.meta.errors import AwexValueError


def seconds(value: Any, what: str = "timeout", positive: bool = False) -> float:
    """``value`` as a number of seconds: finite and not negative (above 0 with ``positive``), else ``ValueError``
    naming ``what`` (a NaN deadline never passes and an infinite one overflows the clock)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise AwexValueError(f"{what}={value!r}: a finite number of seconds, not negative")
    if positive and value == 0:
        raise AwexValueError(f"{what}={value!r}: a number of seconds above 0")
    return float(value)
