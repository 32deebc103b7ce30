"""Dtype names and sizes, without torch.

Dtypes cross process boundaries as strings spelled as torch spells them without the ``torch.`` prefix
(``"bfloat16"``, ``"float8_e4m3fn"``). This module knows their sizes so that planning needs no torch.
"""

from __future__ import annotations

from awex.meta.errors import AwexValueError

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
        raise AwexValueError(f"unknown dtype {name!r}; known dtypes: {known}")
    return key


def itemsize(name: str) -> int:
    """Bytes per element of the named dtype."""
    size = ITEMSIZE.get(name)
    return size if size is not None else ITEMSIZE[normalize_dtype(name)]


_EXACT_WIDENING = {
    ("float16", "float32"),
    ("bfloat16", "float32"),
    ("float16", "float64"),
    ("bfloat16", "float64"),
    ("float32", "float64"),
    *((f8, wide) for f8 in ("float8_e4m3fn", "float8_e5m2") for wide in ("float16", "bfloat16", "float32", "float64")),
    ("int8", "int16"),
    ("int8", "int32"),
    ("int8", "int64"),
    ("int16", "int32"),
    ("int16", "int64"),
    ("int32", "int64"),
    ("uint8", "int16"),
    ("uint8", "int32"),
    ("uint8", "int64"),
}


def is_exact_cast(source: str, destination: str) -> bool:
    """Whether every value of ``source`` is exactly representable in ``destination`` (a widening cast)."""
    source, destination = normalize_dtype(source), normalize_dtype(destination)
    return source == destination or (source, destination) in _EXACT_WIDENING
