"""A digest of regions of canonical tensors that does not depend on how the memory holding them is cut up: the
trainer's views and an engine's views hold the same region in different pieces, layouts and dtypes, and each side
computes the same digest from its own (``verify`` mode: ``awex.engines.sync.verify``).

Each element at global position ``g`` (its flat index in the whole canonical tensor) is taken in the tensor's plan
dtype as 16-bit words (1-byte dtypes: each byte zero-extended); word ``j`` of it sits at position
``P = g * words + j``, keyed by the tensor's name (``salt``): ``p = ((P + salt + SEED) * POS) mod 2^32``, hashed as
in :mod:`awex.transport.checksum` (two 32-bit finalisers of ``p ^ w`` and ``p ^ (w << 16)``), summed mod 2^64. Sums
are order-free, so a region's digest is the sum of its pieces' and a rank's the sum of its regions'; positions and
the salt make a word moved to another place or another tensor count as a change.

On CUDA one Triton kernel hashes a piece in place (no temporaries): the piece is cut into rows whose words are
contiguous both in memory and in positions (as few as its strides allow: one for a whole tensor or a slice of dim
0), each program hashes one span of one row and adds its two sums into one int64 pair. Elsewhere (or without
Triton) torch computes the same in int64, dim-0 chunk by chunk, so its temporaries stay bounded.
"""

from __future__ import annotations

import zlib
from math import prod

import torch

from awex.transport.checksum import MASK, MIX_A, MIX_B, POS, SEED, mix, triton_cdiv
from awex.transport.shards import LocalShards, torch_dtype

MOD = 1 << 64
ROWS_ELEMENTS = 1 << 22  # the torch path: elements hashed at a time (bounds the temporaries)
BLOCK, ITERS = 1024, 16  # the kernel: a program hashes up to ITERS blocks of BLOCK words of one row

_KERNEL: list = []

Digest = tuple[int, int]


