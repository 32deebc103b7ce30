"""The GPU benchmark reports, per scenario, the transport the writers' default (``transport="auto"``) picks for
its GPUs; planning needs no GPU, so the choice is checked here: CUDA IPC on one host except for fan-out from
one trainer GPU, where relayed NCCL keeps the trainer's egress at one copy."""

import pytest

from awex.meta import Role
from awex_integration.benchmarks.bench_common import SCENARIOS, auto_transport, layouts_of, model_tensors

EXPECTED = {
    "1gpu_to_1gpu": "ipc",
    "1gpu_to_1gpu_ipc": "ipc",
    "1gpu_to_1gpu_shm": "ipc",  # asked for shm; the default would take CUDA IPC on these GPUs
    "mcore_tp2_to_vllm_tp2": "ipc",
    "mcore_tp2_to_vllm_tp2_ipc": "ipc",
    "mcore_tp2_to_2x_vllm_tp1": "nccl",
    "mcore_tp2_to_2x_vllm_tp1_ipc": "nccl",  # two GPUs pull from each trainer GPU
    "1gpu_to_3_instances": "nccl",
    "colocated_1gpu_ipc": "ipc",
    "colocated_tp2_to_tp1_per_gpu": "ipc",
    "colocated_dp2_to_2x_tp1": "ipc",
}


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_auto_transport_of_each_benchmark_scenario(scenario):
    _, tensors = model_tensors("qwen3-8b", 2)
    layouts = layouts_of(scenario, tensors)
    sources = [x for x in layouts if x.role == Role.TRAINER]
    dests = [x for x in layouts if x.role == Role.INFERENCE]
    assert auto_transport(scenario, sources, dests) == EXPECTED[scenario.name]


def test_colocated_replicas_are_read_on_their_own_gpus():
    from awex.meta import PlanOptions, plan_transfers
    from awex_integration.benchmarks.bench_common import scenario_devices

    scenario = next(s for s in SCENARIOS if s.name == "colocated_dp2_to_2x_tp1")
    _, tensors = model_tensors("qwen3-8b", 2)
    layouts = layouts_of(scenario, tensors)
    plan = plan_transfers(
        [x for x in layouts if x.role == Role.TRAINER],
        [x for x in layouts if x.role == Role.INFERENCE],
        PlanOptions(relay=False, devices=scenario_devices(scenario)),
    )
    gpu = {(i, r): g for i, r, g in scenario_devices(scenario)}
    of = {r.rank: gpu[(r.instance, r.local_rank)] for r in plan.ranks}
    assert plan.buckets and all(of[b.src] == of[b.dst] for b in plan.buckets)
