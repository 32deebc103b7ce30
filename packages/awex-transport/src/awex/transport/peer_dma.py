"""Peer DMAs issued from the receiving GPU's own context (``cuMemcpyAsync`` on a stream of this GPU).

PyTorch runs a copy between two GPUs on the *source* GPU's current stream. In colocated mode the source GPU
belongs to another engine's process, and every process that issues work on a GPU has its own context there;
contexts on one GPU time-slice. So a receiver pulling from its neighbour GPU through ``Tensor.copy_`` takes
turns with the neighbour's own receiver: the two add up instead of overlapping (measured: docs/performance.md).
Issuing the DMA on a stream of the receiving
GPU keeps each process on its own GPU: the copy engines pull over NVLink while the neighbour's kernels run.

Only the CUDA driver API is used (``libcuda``, present wherever CUDA runs), through ``ctypes``; both sides must
be contiguous, which is why the IPC executor fetches spans into a bounce buffer.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from awex.meta.errors import AwexError, AwexValueError

_PEER_ACCESS_ALREADY_ENABLED = 704
_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1


class _IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


class PeerDmaError(AwexError, RuntimeError):
    """The CUDA driver refused a peer DMA or peer access."""


@functools.cache
def _libcuda() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuMemcpyAsync.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
    lib.cuCtxEnablePeerAccess.argtypes = [ctypes.c_void_p, ctypes.c_uint]
    lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), _IpcMemHandle, ctypes.c_uint]
    lib.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]
    return lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise PeerDmaError(f"{what} failed with CUDA driver error {rc}")


def enable_peer_access(device: torch.device, peer: torch.device) -> None:
    """Peer access between the two GPUs' contexts in this process, both ways (idempotent).

    Both directions are needed for full speed: with only ``device -> peer`` enabled, a DMA issued on
    ``device`` from memory of ``peer`` ran at a fraction of link speed (measured: docs/performance.md).
    """
    if device == peer:
        return
    if not torch.cuda.can_device_access_peer(device, peer):
        raise PeerDmaError(
            f"{device} cannot access {peer} directly (no P2P path between them): CUDA IPC "
            "copies across these GPUs are not possible"
        )
    lib = _libcuda()
    for here, there in ((peer, device), (device, peer)):  # ends with `device` current
        with torch.cuda.device(here):
            torch.cuda.current_stream(here)  # makes the primary context of `here` current on this thread
            handle = ctypes.c_int()
            _check(lib.cuDeviceGet(ctypes.byref(handle), there.index), "cuDeviceGet")
            ctx = ctypes.c_void_p()
            _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), handle), "cuDevicePrimaryCtxRetain")
            rc = lib.cuCtxEnablePeerAccess(ctx, 0)
            if rc not in (0, _PEER_ACCESS_ALREADY_ENABLED):
                _check(rc, f"cuCtxEnablePeerAccess({here} -> {there})")


def pull(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """Copy contiguous ``src`` (any GPU) into contiguous ``dst`` on ``stream`` (a stream of ``dst``'s GPU)."""
    nbytes = dst.nbytes
    if not (dst.is_contiguous() and src.is_contiguous()) or src.nbytes != nbytes:
        raise AwexValueError("peer DMA needs two contiguous tensors of equal byte size")
    pull_bytes(dst.data_ptr(), src.data_ptr(), nbytes, stream)


def pull_bytes(dst: int, src: int, nbytes: int, stream: torch.cuda.Stream) -> None:
    """Copy ``nbytes`` from device address ``src`` to ``dst`` on ``stream`` (addresses mapped in this process)."""
    _check(_libcuda().cuMemcpyAsync(dst, src, nbytes, stream.cuda_stream), "cuMemcpyAsync")


def open_ipc_memory(handle: bytes, device: torch.device) -> int:
    """Map another process's allocation (its 64-byte ``cudaIpcMemHandle_t``) into ``device``'s context; returns
    its address in this process.

    Kernels on ``device`` can read such a mapping over NVLink. They cannot read the mapping PyTorch makes when
    it opens a storage of another GPU (in that GPU's own context), even with peer access enabled: such reads
    fault with an illegal address (seen on H200). Close with :func:`close_ipc_memory`.
    """
    if len(handle) != 64:
        raise AwexValueError(f"a CUDA IPC memory handle has 64 bytes, got {len(handle)}")
    lib = _libcuda()
    raw = _IpcMemHandle()
    ctypes.memmove(ctypes.byref(raw), handle, 64)
    address = ctypes.c_uint64()
    with torch.cuda.device(device):
        torch.cuda.current_stream(device)  # makes the primary context of `device` current on this thread
        _check(
            lib.cuIpcOpenMemHandle_v2(ctypes.byref(address), raw, _IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
            "cuIpcOpenMemHandle",
        )
    return address.value


def close_ipc_memory(address: int, device: torch.device) -> None:
    """Unmap what :func:`open_ipc_memory` mapped at ``address`` on ``device``."""
    with torch.cuda.device(device):
        _check(_libcuda().cuIpcCloseMemHandle(address), "cuIpcCloseMemHandle")
