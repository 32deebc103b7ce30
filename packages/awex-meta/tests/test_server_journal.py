"""The MetaServer's journal: fences, claimed names and served versions outlive the server process, so that what was
refused before a restart is refused after it; a damaged journal or a second server on it is refused, never served
on; claims stay when a version's records are forgotten and go only when their writer releases a failed attempt."""

from __future__ import annotations

import json

import pytest

from awex.meta.client import MetaClient
from awex.meta.errors import MetaConflictError, MetaFencedError
from awex.meta.server import journal as journal_module
from awex.meta.server import start_embedded
from awex.meta.server.journal import Journal, JournalError


def _status(c: MetaClient) -> dict:
    return {p["name"]: p["weight_version"] for p in c.status()["jobs"][c.job]["participants"]}


@pytest.fixture(params=["journal", "etcd"])
def keeper(request, tmp_path):
    """How a server keeps the safety state: a journal file, or etcd (three members; a restart is a new server that
    takes the lead on the same keys). Returns what starts a server (on a port)."""
    if request.param == "journal":
        path = str(tmp_path / "meta.journal")
        return lambda port=0: start_embedded(port=port, journal=path)
    url = request.getfixturevalue("etcd_cluster").url()
    return lambda port=0: start_embedded(port=port, store=url, leader_ttl=2)


def _restarted(server, start):
    port = server.port
    server.stop()
    return start(port)


def test_fences_claims_and_served_versions_outlive_a_restart(keeper):
    server = keeper()
    try:
        plain = MetaClient(server.address, job="rl", timeout=5)
        plain.register("eng", role="inference", instance="eng", world_size=2)
        zombie = plain.fenced("trainer", plain.take_fence("trainer"))
        zombie.put("sync/v1", {"by": "zombie"}, create_only=True)
        live = plain.fenced("trainer", plain.take_fence("trainer"))  # epoch 2 replaces the zombie
        live.put("sync/v1", {"by": "live"})  # took over the unfinished claim
        live.report_version("eng", "v1", claim="sync/v1")
        live.put("sync/v2", {"by": "live"}, create_only=True)
        live.forget(["sync/v2"])  # a finished version's records dropped: its name stays claimed
        server = _restarted(server, keeper)
        assert _status(plain) == {"eng": "v1"}  # the served version, and who serves it, came back
        with pytest.raises(MetaFencedError, match="replaced by a newer one"):  # the zombie stays fenced
            zombie.put("sync/v3", {"by": "zombie"}, create_only=True)
        with pytest.raises(MetaFencedError):
            zombie.report_version("eng", None)
        assert _status(plain) == {"eng": "v1"}
        other = plain.fenced("other-trainer", plain.take_fence("other-trainer"))
        for name in ("sync/v1", "sync/v2"):  # old names are not free again, for any writer
            with pytest.raises(MetaConflictError, match="already exists"):
                other.put(name, {"by": "other"}, create_only=True)
        with pytest.raises(MetaConflictError, match="claimed by another writer"):
            other.put("sync/v2", {"by": "other"})
        with pytest.raises(MetaConflictError, match="was applied"):  # not even by its own, newer writer
            plain.fenced("trainer", plain.take_fence("trainer")).put("sync/v1", {"by": "third"})
        assert plain.take_fence("trainer") == 4  # epochs go on from where they were
    finally:
        server.stop()


def test_a_failed_attempt_is_released_by_its_writer_alone_and_may_be_claimed_again(keeper):
    server = keeper()
    try:
        plain = MetaClient(server.address, job="rl", timeout=5)
        writer = plain.fenced("trainer", plain.take_fence("trainer"))
        other = plain.fenced("other", plain.take_fence("other"))
        writer.put("sync/v1", {"n": 1}, create_only=True)
        other.forget(["sync/v1"], release=["sync/v1"])  # another writer cannot release it
        with pytest.raises(MetaConflictError, match="claimed"):
            writer.put("sync/v1", {"n": 2}, create_only=True)
        writer.forget(["sync/v1"], release=["sync/v1"])  # its own writer can (the attempt failed)
        server = _restarted(server, keeper)
        writer.put("sync/v1", {"n": 3}, create_only=True)  # free again, after the restart too
        plain.register("eng", role="inference", instance="eng")
        writer.report_version("eng", "v1", claim="sync/v1")
        writer.forget(["sync/v1"], release=["sync/v1"])  # applied: never released
        with pytest.raises(MetaConflictError):
            writer.put("sync/v1", {"n": 4}, create_only=True)
    finally:
        server.stop()


