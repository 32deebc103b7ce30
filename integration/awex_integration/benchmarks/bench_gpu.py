"""GPU benchmark: Awex syncs against the link limit and against the usual approaches, in one run.

Every scenario runs in fresh processes, one per (engine rank, GPU). Trainer ranks hold a Qwen3-8B-shaped bf16
model in Megatron-core's exact parameter layout (fused QKV by query group, fused gate/up, padded vocabulary),
receivers in vLLM's exact layout (fused qkv_proj / gate_up_proj), both built by ``awex.convert`` (whose layouts
the CPU tests check against the real engines). Per scenario:

- the limits measured in the same run: the bandwidth between two GPUs (the fastest of an NCCL send, two NCCL
  senders into one GPU, and one copy-engine peer copy) and the device-to-device copy bandwidth; the lower
  bound is, over GPUs, the largest of (bytes it must receive from other GPUs, bytes only it holds that other
  GPUs need) / link bandwidth and (bytes copied on the GPU) / copy bandwidth;
- Awex: the first sync (plan, groups, buffers, IPC handles, first transfer) and the steady-state sync (median);
- baselines, same data and layouts: gather to trainer rank 0 then per-tensor NCCL broadcast (the common RL
  stack approach); the same with vLLM-style packed 1 GiB buckets; for colocated scenarios, CUDA IPC handles
  exported and opened again on every update (what per-update IPC backends do);
- correctness: after the first sync and after a second, changed version, every receiver view equals the
  trainer's tensor, bit for bit;
- peak extra GPU memory of the sync on each side (PyTorch allocator).

Run on a machine with 4 GPUs (scenarios needing fewer GPUs use the first ones):

    python -m awex_integration.benchmarks.bench_gpu --out integration/results/bench-results.json

with ``PYTHONPATH`` holding ``packages/*/src`` and ``integration`` (``nox -s bench`` sets it). Workers talk
through files and the sync groups only: nothing is pickled across processes.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from awex_integration.benchmarks.bench_bounds import dest_ranks, fused_bound, lower_bound, sources_ranks
from awex_integration.benchmarks.bench_calibrate import calibrate_worker
from awex_integration.benchmarks.bench_common import (
    GIB,
    SCENARIOS,
    auto_transport,
    launch_workers,
    layouts_of,
    model_tensors,
    scenario_devices,
)
from awex_integration.benchmarks.bench_gpu_args import checked, parser
from awex_integration.benchmarks.bench_paths import describe_staged, phases_of, staged_summary
from awex_integration.benchmarks.bench_worker import WorkerArgs, worker
from awex_integration.benchmarks.estimate_check import predict
from awex_integration.benchmarks.timeline import describe, merged


def _device_name() -> str:
    import torch

    n = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0)
    if n == 1:
        return f"1x {name}"
    try:
        links = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20).stdout
        link = "NV18" if "NV18" in links else ("NVLink" if " NV" in links else "PCIe")
    except (OSError, subprocess.SubprocessError):
        link = "unknown link"
    return f"{n}x {name}, {link}"


def _write_results(out: str | None, device: str, date: str, cal: dict, results: list, command: list[str]) -> None:
    if not out:
        return
    doc = {
        "device": device,
        "date": date,
        "limits": cal,
        "scenarios": results,
        "command": "python -m awex_integration.benchmarks.bench_gpu " + " ".join(command),
    }
    Path(out).write_text(json.dumps(doc, indent=1) + "\n")


def run_scenario_workers(
    sc, ranks, gpu_of, args, model, layers, iters, baseline_iters, buffer, work, env, shared
) -> tuple[list[dict], str | None]:
    """One scenario's workers (one process per rank) on ``model``; their results in rank order, or a failure."""
    from awex.transport.net import free_ports

    ports = free_ports(2)
    argv = []
    for r in ranks:
        wa = WorkerArgs(
            sc.name,
            model,
            layers,
            r.rank,
            len(ranks),
            r.instance,
            r.local_rank,
            gpu_of[r.rank],
            ports,
            work,
            iters,
            baseline_iters,
            args.wave_mb,
            args.fp8,
            buffer,
            dict(shared),
        )
        argv.append(["--worker", json.dumps(wa.__dict__)])
    outs = launch_workers(argv, args.timeout, env)
    failed = [o[-4000:] for rc, o in outs if rc != 0]
    if failed:
        return [], "\n".join(failed)
    return [json.loads(Path(work, f"{sc.name}-{r.rank}.json").read_text()) for r in ranks], None


