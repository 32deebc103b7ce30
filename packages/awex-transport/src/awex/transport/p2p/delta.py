"""Delta syncs over a process group (:class:`DeltaExecutor`): the encoding, the checksums and the rules are
:mod:`awex.transport.delta`'s. Buckets run in the plan's global order (each rank takes the subsequence it is part of,
so no two ranks can wait on each other), twice: first every bucket goes out (a sender encodes the next while its
receiver applies the last), then each receiver answers per bucket and the buckets asked for go again whole."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta

import torch

from awex.meta import Plan, Role
from awex.meta.errors import AwexValueError
from awex.transport.accelerator import device_api, is_accelerator
from awex.transport.base import TransferError, TransferStats, TransferTimeout
from awex.transport.checksum import checksum
from awex.transport.copies import copier, merge_copies
from awex.transport.deadline import WATCH_SECONDS, timed_out, wait_group_event
from awex.transport.delta import BITMAP, DENSE, OK, SPARSE, WHOLE, encode, fill_words, positions
from awex.transport.group import SyncGroup
from awex.transport.messages import align, message_offsets
from awex.transport.shards import LocalShards, torch_dtype

log = logging.getLogger("awex.transport")


class DeltaExecutor:
    """One rank's share of a relay-free plan as delta buckets, built once; keeps the sender's last versions."""

    def __init__(self, plan: Plan, rank: int, shards: LocalShards, group: SyncGroup, budget_bytes: int | None = None):
        if shards.on_host:
            raise AwexValueError(
                f"rank {rank}: delta syncs apply on the GPU; this rank's views are in host memory (stage on the GPU "
                "or send whole versions)"
            )
        if plan.quantized:
            raise AwexValueError(
                f"this plan has receivers quantise {len(plan.quantized)} weight(s) on the copy: CUDA IPC only "
                "(quantise on the sender for point to point)"
            )
        holders = {r.rank for r in plan.ranks_of(Role.TRAINER)}
        relays = [b for b in plan.buckets if b.src not in holders]
        if relays:
            raise AwexValueError(
                f"delta syncs need a plan without relays ({len(relays)} relayed bucket(s), first from rank "
                f"{relays[0].src}); plan with PlanOptions(relay=False)"
            )
        self.plan, self.rank, self.group, self.device = plan, rank, group, shards.device
        self.budget_bytes = budget_bytes
        dtypes = [torch_dtype(t.dtype) for t in plan.tensors]
        names = [t.name for t in plan.tensors]
        mine = [(i, b) for i, b in enumerate(plan.buckets) if rank in (b.src, b.dst)]  # the plan's global order
        largest = max((align(message_offsets(b.transfers)[1]) for _, b in mine), default=0)
        self.staging = torch.zeros(largest, dtype=torch.uint8, device=self.device)
        # (bucket, op, peer, bytes, views -> staging, staging -> views)
        self.steps: list[tuple[int, str, int, int, list[Callable[[], None]], list[Callable[[], None]]]] = []
        for i, b in mine:
            offsets, nbytes = message_offsets(b.transfers)
            pairs = []  # (staging region, this rank's view)
            for t, off in zip(b.transfers, offsets):
                region = self.staging[off : off + t.nbytes].view(dtypes[t.tensor]).view(t.sizes)
                for here, piece in shards.pieces(names[t.tensor], t.offsets, t.sizes):
                    pairs.append((region[here] if here else region, piece))
            gather = [copier(d, s) for d, s in merge_copies(pairs)]
            scatter = [copier(d, s) for d, s in merge_copies([(v, r) for r, v in pairs])] if b.dst == rank else []
            op, peer = ("send", b.dst) if b.src == rank else ("recv", b.src)
            self.steps.append((i, op, peer, align(nbytes), gather, scatter))
        self.kept: dict[int, torch.Tensor] = {}  # bucket index -> the words its receiver confirmed (senders)
        self.kept_sums: dict[int, tuple[int, int]] = {}  # their checksums (computed when they were sent)
        self.kept_bytes = 0
        self.buckets = len(self.steps)
        self._timeout, self._watch = 300.0, None  # run's

    @property
    def staging_bytes(self) -> int:
        return self.staging.numel() + self.kept_bytes

    def run(self, timeout: float = 300.0, watch: Callable[[], None] | None = None) -> TransferStats:
        """Send and receive this rank's buckets within ``timeout`` seconds; ``bytes_sent`` / ``bytes_received``
        count what crossed the wire, ``bytes_dense`` what a dense sync would have moved. ``watch``: asked about once
        a second while an operation on a GPU is pending (``PeerLink.watch``: a peer that failed the version raises).

        Two passes over the buckets, each in the plan's order: every bucket goes out first, a sender encoding the
        next while its receiver applies the last (nobody waits for an answer); then each receiver answers per
        bucket (applied, or send it whole) and the buckets asked for go again whole. A sender keeps each bucket's
        new words as it sends them; a bucket not confirmed when the sync fails is forgotten (whole next time)."""
        started = time.monotonic()
        deadline = started + timeout
        self._timeout, self._watch = timeout, watch
        sent = received = dense = whole = 0
        pending: dict[int, tuple[int, int]] = {}  # sent buckets not confirmed yet -> their new checksums
        answers: dict[int, tuple[torch.Tensor, tuple[int, int]]] = {}  # received buckets -> (answer, new checksums)
        try:
            for i, op, peer, size, gather, scatter in self.steps:
                words = self.staging[:size].view(torch.int16)
                dense += size
                if op == "send":
                    n, pending[i] = self._send(i, peer, words, gather, deadline)
                    sent += n
                else:
                    n, answers[i] = self._recv(i, peer, words, gather, scatter, deadline)
                    received += n
            for i, op, peer, size, gather, scatter in self.steps:
                words = self.staging[:size].view(torch.int16)
                if op == "send":
                    n = self._settle_send(i, peer, words, gather, pending.pop(i), deadline)
                    sent += n
                else:
                    n = self._settle_recv(i, peer, words, scatter, *answers[i], deadline)
                    received += n
                whole += n > 0
        except BaseException:
            for i in pending:  # the words kept of it may be newer than what its receiver holds
                self._forget(i)
            raise
        if is_accelerator(self.device):  # the last bucket's copies into the views
            device_api(self.device).current_stream(self.device).synchronize()
        stats = TransferStats(sent, received, self.buckets, 1, self.staging_bytes, time.monotonic() - started)
        stats.bytes_dense, stats.buckets_resent = dense, whole
        log.debug(
            "rank %d: delta sync of %d buckets: sent %d B, received %d B of %d B dense, %d sent again whole",
            self.rank,
            self.buckets,
            sent,
            received,
            dense,
            whole,
        )
        return stats

    def _send(self, i: int, peer: int, words: torch.Tensor, gather, deadline: float) -> tuple[int, tuple[int, int]]:
        """Send bucket ``i`` as its changes against what this rank kept, or whole; keep its new words. Returns the
        bytes sent and its new checksums."""
        fill_words(self.staging, words.numel() * 2, gather)
        new = checksum(words)
        kept = self.kept.get(i)
        mode, index, values = encode(words, kept) if kept is not None else (DENSE, None, None)
        base = self.kept_sums[i] if kept is not None else (0, 0)
        count = words.numel() if values is None else values.numel()
        header = torch.tensor([mode, count, *base, *new], dtype=torch.int64, device=self.device)
        self._one("send", header, peer, i, deadline)
        n = header.numel() * 8
        if mode == DENSE:
            self._one("send", words, peer, i, deadline)
            n += words.numel() * 2
        else:
            self._one("send", index, peer, i, deadline)
            self._one("send", values, peer, i, deadline)
            n += index.numel() * index.element_size() + values.numel() * 2
        self._keep(i, words)  # the sends above are ordered before anything later overwrites what they read
        return n, new

    def _settle_send(self, i: int, peer: int, words: torch.Tensor, gather, new: tuple[int, int], deadline) -> int:
        """The receiver's answer for bucket ``i``; the bucket again whole if it asks. Returns the bytes resent."""
        answer = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._one("recv", answer, peer, i, deadline)
        n = 0
        if int(answer) == WHOLE:
            kept = self.kept.get(i)
            if kept is None:  # beyond the budget: the words again from the views
                kept = fill_words(self.staging, words.numel() * 2, gather)
            self._one("send", kept, peer, i, deadline)
            n = words.numel() * 2
            self._one("recv", answer, peer, i, deadline)
        if int(answer) != OK:
            raise TransferError(f"rank {self.rank}: bucket {i} to rank {peer} did not check out at the receiver")
        if i in self.kept:
            self.kept_sums[i] = new
        return n

    def _recv(
        self, i: int, peer: int, words: torch.Tensor, gather, scatter, deadline: float
    ) -> tuple[int, tuple[torch.Tensor, tuple[int, int]]]:
        """Receive bucket ``i``; apply it where it checks out. Returns the bytes received and ``(answer, new
        checksums)``: ``OK`` (applied) or ``WHOLE`` (to be sent whole)."""
        header = torch.zeros(6, dtype=torch.int64, device=self.device)
        self._one("recv", header, peer, i, deadline)
        mode, count, *sums = (int(x) for x in header.cpu())
        base, new = tuple(sums[:2]), tuple(sums[2:])
        if (
            mode not in (DENSE, SPARSE, BITMAP)
            or not 0 <= count <= words.numel()
            or (mode == DENSE and count != words.numel())
        ):
            raise TransferError(f"rank {self.rank}: bucket {i} from rank {peer}: malformed header {header.tolist()}")
        n = header.numel() * 8
        if mode == DENSE:
            self._one("recv", words, peer, i, deadline)
            n += words.numel() * 2
            if checksum(words) != new:
                raise TransferError(
                    f"rank {self.rank}: bucket {i} from rank {peer} arrived whole and does not check out"
                )
            ok = True
        else:
            if mode == SPARSE:
                index = torch.empty(count, dtype=torch.int32, device=self.device)
            else:
                index = torch.empty(words.numel() // 8, dtype=torch.uint8, device=self.device)
            self._one("recv", index, peer, i, deadline)
            n += index.numel() * index.element_size()
            where = positions(mode, index, count, words.numel(), f"rank {self.rank}: bucket {i} from rank {peer}")
            values = torch.empty(count, dtype=torch.int16, device=self.device)
            self._one("recv", values, peer, i, deadline)
            n += count * 2
            fill_words(self.staging, words.numel() * 2, gather)  # the receiver's own previous version: its views
            ok = checksum(words) == base
            if ok:
                words[where] = values
                ok = checksum(words) == new
        if ok:
            for copy in scatter:
                copy()
        return n, (torch.tensor([OK if ok else WHOLE], dtype=torch.int64, device=self.device), new)

    def _settle_recv(
        self, i: int, peer: int, words: torch.Tensor, scatter, answer: torch.Tensor, new, deadline: float
    ) -> int:
        """Answer for bucket ``i``; take it whole if this rank asks. Returns the bytes received again."""
        self._one("send", answer, peer, i, deadline)
        if int(answer) == OK:
            return 0
        self._one("recv", words, peer, i, deadline)
        if checksum(words) != new:
            raise TransferError(f"rank {self.rank}: bucket {i} from rank {peer} arrived whole and does not check out")
        for copy in scatter:
            copy()
        self._one("send", answer.fill_(OK), peer, i, deadline)
        return words.numel() * 2

    def _keep(self, i: int, words: torch.Tensor) -> None:
        """Keep bucket ``i``'s words as the next baseline (within the budget); its checksums once confirmed."""
        kept = self.kept.get(i)
        if kept is not None:
            kept.copy_(words)
            return
        nbytes = words.numel() * 2
        if self.budget_bytes is not None and self.kept_bytes + nbytes > self.budget_bytes:
            return  # beyond the budget: this bucket is always sent whole
        self.kept[i] = words.clone()
        self.kept_bytes += nbytes

    def _forget(self, i: int) -> None:
        kept = self.kept.pop(i, None)
        self.kept_sums.pop(i, None)
        if kept is not None:
            self.kept_bytes -= kept.numel() * 2

    def _one(self, op: str, tensor: torch.Tensor, peer: int, bucket: int, deadline: float) -> None:
        """One send or receive, done (on a GPU, waited for on the host as gloo's are: the host reads what came next,
        a header, an answer, a checksum, and a read behind a receive that never completes would wait without a
        deadline)."""
        left = deadline - time.monotonic()
        what = f"rank {self.rank}: delta bucket {bucket}: {op} {'to' if op == 'send' else 'from'} rank {peer}"
        if left <= 0:
            raise TransferTimeout(f"{what}: the sync's {self._timeout:g} s deadline passed")
        try:
            works = self.group.exchange(
                [(tensor, peer)] if op == "send" else [], [(tensor, peer)] if op == "recv" else []
            )
            for work in works:
                work.wait(timedelta(seconds=left)) if self.device.type == "cpu" else work.wait()
        except RuntimeError as e:
            if timed_out(e, deadline):
                raise TransferTimeout(f"{what}: not done within the sync's {self._timeout:g} s deadline: {e}") from e
            raise TransferError(f"{what} failed: {e}") from e
        if is_accelerator(self.device):
            self._landed(what, deadline)
        error = self.group.error()  # a communicator aborted by PyTorch's watchdog ends its kernels early
        if error is not None:
            raise TransferError(f"rank {self.rank}: the sync group reported {error} during the sync")

    def _landed(self, what: str, deadline: float, every: float = WATCH_SECONDS) -> None:
        """Until the operations queued on this rank's stream are done: at the deadline, or once the watch says a
        peer failed the version (it will never send, or never take), the group is aborted and the transfer fails.
        Polled without sleeping at first (most are done within a fraction of a millisecond; a sleep overshoots by
        tens of microseconds, once an operation)."""
        api = device_api(self.device)
        event = api.Event()
        event.record(api.current_stream(self.device))
        wait_group_event(event, self.group, what, deadline, self._timeout, self._watch, every, time.monotonic())
