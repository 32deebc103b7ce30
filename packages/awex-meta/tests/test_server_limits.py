"""MetaServer hardening: restarts noticed (epoch), retried writes applied once, deadlines that hold, limits that
answer 4xx, waiters woken only by what they wait on, connection and body-read limits, CLI refusals."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from awex.meta import client as client_module
from awex.meta.client import SLACK, MetaClient
from awex.meta.errors import (
    MetaNotRegisteredError,
    MetaPayloadError,
    MetaRestartError,
    MetaTimeoutError,
)
from awex.meta.protocol import EPOCH_HEADER, REQUEST_ID_HEADER
from awex.meta.server import EmbeddedMetaServer, ServerConfig, start_embedded
from awex.meta.server.errors import json_depth
from awex.meta.server.state import Topics


def _raw(address: str, method: str, path: str, body=None, headers=None) -> tuple[int, dict, dict]:
    host, port = address.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    data = json.dumps(body).encode() if body is not None else None
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read() or b"null"), dict(resp.getheaders())
    conn.close()
    return out


def test_a_restart_is_noticed_and_what_the_client_owns_is_published_again():
    first = start_embedded()
    port = first.port
    c = MetaClient(first.address, job="rl", timeout=5)
    c.register("vllm-0", role="inference", instance="vllm-0", world_size=2)
    c.put("layouts/current/vllm-0", {"layout": 1}, keep=True)
    c.put("scratch", 1)  # not kept: gone with the server
    after = c.publish_event("weights_ready", "trainer", version="v1")
    epoch = c.epoch
    first.stop()
    second = start_embedded(port=port)
    try:
        # the report lands although the new server never saw the registration (it used to be dropped: 404)
        c.report_version("vllm-0", "v2")
        assert c.epoch != epoch and c.restarts == 1
        status = c.status()["jobs"]["rl"]
        assert [(p["name"], p["weight_version"]) for p in status["participants"]] == [("vllm-0", "v2")]
        assert c.try_get("layouts/current/vllm-0") == {"layout": 1} and c.try_get("scratch") is None
        # event numbers began again: a waiter for events after the old number is told, not left waiting, even
        # through the client that already noticed the restart (c) and one that never saw the first server
        for waiter in (c, MetaClient(second.address, job="rl", timeout=5)):
            with pytest.raises(MetaRestartError, match="restarted"):
                waiter.events(after=after, timeout=1.0)
            with pytest.raises(MetaRestartError, match="restarted"):
                waiter.wait_event("weights_ready", after=after, timeout=1.0)
        # a cursor of the new server is fine; one of another job is not this job's
        now = c.publish_event("weights_ready", "trainer", version="v2")
        assert [e["version"] for e in c.events(after=now - 1)] == ["v2"] and c.events(after=now) == []
        with pytest.raises(MetaRestartError):
            MetaClient(second.address, job="other", timeout=5).events(after=now, timeout=0.5)
    finally:
        second.stop()


def test_a_retried_write_is_answered_once_and_not_applied_twice():
    with EmbeddedMetaServer() as s:
        rid = {REQUEST_ID_HEADER: "a" * 24}
        first = _raw(s.address, "PUT", "/v1/jobs/j/kv/sync/v1?create=1", {"m": 1}, rid)
        again = _raw(s.address, "PUT", "/v1/jobs/j/kv/sync/v1?create=1", {"m": 1}, rid)
        assert first[0] == again[0] == 200  # the create-only put does not conflict with itself
        other = _raw(s.address, "PUT", "/v1/jobs/j/kv/sync/v1?create=1", {"m": 2}, {REQUEST_ID_HEADER: "b" * 24})
        assert other[0] == 409
        ev = {REQUEST_ID_HEADER: "c" * 24}
        one = _raw(s.address, "POST", "/v1/jobs/j/events", {"kind": "sync_failed", "source": "x"}, ev)
        two = _raw(s.address, "POST", "/v1/jobs/j/events", {"kind": "sync_failed", "source": "x"}, ev)
        assert one[1]["seq"] == two[1]["seq"]
        assert len(MetaClient(s.address, job="j").events(kind="sync_failed")) == 1
        assert (
            _raw(s.address, "POST", "/v1/jobs/j/events", {"kind": "k", "source": "x"}, {REQUEST_ID_HEADER: "no"})[0]
            == 400
        )


class _FrozenServer:
    """Accepts connections and never answers (a MetaServer stopped with SIGSTOP, as seen from a client)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.address = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def close(self):
        self.sock.close()


