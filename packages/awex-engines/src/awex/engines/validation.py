"""Tensor-level validation of a received version against an HF safetensors checkpoint.

For every box a rank received, compare it with the same box of the checkpoint's tensor: max absolute
difference and a bit-exact flag per tensor. Used by the readers (``validate=`` options) and the scenarios.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

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


def load_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF safetensors checkpoint directory (or one file)."""
    from safetensors.torch import load_file

    p = Path(path)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {p}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def validate_shards(shards: LocalShards, reference: dict[str, torch.Tensor], strict: bool = False) -> ValidationReport:
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
            want = ref[box.slices()].to(view.dtype)
            exact = exact and torch.equal(view.cpu(), want)
            worst = max(worst, (view.cpu().double() - want.double()).abs().max().item() if view.numel() else 0.0)
        report.tensors_checked += 1
        report.tensors_mismatched += 0 if exact else 1
        report.per_tensor[name] = {"max_abs_diff": worst, "bit_exact": exact}
    if strict and report.tensors_mismatched:
        bad = [n for n, r in report.per_tensor.items() if not r["bit_exact"]]
        raise ValidationError(f"{report.tensors_mismatched} of {report.tensors_checked} tensors differ from the "
                              f"reference: {bad[:10]}")
    return report
