"""awex.engines.sglang without SGLang: the request that crosses into SGLang's workers is checked field by field,
and a model whose parameters are not the mapped ones is refused before any byte moves. (The binding receiving
into SGLang's own model classes runs in the ``sglang_layout`` nox session; a live server in
integration/tests/test_sglang_server.py, on CUDA machines with SGLang.)"""

from __future__ import annotations

import json

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


def test_http_updater_checks_its_pause_mode():
    with pytest.raises(ValueError, match="pause_mode"):
        SglangHttpUpdater("http://x", AwexSglangInfo("a"), pause_mode="stop")
    assert LOADER == "awex.engines.sglang.receive_weights"
