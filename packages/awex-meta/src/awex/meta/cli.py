"""``awex-meta``: the MetaServer (``serve``, ``status``) and the planner dry run (``plan``).

    awex-meta serve --host 0.0.0.0 --port 8765 --token-env AWEX_META_TOKEN
    awex-meta status http://127.0.0.1:8765
    awex-meta plan --model config.json --trainer megatron:tp=4,pp=8,ep=8,dp=4,first=11,last=11 \\
                   --inference vllm:tp=8,ep=8,instances=16 --link-gbps 400 --json

Rates are in gigabits per second everywhere (``--link-gbps``, and ``--topology``'s ``nic-gbps`` / ``nvlink-gbps``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Sequence

from awex.meta.cli_serve import add_client_token, add_serve, client_token, serve
from awex.meta.errors import AwexValueError, MetaServerError
from awex.meta.models import UnknownModelError


def _versions(others: dict[str, str]) -> str:
    """``awex-meta X`` and the other Awex packages installed beside it (``others``: name -> version)."""
    from awex.meta import __version__

    rest = {k: v for k, v in others.items() if k != "awex-meta"}
    extra = f" ({', '.join(f'{k} {v}' for k, v in rest.items())})" if rest else ""
    return f"awex-meta {__version__}{extra}"


def main(argv: Sequence[str] | None = None, installed: dict[str, str] | None = None) -> int:
    """The ``awex-meta`` command; ``installed``: the Awex packages installed here, for ``--version`` (the ``awex-meta``
    entry point, ``awex_doctor.awex_meta``, checks the installation first and passes them: this module never imports
    the doctor)."""
    parser = argparse.ArgumentParser(
        prog="awex-meta", description="awex-meta: the MetaServer (serve, status) and the planner dry run (plan)."
    )
    parser.add_argument("--version", action="version", version=_versions(installed or {}))
    sub = parser.add_subparsers(dest="command", required=True)

    add_serve(sub.add_parser("serve", help="run a standalone MetaServer"))

    p_status = sub.add_parser("status", help="show who registered, their weight versions and recent events")
    p_status.add_argument("address", help="http://host:port of the MetaServer")
    add_client_token(p_status)
    p_status.add_argument("--json", action="store_true", help="print the raw status document")
    p_status.add_argument("--job", default=None, help="this job alone, every participant (default: every job)")

    p_plan = sub.add_parser("plan", help="plan a sync for a model and layouts without moving any byte")
    p_plan.add_argument("--model", default=None, help="HF config.json (or a directory holding one)")
    p_plan.add_argument(
        "--from-job",
        default=None,
        metavar="ADDRESS",
        help="plan with the layouts a running job published on this MetaServer instead of --model, --trainer and "
        "--inference (any model the job syncs, engines' learned layouts included)",
    )
    p_plan.add_argument("--job", default="default", help="with --from-job: the job (default: default)")
    add_client_token(p_plan, "with --from-job: ")
    p_plan.add_argument(
        "--trainer",
        action="append",
        metavar="SPEC",
        help="trainer layout, e.g. megatron:tp=4,pp=8,ep=8,dp=4 or hf (repeatable)",
    )
    p_plan.add_argument(
        "--inference",
        action="append",
        metavar="SPEC",
        help="inference layout, e.g. vllm:tp=8,ep=8,instances=16 or hf:instances=2 (repeatable)",
    )
    p_plan.add_argument("--dtype", default=None, help="override the config's dtype for every tensor")
    p_plan.add_argument(
        "--fp8",
        action="store_true",
        help="engines hold FP8 block-quantised weights as the config's quantization_config says; trainers "
        "quantise while sending (FP8 bytes and scales cross the links)",
    )
    p_plan.add_argument(
        "--wave-mb",
        type=float,
        default=256.0,
        help="bytes a rank sends plus receives per wave, in MiB (default 256; staging is about twice)",
    )
    p_plan.add_argument("--no-relay", action="store_true", help="never let destinations forward regions")
    p_plan.add_argument(
        "--split-mb", type=float, default=16.0, help="smallest part when a piece is spread over replicas (default 16)"
    )
    p_plan.add_argument(
        "--link-gbps",
        type=float,
        default=None,
        help="per-rank link bandwidth in gigabits per second (as --topology's rates): estimate the sync time",
    )
    p_plan.add_argument(
        "--topology",
        default=None,
        metavar="SPEC",
        help="plan for nodes of GPUs and estimate the sync: gpus-per-node=8,nic-gbps=400,nvlink-gbps=3600,"
        "placement=apart|shared (rates in gigabits/s per GPU and direction; see docs/topology.md)",
    )
    p_plan.add_argument("--no-verify", action="store_true", help="skip the independent coverage check")
    p_plan.add_argument("--json", action="store_true", help="end with one JSON object on the last line")

    args = parser.parse_args(argv)
    try:
        return _run(args)
    except BrokenPipeError:  # the reader went away (`awex-meta plan ... | head`): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return 0


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        if args.command == "serve":
            return serve(args)
        if args.command == "status":
            return _status(args)
        return _plan(args)
    except (ValueError, FileNotFoundError, MetaServerError) as e:
        hint = ""
        if isinstance(e, UnknownModelError):  # such a model may still sync: the engine learns its layout
            hint = (
                "; an HF or FSDP2 trainer and a vLLM engine still sync it (the engine learns its layout from its "
                "own loaders when it starts): `awex-meta plan --from-job ADDRESS --job JOB` plans a running job's "
                "published layouts"
            )
        print(f"awex-meta {args.command}: error: {e}{hint}", file=sys.stderr)
        return 2


def _status(args: argparse.Namespace) -> int:
    from awex.meta.client import MetaClient

    client = MetaClient(args.address, token=client_token(args), timeout=10.0)
    doc = client.status(job=args.job)
    if args.json:
        print(json.dumps(doc, indent=2, sort_keys=True))
        return 0
    now = doc.get("time", time.time())
    print(f"MetaServer {client.address}: {len(doc['jobs'])} job(s)")
    for name, job in doc["jobs"].items():
        total = job.get("participants_total", len(job["participants"]))
        print(f"\njob {name}: {total} participant(s), {job['keys']} key(s)")
        if job["participants"]:
            head = f"{'name':<24} {'role':<10} {'instance':<16} {'ranks':>5}  {'weight version':<16} {'last sync':<24}"
            print(f"  {head} last seen")
            for p in job["participants"]:
                seen = f"{now - p['last_seen']:.0f} s ago"
                last = p.get("last_sync") or {}
                synced = "-"
                if "bytes" in last and "seconds" in last:
                    synced = f"{last['bytes'] / 1e6:,.1f} MB in {last['seconds']:.3f} s"
                print(
                    f"  {p['name']:<24} {p['role']:<10} {p['instance']:<16} {p['world_size']:>5}  "
                    f"{str(p['weight_version'] or '-'):<16} {synced:<24} {seen}"
                )
        if job["recent_events"]:
            print("  recent events:")
            for e in job["recent_events"]:
                stamp = time.strftime("%H:%M:%S", time.localtime(e["time"]))
                version = f" version={e['version']}" if e.get("version") else ""
                print(f"    #{e['seq']:<5} {stamp} {e['kind']:<12} from {e['source']}{version}")
    return 0


class PlanProgress:
    """Progress of a long plan on standard error: silent for the first second, then at most a line a second
    (``awex-meta plan: tensors 512/1,024 after 2.1 s``), and the end of each stage."""

    def __init__(self, what: str, quiet_seconds: float = 1.0, every: float = 1.0, out=None):
        self.what, self.quiet, self.every = what, quiet_seconds, every
        self.out = out or sys.stderr
        self.started = time.perf_counter()
        self.last = 0.0
        self.spoke = False

    def __call__(self, stage: str, done: int, total: int) -> None:
        now = time.perf_counter() - self.started
        if now < self.quiet or (done < total and now - self.last < self.every):
            return
        if not self.spoke:
            print(f"awex-meta plan: planning {self.what}", file=self.out, flush=True)
        self.spoke, self.last = True, now
        count = f" {done:,}/{total:,}" if total > 1 else (" done" if done else "")
        print(f"awex-meta plan: {stage}{count} after {now:.1f} s", file=self.out, flush=True)


def _plan(args: argparse.Namespace) -> int:
    from awex.meta.layouts import layouts_for, parse_engine_spec
    from awex.meta.layouts.vllm import vllm_tensors
    from awex.meta.models import canonical_tensors, load_config, model_dims
    from awex.meta.topology import Topology

    if args.from_job:
        given = [
            f
            for f, v in (
                ("--model", args.model),
                ("--trainer", args.trainer),
                ("--inference", args.inference),
                ("--dtype", args.dtype),
                ("--fp8", args.fp8),
            )
            if v
        ]
        if given:
            raise AwexValueError(f"--from-job plans the job's own layouts: drop {', '.join(given)}")
        return _plan_job(args)
    missing = [
        f for f, v in (("--model", args.model), ("--trainer", args.trainer), ("--inference", args.inference)) if not v
    ]
    if missing:
        raise AwexValueError(f"give {', '.join(missing)} (or --from-job ADDRESS to plan a running job's layouts)")
    config = load_config(args.model)
    dims = model_dims(config, args.dtype)
    tensors = canonical_tensors(dims)
    sources = []
    for i, text in enumerate(args.trainer):
        spec = parse_engine_spec(text)
        prefix = "trainer" if len(args.trainer) == 1 else f"trainer{i}"
        sources += layouts_for(spec, tensors, "trainer", prefix=prefix)
    destinations = []
    for i, text in enumerate(args.inference):
        spec = parse_engine_spec(text)
        prefix = spec.engine if len(args.inference) == 1 else f"{spec.engine}{i}"
        engine_tensors = vllm_tensors(config, args.dtype) if spec.engine == "vllm" else tensors  # its FP32 routers
        destinations += layouts_for(spec, engine_tensors, "inference", prefix=prefix, architecture=dims.architecture)
    topology = Topology.parse(args.topology) if args.topology else None
    if args.fp8:
        from awex.meta.quant import Fp8BlockQuant, quantize_layout

        quant = Fp8BlockQuant.from_hf_config(config)
        if quant is None:
            raise AwexValueError("--fp8: the config declares no quantization_config (FP8 block quantisation)")
        sources = [quantize_layout(x, quant, sender=True) for x in sources]
        destinations = [quantize_layout(x, quant, sender=False) for x in destinations]
    described = (" + ".join(args.trainer), " + ".join(args.inference))
    model = (dims.architecture, f"({dims.dtype})")
    return _plan_and_report(args, sources, destinations, [t.spec for t in tensors], model, described, topology)


def _plan_job(args: argparse.Namespace) -> int:
    from awex.meta.cli_job import job_layouts
    from awex.meta.topology import Topology

    sources, destinations = job_layouts(args.from_job, args.job, client_token(args))
    specs = {t.spec.name: t.spec for layout in sources for t in layout.tensors}
    described = tuple(", ".join(x.instance for x in side) for side in (sources, destinations))
    topology = Topology.parse(args.topology) if args.topology else None
    model = (f"job {args.job}", "(its published layouts)")
    return _plan_and_report(args, sources, destinations, list(specs.values()), model, described, topology)


def _plan_and_report(args, sources, destinations, specs, model, described, topology) -> int:
    from awex.meta.planner import PlanOptions, plan_transfers
    from awex.meta.topology import estimate_seconds
    from awex.meta.verify import verify_plan

    options = PlanOptions(
        wave_bytes=int(args.wave_mb * (1 << 20)),
        split_bytes=int(args.split_mb * (1 << 20)),
        relay=not args.no_relay,
        topology=topology,
    )
    progress = PlanProgress(f"{len(sources) + len(destinations)} layouts, {len(specs):,} tensors")
    plan = plan_transfers(sources, destinations, options, progress=progress)
    summary = plan.summary()
    summary["model"] = model[0]
    summary["model_bytes"] = sum(s.nbytes for s in specs)
    if args.no_verify:
        summary["coverage_ok"] = None
    else:
        started = time.perf_counter()
        progress("verifying", 0, 1)
        report = verify_plan(plan, sources, destinations)
        progress("verifying", 1, 1)
        summary["coverage_ok"] = report.ok
        summary["verify_seconds"] = round(time.perf_counter() - started, 3)
        if not report.ok:
            summary["coverage_problems"] = report.problems
    send, recv = _per_rank(plan)
    hot_send = max(range(len(send)), key=lambda r: (send[r], -r))
    hot_recv = max(range(len(recv)), key=lambda r: (recv[r], -r))
    summary["hot_sender"] = _rank_name(plan, hot_send)
    summary["hot_receiver"] = _rank_name(plan, hot_recv)
    if args.link_gbps and args.topology:
        raise AwexValueError("--link-gbps and --topology both estimate the sync: give one")
    if args.link_gbps is not None:
        if args.link_gbps <= 0:
            raise AwexValueError(f"--link-gbps {args.link_gbps:g}: a rate in gigabits per second, above zero")
        bw = args.link_gbps * 1e9 / 8  # bytes per second
        summary["link_gbps"] = args.link_gbps
        summary["lower_bound_seconds"] = round(summary["lower_bound_bytes"] / bw, 4)
        summary["busiest_rank_seconds"] = round(
            max(summary["max_rank_send_bytes"], summary["max_rank_recv_bytes"]) / bw, 4
        )
        summary["estimated_seconds"] = round(_wave_schedule_seconds(plan, bw), 4)
    if topology:
        summary["topology"] = {k: v for k, v in vars(topology).items()}
        summary.update(estimate_seconds(plan, topology).as_dict())
    _print_human(summary, described, model[1])
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    return 0 if summary["coverage_ok"] in (True, None) else 1


def _per_rank(plan) -> tuple[list[int], list[int]]:
    send = [0] * plan.world_size
    recv = [0] * plan.world_size
    for b in plan.buckets:
        send[b.src] += b.nbytes
        recv[b.dst] += b.nbytes
    return send, recv


def _wave_schedule_seconds(plan, bandwidth: float) -> float:
    """Time of the wave schedule with full-duplex links: each wave lasts as long as its busiest rank's
    larger direction (bytes sent or received in that wave)."""
    per_wave: dict[int, dict[tuple[int, str], int]] = {}
    for b in plan.buckets:
        loads = per_wave.setdefault(b.wave, {})
        loads[(b.src, "send")] = loads.get((b.src, "send"), 0) + b.nbytes
        loads[(b.dst, "recv")] = loads.get((b.dst, "recv"), 0) + b.nbytes
    return sum(max(v.values()) for v in per_wave.values()) / bandwidth


def _rank_name(plan, rank: int) -> str:
    r = plan.ranks[rank]
    return f"{r.instance}:{r.local_rank} (rank {rank})"


def _gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB"


def _print_human(s: dict, described: tuple[str, str], note: str) -> None:
    ratio = s["max_rank_send_bytes"] / s["lower_bound_send_bytes"] if s["lower_bound_send_bytes"] else 1.0
    lines = [
        f"model      {s['model']}: {s['tensors']:,} tensors, {_gb(s['model_bytes'])} {note}",
        f"trainer    {described[0]}: {s['trainer_ranks']} rank(s)",
        f"inference  {described[1]}: {s['inference_ranks']} rank(s)",
        f"plan       {s['ops']:,} transfers in {s['buckets']:,} buckets, {s['waves']} waves, "
        f"planned in {s['plan_seconds']:.2f} s (digest {s['digest'][:12]})",
        f"traffic    {_gb(s['total_bytes'])} in all; busiest sender {s['hot_sender']} {_gb(s['max_rank_send_bytes'])} "
        f"({ratio:.3f}x the least a sender must send without relays, {_gb(s['lower_bound_send_bytes'])}"
        + ("; receivers forward the rest)" if ratio < 1 else ")"),
        f"           busiest receiver {s['hot_receiver']} {_gb(s['max_rank_recv_bytes'])} "
        f"(it needs exactly that); lower bound for the busiest rank {_gb(s['lower_bound_bytes'])}",
    ]
    if s["coverage_ok"] is None:
        lines.append("coverage   not verified (--no-verify)")
    elif s["coverage_ok"]:
        lines.append(
            f"coverage   ok: every needed element is received exactly once; redundant bytes: "
            f"{s['redundant_bytes']} (checked in {s['verify_seconds']:.2f} s)"
        )
    else:
        lines.append("coverage   FAILED: " + "; ".join(s["coverage_problems"][:5]))
    if "link_gbps" in s:
        lines.append(
            f"estimate   at {s['link_gbps']:g} Gb/s per rank: {s['lower_bound_seconds']:.3f} s lower bound, "
            f"{s['estimated_seconds']:.3f} s for this plan's wave schedule"
        )
    if "topology" in s:
        t = s["topology"]
        nic = (
            f"NIC bound {s['nic_lower_bound_seconds']:.3f} s, busiest NIC {_gb(s['busiest_nic_bytes'])} "
            f"({s['busiest_nic_over_bound']:.3f}x its bound)"
            if s["nic_bound_bytes"]
            else "no byte crosses a NIC"
        )
        lines.append(
            f"topology   {t['gpus_per_node']} GPUs per node, {t['placement']}; NIC {t['nic_gbps']:g} Gb/s, NVLink "
            f"{t['nvlink_gbps']:g} Gb/s per GPU: estimated {s['estimated_seconds']:.3f} s ({nic}), "
            f"{s['useful_gbps_per_receiver']:.1f} GB/s per receiver"
        )
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    sys.exit(main())
