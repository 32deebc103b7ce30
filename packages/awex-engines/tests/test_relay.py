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
from relayed_helper import relayed_signals

from awex.engines.outcome import APPLIED
from awex.engines.sync import keys, outcomes, relay
from awex.engines.sync.channel import VersionChannel
from awex.engines.sync.manifest import SyncManifest
from awex.engines.sync.peer_link import SyncPeerLink
from awex.engines.sync.relay import HostRelay, RelayTimeout, Roles, channel_manifest, roles
from awex.meta import PlanOptions, canonical_tensors, plan_transfers
from awex.meta.errors import AwexValueError
from awex.meta.layouts import MegatronParallel, VllmParallel, megatron_layout, vllm_layout

CONFIG = json.loads((Path(__file__).resolve().parents[3] / "integration" / "models" / "qwen2-tiny.json").read_text())
TENSORS = canonical_tensors(CONFIG, dtype="float32")
PLAN = plan_transfers(  # sync ranks: trainer 0-3, vllm-0 4-5, vllm-1 6-7
    [megatron_layout(TENSORS, MegatronParallel(tp=2, pp=2), instance="trainer")],
    [vllm_layout(TENSORS, VllmParallel(tp=2), instance=f"vllm-{i}") for i in range(2)],
    PlanOptions(),
)
HOSTS = {  # the first trainer rank's host (A), a host of trainer ranks (B), two engines' ranks (C), a rank alone (D)
    ("trainer", 0): "A",
    ("trainer", 1): "A",
    ("trainer", 2): "B",
    ("trainer", 3): "B",
    ("vllm-0", 0): "C",
    ("vllm-0", 1): "C",
    ("vllm-1", 0): "C",
    ("vllm-1", 1): "D",
}
MANIFEST = SyncManifest("v1", ("trainer",), ("vllm-0", "vllm-1"), "127.0.0.1", 1, seq=3)


def test_each_group_on_a_host_has_one_relay_and_the_first_trainer_ranks_host_relays_no_manifest():
    got = {r: roles(PLAN, HOSTS, r) for r in range(PLAN.world_size)}
    assert got == {
        0: Roles(trainers_to=(1,)),  # its host reads the manifest on its host board: no manifest relayed
        1: Roles(trainers_from=0),
        2: Roles(manifest_to=(3,), trainers_to=(3,)),  # B's trainer ranks: one ready key, the record handed on
        3: Roles(manifest_from=2, trainers_from=2),
        4: Roles(manifest_to=(5,), receivers_to=(5,), outcome_to=(5,)),  # vllm-0 on C: reads for 5, gathers its outcome
        5: Roles(manifest_from=4, receivers_from=4, outcome_from=4),
        6: Roles(),  # vllm-1's rank on C waits for no rank of vllm-0 (engines may be updated one after another)
        7: Roles(),
    }
    assert not got[6] and not got[7] and all(got[r] for r in range(6))
    assert roles(PLAN, {k: v for k, v in HOSTS.items() if k != ("vllm-0", 1)}, 5) == Roles()  # no host known


def _relays(channel: VersionChannel, ranks, made: list) -> dict[int, HostRelay]:
    relays = {r: HostRelay(roles(PLAN, HOSTS, r), r, channel.secret) for r in ranks}
    made.extend(relays.values())
    return relays


class _Reads:
    """A channel connection that counts its waits (reads from the channel's host)."""

    def __init__(self, channel: VersionChannel):
        self.channel, self.reads, self.secret = channel, 0, channel.secret

    def wait(self, names, timeout):
        self.reads += 1
        return self.channel.wait(names, timeout)


def test_a_relay_reads_the_manifest_once_for_its_host(made):
    channel = VersionChannel.host()
    relays = _relays(channel, (2, 3), made)
    doc = {"version": "v1", "seq": 3, "sources": ["trainer"]}
    channel.put(keys.channel_manifest("v1"), doc)
    conns = {r: _Reads(channel) for r in relays}
    assert channel_manifest(conns[2], relays[2], "v1", 2.0) == doc
    assert channel_manifest(conns[2], relays[2], "v1", 2.0) == doc  # read again: not handed on again
    assert channel_manifest(conns[3], relays[3], "v1", 2.0) == doc
    assert conns[3].reads == 0  # heard, not read
    with pytest.raises(RelayTimeout):  # once only
        relays[3].manifest("v1", 0.05)
    assert conns[2].reads == 2


def test_a_datagram_without_the_secret_or_of_another_version_is_dropped(caplog, made):
    channel = VersionChannel.host()
    relays = _relays(channel, (4, 5), made)
    forger = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    made.append(forger)
    payload = json.dumps({"kind": "manifest", "version": "v1", "doc": {"version": "v1", "forged": True}}).encode()
    forger.sendto(b"0" * 64 + payload, relay.address(channel.secret, 5))  # reaches it: no secret, no MAC
    relays[4].forward_manifest("v0", {"version": "v0", "seq": 1})  # an older version's
    with pytest.raises(RelayTimeout):
        relays[5].manifest("v1", 0.1)
    assert "fails its check" in caplog.text
    relays[4].forward_manifest("v1", {"version": "v1", "seq": 2})
    assert relays[5].manifest("v1", 1.0) == {"version": "v1", "seq": 2}


