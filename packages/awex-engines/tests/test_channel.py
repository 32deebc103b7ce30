"""The version channel: values put by one connection are awaited by another; waits end at their deadline;
a channel whose host is gone fails fast; every value carries a MAC under a secret that is in no key and on no
value, so a process that reaches the port without the secret cannot put a value anyone takes; the store listens
on the address it was given only."""

import json
import logging
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from awex.engines.sync.channel import FD_MARGIN, ChannelError, ChannelTimeout, VersionChannel, open_files_for
from awex.transport.net import local_address


def _raw(address: str) -> dist.TCPStore:
    """A connection to the channel's store as any process that reaches its port has one: no secret."""
    host, _, port = address.rpartition(":")
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=5))


def test_put_wait_and_a_wrong_secret_takes_nothing():
    host = VersionChannel.host()
    other = VersionChannel.connect(host.address, host.secret)
    other.put("manifest/v1", {"version": "v1"})
    assert host.wait(["manifest/v1"], timeout=5) == [{"version": "v1"}]
    stranger = VersionChannel.connect(host.address, "0" * 64)  # the right address, the wrong secret
    with pytest.raises(ChannelTimeout, match="manifest/v1 arrived .* only as values that fail their check"):
        stranger.wait(["manifest/v1"], timeout=0.2)
    assert stranger.get("manifest/v1") is None
    host.delete(["manifest/v1"])
    with pytest.raises(ChannelTimeout):
        other.wait(["manifest/v1"], timeout=0.2)


class _Counted:
    """A connection to the channel's store that counts the operations that go to its host (setting the connection's
    timeout is local)."""

    def __init__(self, store: dist.TCPStore):
        self._store, self.sent = store, []

    def __getattr__(self, name):
        attr = getattr(self._store, name)
        if name in ("set_timeout", "timeout") or not callable(attr):
            return attr

        def counted(*args, **kwargs):
            self.sent.append(name)
            return attr(*args, **kwargs)

        return counted


def test_a_wait_is_one_round_trip_to_the_host_and_keeps_the_connections_timeout():
    # every version's manifest and ready signals are waited for on the critical path: the store's multi_get waits
    # for its keys itself, so a wait before it was a second round trip for nothing
    host = VersionChannel.host()
    address, port = host.address.rsplit(":", 1)
    store = dist.TCPStore(address, int(port), is_master=False, timeout=timedelta(seconds=7))
    counted = _Counted(store)
    reader = VersionChannel([counted], host.address, host.secret, hosting=False)
    host.put("ready/a", 1)
    threading.Timer(0.2, host.put, ("ready/b", 2)).start()  # arrives while the reader waits
    assert reader.wait(["ready/a", "ready/b"], timeout=5) == [1, 2]
    assert counted.sent == ["multi_get"]
    assert store.timeout == timedelta(seconds=7)  # the connection's other operations keep their own
    started = time.monotonic()
    with pytest.raises(ChannelTimeout, match="ready/c did not arrive"):
        reader.wait(["ready/c"], timeout=0.3)
    assert 0.25 < time.monotonic() - started < 2.0 and store.timeout == timedelta(seconds=7)


def test_a_gone_host_fails_fast():
    host = VersionChannel.host()
    client = VersionChannel.connect(host.address, host.secret)
    host.close()
    del host
    started = time.monotonic()
    with pytest.raises((ChannelError, ChannelTimeout)):
        client.wait(["manifest/v2"], timeout=5)
    assert time.monotonic() - started < 5.5


