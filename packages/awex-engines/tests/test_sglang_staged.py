"""SGLang receiving staged (``AwexSglangInfo(receive="staged")``): each worker receives a version into staging on a
thread while SGLang generates and applies it only on the commit; the HTTP updater pauses in place around the steps
that start or drop it (nothing changes the weights there) and in the user's mode for the commit alone; a version
that fails before its commit is dropped, the engine never paused for it; a rank over its staging budget makes the
engine go in place, said. An SGLang server cannot run here (it needs CUDA): the routes are served by a small HTTP
server that calls Awex's loader (``receive_weights``) on a model with SGLang's parameter names and shapes, as
SGLang's scheduler would; the trainer is a ``WeightsWriter`` over shared memory."""

from __future__ import annotations

import http.server
import json
import threading
from types import SimpleNamespace

import pytest
import torch
from test_sglang_binding import JsonRoutes
from test_staged_version import _write
from test_version_signals import CONFIG, TENSORS, views

from awex.convert.sglang import sglang_param_shapes, sglang_views
from awex.engines.sglang import (
    AwexSglangInfo,
    SglangHttpUpdater,
    SglangUpdateRequest,
    close_receivers,
    receive_weights,
)
from awex.engines.sync import keys
from awex.engines.writer import WeightsWriter
from awex.meta.client import MetaClient
from awex.meta.layouts import SglangParallel, hf_layout, sglang_engine_layout
from awex.meta.models import model_dims
from awex.meta.server import start_embedded
from awex.transport import LocalShards

PARALLEL = SglangParallel(tp=1)


class Model:
    """SGLang's parameters of the model, by name (what Awex's loader reads of SGLang's live model)."""

    def __init__(self):
        shapes = sglang_param_shapes(model_dims(CONFIG, "float32"), PARALLEL, 0)
        self.params = {n: torch.zeros(s) for n, s in shapes.items()}
        self.config = SimpleNamespace(to_dict=lambda: dict(CONFIG))

    def named_parameters(self):
        return iter(self.params.items())

    def holds(self, weights: dict[str, torch.Tensor]) -> bool:
        """Whether every canonical tensor's box reads as ``weights`` through SGLang's views."""
        layout = sglang_engine_layout(CONFIG, "float32", PARALLEL, instance="sglang")
        dims = model_dims(CONFIG, "float32")
        shards = LocalShards.from_layout(layout, 0, sglang_views(self.params, dims, PARALLEL, 0))
        return all(torch.equal(v, weights[n][b.slices()]) for n in shards.names() for b, v in shards.pairs(n))

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in self.params.items()}

    def same(self, snap: dict[str, torch.Tensor]) -> bool:
        return all(torch.equal(self.params[n], t) for n, t in snap.items())


class _Sglang(JsonRoutes):
    """SGLang's RL routes: pause and continue are recorded (``paused``), an update calls Awex's loader on ``model``
    with the request as SGLang's scheduler would, and answers SGLang's ``success``/``message``."""

    model: Model
    calls: list
    paused: list

    def do_POST(self):
        body = self.body()
        out: dict = {}
        if self.path == "/pause_generation":
            self.paused.append(body["mode"])
        elif self.path == "/continue_generation":
            self.paused.clear()
        else:
            name = json.loads(body["serialized_named_tensors"][0])
            step = json.loads(name.split(":", 1)[1])["step"]
            self.calls.append((tuple(self.paused), step, body["flush_cache"], body.get("weight_version")))
            try:
                receive_weights(self.model, [(name, torch.empty(0))], runtime=lambda: (PARALLEL, 0))
                out = {"success": True, "message": ""}
            except Exception as e:
                out = {"success": False, "message": f"{type(e).__name__}: {e}"}
        self.answer(out)


@pytest.fixture
def sglang(monkeypatch):
    """(url, model, calls): a served stand-in of SGLang's routes over a fresh model."""
    monkeypatch.setattr(SglangHttpUpdater, "_serialize", staticmethod(lambda named: json.dumps(named[0][0])))
    _Sglang.model, _Sglang.calls, _Sglang.paused = Model(), [], []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Sglang)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _Sglang.model, _Sglang.calls
    server.shutdown()
    close_receivers()


@pytest.fixture
def meta():
    s = start_embedded()
    yield s
    s.stop()


