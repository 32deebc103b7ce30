"""The CUDA IPC executor's knobs are one frozen record, checked when made."""

import pytest

from awex.transport.ipc import IpcOptions


def test_defaults_and_checks():
    o = IpcOptions()
    assert o.bounce_buffers == 4 and o.cuda_graph
    with pytest.raises(ValueError, match="at least 1"):
        IpcOptions(dma_streams=0)
    with pytest.raises(ValueError, match="bounce_bytes"):
        IpcOptions(bounce_bytes=0)
    with pytest.raises(ValueError, match="unknown CUDA IPC options \\['bounce_mb'\\]"):
        IpcOptions.from_dict({"bounce_mb": 64})
    assert IpcOptions.from_dict({"dma_streams": 2}).dma_streams == 2
    with pytest.raises(AttributeError):
        o.dma_streams = 5  # frozen
