"""Colocated sync over CUDA IPC: the receiver copies straight from the trainer's memory into its own.

When trainer and inference processes share a host (the same GPU or GPUs of one NVLink domain), no staging
and no collective are needed: the trainer exports, once, a CUDA IPC handle for every storage behind its views
and a description of each view (storage, offset, sizes, strides, dtype) as plain data (:class:`IpcExport`,
JSON/msgpack through the MetaServer, never pickled). The receiver opens the handles once, rebuilds the same
views over the trainer's memory, and for every transfer of the plan copies source pieces into its own
pieces in place: a device-to-device copy on the same GPU, a peer copy over NVLink across GPUs. Exports stay
valid while the trainer's storages do not move (:meth:`IpcExport.matches` tells); then they are re-exported.

The handles come from PyTorch's own CUDA storage sharing (``UntypedStorage._share_cuda_`` /
``_new_shared_cuda``, the calls ``torch.multiprocessing`` makes), so the trainer's caching allocator keeps
an exported block alive while a receiver holds it.
"""

from __future__ import annotations

import base64
import logging
import time
from dataclasses import dataclass

import torch

from awex.meta import Box, Plan
from awex.transport.copies import merge_copies
from awex.transport.p2p import TransferStats, TransferTimeout
from awex.transport.shards import LocalShards, torch_dtype

log = logging.getLogger("awex.transport")


@dataclass(frozen=True)
class ExportedView:
    """One view of a trainer rank's memory: ``box`` of canonical tensor ``name`` lives at ``storage`` with
    this element offset, sizes and strides."""

    name: str
    box: Box
    storage: int
    offset: int
    strides: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class IpcExport:
    """What a trainer rank publishes once: its storages' IPC handles and its views over them."""

    storages: tuple[tuple, ...]  # the fields of UntypedStorage._share_cuda_() (handles are bytes)
    pointers: tuple[int, ...]  # the storages' device addresses when exported (to notice that they moved)
    views: tuple[ExportedView, ...]

    def to_wire(self) -> dict:
        def enc(x):
            return {"b64": base64.b64encode(x).decode()} if isinstance(x, bytes) else x

        return {
            "storages": [[enc(x) for x in s] for s in self.storages],
            "pointers": list(self.pointers),
            "views": [[v.name, list(v.box.offsets), list(v.box.sizes), v.storage, v.offset, list(v.strides), v.dtype]
                      for v in self.views],
        }

    @classmethod
    def from_wire(cls, doc: dict) -> IpcExport:
        def dec(x):
            return base64.b64decode(x["b64"]) if isinstance(x, dict) else x

        try:
            storages = tuple(tuple(dec(x) for x in s) for s in doc["storages"])
            views = tuple(ExportedView(str(n), Box(tuple(o), tuple(z)), int(s), int(off), tuple(st), str(dt))
                          for n, o, z, s, off, st, dt in doc["views"])
            return cls(storages, tuple(int(p) for p in doc["pointers"]), views)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed IPC export: {e}") from None

    def matches(self, shards: LocalShards) -> bool:
        """Whether ``shards`` still live where this export says (same storages, same views)."""
        return self.pointers == _storage_pointers(shards)[0]


def _storage_pointers(shards: LocalShards) -> tuple[tuple[int, ...], list[torch.UntypedStorage]]:
    seen: dict[int, int] = {}
    storages: list[torch.UntypedStorage] = []
    for name in sorted(shards.names()):
        for _, view in shards.pairs(name):
            st = view.untyped_storage()
            if st.data_ptr() not in seen:
                seen[st.data_ptr()] = len(storages)
                storages.append(st)
    return tuple(s.data_ptr() for s in storages), storages


