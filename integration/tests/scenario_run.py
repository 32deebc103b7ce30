"""Run the scenario runner in a subprocess and return its JSON result (shared by the integration tests; needs no
engine itself, so tests of HF-only or Megatron-only scenarios run where vLLM is not installed)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from conftest import HERE

from awex_integration.scenarios.scenario_results import ScenarioResult


def run_scenario(args: list[str], timeout: float = 600, env: dict | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(HERE.parent), **(env or {})}
    if "vllm" in args and "vllm-http" not in args and "--launcher" not in args:
        args = [*args, "--check-in-place"]
    out = subprocess.run(
        [sys.executable, "-m", "awex_integration.scenarios.scenario", "--steps", "2", "--timeout", "120", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no result (exit {out.returncode}):\n{errors(out.stdout + out.stderr)}\n{out.stderr[-3000:]}"
    result = json.loads(lines[-1])
    ScenarioResult.from_json(result)  # one schema: a field the record does not name fails here
    return result


def errors(text: str, limit: int = 40) -> str:
    """The error lines of a scenario's output (each rank's, the driver's traceback), without C++ stack frames:
    a failure's tail is often one rank's frames and hides which rank failed first."""
    keep = [
        line[:500]
        for line in text.splitlines()
        if re.search(r"ERROR|Error|Traceback|^\s+File ", line) and "frame #" not in line
    ]
    return "\n".join(keep[-limit:])
