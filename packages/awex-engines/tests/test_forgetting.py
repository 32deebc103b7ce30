"""Old versions' MetaServer records go a batch of versions a request: every version's names and prefixes reach the
server once, in order, nothing before a batch is full (or flushed), and a refused request is logged, never raised
(the versions themselves were applied)."""

from __future__ import annotations

import logging

from awex.engines.sync import keys
from awex.engines.sync.forgetting import FORGET_EVERY, Forgetting
from awex.meta.errors import MetaServerError


class _Client:
    def __init__(self, fail: bool = False):
        self.calls: list[tuple[list[str], list[str]]] = []
        self.fail = fail

    def forget(self, names, prefixes, timeout=None):
        self.calls.append((list(names), list(prefixes)))
        self.timeout = timeout
        if self.fail:
            raise MetaServerError("server gone")
        return {"keys": len(names), "agreements": 0}


def test_a_request_for_every_batch_of_versions_with_each_versions_records_once():
    client = _Client()
    batch = Forgetting(client)
    versions = [f"v{i}" for i in range(2 * FORGET_EVERY + 3)]
    for v in versions:
        batch.add(v, *keys.version_records(v))
    assert len(client.calls) == 2  # two full batches; the last three versions wait
    assert batch.waiting == versions[-3:] and client.timeout is None  # the client's own
    batch.flush(timeout=2.0)  # as a closing writer: a request of its own deadline
    batch.flush()  # nothing left: no request
    assert len(client.calls) == 3 and client.timeout == 2.0
    names = [n for call in client.calls for n in call[0]]
    prefixes = [p for call in client.calls for p in call[1]]
    want = [keys.version_records(v) for v in versions]
    assert names == [n for w in want for n in w[0]] and prefixes == [p for w in want for p in w[1]]


def test_a_refused_request_is_logged_and_its_versions_not_asked_again(caplog):
    client = _Client(fail=True)
    batch = Forgetting(client, every=2)
    with caplog.at_level(logging.WARNING, logger="awex.engines"):
        for v in ("v1", "v2", "v3"):
            batch.add(v, *keys.version_records(v))
    assert len(client.calls) == 1 and "could not drop the MetaServer records of versions ['v1', 'v2']" in caplog.text
    assert batch.waiting == ["v3"]


def test_a_closing_writers_last_batch_does_not_wait_for_a_server_that_is_gone():
    """Against an address nobody serves, the client would try again until its own deadline (a minute here); the last
    batch's request gives up after its own, and the close goes on."""
    import socket
    import time

    from awex.meta.client import MetaClient

    with socket.socket() as s:  # a free port, then nobody there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    batch = Forgetting(MetaClient(f"127.0.0.1:{port}", job="gone", timeout=60), every=8)
    batch.add("v1", *keys.version_records("v1"))
    started = time.monotonic()
    batch.flush(timeout=0.5)
    assert time.monotonic() - started < 5 and batch.waiting == []