def export_shards(shards: LocalShards) -> IpcExport:
    """Export a trainer rank's CUDA views for colocated receivers (call once; re-export when they move)."""
    if shards.device.type != "cuda":
        raise ValueError(f"CUDA IPC needs CUDA views, these are on {shards.device}")
    pointers, storages = _storage_pointers(shards)
    index = {p: i for i, p in enumerate(pointers)}
    handles = tuple(tuple(st._share_cuda_()) for st in storages)
    views = []
    for name in sorted(shards.names()):
        for box, view in shards.pairs(name):
            views.append(ExportedView(name, box, index[view.untyped_storage().data_ptr()], view.storage_offset(),
                                      tuple(view.stride()), str(view.dtype).removeprefix("torch.")))
    return IpcExport(handles, pointers, tuple(views))


def open_export(export: IpcExport) -> LocalShards:
    """The trainer rank's views, rebuilt over its memory in this process (opens each handle once).

    Views of memory on another GPU stay on that GPU: copies from them are PyTorch peer copies. (Aliasing them
    onto this process's GPU, so that the copies would run in this process's own context, was tried: the
    receiving process failed on 4x H200; not pursued further yet.)
    """
    torch.cuda._lazy_init()
    storages = []
    for fields in export.storages:
        home, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = fields
        storages.append(torch.UntypedStorage._new_shared_cuda(
            home, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync))
    shards: dict[str, list[tuple[Box, torch.Tensor]]] = {}
    for v in export.views:
        st = storages[v.storage]
        t = torch.empty(0, dtype=torch_dtype(v.dtype), device=st.device)
        t.set_(st, v.offset, v.box.sizes, v.strides)
        shards.setdefault(v.name, []).append((v.box, t))
    return LocalShards(shards)


def _overlap(a: tuple[slice, ...], b: tuple[slice, ...]) -> tuple[slice, ...] | None:
    out = []
    for x, y in zip(a, b):
        lo, hi = max(x.start, y.start), min(x.stop, y.stop)
        if lo >= hi:
            return None
        out.append(slice(lo, hi))
    return tuple(out)


def _shift(s: tuple[slice, ...], by: tuple[slice, ...]) -> tuple[slice, ...]:
    return tuple(slice(x.start - b.start, x.stop - b.start) for x, b in zip(s, by))


