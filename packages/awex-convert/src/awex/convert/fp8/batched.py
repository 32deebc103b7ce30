"""Many weights quantised by one call (:class:`BatchedFp8Quantizer`): one kernel launch over every tile of every
piece on CUDA, each piece as :func:`~awex.convert.fp8.blocks.quantize_fp8_blocks` would (the same bits)."""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from awex.convert.fp8.blocks import fp8_max, quantize_fp8_blocks
from awex.convert.fp8.kernels import kernels
from awex.meta.errors import AwexValueError

log = logging.getLogger("awex.convert.fp8")


Piece = tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]  # (source, FP8 out, float32 scale_inv out)
# the batched kernel's rows per load and warps per program (the fastest of 4-16 warps and 32-128 rows on H100 and
# H200: docs/performance.md)
_BATCHED_SUB_ROWS, _BATCHED_WARPS = 128, 8


class BatchedFp8Quantizer:
    """Many weights quantised by one call, each as :func:`quantize_fp8_blocks` would (the same bits): built once
    over ``pieces`` (``(source, fp8 out, scale_inv out)``, 2-D, tiles of ``block`` from each source's
    ``[0, 0]``), run by calling it on the current stream (capturable in a CUDA graph). The tensors must stay
    where they are.

    On CUDA with Triton, the pieces that are contiguous along columns and 16-byte aligned (rows and widths too)
    go as one kernel launch per source dtype and FP8 dtype, one program per tile of any piece: a launch per piece
    leaves most of the GPU idle on small pieces (one query group's K rows of a fused QKV are 32 tiles) and
    between launches. The other pieces, and every piece off CUDA, go one :func:`quantize_fp8_blocks` call each.
    """

    def __init__(self, pieces: Sequence[Piece], block: tuple[int, int] = (128, 128)):
        self.block = block
        br, bc = block
        built = kernels()
        groups: dict[tuple, list[Piece]] = {}
        self._apart: list[Piece] = []
        for source, out, scale_out in pieces:
            _check_outputs(source, block, out, scale_out)
            if _batchable(source, out, scale_out, block) and built:
                groups.setdefault((source.dtype, out.dtype, source.device), []).append((source, out, scale_out))
            else:
                self._apart.append((source, out, scale_out))
        self._launches = [_BatchedLaunch(group, block) for group in groups.values()]
        self.tiles = sum(launch.tiles for launch in self._launches)
        self.launches = len(self._launches) + len(self._apart)

    @torch.no_grad()
    def __call__(self) -> None:
        for launch in self._launches:
            launch()
        for source, out, scale_out in self._apart:
            quantize_fp8_blocks(source, self.block, out.dtype, out=out, scale_out=scale_out)


def _check_outputs(source: torch.Tensor, block: tuple[int, int], out: torch.Tensor, scale_out: torch.Tensor) -> None:
    if source.dim() != 2:
        raise AwexValueError(f"FP8 block quantisation needs a 2-D weight, got shape {tuple(source.shape)}")
    rows, cols = source.shape
    tiles = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(out.shape) != (rows, cols) or out.element_size() != 1 or not out.dtype.is_floating_point:
        raise AwexValueError(f"out must be an FP8 tensor of shape {(rows, cols)}, got {out.dtype} {tuple(out.shape)}")
    if tuple(scale_out.shape) != tiles or scale_out.dtype != torch.float32:
        raise AwexValueError(
            f"scale_out must be float32 of shape {tiles}, got {scale_out.dtype} {tuple(scale_out.shape)}"
        )
    if not (source.device == out.device == scale_out.device):
        raise AwexValueError(
            f"source, out and scale_out on one device, got {source.device}, {out.device}, {scale_out.device}"
        )


def _batchable(source: torch.Tensor, out: torch.Tensor, scale_out: torch.Tensor, block: tuple[int, int]) -> bool:
    rows, cols = source.shape
    br, bc = block
    return (
        source.is_cuda
        and rows > 0
        and cols % 16 == 0
        and not (br & (br - 1) or bc & (bc - 1))
        and bc >= 16
        and source.stride(1) == 1
        and out.stride(1) == 1
        and scale_out.stride(1) == 1
        and all(t.data_ptr() % 16 == 0 for t in (source, out))
        and (source.stride(0) * source.element_size()) % 16 == 0
        and out.stride(0) % 16 == 0
    )


class _BatchedLaunch:
    """One launch of the batched kernel over pieces of one source dtype, FP8 dtype and device."""

    def __init__(self, pieces: Sequence[Piece], block: tuple[int, int]):
        source, out, scale_out = pieces[0]
        self._x, self._q, self._s = source, out, scale_out  # base pointers (kept alive)
        self._keep = list(pieces)
        br, bc = block
        rows_of, first = [], 0
        counts = []
        for x, q, s in pieces:
            rows, cols = x.shape
            tiles_r, tiles_c = -(-rows // br), -(-cols // bc)
            rows_of.append(
                [
                    (x.data_ptr() - source.data_ptr()) // x.element_size(),
                    q.data_ptr() - out.data_ptr(),
                    (s.data_ptr() - scale_out.data_ptr()) // 4,
                    rows,
                    cols,
                    x.stride(0),
                    q.stride(0),
                    s.stride(0),
                    first,
                    tiles_c,
                ]
            )
            counts.append(tiles_r * tiles_c)
            first += tiles_r * tiles_c
        device = source.device
        self.tiles = first
        self._pieces = torch.tensor(rows_of, dtype=torch.int64).view(-1).to(device)
        self._tile_piece = torch.repeat_interleave(
            torch.arange(len(pieces), dtype=torch.int32), torch.tensor(counts)
        ).to(device)
        self._config = dict(
            BR=br,
            BC=bc,
            SUB=min(br, _BATCHED_SUB_ROWS),
            XA=16 // source.element_size(),
            QA=16,
            num_warps=_BATCHED_WARPS,
        )
        self._fmax = fp8_max(out.dtype)
        self._tiny = torch.finfo(torch.float32).tiny
        self._compile()

    def _args(self) -> tuple:
        return self._x, self._q, self._s, self._pieces, self._tile_piece, self._fmax, self._tiny

    def _compile(self) -> None:
        """Compile the kernel now, without running it, so that a CUDA graph can capture the first call."""
        try:
            kernels()["batched"].warmup(*self._args(), **self._config, grid=(self.tiles,))
        except (AttributeError, TypeError) as e:  # a Triton without warmup(): it compiles on the first call
            log.debug("Triton warmup unavailable (%s); the kernel compiles on first use", e)

    def __call__(self) -> None:
        kernels()["batched"][(self.tiles,)](*self._args(), **self._config)
