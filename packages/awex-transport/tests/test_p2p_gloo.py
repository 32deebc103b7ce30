"""The gloo point-to-point transport with real processes: Megatron-layout trainer ranks send, vLLM-layout
receivers get exactly their boxes, in place, and a dead peer gives an error within the deadline."""

from __future__ import annotations

import json
import multiprocessing as mp
import queue
import time
from pathlib import Path

import pytest
import transport_workers

from awex.meta import PlanOptions, canonical_tensors, plan_transfers
from awex.meta.layouts import MegatronParallel, VllmParallel, megatron_layout, vllm_layout
from awex.meta.serialize import layout_to_wire
from awex.meta.topology import Topology
from awex.transport.net import free_port

TINY = json.loads((Path(__file__).resolve().parents[3] / "integration" / "models" / "qwen2-tiny.json").read_text())


def run_world(
    layouts,
    timeout=60.0,
    behaviours=None,
    wave_bytes=256 << 20,
    allow_cast=(),
    direct_bytes=4 << 20,
    receiver_pieces=2,
    broadcast=False,
    topology="",
):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    docs = [layout_to_wire(lay) for lay in layouts]
    port = free_port()
    procs = []
    for lay in layouts:
        for r in range(lay.world_size):
            behaviour = (behaviours or {}).get((lay.instance, r), "normal")
            p = ctx.Process(
                target=transport_workers.worker,
                args=(
                    lay.role.value,
                    docs,
                    lay.instance,
                    r,
                    "127.0.0.1",
                    port,
                    timeout,
                    results,
                    behaviour,
                    wave_bytes,
                    tuple(allow_cast),
                    direct_bytes,
                    receiver_pieces,
                    broadcast,
                    topology,
                ),
            )
            p.start()
            procs.append(p)
    out = {}
    deadline = time.monotonic() + timeout + 60
    silent = [b for b in (behaviours or {}).values() if b in ("die_before_send", "stall")]  # never report
    expected = sum(lay.world_size for lay in layouts) - len(silent)
    while len(out) < expected and time.monotonic() < deadline:
        try:
            inst, rank, status, received, sent, direct, *extra = results.get(timeout=1.0)
            out[(inst, rank)] = (status, received, sent, direct, *extra)
        except queue.Empty:
            pass
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_megatron_tp2_pp2_to_two_vllm_engines(dtype):
    tensors = canonical_tensors(TINY, dtype=dtype)
    layouts = [
        megatron_layout(tensors, MegatronParallel(tp=2, pp=2, vocab_pad=128), instance="trainer"),
        vllm_layout(tensors, VllmParallel(tp=2), instance="vllm-0"),
        vllm_layout(tensors, VllmParallel(tp=1), instance="vllm-1"),
    ]
    out = run_world(layouts)
    assert len(out) == 4 + 2 + 1, out
    failures = {k: v[0] for k, v in out.items() if v[0] != "ok"}
    assert not failures, failures
    plan = plan_transfers(layouts[:1], layouts[1:])
    for (inst, rank), (_, nbytes, *_) in out.items():
        expected = sum(s.bucket.nbytes for s in plan.schedule(plan.rank(inst, rank).rank) if s.op == "recv")
        assert nbytes == expected


def test_one_trainer_rank_feeding_three_engines_sends_once_and_engines_relay():
    tensors = canonical_tensors(TINY)
    layouts = [megatron_layout(tensors, MegatronParallel(tp=1, vocab_pad=1), instance="trainer")]
    layouts += [vllm_layout(tensors, VllmParallel(tp=1), instance=f"vllm-{i}") for i in range(3)]
    model = sum(t.spec.nbytes for t in tensors)
    wave = model // 8  # many waves: relays overlap later first hops
    out = run_world(layouts, wave_bytes=wave)
    assert len(out) == 4, out
    failures = {k: v[0] for k, v in out.items() if v[0] != "ok"}
    assert not failures, failures
    assert out[("trainer", 0)][2] == model  # the trainer's egress does not multiply with the engines
    for i in range(3):
        assert out[(f"vllm-{i}", 0)][1] == model
    assert sum(out[(f"vllm-{i}", 0)][2] for i in range(3)) == 2 * model  # the rest was relayed
    plan = plan_transfers(layouts[:1], layouts[1:], PlanOptions(wave_bytes=wave))
    assert plan.stats.waves > 8