@pytest.mark.parametrize("forgery", ["plain JSON", "a MAC under another secret", "a real value moved to another key"])
def test_a_forged_value_is_dropped_and_logged_and_the_real_one_taken(forgery, caplog):
    host = VersionChannel.host()
    raw = _raw(host.address)
    key = "outcome/v2/2/eng/0"
    if forgery == "plain JSON":
        raw.set(key, json.dumps({"ok": True}).encode())
    elif forgery == "a MAC under another secret":
        raw.set(key, VersionChannel([None], host.address, "f" * 64, hosting=False)._seal(key, {"ok": True}))
    else:  # a value the writer did sign, for another rank's key
        host.put("outcome/v2/2/eng/1", {"ok": True})
        raw.set(key, raw.get("outcome/v2/2/eng/1"))
    receiver = VersionChannel.connect(host.address, host.secret)
    later = threading.Timer(0.3, receiver.put, (key, {"ok": False, "cause": "load step failed"}))
    later.start()
    with caplog.at_level(logging.WARNING, logger="awex.engines"):
        assert host.wait([key], timeout=5) == [{"ok": False, "cause": "load step failed"}]
    later.join()
    assert "fails its check" in caplog.text
    raw.set(key, json.dumps({"ok": True}).encode())  # after the real one: what is left is nothing anyone takes
    assert host.get(key) is None
    with pytest.raises(ChannelTimeout, match="fail their check"):
        host.wait([key], timeout=0.1)


def test_a_wait_for_many_keys_checks_each_value_and_parses_them_together(caplog):
    # the values of one waited read are parsed in one call: each still arrives as itself, a forged one among them is
    # dropped (and waited for again), one a holder of the secret wrote that is not JSON fails the read, named
    host = VersionChannel.host()
    values = [{"ok": True}, [1, 2], 3, "a,b]", None, [], {"a": [1, {"b": 2}]}, 0.5]
    names = [f"ipc-ready/v1/1/vllm-0/{i}" for i in range(len(values))]
    for name, value in zip(names, values):
        host.put(name, value)
    reader = VersionChannel.connect(host.address, host.secret)
    assert reader.wait(names, timeout=5) == values
    assert reader.wait(names[:1], timeout=5) == values[:1]
    raw = _raw(host.address)
    raw.set(names[1], json.dumps([9]).encode())  # no MAC
    later = threading.Timer(0.3, host.put, (names[1], [1, 2]))
    later.start()
    with caplog.at_level(logging.WARNING, logger="awex.engines"):
        assert reader.wait(names, timeout=5) == values
    later.join()
    assert "fails its check" in caplog.text
    raw.set(names[1], host._mac(names[1], b"[1,") + b"[1,")  # passes its check, is not JSON
    with pytest.raises(ChannelError, match="malformed value"):
        reader.wait(names, timeout=5)


def test_the_secret_is_in_no_key_and_on_no_value():
    host = VersionChannel.host()
    host.put("manifest/v1", {"version": "v1", "port": 5000})
    raw = _raw(host.address)
    assert host.secret.encode() not in raw.get("manifest/v1")
    assert raw.check(["manifest/v1"])  # the key is its name alone
    if hasattr(raw, "list_keys"):
        assert not any(host.secret in k for k in raw.list_keys())


def test_the_channel_listens_on_the_address_it_was_given_only():
    other = local_address("192.0.2.1")  # this host's address on a route out, if it has one
    if other.startswith("127."):
        pytest.skip("this host has no address but loopback")
    host = VersionChannel.host("127.0.0.1")
    port = int(host.address.rpartition(":")[2])
    with socket.create_connection(("127.0.0.1", port), timeout=2):
        pass
    with pytest.raises(OSError):
        socket.create_connection((other, port), timeout=2).close()


