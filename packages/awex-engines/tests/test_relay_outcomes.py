"""Outcomes through host relays: an engine instance's receiving ranks on one host tell the lowest of them their
outcome over a local datagram; it puts one record for them, and tells them whether theirs is in it. The first
trainer rank reads that record instead of each rank's key. Nothing is lost: a rank whose lead refuses its datagram,
names it silent or exits puts its own key, which the first trainer rank reads (and its writer drops); a rank that
exited on its lead's host failed. Never a false success, never a wait to the deadline where a rank is gone."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
from relayed_helper import relayed_signals

from awex.engines.outcome import APPLIED, Outcome
from awex.engines.sync import keys, outcomes, relay, relayed
from awex.engines.sync.board import host_identity
from awex.engines.sync.channel import VersionChannel
from awex.engines.sync.manifest import SyncManifest
from awex.meta import PlanOptions, canonical_tensors, plan_transfers
from awex.meta.layouts import MegatronParallel, VllmParallel, megatron_layout, vllm_layout
from awex.transport.pull.segments import start_time

CONFIG = json.loads((Path(__file__).resolve().parents[3] / "integration" / "models" / "qwen2-tiny.json").read_text())
TENSORS = canonical_tensors(CONFIG, dtype="float32")
PLAN = plan_transfers(  # sync ranks: trainer 0-1, vllm-0 2-5, vllm-1 6-7
    [megatron_layout(TENSORS, MegatronParallel(tp=2), instance="trainer")],
    [vllm_layout(TENSORS, VllmParallel(tp=4), instance="vllm-0"), vllm_layout(TENSORS, VllmParallel(tp=2), "vllm-1")],
    PlanOptions(),
)
HERE = host_identity()  # three of vllm-0's ranks: one group, led by sync rank 2 (liveness is checked on this host)
HOSTS = {
    ("trainer", 0): "A",
    ("trainer", 1): "B",
    ("vllm-0", 0): HERE,
    ("vllm-0", 1): HERE,
    ("vllm-0", 2): HERE,
    ("vllm-0", 3): "E",  # alone on its host (as is each of vllm-1's ranks): keys of their own
    ("vllm-1", 0): "C",
    ("vllm-1", 1): "D",
}
MANIFEST = SyncManifest("v1", ("trainer",), ("vllm-0", "vllm-1"), "127.0.0.1", 1, seq=3)
OK = {"ok": True}
RECORD = "vllm-0/0"


@pytest.fixture
def channel():
    return VersionChannel.host()


def _signals(channel, ranks, made, exited=()):
    """Each rank's signals through its relays; ranks in ``exited`` look gone (their process's start time differs)."""
    me, started = os.getpid(), start_time(os.getpid())
    processes = {who: (host, me, -1 if PLAN.rank(*who).rank in exited else started) for who, host in HOSTS.items()}
    return relayed_signals(PLAN, processes, channel, ranks, made)[1]


def _finish(signals, rank, doc, deadline=10.0):
    """What a receiving rank does once its transfer ended: report, then its part in its group's record."""
    me = PLAN.ranks[rank]
    signals.report(MANIFEST, me, doc)
    outcomes.aggregate(PLAN, signals, MANIFEST, (me.instance, me.local_rank), time.monotonic() + deadline)


def _all(signals, docs, deadline=10.0):
    threads = [threading.Thread(target=_finish, args=(signals[r], r, d, deadline)) for r, d in docs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)


def _own(channel, rank):
    return channel.get(keys.channel_outcome("v1", 3, PLAN.ranks[rank].instance, PLAN.ranks[rank].local_rank))


def test_an_instances_ranks_on_one_host_report_in_one_record(channel, made):
    signals = _signals(channel, range(PLAN.world_size), made)
    assert signals[0].record_groups(PLAN) == {RECORD: [PLAN.ranks[r] for r in (2, 3, 4)]}
    _all(signals, {r: OK for r in range(2, 8)})
    assert channel.get(keys.instance_outcomes("v1", 3, RECORD)) == {"failed": {}, "silent": []}
    assert [_own(channel, r) for r in range(2, 8)] == [None, None, None, OK, OK, OK]
    got = outcomes.collect(PLAN, signals[0], MANIFEST, time.monotonic() + 5.0, rank=0)
    assert got == {(r.instance, r.local_rank): APPLIED for r in PLAN.ranks[2:]}
    # what its writer drops once the version is old: the record and the keys of the ranks alone, each there
    assert [r.rank for r in signals[0].own_outcomes(PLAN, "v1", 3)] == [5, 6, 7]


def test_a_members_failure_is_in_the_record_with_its_cause(channel, made):
    signals = _signals(channel, range(2, 5), made)
    failed = {"ok": False, "cause": "RuntimeError: apply " + "x" * 5000, "partial": True}
    _all(signals, {2: OK, 3: failed, 4: OK})
    record = channel.get(keys.instance_outcomes("v1", 3, RECORD))
    assert record["silent"] == [] and list(record["failed"]) == ["vllm-0:1"]
    said = outcomes.from_record(record, PLAN.ranks[2:5])[("vllm-0", 1)]
    assert not said.ok and said.partial and said.cause.startswith("RuntimeError: apply")


