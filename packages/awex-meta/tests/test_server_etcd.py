"""Several MetaServers on one etcd cluster of three (``awex-meta serve --store etcd://...``): one leads and listens,
the others stand by; when the leader dies another takes over with every fence, claim and served version, and
clients given every address follow; a leader frozen past its lease answers nothing once it wakes and stops; losing
one etcd member of three changes nothing. Real etcd processes (``etcd_cluster``), real server processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from test_server import _free_port
from test_server_journal import _status

from awex.meta.client import MetaClient
from awex.meta.errors import MetaConflictError, MetaConnectionError, MetaFencedError, MetaServerError
from awex.meta.server import start_embedded

TTL = 2  # seconds a dead leader keeps the lead


def _serve(url: str, port: int) -> subprocess.Popen:
    args = [sys.executable, "-m", "awex.meta.cli", "serve", "--port", str(port), "--store", url]
    args += ["--leader-ttl", str(TTL)]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _listens(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _until(what, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "not within the deadline"
        time.sleep(0.05)


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(10)


@pytest.fixture
def two_servers(etcd_cluster):
    """Two server processes on one etcd: the first leads (listening), the second stands by (not listening)."""
    url = etcd_cluster.url()
    ports = [_free_port(), _free_port()]
    first = _serve(url, ports[0])
    _until(lambda: _listens(ports[0]))
    second = _serve(url, ports[1])
    time.sleep(0.5)
    assert second.poll() is None and not _listens(ports[1])  # standing by
    yield (first, second), ports
    _stop(first, second)


def test_the_standby_takes_over_from_a_dead_leader_and_refuses_what_it_refused(two_servers):
    (first, second), ports = two_servers
    both = ",".join(f"http://127.0.0.1:{p}" for p in ports)
    plain = MetaClient(both, job="rl", timeout=20)
    plain.register("eng", role="inference", instance="eng", world_size=1)
    zombie = plain.fenced("trainer", plain.take_fence("trainer"))
    live = plain.fenced("trainer", plain.take_fence("trainer"))
    live.put("sync/v1", {"by": "live"}, create_only=True)
    live.report_version("eng", "v1", claim="sync/v1")
    live.put("sync/v2", {"by": "live"}, create_only=True)  # claimed, never applied
    first.send_signal(signal.SIGKILL)  # no goodbye: its lead ends with its etcd lease
    assert _status(plain) == {"eng": "v1"}  # answered by the second server, once it leads
    assert _listens(ports[1]) and plain.restarts == 1
    with pytest.raises(MetaFencedError):
        zombie.put("sync/v3", {"by": "zombie"}, create_only=True)
    other = plain.fenced("other", plain.take_fence("other"))
    for name in ("sync/v1", "sync/v2"):
        with pytest.raises(MetaConflictError):
            other.put(name, {"by": "other"}, create_only=True)
    live.put("sync/v2", {"by": "live again"})  # its own writer may still finish the unfinished attempt
    with pytest.raises(MetaConflictError, match="was applied"):
        plain.fenced("trainer", plain.take_fence("trainer")).put("sync/v1", {"by": "third"})
    assert plain.take_fence("trainer") == 4  # epochs go on


def test_a_leader_frozen_past_its_lease_answers_nothing_once_it_wakes_and_stops(two_servers):
    (first, second), ports = two_servers
    only_first = MetaClient(f"http://127.0.0.1:{ports[0]}", job="rl", timeout=3)
    only_first.put("before", 1)
    os.kill(first.pid, signal.SIGSTOP)
    try:
        _until(lambda: _listens(ports[1]))  # the second took the lead
        now = MetaClient(f"http://127.0.0.1:{ports[1]}", job="rl", timeout=10)
        epoch = now.take_fence("trainer")
    finally:
        os.kill(first.pid, signal.SIGCONT)
    with pytest.raises((MetaServerError, MetaConnectionError)):  # 503 standby, or gone: never an answer
        only_first.put("after", 2)
    assert first.wait(15) == 3  # it stopped, saying it lost the lead
    assert "lost the lead" in first.stdout.read()
    assert now.take_fence("trainer") == epoch + 1 and now.try_get("after") is None


def test_losing_one_etcd_member_of_three_changes_nothing(etcd_cluster):
    url = etcd_cluster.url()
    etcd_cluster.stop(0)  # the first endpoint the store tries
    try:
        server = start_embedded(store=url, leader_ttl=TTL)
        c = MetaClient(server.address, job="rl", timeout=10)
        c.register("eng", role="inference", instance="eng")
        writer = c.fenced("trainer", c.take_fence("trainer"))
        writer.put("sync/v1", {"n": 1}, create_only=True)
        writer.report_version("eng", "v1", claim="sync/v1")
        port = server.port
        server.stop()
        server = start_embedded(port=port, store=url, leader_ttl=TTL)  # read back from the two members left
        try:
            assert _status(c) == {"eng": "v1"}
            with pytest.raises(MetaConflictError):
                c.fenced("other", c.take_fence("other")).put("sync/v1", {"n": 2}, create_only=True)
        finally:
            server.stop()
    finally:
        etcd_cluster.start(0)
        etcd_cluster.wait_healthy()


@pytest.mark.parametrize(
    "args,said",
    [
        (["--store", "etcd://no-port-here"], "host:port"),
        (["--store", "http://127.0.0.1:2379"], "etcd://host:port"),
        (["--store", "etcd://127.0.0.1:1", "--journal", "x.journal"], "no --journal or --no-journal"),
        (["--store", "etcd://127.0.0.1:1", "--leader-ttl", "1"], "--leader-ttl 1"),
    ],
)
def test_serve_refuses_a_store_it_cannot_use_before_waiting_for_anything(args, said):
    out = subprocess.run(
        [sys.executable, "-m", "awex.meta.cli", "serve", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and said in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_serve_says_when_etcd_cannot_be_reached():
    port = _free_port()  # nothing listens there
    out = subprocess.run(
        [sys.executable, "-m", "awex.meta.cli", "serve", "--port", "0", "--store", f"etcd://127.0.0.1:{port}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "cannot reach etcd" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_a_client_refuses_an_address_given_twice():
    with pytest.raises(ValueError, match="given twice"):
        MetaClient("http://127.0.0.1:1,127.0.0.1:1")


def test_a_requests_changes_reach_etcd_in_one_transaction_before_its_answer(etcd_cluster):
    from awex.meta.server.app import SERVER_KEY

    url = etcd_cluster.url()
    server = start_embedded(store=url, leader_ttl=TTL)
    try:
        store = server._runner.app[SERVER_KEY].journal
        c = MetaClient(server.address, job="rl", timeout=10)
        names = [f"eng-{i}" for i in range(5)]
        for name in names:
            c.register(name, role="inference", instance=name)
        writer = c.fenced("trainer", c.take_fence("trainer"))
        writer.put("sync/v1", {"n": 1}, create_only=True)
        before = store.transactions
        writer.report_versions({name: {"version": "v1", "claim": "sync/v1"} for name in names})
        assert store.transactions - before == 1  # five served versions and the applied claim: one round trip
        port = server.port
        server.stop()
        server = start_embedded(port=port, store=url, leader_ttl=TTL)
        assert _status(c) == {name: "v1" for name in names}  # all of it was kept
        with pytest.raises(MetaConflictError, match="was applied"):
            c.fenced("trainer", c.take_fence("trainer")).put("sync/v1", {"n": 2})
    finally:
        server.stop()


def test_a_server_that_cannot_keep_a_change_answers_503_and_serves_no_more(etcd_cluster):
    from awex.meta.server.app import SERVER_KEY

    server = start_embedded(store=etcd_cluster.url(), leader_ttl=TTL)
    try:
        store = server._runner.app[SERVER_KEY].journal
        c = MetaClient(server.address, job="rl", timeout=2)
        c.register("eng", role="inference", instance="eng")
        store._revision += 1  # as if another server had taken the lead: the leader key is not this one's
        with pytest.raises(MetaServerError, match="lost the lead|does not lead"):
            c.take_fence("trainer")
        with pytest.raises(MetaServerError, match="does not lead"):  # nothing is answered from now on
            c.try_get("anything")
    finally:
        server.stop()
