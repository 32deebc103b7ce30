"""Digests of many regions of CUDA views in a few kernel launches (verify mode): the same sums as
:func:`awex.transport.digest.region_sums`, region by region, without a launch (and its Python) per piece.

:func:`batch` lays the regions' pieces out once, as a table of *entries* (runs of rows with evenly spaced memory and
positions: a piece's rows, :func:`awex.transport.digest._rows`) and a table of *programs* (one span of one row each),
on the views' device; :meth:`DigestBatch.sums` then launches one kernel per kind of entry (16-bit words or bytes;
rows whose words are adjacent and 16-byte aligned, for vector loads, or not) and reads every region's sums once.
Built per set of views: views of memory that moved make a new batch. Pieces that must be converted first (a view of
another dtype than the plan's, or wider elements whose bytes are not adjacent) are digested one by one, each time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import product

import torch

from awex.transport.checksum import MIX_A, POS, SEED, triton_cdiv
from awex.transport.digest import BLOCK, ITERS, MOD, PSTEP, Digest, _rows, piece_sums, salt, triton_words
from awex.transport.shards import LocalShards, torch_dtype

Region = tuple[str, tuple[int, ...], str, tuple[int, ...], tuple[int, ...]]  # name, shape, dtype, offsets, sizes
FIELDS = ("off", "pos", "row", "step", "rows", "row_pos", "row_mem", "spans", "out")

_KERNEL: list = []


@dataclass
class _Launch:
    """Entries of one kind and their programs, on the device."""

    words: torch.Tensor  # what entries' offsets count from (words of one of the views)
    table: torch.Tensor  # int64 [len(FIELDS), entries]
    prog_entry: torch.Tensor  # int32 [programs]
    prog_local: torch.Tensor  # int64 [programs]: which span of which row of its entry
    byte: bool
    vector: bool  # every row 16-byte aligned, words adjacent


@dataclass
class DigestBatch:
    """Regions laid out for :meth:`sums` (:func:`batch`)."""

    count: int  # regions
    device: torch.device
    launches: list[_Launch] = field(default_factory=list)
    # (region, piece, its offsets, the tensor's shape, salt, plan dtype): digested one by one, converted each time
    loose: list[tuple[int, torch.Tensor, tuple[int, ...], tuple[int, ...], int, torch.dtype]] = field(
        default_factory=list
    )
    shards: LocalShards | None = None  # kept alive: the tables hold its addresses

    def sums(self) -> list[Digest]:
        """Every region's digest, in the order given to :func:`batch` (one read of the device's sums)."""
        out = torch.zeros(self.count, 2, dtype=torch.int64, device=self.device)
        self.add_into(out)
        return [(a % MOD, b % MOD) for a, b in out.tolist()]

    def add_into(self, out: torch.Tensor, loose: bool = True) -> None:
        """Enqueue adding every region's sums to row ``out[region]`` (int64, on the device; no read back).
        ``loose=False``: the launches alone (what a CUDA graph can capture)."""
        for launch in self.launches:
            _run(launch, out)
        for i, piece, starts, shape, key, want in self.loose if loose else ():
            piece_sums(piece if piece.dtype == want else piece.to(want), starts, shape, key, out[i])


Piece = tuple[int, torch.Tensor, tuple[int, ...], tuple[int, ...], int, torch.dtype]
"""``(region, view, offsets of its first element in the tensor, the tensor's shape, salt, plan dtype)``."""


def batch(shards: LocalShards, regions: Sequence[Region]) -> DigestBatch:
    """``regions`` of ``shards`` (CUDA views) laid out for one launch per kind (see the module)."""
    pieces = [p for i, region in enumerate(regions) for p in region_pieces(shards, i, region)]
    out = batch_pieces(shards.device, len(regions), pieces)
    out.shards = shards
    return out


def plan_region(plan, key: tuple[int, tuple[int, ...], tuple[int, ...]]) -> Region:
    """The :data:`Region` of ``key`` (plan tensor index, offsets, sizes) of ``plan`` (an ``awex.meta.Plan``)."""
    t = plan.tensors[key[0]]
    return t.name, tuple(t.shape), t.dtype, key[1], key[2]


def region_pieces(shards: LocalShards, i: int, region: Region) -> list[Piece]:
    """The pieces ``shards`` hold of ``region``, each to be added to region ``i``'s sums."""
    name, shape, dtype, offsets, sizes = region
    want, key = torch_dtype(dtype), salt(name)
    out = []
    for index, view in shards.pieces(name, offsets, sizes):
        starts = tuple(o + (s.start or 0) for o, s in zip(offsets, index)) if index else offsets
        out.append((i, view, starts, shape, key, want))
    return out


def batch_pieces(device: torch.device, count: int, pieces: Sequence[Piece]) -> DigestBatch:
    """``pieces``, each added to its region's sums, laid out for one launch per kind; ``count`` regions. Pieces
    elsewhere than on ``device`` (a CUDA device), or that :func:`batchable` refuses, are digested one by one (as
    where Triton is missing). The caller keeps the views alive (the tables hold their addresses)."""
    entries: dict[tuple[bool, bool], list[tuple]] = {}
    bases: dict[bool, torch.Tensor] = {}
    loose = []
    kernel = device.type == "cuda" and available()  # else every piece by piece_sums (torch where no kernel)
    for i, view, starts, shape, key, want in pieces:
        if view.numel() == 0:
            continue
        if not kernel or view.device != device or not batchable(view, want):
            loose.append((i, view, starts, shape, key, want))  # converted each time
            continue
        rows = _rows(view, starts, shape)
        words = rows.words
        byte = words.element_size() == 1
        base = bases.setdefault(byte, words)
        gap = words.data_ptr() - base.data_ptr()
        if gap % words.element_size():
            loose.append((i, view, starts, shape, key, want))
            continue
        outer, (n, row_pos, row_mem) = rows.lead[:-1], rows.lead[-1] if rows.lead else (1, 0, 0)
        vec = 16 // words.element_size()  # words in 16 bytes
        for at in product(*(range(size) for size, _, _ in outer)):
            off = gap // words.element_size() + sum(a * m for a, (_, _, m) in zip(at, outer))
            pos = rows.base + sum(a * p for a, (_, p, _) in zip(at, outer)) + key + SEED
            vector = rows.step == 1 and off % vec == 0 and (n == 1 or row_mem % vec == 0)
            spans = triton_cdiv(rows.row, BLOCK * ITERS)
            fields = (off, pos, rows.row, rows.step, n, row_pos, row_mem, spans, i)
            entries.setdefault((byte, vector), []).append(fields)
    out = DigestBatch(count, device, loose=loose)
    for (byte, vector), fields in sorted(entries.items()):
        table = torch.tensor(fields, dtype=torch.int64).t().contiguous().to(device)
        per_entry = table[FIELDS.index("rows")] * table[FIELDS.index("spans")]
        prog_entry = torch.repeat_interleave(torch.arange(len(fields), device=device, dtype=torch.int32), per_entry)
        first = torch.cumsum(per_entry, 0) - per_entry
        prog_local = torch.arange(prog_entry.numel(), device=device, dtype=torch.int64) - first[prog_entry.long()]
        out.launches.append(_Launch(bases[byte], table, prog_entry, prog_local, byte, vector))
    return out


def batchable(view: torch.Tensor, want: torch.dtype) -> bool:
    """Whether a piece is read as it lies (else it is converted first, each time: a view of another dtype than the
    plan's, or wider elements whose bytes are not adjacent)."""
    return view.dtype == want and not (view.element_size() > 2 and view.stride(-1) != 1)


def _run(launch: _Launch, out: torch.Tensor) -> None:
    t = launch.table
    with torch.cuda.device(out.device):
        _kernel()[(launch.prog_entry.numel(),)](
            launch.words, *(t[k] for k in range(len(FIELDS))), launch.prog_entry, launch.prog_local, out,
            POS=POS, PSTEP=PSTEP, A0=MIX_A[0], A1=MIX_A[1], BYTES=launch.byte, VECTOR=launch.vector,
            BLOCK=BLOCK, ITERS=ITERS, num_warps=4,
        )  # fmt: skip


def _kernel():
    if _KERNEL:
        return _KERNEL[0]
    import triton
    import triton.language as tl

    _words = triton_words()

    @triton.jit
    def entry_sums(
        words,
        off_t,
        pos_t,
        row_t,
        step_t,
        rows_t,
        row_pos_t,
        row_mem_t,
        spans_t,
        out_t,
        prog_entry,
        prog_local,
        sums,
        POS: tl.constexpr,
        PSTEP: tl.constexpr,
        A0: tl.constexpr,
        A1: tl.constexpr,
        BYTES: tl.constexpr,
        VECTOR: tl.constexpr,
        BLOCK: tl.constexpr,
        ITERS: tl.constexpr,
    ):
        pid = tl.program_id(0)
        e = tl.load(prog_entry + pid)
        local = tl.load(prog_local + pid)
        spans = tl.load(spans_t + e)
        r = local // spans
        start = (local % spans) * (BLOCK * ITERS)
        step = tl.load(step_t + e)
        left = tl.load(row_t + e) - start
        off = tl.load(off_t + e) + r * tl.load(row_mem_t + e) + start * step
        pos = tl.load(pos_t + e) + r * tl.load(row_pos_t + e) + start
        if VECTOR:
            off = tl.multiple_of(off, 16 if BYTES else 8)
        lanes = tl.arange(0, BLOCK)
        p = ((pos & 0xFFFFFFFF).to(tl.uint32) + lanes.to(tl.uint32)) * POS  # each lane's position key
        span = tl.minimum(left, BLOCK * ITERS)
        full = span // BLOCK
        sum_a = tl.zeros([BLOCK], dtype=tl.uint32)
        sum_b = tl.zeros([BLOCK], dtype=tl.uint32)
        for k in range(0, full):  # whole blocks: no mask
            j = k * BLOCK + lanes
            if VECTOR:
                w = tl.load(words + off + j)
            else:
                w = tl.load(words + off + j.to(tl.int64) * step)
            sum_a, sum_b = _words(w, p, sum_a, sum_b, A0, A1, BYTES)
            p += PSTEP
        if span > full * BLOCK:  # the last, partial block
            j = full * BLOCK + lanes
            inside = j < span
            if VECTOR:
                w = tl.load(words + off + j, mask=inside, other=0)
            else:
                w = tl.load(words + off + j.to(tl.int64) * step, mask=inside, other=0)
            a, b = _words(w, p, sum_a, sum_b, A0, A1, BYTES)
            sum_a = tl.where(inside, a, sum_a)
            sum_b = tl.where(inside, b, sum_b)
        o = tl.load(out_t + e)
        tl.atomic_add(sums + 2 * o, tl.sum(sum_a.to(tl.int64), axis=0))
        tl.atomic_add(sums + 2 * o + 1, tl.sum(sum_b.to(tl.int64), axis=0))

    _KERNEL.append(entry_sums)
    return entry_sums


def available() -> bool:
    """Whether Triton is installed (the batch runs on CUDA views only)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
