"""Claim leases (``awex.meta.server.leases``): while a writer holds its job's lease no other writer claims a name and
no newer writer of its identity takes an epoch; the grant lists every name claimed before (by digest); whoever
waits for the lease stops its renewal; a journalled lease outlives a restart; bad requests are refused."""

from __future__ import annotations

import time

import pytest

from awex.meta.client import MetaClient
from awex.meta.errors import MetaBusyError, MetaFencedError, MetaPayloadError
from awex.meta.protocol import claim_digest
from awex.meta.server import leases, start_embedded


@pytest.fixture(scope="module")
def server():
    with start_embedded() as s:
        yield s


def _writer(server, job: str, identity: str = "trainer", timeout: float = 5) -> MetaClient:
    plain = MetaClient(server.address, job=job, timeout=timeout)
    return plain.fenced(identity, plain.take_fence(identity))


def _digests(answer: dict) -> set[str]:
    names = answer["names"]
    return {names[i : i + 16] for i in range(0, len(names), 16)}


def test_the_grant_names_every_claimed_name_and_the_holder_alone_claims(server):
    other = _writer(server, "j1", "critic")
    other.put("manifest/v1", {"x": 1}, create_only=True)
    other.put("manifest/plain", {"x": 1})  # written, not claimed: a name all the same
    other.put("elsewhere/k", {"x": 1})
    holder = _writer(server, "j1")
    answer = holder.lease(5, "manifest/", names=True)
    assert answer["granted"] and answer["seconds"] == 5
    assert _digests(answer) == {claim_digest("manifest/v1"), claim_digest("manifest/plain")}
    holder.put("manifest/v2", {"x": 2}, create_only=True)  # the holder's own claims go through
    assert holder.lease(5, "manifest/")["granted"] and "names" not in holder.lease(5, "manifest/")  # renewed
    quick = MetaClient(server.address, job="j1", timeout=0.3).fenced("critic", 1)
    with pytest.raises(MetaBusyError, match="claim lease"):  # another writer's claim waits for the lease
        quick.put("manifest/v3", {"x": 3}, create_only=True)
    with pytest.raises(MetaBusyError):  # a claimed name written again is a claim too
        quick.put("manifest/v1", {"x": 9})
    with pytest.raises(MetaBusyError):  # so is any write of a key under the lease's prefix
        quick.put("manifest/v4", {"x": 4})
    quick.put("plain-key", {"x": 4})  # what is neither is not held up
    refused = holder.lease(5, "manifest/")  # wanted by another writer: not renewed
    assert not refused["granted"] and "waits" in refused["why"]


def test_another_writers_lease_request_marks_it_wanted_and_leases_stay_refused(server):
    holder, other = _writer(server, "j2"), _writer(server, "j2", "critic")
    assert holder.lease(2, "manifest/")["granted"]
    answer = other.lease(2, "manifest/")
    assert not answer["granted"] and 0 < answer["retry_after"] <= 2
    assert not holder.lease(2, "manifest/")["granted"]
    time.sleep(2.1)  # the lease ended; several writers claim in this job: no lease for a while
    assert "several writers" in other.lease(2, "manifest/")["why"]
    other.put("manifest/v1", {}, create_only=True)  # claims by a round trip go through


def test_a_replacement_waits_for_the_lease_of_the_writer_it_replaces(server):
    old = _writer(server, "j3")
    assert old.lease(1.5, "manifest/")["granted"]
    plain = MetaClient(server.address, job="j3", timeout=10)
    started = time.monotonic()
    epoch = plain.take_fence("trainer")  # waits until the old writer's lease ended
    assert epoch == 2 and time.monotonic() - started >= 1.2
    with pytest.raises(MetaFencedError):
        old.lease(1.5, "manifest/")
    with pytest.raises(MetaFencedError):
        old.put("manifest/v9", {}, create_only=True)


def test_a_lease_given_back_lets_a_replacement_start_at_once(server):
    old = _writer(server, "j4")
    assert old.lease(30, "manifest/")["granted"]
    assert old.lease(30, give_back=True)["released"]
    started = time.monotonic()
    MetaClient(server.address, job="j4", timeout=5).take_fence("trainer")
    assert time.monotonic() - started < 10.0  # not the 30 s the lease had left


def test_a_journalled_lease_outlives_a_restart(tmp_path):
    path = str(tmp_path / "meta.journal")
    server = start_embedded(journal=path)
    try:
        holder = _writer(server, "rl")
        assert holder.lease(3, "manifest/")["granted"]
        port = server.port
        server.stop()
        server = start_embedded(port=port, journal=path)
        quick = MetaClient(server.address, job="rl", timeout=0.5).fenced("critic", 1)
        with pytest.raises(MetaBusyError, match="claim lease"):
            quick.put("manifest/v1", {}, create_only=True)
        holder.put("manifest/v1", {}, create_only=True)  # the holder's claims go through
    finally:
        server.stop()


def test_renewals_write_nothing_to_the_journal_and_a_restart_restores_the_whole_length(tmp_path):
    path = tmp_path / "meta.journal"
    server = start_embedded(journal=str(path))
    try:
        holder = _writer(server, "rl")
        assert holder.lease(2, "manifest/")["granted"]
        lines = path.read_bytes().count(b"\n")
        for _ in range(3):
            time.sleep(0.4)
            assert holder.lease(2, "manifest/")["granted"]  # renewed
        assert path.read_bytes().count(b"\n") == lines  # nothing more journalled
        port = server.port
        server.stop()
        server = start_embedded(port=port, journal=str(path))
        started = time.monotonic()
        MetaClient(server.address, job="rl", timeout=10).take_fence("trainer")  # waits for the restored lease
        assert time.monotonic() - started >= 1.5  # its whole length again from the restart, not what was left
    finally:
        server.stop()


@pytest.mark.parametrize("seconds", [0, 0.5, 61, "5", True])
def test_bad_lease_requests_are_refused(server, seconds):
    with pytest.raises(MetaPayloadError, match="seconds"):
        _writer(server, "j5").lease(seconds, "manifest/")


def test_a_lease_is_for_a_fenced_writer(server):
    with pytest.raises(MetaPayloadError, match="fenced writer"):
        MetaClient(server.address, job="j6", timeout=5).lease(5, "manifest/")
    assert leases.MAX_SECONDS <= leases.CONTENDED_SECONDS  # a contended job stays without leases past one's length