def test_a_member_whose_lead_does_not_listen_puts_its_own_key(channel, made):
    signals = _signals(channel, (0, 3, 4), made)  # its lead (2) never made its relay
    _all(signals, {3: OK, 4: OK})
    assert _own(channel, 3) == OK and _own(channel, 4) == OK
    # the first trainer rank: no record comes; it reads them by their keys (and its writer then drops those)
    channel.put(keys.channel_outcome("v1", 3, "vllm-0", 0), OK)  # the lead's own (what a deaf lead does)
    for r in (5, 6, 7):
        channel.put(keys.channel_outcome("v1", 3, PLAN.ranks[r].instance, PLAN.ranks[r].local_rank), OK)
    got = outcomes.collect(PLAN, signals[0], MANIFEST, time.monotonic() + 0.5, rank=0)
    assert all(o == APPLIED for o in got.values()), got
    assert [r.rank for r in signals[0].own_outcomes(PLAN, "v1", 3)] == [2, 3, 4, 5, 6, 7]
    assert signals[0].own_outcomes(PLAN, "v1", 3)[0].rank == 5  # asked once: the writer drops them once


def test_a_member_its_lead_calls_silent_puts_its_own_key(channel, made):
    signals = _signals(channel, range(2, 5), made)
    started = time.monotonic()
    lead = threading.Thread(target=_finish, args=(signals[2], 2, OK, 0.3))  # its deadline passes before 4 reports
    lead.start()
    _finish(signals[3], 3, OK)
    lead.join(30)
    assert time.monotonic() - started < 5.0
    assert channel.get(keys.instance_outcomes("v1", 3, RECORD)) == {"failed": {}, "silent": ["vllm-0:2"]}
    assert _own(channel, 3) is None
    _finish(signals[4], 4, OK)  # late: its lead said it is not in the record, so it puts its own key
    assert _own(channel, 4) == OK


def test_a_member_that_exited_on_its_leads_host_failed(channel, made, monkeypatch):
    monkeypatch.setattr(relayed, "LIVENESS_SECONDS", 0.1)
    signals = _signals(channel, range(2, 5), made, exited=(4,))
    started = time.monotonic()
    _all(signals, {2: OK, 3: OK}, deadline=60.0)
    assert time.monotonic() - started < 5.0  # not the deadline: its lead saw it gone
    said = outcomes.from_record(channel.get(keys.instance_outcomes("v1", 3, RECORD)), PLAN.ranks[2:5])
    assert said[("vllm-0", 0)] == APPLIED and said[("vllm-0", 1)] == APPLIED
    gone = said[("vllm-0", 2)]
    assert isinstance(gone, Outcome) and not gone.ok and "exited before it reported" in gone.cause


def test_a_member_whose_lead_exited_puts_its_own_key(channel, made, monkeypatch):
    monkeypatch.setattr(relayed, "LIVENESS_SECONDS", 0.1)
    signals = _signals(channel, range(2, 5), made, exited=(2,))  # 2 listens, then is gone before it gathers
    started = time.monotonic()
    _all(signals, {3: OK}, deadline=60.0)
    assert time.monotonic() - started < 5.0
    assert _own(channel, 3) == OK


def test_a_forged_or_strangers_outcome_is_not_recorded(channel, made):
    signals = _signals(channel, range(2, 5), made)
    lead = signals[2].relay
    lead.tell(2, {"kind": "outcome", "version": "v1", "seq": 3, "rank": 0, "doc": OK})  # a trainer rank's: no
    raw = b"0" * 64 + json.dumps({"kind": "outcome", "version": "v1", "seq": 3, "rank": 4, "doc": OK}).encode()
    lead._outbox.sendto(raw, relay.address(channel.secret, 2))  # without the secret: dropped
    _all(signals, {2: OK, 3: OK}, deadline=0.3)
    assert outcomes.from_record(channel.get(keys.instance_outcomes("v1", 3, RECORD)), PLAN.ranks[2:5]) == {
        ("vllm-0", 0): APPLIED,
        ("vllm-0", 1): APPLIED,
        ("vllm-0", 2): None,  # neither datagram counted as its
    }


def test_a_member_whose_leads_word_is_lost_reads_the_record(channel, made, monkeypatch):
    # its lead's datagram saying the record holds its outcome never came (its queue was full): after a slice it
    # reads the record itself, finds its outcome there and puts no key of its own
    monkeypatch.setattr(relayed, "LIVENESS_SECONDS", 0.1)
    signals = _signals(channel, range(2, 5), made)
    monkeypatch.setattr(signals[2], "_tell_all", lambda peers, message: None)
    started = time.monotonic()
    _all(signals, {2: OK, 3: OK, 4: OK}, deadline=60.0)
    assert time.monotonic() - started < 5.0
    assert channel.get(keys.instance_outcomes("v1", 3, RECORD)) == {"failed": {}, "silent": []}
    assert [_own(channel, r) for r in (3, 4)] == [None, None]


def test_a_lead_stops_waiting_for_a_member_that_reported_alone(channel, made, monkeypatch):
    # a member that could not bind its datagram address (taken) reports under its own key: its lead sees that key
    # after a slice and names it silent in its record (so the first trainer rank reads the key), not waiting longer
    monkeypatch.setattr(relayed, "LIVENESS_SECONDS", 0.1)
    signals = _signals(channel, range(2, 5), made)
    signals[4].relay._inbox.close()
    signals[4].relay._inbox = None
    started = time.monotonic()
    _all(signals, {2: OK, 3: OK, 4: OK}, deadline=60.0)
    assert time.monotonic() - started < 5.0
    assert channel.get(keys.instance_outcomes("v1", 3, RECORD)) == {"failed": {}, "silent": ["vllm-0:2"]}
    assert _own(channel, 4) == OK and _own(channel, 3) is None
