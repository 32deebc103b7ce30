"""A digest of regions of canonical tensors that does not depend on how the memory holding them is cut up: the
trainer's views and an engine's views hold the same region in different pieces, layouts and dtypes, and each side
computes the same digest from its own (``verify`` mode: ``awex.engines.sync.verify``).

Each element at global position ``g`` (its flat index in the whole canonical tensor) is taken in the tensor's plan
dtype as 16-bit words (1-byte dtypes: each byte zero-extended); word ``j`` of it sits at position
``P = g * words + j``, keyed by the tensor's name (``salt``): ``p = ((P + salt + SEED) * POS) mod 2^32``. A word
``w`` hashes once, ``h = mix(p ^ w)`` (:func:`awex.transport.checksum.mix`, a bijection: for one position every
word has its own ``h``), and the digest is ``(sum of h, sum of h * (p | 1))``, each mod 2^32. One finaliser per
word keeps the kernel at the memory's rate (two cost twice the integer work, and ran at a third of it); the second
sum weighs each hash by its odd position key, so a change cancelling in the first (two words whose ``p ^ w``
trade places) does not cancel in the second, and a single changed word changes both. Sums are order-free, so a
region's digest is the sum of its pieces' and a rank's the sum of its regions'; positions and the salt make a word
moved to another place or another tensor count as a change.

A piece is cut into rows whose positions are contiguous and whose words lie evenly spaced in memory (as few rows as
its strides allow: one for a whole tensor or a slice of dim 0). On CUDA one Triton kernel hashes them in place (each
program one span of one row, in 32-bit arithmetic, whole blocks unmasked and the last masked, its two sums added
into an int64 pair on the device); elsewhere (or without Triton) torch computes the same in int64, a span of words
at a time, so its temporaries stay small. Sums stay on the device until a caller reads them (:func:`region_sums`
into a row of a tensor it reads once)."""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from math import gcd, prod
from typing import NamedTuple

import torch

from awex.transport.checksum import MASK, MIX_A, POS, SEED, triton_cdiv, triton_mix
from awex.transport.shards import LocalShards, torch_dtype

MOD = 1 << 32  # each sum of a digest is taken mod 2^32
SPAN = 1 << 16  # the torch path: words hashed at a time (temporaries that stay in cache)
BLOCK, ITERS = 1024, 64  # the kernel: a program hashes up to ITERS blocks of BLOCK words of one row
PSTEP = BLOCK * POS & MASK  # a lane's position key from one block to the next

_KERNEL: list = []
_WORDS: list = []

Digest = tuple[int, int]


def salt(name: str) -> int:
    return zlib.crc32(name.encode()) * 0x9E3779B1 & MASK


def add(x: Digest, y: Digest) -> Digest:
    return (x[0] + y[0]) % MOD, (x[1] + y[1]) % MOD


def grouped(groups: Mapping[int, Sequence[int]], values: Sequence[Digest]) -> dict[int, Digest]:
    """Per group, the digest of its members (indices into ``values``: each a region's digest)."""
    out: dict[int, Digest] = {}
    for group, members in groups.items():
        total: Digest = (0, 0)
        for i in members:
            total = add(total, values[i])
        out[group] = total
    return out


def digest_of(sums: torch.Tensor) -> Digest:
    """The digest an int64 pair of sums holds (reads it: on CUDA, waits for the kernels that add to it)."""
    a, b = sums.tolist()
    return a % MOD, b % MOD


def region_digest(
    shards: LocalShards, name: str, shape: tuple[int, ...], dtype: str, offsets: tuple[int, ...], sizes: tuple[int, ...]
) -> Digest:
    """The digest of region ``offsets``/``sizes`` of canonical tensor ``name`` (``shape``, plan dtype ``dtype``)
    as ``shards`` hold it (views of another dtype are read as the plan's: a float32 view holding a bfloat16
    tensor is narrowed, exactly); raises unless ``shards`` hold all of it."""
    sums = torch.zeros(2, dtype=torch.int64, device=shards.device)
    region_sums(shards, name, shape, dtype, offsets, sizes, sums)
    return digest_of(sums)


