import pytest
from hypothesis import given
from hypothesis import strategies as st
from oracle import check_plan_by_elements
from strategies import layouts, tensor_specs

from awex.meta import (
    Layout,
    Mesh,
    MeshSharding,
    PlanError,
    PlanOptions,
    Role,
    Shard,
    TensorLayout,
    TensorSpec,
    plan_transfers,
    verify_plan,
)


@st.composite
def scenarios(draw):
    specs = draw(tensor_specs(draw(st.integers(1, 4))))
    n_src = draw(st.integers(1, 2))
    n_dst = draw(st.integers(1, 3))
    sources = [draw(layouts(specs, Role.TRAINER, f"train{i}")) for i in range(n_src)]
    dests = [draw(layouts(specs, Role.INFERENCE, f"inf{i}", full_coverage=False, subset=True)) for i in range(n_dst)]
    devices = tuple(
        (lay.instance, r, d)
        for lay in (*sources, *dests)
        for r in range(lay.world_size)
        for d in [draw(st.sampled_from(["gpu0", "gpu1", None]))]
        if d is not None
    )
    options = PlanOptions(
        wave_bytes=draw(st.sampled_from([8, 64, 1 << 20])),
        split_bytes=draw(st.sampled_from([1, 16, 1 << 20])),
        relay=draw(st.booleans()),
        devices=devices if draw(st.booleans()) else (),
        broadcast=draw(st.booleans()),
    )
    return sources, dests, options


