"""awex.engines.sglang without SGLang: the request that crosses into SGLang's workers is checked field by field,
and a model whose parameters are not the mapped ones is refused before any byte moves. (The binding receiving
into SGLang's own model classes runs in the ``sglang_layout`` nox session; a live server in
integration/tests/test_sglang_server.py, on CUDA machines with SGLang.)"""

from __future__ import annotations

import http.server
import json
import threading

import pytest
import torch

from awex.engines.sglang import (
    LOADER,
    REQUEST_PREFIX,
    AwexSglangInfo,
    SglangHttpUpdater,
    SglangUpdateRequest,
    check_params,
    receive_weights,
)


def test_request_round_trips_through_a_tensor_name():
    request = SglangUpdateRequest("step-3", AwexSglangInfo("127.0.0.1:5000", "sglang-1", "grpo", "secret", 30.0))
    named = request.to_named_tensors()
    assert len(named) == 1 and named[0][0].startswith(REQUEST_PREFIX) and named[0][1].numel() == 0
    assert SglangUpdateRequest.from_named_tensors(named) == request


def _named(body) -> list:
    return [(REQUEST_PREFIX + (body if isinstance(body, str) else json.dumps(body)), torch.empty(0))]


@pytest.mark.parametrize(
    ("named", "error"),
    [
        ([("model.embed_tokens.weight", torch.zeros(2))], "expects one request"),
        (_named("{not json"), "not JSON"),
        (_named([1, 2]), "JSON object"),
        (_named({"version": "v"}), "missing \\['meta_address'\\]"),
        (_named({"version": "v", "meta_address": "a", "pickle": "x"}), "unknown \\['pickle'\\]"),
        (_named({"version": "v", "meta_address": "a", "timeout": "10"}), "'timeout' has type str"),
        (_named({"version": "", "meta_address": "a"}), "non-empty"),
        (_named({"version": "v", "meta_address": "a", "timeout": 0}), "timeout positive"),
    ],
)
def test_bad_requests_are_refused_naming_the_problem(named, error):
    with pytest.raises(ValueError, match=error):
        SglangUpdateRequest.from_named_tensors(named)


def test_receive_weights_refuses_a_bad_request_before_touching_the_model():
    model = torch.nn.Linear(2, 2)

    def runtime():
        raise AssertionError("the runtime must not be asked for a refused request")

    with pytest.raises(ValueError, match="expects one request"):
        receive_weights(model, [("w", torch.zeros(1))], runtime=runtime)


def test_unmapped_parameters_are_refused_listing_the_differences():
    params = {"a": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.float16)}
    check_params(params, {"a": ((2, 3), torch.float32), "b": ((4,), torch.float16)})
    with pytest.raises(
        ValueError, match=r"2 differ.*b: SGLang \(\(4,\), torch.float16\), Awex \(\(4,\), torch.bfloat16\)"
    ):
        check_params(params, {"a": ((3, 2), torch.float32), "b": ((4,), torch.bfloat16)})


@pytest.mark.parametrize(("pause", "error"), [("stop", "pause mode"), ("retract", "pause mode"), ("wait", "no SGLang")])
def test_http_updater_takes_the_shared_pause_policy_names(pause, error):
    with pytest.raises(ValueError, match=error):
        SglangHttpUpdater("http://x", AwexSglangInfo("a"), pause=pause)
    assert LOADER == "awex.engines.sglang.receive_weights"


class JsonRoutes(http.server.BaseHTTPRequestHandler):
    """HTTP routes taking and answering JSON, quietly (the stand-ins of SGLang's server in these tests)."""

    def body(self) -> dict:
        return json.loads(self.rfile.read(int(self.headers["Content-Length"])))

    def answer(self, out: dict) -> None:
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


class _Sglang(JsonRoutes):
    """SGLang's RL routes as a stub: records each call; the update succeeds unless the version says ``bad``."""

    calls: list = []

    def do_POST(self):
        body = self.body()
        self.calls.append((self.path, body.get("mode", body.get("weight_version"))))
        ok = "bad" not in str(body.get("weight_version"))
        self.answer({"success": ok, "message": "" if ok else "loader raised"} if "update" in self.path else {})


@pytest.fixture
def sglang_stub():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Sglang)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Sglang.calls = []
    yield f"http://127.0.0.1:{server.server_address[1]}", _Sglang.calls
    server.shutdown()


@pytest.mark.parametrize(("pause", "mode"), [("keep", "retract"), ("abort", "abort"), ("none", None)])
def test_http_updater_pauses_in_sglangs_mode_and_stays_paused_after_a_failure(sglang_stub, pause, mode, monkeypatch):
    url, calls = sglang_stub
    monkeypatch.setattr(SglangHttpUpdater, "_serialize", staticmethod(lambda named: "payload"))
    updater = SglangHttpUpdater(url, AwexSglangInfo("127.0.0.1:1", "sglang-0"), pause=pause)
    updater.update("step-1")
    paused = [("/pause_generation", mode)] if mode else []
    resumed = [("/continue_generation", None)] if mode else []
    assert calls == [*paused, ("/update_weights_from_tensor", "step-1"), *resumed]

    calls.clear()  # a failed in-place update: paused it stays (not resumed on mixed weights), and says so
    with pytest.raises(RuntimeError, match="stays paused" if mode else "did not apply bad-2"):
        updater.update("bad-2")
    assert calls == [*paused, ("/update_weights_from_tensor", "bad-2")]
    assert updater.left_paused is bool(mode)

    calls.clear()  # the next version that applies resumes it
    updater.update("step-3")
    assert calls[-1] == (resumed[0] if mode else ("/update_weights_from_tensor", "step-3"))
    assert updater.left_paused is False


def test_a_steady_receive_asks_no_view_and_moved_weights_are_re_pointed():
    """SGLang views carry a fingerprint of the rank's parameters: a steady version checks where each is, asking no
    view (it derived all of them every version), and after the engine re-allocates its weights each view lies where
    deriving it again puts it, re-pointed without asking."""
    from steady_counts import counted

    from awex.convert.sglang import sglang_param_dtypes, sglang_param_shapes, sglang_views
    from awex.meta.layouts import SglangParallel, sglang_engine_layout
    from awex.meta.models import model_dims
    from awex.transport import LocalShards
    from awex.transport.rebind import rebound

    config = dict(architectures=["Qwen3ForCausalLM"], hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, vocab_size=1000, intermediate_size=96, num_hidden_layers=2)  # fmt: skip
    parallel, rank = SglangParallel(tp=2), 1
    dims = model_dims(config, "float32")
    shapes = sglang_param_shapes(dims, parallel, rank)
    dtypes = sglang_param_dtypes(shapes, "float32")
    model = torch.nn.Module()
    for name, shape in shapes.items():
        model.register_parameter(name.replace(".", "__"), torch.nn.Parameter(torch.randn(shape).to(dtypes[name])))
    params = {name: getattr(model, name.replace(".", "__")) for name in shapes}
    layout = sglang_engine_layout(config, "float32", parallel, instance="sglang-0")
    derive = sglang_views(params, dims, parallel, rank)
    view_of, calls = counted(derive)
    held, _ = rebound(layout, rank, view_of, LocalShards.from_layout(layout, rank, view_of), quick=True)
    calls.clear()
    assert rebound(layout, rank, view_of, held, quick=True) == (held, []) and calls == []
    for p in params.values():  # the engine's weights re-allocated (released and reloaded)
        p.data = p.data.clone()
    now, moved = rebound(layout, rank, view_of, held, quick=True)
    assert calls == [] and moved and now.moved(LocalShards.from_layout(layout, rank, derive)) == []
