"""A source rank's exported views opened in this process: the handles mapped, the same views rebuilt over them."""

from __future__ import annotations

import bisect
import logging
import weakref
from collections.abc import Sequence

import torch

from awex.meta import Box
from awex.transport.ipc.wire import IpcExport
from awex.transport.peer_dma import (
    PeerDmaError,
    close_ipc_memory,
    open_ipc_memory,
)
from awex.transport.shards import LocalShards, torch_dtype

log = logging.getLogger("awex.transport")


class MappedShards(LocalShards):
    """A source rank's views opened over CUDA IPC, with the address ranges mapped in this process.

    Each IPC handle maps a whole allocation (one segment of the trainer's caching allocator, usually holding
    many parameters); ``regions`` are those ranges ``(start, end)``, so a receiver may read across several
    parameters of one segment with one DMA.
    """

    def __init__(
        self,
        shards,
        regions: Sequence[tuple[int, int]],
        handles: dict[tuple[int, int], tuple[bytes | None, int]] | None = None,
        export: IpcExport | None = None,
        storages: Sequence[torch.UntypedStorage] = (),
    ):
        super().__init__(shards)
        self.export, self.storages = export, tuple(storages)  # what was opened: the export, a storage per handle
        self.regions = tuple(sorted(regions))
        self._starts = [lo for lo, _ in self.regions]
        self._handles = dict(handles or {})  # region -> (its cudaIpcMemHandle_t or None, the GPU it lives on)
        self._aliases: dict[tuple[tuple[int, int], int], int | None] = {}
        weakref.finalize(self, _close_aliases, self._aliases)

    def kernel_address(self, pointer: int, device: torch.device) -> int | None:
        """Where kernels on ``device`` read the byte at ``pointer`` (an address of these views), or ``None``
        where they cannot. Memory of another GPU is mapped a second time, into ``device``'s context, on first
        use (:func:`~awex.transport.peer_dma.open_ipc_memory`), and unmapped by :meth:`close`."""
        region = self.region_of(pointer)
        handle, home = self._handles.get(region, (None, None)) if region else (None, None)
        if home is None:
            return None
        if home == device.index:
            return pointer
        key = (region, device.index)
        if key not in self._aliases:
            try:
                self._aliases[key] = open_ipc_memory(handle, device) if handle is not None else None
            except PeerDmaError as e:
                log.info("cannot map trainer memory into %s for kernel reads (%s): copy engines read it", device, e)
                self._aliases[key] = None
        alias = self._aliases[key]
        return None if alias is None else alias + pointer - region[0]

    def close(self) -> None:
        """Unmap the second mappings made for kernel reads (the views themselves stay valid). Call it only once
        no executor built over these views runs again: their graphs read through those mappings."""
        _close_aliases(self._aliases)

    def region_of(self, pointer: int) -> tuple[int, int] | None:
        i = bisect.bisect_right(self._starts, pointer) - 1
        if i >= 0 and pointer < self.regions[i][1]:
            return self.regions[i]
        return None


def _close_aliases(aliases: dict[tuple[tuple[int, int], int], int | None]) -> None:
    """Unmap and forget every mapping in ``aliases`` (at ``close()`` and when the MappedShards is collected)."""
    for (_, index), address in aliases.items():
        if address is not None:
            try:
                close_ipc_memory(address, torch.device("cuda", index))
            except Exception as e:  # at interpreter exit CUDA may be gone already
                log.debug("closing a CUDA IPC mapping failed: %s", e)
    aliases.clear()


def cuda_malloc_handle(shared: bytes) -> bytes | None:
    """The ``cudaIpcMemHandle_t`` inside the handle PyTorch's ``UntypedStorage._share_cuda_()`` returns, or
    ``None`` where the storage is not a plain ``cudaMalloc`` allocation (expandable segments).

    PyTorch's format is internal: the 64 handle bytes alone (older releases), or after a type byte ``c``
    (``cudaMalloc``; ``e`` for expandable segments), or after a version byte and that type byte (seen with
    PyTorch 2.11). The GPU test ``test_torch_ipc_handle_format`` fails when it changes."""
    if len(shared) == 64:
        return shared
    if len(shared) == 65 and shared[:1] == b"c":
        return shared[1:]
    if len(shared) == 66 and shared[1:2] == b"c":
        return shared[2:]
    return None


def open_export(export: IpcExport) -> MappedShards:
    """The trainer rank's views, rebuilt over its memory in this process (opens each handle once).

    Views of memory on another GPU stay on that GPU; the IPC executor reads them with DMAs issued on this
    GPU (:mod:`awex.transport.peer_dma`).
    """
    torch.cuda._lazy_init()
    storages = []
    mapped: dict[bytes, tuple[int, int]] = {}  # handle -> (allocation start, end of what is known to be mapped)
    homes: dict[bytes, int] = {}
    for fields in export.storages:
        home, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = fields
        st = torch.UntypedStorage._new_shared_cuda(
            home, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync
        )
        storages.append(st)
        base = st.data_ptr() - offset
        lo, hi = mapped.get(handle, (base, base))
        mapped[handle] = (lo, max(hi, base + offset + size))
        homes[handle] = st.device.index
    return MappedShards(
        views_over(export, storages),
        list(mapped.values()),
        {region: (cuda_malloc_handle(h), homes[h]) for h, region in mapped.items()},
        export,
        storages,
    )


def views_over(
    export: IpcExport, storages: Sequence[torch.UntypedStorage]
) -> dict[str, list[tuple[Box, torch.Tensor]]]:
    """``export``'s views over ``storages`` (its storages as opened here, in its order): strided views of one tensor
    per storage and dtype."""
    shards: dict[str, list[tuple[Box, torch.Tensor]]] = {}
    whole: dict[tuple[int, str], torch.Tensor] = {}  # each storage as one tensor of each dtype its views have
    for v in export.views:
        base = whole.get((v.storage, v.dtype))
        if base is None:
            st = storages[v.storage]
            base = whole[(v.storage, v.dtype)] = torch.empty(0, dtype=torch_dtype(v.dtype), device=st.device).set_(st)
        shards.setdefault(v.name, []).append((v.box, base.as_strided(v.box.sizes, v.strides, v.offset)))
    return shards