HOST_CHUNK_BYTES = 64 << 20  # a piece in host memory digested on a GPU: read up this much at a time


def region_sums(
    shards: LocalShards,
    name: str,
    shape: tuple[int, ...],
    dtype: str,
    offsets: tuple[int, ...],
    sizes: tuple[int, ...],
    out: torch.Tensor,
) -> None:
    """Add :func:`region_digest`'s two sums to ``out`` (int64, two elements, on the views' device) without reading
    them: many regions, one read."""
    want = torch_dtype(dtype)
    key = salt(name)
    for index, view in shards.pieces(name, offsets, sizes):
        starts = tuple(o + (s.start or 0) for o, s in zip(offsets, index)) if index else offsets
        piece_sums(view if view.dtype == want else view.to(want), starts, shape, key, out)


def piece_digest(piece: torch.Tensor, offsets: tuple[int, ...], shape: tuple[int, ...], key: int) -> Digest:
    """The digest of ``piece``: the box of the canonical tensor of ``shape`` starting at ``offsets`` (in the tensor's
    plan dtype), its positions salted by ``key``."""
    sums = torch.zeros(2, dtype=torch.int64, device=piece.device)
    piece_sums(piece, offsets, shape, key, sums)
    return digest_of(sums)


def piece_sums(
    piece: torch.Tensor, offsets: tuple[int, ...], shape: tuple[int, ...], key: int, out: torch.Tensor
) -> None:
    """Add :func:`piece_digest`'s two sums to ``out`` (on the piece's device): the kernel on CUDA, else torch. A
    piece in host memory with ``out`` on a GPU (a version staged on the host) is read up to that GPU and digested
    there, :data:`HOST_CHUNK_BYTES` of whole rows at a time."""
    if piece.numel() == 0:
        return
    if piece.device != out.device:
        if piece.dim() == 0:
            piece_sums(piece.to(out.device), offsets, shape, key, out)
            return
        rows = max(1, HOST_CHUNK_BYTES // piece[0].nbytes)
        for i in range(0, piece.shape[0], rows):
            chunk = piece[i : i + rows].to(out.device, non_blocking=True)  # stream-ordered with the kernel below
            piece_sums(chunk, (offsets[0] + i, *offsets[1:]), shape, key, out)
        return
    if piece.is_cuda and _kernel() is not None:
        _kernel_sums(_rows(piece, offsets, shape), key, out)
    else:
        _torch_sums(_rows(piece, offsets, shape), key, out)


def piece_digest_torch(piece: torch.Tensor, offsets: tuple[int, ...], shape: tuple[int, ...], key: int) -> Digest:
    """:func:`piece_digest` by the torch path, on any device."""
    sums = torch.zeros(2, dtype=torch.int64, device=piece.device)
    if piece.numel():
        _torch_sums(_rows(piece, offsets, shape), key, sums)
    return digest_of(sums)


def piece_digest_kernel(piece: torch.Tensor, offsets: tuple[int, ...], shape: tuple[int, ...], key: int) -> Digest:
    """:func:`piece_digest` of a CUDA piece by the Triton kernel (one launch; reads each word once, in place)."""
    sums = torch.zeros(2, dtype=torch.int64, device=piece.device)
    if piece.numel():
        _kernel_sums(_rows(piece, offsets, shape), key, sums)
    return digest_of(sums)


class Rows(NamedTuple):
    """A piece as rows of words (:func:`_rows`)."""

    words: torch.Tensor  # the piece's 16-bit words (int16), or bytes (uint8) for 1-byte dtypes
    base: int  # the position of the first row's first word
    row: int  # words per row (positions contiguous)
    step: int  # words between a row's words in memory
    lead: tuple[tuple[int, int, int], ...]  # per dim indexing rows: (size, position stride, memory stride)

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's first position and memory offset (in words, from the piece's first), int64 on its device."""
        device = self.words.device
        pos = torch.full((), self.base, dtype=torch.int64, device=device)
        mem = torch.zeros((), dtype=torch.int64, device=device)
        for size, pos_stride, mem_stride in self.lead:
            at = torch.arange(size, dtype=torch.int64, device=device)
            pos = pos.unsqueeze(-1) + at * pos_stride
            mem = mem.unsqueeze(-1) + at * mem_stride
        return pos.reshape(-1), mem.reshape(-1)


def _rows(piece: torch.Tensor, offsets: tuple[int, ...], shape: tuple[int, ...]) -> Rows:
    """``piece`` as :class:`Rows`: rows whose positions are contiguous and whose words lie ``step`` apart in memory
    (1 but for the last dim of a column-major piece of a 1- or 2-byte dtype), as long as the strides allow (a whole
    tensor or a slice of dim 0: one row)."""
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
    lead = tuple((words.shape[d], strides[d], words.stride(d)) for d in range(last) if words.shape[d] != 1)
    return Rows(words, base, row, step, lead)


def _torch_sums(rows: Rows, key: int, out: torch.Tensor) -> None:
    """The sums in torch, on any device: a long row span by span, short rows gathered several at a time, in int64,
    in place where torch allows."""
    words, row, step = rows.words, rows.row, rows.step
    pos, mem = rows.tables() if rows.lead else ([rows.base], [0])
    last = (int(mem.max()) if rows.lead else 0) + (row - 1) * step + 1
    storage = words.as_strided((last,), (1,))  # from the piece's first word
    low = 0xFF if words.element_size() == 1 else 0xFFFF
    salted = (key + SEED) & MASK
    cols = torch.arange(min(row, SPAN), dtype=torch.int64, device=words.device)
    if row >= SPAN // 2 or not rows.lead:  # long rows: spans of one row
        for p0, m0 in zip(pos.tolist() if rows.lead else pos, mem.tolist() if rows.lead else mem):
            for c0 in range(0, row, SPAN):
                n = min(SPAN, row - c0)
                w = storage[m0 + c0 * step : m0 + (c0 + n - 1) * step + 1 : step]
                _hash_into(out, w.to(torch.int64) & low, cols[:n] + (p0 + c0 + salted))
    else:  # short rows: several at a time
        k = max(1, SPAN // row)
        at = cols * step
        for r0 in range(0, pos.numel(), k):
            w = storage[mem[r0 : r0 + k, None] + at]
            _hash_into(out, w.to(torch.int64) & low, pos[r0 : r0 + k, None] + (cols + salted))


def _hash_into(sums: torch.Tensor, w: torch.Tensor, p: torch.Tensor) -> None:
    """Add the two sums of words ``w`` (int64, unsigned) at salted positions ``p`` (int64) to ``sums``; overwrites
    both (products kept below 2^63: the weight is multiplied in two 16-bit halves)."""
    p &= MASK
    p *= POS
    p &= MASK
    w ^= p
    h = _mix_(w, MIX_A)
    sums[0] += h.sum()
    p |= 1
    low = h * (p & 0xFFFF)
    p >>= 16
    p *= h
    p &= 0xFFFF
    p <<= 16
    low += p
    low &= MASK
    sums[1] += low.sum()


def _mix_(x: torch.Tensor, muls: tuple[int, int]) -> torch.Tensor:
    """:func:`awex.transport.checksum.mix` in place (int64 values below 2^32)."""
    x ^= x >> 16
    x *= muls[0]
    x &= MASK
    x ^= x >> 15
    x *= muls[1]
    x &= MASK
    x ^= x >> 16
    return x


def _kernel_sums(rows: Rows, key: int, out: torch.Tensor) -> None:
    """The sums by one Triton kernel launch (one span of one row per program; rows' tables only where there are
    several)."""
    words, row, step = rows.words, rows.row, rows.step
    iters = ITERS if row >= BLOCK * ITERS else 1
    spans = triton_cdiv(row, BLOCK * iters)
    if rows.lead:
        pos, mem = rows.tables()
        count = pos.numel()
        align = 8  # rows' memory offsets share this power-of-two factor (in words): vector loads where it is > 1
        for _, _, mem_stride in rows.lead:
            align = gcd(align, mem_stride)
    else:
        pos = mem = out  # (not read)
        count, align = 1, 8
    constants = dict(POS=POS, PSTEP=PSTEP, A0=MIX_A[0], A1=MIX_A[1])
    with torch.cuda.device(words.device):
        _kernel()[(count * spans,)](
            words, pos, mem, row, step, spans, ((0 if rows.lead else rows.base) + key + SEED) & MASK, out,
            **constants, ONE_ROW=not rows.lead, STEP_ONE=step == 1, ALIGN=max(1, align),
            BYTES=words.element_size() == 1, BLOCK=BLOCK, ITERS=iters, num_warps=4,
        )  # fmt: skip


def triton_words():
    """The per-block step both digest kernels share (``_words(w, p, sum_a, sum_b, A0, A1, BYTES)``: words ``w``, as
    loaded (int16, or uint8 where ``BYTES``), at position keys ``p`` added into the two sums), as a Triton function;
    Triton must be installed."""
    if _WORDS:
        return _WORDS[0]
    import triton
    import triton.language as tl

    _mix = triton_mix()

    @triton.jit
    def _words(w, p, sum_a, sum_b, A0, A1, BYTES: tl.constexpr):
        if BYTES:
            u = w.to(tl.uint32)
        else:
            u = w.to(tl.uint16, bitcast=True).to(tl.uint32)
        h = _mix(p ^ u, A0, A1)
        return sum_a + h, sum_b + h * (p | 1)

    _WORDS.append(_words)
    return _words


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

    _words = triton_words()

    @triton.jit
    def _load(at, j, step, inside, MASKED: tl.constexpr, STEP_ONE: tl.constexpr):
        if STEP_ONE:
            where = at + j
        else:
            where = at + j.to(tl.int64) * step
        if MASKED:
            w = tl.load(where, mask=inside, other=0)
        else:
            w = tl.load(where)
        return w

    @triton.jit
    def row_sums(
        words,
        row_pos,
        row_mem,
        row,
        step,
        spans,
        salted,  # key + SEED (one row: plus its first position), mod 2^32
        sums,
        POS: tl.constexpr,
        PSTEP: tl.constexpr,
        A0: tl.constexpr,
        A1: tl.constexpr,
        ONE_ROW: tl.constexpr,
        STEP_ONE: tl.constexpr,
        ALIGN: tl.constexpr,
        BYTES: tl.constexpr,
        BLOCK: tl.constexpr,
        ITERS: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        start = (pid % spans) * (BLOCK * ITERS)  # this program's first word of its row
        if ONE_ROW:
            pos = salted + start
            at = words + start
        else:
            r = pid // spans
            pos = tl.load(row_pos + r) + salted + start
            mem = tl.multiple_of(tl.load(row_mem + r), ALIGN)
            if STEP_ONE:
                at = words + mem + start
            else:
                at = words + mem + start * step
        lanes = tl.arange(0, BLOCK)
        p = ((pos & 0xFFFFFFFF).to(tl.uint32) + lanes.to(tl.uint32)) * POS  # each lane's position key
        span = tl.minimum(row - start, BLOCK * ITERS)  # words of the row this program hashes
        full = span // BLOCK
        sum_a = tl.zeros([BLOCK], dtype=tl.uint32)
        sum_b = tl.zeros([BLOCK], dtype=tl.uint32)
        for k in range(full):  # whole blocks: no mask
            w = _load(at, k * BLOCK + lanes, step, None, False, STEP_ONE)
            sum_a, sum_b = _words(w, p, sum_a, sum_b, A0, A1, BYTES)
            p += PSTEP
        if span > full * BLOCK:  # the last, partial block
            inside = full * BLOCK + lanes < span
            w = _load(at, full * BLOCK + lanes, step, inside, True, STEP_ONE)
            a, b = _words(w, p, sum_a, sum_b, A0, A1, BYTES)
            sum_a = tl.where(inside, a, sum_a)
            sum_b = tl.where(inside, b, sum_b)
        tl.atomic_add(sums, tl.sum(sum_a.to(tl.int64), axis=0))
        tl.atomic_add(sums + 1, tl.sum(sum_b.to(tl.int64), axis=0))

    _KERNEL.append(row_sums)
    return row_sums
