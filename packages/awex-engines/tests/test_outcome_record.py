"""Outcomes at scale: each engine instance's first receiving rank collects its instance's outcomes in one record;
the first trainer rank reads one record per instance (and, one by one, the ranks no record says) and publishes
every outcome in one record; the other trainer ranks read that record only (one read each, not one per receiver).
A record that is missing, malformed or names strangers says nothing: the ranks it would cover are read one by
one (an instance's record) or count as silent (the trainers' record): the version fails, never a false success."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from awex.engines.errors import instance_verdicts
from awex.engines.outcome import APPLIED, Outcome, all_applied
from awex.engines.sync import outcomes
from awex.engines.sync import signals as signals_module
from awex.engines.sync.manifest import SyncManifest
from awex.engines.sync.signals import InstanceRecords
from awex.meta import PlanOptions, canonical_tensors, plan_transfers
from awex.meta.layouts import MegatronParallel, VllmParallel, megatron_layout, vllm_layout

CONFIG = json.loads((Path(__file__).resolve().parents[3] / "integration" / "models" / "qwen2-tiny.json").read_text())
TENSORS = canonical_tensors(CONFIG, dtype="float32")
PLAN = plan_transfers(
    [megatron_layout(TENSORS, MegatronParallel(tp=2), instance="trainer")],
    [vllm_layout(TENSORS, VllmParallel(tp=2), instance=f"vllm-{i}") for i in range(2)],
    PlanOptions(),
)
MANIFEST = SyncManifest("v1", ("trainer",), ("vllm-0", "vllm-1"), "127.0.0.1", 1, seq=3)
RECEIVERS = [(r.instance, r.local_rank) for r in PLAN.ranks if r.role.value != "trainer"]


class Recorded(InstanceRecords):
    """Signals that share outcomes, in memory, counting what each trainer rank read (records by instance)."""

    medium = "channel"
    shares_outcomes = True

    def __init__(self, docs):
        self.docs, self.record, self.reads, self.by_instance = docs, None, 0, {}

    def outcomes(self, manifest, receivers, deadline):
        self.reads += len(receivers)
        return [self.docs.get((r.instance, r.local_rank)) for r in receivers]

    def publish_instance(self, manifest, instance, doc):
        self.by_instance[instance] = json.loads(json.dumps(doc))

    def instances(self, manifest, names, deadline):
        self.reads += len(names)
        return [self.by_instance.get(name) for name in names]

    def publish_outcomes(self, manifest, doc):
        self.record = json.loads(json.dumps(doc))  # as it would travel

    def collected(self, manifest, timeout):
        if self.record is None:
            raise TimeoutError("no record")
        self.reads += 1
        return self.record


def test_the_first_trainer_rank_reads_every_receiver_and_the_others_one_record():
    failed = {"ok": False, "cause": "RuntimeError: boom", "partial": True}
    docs = {who: {"ok": True} for who in RECEIVERS}
    docs[RECEIVERS[1]] = failed
    del docs[RECEIVERS[2]]  # silent
    signals = Recorded(docs)
    first = outcomes.collect(PLAN, signals, MANIFEST, time.monotonic() + 0.01, rank=0)
    assert signals.reads >= len(RECEIVERS) and signals.record is not None
    before = signals.reads
    other = outcomes.collect(PLAN, signals, MANIFEST, time.monotonic() + 1.0, rank=1)
    assert signals.reads == before + 1  # one read, whatever the number of receivers
    assert other == first
    assert other[RECEIVERS[1]] == Outcome(False, "RuntimeError: boom", True)
    assert other[RECEIVERS[2]] is None and other[RECEIVERS[0]] == APPLIED


@pytest.mark.parametrize(
    "record",
    [
        None,  # the first rank never published (gone)
        "all ok",
        {"failed": {}, "silent": "none"},
        {"failed": {"vllm-9:0": {"ok": False}}, "silent": []},  # a rank outside the plan
        {"failed": {"vllm-0:0": {"ok": True}}, "silent": []},  # a "failure" that says ok
    ],
)
def test_a_missing_or_malformed_record_counts_every_receiver_as_silent(record):
    signals = Recorded({})
    signals.record = record
    got = outcomes.collect(PLAN, signals, MANIFEST, time.monotonic() + 0.05, rank=1)
    assert set(got) == set(RECEIVERS) and all(doc is None for doc in got.values())


def test_the_record_round_trips_every_outcome():
    got = {who: APPLIED for who in RECEIVERS}
    got[RECEIVERS[0]] = Outcome(False, None, False)
    got[RECEIVERS[1]] = Outcome(False, "RuntimeError: apply", True)
    got[RECEIVERS[3]] = None
    receivers = [r for r in PLAN.ranks if r.role.value != "trainer"]
    assert outcomes.from_record(json.loads(json.dumps(outcomes.to_record(got))), receivers) == got


def _aggregated(signals):
    """Every receiving rank's part after its report: each instance's first rank publishes its instance's record."""
    for who in RECEIVERS:
        outcomes.aggregate(PLAN, signals, MANIFEST, who, time.monotonic() + 0.01)
    return signals