@pytest.mark.parametrize("call", ["get", "put", "events", "agree"])
def test_waits_against_a_frozen_server_raise_within_their_deadline(call):
    frozen = _FrozenServer()
    try:
        c = MetaClient(frozen.address, job="j", timeout=1.5)
        started = time.monotonic()
        with pytest.raises(MetaTimeoutError):
            {
                "get": lambda: c.get("k", timeout=1.5),
                "put": lambda: c.put("k", 1),
                "events": lambda: c.events(timeout=1.5) or (_ for _ in ()).throw(MetaTimeoutError("none")),
                "agree": lambda: c.agree("a", "p", 2, 1, timeout=1.5),
            }[call]()
        assert time.monotonic() - started < 1.5 + SLACK + 0.5  # it used to take the wait plus 10-15 s
    finally:
        frozen.close()


@pytest.mark.heavy  # minutes on 2 cores: once per CI run, not again under tox
def test_a_wait_outlives_a_server_outage_longer_than_one_long_poll(monkeypatch):
    monkeypatch.setattr(client_module, "_POLL_SLICE", 0.5)
    first = start_embedded()
    port = first.port
    c = MetaClient(f"http://127.0.0.1:{port}", job="j", timeout=30)
    c.health()  # reached once: refusals from now on are an outage, waited out (a server never reached is not)
    first.stop()  # down for longer than a long-poll slice plus the old per-request allowance (10 s)
    found: list = []
    t = threading.Thread(target=lambda: found.append(c.get("k", timeout=25)))
    t.start()
    time.sleep(12)
    second = start_embedded(port=port)
    try:
        MetaClient(second.address, job="j").put("k", "here")
        t.join(10)
        assert found == ["here"]
    finally:
        second.stop()


def test_limits_answer_4xx_and_leave_the_server_healthy():
    config = ServerConfig(
        max_job_bytes=20_000,
        max_total_bytes=30_000,
        max_small_bytes=1_000,
        max_depth=16,
        max_agreements_per_job=3,
        max_participants_per_job=2,
        max_agreement_size=8,
    )
    with EmbeddedMetaServer(config=config) as s:
        c = MetaClient(s.address, job="j", timeout=5)
        c.put("a", "x" * 8_000)
        c.put("b", "x" * 8_000)
        with pytest.raises(MetaPayloadError, match="would hold more than 20000 bytes"):
            c.put("c", "x" * 8_000)
        c.put("a", "x" * 100)  # replacing a value frees what it held
        c.put("c", "x" * 8_000)
        d = MetaClient(s.address, job="k", timeout=5)
        d.put("a", "x" * 8_000)
        with pytest.raises(MetaPayloadError, match="more than 30000 bytes in all"):
            d.put("b", "x" * 8_000)
        with pytest.raises(MetaPayloadError, match="event's data"):
            c.publish_event("k", "src", data="x" * 2_000)
        nested: object = 1
        for _ in range(40):
            nested = [nested]
        with pytest.raises(MetaPayloadError, match="deeper than 16"):
            c.publish_event("k", "src", data=nested)
        with pytest.raises(MetaPayloadError, match="deeper than 16"):
            c.put("deep", nested)
        c.put("wide", [{"a": [i]} for i in range(100)])  # brackets aplenty, three deep
        exactly: object = 1
        for _ in range(16):
            exactly = [exactly]
        c.put("sixteen", exactly)  # as deep as allowed, as few brackets as that takes
        with pytest.raises(MetaPayloadError, match="deeper than 16"):
            c.put("seventeen", [exactly])
        deepest = b"[" * 5000 + b"1" + b"]" * 5000  # deeper than the JSON parser's recursion limit
        with pytest.raises(MetaPayloadError, match="deeper than 16"):
            c._request("PUT", c._job_path("kv", "deeper"), raw=deepest, deadline=time.monotonic() + 5)
        with pytest.raises(MetaPayloadError, match="non-empty strings"):
            c.forget(names=[["x"]])  # used to answer 500
        for i in range(3):
            c.agree(f"plan/v{i}", "r0", 1, "d", timeout=1)
        with pytest.raises(MetaPayloadError, match="too many agreements"):
            c.agree("plan/v9", "r0", 1, "d", timeout=1)
        with pytest.raises(MetaPayloadError, match="expected must be 1 to 8"):
            c.agree("plan/v0", "r0", 9, "d", timeout=1)
        c.register("p0", role="trainer", instance="t")
        c.register("p1", role="trainer", instance="t")
        c.register("p1", role="trainer", instance="t")  # registering again is fine
        with pytest.raises(MetaPayloadError, match="too many participants"):
            c.register("p2", role="trainer", instance="t")
        status = c.status()  # still answers, small
        assert set(status["jobs"]) == {"j", "k"}
        assert len(json.dumps(status)) < 20_000


def test_reads_do_not_create_jobs_and_a_wait_on_a_new_job_wakes_when_it_appears():
    with EmbeddedMetaServer() as s:
        c = MetaClient(s.address, job="later", timeout=5)
        assert c.try_get("k") is None and c.keys() == [] and c.events() == []
        assert c.status()["jobs"] == {}
        threading.Timer(0.3, lambda: MetaClient(s.address, job="later").put("k", 7)).start()
        started = time.monotonic()
        assert c.get("k", timeout=4) == 7
        assert time.monotonic() - started < 2.0