def main(argv: list[str] | None = None) -> int:
    from awex.transport.net import free_ports  # here: upstream Awex's workers import this module before their awex

    ap = parser(__doc__)
    args = ap.parse_args(argv)
    command = list(sys.argv[1:] if argv is None else argv)
    direct_bytes = None if args.direct_mb == "none" else int(float(args.direct_mb) * (1 << 20))
    ipc_options = json.loads(args.ipc_options)
    if not isinstance(ipc_options, dict):
        ap.error("--ipc-options: a JSON object")
    from awex.transport.ipc.options import IpcOptions

    try:
        IpcOptions.from_dict(ipc_options)  # refused here, before any worker starts
    except (TypeError, ValueError) as e:
        ap.error(f"--ipc-options: {e}")

    if args.worker:
        a = WorkerArgs(**json.loads(args.worker))
        res = worker(a)
        Path(a.workdir, f"{a.scenario}-{a.rank}.json").write_text(json.dumps(res))
        return 0
    if args.calibrate:
        calibrate_worker(**json.loads(args.calibrate))
        return 0

    import torch

    from awex.meta import Fp8BlockQuant, PlanOptions, Role, plan_transfers, quantize_layout

    env = dict(
        os.environ,
        NCCL_NVLS_ENABLE="0",
        TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
        NVSHMEM_DISABLE_NVLS="1",
        PYTHONUNBUFFERED="1",
    )
    gpus = torch.cuda.device_count()
    device = _device_name()
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    work = tempfile.mkdtemp(prefix="awex-bench-")
    model_label = (
        args.model + (f" ({args.layers} layers)" if args.layers else "") + (", FP8 to receivers" if args.fp8 else "")
    )
    print(f"device: {device}; model {model_label}", flush=True)

    # limits, measured now
    cal_world = min(gpus, 3)
    port = free_ports(1)[0]
    cal_file = str(Path(work) / "calibration.json")
    outs = launch_workers(
        [
            [
                "--calibrate",
                json.dumps({"rank": r, "world": cal_world, "port": port, "nbytes": 4 * GIB, "out_file": cal_file}),
            ]
            for r in range(cal_world)
        ],
        300,
        env,
    )
    if any(rc for rc, _ in outs):
        print("\n".join(o for _, o in outs))
        return 1
    cal = json.loads(Path(cal_file).read_text())
    link_bps = max(cal["pair_bps"], cal.get("two_into_one_bps", 0.0), cal.get("dma_bps", 0.0))
    copy_bps = cal["copy_bps"]
    print(
        f"limits: NCCL one pair {cal['pair_bps'] / 1e9:.0f} GB/s, two into one "
        f"{cal.get('two_into_one_bps', 0) / 1e9:.0f} GB/s, copy-engine peer copy {cal.get('dma_bps', 0) / 1e9:.0f} "
        f"GB/s, device copy {copy_bps / 1e9:.0f} GB/s (bytes copied per second), pinned host memory: D2H "
        f"{cal['d2h_bps'] / 1e9:.0f} GB/s, H2D {cal['h2d_bps'] / 1e9:.0f} GB/s, each while the other runs "
        f"{cal.get('d2h_while_h2d_bps', 0) / 1e9:.0f} GB/s; link = the fastest of the first three",
        flush=True,
    )

    meta = None
    if args.path == "public":
        if args.meta_server == "process":  # `awex-meta serve` of its own (journalling), as a deployment runs it
            from awex_integration.faults.servers import ProcessServer

            meta = ProcessServer()
        else:
            from awex.meta.server import start_embedded  # in this process; the workers reach it over loopback HTTP

            meta = start_embedded()
    wanted = [s for s in SCENARIOS if (args.scenarios == "all" or s.name in args.scenarios.split(","))]
    results = []
    dims, tensors = model_tensors(args.model, args.layers)
    quant = Fp8BlockQuant() if args.fp8 else None
    model_bytes = sum(t.spec.nbytes for t in tensors)
    checked(ap, args)
    shared = {
        "staged": args.staged,
        "verify": args.verify,
        "timeline": args.timeline,
        "step_seconds": args.step_seconds,
        "waiting_receivers": args.waiting_receivers,
        "delta": args.delta,
        "fp8_on_receive": "auto" if args.fp8_auto else args.fp8_on_receive,  # the writer's quantize_on_receive
        "ipc": ipc_options,
        "direct_bytes": direct_bytes,
        "fanout": args.fanout,
        "path": args.path,
        "meta": meta.address if meta else None,
        "timeout": args.timeout,
    }
    buffers = args.trainer_buffer.split(",")
    if not set(buffers) <= {"per-param", "flat"}:
        ap.error(f"--trainer-buffer: per-param and/or flat, got {args.trainer_buffer!r}")
    for buffer, sc in ((b, sc) for b in buffers for sc in wanted):
        if sc.gpus > gpus:
            print(f"skip {sc.name}: needs {sc.gpus} GPUs, this machine has {gpus}")
            continue
        layouts = layouts_of(sc, tensors)
        if args.fp8_on_receive and sc.transport != "ipc":
            print(f"skip {sc.name}: FP8 on receive runs over CUDA IPC only")
            continue
        if quant:
            layouts = [
                quantize_layout(x, quant) if x.role == Role.INFERENCE or not args.fp8_on_receive else x for x in layouts
            ]
        sources = [x for x in layouts if x.role == Role.TRAINER]
        dests = [x for x in layouts if x.role == Role.INFERENCE]
        direct = plan_transfers(
            sources,
            dests,
            PlanOptions(
                relay=False,
                devices=scenario_devices(sc) if sc.transport == "ipc" else (),
                quantize_on_receive=args.fp8_on_receive,
            ),
        )
        ranks = direct.ranks
        gpu_of = {r.rank: next(e for e in sc.engines if e.instance == r.instance).gpus[r.local_rank] for r in ranks}
        bound, per_gpu = lower_bound(direct, gpu_of, link_bps, copy_bps)
        fused = None
        if quant and sc.transport == "ipc":  # FP8 on the copy's bound: bf16 read once, FP8 written once
            bf16 = [x for x in layouts_of(sc, tensors) if x.role == Role.TRAINER]
            fused = fused_bound(
                plan_transfers(
                    bf16, dests, PlanOptions(relay=False, devices=scenario_devices(sc), quantize_on_receive=True)
                ),
                gpu_of,
                copy_bps,
            )
            if args.fp8_on_receive or (args.fp8_auto and sc.name.startswith("colocated")):
                bound = fused  # auto quantises on receive where every engine shares its trainer's GPU
        if sc.transport == "shm":  # every byte crosses to host memory and back: D2H by senders, H2D by receivers
            if args.path != "public":
                print(f"skip {sc.name}: the shm transport runs through the public path only")
                continue
            sent = max(sum(b.nbytes for b in direct.buckets if b.src == r.rank) for r in sources_ranks(direct))
            received = max(sum(b.nbytes for b in direct.buckets if b.dst == r.rank) for r in dest_ranks(direct))
            # receivers copy out while the senders fill (chunk by chunk): both directions at once, at the rate each
            # keeps while the other runs (measured: one GPU to host while host to the other GPU)
            both = cal.get("d2h_while_h2d_bps") or min(cal["d2h_bps"], cal["h2d_bps"])
            bound = max(sent, received) / both
            per_gpu = {
                "d2h_bytes": sent,
                "h2d_bytes": received,
                "one_after_the_other_seconds": sent / cal["d2h_bps"] + received / cal["h2d_bps"],
            }
        started = time.monotonic()
        per_rank, failure = run_scenario_workers(
            sc, ranks, gpu_of, args, args.model, args.layers, args.iters, args.baseline_iters, buffer, work, env, shared
        )
        if failure is not None:
            print(f"FAILED {sc.name}:\n{failure}", flush=True)
            results.append({"name": sc.name, "what": sc.what, "device": device, "date": date, "error": failure[-2000:]})
            continue
        rec = [p for p in per_rank if not p["trainer"]]
        bad = [f"{p['instance']}:{b}" for p in rec for b in p["bad_first"] + p.get("bad_steady", []) + p["bad_second"]]
        steady = statistics.median(per_rank[0]["steady_seconds"])
        received = sum(p.get("bytes_received", 0) for p in rec)
        entry = {
            "name": sc.name,
            "what": sc.what,
            "device": device,
            "date": date,
            "model": model_label,
            "trainer_buffer": buffer,
            "model_bytes": model_bytes,
            "wire_bytes": direct.stats.total_bytes,
            "quantize_seconds": max((p.get("quantize_seconds", 0.0) for p in per_rank), default=0.0) or None,
            "transport": sc.transport,
            "path": (
                "public: WeightsWriter / WeightsReader with a MetaServer (plan, agreement, versions)"
                if args.path == "public"
                else "executor: transport executors wired by hand"
            ),
            **(
                {
                    "first_sync_phases": phases_of(per_rank, "first_sync_phases"),
                    "steady_phases": phases_of(per_rank, "steady_phases"),
                    "meta_server": args.meta_server,
                }
                if args.path == "public"
                else {}
            ),
            **({"ipc_options": ipc_options} if ipc_options and sc.transport == "ipc" else {}),
            **({"direct_bytes": direct_bytes, "fanout": args.fanout} if sc.transport == "nccl" else {}),
            # the default's choice for these GPUs (quantising on receive is chosen explicitly, over CUDA IPC)
            "auto_transport": "ipc" if args.fp8_on_receive else auto_transport(sc, sources, dests, fp8=args.fp8),
            "bytes": received,
            **(
                {"delta_fraction": args.delta, "bytes_dense": sum(p.get("bytes_dense", 0) for p in rec)}
                if args.delta
                else {}
            ),
            **({"verify": True} if args.verify else {}),
            **({"timeline": merged(per_rank[0]["timeline"], rec[0]["timeline"])} if args.timeline else {}),
            **(staged_summary(per_rank) if args.staged else {}),
            **({"step_seconds": args.step_seconds} if args.step_seconds else {}),
            **({"waiting_receivers": True} if args.waiting_receivers else {}),
            "seconds": round(steady, 6),
            "seconds_all": [round(x, 6) for x in per_rank[0]["steady_seconds"]],
            # timed calls start on every rank at one instant; where a rank reached it late, by how much (seconds)
            "late_starts": {
                f"{p['instance']}:{p['rank']}": [round(x, 6) for x in p["late_starts"]]
                for p in per_rank
                if p.get("late_starts")
            },
            # each rank's own time in the call (median)
            "rank_seconds": {
                f"{p['instance']}:{p['rank']}": round(statistics.median(p["own_seconds"]), 6)
                for p in per_rank
                if p.get("own_seconds")
            },
            "first_sync_seconds": round(per_rank[0]["first_sync_seconds"], 6),
            "lower_bound_seconds": round(bound, 6),
            **({"fused_bound_seconds": round(fused, 6), "fp8_on_receive": args.fp8_on_receive} if fused else {}),
            **({"fp8_auto": True} if args.fp8_auto else {}),
            "ratio": round(steady / bound, 3) if bound else None,
            "limits": {"link_bytes_per_s": round(link_bps), "copy_bytes_per_s": round(copy_bps)},
            "per_gpu_bytes": per_gpu,
            "waves": per_rank[0]["plan"]["waves"],
            "relayed_bytes": per_rank[0]["plan"]["relayed_bytes"],
            "peak_extra_gpu_bytes": {
                "trainer": max(p["peak_extra_bytes"] for p in per_rank if p["trainer"]),
                "inference": max(p["peak_extra_bytes"] for p in rec),
            },
            "staging_bytes": max((p.get("staging_bytes", 0) for p in per_rank), default=0),
            "correct": not bad,
            "mismatches": bad[:10],
            "baselines": {
                k: round(statistics.median(v), 6) for k, v in per_rank[0]["baselines"].items() if not k.endswith("_bad")
            },
            "baseline_mismatches": sorted(
                {b for p in rec for k, v in p["baselines"].items() if k.endswith("_bad") for b in v}
            )[:5],
            "wall_seconds": round(time.monotonic() - started, 1),
        }
        # the topology cost model's prediction from this run's measured rates (benchmarks.estimate_check),
        # plus, on the public path, what a sync costs whatever its size: the same scenario with a model of a few MB
        per_sync = None
        if args.path == "public" and args.per_sync_model != "none" and not args.fp8:
            tiny_rank, failure = run_scenario_workers(
                sc, ranks, gpu_of, args, args.per_sync_model, None, args.iters, 0, buffer, work, env, shared
            )
            if failure is None:
                per_sync = statistics.median(tiny_rank[0]["steady_seconds"])
            else:
                print(f"per-sync measurement of {sc.name} failed (left out of the prediction):\n{failure}", flush=True)
        entry["per_sync_seconds"] = None if per_sync is None else round(per_sync, 6)
        entry["per_sync_model"] = args.per_sync_model if per_sync is not None else None
        if not args.fp8_on_receive:  # the cost model prices copies, not quantising kernels
            predicted = predict({"limits": cal}, entry, layouts=layouts, per_sync_seconds=per_sync or 0.0)
            entry["predicted_seconds"] = predicted["predicted_seconds"]
            entry["measured_over_predicted"] = predicted["measured_over_predicted"]
        if args.upstream and args.upstream_awex and sc.transport == "nccl" and buffer == buffers[0] and not args.fp8:
            from awex_integration.benchmarks.bench_upstream_awex import run as run_upstream_awex
            from awex_integration.benchmarks.bench_upstream_awex import scenario_spec

            spec = scenario_spec(sc, tensors, layouts, max(1, args.baseline_iters), work, free_ports(1)[0])
            upstream = run_upstream_awex(args.upstream_awex, spec, args.timeout)
            entry["upstream_awex"] = upstream
            if upstream.get("correct"):
                entry["baselines"]["awex_0.9.0_transfer_core"] = upstream["update_seconds"]
            print(f"awex 0.9.0: {json.dumps(upstream)[:600]}", flush=True)
        if args.upstream and sc.name == "colocated_1gpu_ipc" and buffer == buffers[0] and not args.fp8:
            from awex_integration.benchmarks.bench_checkpoint_engine import run as run_checkpoint_engine

            upstream = run_checkpoint_engine(args.model, args.layers, max(1, args.baseline_iters))
            entry["upstream"] = upstream
            if upstream.get("correct"):
                entry["baselines"]["checkpoint_engine_0.4.2_update"] = upstream["update_seconds"]
            print(f"checkpoint-engine 0.4.2: {json.dumps(upstream)[:600]}", flush=True)
        results.append(entry)
        _write_results(args.out, device, date, cal, results, command)  # after every scenario: a later one may time out
        base = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in entry["baselines"].items())
        print(
            f"{sc.name} ({buffer} trainer buffer): {steady * 1e3:.1f} ms steady "
            f"(first {entry['first_sync_seconds'] * 1e3:.0f} ms), "
            f"bound {bound * 1e3:.1f} ms, ratio {entry['ratio']}, cost model "
            f"{(entry.get('predicted_seconds') or 0) * 1e3:.1f} ms ({entry.get('measured_over_predicted')}), "
            f"fused bound {(entry.get('fused_bound_seconds') or 0) * 1e3:.1f} ms, correct={entry['correct']}; {base}",
            flush=True,
        )
        print(f"  each rank's own time (median): {entry['rank_seconds']}", flush=True)
        if "staged" in entry:  # what a generating engine would stall for: the commit, against the whole sync
            print(describe_staged(entry["staged"]), flush=True)
        for key in ("first_sync_phases", "steady_phases"):
            for side, phases in (entry.get(key) or {}).items():
                print(f"  {key} ({side}): " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in phases.items()), flush=True)
        if "timeline" in entry:
            print("  timeline (ms from the trainer's write; start, end, length):\n" + describe(entry["timeline"]))
    _write_results(args.out, device, date, cal, results, command)
    if meta is not None:
        meta.stop()
    print(
        json.dumps(
            {
                "scenarios": [
                    {k: r.get(k) for k in ("name", "seconds", "lower_bound_seconds", "ratio", "correct", "baselines")}
                    for r in results
                ]
            }
        )
    )
    return 0 if all(r.get("correct") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
