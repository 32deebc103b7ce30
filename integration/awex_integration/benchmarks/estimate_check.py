"""The topology cost model against GPU benchmark rows: each row's plan priced by :func:`awex.meta.estimate_seconds`
with the link rates that the same benchmark run measured, next to the time the row measured.

Per row: the plan the row ran (its scenario's layouts and the public path's options: relays for NCCL, pieces from
the same GPU for CUDA IPC), ranks placed on the row's GPUs of one node; rates: NVLink at the run's NCCL pair rate
(NCCL rows) or its copy-engine peer rate (CUDA IPC), copies on one GPU at its device copy rate, and for host
shared memory each GPU's bytes through host memory at the "D2H while H2D" rate. Rows of the public path that
measured it (``per_sync_seconds``: the same scenario with a model of a few MB, in the same run) add what a sync
costs whatever its size: signals, the version's manifest, the engines' hooks.

    python -m awex_integration.benchmarks.estimate_check \
        integration/results/bench-results-public-2xh200.json [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from awex.meta import PlanOptions, Role, Topology, estimate_seconds, plan_transfers
from awex.meta.topology import Placement
from awex_integration.benchmarks.bench_common import SCENARIOS, layouts_of, model_tensors, scenario_devices


def limits_of(doc: dict, row: dict) -> dict:
    limits = doc["limits"]
    if "pair_bps" not in limits:  # one block per path
        limits = limits["public" if row.get("path", "").startswith("public") else "executor"]
    return limits


def predict(doc: dict, row: dict, tensors=None, layouts=None, per_sync_seconds: float | None = None) -> dict:
    """``row`` priced with the limits in ``doc``; ``tensors``: the row's canonical tensors (default: the full model
    its ``model`` names), ``layouts``: the row's layouts (default: its scenario's over ``tensors``; give them where
    the run quantised them); ``per_sync_seconds``: what a sync on the row's path costs whatever its size, added
    to the links' time (default: the row's own ``per_sync_seconds`` where the run measured it, else 0)."""
    sc = next(s for s in SCENARIOS if s.name == row["name"])
    if layouts is None:
        if tensors is None:
            _, tensors = model_tensors(row["model"].split(" ")[0], None)
        layouts = layouts_of(sc, tensors)
    src = [x for x in layouts if x.role == Role.TRAINER]
    dst = [x for x in layouts if x.role == Role.INFERENCE]
    ipc = sc.transport in ("ipc", "shm")
    plan = plan_transfers(
        src, dst, PlanOptions(relay=sc.transport == "nccl", devices=scenario_devices(sc) if ipc else ())
    )
    limits = limits_of(doc, row)
    link = {"nccl": "pair_bps", "ipc": "dma_bps", "shm": "d2h_while_h2d_bps"}[sc.transport]
    if link not in limits and sc.gpus == 1 and sc.transport != "shm":
        link = "copy_bps"  # one GPU: no link between GPUs was measured, and none is used
    gpu = {r.rank: next(e for e in sc.engines if e.instance == r.instance).gpus[r.local_rank] for r in plan.ranks}
    topology = Topology(
        gpus_per_node=sc.gpus, nvlink_gbps=limits[link] * 8 / 1e9, copy_gbps=limits["copy_bps"] * 8 / 1e9
    )
    placement = Placement((0,) * plan.world_size, tuple(gpu[r] for r in range(plan.world_size)))
    if sc.transport == "shm":  # every byte leaves through host memory: no copy on the GPU, even on one GPU
        placement = Placement(tuple(range(plan.world_size)), (0,) * plan.world_size)
        topology = Topology(gpus_per_node=1, nic_gbps=limits[link] * 8 / 1e9)
    estimate = estimate_seconds(plan, topology, placement)
    if per_sync_seconds is None:
        per_sync_seconds = row.get("per_sync_seconds") or 0.0
    seconds = estimate.seconds + per_sync_seconds
    return {
        "name": row["name"],
        "transport": sc.transport,
        "path": row.get("path", "").split(":")[0],
        "link_rate_bytes_per_s": round(limits[link]),  # for the row's link between GPUs (or the copy on one)
        "links_seconds": round(estimate.seconds, 6),
        "per_sync_seconds": round(per_sync_seconds, 6),
        "predicted_seconds": round(seconds, 6),
        "measured_seconds": row["seconds"],
        "measured_over_predicted": round(row["seconds"] / seconds, 3),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="GPU benchmark results files")
    ap.add_argument("--out", default=None, help="write predicted against measured here (JSON)")
    args = ap.parse_args(argv)
    out = []
    for path in args.results:
        doc = json.loads(Path(path).read_text())
        for row in doc["scenarios"]:
            if "seconds" not in row:
                continue
            r = {"results": Path(path).name, "device": doc["device"], "date": doc["date"], **predict(doc, row)}
            name = f"{r['results']} {r['name']} ({r['transport']}, {r['path']})"
            predicted, measured = r["predicted_seconds"] * 1e3, r["measured_seconds"] * 1e3
            ratio = r["measured_over_predicted"]
            print(f"{name}: predicted {predicted:.1f} ms, measured {measured:.1f} ms ({ratio:.3f})", flush=True)
            out.append(r)
    if args.out:
        Path(args.out).write_text(json.dumps({"what": __doc__.split("\n\n")[0], "rows": out}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
