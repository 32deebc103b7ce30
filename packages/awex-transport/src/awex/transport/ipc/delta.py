"""Delta syncs over CUDA IPC: receivers read the changed words from a board the trainer exports with its weights.

The encoding, the checksums and the rules are :mod:`awex.transport.delta`'s; what differs is who moves the bytes.
Before it says ready, a trainer rank encodes each bucket it sends against what its receiver confirmed last
(:class:`IpcDeltaSender`): a header row per bucket (mode, count, where its payload lies, the checksums of the
version it assumes and of the new one) and the payloads, written into one buffer (the *board*) exported over CUDA
IPC beside its weights. A receiver (:class:`IpcDeltaReceiver`) reads the headers, pulls each payload, applies it
to its own words and checks both checksums; a bucket that does not check out, or that the trainer marked whole,
it reads straight from the trainer's weights (no round trip: the weights are exported anyway) and checks again.
The trainer keeps a bucket's words as the next baseline only once every receiver applied the version
(:meth:`IpcDeltaSender.confirm`, from the transport's ``applied``), so a failed sync costs the next one a whole
read of what it did not confirm, never a wrong weight.

The board holds a quarter of the sender's bytes (beyond it buckets go whole): a step that changes more than that
gains little from a delta. What pays here is fewer bytes over NVLink; on one GPU the copy costs about as much as
the encoding does.
"""

from __future__ import annotations

import time

import torch

from awex.meta import Box, Plan
from awex.meta.errors import AwexValueError
from awex.transport.base import TransferError, TransferStats, TransferTimeout
from awex.transport.checksum import checksum
from awex.transport.copies import copier, merge_copies
from awex.transport.deadline import wait_event
from awex.transport.delta import BITMAP, DENSE, SPARSE, encode, fill_words, positions
from awex.transport.messages import align, message_offsets
from awex.transport.shards import LocalShards, torch_dtype

BOARD = "awex.delta_board"  # the name the board is exported under (not a canonical tensor name)
_ROW = 8  # int64 header fields per bucket: mode, count, payload offset, index bytes, base sums (2), new sums (2)


def _buckets_from(plan: Plan, rank: int) -> list[int]:
    """The buckets ``rank`` sends, in the plan's order: a board's header rows, in the same order on both sides."""
    return [i for i, b in enumerate(plan.buckets) if b.src == rank]


def _words_of(plan: Plan, shards: LocalShards, bucket: int, staging: torch.Tensor, into: bool):
    """The copies between ``shards`` and a bucket's words in ``staging`` (its transfers end to end, as
    :func:`awex.transport.messages.message_offsets` lays them out): from the views into the words, or back."""
    b = plan.buckets[bucket]
    offsets, _ = message_offsets(b.transfers)
    pairs = []
    for t, off in zip(b.transfers, offsets):
        region = staging[off : off + t.nbytes].view(torch_dtype(plan.tensors[t.tensor].dtype)).view(t.sizes)
        for here, piece in shards.pieces(plan.tensors[t.tensor].name, t.offsets, t.sizes):
            pairs.append((region[here] if here else region, piece))
    if not into:
        pairs = [(view, region) for region, view in pairs]
    return [copier(d, s) for d, s in merge_copies(pairs)]


def _bucket_bytes(plan: Plan, bucket: int) -> int:
    return align(message_offsets(plan.buckets[bucket].transfers)[1])


