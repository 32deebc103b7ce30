"""Outcomes at scale: the first trainer rank reads every receiver's outcome and publishes them in one record; the
other trainer ranks read that record only (one read each, not one per receiver), and a record that is missing,
malformed or names strangers counts every receiver as silent: the version fails, never a false success."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from awex.engines.sync import outcomes
from awex.engines.sync.manifest import SyncManifest
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


class Recorded:
    """Signals that share outcomes, in memory, counting what each trainer rank read."""

    medium = "channel"
    shares_outcomes = True

    def __init__(self, docs):
        self.docs, self.record, self.reads = docs, None, 0

    def outcomes(self, manifest, receivers, deadline):
        self.reads += len(receivers)
        return [self.docs.get((r.instance, r.local_rank)) for r in receivers]

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
    assert other[RECEIVERS[1]] == failed and other[RECEIVERS[2]] is None and other[RECEIVERS[0]] == {"ok": True}


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
    got = {who: {"ok": True} for who in RECEIVERS}
    got[RECEIVERS[0]] = {"ok": False, "cause": None, "partial": False}
    got[RECEIVERS[3]] = None
    receivers = [r for r in PLAN.ranks if r.role.value != "trainer"]
    assert outcomes.from_record(json.loads(json.dumps(outcomes.to_record(got))), receivers) == got
