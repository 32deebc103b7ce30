"""The MetaServer, embedded and standalone, through the real HTTP client."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from conftest import MODELS

from awex.meta import canonical_tensors, load_config
from awex.meta.client import MetaClient
from awex.meta.errors import (
    AgreementAbortedError,
    AgreementError,
    MetaAuthError,
    MetaConflictError,
    MetaConnectionError,
    MetaPayloadError,
    MetaServerError,
    MetaTimeoutError,
)
from awex.meta.layouts import VllmParallel, vllm_layout
from awex.meta.server import EmbeddedMetaServer, ServerConfig, start_embedded


@pytest.fixture(scope="module")
def server():
    with EmbeddedMetaServer(config=ServerConfig(max_payload_bytes=1 << 20, max_wait_seconds=5.0)) as s:
        yield s


@pytest.fixture
def client(server, request):
    return MetaClient(server.address, job=request.node.name[:60].replace("[", "-").replace("]", ""), timeout=5.0)


def test_embedded_server_starts_on_a_free_loopback_port(server):
    assert server.address.startswith("http://127.0.0.1:")
    assert server.port > 0
    assert MetaClient(server.address).health()["ok"] is True


def test_put_get_delete_and_keys(client):
    client.put("a/b", {"x": [1, 2]})
    assert client.get("a/b") == {"x": [1, 2]}
    assert client.try_get("nope") is None
    assert client.keys("a/") == ["a/b"]
    assert client.delete("a/b") is True
    assert client.try_get("a/b") is None
    client.put("once", 1, create_only=True)
    with pytest.raises(MetaConflictError, match="already exists"):
        client.put("once", 2, create_only=True)


def test_wait_is_a_long_poll_that_wakes_when_the_value_arrives(client):
    threading.Timer(0.3, lambda: client.put("late", "here")).start()
    started = time.monotonic()
    assert client.get("late", timeout=4.0) == "here"
    elapsed = time.monotonic() - started
    assert 0.25 < elapsed < 2.0  # woke on the write, not on a poll interval or the deadline


def test_wait_times_out_with_a_clear_error(client):
    started = time.monotonic()
    with pytest.raises(MetaTimeoutError, match="'never' of job .* did not appear within 0.5 s"):
        client.get("never", timeout=0.5)
    assert time.monotonic() - started < 3.0


def test_layouts_and_rendezvous_round_trip(client):
    tensors = canonical_tensors(load_config(MODELS / "qwen2-tiny.json"))
    layout = vllm_layout(tensors, VllmParallel(tp=2), instance="vllm-0")
    client.publish_layout(layout, version="step-3")
    assert client.fetch_layout("vllm-0", version="step-3", timeout=1.0) == layout
    other = layout.renamed("vllm-1")
    client.publish_layout(other, version="step-3")
    got = client.fetch_layout("vllm-1", version="step-3", timeout=1.0)
    assert got == other and got.instance == "vllm-1"
    assert got.tensors is client.fetch_layout("vllm-0", version="step-3").tensors  # engines alike: decoded once
    got = client.fetch_layouts(["vllm-1", "vllm-0"], version="step-3")
    assert got == {"vllm-1": other, "vllm-0": layout}


def test_participants_versions_events_and_status(client):
    client.register("trainer", role="trainer", instance="trainer", world_size=2)
    client.register("vllm-0", role="inference", instance="vllm-0", world_size=1, info={"tp": 1})
    seq = client.publish_event("sync_started", "trainer", version="step-1")
    client.report_version("vllm-0", "step-1")
    got = client.wait_event("version", after=seq, timeout=2.0)
    assert got["source"] == "vllm-0" and got["version"] == "step-1"
    status = client.status()["jobs"][client.job]
    versions = {p["name"]: p["weight_version"] for p in status["participants"]}
    assert versions == {"trainer": None, "vllm-0": "step-1"}
    assert [e["kind"] for e in status["recent_events"]] == ["register", "register", "sync_started", "version"]
    with pytest.raises(MetaTimeoutError, match="no 'finished' event"):
        client.wait_event("finished", timeout=0.3)


def test_several_versions_are_reported_in_one_request(client):
    for name in ("vllm-0", "vllm-1"):
        client.register(name, role="inference", instance=name, world_size=1)
    reports = {
        "vllm-0": {"version": "v1", "bytes": 10, "seconds": 0.5, "claim": "sync/v1"},
        "vllm-1": {"version": None},
    }
    assert client.report_versions(dict(reports, **{"vllm-9": {"version": "v1"}})) == ["vllm-9"]  # not registered
    status = client.status()["jobs"][client.job]["participants"]
    assert {p["name"]: p["weight_version"] for p in status} == {"vllm-0": "v1", "vllm-1": None}
    with pytest.raises(MetaServerError, match="wrong type"):  # every report checked before any applies
        client.report_versions({"vllm-1": {"version": "v2"}, "vllm-0": {"version": 3}})
    assert {p["name"]: p["weight_version"] for p in client.status()["jobs"][client.job]["participants"]}[
        "vllm-1"
    ] is None


def test_event_wait_wakes_on_publish(client):
    threading.Timer(0.3, lambda: client.publish_event("go", "x")).start()
    started = time.monotonic()
    events = client.events(after=0, kind="go", timeout=4.0)
    assert [e["kind"] for e in events] == ["go"] and time.monotonic() - started < 2.0


def test_agreement_proves_ranks_computed_the_same_plan(client):
    results = {}

    def rank(i, value):
        try:
            results[i] = client.agree("plan/step-1", f"rank{i}", 3, value, timeout=4.0)
        except Exception as e:  # collected and asserted below
            results[i] = e

    threads = [threading.Thread(target=rank, args=(i, "abc")) for i in range(3)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert results == {0: "abc", 1: "abc", 2: "abc"}
    # complete: a value is final (a retry with the same value is answered again; another value is refused)
    assert client.agree("plan/step-1", "rank1", 3, "abc", timeout=4.0) == "abc"
    with pytest.raises(MetaConflictError, match="complete: 'rank1'.s value is final"):
        client.agree("plan/step-1", "rank1", 3, "xyz", timeout=4.0)
    assert client.agree("plan/step-1", "rank2", 3, "abc", timeout=4.0) == "abc"


def test_agreement_mismatch_and_missing_participant():
    with EmbeddedMetaServer() as s:
        c = MetaClient(s.address, job="j", timeout=5.0)
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("r1", _catch(lambda: c.agree("d", "r1", 2, "A", timeout=4))))
        t.start()
        with pytest.raises(AgreementError, match="2 distinct values"):
            c.agree("d", "r0", 2, "B", timeout=4)
        t.join()
        assert isinstance(out["r1"], AgreementError)
        with pytest.raises(MetaTimeoutError, match="1 of 2 participants arrived"):
            c.agree("e", "r0", 2, "A", timeout=0.3)


def test_a_gather_gives_every_participant_every_value_once_all_arrived(client):
    """One request per participant: each gets every participant's value (JSON as given) once all arrived; a
    participant that comes back gets the same answer; an agreement of the same name is not a gather."""
    results = {}
    values = {f"r{i}": {"device": f"GPU-{i}", "reach": [i, i + 1], "cpu": i % 2 == 0} for i in range(5)}

    def rank(name):
        results[name] = _catch(lambda: client.gather("devices/v1/1", name, 5, values[name], timeout=4.0))

    threads = [threading.Thread(target=rank, args=(n,)) for n in values]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert results == {n: values for n in values}
    assert client.gather("devices/v1/1", "r3", 5, values["r3"], timeout=1.0) == values
    with pytest.raises(MetaConflictError, match="is a gather"):
        client.agree("devices/v1/1", "r3", 5, values["r3"], timeout=1.0)
    with pytest.raises(MetaTimeoutError, match="gather 'devices/v2/1': 1 of 2 participants arrived"):
        client.gather("devices/v2/1", "r0", 2, 1, timeout=0.3)


def test_a_participant_that_fails_first_gives_the_agreement_up_for_everyone(client):
    """Participants waiting in a gather (or an agreement) are answered at once when another gives it up, with who
    did and why; one that comes later is too; an abort before anyone contributed holds as well; a complete
    agreement is final: an abort changes nothing there."""
    waiting = {}

    def rank(name):
        waiting[name] = _catch(lambda: client.gather("devices/v3/1", name, 3, {"r": name}, timeout=20.0))

    threads = [threading.Thread(target=rank, args=(n,)) for n in ("r0", "r1")]
    started = time.monotonic()
    [t.start() for t in threads]
    time.sleep(0.3)
    assert client.abort_agreement("devices/v3/1", "vllm-0:2", "ValueError: vllm-0 is not a destination")
    [t.join(10) for t in threads]
    assert time.monotonic() - started < 5.0  # not the 20 s deadline
    for e in waiting.values():
        assert isinstance(e, AgreementAbortedError) and e.by == "vllm-0:2" and "not a destination" in e.cause
    with pytest.raises(AgreementAbortedError, match="given up by vllm-0:2"):
        client.gather("devices/v3/1", "r2", 3, {"r": "r2"}, timeout=5.0)
    assert client.abort_agreement("plan/v3/1", "trainer:1", "boom")  # before anyone: later ones learn it
    with pytest.raises(AgreementAbortedError, match="boom"):
        client.agree("plan/v3/1", "r0", 2, "digest", timeout=5.0)
    client.agree("plan/v4/1", "r0", 1, "digest", timeout=1.0)
    assert not client.abort_agreement("plan/v4/1", "r1", "late")  # complete: final
    assert client.agree("plan/v4/1", "r0", 1, "digest", timeout=1.0) == "digest"


def _catch(fn):
    try:
        return fn()
    except Exception as e:  # returned for the assertion
        return e


def test_token_is_required_when_configured():
    with start_embedded(token="s3cret") as s:
        assert MetaClient(s.address).health()["auth"] is True  # health stays open
        with pytest.raises(MetaAuthError, match="rejected the token"):
            MetaClient(s.address, token="wrong").put("k", 1)
        with pytest.raises(MetaAuthError):
            MetaClient(s.address).status()
        good = MetaClient(s.address, token="s3cret")
        good.put("k", 1)
        assert good.get("k") == 1


def test_malformed_and_oversized_payloads_are_rejected(server, client):
    client.put("ok", 1)
    req = urllib.request.Request(f"{server.address}/v1/jobs/x/kv/k", data=b"{not json", method="PUT")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req)
    assert err.value.code == 400 and json.loads(err.value.read())["error"] == "bad_request"
    with pytest.raises(MetaPayloadError, match="exceeds"):
        client.put("big", "x" * (2 << 20))
    with pytest.raises(MetaPayloadError, match="bad key"):
        client.put("bad key!", 1)
    with pytest.raises(MetaPayloadError, match="role"):
        client.register("p", role="boss", instance="i")
    # a pickle is just bytes that do not parse: rejected, never loaded
    import pickle

    req = urllib.request.Request(f"{server.address}/v1/jobs/x/kv/p", data=pickle.dumps(object()), method="PUT")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req)
    assert err.value.code == 400


def test_unreachable_server_fails_within_the_deadline():
    c = MetaClient("http://127.0.0.1:9", timeout=0.5)
    started = time.monotonic()
    with pytest.raises(MetaConnectionError, match="cannot reach"):
        c.put("k", 1)
    assert time.monotonic() - started < 3.0


def test_standalone_server_and_status_cli(tmp_path):
    env = {**os.environ, "AWEX_META_TOKEN": "tok", "AWEX_STATE_DIR": str(tmp_path)}  # its journal goes there
    port = _free_port()
    serve = [sys.executable, "-m", "awex.meta.cli", "serve", "--port", str(port), "--token-env", "AWEX_META_TOKEN"]
    proc = subprocess.Popen(serve, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:  # up once it says so (a client gives an address never reached 5 s, not a start)
            if "serving on" in line:
                break
        c = MetaClient(f"http://127.0.0.1:{port}", job="rl", token="tok", timeout=15.0)
        c.register("vllm-0", role="inference", instance="vllm-0", world_size=2)
        c.report_version("vllm-0", "step-7")
        out = subprocess.run(
            [sys.executable, "-m", "awex.meta.cli", "status", f"http://127.0.0.1:{port}"],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0, out.stderr
        assert "job rl: 1 participant(s)" in out.stdout
        assert "vllm-0" in out.stdout and "step-7" in out.stdout and "version=step-7" in out.stdout
        bad = subprocess.run(
            [sys.executable, "-m", "awex.meta.cli", "status", f"http://127.0.0.1:{port}", "--token", "nope"],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert bad.returncode == 2 and "rejected the token" in bad.stderr
        by_env = subprocess.run(  # --token-env, as serve takes it
            [sys.executable, "-m", "awex.meta.cli", "status", f"http://127.0.0.1:{port}", "--token-env", "MY_TOKEN"],
            env={**env, "MY_TOKEN": "tok", "AWEX_META_TOKEN": ""},
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert by_env.returncode == 0 and "step-7" in by_env.stdout, by_env.stderr
        proc.kill()  # killed, and started again on its journal: who serves which version is still known
        proc.wait(10)
        assert (tmp_path / f"meta-{port}.journal").exists()
        proc = subprocess.Popen(serve, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        c.health(timeout=15)
        assert c.status()["jobs"]["rl"]["participants"][0]["weight_version"] == "step-7"
    finally:
        proc.terminate()
        proc.wait(10)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_forget_drops_a_finished_versions_keys_and_agreements_only(client):
    for key in (
        "sync/v1",
        "sync/v10",
        "ipc-ready/v1/trainer/0",
        "ipc-ready/v10/trainer/0",
        "validation/v1/e:0",
        "layouts/current/trainer",
    ):
        client.put(key, {"k": key})
    client.agree("plan/v1", "rank0", 1, "d")
    client.agree("plan/v10", "rank0", 1, "d")
    gone = client.forget(names=["sync/v1", "plan/v1"], prefixes=["ipc-ready/v1/", "validation/v1/"])
    assert gone == {"keys": 3, "agreements": 1}
    assert client.keys() == ["ipc-ready/v10/trainer/0", "layouts/current/trainer", "sync/v10"]
    # the forgotten agreement starts afresh (one new participant completes it); the kept one still holds its value
    assert client.agree("plan/v1", "rank9", 1, "new", timeout=2.0) == "new"
    assert client.agree("plan/v10", "rank0", 1, "d", timeout=2.0) == "d"
    with pytest.raises(MetaServerError, match="non-empty strings"):
        client.forget(names=[""])


def test_client_keeps_one_connection_per_thread_and_reconnects_after_the_server_closed_it():
    import threading

    from awex.meta.server import start_embedded

    first = start_embedded()
    port = int(first.address.rsplit(":", 1)[1])
    c = MetaClient(first.address, job="keepalive", timeout=10)
    c.put("a", 1)
    conn = c._http._local.conn
    assert conn is not None and conn.sock is not None  # kept open
    assert c.get("a") == 1 and c._http._local.conn is conn  # and reused
    other: list = []
    t = threading.Thread(target=lambda: other.append((c.get("a"), c._http._local.conn)))
    t.start()
    t.join(10)
    assert other[0][0] == 1 and other[0][1] is not conn  # each thread its own connection
    first.stop()  # the kept-alive connection dies with the server; a new server listens on the same port
    second = start_embedded(port=port)
    try:
        c.put("b", 2)  # no error: reconnected
        assert c.get("b") == 2 and c._http._local.conn is not conn
    finally:
        c.close()
        second.stop()


def test_a_put_sent_now_and_answered_later_means_what_put_means_even_across_a_restart():
    """``put_sent``: the request leaves at once (the server holds it before its answer is read), its answer is
    read later with put's meaning (a refused create raises then), and a kept-alive connection the server closed
    meanwhile costs nothing but a second send of the same request (applied once)."""
    from awex.meta.server import start_embedded

    first = start_embedded()
    port = int(first.address.rsplit(":", 1)[1])
    c = MetaClient(first.address, job="sent", timeout=10)
    watcher = MetaClient(first.address, job="sent", timeout=10)
    try:
        answer = c.put_sent("claim/v1", {"n": 1}, create_only=True)
        assert watcher.get("claim/v1", timeout=5) == {"n": 1}  # arrived before its answer was read
        assert answer() is None
        refused = c.put_sent("claim/v1", {"n": 2}, create_only=True)  # only reading the answer says so
        with pytest.raises(MetaConflictError, match="already exists"):
            refused()
        assert watcher.get("claim/v1") == {"n": 1}
    finally:
        first.stop()
    second = start_embedded(port=port)  # the kept-alive connection died with the first server
    try:
        c.put_sent("claim/v2", {"n": 3}, create_only=True)()  # sent again on a new connection
        assert MetaClient(second.address, job="sent").get("claim/v2") == {"n": 3}
        assert c.put("after", 1) is None  # the thread's connection works on
    finally:
        c.close()
        second.stop()


def test_an_address_that_refuses_connections_is_told_within_seconds_unless_it_answered_before(monkeypatch):
    """A server this client never reached that refuses connections: a wrong address, said within a few seconds
    (``FIRST_CONTACT_SECONDS``, 5 s; 1 s here), not at the deadline; one it reached before (a restart) is waited
    for until the deadline."""
    from awex.meta import http_exchange
    from awex.meta.server import start_embedded

    monkeypatch.setattr(http_exchange, "FIRST_CONTACT_SECONDS", 1.0)
    port = _free_port()  # nothing listens there
    c = MetaClient(f"http://127.0.0.1:{port}", job="refused", timeout=60)
    started = time.monotonic()
    with pytest.raises(MetaConnectionError, match="never reached: is the address right"):
        c.put("k", 1)
    assert 1.0 <= time.monotonic() - started < 5.0
    server = start_embedded(port=port)
    c.put("k", 1)  # reached now
    server.stop()
    restarted: list = []
    timer = threading.Timer(2.5, lambda: restarted.append(start_embedded(port=port)))
    timer.start()
    try:
        started = time.monotonic()
        c.put("k", 2)  # waited out: back after 2.5 s
        assert time.monotonic() - started >= 2.0
    finally:
        timer.join()
        for s in restarted:
            s.stop()