@given(scenarios())
def test_every_needed_element_arrives_exactly_once_and_nothing_else_is_sent(scenario):
    sources, dests, options = scenario
    plan = plan_transfers(sources, dests, options)
    check_plan_by_elements(plan, sources, dests)
    report = verify_plan(plan, sources, dests)
    assert report.ok, report.problems
    assert plan.stats.redundant_bytes == 0
    assert report.received_bytes == report.needed_bytes == plan.stats.total_bytes
    # a rank moves about wave_bytes per wave: its share of every pair (sum <= wave_bytes), plus per pair at most
    # one piece that straddles a wave boundary (pieces are cut to a pair's share, never finer than `floor`)
    floor = max(1, min(options.split_bytes, options.wave_bytes // 4))
    per_wave: dict[tuple[int, int], list] = {}
    broadcast_sent = set()  # with broadcast, a source's identical buckets to several destinations go once
    for b in plan.buckets:
        per_wave.setdefault((b.wave, b.dst), []).append(b)
        if not options.broadcast or (b.wave, b.src, b.transfers) not in broadcast_sent:
            broadcast_sent.add((b.wave, b.src, b.transfers))
            per_wave.setdefault((b.wave, b.src), []).append(b)
    for bs in per_wave.values():
        slack = sum(max(floor, max(t.nbytes for t in b.transfers)) + 1 for b in bs)
        assert sum(b.nbytes for b in bs) <= options.wave_bytes + 2 * slack


@given(scenarios(), st.randoms(use_true_random=False))
def test_plan_is_identical_for_any_input_order(scenario, rnd):
    sources, dests, options = scenario
    first = plan_transfers(sources, dests, options)
    shuffled_sources = [
        Layout(s.instance, s.role, s.world_size, s.meshes, tuple(rnd.sample(s.tensors, len(s.tensors))))
        for s in sources
    ]
    rnd.shuffle(shuffled_sources)
    shuffled_dests = list(dests)
    rnd.shuffle(shuffled_dests)
    second = plan_transfers(shuffled_sources, shuffled_dests, options)
    assert second.digest == first.digest
    assert second.buckets == first.buckets


@given(scenarios())
def test_lower_bound_is_never_beaten_and_each_pair_meets_once_per_wave(scenario):
    sources, dests, options = scenario
    plan = plan_transfers(sources, dests, options)
    s = plan.stats
    if s.relayed_bytes == 0:
        assert s.max_rank_send_bytes >= s.lower_bound_send_bytes
    assert s.max_rank_recv_bytes == s.lower_bound_recv_bytes
    seen = set()
    shared: dict[tuple, int] = {}  # broadcast plans: buckets a source sends alike to several destinations
    for b in plan.buckets:
        shared[(b.wave, b.src, b.transfers)] = shared.get((b.wave, b.src, b.transfers), 0) + 1
    for b in plan.buckets:
        # a pair meets once per wave, apart from buckets its source sends alike to other destinations too
        # (broadcast plans: one per destination set)
        if options.broadcast and shared[(b.wave, b.src, b.transfers)] > 1:
            continue
        key = (b.wave, b.src, b.dst)
        assert key not in seen, "two buckets for one pair in one wave"
        seen.add(key)
    # each rank's schedule is ordered by wave
    for r in range(plan.world_size):
        waves = [step.bucket.wave for step in plan.schedule(r)]
        assert waves == sorted(waves)


def test_digest_changes_when_the_plan_changes():
    spec = TensorSpec("w", (8, 4), "float32")
    m = Mesh("m", (("tp", 2),))
    src = Layout("t", Role.TRAINER, 2, (m,), (TensorLayout(spec, MeshSharding("m", (("tp", Shard(0)),))),))
    dst1 = Layout("v", Role.INFERENCE, 2, (m,), (TensorLayout(spec, MeshSharding("m", (("tp", Shard(0)),))),))
    dst2 = Layout("v", Role.INFERENCE, 2, (m,), (TensorLayout(spec, MeshSharding("m", (("tp", Shard(1)),))),))
    assert plan_transfers([src], [dst1]).digest != plan_transfers([src], [dst2]).digest
    # which transfers travel as their own message changes no bucket, but both ends must agree on it
    same = plan_transfers([src], [dst1], PlanOptions(direct_bytes=None))
    assert same.buckets == plan_transfers([src], [dst1]).buckets
    assert same.digest != plan_transfers([src], [dst1]).digest


def test_broadcast_plans_give_every_destination_of_a_region_identical_buckets_counted_once_for_the_source():
    spec = TensorSpec("w", (64, 4), "float32")
    m = Mesh("m", (("tp", 2),))
    src = Layout("t", Role.TRAINER, 2, (m,), (TensorLayout(spec, MeshSharding("m", (("tp", Shard(0)),))),))
    one = Mesh("one", (("tp", 1),))
    dsts = [
        Layout(f"v{i}", Role.INFERENCE, 1, (one,), (TensorLayout(spec, MeshSharding("one", ())),)) for i in range(3)
    ]
    options = PlanOptions(wave_bytes=256, broadcast=True)
    assert options.relay is False  # broadcast replaces relays
    plan = plan_transfers([src], dsts, options)
    assert plan.stats.relayed_bytes == 0
    by_key: dict[tuple, set[int]] = {}
    for b in plan.buckets:
        by_key.setdefault((b.wave, b.src, b.transfers), set()).add(b.dst)
    assert all(len(d) == 3 for d in by_key.values())  # every bucket goes alike to all three engines
    # each trainer rank holds 512 B that three engines need: as broadcasts its load is 512 B, point to point
    # three times that (6 waves of 256 B); each engine receives 1024 B (4 waves), now the busiest
    assert plan.stats.waves == 4
    assert plan_transfers([src], dsts, PlanOptions(wave_bytes=256, relay=False)).stats.waves == 6
    assert plan.digest != plan_transfers([src], dsts, PlanOptions(wave_bytes=256, relay=False)).digest


def test_direct_bytes_must_be_positive_or_none():
    with pytest.raises(ValueError, match="direct_bytes"):
        PlanOptions(direct_bytes=0)
    assert PlanOptions(direct_bytes=None).direct_bytes is None


def _one(name, shape, dtype="float32", instance="t", role=Role.TRAINER):
    m = Mesh("m", (("world", 1),))
    return Layout(instance, role, 1, (m,), (TensorLayout(TensorSpec(name, shape, dtype), MeshSharding("m")),))


def _many(instance, role, specs):
    m = Mesh("m", (("world", 1),))
    return Layout(instance, role, 1, (m,), tuple(TensorLayout(s, MeshSharding("m")) for s in specs))


def test_missing_tensor_shape_and_dtype_mismatches_are_all_named_before_planning():
    src = _many(
        "t",
        Role.TRAINER,
        [TensorSpec("a", (4,), "float32"), TensorSpec("b", (4,), "float32"), TensorSpec("c", (4,), "float32")],
    )
    dst = _many(
        "v",
        Role.INFERENCE,
        [
            TensorSpec("a", (4,), "float32"),
            TensorSpec("b", (5,), "float32"),
            TensorSpec("c", (4,), "bfloat16"),
            TensorSpec("d", (4,), "float32"),
        ],
    )
    with pytest.raises(PlanError) as err:
        plan_transfers([src], [dst])
    text = str(err.value)
    assert "b: shape mismatch: source (4,) vs destination (5,)" in text
    assert "c: dtype mismatch: source float32 vs destination bfloat16" in text
    assert "d: needed by the destination but held by no source" in text
    assert len(err.value.problems) == 3


def test_region_held_by_no_source_is_an_error():
    spec = TensorSpec("w", (8,), "float32")
    m = Mesh("m", (("pp", 2),))
    from awex.meta import Pin

    src = Layout("t", Role.TRAINER, 2, (m,), (TensorLayout(spec, MeshSharding("m", (("pp", Pin((0,))),))),))
    # source holds all of w on pp=0; make a source that holds only half
    from awex.meta import Box, ExplicitSharding

    half = Layout("t", Role.TRAINER, 2, (m,), (TensorLayout(spec, ExplicitSharding(((0, (Box((0,), (4,)),)),))),))
    dst = _one("w", (8,), instance="v", role=Role.INFERENCE)
    plan_transfers([src], [dst])
    with pytest.raises(PlanError, match=r"w: region \[4:8\] needed by v is held by no source rank"):
        plan_transfers([half], [dst])


def test_duplicate_instances_and_empty_inputs():
    a = _one("w", (4,))
    with pytest.raises(PlanError, match="used twice"):
        plan_transfers([a], [_one("w", (4,), instance="t", role=Role.INFERENCE)])
    with pytest.raises(PlanError, match="at least one"):
        plan_transfers([a], [])


def test_replicas_share_the_send_load():
    # the upstream weak point: TP2 x DP4 trainer -> one TP8 engine used only 2 of 8 senders
    from conftest import MODELS

    from awex.meta import canonical_tensors, load_config
    from awex.meta.layouts import MegatronParallel, VllmParallel, megatron_layout, vllm_layout

    tensors = canonical_tensors(load_config(MODELS / "qwen3-8b.json"))
    src = megatron_layout(tensors, MegatronParallel(tp=2, dp=4))
    dst = vllm_layout(tensors, VllmParallel(tp=8))
    plan = plan_transfers([src], [dst])
    senders = {b.src for b in plan.buckets}
    assert senders == set(range(8))
    assert plan.stats.max_rank_send_bytes <= 1.05 * plan.stats.lower_bound_send_bytes
    assert plan.stats.lower_bound_send_bytes == -(-plan.stats.total_bytes // 8)


def test_with_devices_known_colocated_engines_read_their_own_gpus_replica():
    # Megatron TP=1 x DP=2 on GPUs 0 and 1, a vLLM TP=1 engine on each of them (CUDA IPC): each engine takes
    # everything from the replica on its own GPU; without devices the balancer spreads over both replicas
    from conftest import MODELS

    from awex.meta import canonical_tensors, load_config
    from awex.meta.layouts import MegatronParallel, VllmParallel, megatron_layout, vllm_layout

    tensors = canonical_tensors(load_config(MODELS / "qwen2-tiny.json"))
    src = megatron_layout(tensors, MegatronParallel(tp=1, dp=2), instance="trainer")
    dsts = [vllm_layout(tensors, VllmParallel(tp=1), instance=f"vllm-{i}") for i in range(2)]
    devices = (
        ("trainer", 0, "host/gpu-0"),
        ("trainer", 1, "host/gpu-1"),
        ("vllm-1", 0, "host/gpu-0"),
        ("vllm-0", 0, "host/gpu-1"),
    )
    plan = plan_transfers([src], dsts, PlanOptions(relay=False, devices=devices))
    verify_plan(plan, [src], dsts)
    gpu = {r.rank: dict(((i, lr), d) for i, lr, d in devices)[(r.instance, r.local_rank)] for r in plan.ranks}
    assert plan.buckets and all(gpu[b.src] == gpu[b.dst] for b in plan.buckets)
    spread = plan_transfers([src], dsts, PlanOptions(relay=False))
    assert any(gpu[b.src] != gpu[b.dst] for b in spread.buckets)
    assert plan.digest != spread.digest
    # a destination whose device no source shares is served as before; the order of `devices` does not matter
    partial = plan_transfers([src], dsts, PlanOptions(relay=False, devices=devices[:3]))
    verify_plan(partial, [src], dsts)
    assert all(gpu[b.src] == "host/gpu-0" for b in partial.buckets if gpu[b.dst] == "host/gpu-0")
    assert plan_transfers([src], dsts, PlanOptions(relay=False, devices=devices[::-1])).digest == plan.digest


def _fanout_layouts(n_dst: int, src_tp: int):
    spec = [TensorSpec(f"w{i}", (64, 32), "bfloat16") for i in range(6)]
    m = Mesh("m", (("tp", src_tp),))
    one = Mesh("m", (("tp", 1),))
    src = Layout(
        "t", Role.TRAINER, src_tp, (m,), tuple(TensorLayout(s, MeshSharding("m", (("tp", Shard(0)),))) for s in spec)
    )
    dsts = [
        Layout(f"v{i}", Role.INFERENCE, 1, (one,), tuple(TensorLayout(s, MeshSharding("m", ())) for s in spec))
        for i in range(n_dst)
    ]
    return src, dsts


def test_one_source_feeding_three_instances_sends_each_byte_once_and_destinations_relay():
    src, dsts = _fanout_layouts(3, 1)
    model = 6 * 64 * 32 * 2
    plan = plan_transfers([src], dsts, PlanOptions(wave_bytes=4096, split_bytes=256))
    assert verify_plan(plan, [src], dsts).ok
    check_plan_by_elements(plan, [src], dsts)
    send = [0] * plan.world_size
    for b in plan.buckets:
        send[b.src] += b.nbytes
    assert send[0] == model  # the trainer's egress does not multiply with the instances
    assert plan.stats.relayed_bytes == 2 * model
    assert max(send[1:]) <= model  # relaying is spread over the instances
    direct = plan_transfers([src], dsts, PlanOptions(wave_bytes=4096, split_bytes=256, relay=False))
    assert direct.stats.relayed_bytes == 0 and direct.stats.max_rank_send_bytes == 3 * model


def test_no_relay_where_the_source_is_not_the_bottleneck():
    src, dsts = _fanout_layouts(2, 2)  # TP=2 trainer -> two TP=1 engines: each trainer rank sends its half twice
    plan = plan_transfers([src], dsts)
    assert plan.stats.relayed_bytes == 0
    assert plan.stats.max_rank_send_bytes == plan.stats.max_rank_recv_bytes


def test_dtype_policy_widening_is_allowed_and_recorded_narrowing_needs_an_explicit_pattern():
    src = _many(
        "t",
        Role.TRAINER,
        [
            TensorSpec("model.layers.0.mlp.gate.weight", (4, 8), "float32"),
            TensorSpec("w", (4,), "bfloat16"),
            TensorSpec("x", (4,), "float32"),
        ],
    )
    dst = _many(
        "v",
        Role.INFERENCE,
        [
            TensorSpec("model.layers.0.mlp.gate.weight", (4, 8), "bfloat16"),
            TensorSpec("w", (4,), "float32"),
            TensorSpec("x", (4,), "float32"),
        ],
    )
    with pytest.raises(PlanError) as err:  # the router would silently lose precision
        plan_transfers([src], [dst])
    assert len(err.value.problems) == 1
    assert "model.layers.0.mlp.gate.weight: dtype mismatch: source float32 vs destination bfloat16" in str(err.value)
    assert "allow_cast" in str(err.value)
    plan = plan_transfers([src], [dst], PlanOptions(allow_cast=("*.mlp.gate.weight",)))
    assert set(plan.casts) == {("model.layers.0.mlp.gate.weight", "float32", "bfloat16"), ("w", "bfloat16", "float32")}
    # what moves is in the destination's dtype
    assert {t.name: t.dtype for t in plan.tensors}["model.layers.0.mlp.gate.weight"] == "bfloat16"
    assert plan.stats.total_bytes == 4 * 8 * 2 + 4 * 4 + 4 * 4
    assert verify_plan(plan, [src], [dst]).ok


def test_many_missing_tensors_or_narrowing_casts_are_told_in_a_few_lines_naming_the_cause():
    """Another model on one side: one line naming both models (as their tensors tell them); a few tensors missing
    from a model otherwise alike: a few named, then one line saying how many more and how much the two sides share;
    narrowing casts likewise, naming the option on the writer."""
    src = _many("t", Role.TRAINER, [TensorSpec(f"a{i}", (4,), "float32") for i in range(20)])
    dst = _many("v", Role.INFERENCE, [TensorSpec(f"b{i}", (4,), "float32") for i in range(27)])
    with pytest.raises(PlanError) as err:
        plan_transfers([src], [dst])
    assert err.value.problems == [
        "t and v hold different models: t has 20 tensors; v needs 27 tensors; 0 tensor names in common, 27 that v "
        "needs and t lacks (e.g. b0): load the same model on both sides"
    ]
    alike = [TensorSpec(f"c{i}", (4,), "float32") for i in range(40)]
    src = _many("t", Role.TRAINER, alike[:32])
    dst = _many("v", Role.INFERENCE, alike)
    with pytest.raises(PlanError) as err:
        plan_transfers([src], [dst])
    assert len(err.value.problems) == 6
    assert "c32: needed by the destination but held by no source" in str(err.value)
    assert (
        "3 more tensors the destination needs are held by no source: are the trainer and the engine the same "
        "model? (the trainer has 32 tensors, the engine 40, 32 of them alike by name)" in str(err.value)
    )
    src = _many("t", Role.TRAINER, [TensorSpec(f"w{i}", (4,), "float32") for i in range(9)])
    dst = _many("v", Role.INFERENCE, [TensorSpec(f"w{i}", (4,), "bfloat16") for i in range(9)])
    with pytest.raises(PlanError) as err:
        plan_transfers([src], [dst])
    assert len(err.value.problems) == 6 and "AwexTrainerInitInfo" in str(err.value)
    assert "4 more narrowing casts (4 float32 -> bfloat16)" in str(err.value)
