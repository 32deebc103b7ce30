"""Fewer, larger copies: merging runs of equally shaped copies that advance by a constant stride.

A transfer's pieces often form a regular run: the query heads of each query group of Megatron's fused QKV
(one piece per group, ``group_rows`` apart) land in consecutive rows of vLLM's ``qkv_proj``, or in consecutive
slots of a staging buffer. Each piece as its own ``copy_`` costs a kernel launch and a few microseconds of host
time; the run as one strided copy (one extra leading dimension on both sides) costs one. Built once per plan.
Copies between two GPUs are left alone: each piece is contiguous there and goes as one peer memcpy, which a
strided view would turn into temporaries.
"""

from __future__ import annotations

import torch


def _same_geometry(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype and a.device == b.device
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


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
                    if not (_same_geometry(d0, dn) and _same_geometry(s0, sn)
                            and dn.storage_offset() - copies[j][0].storage_offset() == dd
                            and sn.storage_offset() - copies[j][1].storage_offset() == ds):
                        break
                    j += 1
        if j == i:
            out.append((d0, s0))
        else:
            count = j - i + 1
            out.append((d0.as_strided((count, *d0.shape), (dd, *d0.stride()), d0.storage_offset()),
                        s0.as_strided((count, *s0.shape), (ds, *s0.stride()), s0.storage_offset())))
        i = j + 1
    return out