def test_a_journal_cut_short_at_its_end_loses_only_the_unanswered_record(tmp_path):
    path = tmp_path / "meta.journal"
    server = start_embedded(journal=str(path))
    plain = MetaClient(server.address, job="rl", timeout=5)
    assert plain.take_fence("trainer") == 1
    server.stop()
    with open(path, "ab") as f:
        f.write(journal_module.encode({"op": "fence", "job": "rl", "id": "trainer", "epoch": 9})[:-7])
    server = start_embedded(port=server.port, journal=str(path))
    try:
        assert plain.take_fence("trainer") == 2
        assert path.read_bytes().endswith(b"\n")  # rewritten without the piece
    finally:
        server.stop()


@pytest.mark.parametrize(
    "damage",
    [
        lambda lines: [lines[0].replace(b'"epoch":1', b'"epoch":0')] + lines[1:],  # checksum no longer matches
        lambda lines: [b"not a record"] + lines[1:],
        lambda lines: [journal_module.encode({"op": "forget-everything", "job": "rl"})[:-1]] + lines[1:],
        lambda lines: [journal_module.encode({"op": "fence", "job": "rl", "id": "t", "epoch": -1})[:-1]] + lines[1:],
    ],
)
def test_a_damaged_journal_is_refused_naming_the_line(tmp_path, damage):
    path = tmp_path / "meta.journal"
    server = start_embedded(journal=str(path))
    plain = MetaClient(server.address, job="rl", timeout=5)
    plain.take_fence("trainer")
    plain.put("sync/v1", {}, create_only=True)
    server.stop()
    lines = path.read_bytes().split(b"\n")[:-1]
    path.write_bytes(b"\n".join(damage(lines)) + b"\n")
    with pytest.raises(RuntimeError, match=r"journal .* damaged at line 1 .*refusing to serve"):
        start_embedded(journal=str(path))


def test_two_servers_on_one_journal_are_refused_and_a_stopped_one_lets_go(tmp_path):
    path = str(tmp_path / "meta.journal")
    first = start_embedded(journal=path)
    try:
        with pytest.raises(RuntimeError, match="another MetaServer is serving on the journal"):
            start_embedded(journal=path)
        with pytest.raises(JournalError, match="another MetaServer"):
            Journal(path)
    finally:
        first.stop()
    start_embedded(journal=path).stop()


def test_the_journal_is_rewritten_from_the_state_once_it_grew_past_it(tmp_path, monkeypatch):
    monkeypatch.setattr(journal_module, "COMPACT_AFTER", 20)
    path = tmp_path / "meta.journal"
    server = start_embedded(journal=str(path))
    try:
        plain = MetaClient(server.address, job="rl", timeout=5)
        plain.register("eng", role="inference", instance="eng")
        for i in range(60):
            plain.report_version("eng", f"v{i}")  # one record each; the state stays one participant
        lines = path.read_bytes().split(b"\n")[:-1]
        assert len(lines) < 30, len(lines)
        server = _restarted(server, lambda port: start_embedded(port=port, journal=str(path)))
        ops = [json.loads(x.split(b" ", 1)[1])["op"] for x in path.read_bytes().split(b"\n")[:-1]]
        assert ops == ["participant", "serves"]  # rewritten as it opened
        assert _status(plain) == {"eng": "v59"}  # (the client registers again on seeing the restart: kept)
    finally:
        server.stop()