def test_a_rank_whose_relay_says_nothing_reads_the_channel_after_its_slice(made):
    channel = VersionChannel.host()
    peer = _relays(channel, (5,), made)[5]  # its relay (4) never runs
    doc = {"version": "v1", "seq": 3}
    channel.put(keys.channel_manifest("v1"), doc)
    conn = _Reads(channel)
    started = time.monotonic()
    assert channel_manifest(conn, peer, "v1", 0.2) == doc
    assert conn.reads == 1 and 0.15 < time.monotonic() - started < 2.0


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


def test_a_trainer_relay_hands_the_record_to_its_hosts_trainer_ranks(monkeypatch, made):
    channel = VersionChannel.host()
    relays = _relays(channel, (0, 1), made)
    monkeypatch.setattr(outcomes, "LIVENESS_SECONDS", 0.1)
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


def test_an_other_versions_record_is_not_taken(monkeypatch, made):
    channel = VersionChannel.host()
    relays = _relays(channel, (0, 1), made)
    monkeypatch.setattr(outcomes, "LIVENESS_SECONDS", 0.1)
    relays[0].forward_outcomes("v1", 2, {"failed": {}, "silent": []})  # a failed earlier attempt's count
    got = outcomes.collect(PLAN, _Record(), MANIFEST, time.monotonic() + 0.3, rank=1, relay=relays[1])
    assert all(o is None for o in got.values())


def _relayed(channel: VersionChannel, ranks, made: list):
    """Each rank's signals through its host's relays (conftest's ``relayed_signals``)."""
    return relayed_signals(PLAN, {who: (host, 1, None) for who, host in HOSTS.items()}, channel, ranks, made)


def _senders(rank: int):
    """The ranks receiving rank ``rank`` reads from, as a pull transport's receiver finds them."""
    return [PLAN.ranks[p] for p in sorted({s.peer for s in PLAN.schedule(rank) if s.op == "recv"})]


class _Counting:
    """Counts a channel connection's operations that reach the channel's host."""

    def __init__(self, channel: VersionChannel):
        self.channel, self.ops = channel, 0
        self.secret, self.address = channel.secret, channel.address

    def put(self, key, value):
        self.ops += 1
        return self.channel.put(key, value)

    def wait(self, names, timeout):
        self.ops += 1
        return self.channel.wait(names, timeout)


