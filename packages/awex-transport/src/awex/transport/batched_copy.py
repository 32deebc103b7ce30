"""Many contiguous copies within one GPU as one kernel launch.

A receiver whose sources are separate allocations (per-parameter trainer memory, MoE experts) makes thousands
of same-GPU copies of a few MiB each. Each as its own copy kernel ends in a tail where most of the GPU idles,
and a few streams of them do not fill the gaps (measured: docs/performance.md).
Here every copy is cut into blocks of ``block_bytes`` and one launch of one Triton kernel copies all blocks,
each program one block, so the GPU stays full to the end.

Only copies whose both ends are contiguous, 16-byte aligned and a multiple of 16 bytes long take this path
(so every program moves 16-byte words); :func:`split_batchable` says which. A copy that is not contiguous but whose
rows are (a row-parallel half landing in every other half-row) can go row by row (:func:`row_copy`, ``rows``).
Addresses are kept as byte offsets from one base tensor's address, which the kernel receives as its only pointer.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Sequence

import torch

from awex.meta.errors import AwexValueError

log = logging.getLogger("awex.transport")

ALIGN = 16
BLOCK_BYTES = 1 << 16  # a launch with reads from another GPU (spread, rows): as the rows across GPUs were measured
# a launch within one GPU: its 16.4 GB of Qwen3-8B-shaped per-parameter copies on 1x H200 took 1.007x of one large
# copy against 1.020x with 64 KiB blocks and 16 warps (the sweep, docs/performance.md); twice the blocks in its table
LOCAL_BLOCK_BYTES, LOCAL_WARPS = 1 << 15, 32
ROW_BLOCK_MIN, ROW_BLOCK_MAX = 1 << 10, 1 << 14  # the blocks of a launch copying row by row (row_reads)


def batchable(dst: torch.Tensor, src: torch.Tensor, peer: bool = False) -> bool:
    """Whether ``dst <- src`` can go through :class:`BatchedCopy`: both contiguous, on one CUDA device (with
    ``peer``: ``src`` on any GPU, read over NVLink), of equal byte size, 16-byte aligned at both ends and a
    multiple of 16 bytes long."""
    nbytes = dst.nbytes
    return (
        dst.device.type == "cuda"
        and src.device.type == "cuda"
        and (peer or dst.device == src.device)
        and dst.is_contiguous()
        and src.is_contiguous()
        and nbytes == src.nbytes
        and nbytes > 0
        and nbytes % ALIGN == 0
        and dst.data_ptr() % ALIGN == 0
        and src.data_ptr() % ALIGN == 0
    )


def row_copy(dst: torch.Tensor, src: torch.Tensor) -> tuple[int, int, int, int] | None:
    """``(rows, row bytes, destination row stride, source row stride)`` (strides in bytes) where ``dst <- src`` can
    go row by row through :class:`BatchedCopy` (``rows``): CUDA tensors of one shape and dtype, each row (along
    the first dimension) contiguous on both sides, every row 16-byte aligned at both ends and a multiple of 16
    bytes long, the destination's rows apart; else ``None``."""
    if dst.dim() < 2 or dst.shape != src.shape or dst.dtype != src.dtype or dst.shape[0] < 1 or dst.numel() == 0:
        return None
    if (
        dst.device.type != "cuda"
        or src.device.type != "cuda"
        or not (dst[0].is_contiguous() and src[0].is_contiguous())
    ):
        return None
    size = dst.element_size()
    row = dst[0].nbytes
    dstride, sstride = dst.stride(0) * size, src.stride(0) * size
    aligned = all(x % ALIGN == 0 for x in (row, dstride, sstride, dst.data_ptr(), src.data_ptr()))
    if not aligned or (dst.shape[0] > 1 and dstride < row) or sstride < 0:
        return None
    return dst.shape[0], row, dstride, sstride


