"""Run the scenario runner in a subprocess and return its JSON result (shared by the integration tests; needs no
engine itself, so tests of HF-only or Megatron-only scenarios run where vLLM is not installed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import HERE


def run_scenario(args: list[str], timeout: float = 600, env: dict | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(HERE.parent), **(env or {})}
    if "vllm" in args and "vllm-http" not in args and "--launcher" not in args:
        args = [*args, "--check-in-place"]
    out = subprocess.run(
        [sys.executable, "-m", "awex_integration.scenario", "--steps", "2", "--timeout", "120", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no result (exit {out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    return json.loads(lines[-1])