def test_ready_signals_go_once_a_host_and_are_read_once_a_host(made):
    import threading

    channel = VersionChannel.host()
    groups, signals = _relayed(channel, range(PLAN.world_size), made)
    for s in signals.values():
        s.channel = _Counting(s.channel)
    trainers = [r for r in PLAN.ranks if r.role.value == "trainer"]
    generations = {0: 3, 1: 5, 2: 1, 3: 2}
    got, errors = {}, []

    def say(rank):
        signals[rank].ready("ipc", MANIFEST, PLAN.ranks[rank], generations[rank])

    def hear(rank):
        try:
            got[rank] = signals[rank].wait_ready("ipc", MANIFEST, _senders(rank), 10.0)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append((rank, e))

    threads = [threading.Thread(target=hear, args=(r,)) for r in (4, 5, 6, 7)]
    threads += [threading.Thread(target=say, args=(r,)) for r in (1, 2, 3, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and all(got[r] == [generations[s.rank] for s in _senders(r)] for r in (4, 5, 6, 7)), got
    # trainer ranks 0 and 1 share host A, 2 and 3 host B: one key a host, put by the lowest
    assert channel.get(keys.host_ready("ipc", "v1", 3, 0)) == [3, 5]  # its host's trainer ranks' in order
    assert channel.get(keys.host_ready("ipc", "v1", 3, 2)) == [1, 2]
    assert channel.get(keys.ready("ipc", "v1", 3, "trainer", 1)) is None
    # the first trainer rank (0) puts its host's key, reads every host's once all are there and puts them in one key
    # (on every lane of the channel): three operations; the other hosts' leads one
    assert channel.get(keys.all_ready("ipc", "v1", 3)) == [3, 5, 1, 2]  # the plan's trainer ranks' in order
    assert [signals[r].channel.ops for r in range(4)] == [3, 0, 1, 0]
    # vllm-0's ranks share host C: 4 reads that key once and hands its senders' on, 5 reads nothing; vllm-1's rank on
    # C reads it itself (another engine's ranks are no group of its)
    assert [signals[r].channel.ops for r in (4, 5, 6, 7)] == [1, 0, 1, 1]
    # what the writer drops once the version is old: exactly what was put
    own, leads = groups.ready_keys([r.rank for r in trainers])
    assert (own, leads) == ([], [0, 2])
    names = keys.channel_signals("v1", 3, [], [], ["ipc"], leads, everyone=groups.relays_ready)
    assert sorted(n for n in names if "ready/" in n) == [
        keys.all_ready("ipc", "v1", 3),
        keys.host_ready("ipc", "v1", 3, 0),
        keys.host_ready("ipc", "v1", 3, 2),
    ]
    assert all(channel.get(n) is not None for n in names if "ready/" in n)


def test_a_trainer_rank_whose_lead_does_not_listen_fails_its_version(made):
    from awex.transport.base import TransferError

    channel = VersionChannel.host()
    _, signals = _relayed(channel, (1,), made)  # its lead (0) never made its relay
    with pytest.raises(TransferError, match="could not tell its host's lead"):
        signals[1].ready("ipc", MANIFEST, PLAN.ranks[1], 1)


def test_a_hosts_key_vouches_for_its_own_hosts_ranks_only(made, caplog):
    # a host's key holds its trainer ranks' generations in their order: one that holds more (written with the secret,
    # by a rank that should not: a generation for another host's rank) or a value that is no generation vouches for
    # nothing of it; the first trainer rank leaves those ranks out at the timeout, and their receivers fail
    from dataclasses import replace

    from awex.engines.sync.channel import ChannelTimeout
    from awex.engines.sync.options import SyncOptions

    manifest = replace(MANIFEST, options=SyncOptions(timeout=0.3))
    channel = VersionChannel.host()
    _, signals = _relayed(channel, (0, 7), made)
    channel.put(keys.host_ready("ipc", "v1", 3, 0), [3, 5, 9])
    channel.put(keys.host_ready("ipc", "v1", 3, 2), [1, "2"])
    signals[0]._all_ready("ipc", manifest)
    assert channel.get(keys.all_ready("ipc", "v1", 3)) == [None, None, 1, "2"]  # what it holds, passed on as it is
    trainers = [r for r in PLAN.ranks if r.role.value == "trainer"]
    with pytest.raises(ChannelTimeout, match=r"sync ranks \[0, 1\] did not say"):
        signals[7].wait_ready("ipc", manifest, trainers, 1.0)
    # a value that is no generation: the receiver's link refuses it before any byte moves
    link = SyncPeerLink(PLAN, 7, signals[7], None, manifest, "ipc", {})
    with pytest.raises(AwexValueError, match="trainer:3 for 'v1': '2' is not an export generation"):
        link.await_ready([3], time.monotonic() + 1.0)
    channel.put(keys.host_ready("ipc", "v1", 3, 0), [3, 5])
    channel.put(keys.host_ready("ipc", "v1", 3, 2), [1, 2])
    signals[0]._all_ready("ipc", manifest)
    assert signals[7].wait_ready("ipc", manifest, trainers, 1.0) == [3, 5, 1, 2]


def test_a_trainer_rank_silent_past_the_timeout_fails_its_receivers_only(made, caplog):
    # host B's key never comes: at the sync's timeout the first trainer rank puts the generations it has; a receiver
    # whose senders are all there goes on, one that reads from host B fails its wait naming them (no false success)
    from dataclasses import replace

    from awex.engines.sync.channel import ChannelTimeout
    from awex.engines.sync.options import SyncOptions

    manifest = replace(MANIFEST, options=SyncOptions(timeout=0.3))
    channel = VersionChannel.host()
    _, signals = _relayed(channel, (0, 4, 7), made)
    channel.put(keys.host_ready("ipc", "v1", 3, 0), [3, 5])
    started = time.monotonic()
    signals[0]._all_ready("ipc", manifest)
    assert 0.25 < time.monotonic() - started < 5.0 and "did not say 'v1' ready" in caplog.text
    assert channel.get(keys.all_ready("ipc", "v1", 3)) == [3, 5, None, None]
    on_a = [PLAN.ranks[0], PLAN.ranks[1]]
    assert signals[7].wait_ready("ipc", manifest, on_a, 1.0) == [3, 5]
    with pytest.raises(ChannelTimeout, match=r"sync ranks \[2, 3\] did not say 'v1' ready"):
        signals[4].wait_ready("ipc", manifest, _senders(4), 1.0)


def test_a_receiver_whose_lead_says_nothing_reads_its_senders_ready_signals_after_a_slice(made):
    channel = VersionChannel.host()
    _, signals = _relayed(channel, (0, 5), made)  # its lead (4) never reads for it (failed before, say)
    channel.put(keys.host_ready("ipc", "v1", 3, 0), [3, 5])
    channel.put(keys.host_ready("ipc", "v1", 3, 2), [1, 2])
    signals[0]._all_ready("ipc", MANIFEST)
    started = time.monotonic()
    generations = {0: 3, 1: 5, 2: 1, 3: 2}
    assert signals[5].wait_ready("ipc", MANIFEST, _senders(5), 0.3) == [generations[s.rank] for s in _senders(5)]
    assert 0.25 < time.monotonic() - started < 5.0  # one slice, then its own read
