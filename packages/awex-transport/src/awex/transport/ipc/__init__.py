"""Sync on one host over CUDA IPC: the receiver copies straight from the trainer's memory into its own.

When trainer and inference processes share a host (the same GPUs, colocated, or other GPUs of one NVLink
domain), no staging on the trainer and no collective are needed: the trainer exports, once, a CUDA IPC handle
for every storage behind its views and a description of each view (storage, offset, sizes, strides, dtype) as
plain data (:class:`IpcExport`, JSON/msgpack through the MetaServer, never pickled). The receiver opens the
handles once, rebuilds the same views over the trainer's memory, and for every transfer of the plan copies
source pieces into its own pieces in place: a device-to-device copy on the same GPU, a DMA pulled over NVLink
by this GPU's copy engines across GPUs (:class:`IpcExecutor`). Exports stay valid while the trainer's storages
do not move (:meth:`IpcExport.matches` tells); then they are re-exported.

The handles come from PyTorch's own CUDA storage sharing (``UntypedStorage._share_cuda_`` /
``_new_shared_cuda``, the calls ``torch.multiprocessing`` makes), so the trainer's caching allocator keeps
an exported block alive while a receiver holds it.

Modules: :mod:`.wire` (exports as plain data, checked on arrival), :mod:`.mapping` (opening them),
:mod:`.executor` (the receiver's copies), :mod:`.fp8_on_copy` (FP8 receivers quantising from the trainer's
memory), :mod:`.delta` (delta syncs: changed words through an exported board), :mod:`.options` (the executor's
knobs), :mod:`.spans` and :mod:`.scheduling` (its planning and pure rules), :mod:`.transport` (the
:class:`~awex.transport.base.Transport` the sync session drives).
"""

from awex.transport.ipc.executor import IpcExecutor
from awex.transport.ipc.mapping import MappedShards, open_export
from awex.transport.ipc.options import IpcOptions
from awex.transport.ipc.transport import IpcTransport
from awex.transport.ipc.wire import ExportedView, IpcExport, export_shards

__all__ = [
    "ExportedView",
    "IpcExecutor",
    "IpcExport",
    "IpcOptions",
    "IpcTransport",
    "MappedShards",
    "export_shards",
    "open_export",
]
