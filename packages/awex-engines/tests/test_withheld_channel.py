"""A trainer rank that fails a version after it was announced, before its bytes were ready, over the version channel
(no host board: the signals go as they go between hosts), tells its receivers (``Signals.withhold``): under its own
ready key, or through its host's relay lead and the first trainer rank's key of every ready signal. Every rank's
wait ends in moments, not at its deadline, nothing moves into a receiver from the failed rank, and the retry lands
exactly the trainer's bytes."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from awex.engines.reader import WeightsReader
from awex.engines.sync.board import HostBoard
from awex.engines.writer import WeightsWriter
from awex.meta import canonical_tensors
from awex.meta.client import MetaClient
from awex.meta.layouts import MegatronParallel, VllmParallel, megatron_layout, vllm_layout
from awex.meta.server import start_embedded
from awex.transport.base import TransferError

CONFIG = json.loads((Path(__file__).resolve().parents[3] / "integration" / "models" / "qwen2-tiny.json").read_text())
TENSORS = canonical_tensors(CONFIG, dtype="float32")
DEADLINE = 30.0  # every rank's timeout: what its wait for the failed rank took before
PROMPT = 5.0  # what "in moments" allows here


def _views(params):
    return lambda name, box: params[name][box.slices()]


@pytest.mark.parametrize(
    "tp, failing",
    [(1, 0), (2, 1), (2, 0)],
    ids=["alone-on-its-host", "through-its-lead", "the-lead-and-first-rank"],
)
def test_a_trainer_rank_that_fails_after_the_announcement_tells_its_receivers_over_the_channel(
    monkeypatch, tp, failing
):
    monkeypatch.setattr(HostBoard, "create", staticmethod(lambda: (_ for _ in ()).throw(OSError("no /dev/shm"))))
    server = start_embedded()
    sent = {t.name: torch.zeros(t.spec.shape) for t in TENSORS}
    got = [{t.name: torch.full(t.spec.shape, -1.0) for t in TENSORS} for _ in range(tp)]
    now = {"failing": False}

    def refresh(rank):
        def step():  # the trainer's own step before its bytes are ready (here: after the version was announced)
            if now["failing"] and rank == failing:
                raise RuntimeError(f"trainer rank {rank}'s refresh failed")

        return step

    def client():
        return MetaClient(server.address, job=f"withheld-channel-{tp}-{failing}", timeout=30)

    trainer = megatron_layout(TENSORS, MegatronParallel(tp=tp), instance="trainer")
    engine = vllm_layout(TENSORS, VllmParallel(tp=tp), instance="vllm-0")
    writers = [
        WeightsWriter(client(), trainer, r, _views(sent), timeout=DEADLINE, refresh=refresh(r), transport="shm")
        for r in range(tp)
    ]
    readers = [WeightsReader(client(), engine, r, _views(got[r]), timeout=DEADLINE) for r in range(tp)]
    try:
        for step, version in enumerate(("v1", "v2", "v3", "v3"), start=1):
            now["failing"] = step == 3
            for t in sent.values():
                t.fill_(float(step))
            errors: dict = {}
            took: dict = {}

            def run(who, fn, *args):
                started = time.monotonic()
                try:
                    fn(*args)
                except Exception as e:  # noqa: BLE001 - asserted below
                    errors[who] = e
                took[who] = time.monotonic() - started

            threads = [threading.Thread(target=run, args=(f"r{r}", x.receive, version)) for r, x in enumerate(readers)]
            threads += [
                threading.Thread(target=run, args=(f"w{r}", w.write, version, ["vllm-0"]))
                for r, w in enumerate(writers)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(DEADLINE + 15)
            assert not any(t.is_alive() for t in threads)
            if not now["failing"]:
                assert not errors, errors
                for r in range(tp):  # each receiver's share of every tensor holds this version's bytes, exactly
                    assert _holds(got[r], engine, r, sent, 0.0), (version, r)
                continue
            assert writers[0]._session.signals.medium == "channel"
            assert isinstance(errors[f"w{failing}"], RuntimeError), errors
            assert all(f"w{r}" in errors for r in range(tp)), errors  # the version failed on every trainer rank
            told = [r for r in range(tp) if isinstance(errors.get(f"r{r}"), TransferError)]
            assert f"r{failing}" in errors and told, errors  # the failed rank's receiver (vLLM rank r reads trainer r)
            assert all(
                "'v3' from sender trainer:" in str(errors[f"r{r}"]) and "withheld" in str(errors[f"r{r}"]) for r in told
            )
            assert max(took.values()) < PROMPT, took  # not the 30-s deadline
            for r in told:  # told before any byte moved: still the last version's bytes, exactly
                assert _holds(got[r], engine, r, sent, 1.0), r
    finally:
        for side in (*writers, *readers):
            side.close()
        server.stop()


def _holds(got: dict, engine, rank: int, sent: dict, behind: float) -> bool:
    """Whether receiving rank ``rank``'s share of every tensor holds the trainer's bytes less ``behind`` (one version
    back: each version's bytes are the last one's plus one)."""
    return all(
        torch.equal(got[name][box.slices()], sent[name][box.slices()] - behind)
        for name, held in engine.rank_boxes(rank).items()
        for box in held
    )