def test_lanes_spread_keys_and_keep_those_many_read_on_every_lane():
    """A channel of several lanes: each key on one lane (a hash of its name), the manifest and the trainers' record
    on every lane, each reader reading its own lane's copy; a wait over keys of several lanes gets them all; a delete
    takes a key from wherever it is; an address of lanes no manifest would carry is refused."""
    host = VersionChannel.host(lanes=4)
    assert host.lanes == 4 and host.address.count(",") == 3
    readers = [VersionChannel.connect(host.address, host.secret, home=f"vllm-0:{r}") for r in range(16)]
    assert len({r._home for r in readers}) > 1  # readers spread over the lanes' copies
    ready = [f"ipc-ready/v1/1/host/{lead}" for lead in range(32)]
    for i, key in enumerate(ready):
        host.put(key, i)
    per_lane = [sum(host._lane(lane).check([k]) for k in ready) for lane in range(4)]
    assert sum(per_lane) == 32 and max(per_lane) < 32 and min(per_lane) > 0, per_lane
    host.put("manifest/v1", {"version": "v1"})
    host.put("record/v1/1", {"ok": True})
    assert all(host._lane(lane).check(["manifest/v1", "record/v1/1"]) for lane in range(4))
    for reader in readers:
        assert reader.wait(["manifest/v1", "record/v1/1", *ready], timeout=5) == [
            {"version": "v1"},
            {"ok": True},
            *range(32),
        ]
        assert reader.get("manifest/v1") == {"version": "v1"}
    before = host.num_keys()
    host.delete(["manifest/v1", ready[0]])
    assert host.num_keys() == before - 5 and not host.holds("manifest/v1") and not host.holds(ready[0])
    assert readers[0].holds("record/v1/1") and readers[0].holds(ready[1])
    with pytest.raises(ChannelTimeout, match="ipc-ready/v1/1/host/0 did not arrive"):
        readers[1].wait([ready[1], ready[0]], timeout=0.3)
    with pytest.raises(ChannelError, match="not host:port"):
        VersionChannel.connect("127.0.0.1:1,x", host.secret)
    assert readers[2].wait([], timeout=0.1) == []
    readers[2].close()
    with pytest.raises(ChannelError, match="closed"):
        readers[2].put("manifest/v2", {})


def test_a_reader_joins_a_lane_when_it_first_uses_it():
    host = VersionChannel.host(lanes=8)
    reader = VersionChannel.connect(host.address, host.secret, home="trainer:3")
    assert sum(s is not None for s in reader._stores) == 1  # its home lane
    host.put("manifest/v1", {"version": "v1"})
    assert reader.wait(["manifest/v1"], timeout=5) == [{"version": "v1"}]
    assert sum(s is not None for s in reader._stores) == 1  # read on its home lane
    key = next(
        f"outcome/v1/1/vllm-0/{r}" for r in range(64) if host._lane_of(f"outcome/v1/1/vllm-0/{r}") != reader._home
    )
    reader.put(key, {"ok": True})
    assert sum(s is not None for s in reader._stores) == 2 and host.wait([key], timeout=5) == [{"ok": True}]


class _Limits:
    """Open-file limits as ``resource`` keeps them, for :func:`open_files_for` to read and raise."""

    def __init__(self, soft: int, hard: int, settable: bool = True):
        self.soft, self.hard, self.settable, self.set_to = soft, hard, settable, None

    def get(self, _which):
        return self.soft, self.hard

    def set(self, _which, limits):
        if not self.settable:
            raise ValueError("not allowed")
        self.set_to = limits
        self.soft = limits[0]


def test_the_hosting_process_makes_room_for_every_ranks_connections(caplog):
    """A soft open-file limit below what the ranks' connections need is raised (up to the hard limit); where the hard
    limit is short too, or may not be raised, the log says how many connections are expected and what to do."""
    import os

    held = len(os.listdir("/proc/self/fd"))
    room = _Limits(1024, 1 << 20)
    assert open_files_for(4000, (room.get, room.set)) >= held + 4000 + FD_MARGIN - 8  # (files opened meanwhile)
    assert room.set_to is not None and room.set_to[1] == 1 << 20
    enough = _Limits(1 << 20, 1 << 20)
    assert open_files_for(4000, (enough.get, enough.set)) == 1 << 20 and enough.set_to is None  # nothing to do
    short = _Limits(1024, 2048)
    with caplog.at_level(logging.WARNING, logger="awex.engines"):
        assert open_files_for(4000, (short.get, short.set)) == 2048  # as far as it goes
    assert "up to 4000 ranks' connections expected" in caplog.text and "ulimit -n" in caplog.text
    caplog.clear()
    stuck = _Limits(1024, 1 << 20, settable=False)
    with caplog.at_level(logging.WARNING, logger="awex.engines"):
        assert open_files_for(4000, (stuck.get, stuck.set)) == 1024
    assert "could not raise the open-file limit" in caplog.text and "ulimit -n" in caplog.text
