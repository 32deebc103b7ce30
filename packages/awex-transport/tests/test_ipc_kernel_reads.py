"""Kernels reading another process's GPU memory over CUDA IPC (two GPUs needed; skipped elsewhere).

PyTorch opens an exported storage in the context of the GPU it lives on; kernels of another GPU cannot read
that mapping. ``MappedShards.kernel_address`` maps the allocation a second time into the reading GPU's context.
These tests run a real exporting process: the handle format they parse is PyTorch's internal one.
"""

import gc
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from awex.transport.ipc import IpcExport, open_export
from awex.transport.ipc.mapping import cuda_malloc_handle

needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")

EXPORTER = textwrap.dedent("""
    import json, sys, torch
    from awex.meta import Box
    from awex.transport import LocalShards
    from awex.transport.ipc import export_shards
    torch.cuda.set_device(1)
    a = torch.arange(1 << 20, dtype=torch.int32, device="cuda:1")
    b = (torch.arange(3 << 18, dtype=torch.int32, device="cuda:1") * 7).view(768, 1024)
    shards = LocalShards({"a": [(Box((0,), (1 << 20,)), a)], "b": [(Box((0, 0), (768, 1024)), b)]})
    torch.cuda.synchronize()
    print(json.dumps(export_shards(shards).to_wire()), flush=True)
    sys.stdin.readline()  # stay alive (and keep the memory) until the reader is done
""")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (PyTorch's CUDA IPC handles)")
def test_torch_ipc_handle_format():
    """Fails when PyTorch changes how ``_share_cuda_`` wraps the ``cudaIpcMemHandle_t``."""
    import ctypes

    from awex.transport.peer_dma import _IpcMemHandle, _libcuda

    x = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
    fields = x.untyped_storage()._share_cuda_()
    handle = cuda_malloc_handle(fields[1])
    assert handle is not None and len(handle) == 64
    expected = _IpcMemHandle()
    lib = _libcuda()
    lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcMemHandle), ctypes.c_uint64]
    assert lib.cuIpcGetMemHandle(ctypes.byref(expected), x.data_ptr() - fields[3]) == 0
    assert handle == bytes(expected)


def test_handle_format_parsing_without_gpu():
    raw = bytes(range(64))
    assert cuda_malloc_handle(raw) == raw
    assert cuda_malloc_handle(b"c" + raw) == raw
    assert cuda_malloc_handle(b"\x02c" + raw) == raw
    assert cuda_malloc_handle(b"\x02e" + raw) is None  # expandable segment: no cudaMalloc handle
    assert cuda_malloc_handle(raw[:10]) is None


@needs_two_gpus
def test_kernel_on_one_gpu_reads_another_process_memory_on_another():
    from awex.transport.batched_copy import BatchedCopy
    from awex.transport.peer_dma import enable_peer_access

    exporter = subprocess.Popen(
        [sys.executable, "-c", EXPORTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        line = exporter.stdout.readline()
        assert line, "the exporting process died"
        here, there = torch.device("cuda", 0), torch.device("cuda", 1)
        torch.cuda.set_device(here)
        enable_peer_access(here, there)
        mapped = open_export(IpcExport.from_wire(json.loads(line)))
        ((_, a),) = mapped.pairs("a")
        ((_, b),) = mapped.pairs("b")
        assert a.device == there
        rows = b[100:300]  # a contiguous piece inside the allocation
        spread = [(torch.zeros_like(a, device=here), a), (torch.zeros_like(rows, device=here), rows)]
        sources = [mapped.kernel_address(s.data_ptr(), here) for _, s in spread]
        assert None not in sources and sources[0] != a.data_ptr()  # a second mapping, in GPU 0's context
        assert mapped.kernel_address(a.data_ptr(), there) == a.data_ptr()  # read on its own GPU: as it is
        local = [
            (torch.zeros(4096, dtype=torch.int32, device=here), torch.full((4096,), 5, dtype=torch.int32, device=here))
        ]
        BatchedCopy(local, spread=spread, spread_sources=sources)()
        torch.cuda.synchronize(here)
        assert torch.equal(spread[0][0].cpu(), torch.arange(1 << 20, dtype=torch.int32))
        assert torch.equal(spread[1][0].cpu(), (torch.arange(3 << 18, dtype=torch.int32) * 7).view(768, 1024)[100:300])
        assert torch.equal(local[0][0], local[0][1])
        mapped.close()
        assert not mapped._aliases
        del mapped, a, b, rows, spread, sources
        gc.collect()  # release the exporter's memory before it exits (PyTorch counts the references)
    finally:
        exporter.stdin.write("done\n")
        exporter.stdin.close()
        exporter.wait(timeout=60)