def _trainer(meta, job: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    weights = {t.name: torch.randn(t.spec.shape, generator=g) for t in TENSORS}
    client = MetaClient(meta.address, job=job, timeout=30)
    return weights, WeightsWriter(client, hf_layout(TENSORS, "trainer", "trainer"), 0, views(weights), transport="shm")


def _writing(writer, version: str) -> tuple[threading.Thread, dict]:
    out: dict = {}
    return _write(writer, version, out, ["sglang"]), out


def test_a_staged_version_arrives_unpaused_and_only_its_commit_pauses(sglang, meta):
    url, model, calls = sglang
    weights, writer = _trainer(meta, "sg-staged", 1)
    info = AwexSglangInfo(meta.address, "sglang", job="sg-staged", timeout=20, receive="staged", staging="host")
    updater = SglangHttpUpdater(url, info)
    try:
        for version in ("step-1", "step-2"):
            for w in weights.values():
                w.add_(1)
            t, out = _writing(writer, version)
            stall = updater.update(version)
            t.join(30)
            assert "error" not in out, out.get("error")
            assert model.holds(weights) and not updater.left_paused and _Sglang.paused == []
            assert stall.commit_seconds is not None and 0 < stall.commit_seconds <= stall.stall_seconds, stall
        stage = [(("in_place",), "stage", False, None), (("retract",), "commit", True, "step-2")]
        assert calls[0] == (("in_place",), "prepare", False, None) and calls[-2:] == stage
        said = MetaClient(meta.address, job="sg-staged").get(keys.staging("sglang", 0), timeout=5)
        assert said["staged"] and said["where"] == "host", said
    finally:
        writer.close()


def test_a_version_that_fails_before_its_commit_is_dropped_and_the_engine_was_never_paused_for_it(sglang, meta):
    """The trainer never writes: no rank holds the version by the deadline; the updater drops it (a pause in place
    around the request, nothing changed), raises, and the engine serves its previous weights, resumed. The next
    version goes; a second version while one is staged is refused on the worker, never mixed."""
    url, model, calls = sglang
    weights, writer = _trainer(meta, "sg-drop", 2)
    info = AwexSglangInfo(meta.address, "sglang", job="sg-drop", timeout=3, receive="staged")
    updater = SglangHttpUpdater(url, info)
    try:
        t, out = _writing(writer, "step-1")
        updater.update("step-1")
        t.join(30)
        before = model.snapshot()
        with pytest.raises(RuntimeError, match="did not stage step-2; dropped before its commit, never paused"):
            updater.update("step-2")  # nothing writes step-2
        assert calls[-1] == (("in_place",), "drop", False, None) and _Sglang.paused == []
        assert model.same(before) and not updater.left_paused

        # on the worker: a version held staged is never mixed with another; dropped at the gate, nothing changes
        t, out = _writing(writer, "step-3")
        receive_weights(model, SglangUpdateRequest("step-3", info, step="stage").to_named_tensors())
        MetaClient(meta.address, job="sg-drop").get(keys.staged("step-3", "sglang", 0), timeout=20)
        with pytest.raises(RuntimeError, match="'step-3' is staged and not yet committed or dropped"):
            receive_weights(model, SglangUpdateRequest("step-4", info, step="stage").to_named_tensors())
        receive_weights(model, SglangUpdateRequest("step-3", info, step="drop").to_named_tensors())
        t.join(30)
        assert "was not applied" in str(out.get("error")) and model.same(before)

        for w in weights.values():
            w.mul_(2)
        t, out = _writing(writer, "step-5")
        updater.update("step-5")
        t.join(30)
        assert "error" not in out and model.holds(weights)
    finally:
        writer.close()


def test_a_rank_over_its_staging_budget_makes_the_engine_update_in_place_and_says_why(sglang, meta, caplog):
    url, model, calls = sglang
    weights, writer = _trainer(meta, "sg-budget", 3)
    info = AwexSglangInfo(
        meta.address, "sglang", job="sg-budget", timeout=20, receive="staged", staging_budget_bytes=64
    )
    updater = SglangHttpUpdater(url, info)
    try:
        t, out = _writing(writer, "step-1")
        assert updater.update("step-1") is None  # in place: no staged stall to report
        t.join(30)
        assert "error" not in out and model.holds(weights) and updater.staged is False
        assert calls[-1] == (("retract",), None, True, "step-1")  # paused for the whole transfer
        assert "does not fit the staging budget (64 bytes)" in caplog.text
    finally:
        writer.close()


def test_staged_options_are_checked_where_they_are_given():
    with pytest.raises(ValueError, match="receive='eager'"):
        AwexSglangInfo("127.0.0.1:1", receive="eager")
    with pytest.raises(ValueError, match="staging='host' is for receive='staged'"):
        AwexSglangInfo("127.0.0.1:1", staging="host")
    body = SglangUpdateRequest("v", AwexSglangInfo("127.0.0.1:1", receive="staged"), step="later").to_named_tensors()
    with pytest.raises(ValueError, match="request step 'later'"):
        SglangUpdateRequest.from_named_tensors(body)
