"""Host relays: on each host of two or more ranks the lowest reads the manifest (and the lowest trainer rank the
record of every outcome) from the version channel once and hands it to the others over local datagrams; the others
read nothing from the channel. A datagram without the channel's secret, or of another version, is dropped; a rank
whose relay says nothing reads the channel itself once its slice of waiting ends (never a wait to the deadline,
never a false success)."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from awex.engines.outcome import APPLIED
from awex.engines.sync import keys, outcomes, relay
from awex.engines.sync.channel import VersionChannel
from awex.engines.sync.manifest import SyncManifest
from awex.engines.sync.relay import HostRelay, RelayTimeout, Roles, channel_manifest, roles
from awex.meta import PlanOptions, canonical_tensors, plan_transfers
from awex.meta.layouts import MegatronParallel, VllmParallel, megatron_layout, vllm_layout

CONFIG = json.loads((Path(__file__).resolve().parents[3] / "integration" / "models" / "qwen2-tiny.json").read_text())
TENSORS = canonical_tensors(CONFIG, dtype="float32")
PLAN = plan_transfers(  # sync ranks: trainer 0-3, vllm-0 4-5, vllm-1 6-7
    [megatron_layout(TENSORS, MegatronParallel(tp=2, pp=2), instance="trainer")],
    [vllm_layout(TENSORS, VllmParallel(tp=2), instance=f"vllm-{i}") for i in range(2)],
    PlanOptions(),
)
HOSTS = {  # the first trainer rank's host (A), a host of trainer ranks (B), a mixed one (C), a rank alone (D)
    ("trainer", 0): "A",
    ("trainer", 1): "A",
    ("trainer", 2): "B",
    ("vllm-0", 0): "B",
    ("trainer", 3): "C",
    ("vllm-0", 1): "C",
    ("vllm-1", 0): "C",
    ("vllm-1", 1): "D",
}
MANIFEST = SyncManifest("v1", ("trainer",), ("vllm-0", "vllm-1"), "127.0.0.1", 1, seq=3)


def test_each_host_has_one_relay_and_the_first_trainer_ranks_host_relays_no_manifest():
    got = {r: roles(PLAN, HOSTS, r) for r in range(PLAN.world_size)}
    assert got == {
        0: Roles(outcomes_to=(1,)),  # its host reads the manifest on its host board: no manifest relayed
        1: Roles(outcomes_from=0),
        2: Roles(manifest_to=(4,)),  # alone of the trainer ranks on B: no record relayed
        4: Roles(manifest_from=2),
        3: Roles(manifest_to=(5, 6)),
        5: Roles(manifest_from=3),
        6: Roles(manifest_from=3),
        7: Roles(),
    }
    assert not got[7] and all(got[r] for r in range(7))
    assert roles(PLAN, {k: v for k, v in HOSTS.items() if k != ("vllm-0", 1)}, 5) == Roles()  # no host known


def _relays(channel: VersionChannel, ranks) -> dict[int, HostRelay]:
    return {r: HostRelay(roles(PLAN, HOSTS, r), r, channel.secret) for r in ranks}


class _Reads:
    """A channel connection that counts its waits (reads from the channel's host)."""

    def __init__(self, channel: VersionChannel):
        self.channel, self.reads, self.secret = channel, 0, channel.secret

    def wait(self, names, timeout):
        self.reads += 1
        return self.channel.wait(names, timeout)


def test_a_relay_reads_the_manifest_once_for_its_host():
    channel = VersionChannel.host()
    relays = _relays(channel, (3, 5, 6))
    doc = {"version": "v1", "seq": 3, "sources": ["trainer"]}
    channel.put(keys.channel_manifest("v1"), doc)
    try:
        conns = {r: _Reads(channel) for r in relays}
        assert channel_manifest(conns[3], relays[3], "v1", 2.0) == doc
        assert channel_manifest(conns[3], relays[3], "v1", 2.0) == doc  # read again: not handed on again
        for peer in (5, 6):
            assert channel_manifest(conns[peer], relays[peer], "v1", 2.0) == doc
            assert conns[peer].reads == 0  # heard, not read
            with pytest.raises(RelayTimeout):  # once only
                relays[peer].manifest("v1", 0.05)
        assert conns[3].reads == 2
    finally:
        for r in relays.values():
            r.close()


def test_a_datagram_without_the_secret_or_of_another_version_is_dropped(caplog):
    channel = VersionChannel.host()
    relays = _relays(channel, (2, 4))
    forger = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        payload = json.dumps({"kind": "manifest", "version": "v1", "doc": {"version": "v1", "forged": True}}).encode()
        forger.sendto(b"0" * 64 + payload, relay.address(channel.secret, 4))  # reaches it: no secret, no MAC
        relays[2].forward_manifest("v0", {"version": "v0", "seq": 1})  # an older version's
        with pytest.raises(RelayTimeout):
            relays[4].manifest("v1", 0.1)
        assert "fails its check" in caplog.text
        relays[2].forward_manifest("v1", {"version": "v1", "seq": 2})
        assert relays[4].manifest("v1", 1.0) == {"version": "v1", "seq": 2}
    finally:
        forger.close()
        for r in relays.values():
            r.close()


def test_a_rank_whose_relay_says_nothing_reads_the_channel_after_its_slice():
    channel = VersionChannel.host()
    peer = _relays(channel, (4,))[4]  # its relay (2) never runs
    doc = {"version": "v1", "seq": 3}
    channel.put(keys.channel_manifest("v1"), doc)
    try:
        conn = _Reads(channel)
        started = time.monotonic()
        assert channel_manifest(conn, peer, "v1", 0.2) == doc
        assert conn.reads == 1 and 0.15 < time.monotonic() - started < 2.0
    finally:
        peer.close()


class _Record:
    """Signals sharing outcomes, in memory: the first trainer rank's record, counting the other ranks' reads."""

    medium, shares_outcomes = "channel", True

    def __init__(self, record=None):
        self.record, self.reads = record, 0

    def collected(self, manifest, timeout):
        self.reads += 1
        if self.record is None:
            time.sleep(min(timeout, 0.01))
            raise TimeoutError("no record")
        return self.record


def test_a_trainer_relay_hands_the_record_to_its_hosts_trainer_ranks(monkeypatch):
    channel = VersionChannel.host()
    relays = _relays(channel, (0, 1))
    monkeypatch.setattr(outcomes, "LIVENESS_SECONDS", 0.1)
    try:
        failed = {"failed": {"vllm-0:1": {"ok": False, "cause": "boom", "partial": True}}, "silent": ["vllm-1:1"]}
        relays[0].forward_outcomes("v1", 3, failed)  # as the first rank's collect does once it made the record
        signals = _Record()
        got = outcomes.collect(PLAN, signals, MANIFEST, time.monotonic() + 5.0, rank=1, relay=relays[1])
        assert signals.reads == 0
        assert got[("vllm-0", 1)].cause == "boom" and got[("vllm-1", 1)] is None and got[("vllm-0", 0)] == APPLIED
        # the relay had no record (its own read failed): the peer reads the channel's itself, at once
        relays[0].forward_outcomes("v1", 3, None)
        signals = _Record({"failed": {}, "silent": []})
        got = outcomes.collect(PLAN, signals, MANIFEST, time.monotonic() + 5.0, rank=1, relay=relays[1])
        assert signals.reads == 1 and all(o == APPLIED for o in got.values())
        # a relay that says nothing (failed before it could): read after one slice, not at the deadline
        started = time.monotonic()
        got = outcomes.collect(PLAN, signals, MANIFEST, time.monotonic() + 30.0, rank=1, relay=relays[1])
        assert signals.reads == 2 and time.monotonic() - started < 5.0 and all(o == APPLIED for o in got.values())
        # nothing anywhere: every receiver silent at the deadline (the version failed)
        got = outcomes.collect(PLAN, _Record(), MANIFEST, time.monotonic() + 0.3, rank=1, relay=relays[1])
        assert all(o is None for o in got.values())
    finally:
        for r in relays.values():
            r.close()


def test_an_other_versions_record_is_not_taken(monkeypatch):
    channel = VersionChannel.host()
    relays = _relays(channel, (0, 1))
    monkeypatch.setattr(outcomes, "LIVENESS_SECONDS", 0.1)
    try:
        relays[0].forward_outcomes("v1", 2, {"failed": {}, "silent": []})  # a failed earlier attempt's count
        got = outcomes.collect(PLAN, _Record(), MANIFEST, time.monotonic() + 0.3, rank=1, relay=relays[1])
        assert all(o is None for o in got.values())
    finally:
        for r in relays.values():
            r.close()
