"""The MetaServer at scale: long-polls capped (beyond a cap a 503 busy answer the client honours), agreements and
event reads linear, names charged against byte limits, limits sized from the open-file limit, loop errors
rate-limited. The 5,000- and 16,384-client runs are the fault suite's ``metaserver_*`` cases."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from awex.meta.client import MetaClient
from awex.meta.errors import AgreementError, MetaBusyError, MetaPayloadError, MetaTimeoutError
from awex.meta.server import EmbeddedMetaServer, ServerConfig
from awex.meta.server import site as site_mod
from awex.meta.server.agreements import SHOWN
from awex.meta.server.state import Agreement, JobState


def test_waiters_beyond_the_cap_are_told_to_retry_and_all_get_the_value():
    config = ServerConfig(max_parked=4, max_parked_per_client=4)
    with EmbeddedMetaServer(config=config) as s:
        got, errors = [], []

        def wait() -> None:
            try:
                got.append(MetaClient(s.address, job="j", timeout=20).get("go", timeout=20))
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=wait) for _ in range(20)]
        for t in threads:
            t.start()
        time.sleep(1.5)
        writer = MetaClient(s.address, job="j", timeout=5)
        status = writer.status()
        assert status["waiting"] <= 4 and status["busy_answers"] > 0  # the cap held; the others were told
        started = time.monotonic()
        writer.put("go", 7)  # gets through although the parked ones hold their connections
        assert time.monotonic() - started < 1.0
        for t in threads:
            t.join(30)
        assert not errors and got == [7] * 20


def test_a_client_kept_busy_until_its_deadline_gets_a_timeout_that_says_so():
    with EmbeddedMetaServer(config=ServerConfig(max_parked=1, max_parked_per_client=1)) as s:
        parked = threading.Thread(target=lambda: MetaClient(s.address, job="j").try_get("x") or _wait(s, "x", 4))
        parked.start()
        time.sleep(0.5)
        started = time.monotonic()
        with pytest.raises(MetaBusyError, match="stayed busy") as err:
            MetaClient(s.address, job="j").get("y", timeout=1.5)
        assert isinstance(err.value, MetaTimeoutError) and time.monotonic() - started < 1.5 + 1.0
        parked.join(10)


def _wait(s, key: str, seconds: float) -> None:
    with pytest.raises(MetaTimeoutError):
        MetaClient(s.address, job="j").get(key, timeout=seconds)


def test_agreements_count_distinct_values_as_they_arrive():
    a = Agreement(expected=4)
    for who, value in (("a", {"x": 1, "y": 2}), ("b", {"y": 2, "x": 1}), ("c", [1]), ("c", {"x": 1, "y": 2})):
        a.give(who, value)
    assert len(a.counts) == 1 and list(a.first.values()) == [{"x": 1, "y": 2}] and not a.complete  # c changed its mind
    a.give("d", "other")
    assert a.complete and dict(a.counts) == {'{"x":1,"y":2}': 3, '"other"': 1}


def test_a_disagreement_names_how_many_values_and_lists_a_few():
    with EmbeddedMetaServer() as s:
        n = SHOWN + 4
        errors = []

        def agree(i: int) -> None:
            try:
                MetaClient(s.address, job="j", timeout=10).agree("plan", f"r{i}", n, f"digest-{i % (SHOWN + 2)}")
            except AgreementError as e:
                errors.append(str(e))

        threads = [threading.Thread(target=agree, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert len(errors) == n and all(f"{SHOWN + 2} distinct values" in e for e in errors)


def test_names_count_against_the_byte_limits():
    with EmbeddedMetaServer(config=ServerConfig(max_job_bytes=10_000)) as s:
        c = MetaClient(s.address, job="j", timeout=5)
        with pytest.raises(MetaPayloadError, match="more than 10000 bytes"):
            for i in range(40):  # values of 1 byte under 500-character names: ~20 fit, not 10,000
                c.put(f"{i:03d}" + "k" * 497, 1)
        assert 15 <= len(c.keys()) <= 20
        for key in c.keys():
            c.delete(key)
        c.put("k" * 500, 1)  # deleting gave the names' bytes back


def test_events_after_a_cursor_read_only_the_newer_ones():
    job = JobState("j", max_events=5, max_keys=10)
    seqs = [job.add_event("k" if i % 2 else "other", "s", None, None, nbytes=10)["seq"] for i in range(8)]
    assert [e["seq"] for e in job.after(0, None)] == seqs[-5:]  # the oldest three went
    assert [e["seq"] for e in job.after(seqs[5], None)] == seqs[6:]
    assert [e["seq"] for e in job.after(seqs[2], "k")] == [seqs[3], seqs[5], seqs[7]]
    assert job.after(seqs[-1], None) == [] and job.held_bytes() == 50


def test_limits_are_sized_from_the_open_file_limit():
    sized = ServerConfig().sized(1024)
    assert sized.max_connections == 1024 - 128
    assert (sized.max_parked, sized.max_connections_per_client, sized.max_parked_per_client) == (672, 672, 336)
    assert ServerConfig(max_connections=100).sized(1 << 20).max_connections == 100
    assert ServerConfig(max_parked=10, max_parked_per_client=3).sized(1024).max_parked_per_client == 3


def test_the_server_raises_its_soft_open_file_limit():
    script = (
        "import resource; from awex.meta.server.site import descriptor_limit;"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE);"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard));"
        "got = descriptor_limit(1 << 12);"
        "print(got, min(1 << 12, hard) if hard != resource.RLIM_INFINITY else 1 << 12)"
    )
    got, want = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout.split()
    assert got == want


def test_loop_errors_are_reported_once_per_interval(monkeypatch, caplog):
    quiet = site_mod.QuietLoopErrors()
    err = OSError(24, "Too many open files")
    with caplog.at_level(logging.ERROR, logger="awex.meta.server"):
        for _ in range(1000):
            quiet(None, {"message": "socket.accept() out of system resource", "exception": err})
    assert len(caplog.records) == 1
    monkeypatch.setattr(site_mod, "LOG_EVERY", 0.0)
    with caplog.at_level(logging.ERROR, logger="awex.meta.server"):
        quiet(None, {"message": "socket.accept() out of system resource", "exception": err})
    assert "999 more like it" in caplog.records[-1].getMessage()


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.booleans(), st.text("ab/", min_size=0, max_size=5)),  # (set or pop, key)
        max_size=60,
    ),
    st.lists(st.text("ab/", max_size=4), min_size=1, max_size=6),
)
def test_the_keys_under_a_prefix_match_a_scan_of_every_key(ops, prefixes):
    # forget, keys?prefix= and the claim lease's names read a prefix by bisection of the sorted keys (a steady
    # version's records dropped at a cost of what they are, not of the job's thousands of keys); the oracle: a scan
    job = JobState("j", max_events=5, max_keys=1000)
    for put, key in ops:
        if not key:
            continue
        if put:
            job.set_kv(key, b"1")
        else:
            job.pop_kv(key)
    for prefix in prefixes:
        assert job.keys_under(prefix) == sorted(k for k in job.kv if k.startswith(prefix))
    assert job.kv_bytes == sum(len(k) + 1 for k in job.kv)


def test_dropping_one_version_s_records_costs_what_it_finds_not_the_job_s_size():
    # counted, not timed: startswith calls a forget makes on a job of 20,000 keys to drop 3 of them
    job = JobState("j", max_events=5, max_keys=100_000)
    for i in range(20_000):
        job.set_kv(f"devices/a{i:05d}", b"{}")
    for i in range(3):
        job.set_kv(f"signals/v7/{i}", b"{}")

    class Counted(str):
        calls = 0

        def startswith(self, *args):
            Counted.calls += 1
            return str.startswith(self, *args)

    job._ordered = [Counted(k) for k in job._ordered]
    assert job.keys_under("signals/v7/") == [f"signals/v7/{i}" for i in range(3)]
    assert Counted.calls <= 4, Counted.calls