class IpcExecutor:
    """A receiver's copies for one plan, straight from its sources' memory (built once, run every sync)."""

    def __init__(self, plan: Plan, rank: int, shards: LocalShards, sources: dict[int, LocalShards],
                 cuda_graph: bool = True, bounce_bytes: int = 256 << 20):
        self.plan = plan
        self.cuda_graph = cuda_graph
        self.rank = rank
        self.device = shards.device
        names = [t.name for t in plan.tensors]
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.bytes_received = 0
        for step in plan.schedule(rank):
            if step.op != "recv":
                raise ValueError(f"rank {rank} would send over CUDA IPC (a relay): plan colocated syncs without relay")
            src = sources.get(step.peer)
            if src is None:
                raise KeyError(f"rank {rank}: no IPC export of source rank {step.peer}")
            for t in step.bucket.transfers:
                whole = tuple(slice(0, n) for n in t.sizes)
                dst_pieces = shards.pieces(names[t.tensor], t.offsets, t.sizes)
                src_pieces = src.pieces(names[t.tensor], t.offsets, t.sizes)
                for here_d, dview in dst_pieces:
                    here_d = here_d or whole
                    for here_s, sview in src_pieces:
                        here_s = here_s or whole
                        both = _overlap(here_d, here_s)
                        if both is None:
                            continue
                        d = dview[_shift(both, here_d)] if both else dview
                        s = sview[_shift(both, here_s)] if both else sview
                        self.copies.append((d, s))
                self.bytes_received += t.nbytes
        self.copies = merge_copies(self.copies)
        self._remote = [(d, s) for d, s in self.copies if s.device != d.device]  # PyTorch peer copies
        self._local = [(d, s) for d, s in self.copies if s.device == d.device]
        self._graph: torch.cuda.CUDAGraph | None = None
        # A peer copy is a DMA (copy engines) only when both sides are contiguous; otherwise PyTorch runs a copy
        # kernel on the source GPU, inside this process's context there, which time-slices with the engine that
        # owns that GPU. And many small DMAs cost more than one large one. So the pieces read from one source
        # storage are fetched as one contiguous span (one DMA, up to `bounce_bytes`) into a buffer on this GPU
        # and placed from there by local copies.
        self._plan_remote(bounce_bytes)
        self.buckets = len(plan.schedule(rank))

    def run(self, timeout: float = 300.0) -> TransferStats:
        """Copy everything; returns when it is done (or raises after ``timeout``).

        Copies from another GPU's memory (peer copies, fetched per source storage as one contiguous span where
        possible) and copies within this GPU (one CUDA graph replay after the first sync) go on separate
        streams so that they overlap.
        """
        started = time.monotonic()
        compute = torch.cuda.current_stream(self.device)
        streams = []
        if self._direct or self._spans:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(compute)
            with torch.cuda.stream(stream):
                for d, s in self._direct:
                    d.copy_(s, non_blocking=True)
                for span, n, placed in self._spans:
                    self._bounce.view(span.dtype)[:n].copy_(span, non_blocking=True)  # one peer DMA
                    for d, s in placed:
                        d.copy_(s, non_blocking=True)  # local copies from the bounce buffer
            streams.append(stream)
        if self._local:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(compute)
            with torch.cuda.stream(stream):
                self._copy_local(stream)
            streams.append(stream)
        events = []
        for stream in streams:
            done = torch.cuda.Event()
            done.record(stream)
            events.append(done)
        for done in events:
            while not done.query():
                if time.monotonic() - started > timeout:
                    raise TransferTimeout(f"rank {self.rank}: CUDA IPC copies not done within {timeout:g} s")
                time.sleep(20e-6)
        for stream in streams:
            compute.wait_stream(stream)
        return TransferStats(bytes_received=self.bytes_received, buckets=self.buckets, waves=1,
                             seconds=time.monotonic() - started)

    def _plan_remote(self, bounce_bytes: int) -> None:
        self._direct: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._spans: list[tuple[torch.Tensor, int, list[tuple[torch.Tensor, torch.Tensor]]]] = []
        by_storage: dict[tuple[int, torch.dtype], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for d, s in self._remote:
            by_storage.setdefault((s.untyped_storage().data_ptr(), s.dtype), []).append((d, s))
        largest = 0
        spans = []
        for (_, dtype), items in by_storage.items():
            if len(items) == 1 and items[0][0].is_contiguous() and items[0][1].is_contiguous():
                self._direct.extend(items)  # already one DMA
                continue
            lo = min(s.storage_offset() for _, s in items)
            hi = max(s.storage_offset() + sum((n - 1) * st for n, st in zip(s.shape, s.stride())) + 1
                     for _, s in items)
            size = (hi - lo) * items[0][1].element_size()
            if size > bounce_bytes or items[0][0].dtype != dtype:
                self._direct.extend(items)
                continue
            spans.append((lo, hi, dtype, items))
            largest = max(largest, size)
        largest = -(-largest // 16) * 16
        self._bounce = torch.empty(largest, dtype=torch.uint8, device=self.device) if spans else None
        self.staging_bytes = largest
        for lo, hi, dtype, items in spans:
            src = items[0][1]
            span = torch.empty(0, dtype=dtype, device=src.device).set_(src.untyped_storage(), lo, (hi - lo,), (1,))
            flat = self._bounce.view(dtype)
            placed = [(d, flat.as_strided(s.shape, s.stride(), s.storage_offset() - lo)) for d, s in items]
            self._spans.append((span, hi - lo, merge_copies(placed)))

    def _copy_local(self, stream: torch.cuda.Stream) -> None:
        """The same-GPU copies, replayed from a CUDA graph captured on first use (one launch per sync)."""
        if self._graph is None and self.cuda_graph:
            try:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=stream):
                    for d, s in self._local:
                        d.copy_(s, non_blocking=True)
                self._graph = graph
            except RuntimeError as e:  # capture is an optimisation: fall back to plain copies
                log.warning("rank %d: CUDA graph capture of IPC copies failed (%s); copying eagerly", self.rank, e)
                self.cuda_graph = False
        if self._graph is not None:
            self._graph.replay()
        else:
            for d, s in self._local:
                d.copy_(s, non_blocking=True)
