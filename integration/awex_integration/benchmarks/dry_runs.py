"""Cluster dry runs: each ``integration/dry_runs/*.json`` planned through ``awex-meta plan`` (the command users run),
with its topology, and its numbers written to a results file: plan and verification time, the planner's peak
memory, and the cost model's estimate (an estimate, not a measurement: see docs/topology.md).

    python -m awex_integration.benchmarks.dry_runs --out integration/results/dry-run-results.json \
        [--only kimi-k2-256-to-128x16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from awex_integration.benchmarks import results_file

HERE = Path(__file__).resolve().parents[2]
KEEP = (
    "model", "model_bytes", "tensors", "trainer_ranks", "inference_ranks", "total_bytes", "waves", "buckets", "ops",
    "relayed_bytes", "plan_seconds", "verify_seconds", "coverage_ok", "max_rank_send_bytes", "max_rank_recv_bytes",
    "estimated_seconds", "nic_lower_bound_seconds", "busiest_nic_bytes", "nic_bound_bytes", "busiest_nic_over_bound",
    "useful_gbps_per_receiver", "link_bytes", "digest",
)  # fmt: skip


def command(run: dict) -> list[str]:
    argv = [sys.executable, "-m", "awex.meta.cli", "plan", "--model", str(HERE / "models" / run["model"])]
    for spec in run["trainer"]:
        argv += ["--trainer", spec]
    for spec in run["inference"]:
        argv += ["--inference", spec]
    argv += ["--fp8"] if run.get("fp8") else []
    argv += ["--wave-mb", str(run["wave_mb"])] if run.get("wave_mb") else []
    return [*argv, "--topology", run["topology"], "--json"]


def dry_run(path: Path) -> dict:
    run = json.loads(path.read_text())
    argv = command(run)
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True)
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)  # reaped here, so its own peak memory is known
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        if proc.returncode != 0:
            raise SystemExit(f"{path.name}: awex-meta plan failed:\n{err.read()[-3000:]}")
    wall = time.perf_counter() - started
    summary = json.loads(out.strip().splitlines()[-1])
    peak = usage.ru_maxrss
    return {
        "name": path.stem,
        "what": run["what"],
        "command": "awex-meta plan " + " ".join(a if " " not in a else repr(a) for a in argv[4:]),
        "wall_seconds": round(wall, 2),
        "peak_rss_bytes": peak * 1024,
        **{k: summary[k] for k in KEEP if k in summary},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="results file (JSON)")
    ap.add_argument("--only", action="append", default=[], help="run only these dry runs (by file stem)")
    args = ap.parse_args(argv)
    runs = sorted((HERE / "dry_runs").glob("*.json"))
    runs = [p for p in runs if not args.only or p.stem in args.only]
    results = []
    for path in runs:
        r = dry_run(path)
        print(
            f"{r['name']}: planned in {r['plan_seconds']:.1f} s, verified in {r['verify_seconds']:.1f} s, "
            f"peak {r['peak_rss_bytes'] / 2**30:.2f} GiB; estimate {r['estimated_seconds']:.3f} s (NIC bound "
            f"{r['nic_lower_bound_seconds']:.3f} s), busiest NIC {r['busiest_nic_over_bound']:.4f}x its bound, "
            f"{r['useful_gbps_per_receiver']:.1f} GB/s per receiver",
            flush=True,
        )
        results.append(r)
    if args.out:
        what = "Cluster dry runs: plans of real model shapes on cluster layouts, priced by the topology cost model "
        results_file.write(args.out, what + "(estimates, not measurements)", runs=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
