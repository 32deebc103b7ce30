"""The delta syncs' checksum of a bucket of 16-bit words: two sums of per-word hashes, the same on every device.

Each word ``w`` (as unsigned) at position ``i`` is hashed with its position: ``p = (i + SEED) * POS`` (mod 2^32,
distinct for distinct positions), ``h_a = mix_a(p ^ w)``, ``h_b = mix_b(p ^ (w << 16))`` (``mix``: a 32-bit
integer finaliser, a bijection whose every output bit depends on every input bit), and ``checksum(words) = (sum of
h_a, sum of h_b)``. Two words can share a key in one sum but never in both, and the finalisers are not linear, so no
structured change cancels by construction, unlike linear sums (the earlier ``sum of w * (i % 8191 + 1)`` missed
neighbours changed by +1/-2/+1 and words 8191 apart changed by +1 and -1): a change goes unseen only if its hash
differences cancel in both sums by chance. Sums are exact (below 2^31 words: each hash is below 2^32, the sums below
2^63). On CUDA one Triton kernel reads each word once, hashes in 32-bit unsigned arithmetic and adds each program's
two sums into one int64 pair (no temporaries); elsewhere (or without Triton) torch computes the same in int64,
bucket by chunk, so its temporaries stay bounded whatever the bucket's size.
"""

from __future__ import annotations

import torch

from awex.meta.errors import AwexValueError

SEED = 0x3C6EF372  # positions are keyed from i + SEED (mod 2^32)
MASK = 0xFFFFFFFF
POS = 0x61C88647  # odd: (i + SEED) * POS is a bijection of positions mod 2^32
# (multiplier, multiplier) of each finaliser: odd, below 2^31 (on the torch path products of values below 2^32 stay
# below 2^63)
MIX_A = (0x7FEB352D, 0x2C1B3C6D)
MIX_B = (0x5BD1E995, 0x27D4EB2F)
CHUNK = 1 << 22  # words per chunk on the torch path
BLOCK, ITERS = 1024, 16  # the kernel: each program hashes ITERS blocks of BLOCK words

_KERNEL: list = []
_MIX: list = []


def checksum(words: torch.Tensor, chunk: int = CHUNK) -> tuple[int, int]:
    """``(sum of h_a, sum of h_b)`` over ``words`` (any 16-bit dtype, any shape, read in memory order as
    flattened); exact below 2^31 words. ``chunk``: words at a time on the torch path."""
    flat = words.reshape(-1)
    if flat.element_size() != 2:
        raise AwexValueError(f"checksum of 16-bit words, got {flat.dtype}")
    if flat.numel() >= 1 << 31:
        raise AwexValueError(f"checksum of at most 2^31 - 1 words, got {flat.numel()}")
    if flat.is_cuda and flat.numel() and _kernel() is not None:
        return checksum_kernel(flat)
    return checksum_torch(flat, chunk)


def mix(x: torch.Tensor, muls: tuple[int, int]) -> torch.Tensor:
    """A 32-bit finaliser on int64 values below 2^32 (shifts of non-negative values are logical)."""
    x = x ^ (x >> 16)
    x = (x * muls[0]) & MASK
    x = x ^ (x >> 15)
    x = (x * muls[1]) & MASK
    return x ^ (x >> 16)


def checksum_torch(flat: torch.Tensor, chunk: int = CHUNK) -> tuple[int, int]:
    """The definition in torch, ``chunk`` words at a time (positions continue across chunks)."""
    sums = torch.zeros(2, dtype=torch.int64, device=flat.device)  # summed on the device, read once
    for start in range(0, flat.numel(), chunk):
        w = flat[start : start + chunk].view(torch.int16).to(torch.int64) & 0xFFFF
        i = torch.arange(start, start + w.numel(), device=w.device, dtype=torch.int64)
        p = (((i + SEED) & MASK) * POS) & MASK
        sums[0] += mix(p ^ w, MIX_A).sum()
        sums[1] += mix(p ^ (w << 16), MIX_B).sum()
    a, b = sums.tolist()
    return a, b


def checksum_kernel(flat: torch.Tensor) -> tuple[int, int]:
    """The same sums by one Triton kernel on a CUDA tensor (contiguous or not: a strided one is copied first)."""
    words = flat.view(torch.int16) if flat.is_contiguous() else flat.contiguous().view(torch.int16)
    sums = torch.zeros(2, dtype=torch.int64, device=words.device)
    n = words.numel()
    grid = (triton_cdiv(n, BLOCK * ITERS),)
    constants = dict(SEED=SEED, POS=POS, A0=MIX_A[0], A1=MIX_A[1], B0=MIX_B[0], B1=MIX_B[1])
    _kernel()[grid](words, sums, n, **constants, BLOCK=BLOCK, ITERS=ITERS, num_warps=4)
    a, b = sums.tolist()
    return a, b


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def triton_mix():
    """:func:`mix` as a Triton function on uint32 (products wrap mod 2^32; shifts are logical), for the kernels that
    hash words (this module's, ``awex.transport.digest``'s); Triton must be installed."""
    if _MIX:
        return _MIX[0]
    import triton

    @triton.jit
    def _mix(x, m0, m1):
        x = x ^ (x >> 16)
        x = x * m0
        x = x ^ (x >> 15)
        x = x * m1
        return x ^ (x >> 16)

    _MIX.append(_mix)
    return _mix


def _kernel():
    """The Triton kernel (ITERS blocks of words per program), or ``None`` where Triton is not installed."""
    if _KERNEL:
        return _KERNEL[0]
    try:
        import triton
        import triton.language as tl
    except ImportError:
        _KERNEL.append(None)
        return None

    _mix = triton_mix()

    @triton.jit
    def block_sums(
        words,
        sums,
        n,
        SEED: tl.constexpr,
        POS: tl.constexpr,
        A0: tl.constexpr,
        A1: tl.constexpr,
        B0: tl.constexpr,
        B1: tl.constexpr,
        BLOCK: tl.constexpr,
        ITERS: tl.constexpr,
    ):
        base = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
        lanes = tl.arange(0, BLOCK)
        sum_a = tl.zeros([BLOCK], dtype=tl.int64)
        sum_b = tl.zeros([BLOCK], dtype=tl.int64)
        for k in range(ITERS):
            i = base + k * BLOCK + lanes
            inside = i < n
            w = tl.load(words + i, mask=inside, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
            p = ((i + SEED) & 0xFFFFFFFF).to(tl.uint32) * POS
            h_a = _mix(p ^ w, A0, A1)
            h_b = _mix(p ^ (w << 16), B0, B1)
            sum_a += tl.where(inside, h_a.to(tl.int64), 0)
            sum_b += tl.where(inside, h_b.to(tl.int64), 0)
        tl.atomic_add(sums, tl.sum(sum_a, axis=0))
        tl.atomic_add(sums + 1, tl.sum(sum_b, axis=0))

    _KERNEL.append(block_sums)
    return block_sums
