"""Syncs across hosts: the MetaServer and a Megatron trainer (TP=2) in one network namespace, an HF engine in
another, joined only by a veth pair (two hosts on one machine). Over rdma (Mooncake's transfer engine, TCP) and
``auto`` (which must take a cross-host transport: gloo here), bit-exact with greedy output equal to HF's; shared
memory is refused before any byte moves."""

from __future__ import annotations

import pytest
from scenario_run import run_scenario

from awex_integration.scenarios import netns

WHY = netns.unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"two network namespaces cannot be made here: {WHY}")

BASE = ["--trainer", "megatron", "--train-tp", "2", "--inference", "hf", "--hosts", "2"]


@pytest.mark.parametrize("transport,used", [("rdma", "rdma"), ("auto", "gloo")])
def test_a_sync_across_two_hosts_is_bit_exact(transport, used):
    result = run_scenario([*BASE, "--transport", transport])
    assert result["ok"], result.get("error") or result.get("trainer_errors")
    assert result["tensors_checked"] > 0 and result["tensors_mismatched"] == 0
    assert result["greedy_match"] is True
    assert result["transport"] == used


def test_shared_memory_is_refused_across_hosts_before_any_byte_moves():
    result = run_scenario([*BASE, "--transport", "shm"])
    assert not result["ok"] and result["failed_step"] == 1
    assert "run on 2 hosts" in result["error"] and "network namespaces count as hosts" in result["error"]
    assert result["bytes"] == [] and result["kept_previous_output"]
    assert not netns_left()


def netns_left() -> list[str]:
    import subprocess

    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.startswith("awex-")]
