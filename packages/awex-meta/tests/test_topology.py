"""Topology: ranks on nodes, node fan-out in the planner, the NIC bound and the cost model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from awex.meta import PlanOptions, Topology, canonical_tensors, estimate_seconds, load_config, plan_transfers
from awex.meta.layouts import MegatronParallel, VllmParallel, megatron_layout, vllm_layout
from awex.meta.plan import RELAY_LAG
from awex.meta.spec import Role
from awex.meta.topology import Placement
from awex.meta.verify import verify_plan

MODELS = Path(__file__).resolve().parents[3] / "integration" / "models"
TENSORS = canonical_tensors(load_config(MODELS / "qwen2-tiny.json"))
MODEL = sum(t.spec.nbytes for t in TENSORS)


def layouts(trainer_tp=2, engines=4, engine_tp=1, trainer_dp=1):
    src = [megatron_layout(TENSORS, MegatronParallel(tp=trainer_tp, dp=trainer_dp, vocab_pad=1), instance="trainer")]
    dst = [vllm_layout(TENSORS, VllmParallel(tp=engine_tp), instance=f"vllm-{i}") for i in range(engines)]
    return src, dst


def nic_bytes_into(plan, placement, node):
    return sum(b.nbytes for b in plan.buckets if placement.node[b.dst] == node and placement.node[b.src] != node)


def test_parse_names_every_key_and_refuses_unknown_ones():
    t = Topology.parse("gpus-per-node=4, nic-gbps=200,nvlink-gbps=1800,placement=shared")
    assert (t.gpus_per_node, t.nic_gbps, t.nvlink_gbps, t.placement) == (4, 200.0, 1800.0, "shared")
    assert Topology.parse("") == Topology()
    assert t.rate("nic") == 25e9
    with pytest.raises(ValueError, match="expected one of gpus-per-node"):
        Topology.parse("gpus=8")
    with pytest.raises(ValueError, match="must be a number"):
        Topology.parse("nic-gbps=fast")
    with pytest.raises(ValueError, match="placement must be one of apart, shared"):
        Topology.parse("placement=mixed")
    with pytest.raises(ValueError, match="gpus-per-node must be positive"):
        Topology(gpus_per_node=0)


def test_ranks_fill_nodes_in_order_apart_or_on_the_trainers_nodes():
    src, dst = layouts(trainer_tp=2, trainer_dp=2, engines=3, engine_tp=2)  # 4 trainer ranks, 6 inference ranks
    plan = plan_transfers(src, dst)
    assert Topology(gpus_per_node=4).nodes(plan.ranks) == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    shared = Placement.of(Topology(gpus_per_node=4, placement="shared"), plan.ranks)
    assert shared.node == (0, 0, 0, 0, 0, 0, 0, 0, 1, 1)
    assert shared.gpu == (0, 1, 2, 3, 0, 1, 2, 3, 0, 1)
    assert shared.link(0, 4) == "copy" and shared.link(0, 5) == "nvlink" and shared.link(0, 8) == "nic"


def test_a_node_receives_each_region_once_and_forwards_it_to_its_other_gpus():
    src, dst = layouts(trainer_tp=2, engines=4)  # trainer on node 0, the four engines on node 1
    topology = Topology(gpus_per_node=4)
    plan = plan_transfers(src, dst, PlanOptions(wave_bytes=MODEL // 4, topology=topology))
    place = Placement.of(topology, plan.ranks)
    assert verify_plan(plan, src, dst).ok
    assert nic_bytes_into(plan, place, 1) == MODEL  # once into the node, not four times
    assert plan.stats.relayed_bytes == 3 * MODEL
    # receiving, each of the node's four NICs can take a quarter; sending, the two trainer ranks half each
    assert plan.stats.lower_bound_send_bytes >= MODEL // 2
    assert plan.stats.nic_bound_bytes == max(-(-MODEL // 4), plan.stats.lower_bound_send_bytes)
    first_hop = {}
    for b in plan.buckets:
        if plan.ranks[b.src].role == Role.TRAINER:
            for t in b.transfers:
                first_hop[(b.dst, t.tensor)] = min(first_hop.get((b.dst, t.tensor), b.wave), b.wave)
    for b in plan.buckets:
        if plan.ranks[b.src].role != Role.TRAINER:
            assert place.node[b.src] == place.node[b.dst]  # forwarded inside the node only
            assert all(b.wave >= first_hop[(b.src, t.tensor)] + RELAY_LAG for t in b.transfers)
    estimate = estimate_seconds(plan, topology)
    assert estimate.busiest_nic_bytes <= 1.05 * plan.stats.nic_bound_bytes
    without = plan_transfers(src, dst, PlanOptions(wave_bytes=MODEL // 4, relay=False))
    assert nic_bytes_into(without, place, 1) == 4 * MODEL  # what the fan-out saves
    unaware = plan_transfers(src, dst, PlanOptions(wave_bytes=MODEL // 4))  # hot-source relays, blind to nodes
    assert nic_bytes_into(unaware, place, 1) > 1.5 * MODEL


def test_shared_placement_takes_from_holders_on_the_same_node():
    # colocated: trainer TP=2 and an engine TP=2 on each pair of GPUs: nothing crosses a NIC
    src, dst = layouts(trainer_tp=2, engines=1, engine_tp=2)
    topology = Topology(gpus_per_node=2, placement="shared")
    plan = plan_transfers(src, dst, PlanOptions(topology=topology))
    assert verify_plan(plan, src, dst).ok
    est = estimate_seconds(plan, topology)
    assert est.link_bytes["nic"] == 0
    # each rank's own GPU holds its boxes but for the vocabulary rows the two engines' paddings split differently
    assert est.link_bytes["copy"] + est.link_bytes["nvlink"] == plan.stats.total_bytes >= MODEL
    assert 0 < est.link_bytes["nvlink"] < 0.01 * MODEL


def test_the_estimate_of_one_pair_is_its_bytes_over_the_nic_rate():
    src, dst = layouts(trainer_tp=1, engines=1)
    topology = Topology(gpus_per_node=1, nic_gbps=8.0)  # 1 GB/s
    plan = plan_transfers(src, dst, PlanOptions(wave_bytes=MODEL // 8, topology=topology))
    est = estimate_seconds(plan, topology)
    assert est.seconds == pytest.approx(MODEL / 1e9, rel=1e-9)
    assert est.nic_lower_bound_seconds == pytest.approx(MODEL / 1e9, rel=1e-9)
    assert est.useful_bytes_per_s_per_receiver == pytest.approx(1e9)
    slower = estimate_seconds(plan, topology, wave_seconds=0.5)  # a fixed cost per wave adds up
    assert slower.seconds == pytest.approx(est.seconds + 0.5 * plan.stats.waves)


def test_plans_with_a_topology_do_not_depend_on_input_order():
    src, dst = layouts(trainer_tp=2, engines=3)
    options = PlanOptions(wave_bytes=MODEL // 4, topology=Topology(gpus_per_node=2))
    assert plan_transfers(src, dst, options).digest == plan_transfers(src, dst[::-1], options).digest
    with pytest.raises(ValueError, match="broadcast and topology"):
        PlanOptions(broadcast=True, topology=Topology())


def test_cli_reports_the_estimate_and_refuses_two_estimates(tmp_path):
    config = json.loads((MODELS / "qwen3-moe-tiny.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    cmd = [sys.executable, "-m", "awex.meta.cli", "plan", "--model", str(tmp_path / "config.json")]
    cmd += ["--trainer", "megatron:tp=2,ep=2", "--inference", "vllm:tp=2,instances=4", "--fp8", "--json"]
    done = subprocess.run([*cmd, "--topology", "gpus-per-node=4"], capture_output=True, text=True, check=True)
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    for key in (
        "estimated_seconds",
        "nic_lower_bound_seconds",
        "busiest_nic_bytes",
        "nic_bound_bytes",
        "useful_gbps_per_receiver",
    ):
        assert summary[key] > 0, key
    assert summary["busiest_nic_over_bound"] <= 1.05 and summary["coverage_ok"]
    assert summary["total_bytes"] < 0.6 * 4 * summary["model_bytes"]  # FP8 to the engines, entering their node once
    done = subprocess.run([*cmd[:5], str(MODELS / "qwen3-moe-tiny.json"), *cmd[6:]], capture_output=True, text=True)
    assert done.returncode == 2 and "declares no quantization_config" in done.stderr
    one = [*cmd[: cmd.index("--inference")], "--inference", "vllm:tp=2", "--fp8", "--json"]  # on the trainer's GPUs
    shared = subprocess.run([*one, "--topology", "gpus-per-node=2,placement=shared"], capture_output=True, text=True)
    assert shared.returncode == 0, shared.stderr  # nothing crosses a NIC: said so, no bound to divide by
    summary = json.loads(shared.stdout.strip().splitlines()[-1])
    assert summary["link_bytes"]["nic"] == 0 and summary["nic_bound_bytes"] is None
    assert "no byte crosses a NIC" in shared.stdout
    done = subprocess.run([*cmd, "--topology", "gpus=8"], capture_output=True, text=True)
    assert done.returncode == 2 and "expected one of gpus-per-node" in done.stderr
    done = subprocess.run([*cmd, "--topology", "", "--link-gbps", "400"], capture_output=True, text=True)
    assert done.returncode == 0  # an empty topology is no topology
    done = subprocess.run([*cmd, "--topology", "gpus-per-node=4", "--link-gbps", "400"], capture_output=True, text=True)
    assert done.returncode == 2 and "give one" in done.stderr


def test_hosts_the_ranks_report_decide_their_nodes():
    """How the writer and reader plan across hosts: nodes from the hosts ranks report, not from a placement rule."""
    src, dst = layouts(trainer_tp=2, engines=3)
    hosts = [("trainer", 0, "a"), ("trainer", 1, "a"), ("vllm-0", 0, "b"), ("vllm-1", 0, "b"), ("vllm-2", 0, "c")]
    options = PlanOptions(wave_bytes=MODEL // 4, topology=Topology(), hosts=hosts)
    plan = plan_transfers(src, dst, options)
    place = Placement.of(Topology(), plan.ranks, options.hosts)
    assert place.node == (0, 0, 1, 1, 2) and place.gpu == (0, 1, 0, 1, 0)
    assert verify_plan(plan, src, dst).ok
    assert nic_bytes_into(plan, place, 1) == MODEL and nic_bytes_into(plan, place, 2) == MODEL
    assert plan.stats.relayed_bytes == MODEL  # host b's second engine gets everything from its first
    unknown = Placement.of(Topology(), plan.ranks, hosts[:4])  # a rank without a host: a node of its own
    assert unknown.node[4] not in unknown.node[:4]
    assert PlanOptions(hosts=hosts[::-1]) == PlanOptions(hosts=hosts)  # order-free, like devices