def test_the_first_trainer_rank_reads_one_record_per_instance():
    docs = {who: {"ok": True} for who in RECEIVERS}
    docs[RECEIVERS[3]] = {"ok": False, "cause": "ValueError: views", "partial": False}
    signals = _aggregated(Recorded(docs))
    assert sorted(signals.by_instance) == ["vllm-0", "vllm-1"]  # one record each, by the instance's first rank
    signals.reads = 0
    got = outcomes.collect(PLAN, signals, MANIFEST, time.monotonic() + 1.0, rank=0)
    assert signals.reads == 2  # one per instance, not one per rank
    assert got == {who: APPLIED for who in RECEIVERS[:3]} | {RECEIVERS[3]: Outcome(False, "ValueError: views")}


def test_ranks_a_record_does_not_vouch_for_are_read_one_by_one():
    docs = {who: {"ok": True} for who in RECEIVERS}
    late = docs.pop(RECEIVERS[1])  # not there when its instance's first rank collected
    signals = _aggregated(Recorded(docs))
    assert signals.by_instance["vllm-0"]["silent"] == ["vllm-0:1"]
    signals.docs[RECEIVERS[1]] = late  # reported before the trainer's deadline
    signals.by_instance["vllm-1"] = {"failed": {"vllm-0:0": {"ok": False}}, "silent": []}  # names another instance
    got = outcomes.collect(PLAN, signals, MANIFEST, time.monotonic() + 1.0, rank=0)
    assert got == {who: APPLIED for who in RECEIVERS}  # vllm-0:1 and vllm-1's ranks read one by one
    signals.by_instance["vllm-1"] = {"failed": {}, "silent": []}  # "all applied"
    del signals.docs[RECEIVERS[2]]
    signals.by_instance["vllm-1"]["silent"] = ["vllm-1:0"]
    assert outcomes.collect(PLAN, signals, MANIFEST, time.monotonic() + 0.01, rank=0)[RECEIVERS[2]] is None


def test_only_an_instance_s_first_rank_aggregates_and_only_where_outcomes_are_shared():
    signals = Recorded({who: {"ok": True} for who in RECEIVERS})
    for who in RECEIVERS[1::2]:  # every instance's second rank
        outcomes.aggregate(PLAN, signals, MANIFEST, who, time.monotonic())
    assert signals.by_instance == {}
    signals.shares_outcomes = False  # the host board: every trainer rank reads the slots itself
    outcomes.aggregate(PLAN, signals, MANIFEST, RECEIVERS[0], time.monotonic())
    assert signals.by_instance == {}


def test_instance_records_travel_on_the_version_channel():
    from awex.engines.sync.channel import VersionChannel
    from awex.engines.sync.signals import ChannelSignals

    host = VersionChannel.host(timeout=30.0)
    try:
        trainer, receiver = ChannelSignals(host), ChannelSignals(VersionChannel.connect(host.address, host.secret))
        ranks = {(r.instance, r.local_rank): r for r in PLAN.ranks}
        failed = {"ok": False, "cause": "RuntimeError: apply", "partial": True}
        for who in RECEIVERS:
            receiver.report(MANIFEST, ranks[who], failed if who == RECEIVERS[2] else {"ok": True})
        for who in RECEIVERS:
            outcomes.aggregate(PLAN, receiver, MANIFEST, who, time.monotonic() + 5.0)
        assert trainer.instances(MANIFEST, ["vllm-0", "vllm-1", "vllm-9"], time.monotonic() + 0.05)[2] is None
        got = outcomes.collect(PLAN, trainer, MANIFEST, time.monotonic() + 5.0, rank=0)
        assert got == {who: Outcome.from_wire(failed) if who == RECEIVERS[2] else APPLIED for who in RECEIVERS}
        assert got[RECEIVERS[2]] == Outcome(False, "RuntimeError: apply", True)
        assert outcomes.collect(PLAN, receiver, MANIFEST, time.monotonic() + 5.0, rank=1) == got  # the others' record
    finally:
        host.close()


def test_an_instance_s_first_rank_waits_for_its_ranks_a_bounded_while_and_says_who_was_silent(monkeypatch):
    class Waiting(Recorded):
        def outcomes(self, manifest, receivers, deadline):  # a rank that never reports: wait out the deadline
            time.sleep(max(0.0, deadline - time.monotonic()))
            return super().outcomes(manifest, receivers, deadline)

    monkeypatch.setattr(signals_module, "AGGREGATE_SECONDS", 0.2)
    signals = Waiting({RECEIVERS[0]: {"ok": True}})
    started = time.monotonic()
    outcomes.aggregate(PLAN, signals, MANIFEST, RECEIVERS[0], time.monotonic() + 60.0)  # a sync's long deadline
    assert time.monotonic() - started < 5.0  # not the sync's deadline: the trainer reads the rest itself
    assert signals.by_instance["vllm-0"] == {"failed": {}, "silent": ["vllm-0:1"]}


