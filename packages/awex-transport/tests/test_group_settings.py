"""How the sync group sets up PyTorch's NCCL watchdog (the GPU behaviour itself is tested in
``integration/tests/test_gpu_sync.py::test_fault_cases_over_nccl``)."""

from __future__ import annotations

import os

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
