"""The staging policy the engine bindings share (``awex.engines.staging``): options refused with the option's name,
the budget's decision and the record a rank publishes, and where a staging buffer lives."""

from __future__ import annotations

import pytest
import torch

from awex.engines.staging import Staging, buffer, check_staging, transport_device


@pytest.mark.parametrize(
    "where, budget, receive, match",
    [
        ("gpu", None, "staged", "staging='gpu'; use 'device'"),
        ("host", None, "in_place", "staging='host' is for receive='staged'"),
        ("device", 1 << 20, "in_place", "staging_budget_bytes is for receive='staged'"),
        ("device", -1, "staged", "staging_budget_bytes=-1"),
        ("device", 1.5, "staged", "staging_budget_bytes=1.5"),
        ("device", True, "staged", "staging_budget_bytes=True"),
    ],
)
def test_bad_staging_options_are_refused_naming_the_option(where, budget, receive, match):
    with pytest.raises(ValueError, match=match):
        check_staging(where, budget, receive, "awex backend")


def test_good_staging_options_pass():
    for where in ("device", "host"):
        check_staging(where, None, "staged")
        check_staging(where, 0, "staged")
    check_staging("device", None, "in_place")


def test_a_shard_over_the_budget_is_not_staged_and_the_record_says_why():
    fits = Staging.decide(100, None, "host")
    assert fits.record() == {"staged": True, "where": "host", "bytes": 100, "budget": None, "reason": None}
    assert Staging.decide(100, 100, "device").staged
    over = Staging.decide(4097, 4096, "device")
    assert not over.staged and over.record()["reason"] == (
        "its shard (4,097 bytes) does not fit the staging budget (4,096 bytes)"
    )


def test_a_cpu_engine_stages_in_host_memory_either_way():
    cpu = torch.device("cpu")
    for where in ("device", "host"):
        t = buffer((2, 3), torch.bfloat16, where, cpu)
        assert t.shape == (2, 3) and t.dtype == torch.bfloat16 and t.device == cpu
        assert transport_device(where, cpu) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory behind a GPU: no GPU here")
def test_host_staging_behind_a_gpu_is_pinned_and_filled_from_that_gpu():
    gpu = torch.device("cuda", torch.cuda.current_device())
    assert buffer((4,), torch.float32, "host", gpu).is_pinned()
    assert buffer((4,), torch.float32, "device", gpu).device == gpu
    assert transport_device("host", gpu) == gpu and transport_device("device", gpu) is None