def row_blocks(runs: Sequence[tuple[int, int, int, int, int, int]], base: int, block_bytes: int) -> torch.Tensor:
    """Copies of ``(destination address, source address, rows, row bytes, destination row stride, source row
    stride)`` cut into blocks of at most ``block_bytes``, none across a row's end: rows as :func:`copy_blocks`
    makes them (offsets from ``base``), each copy's rows and blocks in order."""
    cut(torch.empty(0, dtype=torch.int64), block_bytes)  # (checks block_bytes)
    parts = [torch.empty((0, 3), dtype=torch.int64)]
    for dst, src, rows, row, dstride, sstride in runs:
        if rows < 1 or row <= 0:
            raise AwexValueError("every copy must move at least one row of at least one byte")
        per_row = -(-row // block_bytes)
        k = torch.arange(rows * per_row, dtype=torch.int64)
        r, at = k // per_row, (k % per_row) * block_bytes
        parts.append(
            torch.stack(
                [dst - base + r * dstride + at, src - base + r * sstride + at, (row - at).clamp(max=block_bytes)], 1
            )
        )
    return torch.cat(parts)


def split_batchable(copies: Sequence[tuple[torch.Tensor, torch.Tensor]]):
    """``(batchable copies, the others)``, each in the given order."""
    yes, no = [], []
    for d, s in copies:
        (yes if batchable(d, s) else no).append((d, s))
    return yes, no


def cut(
    nbytes: torch.Tensor, block_bytes: int, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of ``nbytes`` bytes each (int64, on the CPU) cut into blocks of at most ``block_bytes``: per block,
    the copy it belongs to and its byte offset within it (each copy's blocks in order), made on ``device`` (by
    default the CPU; a GPU makes a table of half a million blocks in well under a millisecond, where the CPU took
    tens of them, and sends nothing but the copies)."""
    if block_bytes <= 0 or block_bytes % ALIGN:
        raise AwexValueError(f"block_bytes must be a positive multiple of {ALIGN}, got {block_bytes}")
    if bool((nbytes <= 0).any()):
        raise AwexValueError("every copy must move at least one byte")
    counts = -(-nbytes // block_bytes)
    total = int(counts.sum())  # known here: the device's repeats need no sync to size their output
    counts = counts.to(device) if device is not None else counts
    which = torch.repeat_interleave(torch.arange(len(nbytes), device=counts.device), counts, output_size=total)
    first = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts, output_size=total)
    return which, (torch.arange(total, device=counts.device) - first) * block_bytes


def copy_blocks(
    copies: Sequence[tuple[int, int, int]],
    base: int,
    block_bytes: int = BLOCK_BYTES,
    device: torch.device | None = None,
) -> torch.Tensor:
    """``(destination address, source address, bytes)`` copies cut into blocks of at most ``block_bytes``: an
    int64 tensor of ``(destination offset, source offset, bytes)`` rows, offsets from address ``base``
    (negative where below it), each copy's blocks in order; made on ``device`` (:func:`cut`)."""
    if not copies:
        cut(torch.empty(0, dtype=torch.int64), block_bytes)  # (checks block_bytes)
        return torch.empty((0, 3), dtype=torch.int64, device=device)
    dst, src, nbytes = (torch.tensor(col, dtype=torch.int64) for col in zip(*copies))
    which, at = cut(nbytes, block_bytes, device)
    if device is not None:
        dst, src, nbytes = dst.to(device), src.to(device), nbytes.to(device)
    return torch.stack(
        [dst[which] + at - base, src[which] + at - base, torch.clamp(nbytes[which] - at, max=block_bytes)], dim=1
    )


def spread_evenly(table: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """The rows of both block tables, ``other``'s spread evenly among ``table``'s (each keeping its order), so
    that every stretch of the launch runs both kinds of block in the same proportion."""
    if not len(table) or not len(other):
        return torch.cat([table, other])
    at = table.device
    position = torch.cat(
        [
            torch.arange(len(table), dtype=torch.float64, device=at) / len(table),
            (torch.arange(len(other), dtype=torch.float64, device=at) + 0.5) / len(other),
        ]
    )
    return torch.cat([table, other.to(at)])[torch.argsort(position, stable=True)]


@functools.cache
def triton_available() -> bool:
    """Whether Triton (which CUDA builds of PyTorch bring) can be imported here."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def copy_blocks_kernel(base, table, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64)
        dst = tl.multiple_of(tl.load(table + 3 * i), 16)
        src = tl.multiple_of(tl.load(table + 3 * i + 1), 16)
        n = tl.multiple_of(tl.load(table + 3 * i + 2), 16)
        k = tl.arange(0, BLOCK)
        mask = k < n
        tl.store(base + dst + k, tl.load(base + src + k, mask=mask), mask=mask)

    return copy_blocks_kernel


_COMPILED: set = set()


class BatchedCopy:
    """Copies ``dst <- src`` (all :func:`batchable`, into one GPU) built once, run by calling it: one kernel
    launch on the current stream (capturable in a CUDA graph). The tensors must stay where they are.

    ``spread`` copies may read another GPU of the host (peer access enabled, :func:`batchable` with ``peer``):
    the kernel's loads cross NVLink. Their blocks are spread evenly among the others' (:func:`spread_evenly`),
    so the reads over the link overlap the whole launch instead of leaving the GPU's memory idle at one end
    (measured: docs/performance.md).
    ``spread_sources`` are the addresses the kernel reads each spread copy's source at, where that is not its
    ``data_ptr()`` (memory of another process: :func:`awex.transport.peer_dma.open_ipc_memory`).
    ``rows`` are copies that go row by row (:func:`row_copy`), read from another GPU as the spread ones are (at
    ``rows_sources``); a row shorter than ``block_bytes`` leaves the rest of its program idle, so a launch of short
    rows takes a block of about a row. ``block_bytes`` and ``num_warps`` default to :data:`LOCAL_BLOCK_BYTES` and
    :data:`LOCAL_WARPS` for a launch within one GPU, else to :data:`BLOCK_BYTES` and 16 warps."""

    def __init__(
        self,
        copies: Sequence[tuple[torch.Tensor, torch.Tensor]],
        block_bytes: int | None = None,
        num_warps: int | None = None,
        spread: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
        spread_sources: Sequence[int] | None = None,
        rows: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
        rows_sources: Sequence[int] | None = None,
    ):
        everything = [*copies, *spread, *rows]
        if not everything:
            raise AwexValueError("BatchedCopy needs at least one copy")
        local = not spread and not rows
        if block_bytes is None:
            block_bytes = LOCAL_BLOCK_BYTES if local else BLOCK_BYTES
        if num_warps is None:
            num_warps = LOCAL_WARPS if local else 16
        shapes = [row_copy(d, s) for d, s in rows]  # (rows, row bytes, strides) of each rows copy, worked out once
        bad = (
            [i for i, (d, s) in enumerate(copies) if not batchable(d, s)]
            + [len(copies) + i for i, (d, s) in enumerate(spread) if not batchable(d, s, peer=True)]
            + [len(copies) + len(spread) + i for i, shape in enumerate(shapes) if shape is None]
        )
        if bad:
            raise AwexValueError(
                f"copies {bad[:5]} are not batchable (contiguous, CUDA, 16-byte aligned; only "
                "spread copies may read another GPU; rows copies go row by row: row_copy)"
            )
        self.device = everything[0][0].device
        if any(d.device != self.device for d, _ in everything):
            raise AwexValueError("BatchedCopy copies into one GPU")
        if spread_sources is None:
            spread_sources = [s.data_ptr() for _, s in spread]
        if len(spread_sources) != len(spread) or any(a % ALIGN for a in spread_sources):
            raise AwexValueError(f"spread_sources: one {ALIGN}-byte aligned address per spread copy")
        if rows_sources is None:
            rows_sources = [s.data_ptr() for _, s in rows]
        if len(rows_sources) != len(rows) or any(a % ALIGN for a in rows_sources):
            raise AwexValueError(f"rows_sources: one {ALIGN}-byte aligned address per rows copy")
        first = everything[0][0]
        self._base = first if first.is_contiguous() else first[0]  # kept alive: the kernel's base pointer
        base = self._base.data_ptr()
        at = self.device  # the table is made where the kernel reads it
        blocks = spread_evenly(
            copy_blocks([(d.data_ptr(), s.data_ptr(), d.nbytes) for d, s in copies], base, block_bytes, at),
            torch.cat(
                [
                    copy_blocks(
                        [(d.data_ptr(), a, d.nbytes) for (d, _), a in zip(spread, spread_sources)],
                        base,
                        block_bytes,
                        at,
                    ),
                    row_blocks(
                        [(d.data_ptr(), a, *shape) for (d, _), a, shape in zip(rows, rows_sources, shapes)],
                        base,
                        block_bytes,
                    ).to(at),
                ]
            ),
        )
        self._table = blocks.view(-1)
        self._pointer = self._base.view(-1).view(torch.uint8)
        self.blocks = len(blocks)
        self.nbytes = sum(d.nbytes for d, _ in (*copies, *spread)) + sum(n * row for n, row, _, _ in shapes)
        self.block_bytes = block_bytes
        self.num_warps = num_warps
        self._keep = everything
        self._compile()

    def _compile(self) -> None:
        """Compile the kernel now, without running it, so that a CUDA graph can capture the first call (once per
        configuration and device; Triton keeps what it compiled)."""
        config = (self.block_bytes, self.num_warps, self.device)
        if config in _COMPILED:
            return
        _COMPILED.add(config)
        try:
            _kernel().warmup(
                self._pointer, self._table, BLOCK=self.block_bytes, num_warps=self.num_warps, grid=(self.blocks,)
            )
        except (AttributeError, TypeError) as e:  # a Triton without warmup(): it compiles on the first call
            log.debug("Triton warmup unavailable (%s); the kernel compiles on first use", e)

    def __call__(self) -> None:
        _kernel()[(self.blocks,)](self._pointer, self._table, BLOCK=self.block_bytes, num_warps=self.num_warps)


def row_reads(rows: Sequence[tuple[torch.Tensor, torch.Tensor]], rows_sources: Sequence[int]) -> BatchedCopy:
    """One launch copying ``rows`` row by row (read at ``rows_sources``: :class:`BatchedCopy`), its block the
    largest power of two up to :data:`ROW_BLOCK_MAX` that divides every row, so that no program idles past a row's
    end; a warp a 4 KiB of block, as the default launch has."""
    block = ROW_BLOCK_MAX
    for d, _ in rows:
        n = d[0].nbytes
        block = min(block, n & -n)
    return BatchedCopy([], rows=rows, rows_sources=rows_sources, block_bytes=block, num_warps=max(1, block // 4096))
