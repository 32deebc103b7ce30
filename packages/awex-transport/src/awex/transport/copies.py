"""Fewer, larger copies: merging runs of equally shaped copies that advance by a constant stride.

A transfer's pieces often form a regular run: the query heads of each query group of Megatron's fused QKV
(one piece per group, ``group_rows`` apart) land in consecutive rows of vLLM's ``qkv_proj``, or in consecutive
slots of a staging buffer. Each piece as its own ``copy_`` costs a kernel launch and a few microseconds of host
time; the run as one strided copy (one extra leading dimension on both sides) costs one. Built once per plan.
Copies between two GPUs are left alone: each piece is contiguous there and goes as one peer memcpy, which a
strided view would turn into temporaries.

Such strided copies are then made wide (:func:`copier`): PyTorch copies a non-contiguous view element by
element, without vectorised loads, so 2-byte bf16 elements move at a fraction of memory bandwidth (a 2D
``cuMemcpy2DAsync`` is no faster). Copying the same bytes viewed as 8-byte integers moves four elements per
load, bit for bit (measured: docs/performance.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_WIDE = (torch.int64, torch.int32, torch.int16)


def _same_geometry(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.device == b.device
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    )


def merge_copies(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(destination, source)`` pairs with runs merged; copying the result equals copying the input."""
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    i = 0
    n = len(copies)
    while i < n:
        d0, s0 = copies[i]
        j = i
        if i + 1 < n and d0.dim() > 0 and d0.device == s0.device:  # across GPUs, keep contiguous peer copies
            d1, s1 = copies[i + 1]
            dd = d1.storage_offset() - d0.storage_offset()
            ds = s1.storage_offset() - s0.storage_offset()
            if dd > 0 and ds > 0 and _same_geometry(d0, d1) and _same_geometry(s0, s1):
                j = i + 1
                while j + 1 < n:
                    dn, sn = copies[j + 1]
                    if not (
                        _same_geometry(d0, dn)
                        and _same_geometry(s0, sn)
                        and dn.storage_offset() - copies[j][0].storage_offset() == dd
                        and sn.storage_offset() - copies[j][1].storage_offset() == ds
                    ):
                        break
                    j += 1
        if j == i:
            out.append((d0, s0))
        else:
            count = j - i + 1
            out.append(
                (
                    d0.as_strided((count, *d0.shape), (dd, *d0.stride()), d0.storage_offset()),
                    s0.as_strided((count, *s0.shape), (ds, *s0.stride()), s0.storage_offset()),
                )
            )
        i = j + 1
    return out


def wide_views(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``dst`` and ``src`` viewed as the widest integer type their layouts allow, where both are non-contiguous
    views of one dtype on one device and a wider type fits; else ``None``."""
    if (
        dst.dtype != src.dtype
        or dst.device != src.device
        or dst.shape != src.shape
        or (dst.is_contiguous() and src.is_contiguous())
    ):
        return None
    for wide in _WIDE:
        if wide.itemsize <= dst.element_size():
            return None
        try:
            return dst.view(wide), src.view(wide)
        except RuntimeError:  # innermost dim not contiguous, or sizes, strides, offsets not multiples
            continue
    return None


def copier(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], None]:
    """A function copying ``src`` into ``dst`` on the current stream: through :func:`wide_views` where they
    exist (same bytes, fewer and wider loads), else a plain ``copy_``. Decided once, when a plan's copies are
    built."""
    wide = wide_views(dst, src)
    if wide is not None:
        d, s = wide
        return lambda: d.copy_(s, non_blocking=True)
    return lambda: dst.copy_(src, non_blocking=True)
