"""``bench_gpu --timeline`` (``awex_integration.benchmarks.timeline``): every step it names still exists (a renamed
step fails here, not silently on a GPU host), it leaves the code as it found it, and the time line it puts together
from a writer's and a reader's steps is the order a version goes in. A writer and a reader in two threads of this
process, over the CPU transport ``auto`` picks on one host (shared memory, signals on the host board)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import torch

from awex.engines.reader import WeightsReader
from awex.engines.writer import WeightsWriter
from awex.meta import canonical_tensors
from awex.meta.client import MetaClient
from awex.meta.layouts import hf_layout
from awex.meta.server import start_embedded
from awex_integration.benchmarks.timeline import STEPS, Timeline, describe, merged

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "packages" / "awex-engines" / "tests"))
from steady_counts import CONFIG, views_of  # noqa: E402
from test_moved_memory import module_of  # noqa: E402

VERSIONS = 5  # the first plans; the timeline is installed from the second and counts the last three


def test_every_step_exists_and_is_put_back():
    before = WeightsWriter.__dict__["write"]
    timeline = Timeline()
    timeline.install()
    assert len(timeline._undo) == sum(len(names) for _, _, names in STEPS)
    assert WeightsWriter.__dict__["write"] is not before
    timeline.uninstall()
    assert WeightsWriter.__dict__["write"] is before


def test_a_steady_versions_steps_line_up_in_the_order_a_version_goes():
    specs = canonical_tensors(dict(CONFIG, num_hidden_layers=2), dtype="float32")
    sent, got = (module_of({t.name: torch.zeros(t.spec.shape) for t in specs}) for _ in range(2))
    server = start_embedded()
    writer = WeightsWriter(
        MetaClient(server.address, job="timeline"), hf_layout(specs, "trainer", "out"), 0, views_of(sent)
    )
    reader = WeightsReader(
        MetaClient(server.address, job="timeline"), hf_layout(specs, "inference", "in"), 0, views_of(got)
    )
    timeline = Timeline()
    try:
        for step in range(1, VERSIONS + 1):
            if step == 2:
                timeline.install()
            for p in sent.parameters():
                p.data.fill_(float(step))
            errors: list = []
            thread = threading.Thread(
                target=lambda v=f"v{step}": errors.append(None) if reader.receive(v) else None, name="receiver"
            )
            thread.start()
            writer.write(f"v{step}", ["in"])
            thread.join(60)
            assert not thread.is_alive()
            assert all(torch.equal(a, b) for a, b in zip(sent.parameters(), got.parameters())), step
    finally:
        timeline.uninstall()
        writer.close(), reader.close()
        server.stop()
    trainer = [e for e in timeline.events if e[3] != "receiver"]
    receiver = [e for e in timeline.events if e[3] == "receiver"]
    rows = merged(trainer, receiver)
    print(describe(rows))
    at = {(r["side"], r["step"]): r for r in rows}
    assert all(r["versions"] == VERSIONS - 2 for r in rows if r["step"] == "WeightsWriter.write")
    assert at[("trainer", "WeightsWriter.write")]["start_ms"] == 0.0
    posted = at[("trainer", "HostBoard.post")]
    assert posted["end_ms"] <= at[("receiver", "HostBoard.manifest")]["end_ms"]  # seen once posted
    ready = at[("trainer", "SyncPeerLink.ready")]
    assert ready["start_ms"] <= at[("receiver", "SyncPeerLink.await_ready")]["end_ms"]  # the bytes move once ready
    finished = at[("receiver", "SyncSession.finish")]
    outcomes = at[("trainer", "SyncSession.await_outcomes")]
    assert finished["start_ms"] <= outcomes["end_ms"] <= at[("trainer", "WeightsWriter.write")]["end_ms"]
    assert at[("trainer", "Announcer.report_sent")]["start_ms"] >= outcomes["end_ms"]  # reported once applied
