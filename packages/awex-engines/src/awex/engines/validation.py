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

from awex.meta.errors import AwexError, AwexValueError
from awex.transport import LocalShards


class ValidationError(AwexError):
    """Received tensors differ from the reference checkpoint (raised only when asked to be strict)."""


@dataclass
class ValidationReport:
    tensors_checked: int = 0
    tensors_mismatched: int = 0
    per_tensor: dict[str, dict] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "tensors_checked": self.tensors_checked,
            "tensors_mismatched": self.tensors_mismatched,
            "mismatched": sorted(n for n, r in self.per_tensor.items() if not r["bit_exact"])[:50],
            "max_abs_diff": max((r["max_abs_diff"] for r in self.per_tensor.values()), default=0.0),
        }


_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class _StoredTensor:
    """One checkpoint tensor, read with plain file reads only where sliced (rows of dim 0 at a time): no memory
    map, so validating adds only the rows read to the process's memory."""

    def __init__(self, path: Path, header_end: int, entry: dict):
        dtype = _DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise AwexValueError(f"{path}: unsupported safetensors dtype {entry.get('dtype')!r}")
        self.dtype = dtype
        self.shape = tuple(int(n) for n in entry["shape"])
        begin, end = (int(n) for n in entry["data_offsets"])
        self._path, self._start = path, header_end + begin
        numel = 1
        for n in self.shape:
            numel *= n
        if end - begin != numel * dtype.itemsize:
            raise AwexValueError(
                f"{path}: tensor holds {end - begin} bytes, its shape and dtype need {numel * dtype.itemsize}"
            )

    def __getitem__(self, index) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        if not self.shape:
            return self._read(0, 1).reshape(())
        rows = range(*(index[0] if index else slice(None)).indices(self.shape[0]))
        if rows.step != 1:
            raise AwexValueError("only contiguous row ranges are read")
        return self._read(rows.start, len(rows)).reshape(len(rows), *self.shape[1:])[(slice(None), *index[1:])]

    def _read(self, row: int, count: int) -> torch.Tensor:
        per_row = self.dtype.itemsize
        for n in self.shape[1:]:
            per_row *= n
        data = bytearray(count * per_row)
        with open(self._path, "rb") as f:
            f.seek(self._start + row * per_row)
            if f.readinto(data) != len(data):
                raise AwexValueError(f"{self._path}: truncated")
        return torch.frombuffer(data, dtype=self.dtype) if data else torch.empty(0, dtype=self.dtype)


class Checkpoint(Mapping):
    """The tensors of an HF safetensors checkpoint directory (or one file), read lazily."""

    def __init__(self, path: str | Path):
        import json
        import struct

        p = Path(path)
        files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {p}")
        self._entries: dict[str, tuple[Path, int, dict]] = {}
        for f in files:
            with open(f, "rb") as fh:
                (size,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(size))
            for name, entry in header.items():
                if name != "__metadata__":
                    self._entries[name] = (f, 8 + size, entry)

    def __getitem__(self, name: str) -> _StoredTensor:
        return _StoredTensor(*self._entries[name])

    def __iter__(self):
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def load_checkpoint(path: str | Path) -> Checkpoint:
    """The tensors of an HF safetensors checkpoint directory (or one file), read lazily box by box."""
    return Checkpoint(path)


_CHUNK = 1 << 18  # elements read and compared at a time


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
        chunks = [
            (view[i : i + rows], lambda i=i: ref[(slice(first + i, first + min(i + rows, view.shape[0])), *index[1:])])
            for i in range(0, view.shape[0], rows)
        ]
    exact, worst = True, 0.0
    for got, read in chunks:
        a = got.cpu()
        b = read().to(a.dtype)
        if not torch.equal(a, b):  # only then the difference (float64: exact for every dtype we move)
            exact = False
            worst = max(worst, (a.double() - b.double()).abs().max().item())
    return exact, worst


def _misfit(ref, box, view) -> str | None:
    """Why ``box`` (received as ``view``) cannot be compared with the reference tensor ``ref``; ``None`` if it can."""
    if ref is None:
        return "not in the reference"
    shape = tuple(ref.shape)
    if len(shape) != len(box.ends) or any(end > n for end, n in zip(box.ends, shape)):
        return f"box {box.offsets}+{box.sizes} does not lie inside the reference's shape {shape}"
    if tuple(view.shape) != tuple(box.sizes):
        return f"received shape {tuple(view.shape)} for a box of {tuple(box.sizes)}"
    return None


def validate_shards(shards: LocalShards, reference: Mapping, strict: bool = False) -> ValidationReport:
    """Compare every received box with the reference; raise :class:`ValidationError` on mismatch if ``strict``
    (otherwise a box that cannot be compared, a shape that does not fit, is a mismatch with its reason)."""
    report = ValidationReport()
    for name in sorted(shards.names()):
        ref = reference.get(name)
        worst, exact, reason = 0.0, True, None
        for box, view in shards.pairs(name):
            reason = _misfit(ref, box, view)
            if reason is not None:
                exact, worst = False, float("inf")
                break
            same, diff = _compare(view, ref, box)
            exact = exact and same
            worst = max(worst, diff)
        report.tensors_checked += 1
        report.tensors_mismatched += 0 if exact else 1
        report.per_tensor[name] = {"max_abs_diff": worst, "bit_exact": exact}
        if reason is not None:
            report.per_tensor[name]["reason"] = reason
    if strict and report.tensors_mismatched:
        bad = [n for n, r in report.per_tensor.items() if not r["bit_exact"]]
        raise ValidationError(
            f"{report.tensors_mismatched} of {report.tensors_checked} tensors differ from the reference: {bad[:10]}"
        )
    return report
