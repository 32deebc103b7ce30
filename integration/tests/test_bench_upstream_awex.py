"""The upstream awex 0.9.0 baseline of the GPU benchmark runs its transfer core correctly (here on CPU, gloo).

The wheel is fetched from the package index into a temporary directory and never installed (its top-level
package is also called ``awex``); skipped where the index cannot be reached."""

from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest

from awex.transport.net import free_port
from awex_integration.benchmarks import bench_common
from awex_integration.benchmarks.bench_upstream_awex import run, scenario_spec


@pytest.fixture(scope="module")
def upstream_dir(tmp_path_factory):
    where = tmp_path_factory.mktemp("awex-0.9.0")
    got = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(where), "awex==0.9.0"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    wheels = list(where.glob("awex-0.9.0-*.whl"))
    if got.returncode != 0 or not wheels:
        pytest.skip(f"awex 0.9.0 wheel not available from the package index: {got.stderr.strip()[-300:]}")
    with zipfile.ZipFile(wheels[0]) as z:
        z.extractall(where / "unpacked")
    return str(where / "unpacked")


@pytest.mark.parametrize("name", ["mcore_tp2_to_2x_vllm_tp1", "1gpu_to_3_instances"])
def test_upstream_awex_transfer_core_delivers_every_box(upstream_dir, tmp_path, name):
    scenario = next(s for s in bench_common.SCENARIOS if s.name == name)
    _, tensors = bench_common.model_tensors("qwen2-tiny", None)
    layouts = bench_common.layouts_of(scenario, tensors)
    spec = scenario_spec(scenario, tensors, layouts, 2, str(tmp_path), free_port())
    # upstream numbers inference ranks first, then the trainer's
    assert [r["role"] for r in spec["ranks"]] == ["inference"] * (len(spec["ranks"]) - spec["trainer_ranks"]) + [
        "trainer"
    ] * spec["trainer_ranks"]
    result = run(upstream_dir, spec, timeout=240)
    assert "error" not in result, result.get("error")
    assert result["correct"], result["mismatches"]  # receivers compare every box with the trainer's values
    assert result["version"] == "awex 0.9.0" and len(result["update_seconds_all"]) == 2
