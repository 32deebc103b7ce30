"""Tensor-level validation of a received version against an HF safetensors checkpoint.

For every box a rank received, compare it with the same box of the checkpoint's tensor: max absolute
difference and a bit-exact flag per tensor. Used by the readers (``validate=`` options) and the scenarios.
The checkpoint is read box by box (``safe_open`` slices) and compared in chunks, so validating costs little
memory next to the model's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import torch

from awex.transport import LocalShards


class ValidationError(AssertionError):
    """Received tensors differ from the reference checkpoint (raised only when asked to be strict)."""


@dataclass
class ValidationReport:
    tensors_checked: int = 0
    tensors_mismatched: int = 0
    per_tensor: dict[str, dict] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"tensors_checked": self.tensors_checked, "tensors_mismatched": self.tensors_mismatched,
                "mismatched": sorted(n for n, r in self.per_tensor.items() if not r["bit_exact"])[:50],
                "max_abs_diff": max((r["max_abs_diff"] for r in self.per_tensor.values()), default=0.0)}


class _StoredTensor:
    """One checkpoint tensor, read only where sliced."""

    def __init__(self, handle, name: str):
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())

    def __getitem__(self, index) -> torch.Tensor:
        return self._slice[index]


class Checkpoint(Mapping):
    """The tensors of an HF safetensors checkpoint directory (or one file), read lazily."""

    def __init__(self, path: str | Path):
        from safetensors import safe_open

        p = Path(path)
        files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {p}")
        self._where = {}
        for f in files:
            handle = safe_open(str(f), framework="pt")
            for name in handle.keys():
                self._where[name] = handle

    def __getitem__(self, name: str) -> _StoredTensor:
        return _StoredTensor(self._where[name], name)

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def load_checkpoint(path: str | Path) -> Checkpoint:
    """The tensors of an HF safetensors checkpoint directory (or one file), read lazily box by box."""
    return Checkpoint(path)


_CHUNK = 1 << 20  # elements compared at a time


def _compare(view: torch.Tensor, ref, box) -> tuple[bool, float]:
    """Bit-exact flag and max absolute difference of a received box and the same box of ``ref``, read and
    compared a chunk of rows at a time."""
    if view.numel() == 0:
        return True, 0.0
    index = box.slices()
    if view.dim() == 0:
        chunks = [(view.reshape(1), lambda: torch.as_tensor(ref[index]).reshape(1))]
    else:
        rows = max(1, _CHUNK // max(1, view[0].numel()))
        first = index[0].start or 0
        chunks = [(view[i:i + rows], lambda i=i: ref[(slice(first + i, first + min(i + rows, view.shape[0])),
                                                        *index[1:])])
                  for i in range(0, view.shape[0], rows)]
    exact, worst = True, 0.0
    for got, read in chunks:
        a = got.cpu()
        b = read().to(a.dtype)
        exact = exact and torch.equal(a, b)
        worst = max(worst, (a.double() - b.double()).abs().max().item())
    return exact, worst


def validate_shards(shards: LocalShards, reference: Mapping, strict: bool = False) -> ValidationReport:
    """Compare every received box with the reference; raise :class:`ValidationError` on mismatch if ``strict``."""
    report = ValidationReport()
    for name in sorted(shards.names()):
        ref = reference.get(name)
        worst = 0.0
        exact = ref is not None
        for box, view in shards.pairs(name):
            if ref is None or tuple(ref.shape) < box.ends:
                exact = False
                worst = float("inf")
                break
            same, diff = _compare(view, ref, box)
            exact = exact and same
            worst = max(worst, diff)
        report.tensors_checked += 1
        report.tensors_mismatched += 0 if exact else 1
        report.per_tensor[name] = {"max_abs_diff": worst, "bit_exact": exact}
    if strict and report.tensors_mismatched:
        bad = [n for n, r in report.per_tensor.items() if not r["bit_exact"]]
        raise ValidationError(f"{report.tensors_mismatched} of {report.tensors_checked} tensors differ from the "
                              f"reference: {bad[:10]}")
    return report
