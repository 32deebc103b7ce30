"""awex.transport.accelerator: which backend and stream API each kind of device uses (CPU-checkable parts)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from awex.transport.accelerator import device_api, is_accelerator, p2p_backend
from awex.transport.group import create_sync_group


def test_backends_by_device_kind():
    assert p2p_backend("cuda:1") == "nccl" and p2p_backend("npu:0") == "hccl"
    assert p2p_backend("cpu") == "gloo" and p2p_backend(None) == "gloo"
    with pytest.raises(ValueError, match="no point-to-point backend for meta devices"):
        p2p_backend("meta")
    assert is_accelerator("cuda:0") and is_accelerator("npu:3") and not is_accelerator("cpu")
    assert not is_accelerator(None)


def test_device_api_is_torch_cuda_for_cuda_and_refuses_cpu():
    assert device_api("cuda:0") is torch.cuda
    with pytest.raises(ValueError, match="no stream API"):
        device_api("cpu")


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch-npu is installed here")
def test_npu_without_torch_npu_says_what_to_install():
    with pytest.raises(ImportError, match=r"awex-transport\[npu\]"):
        device_api("npu:0")
    with pytest.raises(ImportError, match="torch-npu"):  # before any store or group is formed
        create_sync_group(0, 1, "127.0.0.1", 0, backend="hccl", timeout=5)


def test_unknown_backend_names_the_known_ones():
    with pytest.raises(ValueError, match="'gloo', 'nccl' or 'hccl'"):
        create_sync_group(0, 1, "127.0.0.1", 0, backend="mpi", timeout=5)
