"""What a sync tells its caller and operators: ``write``/``receive`` return the split of the sync's time by phase
(planning, agreement, group set-up, transfer, ...) and whether it planned anew; the first sync of a plan logs
that split at INFO; the MetaServer's status shows each instance's last version with its bytes and time."""

from __future__ import annotations

import logging
import threading
import time

from test_version_signals import TENSORS, make_writer, server, tensors, views  # noqa: F401  (fixture)

from awex.engines.reader import WeightsReader
from awex.meta.client import MetaClient
from awex.meta.layouts import hf_layout


def test_stats_split_by_phase_logs_of_a_new_plan_and_the_status_of_the_last_sync(server, caplog):  # noqa: F811
    caplog.set_level(logging.INFO, logger="awex.engines")
    sent, got = tensors(1.0), tensors(-1.0)
    writer = make_writer(server, sent)
    reader = WeightsReader(
        MetaClient(server.address, job="signals", timeout=60), hf_layout(TENSORS, "inference", "hf-in"), 0, views(got)
    )
    results = []
    for step in (1, 2):
        received: list = []
        t = threading.Thread(target=lambda v=f"v{step}": received.append(reader.receive(v)))
        t.start()
        written = writer.write(f"v{step}", ["hf-in"])
        t.join(60)
        results.append((written, received[0]))
    (w1, r1), (w2, r2) = results
    for stats in (w1, r1):
        assert stats.planned
        assert {"plan", "agreement", "transfer", "total"} <= set(stats.phases), stats.phases
        assert all(v >= 0 for v in stats.phases.values())
        assert stats.phases["total"] >= stats.phases["transfer"]
    assert not w2.planned and not r2.planned and "plan" not in w2.phases  # the plan was reused
    # a steady version's control, step by step (the benchmark prints them: a regression shows its step)
    assert {"fingerprint", "claim", "post", "manifest", "confirm", "done", "total"} <= set(w2.phases), w2.phases
    assert {"manifest", "fingerprint", "ready_wait", "open", "transfer", "done", "total"} <= set(r2.phases), r2.phases
    assert w2.phases["claim"] + w2.phases["post"] <= w2.phases["manifest"] <= w2.phases["total"]
    lines = [r.getMessage() for r in caplog.records if r.name == "awex.engines"]
    first = [m for m in lines if "v1:" in m and "new plan" in m]
    assert len(first) == 2, lines  # the writer's and the reader's, each with the phases
    assert all("agreement" in m and "transfer" in m and "buckets" in m for m in first), first
    assert not any("v2:" in m and "new plan" in m for m in lines), lines

    model_bytes = sum(t.spec.nbytes for t in TENSORS)
    client = MetaClient(server.address, job="signals", timeout=10)
    deadline = time.monotonic() + 10
    while True:  # rank 0 reports after the write returns, in the background
        status = {p["name"]: p for p in client.status()["jobs"]["signals"]["participants"]}
        last = (status.get("hf-in") or {}).get("last_sync") or {}
        if last.get("version") == "v2" or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert last.get("version") == "v2", status
    assert last["bytes"] == model_bytes and last["seconds"] > 0 and last["at"] > 0
    writer.close()
    reader.close()
