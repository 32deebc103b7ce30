"""Canonical tensors and the ranks that take part in a sync."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from math import prod

from awex.meta.dtypes import itemsize, normalize_dtype
from awex.meta.errors import AwexValueError


class Role(str, Enum):
    """Which side of a weight sync a rank is on."""

    TRAINER = "trainer"
    INFERENCE = "inference"


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A canonical (HF-style) tensor: its name, global shape and dtype.

    Every engine describes its weights as boxes of these, whatever its native names, fusions and paddings.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise AwexValueError("tensor name must be a non-empty string")
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if any(s < 0 for s in self.shape):
            raise AwexValueError(f"{self.name}: negative dimension in shape {self.shape}")
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True, slots=True)
class RankDescriptor:
    """One rank of the sync world: which engine instance it belongs to, its role and where it runs.

    ``rank`` numbers the sync world (all trainer ranks, then all inference ranks, instances sorted by name);
    ``local_rank`` numbers the rank inside its engine instance. ``host`` and ``device`` are filled in at
    rendezvous and are empty in a dry run.
    """

    rank: int
    instance: str
    role: Role
    local_rank: int
    host: str = ""
    device: str = ""