def salt(name: str) -> int:
    return zlib.crc32(name.encode()) * 0x9E3779B1 & MASK


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as 16-bit words (int64, unsigned), shape ``t.shape + (words per element,)``."""
    t = t.contiguous()
    if t.element_size() == 1:
        return t.view(torch.uint8).to(torch.int64).unsqueeze(-1)
    return (t.view(torch.int16).to(torch.int64) & 0xFFFF).reshape(*t.shape, t.element_size() // 2)


def piece_digest(piece: torch.Tensor, offsets: tuple[int, ...], shape: tuple[int, ...], key: int) -> Digest:
    """The digest of ``piece``: the box of the canonical tensor of ``shape`` starting at ``offsets`` (in the tensor's
    plan dtype), its positions salted by ``key``."""
    if piece.numel() == 0:
        return 0, 0
    if piece.is_cuda and _kernel() is not None:
        return piece_digest_kernel(piece, offsets, shape, key)
    return piece_digest_torch(piece, offsets, shape, key)


def piece_digest_torch(piece: torch.Tensor, offsets: tuple[int, ...], shape: tuple[int, ...], key: int) -> Digest:
    """:func:`piece_digest` by its definition in torch (int64 temporaries of at most :data:`ROWS_ELEMENTS` words
    per element)."""
    if piece.numel() == 0:
        return 0, 0
    strides = [prod(shape[d + 1 :]) for d in range(len(shape))]
    if piece.dim() == 0:
        piece, offsets, strides = piece.reshape(1), (0,), [1]
    rows = max(1, ROWS_ELEMENTS // max(1, prod(piece.shape[1:])))
    sums = torch.zeros(2, dtype=torch.int64, device=piece.device)
    for r0 in range(0, piece.shape[0], rows):
        chunk = piece[r0 : r0 + rows]
        words = _words(chunk)
        n = words.shape[-1]
        g = torch.zeros((), dtype=torch.int64, device=piece.device)
        for d, size in enumerate(chunk.shape):
            start = offsets[d] + (r0 if d == 0 else 0)
            at = torch.arange(start, start + size, device=piece.device, dtype=torch.int64) * strides[d]
            g = g.unsqueeze(-1) + at if d else at
        if chunk.dim() > 1:
            g = g.reshape(chunk.shape)
        pos = g.unsqueeze(-1) * n + torch.arange(n, device=piece.device, dtype=torch.int64)
        p = (((pos + key + SEED) & MASK) * POS) & MASK
        sums[0] += mix(p ^ words, MIX_A).sum()
        sums[1] += mix(p ^ (words << 16), MIX_B).sum()
    a, b = sums.tolist()
    return a % MOD, b % MOD


def region_digest(
    shards: LocalShards, name: str, shape: tuple[int, ...], dtype: str, offsets: tuple[int, ...], sizes: tuple[int, ...]
) -> Digest:
    """The digest of region ``offsets``/``sizes`` of canonical tensor ``name`` (``shape``, plan dtype ``dtype``)
    as ``shards`` hold it (views of another dtype are read as the plan's: a float32 view holding a bfloat16
    tensor is narrowed, exactly); raises unless ``shards`` hold all of it."""
    want = torch_dtype(dtype)
    key = salt(name)
    a = b = 0
    for index, view in shards.pieces(name, offsets, sizes):
        starts = tuple(o + (s.start or 0) for o, s in zip(offsets, index)) if index else offsets
        da, db = piece_digest(view if view.dtype == want else view.to(want), starts, shape, key)
        a, b = (a + da) % MOD, (b + db) % MOD
    return a, b


def add(x: Digest, y: Digest) -> Digest:
    return (x[0] + y[0]) % MOD, (x[1] + y[1]) % MOD


def _rows(piece: torch.Tensor, offsets: tuple[int, ...], shape: tuple[int, ...]):
    """``piece`` as 16-bit words (or bytes, for 1-byte dtypes), cut into rows whose positions are contiguous and
    whose words lie ``step`` apart in memory (1 but for the last dim of a column-major piece of a 1- or 2-byte
    dtype): ``(words, row positions, row memory offsets in words, words per row, step)``, the two row tensors int64
    on the piece's device (one entry per row). Rows are as long as the strides allow (a whole tensor or a slice of
    dim 0: one row)."""
    if piece.dim() == 0:
        piece, offsets, shape = piece.reshape(1), (0,), (1,)
    n = max(1, piece.element_size() // 2)  # words per element
    if n > 1 and piece.stride(-1) != 1:  # read as words: each element's bytes must be adjacent
        piece = torch.empty(piece.shape, dtype=piece.dtype, device=piece.device).copy_(piece)
    words = piece.view(torch.uint8) if piece.element_size() == 1 else piece.view(torch.int16)
    strides = [prod(shape[d + 1 :]) * n for d in range(len(shape))]  # of positions, in words
    row, step = words.shape[-1], words.stride(-1) if words.shape[-1] > 1 else 1
    last = words.dim() - 1  # dims [0, last) index rows
    while last > 0 and step == 1:
        d = last - 1
        if words.shape[d] != 1 and (words.stride(d) != row or strides[d] != row):
            break
        row *= words.shape[d]
        last = d
    base = sum(o * st for o, st in zip(offsets, strides))
    pos = torch.full((), base, dtype=torch.int64, device=piece.device)
    mem = torch.zeros((), dtype=torch.int64, device=piece.device)
    for d in range(last):
        at = torch.arange(words.shape[d], dtype=torch.int64, device=piece.device)
        pos = pos.unsqueeze(-1) + at * strides[d]
        mem = mem.unsqueeze(-1) + at * words.stride(d)
    return words, pos.reshape(-1), mem.reshape(-1), row, step


def piece_digest_kernel(piece: torch.Tensor, offsets: tuple[int, ...], shape: tuple[int, ...], key: int) -> Digest:
    """:func:`piece_digest` of a CUDA piece by one Triton kernel launch (reads each word once, in place)."""
    words, pos, mem, row, step = _rows(piece, offsets, shape)
    sums = torch.zeros(2, dtype=torch.int64, device=piece.device)
    iters = ITERS if row >= BLOCK * ITERS else 1
    spans = triton_cdiv(row, BLOCK * iters)
    grid = (pos.numel() * spans,)
    constants = dict(POS=POS, A0=MIX_A[0], A1=MIX_A[1], B0=MIX_B[0], B1=MIX_B[1])
    with torch.cuda.device(piece.device):
        _kernel()[grid](
            words, pos, mem, row, step, spans, (key + SEED) & MASK, sums,
            **constants, BYTES=words.element_size() == 1, BLOCK=BLOCK, ITERS=iters, num_warps=4,
        )  # fmt: skip
    a, b = sums.tolist()
    return a % MOD, b % MOD


def _kernel():
    """The Triton kernel (one span of one row per program), or ``None`` where Triton is not installed."""
    if _KERNEL:
        return _KERNEL[0]
    try:
        import triton
        import triton.language as tl
    except ImportError:
        _KERNEL.append(None)
        return None

    @triton.jit
    def _mix(x, m0, m1):  # awex.transport.checksum.mix in uint32 (products wrap mod 2^32; shifts are logical)
        x = x ^ (x >> 16)
        x = x * m0
        x = x ^ (x >> 15)
        x = x * m1
        return x ^ (x >> 16)

    @triton.jit
    def row_sums(
        words,
        row_pos,
        row_mem,
        row,
        step,
        spans,
        salted,
        sums,
        POS: tl.constexpr,
        A0: tl.constexpr,
        A1: tl.constexpr,
        B0: tl.constexpr,
        B1: tl.constexpr,
        BYTES: tl.constexpr,
        BLOCK: tl.constexpr,
        ITERS: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        r = pid // spans
        start = (pid % spans) * BLOCK * ITERS
        pos = tl.load(row_pos + r) + salted  # positions of this row, salted (+ key + SEED)
        mem = tl.load(row_mem + r)
        lanes = tl.arange(0, BLOCK)
        sum_a = tl.zeros([BLOCK], dtype=tl.int64)
        sum_b = tl.zeros([BLOCK], dtype=tl.int64)
        for k in range(ITERS):
            c = start + k * BLOCK + lanes
            inside = c < row
            if BYTES:
                w = tl.load(words + mem + c * step, mask=inside, other=0).to(tl.uint32)
            else:
                w = tl.load(words + mem + c * step, mask=inside, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
            p = ((pos + c) & 0xFFFFFFFF).to(tl.uint32) * POS
            h_a = _mix(p ^ w, A0, A1)
            h_b = _mix(p ^ (w << 16), B0, B1)
            sum_a += tl.where(inside, h_a.to(tl.int64), 0)
            sum_b += tl.where(inside, h_b.to(tl.int64), 0)
        tl.atomic_add(sums, tl.sum(sum_a, axis=0))
        tl.atomic_add(sums + 1, tl.sum(sum_b, axis=0))

    _KERNEL.append(row_sums)
    return row_sums