def test_verify_digests_taken_wave_by_wave_match_across_relays():
    """Verify mode's digests taken as waves are posted and unpacked (``WaveDigests``): each rank's equal what it
    digests of the same regions after the transfer, again in a second version, and what a trainer rank digests for
    each receiving rank equals what that rank digests of the regions from it, relayed ones included."""
    tensors = canonical_tensors(TINY)
    layouts = [megatron_layout(tensors, MegatronParallel(tp=2, vocab_pad=1), instance="trainer")]
    layouts += [vllm_layout(tensors, VllmParallel(tp=1 + i % 2), instance=f"vllm-{i}") for i in range(3)]
    model = sum(t.spec.nbytes for t in tensors)
    ranks = [(lay.instance, r) for lay in layouts for r in range(lay.world_size)]
    out = run_world(layouts, wave_bytes=model // 8, behaviours={k: "digests" for k in ranks})
    failures = {k: v[0] for k, v in out.items() if v[0] != "ok"}
    assert len(out) == len(ranks) and not failures, failures
    plan = plan_transfers(layouts[:1], layouts[1:], PlanOptions(wave_bytes=model // 8))
    assert plan.stats.relayed_bytes > 0
    sync = {k: plan.rank(*k).rank for k in ranks}
    sent = {(sync[k], dst): d for k, v in out.items() for dst, d in v[-1]["sent"].items()}
    got = {(origin, sync[k]): d for k, v in out.items() for origin, d in v[-1]["got"].items()}
    assert sent == got  # (origin, receiving rank) -> digest, alike on both ends
    assert {dst for _, dst in got} == {sync[k] for k in ranks if not k[0] == "trainer"}


def test_a_topology_sends_each_region_into_a_node_once_and_gpus_there_forward_it():
    """Nodes of two GPUs, trainer and engines apart: the trainer (TP=2, node 0) sends each region once into node 1,
    where engines vllm-0 and vllm-1 hold the same boxes; one of them forwards it to the other (NVLink in a real
    cluster) and vllm-2, alone on node 2, gets its own copy; every receiver gets every byte."""
    tensors = canonical_tensors(TINY)
    layouts = [megatron_layout(tensors, MegatronParallel(tp=2, vocab_pad=1), instance="trainer")]
    layouts += [vllm_layout(tensors, VllmParallel(tp=1), instance=f"vllm-{i}") for i in range(3)]
    model = sum(t.spec.nbytes for t in tensors)
    wave = model // 6
    topology = "gpus-per-node=2"
    out = run_world(layouts, wave_bytes=wave, topology=topology)
    assert len(out) == 5, out
    failures = {k: v[0] for k, v in out.items() if v[0] != "ok"}
    assert not failures, failures
    for i in range(3):
        assert out[(f"vllm-{i}", 0)][1] == model
    forwarded = out[("vllm-0", 0)][2] + out[("vllm-1", 0)][2]
    assert forwarded == model and out[("vllm-2", 0)][2] == 0  # node 1 got each region once, node 2 its own
    sent = out[("trainer", 0)][2] + out[("trainer", 1)][2]
    assert 2 * model <= sent < 2 * model * 1.01  # into two nodes (norms, held by both ranks, may go twice)
    plan = plan_transfers(layouts[:1], layouts[1:], PlanOptions(wave_bytes=wave, topology=Topology.parse(topology)))
    assert plan.stats.relayed_bytes == model


@pytest.mark.parametrize("receiver_pieces", [1, 2])
def test_large_transfers_travel_alone_straight_from_and_into_engine_memory(receiver_pieces):
    # direct_bytes far below the tiny model's tensors: most transfers are their own message; the trainer's
    # views are contiguous (sent as they are, no packing), the engines' are contiguous (received in place)
    # with receiver_pieces=1 and two pieces each (staged, unpacked) with 2; relays forward from engine memory.
    # Several messages per peer and wave must pair up in order, or values land in the wrong tensors.
    tensors = canonical_tensors(TINY)
    layouts = [megatron_layout(tensors, MegatronParallel(tp=1, vocab_pad=1), instance="trainer")]
    layouts += [vllm_layout(tensors, VllmParallel(tp=1), instance=f"vllm-{i}") for i in range(3)]
    model = sum(t.spec.nbytes for t in tensors)
    out = run_world(layouts, wave_bytes=model // 4, direct_bytes=512, receiver_pieces=receiver_pieces)
    assert len(out) == 4, out
    failures = {k: v[0] for k, v in out.items() if v[0] != "ok"}
    assert not failures, failures
    assert out[("trainer", 0)][3] > model // 2  # most of what the trainer sent left straight from its views
    engines = [out[(f"vllm-{i}", 0)][3] for i in range(3)]
    if receiver_pieces == 1:
        assert min(engines) > model // 2
    else:  # views in two pieces: a transfer lying inside one piece lands in place, the others are staged
        staged = [out[(f"vllm-{i}", 0)][1] - engines[i] for i in range(3)]
        assert min(staged) > model // 10, staged
    plan = plan_transfers(layouts[:1], layouts[1:], PlanOptions(wave_bytes=model // 4, direct_bytes=512))
    assert plan.stats.relayed_bytes > 0
    assert max(len([t for t in b.transfers if t.nbytes >= 512]) for b in plan.buckets) > 1


@pytest.mark.parametrize("trainer_tp, engines", [(1, 3), (2, 2)])
def test_fan_out_as_broadcasts_sends_each_region_once(trainer_tp, engines):
    # PlanOptions(broadcast=True): what a trainer rank sends to several engines goes, wave by wave, as one
    # broadcast over a subgroup of the sync group; with direct_bytes small, a bucket is several messages (a
    # packed one and large transfers straight from the trainer's views), broadcast in the same order everywhere
    tensors = canonical_tensors(TINY)
    layouts = [megatron_layout(tensors, MegatronParallel(tp=trainer_tp, vocab_pad=1), instance="trainer")]
    layouts += [vllm_layout(tensors, VllmParallel(tp=1), instance=f"vllm-{i}") for i in range(engines)]
    model = sum(t.spec.nbytes for t in tensors)
    wave = model // 6
    out = run_world(layouts, wave_bytes=wave, direct_bytes=512, receiver_pieces=1, broadcast=True)
    assert len(out) == trainer_tp + engines, out
    failures = {k: v[0] for k, v in out.items() if v[0] != "ok"}
    assert not failures, failures
    sent = sum(out[("trainer", r)][2] for r in range(trainer_tp))
    # each region leaves once (with TP=2, the few tensors both trainer ranks hold, the norms, may go to each
    # engine from a different rank: under 1%)
    assert model <= sent < model * 1.01, (sent, model)
    for i in range(engines):
        assert out[(f"vllm-{i}", 0)][1] == model and out[(f"vllm-{i}", 0)][2] == 0  # no relays
    plan = plan_transfers(layouts[:1], layouts[1:], PlanOptions(wave_bytes=wave, broadcast=True))
    assert plan.stats.relayed_bytes == 0 and plan.stats.waves > 3
    # the waves count each broadcast region once for its source: as many as for one engine
    one = plan_transfers(layouts[:1], layouts[1:2], PlanOptions(wave_bytes=wave))
    assert plan.stats.waves == one.stats.waves


def test_an_explicitly_allowed_narrowing_cast_arrives_in_the_receivers_dtype():
    trainer = megatron_layout(
        canonical_tensors(TINY, dtype="float32"), MegatronParallel(tp=2, vocab_pad=128), instance="trainer"
    )
    engine = vllm_layout(canonical_tensors(TINY, dtype="bfloat16"), VllmParallel(tp=1), instance="vllm-0")
    out = run_world([trainer, engine], allow_cast=("*",))
    assert len(out) == 3, out
    failures = {k: v[0] for k, v in out.items() if v[0] != "ok"}
    assert not failures, failures  # receivers compare with the fp32 values rounded to bf16, bit for bit
    bf16_bytes = sum(t.spec.nbytes for t in engine.tensors)
    assert out[("vllm-0", 0)][1] == bf16_bytes  # the wire carries bf16: half the fp32 bytes


def test_senders_prepare_each_wave_just_before_it_is_packed():
    # trainer ranks hold zeros; their before_pack(i) writes the real values of exactly what wave i sends
    # (WaveExecutor.sent_regions[i]); receivers get the real values only if every wave was prepared, in order,
    # before it was packed. The work beside the transfer (meanwhile: the writer's claim and moved-memory check)
    # runs once, with the first wave posted, not after the last
    tensors = canonical_tensors(TINY)
    layouts = [
        megatron_layout(tensors, MegatronParallel(tp=2, vocab_pad=1), instance="trainer"),
        vllm_layout(tensors, VllmParallel(tp=1), instance="vllm-0"),
    ]
    wave = sum(t.spec.nbytes for t in tensors) // 10
    out = run_world(
        layouts, wave_bytes=wave, behaviours={("trainer", 0): "fill_before_pack", ("trainer", 1): "fill_before_pack"}
    )
    assert len(out) == 3, out
    failures = {k: v[0] for k, v in out.items() if v[0] != "ok"}
    assert not failures, failures
    assert plan_transfers(layouts[:1], layouts[1:], PlanOptions(wave_bytes=wave)).stats.waves > 5


def test_a_sender_that_dies_makes_receivers_fail_within_the_deadline():
    tensors = canonical_tensors(TINY)
    layouts = [
        megatron_layout(tensors, MegatronParallel(tp=2, vocab_pad=1), instance="trainer"),
        vllm_layout(tensors, VllmParallel(tp=1), instance="vllm-0"),
    ]
    started = time.monotonic()
    out = run_world(layouts, timeout=8.0, behaviours={("trainer", 1): "die_before_send"})
    elapsed = time.monotonic() - started
    status = out[("vllm-0", 0)][0]
    assert status.startswith("error: Transfer"), status
    assert "rank 1" in status or "from rank 1" in status
    assert elapsed < 60


def test_a_sender_that_stalls_makes_receivers_time_out():
    tensors = canonical_tensors(TINY)
    layouts = [
        megatron_layout(tensors, MegatronParallel(tp=1, vocab_pad=1), instance="trainer"),
        vllm_layout(tensors, VllmParallel(tp=1), instance="vllm-0"),
    ]
    out = run_world(layouts, timeout=4.0, behaviours={("trainer", 0): "stall"})
    status = out[("vllm-0", 0)][0]
    assert status.startswith("error: TransferTimeout"), status
    assert "from rank 0" in status


def test_views_that_do_not_match_the_layout_are_rejected_before_any_transfer():
    import torch

    from awex.transport import LocalShards, ShardMismatchError

    tensors = canonical_tensors(TINY)
    layout = vllm_layout(tensors, VllmParallel(tp=2), instance="vllm-0")

    def wrong(name, box):
        if name == "model.norm.weight":
            raise KeyError("model.norm.weight")
        if name.endswith("q_proj.weight"):
            return torch.zeros(box.sizes[0] + 1, box.sizes[1])
        if name.endswith("k_proj.bias"):
            return torch.zeros(box.sizes, dtype=torch.bfloat16)
        return torch.zeros(box.sizes)

    with pytest.raises(ShardMismatchError) as err:
        LocalShards.from_layout(layout, 0, wrong)
    text = str(err.value)
    assert "model.norm.weight" in text and "no native tensor" in text
    assert "model.layers.0.self_attn.q_proj.weight [0:64, 0:128]: native view has shape (65, 128)" in text
    assert "k_proj.bias" in text and "bfloat16" in text


def test_pieces_must_tile_each_box():
    import torch

    from awex.meta import Box
    from awex.transport import LocalShards, ShardMismatchError

    tensors = canonical_tensors(TINY)
    layout = vllm_layout(tensors, VllmParallel(tp=1), instance="vllm-0")

    def gappy(name, box):
        if name == "model.norm.weight":  # only the first 100 of 128 elements
            return [(Box((0,), (100,)), torch.zeros(100))]
        if name == "model.layers.0.input_layernorm.weight":  # overlapping pieces
            return [(Box((0,), (100,)), torch.zeros(100)), (Box((50,), (78,)), torch.zeros(78))]
        return torch.zeros(box.sizes)

    with pytest.raises(ShardMismatchError) as err:
        LocalShards.from_layout(layout, 0, gappy)
    assert "model.norm.weight [0:128]: pieces cover 100 of 128 elements" in str(err.value)
    assert "model.layers.0.input_layernorm.weight: pieces overlap" in str(err.value)

    shards = LocalShards(
        {
            "w": [
                (Box((0, 0), (2, 3)), torch.arange(6.0).view(2, 3)),
                (Box((2, 0), (2, 3)), torch.arange(6.0, 12.0).view(2, 3)),
            ]
        }
    )
    out = torch.empty(2, 2)
    shards.copy_out("w", (1, 1), (2, 2), out)  # spans both pieces
    assert out.tolist() == [[4.0, 5.0], [7.0, 8.0]]
    shards.copy_in("w", (1, 0), (2, 3), torch.zeros(2, 3))
    assert shards.pairs("w")[0][1].tolist() == [[0.0, 1.0, 2.0], [0.0, 0.0, 0.0]]
    with pytest.raises(ShardMismatchError, match="does not hold all"):
        shards.copy_out("w", (3, 0), (2, 3), torch.empty(2, 3))


def test_tensors_of_odd_byte_sizes_share_a_bucket():
    # FP8 weights next to float32 scales: transfers start 16-byte aligned inside a message, so a message is
    # longer than the sum of its transfers and the staging must hold every message whole
    from awex.meta import Layout, Mesh, MeshSharding, Role, Shard, TensorLayout, TensorSpec

    specs = [
        TensorSpec("a.weight", (3, 5), "float8_e4m3fn"),
        TensorSpec("a.weight_scale_inv", (1, 1), "float32"),
        TensorSpec("b.weight", (7, 3), "float8_e4m3fn"),
        TensorSpec("c", (5,), "bfloat16"),
    ]

    def layout(instance, role, tp):
        mesh = Mesh("m", (("tp", tp),))
        return Layout(
            instance,
            role,
            tp,
            (mesh,),
            tuple(TensorLayout(s, MeshSharding("m", (("tp", Shard(0)),) if s.shape[0] > 1 else ())) for s in specs),
        )

    layouts = [layout("trainer", Role.TRAINER, 1), layout("vllm-0", Role.INFERENCE, 2)]
    out = run_world(layouts)
    assert len(out) == 3, out
    failures = {k: v[0] for k, v in out.items() if v[0] != "ok"}
    assert not failures, failures


def test_subgroups_must_be_sorted_and_include_the_rank():
    from awex.transport import create_sync_group

    group = create_sync_group(0, 1, "127.0.0.1", free_port(), backend="gloo", timeout=10)
    pg = group.subgroup((0,))
    assert group.subgroup((0,)) is pg  # built once
    for bad in ((1, 0), (1,), (0, 0)):
        with pytest.raises(ValueError, match="subgroup"):
            group.subgroup(bad)
    import torch

    t = torch.arange(4.0)
    group.broadcast((0,), t, 0).wait()  # a group of one: the root keeps its values
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
