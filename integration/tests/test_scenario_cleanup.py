"""The scenario runner's own behaviour: it removes its temporary folder (the tiny model and a reference checkpoint per
step, about 190 MB a run: the integration matrix runs it well over a hundred times per CI run), and an engine that
fails to start ends the run at once."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import HERE
from scenario_run import run_scenario

pytest.importorskip("transformers", reason="transformers is not installed in this environment")


def test_a_scenario_run_leaves_nothing_in_the_temporary_folder(tmp_path):
    result = run_scenario(["--trainer", "hf", "--inference", "hf"], env={"TMPDIR": str(tmp_path)})
    assert result["ok"] and result["tensors_mismatched"] == 0
    assert not list(tmp_path.glob("awex-scenario-*")), sorted(p.name for p in tmp_path.iterdir())


def test_engines_that_fail_once_the_trainer_ranks_are_up_stop_them_at_once(tmp_path):
    """Engines that fail to start late (the trainer ranks started beside them are up and waiting for a first
    version) end the run with their error at once: the runner tells the trainer ranks to stop instead of leaving them
    to wait (until the run's deadline, 180 s here)."""
    from awex_integration.scenarios.scenario import FAIL_ENGINES

    env = {**os.environ, "PYTHONPATH": str(HERE.parent), "TMPDIR": str(tmp_path), FAIL_ENGINES: "1"}
    out = subprocess.run(  # without the stop: the trainers keep the run going past this
        [sys.executable, "-m", "awex_integration.scenarios.scenario", "--steps", "1", "--timeout", "60"]
        + ["--trainer", "hf", "--inference", "hf"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode != 0
    assert f"the engines did not start ({FAIL_ENGINES}=1)" in out.stderr, out.stderr[-3000:]
    assert not list(tmp_path.glob("awex-scenario-*"))
