"""Writer fences on the MetaServer: a writer that starts takes a new epoch for its identity, and every write of a
client fenced with an older one is refused (409 ``fenced``, ``MetaFencedError``) and changes nothing; a restarted
server learns the newest epoch from its writer's next write."""

from __future__ import annotations

import pytest

from awex.meta.client import MetaClient
from awex.meta.errors import MetaConflictError, MetaFencedError, MetaPayloadError
from awex.meta.protocol import FENCE_HEADER
from awex.meta.server import start_embedded


@pytest.fixture
def server():
    s = start_embedded()
    yield s
    s.stop()


def _writes(c: MetaClient):
    """Every kind of write a writer makes: records, deletes, drops, participants, versions, events."""
    return [
        lambda: c.put("sync/v9/manifest", {"w": c.fence}),
        lambda: c.delete("sync/v1/manifest"),
        lambda: c.forget(["sync/v1/manifest"], ["plan/v1/"]),
        lambda: c.register("trainer", role="trainer", instance="trainer"),
        lambda: c.report_version("eng", None),
        lambda: c.publish_event("sync_failed", "trainer:0", version="v1"),
    ]


def test_a_newer_writer_fences_every_write_of_the_older_one(server):
    plain = MetaClient(server.address, job="rl", timeout=5)
    plain.register("eng", role="inference", instance="eng")
    first = plain.fenced("trainer", plain.take_fence("trainer"))
    first.put("sync/v1/manifest", {"by": "first"})
    first.report_version("eng", "v1")
    second = plain.fenced("trainer", plain.take_fence("trainer"))
    assert (first.fence, second.fence) == ("1:trainer", "2:trainer")
    for write in _writes(first):
        with pytest.raises(MetaFencedError, match="replaced by a newer one"):
            write()
    assert plain.try_get("sync/v1/manifest") == {"by": "first"}  # nothing the old writer asked was done
    assert plain.try_get("sync/v9/manifest") is None
    versions = {p["name"]: p["weight_version"] for p in plain.status()["jobs"]["rl"]["participants"]}
    assert versions["eng"] == "v1"
    for write in _writes(second):  # the newest writer, and anyone unfenced, go on
        write()
    plain.put("x", 1)
    other = plain.fenced("another-trainer", plain.take_fence("another-trainer"))  # identities are separate
    other.put("y", 1)
    assert issubclass(MetaFencedError, MetaConflictError)


def test_a_restarted_server_learns_the_newest_epoch_from_its_writers_next_write():
    server = start_embedded()
    plain = MetaClient(server.address, job="rl", timeout=5)
    old = plain.fenced("trainer", plain.take_fence("trainer"))
    new = plain.fenced("trainer", plain.take_fence("trainer"))
    port = server.port
    server.stop()
    restarted = start_embedded(port=port)
    try:
        old.put("a", 1)  # the server forgot every epoch: the old writer's write lands until the new one writes
        new.put("b", 1)
        with pytest.raises(MetaFencedError):
            old.put("c", 1)
        assert plain.fenced("trainer", plain.take_fence("trainer")).fence == "3:trainer"
    finally:
        restarted.stop()


@pytest.mark.parametrize("header", ["0:trainer", "x:trainer", "1:", "1:bad name", "-1:trainer", f"{1 << 60}:t"])
def test_a_malformed_fence_is_refused(server, header):
    c = MetaClient(server.address, job="rl", timeout=5)
    c.fence = header
    with pytest.raises(MetaPayloadError, match=FENCE_HEADER):
        c.put("k", 1)
    with pytest.raises(MetaPayloadError, match="writer identity"):
        MetaClient(server.address, job="rl", timeout=5).take_fence("bad name")