def test_a_write_wakes_only_the_waiters_of_its_topic():
    async def main():
        topics = Topics()
        checks = {"a": 0, "b": 0}
        state = {"a": False}

        def ready(name):
            def predicate():
                checks[name] += 1
                return state.get(name, False)

            return predicate

        wait_a = asyncio.ensure_future(topics.wait_until("a", ready("a"), 2.0))
        wait_b = asyncio.ensure_future(topics.wait_until("b", ready("b"), 0.5))
        await asyncio.sleep(0.05)
        for _ in range(50):
            topics.fire("c")  # unrelated writes
        state["a"] = True
        topics.fire("a")
        assert await wait_a is True
        assert await wait_b is False
        assert checks["b"] == 2  # once on entry, once at its deadline: never woken by the other topics
        assert topics.waiting() == 0

    asyncio.run(main())


def test_connections_beyond_the_limits_are_answered_503_with_a_retry_hint_and_idle_ones_time_out():
    config = ServerConfig(max_connections=8, max_connections_per_client=6, idle_seconds=1.0)
    with EmbeddedMetaServer(config=config) as s:
        socks = []
        for _ in range(24):  # one at a time (a burst may overshoot the limit by what one accept round takes)
            socks.append(socket.create_connection(("127.0.0.1", s.port)))
            time.sleep(0.02)
        answers = []
        for sock in socks:
            sock.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\n")
            sock.settimeout(5)
            answers.append(sock.recv(65536))
        refused = [a for a in answers if a.startswith(b"HTTP/1.1 503")]
        assert len(refused) == 18 and all(a.startswith(b"HTTP/1.1 200") for a in answers if a not in refused)
        doc = json.loads(refused[0].split(b"\r\n\r\n", 1)[1])  # not a silent close: why, and when to retry
        assert doc["error"] == "overloaded" and "127.0.0.1 (limit 6)" in doc["message"] and 0 < doc["retry_after"] < 2
        time.sleep(1.5)  # the idle ones (no request in flight) are closed too: a client gets in again
        assert MetaClient(s.address, timeout=5).health()["ok"] is True
        for sock in socks:
            sock.close()


def test_a_connection_refused_without_a_request_is_closed_after_a_while():
    from awex.meta.server import site

    with EmbeddedMetaServer(config=ServerConfig(max_connections=1, max_connections_per_client=1)) as s:
        first = socket.create_connection(("127.0.0.1", s.port))
        time.sleep(0.1)
        second = socket.create_connection(("127.0.0.1", s.port))  # refused, never asks anything
        second.settimeout(site.REFUSED_WAIT + 3)
        started = time.monotonic()
        assert second.recv(1) == b"" and time.monotonic() - started < site.REFUSED_WAIT + 2
        first.close()
        second.close()


def test_a_body_that_never_arrives_is_refused_within_the_body_time():
    with EmbeddedMetaServer(config=ServerConfig(body_seconds=1.0)) as s:
        sock = socket.create_connection(("127.0.0.1", s.port))
        sock.sendall(
            b"PUT /v1/jobs/j/kv/k HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"a":'
        )
        sock.settimeout(5)
        started = time.monotonic()
        answer = sock.recv(4096)
        assert b"400" in answer.split(b"\r\n", 1)[0] and b"did not arrive" in answer
        assert time.monotonic() - started < 3
        sock.close()


@pytest.mark.parametrize("split", [None, 5], ids=["with-the-headers", "after-them"])
def test_a_body_is_read_whole_whether_it_came_with_the_headers_or_after_them(split):
    """A small body usually arrives with its headers (read at once); one that comes later is waited for, up to the
    body time: both are read whole."""
    body = b'{"value": "' + b"x" * 3000 + b'"}'
    head = b"PUT /v1/jobs/j/kv/k HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += b"Content-Length: %d\r\n\r\n" % len(body)
    with EmbeddedMetaServer(config=ServerConfig(body_seconds=5.0)) as s:
        sock = socket.create_connection(("127.0.0.1", s.port))
        if split is None:
            sock.sendall(head + body)
        else:
            sock.sendall(head + body[:split])
            time.sleep(0.3)
            sock.sendall(body[split:])
        sock.settimeout(5)
        assert b" 200 " in sock.recv(4096).split(b"\r\n", 1)[0]
        sock.close()
        assert MetaClient(s.address, job="j").get("k") == {"value": "x" * 3000}


