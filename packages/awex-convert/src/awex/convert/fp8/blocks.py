"""Quantise and dequantise one weight in FP8 tiles (:func:`quantize_fp8_blocks`, :func:`dequantize_fp8_blocks`):
portable, and on CUDA through the Triton kernel of :mod:`awex.convert.fp8.kernels` (the same bits)."""

from __future__ import annotations

import logging

import torch

from awex.convert.fp8.kernels import quantize_cuda, triton_kernel
from awex.meta.errors import AwexValueError

log = logging.getLogger("awex.convert.fp8")


_CHUNK_ELEMENTS = 1 << 24  # float32 temporaries while quantising: at most ~64 MiB at a time


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def quantize_fp8_blocks(
    weight: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    out: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a 2-D weight tile by tile: returns ``(fp8 weight, float32 scale_inv)``.

    Tiles start at ``weight[0, 0]`` (a box of whole tiles of a larger tensor quantises exactly as the whole
    tensor would); the last row and column of tiles may be short. ``out`` / ``scale_out`` receive the result in
    place when given. An all-zero tile gets the smallest positive scale and quantises to zeros. On CUDA a Triton
    kernel does it in one pass (bit-identical to the portable path, checked by the GPU tests).
    """
    if weight.dim() != 2:
        raise AwexValueError(f"FP8 block quantisation needs a 2-D weight, got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    br, bc = block
    n_r, n_c = -(-rows // br), -(-cols // bc)
    q = out if out is not None else torch.empty((rows, cols), dtype=dtype, device=weight.device)
    s = scale_out if scale_out is not None else torch.empty((n_r, n_c), dtype=torch.float32, device=weight.device)
    if tuple(q.shape) != (rows, cols) or q.dtype != dtype:
        raise AwexValueError(f"out must be {dtype} of shape {(rows, cols)}, got {q.dtype} {tuple(q.shape)}")
    if tuple(s.shape) != (n_r, n_c) or s.dtype != torch.float32:
        raise AwexValueError(f"scale_out must be float32 of shape {(n_r, n_c)}, got {s.dtype} {tuple(s.shape)}")
    fmax = fp8_max(dtype)
    tiny = torch.finfo(torch.float32).tiny
    if weight.is_cuda and rows and cols and not (br & (br - 1) or bc & (bc - 1)) and triton_kernel() is not None:
        quantize_cuda(weight, block, q, s, fmax, tiny)
        return q, s
    step = max(1, _CHUNK_ELEMENTS // max(1, br * n_c * bc))  # tile rows per chunk
    for t0 in range(0, n_r, step):
        t1 = min(n_r, t0 + step)
        r0, r1 = t0 * br, min(rows, t1 * br)
        part = weight[r0:r1].float()
        padded = part
        if (r1 - r0) != (t1 - t0) * br or cols != n_c * bc:  # pad the short last tiles with zeros
            padded = part.new_zeros(((t1 - t0) * br, n_c * bc))
            padded[: r1 - r0, :cols] = part
        tiles = padded.view(t1 - t0, br, n_c, bc)
        scale = (tiles.abs().amax(dim=(1, 3), keepdim=True) / fmax).clamp_(min=tiny)
        quantised = (tiles / scale).clamp_(-fmax, fmax).view((t1 - t0) * br, n_c * bc)
        q[r0:r1].copy_(quantised[: r1 - r0, :cols])
        s[t0:t1].copy_(scale.view(t1 - t0, n_c))
    return q, s


def dequantize_fp8_blocks(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``fp8 * scale_inv`` tile by tile, in ``dtype``."""
    rows, cols = weight.shape
    br, bc = block
    expected = (-(-rows // br), -(-cols // bc))
    if tuple(scale_inv.shape) != expected:
        raise AwexValueError(
            f"scale_inv of shape {tuple(scale_inv.shape)} does not tile a {rows}x{cols} weight "
            f"in {br}x{bc} blocks (expected {expected})"
        )
    full = scale_inv.float().repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return (weight.float() * full).to(dtype)