def test_a_change_the_journal_cannot_keep_is_refused_and_not_made(tmp_path):
    """A journal that cannot be written (disk full, file gone read-only): the change is answered 503 ``journal``
    and not made, since a change the journal lacks would be forgotten by the next restart."""
    import os

    from awex.meta.errors import MetaServerError
    from awex.meta.server.app import SERVER_KEY

    path = tmp_path / "meta.journal"
    server = start_embedded(journal=str(path))
    try:
        c = MetaClient(server.address, job="rl", timeout=5)
        for name in ("eng-0", "eng-1"):
            c.register(name, role="inference", instance=name, world_size=1)
        writer = c.fenced("trainer", c.take_fence("trainer"))
        app = server._runner.app[SERVER_KEY]
        os.close(app.journal._fd)
        app.journal._fd = os.open(path, os.O_RDONLY)  # writes now fail
        with pytest.raises(MetaServerError, match="cannot write the MetaServer journal"):
            writer.put("sync/v1", {}, create_only=True)
        with pytest.raises(MetaServerError, match="cannot write the MetaServer journal"):
            c.take_fence("trainer")
        with pytest.raises(MetaServerError, match="cannot write the MetaServer journal"):
            plain = MetaClient(server.address, job="rl", timeout=5)
            plain.fenced("trainer", 7).put("x", 1)  # a higher epoch the server would raise itself to
        with pytest.raises(MetaServerError, match="cannot write the MetaServer journal"):  # several in one write
            writer.report_versions({name: {"version": "v0"} for name in ("eng-0", "eng-1")})
        assert c.try_get("sync/v1") is None and app.jobs["rl"].fences == {"trainer": 1}
        assert "sync/v1" not in app.jobs["rl"].claims
        assert _status(c) == {"eng-0": None, "eng-1": None}  # neither engine's version changed
    finally:
        server.stop()


def test_serve_says_what_to_do_when_its_journal_cannot_be_written(tmp_path):
    import os
    import subprocess
    import sys

    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")  # the journal's directory would have to be this file
    out = subprocess.run(
        [sys.executable, "-m", "awex.meta.cli", "serve", "--port", "0", "--journal", str(blocked / "meta.journal")],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ),
    )
    assert out.returncode == 2 and "cannot open the MetaServer journal" in out.stderr, out.stderr
    assert "--no-journal" in out.stderr and "Traceback" not in out.stderr


def test_a_report_of_several_engines_is_journalled_in_one_write_and_outlives_a_restart(tmp_path, monkeypatch):
    """A writer reports every engine it synced in one request: their versions and the claim's being applied go to
    the journal in one write (one flush to the disk with ``--journal-fsync``), before any is made; all come back."""
    import os

    from awex.meta.server.config import ServerConfig
    from awex.meta.server.embedded import EmbeddedMetaServer

    config = ServerConfig(journal=str(tmp_path / "meta.journal"), journal_fsync=True)
    start = lambda port=0: EmbeddedMetaServer("127.0.0.1", port, config).start()  # noqa: E731
    server = start()
    synced: list[int] = []
    real_fsync = os.fsync
    try:
        c = MetaClient(server.address, job="rl", timeout=5)
        engines = [f"eng-{i}" for i in range(16)]
        for name in engines:
            c.register(name, role="inference", instance=name, world_size=1)
        writer = c.fenced("trainer", c.take_fence("trainer"))
        writer.put("sync/v1", {"by": "trainer"}, create_only=True)
        monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
        writer.report_versions({name: {"version": "v1", "claim": "sync/v1"} for name in engines})
        assert len(synced) == 1  # 17 records (16 engines, the claim applied), one flush
        monkeypatch.setattr(os, "fsync", real_fsync)
        server = _restarted(server, start)
        assert _status(c) == {name: "v1" for name in engines}
        other = c.fenced("other", c.take_fence("other"))
        with pytest.raises(MetaConflictError, match="already exists"):  # applied: never written again
            other.put("sync/v1", {"by": "other"}, create_only=True)
    finally:
        server.stop()
