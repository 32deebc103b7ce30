"""The scenario runner removes its temporary folder (the tiny model and a reference checkpoint per step, about
190 MB a run): the integration matrix runs it well over a hundred times per CI run."""

from __future__ import annotations

import pytest
from scenario_run import run_scenario

pytest.importorskip("transformers", reason="transformers is not installed in this environment")


def test_a_scenario_run_leaves_nothing_in_the_temporary_folder(tmp_path):
    result = run_scenario(["--trainer", "hf", "--inference", "hf"], env={"TMPDIR": str(tmp_path)})
    assert result["ok"] and result["tensors_mismatched"] == 0
    assert not list(tmp_path.glob("awex-scenario-*")), sorted(p.name for p in tmp_path.iterdir())
