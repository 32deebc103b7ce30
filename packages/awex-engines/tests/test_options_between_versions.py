"""A writer option changed between versions takes effect on the next version, and the version before and after
arrive whole (the line-rate work keeps a steady version's manifest and plan between versions: a change must not be
missed by that). Gloo and shared memory on CPU, one trainer rank and one engine rank."""

from __future__ import annotations

import pytest
import torch
from test_fencing import _reader as reader_for
from test_version_signals import make_writer, sync, tensors

from awex.meta.server import start_embedded


@pytest.fixture
def server():
    with start_embedded() as s:
        yield s


def test_transport_verify_delta_and_wave_size_changed_between_versions_take_effect(server):
    sent, got = tensors(1.0), tensors(-1.0)
    writer, reader = make_writer(server, sent), reader_for(server, got)
    writer.transport = "p2p"
    step = 0

    def version() -> dict:
        nonlocal step
        step += 1
        for t in sent.values():
            t.fill_(float(step))
        sync(writer, reader, f"v{step}")
        stats = writer.last_stats
        assert all(torch.equal(got[n], sent[n]) for n in sent), f"v{step}: not every byte arrived"
        return {"transport": writer.transport_in_use, "verify": "verify" in stats.phases, "planned": stats.planned,
                "dense": stats.bytes_dense, "waves": writer._session.plan.stats.waves}  # fmt: skip

    first = version()
    assert first["transport"] == "p2p" and not first["verify"] and first["planned"]
    steady = version()
    assert steady == {**first, "planned": False}  # nothing changed: the plan is kept
    writer.verify = True
    assert version()["verify"]  # digests compared from the very next version
    writer.verify = False
    assert not version()["verify"]
    writer.wave_bytes = 4096
    small = version()
    assert small["planned"] and small["waves"] > first["waves"], small  # planned anew, in smaller waves
    writer.transport = "shm"
    assert version()["transport"] == "shm"
    writer.transport, writer.delta = "p2p", True
    delta = [version(), version()]
    assert delta[0]["transport"] == "p2p" and all(d["dense"] > 0 for d in delta)  # delta syncs say their dense bytes
    writer.delta = False
    assert version()["dense"] == 0
    writer.close()
    reader.close()
