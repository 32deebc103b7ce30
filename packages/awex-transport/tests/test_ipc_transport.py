"""The CUDA IPC transport's bookkeeping, on CPU: a receiver opens each trainer's export once and reuses it while
the generation stays; after a new plan (a restarted trainer starts its generations at 1 again) it compares the
published export with the one it holds and reopens only if it changed. The GPU copies themselves run in
integration/tests/test_gpu_sync.py."""

from __future__ import annotations

import time

from staged_world import world

import awex.transport.ipc.transport as ipc_transport
from awex.transport.base import Setup, TransferStats


class _Mapped:
    def __init__(self, doc):
        self.doc, self.closed = doc, False
        self.export = doc  # what open_export was given (_Export.from_wire gives the document back)

    def close(self):
        self.closed = True


class _Executor:
    capture_seconds = 0.0

    def __init__(self, plan, rank, shards, sources, quantize=None, digest=False, pairs=None):
        self.sources, self.pairs = sources, None  # nothing to re-point: every build pairs anew

    def run(self, timeout, meanwhile=None):
        return TransferStats()


class _Export:
    lasts: list = []  # the export before, as each from_wire was given it

    @staticmethod
    def from_wire(doc, last=None):
        _Export.lasts.append(last)
        return doc


class _Link:
    count = 1
    digests = False

    def __init__(self, docs):
        self.docs, self.fetched = docs, []

    def await_ready(self, peers, deadline):
        return [1] * len(peers)

    def descriptor(self, peer, generation, deadline):
        self.fetched.append(peer)
        return self.docs[peer]

    def moving(self):
        pass

    def meanwhile(self):
        pass


def test_a_receiver_reopens_an_export_only_when_it_changed(monkeypatch):
    monkeypatch.setattr(ipc_transport, "open_export", _Mapped)
    monkeypatch.setattr(ipc_transport, "IpcExport", _Export)
    monkeypatch.setattr(ipc_transport, "IpcExecutor", _Executor)
    _, dests, plan = world(train_tp=2, engines=((1,),))
    rank = plan.rank(dests[0].instance, 0).rank
    peers = sorted({s.peer for s in plan.schedule(rank)})
    transport = ipc_transport.IpcTransport()
    setup = Setup("127.0.0.1", 1, time.monotonic() + 10)

    def sync(docs):
        link = _Link(docs)
        transport.run(object(), link, time.monotonic() + 10, {})
        return link.fetched, {p: transport.opened[(plan.ranks[p].instance, plan.ranks[p].local_rank)][1] for p in peers}

    transport.prepare(plan, rank, setup, {})
    first = {p: {"export": f"trainer-{p}-a"} for p in peers}
    fetched, opened = sync(first)
    assert fetched == peers and [m.doc for m in opened.values()] == list(first.values())
    fetched, again = sync(first)  # steady: nothing fetched, nothing reopened
    assert fetched == [] and again == opened
    transport.prepare(plan, rank, setup, {})  # a new plan: check what is published under the same generation
    fetched, same = sync(first)
    assert fetched == peers and same == opened and not any(m.closed for m in opened.values())
    transport.prepare(plan, rank, setup, {})
    restarted = {**first, peers[0]: {"export": f"trainer-{peers[0]}-restarted"}}
    _Export.lasts.clear()
    fetched, now = sync(restarted)
    assert _Export.lasts == [first[peers[0]]]  # read against the export it replaces (kept views: its bounds alone)
    assert now[peers[0]] is not opened[peers[0]] and now[peers[0]].doc == restarted[peers[0]]
    assert opened[peers[0]].closed and all(now[p] is opened[p] for p in peers[1:])
