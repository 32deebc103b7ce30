"""Same-GPU copies that digest what they write (verify mode over CUDA IPC): one kernel launch copies every block
(as :class:`~awex.transport.batched_copy.BatchedCopy` does) and adds the digest of the words it moves, hashed at
the positions it writes them to, to its copy's row of a sums tensor (:mod:`awex.transport.digest`'s sums).

A receiver that digested its memory after the copy read every byte it had just written a second time: colocated,
with the trainer digesting its own memory on the same GPU meanwhile, the memory's traffic was twice the plain
sync's. Here the digest costs no memory traffic. What it checks is what the copy read from the sender's memory
and where it put it: the bytes a receiver got differ from those its sender digested (a stale or wrong read, a
missed or partial copy) and it fails; a change to its memory after the copy is not seen (reading every word
back after its store cost 4 ms more of 17 for a Qwen3-8B-shaped sync on one H200 and would see only a store
that did not land: docs/performance.md).

A copy takes this path where its destination is contiguous and its words' positions in the canonical tensor are
contiguous too (a whole tensor, or a slice of dim 0; :func:`contiguous_positions`), both ends 16-byte aligned
(:func:`~awex.transport.batched_copy.batchable`), in the plan's dtype. Its :class:`Hashed` says where its words sit:
the first word's salted position and the sums row it adds to.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from awex.meta.errors import AwexValueError
from awex.transport.batched_copy import ALIGN, BLOCK_BYTES, batchable, cut, spread_evenly
from awex.transport.checksum import MASK, MIX_A, POS, SEED
from awex.transport.digest import _rows, triton_words

log = logging.getLogger("awex.transport")

WARPS = 16
THREADS = 32 * WARPS


@dataclass(frozen=True)
class Hashed:
    """Where a copy's words sit in the digest: ``pos`` is its first word's position plus the tensor's salt and
    ``SEED`` (mod 2^32; word ``k`` of the copy is at ``pos + k``), ``out`` the row of the sums it adds to."""

    pos: int
    out: int


def contiguous_positions(piece: torch.Tensor, offsets: tuple[int, ...], shape: tuple[int, ...], key: int) -> int | None:
    """The salted position of ``piece``'s first word where its words, read in memory order, sit at contiguous
    positions of the canonical tensor of ``shape`` (``piece`` at ``offsets``, salted by ``key``); else ``None``."""
    if not piece.is_contiguous() or piece.numel() == 0:
        return None
    rows = _rows(piece, offsets, shape)
    if rows.lead or rows.step != 1:
        return None
    return (rows.base + key + SEED) & MASK


def digest_blocks(
    copies: Sequence[tuple[int, int, int, Hashed]], base: int, unit: int, block_bytes: int = BLOCK_BYTES
) -> torch.Tensor:
    """``(destination address, source address, bytes, Hashed)`` copies cut into blocks of at most ``block_bytes``:
    an int64 tensor of ``(destination offset, source offset, count, position, out)`` rows, offsets and counts in
    units of ``unit`` bytes (2: 16-bit words; 1: bytes) from address ``base``, positions advanced to each block's
    first word (mod 2^32)."""
    if not copies:
        return torch.empty((0, 5), dtype=torch.int64)
    dst, src, nbytes, pos, out = (
        torch.tensor(col, dtype=torch.int64) for col in zip(*((d, s, n, h.pos, h.out) for d, s, n, h in copies))
    )
    which, at = cut(nbytes, block_bytes)
    return torch.stack(
        [
            (dst[which] + at - base) // unit,
            (src[which] + at - base) // unit,
            torch.clamp(nbytes[which] - at, max=block_bytes) // unit,
            (pos[which] + at // unit) & MASK,
            out[which],
        ],
        dim=1,
    )


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    _words = triton_words()

    @triton.jit
    def copy_digest_kernel(
        base,
        table,
        sums,
        POS: tl.constexpr,
        PSTEP: tl.constexpr,
        A0: tl.constexpr,
        A1: tl.constexpr,
        BYTES: tl.constexpr,
        VEC: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        i = tl.program_id(0).to(tl.int64)
        dst = tl.multiple_of(tl.load(table + 5 * i), VEC)
        src = tl.multiple_of(tl.load(table + 5 * i + 1), VEC)
        n = tl.multiple_of(tl.load(table + 5 * i + 2), VEC)
        pos = tl.load(table + 5 * i + 3)
        out = tl.load(table + 5 * i + 4)
        lanes = tl.arange(0, CHUNK)
        p = ((pos & 0xFFFFFFFF).to(tl.uint32) + lanes.to(tl.uint32)) * POS  # each lane's position key
        sum_a = tl.zeros([CHUNK], dtype=tl.uint32)
        sum_b = tl.zeros([CHUNK], dtype=tl.uint32)
        for k in range(0, tl.cdiv(n, CHUNK)):
            j = k * CHUNK + lanes
            inside = j < n
            w = tl.load(base + src + j, mask=inside, other=0)
            tl.store(base + dst + j, w, mask=inside)
            a, b = _words(w, p, sum_a, sum_b, A0, A1, BYTES)
            sum_a = tl.where(inside, a, sum_a)
            sum_b = tl.where(inside, b, sum_b)
            p += PSTEP
        tl.atomic_add(sums + 2 * out, tl.sum(sum_a.to(tl.int64), axis=0))
        tl.atomic_add(sums + 2 * out + 1, tl.sum(sum_b.to(tl.int64), axis=0))

    return copy_digest_kernel


def hashable(dst: torch.Tensor, src: torch.Tensor, peer: bool = False) -> bool:
    """Whether ``dst <- src`` can go through :class:`DigestingCopy` (given its :class:`Hashed`): batchable and of
    one dtype on both ends."""
    return dst.dtype == src.dtype and batchable(dst, src, peer=peer)


class DigestingCopy:
    """Copies ``dst <- src`` with their :class:`Hashed` (all :func:`hashable`, into one GPU), built once, run by
    calling it: one kernel launch per word size (16-bit words; bytes for 1-byte dtypes) on the current stream
    (capturable in a CUDA graph), adding each copy's digest to ``sums[out]`` (int64 pairs on that GPU; the
    caller zeroes them). ``spread`` copies read another GPU as :class:`~awex.transport.batched_copy.BatchedCopy`'s
    do (``spread_sources``: where the kernel reads them)."""

    def __init__(
        self,
        copies: Sequence[tuple[torch.Tensor, torch.Tensor, Hashed]],
        sums: torch.Tensor,
        spread: Sequence[tuple[torch.Tensor, torch.Tensor, Hashed]] = (),
        spread_sources: Sequence[int] | None = None,
        block_bytes: int = BLOCK_BYTES,
    ):
        everything = [*copies, *spread]
        if not everything:
            raise AwexValueError("DigestingCopy needs at least one copy")
        bad = [i for i, (d, s, _) in enumerate(copies) if not hashable(d, s)] + [
            len(copies) + i for i, (d, s, _) in enumerate(spread) if not hashable(d, s, peer=True)
        ]
        if bad:
            raise AwexValueError(
                f"copies {bad[:5]} cannot be digested as they copy (contiguous, CUDA, aligned, one dtype)"
            )
        self.device = everything[0][0].device
        if any(d.device != self.device for d, _, _ in everything) or sums.device != self.device:
            raise AwexValueError("DigestingCopy copies into one GPU, its sums on it")
        rows = sums.shape[0]
        if any(not 0 <= h.out < rows or not 0 <= h.pos <= MASK for _, _, h in everything):
            raise AwexValueError(f"every copy's out must index the {rows} sums rows, its pos fit 32 bits")
        if spread_sources is None:
            spread_sources = [s.data_ptr() for _, s, _ in spread]
        if len(spread_sources) != len(spread) or any(a % ALIGN for a in spread_sources):
            raise AwexValueError(f"spread_sources: one {ALIGN}-byte aligned address per spread copy")
        self.sums = sums
        self._keep = everything
        self._launches: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # (pointer, table, unit)
        for unit in (2, 1):
            near = [(d, s, h) for d, s, h in copies if (d.element_size() == 1) == (unit == 1)]
            far = [(x, a) for x, a in zip(spread, spread_sources) if (x[0].element_size() == 1) == (unit == 1)]
            if not near and not far:
                continue
            base = (near or [far[0][0]])[0][0]
            table = spread_evenly(
                digest_blocks([(d.data_ptr(), s.data_ptr(), d.nbytes, h) for d, s, h in near], base.data_ptr(), unit),
                digest_blocks([(x[0].data_ptr(), a, x[0].nbytes, x[2]) for x, a in far], base.data_ptr(), unit),
            )
            pointer = base.view(-1).view(torch.int16 if unit == 2 else torch.uint8)
            self._launches.append((pointer, table.reshape(-1).to(self.device), unit))
        self.blocks = sum(t.numel() // 5 for _, t, _ in self._launches)
        for launch in self._launches:  # compiled now, so that a CUDA graph can capture the first call
            self._launch(*launch, warmup=True)

    def __call__(self) -> None:
        for launch in self._launches:
            self._launch(*launch)

    def _launch(self, pointer: torch.Tensor, table: torch.Tensor, unit: int, warmup: bool = False) -> None:
        chunk = THREADS * ALIGN // unit  # a 16-byte vector per thread
        kernel, grid = _kernel(), (table.numel() // 5,)
        args = (pointer, table, self.sums)
        constants = dict(
            POS=POS, PSTEP=chunk * POS & MASK, A0=MIX_A[0], A1=MIX_A[1], BYTES=unit == 1, VEC=ALIGN // unit,
            CHUNK=chunk, num_warps=WARPS,
        )  # fmt: skip
        if not warmup:
            kernel[grid](*args, **constants)
            return
        try:
            kernel.warmup(*args, **constants, grid=grid)
        except (AttributeError, TypeError) as e:  # a Triton without warmup(): it compiles on the first call
            log.debug("Triton warmup unavailable (%s); the kernel compiles on first use", e)
