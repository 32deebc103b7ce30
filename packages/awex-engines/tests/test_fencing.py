"""Writers fenced and version names claimed before any byte moves: a writer replaced by a newer one of the same
trainer instance changes nothing when it resumes, and a version name another writer claimed is refused in steady
state too (gloo, one process, writer and reader in threads)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from test_version_signals import TENSORS, make_writer, sync, tensors, views

from awex.engines.errors import SyncFailedError, VersionRefusedError
from awex.engines.reader import WeightsReader
from awex.engines.sync import keys
from awex.meta.client import MetaClient
from awex.meta.errors import MetaFencedError
from awex.meta.layouts import hf_layout
from awex.meta.server import start_embedded


@pytest.fixture
def server():
    s = start_embedded()
    yield s
    s.stop()


def _reader(server, got, timeout=60.0):
    client = MetaClient(server.address, job="signals", timeout=timeout)
    return WeightsReader(client, hf_layout(TENSORS, "inference", "hf-in"), 0, views(got), timeout=timeout)


def _serves(client: MetaClient) -> str | None:
    return {p["name"]: p["weight_version"] for p in client.status()["jobs"]["signals"]["participants"]}.get("hf-in")


def test_a_writer_replaced_by_a_newer_one_changes_nothing_when_it_resumes(server):
    sent, got = tensors(1.0), tensors(-1.0)
    stale = make_writer(server, sent)
    reader = _reader(server, got)
    sync(stale, reader, "v1")
    stale.flush()
    replacement = make_writer(server, sent)  # the same trainer instance, restarted: takes a newer epoch
    for t in sent.values():
        t.fill_(2.0)
    with pytest.raises(MetaFencedError, match="replaced by a newer one"):
        stale.write("v2", ["hf-in"])  # refused before any byte moves: nothing announced, reported or dropped
    stale.flush()
    plain = MetaClient(server.address, job="signals", timeout=10)
    assert _serves(plain) == "v1" and all(torch.equal(got[n], torch.full_like(got[n], 1.0)) for n in got)
    assert not [e for e in plain.events(0) if e["kind"] == "sync_failed"]
    assert plain.try_get(keys.manifest("v1")) is not None  # the records it wrote are left for the live writer
    sync(replacement, reader, "v2")
    replacement.flush()
    assert _serves(plain) == "v2" and all(torch.equal(got[n], sent[n]) for n in sent)
    for w in (stale, replacement):
        w.close()
    reader.close()


def test_a_name_another_writer_claimed_is_refused_in_steady_state_before_any_byte_moves(server):
    sent, got = tensors(1.0), tensors(-1.0)
    writer = make_writer(server, sent, timeout=20.0)
    reader = _reader(server, got, timeout=30.0)
    sync(writer, reader, "v1")
    sync(writer, reader, "v2")  # steady from here on: the plan and group are reused
    MetaClient(server.address, job="signals").put(keys.manifest("v3"), {"by": "another writer"})
    for t in sent.values():
        t.fill_(3.0)
    missed: list = []
    t = threading.Thread(target=lambda: missed.append(_catch(reader.receive, "v3")))
    t.start()
    started = time.monotonic()
    with pytest.raises(ValueError, match="already announced"):
        writer.write("v3", ["hf-in"])
    t.join(30)
    # the receiver learns of the refusal at once (a notice on the board), not at its deadline (30 s)
    assert isinstance(missed[0], VersionRefusedError) and "already announced" in str(missed[0])
    assert time.monotonic() - started < 5.0
    assert all(torch.equal(got[n], torch.full_like(got[n], 1.0)) for n in got)  # v1's bytes: nothing of v3 moved
    sync(writer, reader, "v4")
    assert all(torch.equal(got[n], sent[n]) for n in sent)
    writer.close()
    reader.close()


def _catch(fn, *args):
    try:
        fn(*args)
    except Exception as e:  # asserted by the caller
        return e
    return None


def test_a_name_applied_is_never_taken_again_by_a_replacement_even_when_the_report_was_lost(server):
    """The first writer's report that its version was applied never reached the MetaServer (it was killed after
    ``write`` returned), so the server lets its replacement take the name over: the receiver, which holds that
    name's bytes from the first writer, refuses it before any byte moves, and the replacement's write fails."""
    sent, got = tensors(1.0), tensors(-1.0)
    first = make_writer(server, sent, timeout=10.0)
    reader = _reader(server, got, timeout=10.0)
    first._announcer.report_sent = lambda *args, **kwargs: None  # lost
    sync(first, reader, "v1")
    first.flush()
    plain = MetaClient(server.address, job="signals", timeout=10)
    assert _serves(plain) is None  # the server never learnt that v1 was applied
    replacement = make_writer(server, sent, timeout=10.0)  # the same trainer instance, restarted (epoch 2)
    for t in sent.values():
        t.fill_(2.0)
    refused: list = []
    t = threading.Thread(target=lambda: refused.append(_catch(reader.receive, "v1")))
    t.start()
    started = time.monotonic()
    with pytest.raises(SyncFailedError, match="applied version 'v1' already"):
        replacement.write("v1", ["hf-in"])
    assert time.monotonic() - started < 5.0  # told by the receiver's failure, not at its deadline (10 s)
    t.join(30)
    assert isinstance(refused[0], ValueError) and "name the version anew" in str(refused[0])
    assert all(torch.equal(got[n], torch.full_like(got[n], 1.0)) for n in got)  # v1's bytes, the first writer's
    sync(replacement, reader, "v2")
    assert all(torch.equal(got[n], sent[n]) for n in sent)
    first.close(), replacement.close(), reader.close()


def test_a_versions_report_has_left_when_write_returns(server):
    """The report that a version was applied leaves before ``write`` returns (with the outcome, not from the
    background afterwards): with the writer's background thread stopped for good, the server still learns that
    the engine serves v1 and that the name is taken for good, and the answer is read before the next version."""
    sent, got = tensors(1.0), tensors(-1.0)
    writer = make_writer(server, sent, timeout=10.0)
    reader = _reader(server, got, timeout=10.0)
    writer._background.submit = lambda *args, **kwargs: None  # nothing runs after write returns
    sync(writer, reader, "v1")
    plain = MetaClient(server.address, job="signals", timeout=10)
    deadline = time.monotonic() + 5.0  # the request is on its way when write returns; the server answers it
    while _serves(plain) != "v1":
        assert time.monotonic() < deadline, "the report did not reach the MetaServer"
        time.sleep(0.02)
    replacement = MetaClient(server.address, job="signals", timeout=10)
    with pytest.raises(Exception, match="was applied"):  # a name applied is never written again
        replacement.fenced("other", replacement.take_fence("other")).put(keys.manifest("v1"), {"other": 1})
    sync(writer, reader, "v2")  # the report's answer was read first: the next version goes as ever
    writer.close(), reader.close()