def test_every_answer_names_the_server_epoch():
    with EmbeddedMetaServer() as s:
        status, doc, headers = _raw(s.address, "GET", "/v1/health")
        assert status == 200 and headers[EPOCH_HEADER] == doc["epoch"] and len(doc["epoch"]) == 16
        assert _raw(s.address, "GET", "/v1/jobs/bad%20name/keys")[2][EPOCH_HEADER] == doc["epoch"]


def test_cli_refuses_an_open_address_without_a_token_and_a_busy_port_cleanly(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "awex.meta.cli", "serve", "--host", "0.0.0.0", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "without a token" in out.stderr and "Traceback" not in out.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        out = subprocess.run(
            [sys.executable, "-m", "awex.meta.cli", "serve", "--port", str(busy.getsockname()[1])],
            env={**os.environ, "AWEX_STATE_DIR": str(tmp_path)},  # its journal (default) goes there
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert out.returncode == 2 and "cannot listen on 127.0.0.1" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.splitlines()) <= 3


def test_report_version_of_an_unknown_participant_raises():
    with EmbeddedMetaServer() as s:
        with pytest.raises(MetaNotRegisteredError, match="not registered"):  # the writer re-registers on it
            MetaClient(s.address, job="j", timeout=5).report_version("ghost", "v1")


def test_the_route_table_in_the_docs_lists_every_route():
    import re

    from awex.meta.server import app

    def shape(path: str) -> str:  # placeholders named alike
        return re.sub(r"\{[a-z]+(:[^}]*)?\}", "{}", path)

    documented = {(m, shape(p)) for m, p in re.findall(r"``(GET|PUT|POST|DELETE) (/v1/[^` \[?]+)", app.__doc__)}
    assert documented == {(m, shape(p)) for m, p, _ in app.ROUTES}


def test_a_reported_version_carries_its_bytes_and_seconds_into_the_status():
    with EmbeddedMetaServer() as s:
        c = MetaClient(s.address, job="j", timeout=5)
        c.register("vllm-0", role="inference", instance="vllm-0")
        c.report_version("vllm-0", "v1", nbytes=1234, seconds=0.5)
        c.register("vllm-0", role="inference", instance="vllm-0")  # registering again keeps it
        (p,) = c.status()["jobs"]["j"]["participants"]
        assert p["weight_version"] == "v1"
        assert p["last_sync"]["version"] == "v1" and p["last_sync"]["bytes"] == 1234
        assert p["last_sync"]["seconds"] == 0.5 and p["last_sync"]["at"] > 0
        c.report_version("vllm-0", None)  # a failed version: no bytes claimed
        (p,) = c.status()["jobs"]["j"]["participants"]
        assert p["last_sync"] == {"version": None, "at": p["last_sync"]["at"]}
        path = "/v1/jobs/j/participants/vllm-0/version"
        for bad in (
            {"version": "v2", "bytes": "12"},
            {"version": "v2", "seconds": "1"},
            {"version": "v2", "bytes": True},
        ):
            status, doc, _ = _raw(s.address, "POST", path, bad)
            assert status == 400 and "wrong type" in doc["message"], (bad, doc)


def test_the_status_of_every_job_stays_small_and_one_job_is_told_in_full():
    """Every job: each with its first participants (``status_participants``), without their info, and how many it
    has; ``?job=``: that job, every participant with its info."""
    with EmbeddedMetaServer(config=ServerConfig(status_participants=3)) as s:
        c = MetaClient(s.address, job="big", timeout=5)
        for i in range(5):
            c.register(f"eng-{i}", role="inference", instance=f"eng-{i}", info={"devices": ["x" * 1000]})
        MetaClient(s.address, job="small", timeout=5).register("t", role="trainer", instance="t")
        every = c.status()["jobs"]
        assert [p["name"] for p in every["big"]["participants"]] == ["eng-0", "eng-1", "eng-2"]
        assert every["big"]["participants_total"] == 5 and "info" not in every["big"]["participants"][0]
        assert every["small"]["participants_total"] == 1
        one = c.status(job="big")["jobs"]
        assert list(one) == ["big"] and len(one["big"]["participants"]) == 5
        assert one["big"]["participants"][4]["info"] == {"devices": ["x" * 1000]}
        assert c.status(job="none")["jobs"] == {}


def _depth_oracle(doc) -> int:
    """The nesting depth by its definition (recursive; a scalar is 0)."""
    children = doc.values() if isinstance(doc, dict) else doc if isinstance(doc, list) else None
    return 0 if children is None else 1 + max((_depth_oracle(c) for c in children), default=0)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=2), inner, max_size=4),
    max_leaves=40,
)


@given(doc=_json, limit=st.integers(0, 8))
def test_json_depth_is_the_nesting_depth_and_stops_past_its_limit(doc, limit):
    deep = _depth_oracle(doc)
    assert json_depth(doc) == deep
    capped = json_depth(doc, limit)
    assert capped == deep if deep <= limit else capped == limit + 1  # past the limit: limit + 1, never walked on
