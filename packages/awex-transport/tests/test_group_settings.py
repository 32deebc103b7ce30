"""How the sync group sets up PyTorch's NCCL watchdog (the GPU behaviour itself is tested in
``integration/tests/test_gpu_sync.py::test_fault_cases_over_nccl``)."""

from __future__ import annotations

import os

import pytest
import torch

from awex.transport import group


def test_nccl_groups_are_built_with_communicator_only_error_handling(monkeypatch):
    monkeypatch.delenv(group.ERROR_HANDLING, raising=False)
    with group._errors_abort_communicator_only():
        assert os.environ[group.ERROR_HANDLING] == "2"  # abort the communicator, keep the process
    assert group.ERROR_HANDLING not in os.environ  # only while the group is built


def test_a_users_error_handling_choice_is_kept(monkeypatch):
    monkeypatch.setenv(group.ERROR_HANDLING, "1")
    with group._errors_abort_communicator_only():
        assert os.environ[group.ERROR_HANDLING] == "1"
    assert os.environ[group.ERROR_HANDLING] == "1"


def test_gloo_groups_have_no_watchdog_to_follow():
    import torch.distributed as dist

    store = dist.HashStore()
    pg = dist.ProcessGroupGloo(store, 0, 1)
    sync = group.SyncGroup(0, 1, "gloo", pg, store)
    sync.follow_deadline(5.0)
    assert sync._watchdog == 0.0 and sync.error() is None


@pytest.mark.parametrize(
    "dtype", [torch.int16, torch.uint16, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16]
)
def test_what_nccl_refuses_goes_as_the_same_bytes_of_a_dtype_it_sends(dtype):
    """PyTorch's NCCL group refuses int16 (delta syncs' words) and FP8 tiles; they go as a dtype of the same size,
    a view of the same bytes (dtypes NCCL sends go as they are)."""
    from awex.transport.group import on_the_wire

    raw = (torch.arange(64, dtype=torch.int16) % 2).view(torch.uint8)  # bytes 0 and 1 only: valid bools too
    t = raw.view(dtype)
    wire = on_the_wire(t)
    nccl = {torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int32, torch.int64, torch.float32}
    assert wire.dtype in nccl and wire.element_size() == t.element_size() and wire.shape == t.shape
    assert wire.data_ptr() == t.data_ptr() and torch.equal(wire.view(dtype).view(torch.uint8), t.view(torch.uint8))


def test_a_store_that_fails_after_closing_its_socket_leaves_other_descriptors_alone(monkeypatch, tmp_path):
    """``bound_store`` hands its bound socket to ``TCPStore``; a store that closed it before failing must not have
    the number closed again, which by then may be another thread's file (here: reopened at once)."""
    from datetime import timedelta

    import torch.distributed as dist

    other: list = []

    def failing_store(*args, master_listen_fd, **kwargs):
        os.close(master_listen_fd)
        other.append(os.open(tmp_path / "another-threads-file", os.O_CREAT | os.O_RDWR))  # likely the same number
        raise RuntimeError("store failed")

    monkeypatch.setattr(dist, "TCPStore", failing_store)
    with pytest.raises(RuntimeError, match="store failed"):
        group.bound_store("127.0.0.1", 0, timedelta(seconds=1))
    try:
        os.fstat(other[0])  # still open
    finally:
        os.close(other[0])
