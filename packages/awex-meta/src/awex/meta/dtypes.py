"""Dtype names and sizes, without torch.

Dtypes cross process boundaries as strings spelled as torch spells them without the ``torch.`` prefix
(``"bfloat16"``, ``"float8_e4m3fn"``). This module knows their sizes so that planning needs no torch.
"""

from __future__ import annotations

ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}

_ALIASES = {
    "float": "float32",
    "fp32": "float32",
    "double": "float64",
    "half": "float16",
    "fp16": "float16",
    "bf16": "bfloat16",
    "long": "int64",
    "int": "int32",
}


def normalize_dtype(name: str) -> str:
    """Return the canonical spelling of a dtype name (``"torch.bfloat16"`` and ``"bf16"`` give ``"bfloat16"``).

    Raises ``ValueError`` for names this module does not know.
    """
    if not isinstance(name, str):
        raise TypeError(f"dtype must be a string, got {type(name).__name__}")
    key = name.removeprefix("torch.")
    key = _ALIASES.get(key, key)
    if key not in ITEMSIZE:
        known = ", ".join(sorted(ITEMSIZE))
        raise ValueError(f"unknown dtype {name!r}; known dtypes: {known}")
    return key


def itemsize(name: str) -> int:
    """Bytes per element of the named dtype."""
    size = ITEMSIZE.get(name)
    return size if size is not None else ITEMSIZE[normalize_dtype(name)]