class IpcDeltaSender:
    """A trainer rank's delta buckets for receivers that read its memory (built once per plan)."""

    def __init__(self, plan: Plan, rank: int, shards: LocalShards, budget_bytes: int | None = None):
        if plan.quantized:
            raise AwexValueError("delta syncs with FP8 quantised on the copy are not built: pick one of the two")
        self.plan, self.rank, self.device, self.budget_bytes = plan, rank, shards.device, budget_bytes
        self.buckets = _buckets_from(plan, rank)
        self.sizes = [_bucket_bytes(plan, i) for i in self.buckets]
        self.staging = torch.zeros(max(self.sizes, default=0), dtype=torch.uint8, device=self.device)
        self._gather = [_words_of(plan, shards, i, self.staging, into=True) for i in self.buckets]
        header = align(len(self.buckets) * _ROW * 8)
        self.board = torch.zeros(header + align(sum(self.sizes) // 4), dtype=torch.uint8, device=self.device)
        self._header = header
        self.kept: dict[int, torch.Tensor] = {}  # position in self.buckets -> the words its receiver confirmed
        self.kept_sums: dict[int, tuple[int, int]] = {}
        self.kept_bytes = 0
        self._sums: list[tuple[int, int]] = []  # the encoded version's checksums, kept once confirmed
        self.bytes_read = self.bytes_dense = 0  # what receivers read this version, and a dense sync's bytes

    @property
    def held_bytes(self) -> int:
        return self.staging.numel() + self.board.numel() + self.kept_bytes

    def board_shards(self, shards: LocalShards) -> LocalShards:
        """``shards`` and the board under :data:`BOARD`: what this rank exports."""
        views = {name: shards.pairs(name) for name in shards.names()}
        views[BOARD] = ((Box((0,), (self.board.numel(),)), self.board),)
        return LocalShards(views)

    @torch.no_grad()
    def encode(self) -> None:
        """Write this version's headers and payloads into the board (on the current stream; the caller waits for it
        before saying ready)."""
        rows, at, sums = [], self._header, []
        read = dense = 0
        for k, size in enumerate(self.sizes):
            words = fill_words(self.staging, size, self._gather[k])
            new = checksum(words)
            sums.append(new)
            kept = self.kept.get(k)
            mode, index, values = encode(words, kept) if kept is not None else (DENSE, None, None)
            count, offset, index_bytes = words.numel(), 0, 0
            if mode != DENSE:
                index_bytes = index.numel() * index.element_size()
                need = align(index_bytes) + values.numel() * 2
                if at + need > self.board.numel():
                    mode = DENSE
                else:
                    self.board[at : at + index_bytes].copy_(index.view(torch.uint8))
                    start = at + align(index_bytes)
                    self.board[start : start + values.numel() * 2].copy_(values.view(torch.uint8))
                    count, offset = values.numel(), at
                    at = align(start + values.numel() * 2)
            base = self.kept_sums[k] if mode != DENSE else (0, 0)
            rows.append([mode, count, offset, index_bytes, *base, *new])
            read += _ROW * 8 + (index_bytes + count * 2 if mode != DENSE else size)
            dense += size
        if rows:
            table = torch.tensor(rows, dtype=torch.int64).view(-1).view(torch.uint8)
            self.board[: table.numel()].copy_(table, non_blocking=False)
        self._sums, self.bytes_read, self.bytes_dense = sums, read, dense

    @torch.no_grad()
    def confirm(self) -> None:
        """Every receiver applied the encoded version: its words become the baseline (within the budget)."""
        for k, size in enumerate(self.sizes):
            if k >= len(self._sums):
                return
            kept = self.kept.get(k)
            if kept is None and self.budget_bytes is not None and self.kept_bytes + size > self.budget_bytes:
                continue  # beyond the budget: this bucket always goes whole
            words = fill_words(self.staging, size, self._gather[k])
            if kept is None:
                self.kept[k] = words.clone()
                self.kept_bytes += size
            else:
                kept.copy_(words)
            self.kept_sums[k] = self._sums[k]
        self._sums = []


class IpcDeltaReceiver:
    """A receiver rank's delta buckets, read from its sources' boards and memory (built once per plan and set of
    opened sources). ``run`` returns the same :class:`TransferStats` as the other executors, with
    ``bytes_dense`` and ``buckets_resent``."""

    def __init__(self, plan: Plan, rank: int, shards: LocalShards, sources: dict[int, LocalShards]):
        if shards.on_host:
            raise AwexValueError(
                f"rank {rank}: delta syncs apply on the GPU; this rank's views are in host memory (stage on the GPU "
                "or send whole versions)"
            )
        self.plan, self.rank, self.device = plan, rank, shards.device
        self.buckets = [i for i, b in enumerate(plan.buckets) if b.dst == rank]
        self.sizes = [_bucket_bytes(plan, i) for i in self.buckets]
        self.staging = torch.zeros(max(self.sizes, default=0), dtype=torch.uint8, device=self.device)
        self._boards: dict[int, torch.Tensor] = {}
        self._rows: dict[int, int] = {}  # bucket -> its row on its sender's board
        for peer in sorted({plan.buckets[i].src for i in self.buckets}):
            pairs = sources[peer].pairs(BOARD)
            if len(pairs) != 1:
                raise AwexValueError(
                    f"rank {rank}: sync rank {peer} exported no delta board (is its writer started with delta=True?)"
                )
            self._boards[peer] = pairs[0][1]
            self._rows.update({i: r for r, i in enumerate(_buckets_from(plan, peer))})
        src = [sources[plan.buckets[i].src] for i in self.buckets]
        self._own = [_words_of(plan, shards, i, self.staging, into=True) for i in self.buckets]
        self._theirs = [_words_of(plan, s, i, self.staging, into=True) for i, s in zip(self.buckets, src)]
        self._scatter = [_words_of(plan, shards, i, self.staging, into=False) for i in self.buckets]
        self.staging_bytes = self.staging.numel()
        self.capture_seconds = 0.0

    @torch.no_grad()
    def run(self, timeout: float = 300.0) -> TransferStats:
        started = time.monotonic()
        deadline = started + timeout
        headers = {}
        for peer, board in self._boards.items():
            rows = len(_buckets_from(self.plan, peer))
            headers[peer] = board[: rows * _ROW * 8].to(self.device).view(torch.int64).view(rows, _ROW).cpu()
        received = dense = resent = 0
        for k, i in enumerate(self.buckets):
            if time.monotonic() > deadline:
                raise TransferTimeout(f"rank {self.rank}: delta sync not done within {timeout:g} s")
            peer = self.plan.buckets[i].src
            what = f"rank {self.rank}: delta bucket {i} from sync rank {peer}"
            mode, count, offset, index_bytes, *sums = (int(x) for x in headers[peer][self._rows[i]])
            base, new = tuple(sums[:2]), tuple(sums[2:])
            size = self.sizes[k]
            received += _ROW * 8
            dense += size
            board = self._boards[peer]
            words_count = size // 2
            index_need = count * 4 if mode == SPARSE else words_count // 8
            if (
                mode not in (DENSE, SPARSE, BITMAP)
                or not 0 <= count <= words_count
                or (mode != DENSE and (index_bytes != index_need or offset < 0 or offset % 16))
                or (mode != DENSE and offset + align(index_bytes) + count * 2 > board.numel())
            ):
                raise TransferError(f"{what}: malformed header {[mode, count, offset, index_bytes]}")
            checked = False
            if mode != DENSE:
                index = board[offset : offset + index_bytes].to(self.device)
                start = offset + align(index_bytes)
                values = board[start : start + count * 2].to(self.device).view(torch.int16)
                received += index_bytes + count * 2
                index = index.view(torch.int32) if mode == SPARSE else index
                where = positions(mode, index, count, words_count, what)
                words = fill_words(self.staging, size, self._own[k])
                if checksum(words) == base:
                    words[where] = values
                    checked = checksum(words) == new
            if not checked:  # whole, or not the version the trainer assumed: read the trainer's words
                resent += mode != DENSE
                words = fill_words(self.staging, size, self._theirs[k])
                received += size
                if checksum(words) != new:
                    raise TransferError(f"{what}: the trainer's words do not match its checksum (changed mid-sync?)")
            for copy in self._scatter[k]:
                copy()
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            wait_event(
                done, deadline, lambda: TransferTimeout(f"rank {self.rank}: delta sync not done in {timeout:g} s")
            )
        stats = TransferStats(0, received, len(self.buckets), 1, self.staging_bytes, time.monotonic() - started)
        stats.bytes_dense, stats.buckets_resent = dense, resent
        return stats
