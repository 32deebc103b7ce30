"""The delta syncs' checksum of a bucket of 16-bit words: two exact integer sums, the same on every device.

``checksum(words) = (sum of w, sum of w * (i % 8191 + 1))`` over the words ``w`` (as unsigned) at positions ``i``:
the first changes when any word does, the second also when words move. On CUDA one Triton kernel reads each word
once and adds each program's two sums into one int64 pair (no temporaries; timings in docs/performance.md);
elsewhere (or without Triton) torch sums the bucket in chunks, so its temporaries stay bounded (16 B per word of a
chunk) whatever the bucket's size.
"""

from __future__ import annotations

import torch

MOD = 8191  # position weights 1 .. 8191, repeating
CHUNK = 1 << 22  # words per chunk on the torch path
BLOCK, ITERS = 1024, 16  # the kernel: each program sums ITERS blocks of BLOCK words (per-lane int32/int64 sums)

_KERNEL: list = []


def checksum(words: torch.Tensor, chunk: int = CHUNK) -> tuple[int, int]:
    """``(plain, weighted)`` sums of ``words`` (any 16-bit dtype, any shape, read in memory order as flattened);
    no overflow below 2^31 words. ``chunk``: words at a time on the torch path."""
    flat = words.reshape(-1)
    if flat.element_size() != 2:
        raise ValueError(f"checksum of 16-bit words, got {flat.dtype}")
    if flat.is_cuda and flat.numel() and _kernel() is not None:
        return checksum_kernel(flat)
    return checksum_torch(flat, chunk)


def checksum_torch(flat: torch.Tensor, chunk: int = CHUNK) -> tuple[int, int]:
    """The definition in torch, ``chunk`` words at a time (the position weights continue across chunks)."""
    sums = torch.zeros(2, dtype=torch.int64, device=flat.device)  # summed on the device, read once
    for start in range(0, flat.numel(), chunk):
        w = flat[start : start + chunk].view(torch.int16).to(torch.int64) & 0xFFFF
        weights = (torch.arange(start, start + w.numel(), device=w.device, dtype=torch.int64) % MOD) + 1
        sums[0] += w.sum()
        sums[1] += (w * weights).sum()
    plain, weighted = sums.tolist()
    return plain, weighted


def checksum_kernel(flat: torch.Tensor) -> tuple[int, int]:
    """The same sums by one Triton kernel on a CUDA tensor (contiguous or not: a strided one is copied first)."""
    words = flat.view(torch.int16) if flat.is_contiguous() else flat.contiguous().view(torch.int16)
    sums = torch.zeros(2, dtype=torch.int64, device=words.device)
    n = words.numel()
    _kernel()[(triton_cdiv(n, BLOCK * ITERS),)](words, sums, n, MOD, BLOCK=BLOCK, ITERS=ITERS, num_warps=4)
    plain, weighted = sums.tolist()
    return plain, weighted


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _kernel():
    """The Triton kernel (one block of words per program), or ``None`` where Triton is not installed."""
    if _KERNEL:
        return _KERNEL[0]
    try:
        import triton
        import triton.language as tl
    except ImportError:
        _KERNEL.append(None)
        return None

    @triton.jit
    def block_sums(words, sums, n, mod, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        # per lane: the plain sum in int32 (ITERS * 65535 < 2^31), the weighted one in int64 (w * weight < 2^29);
        # positions in int64 for addressing, weights from an int32 offset (a 64-bit modulo per word costs 3x)
        base = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
        start = (base % mod).to(tl.int32)
        lanes = tl.arange(0, BLOCK)
        plain = tl.zeros([BLOCK], dtype=tl.int32)
        weighted = tl.zeros([BLOCK], dtype=tl.int64)
        for k in range(ITERS):
            offset = k * BLOCK + lanes
            i = base + offset
            w = tl.load(words + i, mask=i < n, other=0).to(tl.int32) & 0xFFFF  # the word as unsigned
            plain += w
            weighted += (w * ((start + offset) % mod + 1)).to(tl.int64)
        tl.atomic_add(sums, tl.sum(plain.to(tl.int64), axis=0))
        tl.atomic_add(sums + 1, tl.sum(weighted, axis=0))

    _KERNEL.append(block_sums)
    return block_sums
