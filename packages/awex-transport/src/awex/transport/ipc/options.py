"""The CUDA IPC executor's knobs, in one frozen record (the defaults were measured: docs/performance.md)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from awex.meta.errors import AwexValueError


@dataclass(frozen=True)
class IpcOptions:
    """See :class:`~awex.transport.ipc.executor.IpcExecutor` for what each does."""

    cuda_graph: bool = True  # capture the whole sync as one CUDA graph at the first run, replay it after
    bounce_bytes: int = 128 << 20  # the largest span pulled from another GPU in one DMA
    bounce_buffers: int = 4  # the bounce ring holds this many of the largest span
    max_gap_bytes: int = 1 << 20  # unneeded bytes a span may include to join two pieces
    dma_streams: int = 3
    local_branches: int = 4  # streams for same-GPU copies that do not go as one kernel launch
    pace_local: bool | None = None  # same-GPU copies in slices between placements; None: where DMAs are longer
    direct_streams: int = 2  # streams for pieces that go as their own DMA
    batched_copy: bool | None = None  # same-GPU copies as one kernel launch; None: where Triton is installed
    kernel_reads: bool | None = None  # pieces from other GPUs read by kernels; None: where several GPUs are read

    def __post_init__(self) -> None:
        if min(self.bounce_buffers, self.dma_streams, self.local_branches, self.direct_streams) < 1:
            raise AwexValueError("bounce_buffers, dma_streams, local_branches and direct_streams must be at least 1")
        if self.bounce_bytes < 1 or self.max_gap_bytes < 0:
            raise AwexValueError("bounce_bytes must be positive and max_gap_bytes at least 0")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> IpcOptions:
        """From a dict (a benchmark's ``--ipc-options``); an unknown knob is an error, not ignored."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise AwexValueError(f"unknown CUDA IPC options {unknown}: known are {sorted(known)}")
        return cls(**d)