@pytest.mark.parametrize(
    "doc",
    [None, "ok", {"ok": 1}, {"ok": "true"}, {"cause": "x"}, [True], {"ok": None, "partial": False}],
)
def test_an_outcome_is_applied_only_where_it_says_exactly_ok_true(doc):
    """Untrusted outcomes: anything but ``ok: true`` is a failure, and a malformed one a partial failure naming it."""
    outcome = Outcome.from_wire(doc)
    assert not outcome.ok and outcome.partial and "malformed outcome" in outcome.cause
    assert Outcome.from_wire({"ok": True, "cause": "ignored"}) is APPLIED
    said = Outcome.from_wire({"ok": False, "cause": "x" * 5000, "partial": "yes"})
    assert not said.ok and not said.partial and len(said.cause) == 2000  # partial only where exactly true


def test_all_applied_and_the_verdicts_are_exact_on_the_fast_path_and_off_it():
    """Every steady version's outcomes are one object (``APPLIED``), told apart by identity; any other outcome, a
    missing one or a failure, takes the full check, with the same answers."""
    ranks = [(f"vllm-{i // 4}", i % 4) for i in range(512)]
    steady = dict.fromkeys(ranks, APPLIED)
    assert all_applied(steady) and all_applied({})
    assert outcomes.to_record(steady) == {"failed": {}, "silent": []}
    assert instance_verdicts(steady) == {f"vllm-{i}": "applied" for i in range(128)}
    assert all_applied({**steady, ranks[7]: Outcome(True, "said more")})  # ok, though not the one object
    for last in (None, Outcome.failed("oom", partial=True), Outcome.failed("refused", partial=False)):
        got = {**steady, ranks[-1]: last}
        assert not all_applied(got)
        record = outcomes.to_record(got)
        assert record == (
            {"failed": {}, "silent": ["vllm-127:3"]}
            if last is None
            else {"failed": {"vllm-127:3": last.to_wire()}, "silent": []}
        )
        verdicts = instance_verdicts(got)
        assert verdicts["vllm-126"] == "applied" and verdicts["vllm-127"] == "inconsistent"
    refused = dict.fromkeys(ranks[:4], Outcome.failed("refused", partial=False))
    assert instance_verdicts({**steady, **refused})["vllm-0"] == "unchanged"


def test_the_writer_drops_exactly_the_keys_a_versions_signals_leave_on_the_channel():
    # the writer drops an old version's channel keys one by one (awex.engines.sync.keys.channel_signals): a key the
    # signals write that the list misses stays in the channel's store for the rest of the run (each engine's record
    # of its ranks' outcomes did, one per instance and version), and one never written costs the channel's host a
    # round trip for nothing (the receivers' ready signals, the trainer ranks' outcomes and every other transport's
    # ready signals were named: half the deletes over a pull transport, three in four over NCCL)
    from awex.engines.sync import keys
    from awex.engines.sync.signals import ChannelSignals
    from awex.meta import Role
    from awex.transport.registry import transport_class

    class Recording:
        def __init__(self):
            self.written: set[str] = set()

        def put(self, key, value):
            self.written.add(key)

    trainers = [r for r in PLAN.ranks if r.role == Role.TRAINER]
    receivers = [r for r in PLAN.ranks if r.role != Role.TRAINER]
    for kind in ("ipc", "p2p"):  # a transport whose senders signal ready, and one whose do not
        channel = Recording()
        signals = ChannelSignals(channel)
        if transport_class(kind).signals_ready:  # what the transports do (awex.transport.ipc, pull, p2p)
            for r in trainers:
                signals.ready(kind, MANIFEST, r, 1)
        for r in receivers:
            signals.report(MANIFEST, r, {"ok": True})
        signals.publish_outcomes(MANIFEST, {"failed": {}, "silent": []})
        for name in MANIFEST.destinations:  # each engine's first rank, where it has two or more (these have 2)
            signals.publish_instance(MANIFEST, name, {"failed": {}, "silent": []})
        kinds = [kind] if transport_class(kind).signals_ready else []
        dropped = keys.channel_signals(
            MANIFEST.version,
            MANIFEST.seq,
            [(r.instance, r.local_rank) for r in trainers],
            [(r.instance, r.local_rank) for r in receivers],
            kinds,
            records=sorted(signals.record_groups(PLAN)),
        )
        assert len(dropped) == len(set(dropped))
        assert set(dropped) == channel.written, (kind, set(dropped) ^ channel.written)
