"""Devices by kind: which collective backend a rank's views use and which stream/event API drives them.

CUDA GPUs use NCCL, Ascend NPUs HCCL (through torch-npu, which registers ``torch.npu`` with the same streams,
events and device guards as ``torch.cuda``), CPUs gloo. The point-to-point executor and the sync group are
written against :func:`device_api`, so one code path runs on both accelerators; CUDA IPC exists only on CUDA
(``auto`` never chooses it for NPU ranks: they publish no CUDA device).
"""

from __future__ import annotations

from types import ModuleType

import torch

from awex.meta.errors import AwexValueError

BACKENDS = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}
GROUPED = ("nccl", "hccl")  # backends whose sends and receives post as one group (and run on device streams)


def device_kind(device: torch.device | str | None) -> str:
    """``"cuda"``, ``"npu"``, ``"cpu"``, ... (``"npu:0"`` parses without torch-npu, which registers the name)."""
    if device is None:
        return "cpu"
    return device.type if isinstance(device, torch.device) else str(device).split(":", 1)[0]


def p2p_backend(device: torch.device | str | None) -> str:
    """The collective backend for views on ``device``: ``nccl`` (CUDA), ``hccl`` (NPU) or ``gloo`` (CPU)."""
    kind = device_kind(device)
    if kind not in BACKENDS:
        raise AwexValueError(f"no point-to-point backend for {kind} devices (known: {', '.join(BACKENDS)})")
    return BACKENDS[kind]


def is_accelerator(device: torch.device | str | None) -> bool:
    """Whether ``device`` is a CUDA GPU or an Ascend NPU (asynchronous streams, a grouped backend)."""
    return device_kind(device) in ("cuda", "npu")


def device_api(device: torch.device | str) -> ModuleType:
    """``torch.cuda`` or ``torch.npu`` for ``device`` (``Stream``, ``Event``, ``current_stream``, ``stream``,
    ``device``); NPUs need torch-npu (``pip install awex-transport[npu]``, with Ascend's CANN)."""
    kind = device_kind(device)
    if kind == "npu":
        try:
            import torch_npu  # noqa: F401  (registers torch.npu)
        except ImportError as e:
            raise ImportError(
                "NPU views need torch-npu (pip install awex-transport[npu]; it needs Ascend's CANN toolkit)"
            ) from e
    if kind not in ("cuda", "npu"):
        raise AwexValueError(f"{kind} devices have no stream API (CUDA or NPU only)")
    return torch.get_device_module(kind)
