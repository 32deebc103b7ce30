"""Megatron-core 0.12's GroupedMLP experts (MindSpeed's ``--moe-grouped-gemm`` on Ascend) through Awex's Megatron
views: Megatron's own forward with Awex-written weights equals every canonical expert, and swapped gate/up
weights are caught (``awex_integration.checks.grouped_mlp_check``, in a process with megatron-core 0.12.1 first on the
path; the ``tests`` nox session installs it into its own folder and says where with ``AWEX_MEGATRON_012``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[1]
MEGATRON_012 = os.environ.get("AWEX_MEGATRON_012")
pytestmark = pytest.mark.skipif(
    not MEGATRON_012 or not Path(MEGATRON_012, "megatron").is_dir(),
    reason="needs megatron-core 0.12.1 in AWEX_MEGATRON_012 (nox -s tests installs it there)",
)


@pytest.mark.parametrize("self_test", [False, True], ids=["awex-views", "swapped-gate-up-is-caught"])
def test_grouped_mlp_forward_matches_canonical_experts(self_test):
    cmd = [sys.executable, "-m", "awex_integration.checks.grouped_mlp_check", "--megatron", MEGATRON_012]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(cmd + (["--self-test"] if self_test else []), capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "megatron-core 0.12.1" in out.stdout, out.stdout
