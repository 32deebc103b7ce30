"""The GPU benchmark's command line (``python -m awex_integration.benchmarks.bench_gpu --help``)."""

from __future__ import annotations

import argparse


def _step_seconds(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 60:
        raise argparse.ArgumentTypeError(f"{text}: seconds between 0 and 60")
    return value


def parser(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--calibrate", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--layers", type=int, default=None, help="cut the model to this many layers (quick runs)")
    ap.add_argument("--scenarios", default="all", help="comma-separated names (default all that fit the GPUs)")
    ap.add_argument("--iters", type=int, default=7, help="steady-state syncs timed per scenario (median)")
    ap.add_argument("--baseline-iters", type=int, default=3, help="0: no baselines (quick runs)")
    ap.add_argument("--wave-mb", type=float, default=256.0, help="wave size per rank in MiB (staging ~2x)")
    ap.add_argument(
        "--fp8",
        action="store_true",
        help="receivers hold FP8 block-quantised weights (e4m3, 128x128 tiles + scales); trainers "
        "quantise their bf16 weights in every sync (timed as part of it)",
    )
    ap.add_argument(
        "--fp8-on-receive",
        action="store_true",
        help="with --fp8, CUDA IPC scenarios, public path: the trainer publishes bf16 and receivers quantise from "
        "its memory into their FP8 weights and scales (quantize_on_receive); bound: bf16 read + FP8 written",
    )
    ap.add_argument(
        "--fp8-auto",
        action="store_true",
        help="with --fp8, public path: the trainer publishes bf16 with quantize_on_receive='auto' (receivers on its "
        "GPU quantise on receive, elsewhere it quantises); bound: the fused one colocated, the FP8 bytes' elsewhere",
    )
    ap.add_argument(
        "--trainer-buffer",
        default="per-param",
        help="per-param: trainer parameters each in their own allocation (as under FSDP2; default); "
        "flat: views of one contiguous buffer (as Megatron-core's DDP keeps them); "
        "'per-param,flat' runs every scenario both ways",
    )
    ap.add_argument("--timeout", type=float, default=300.0, help="per scenario")
    ap.add_argument(
        "--upstream",
        action="store_true",
        help="also run checkpoint-engine 0.4.2 where it runs (colocated on one GPU; needs it installed)",
    )
    ap.add_argument(
        "--direct-mb",
        default="64",
        help="NCCL: transfers of at least this many MiB travel as their own message, straight from and "
        "into engine memory where contiguous (PlanOptions.direct_bytes); 'none': all staged",
    )
    ap.add_argument(
        "--fanout",
        default="relay",
        choices=["relay", "broadcast"],
        help="NCCL: regions several instances need go by relays (default) or as broadcasts per wave "
        "(PlanOptions.broadcast)",
    )
    ap.add_argument(
        "--ipc-options",
        default="{}",
        help="JSON keyword arguments for the CUDA IPC executor, e.g. '{\"dma_streams\": 4}' (tuning runs)",
    )
    ap.add_argument(
        "--upstream-awex",
        default=None,
        metavar="DIR",
        help="with --upstream: a directory holding the unpacked awex 0.9.0 wheel; its transfer core "
        "runs as a baseline in the NCCL scenarios (awex_integration.benchmarks.bench_upstream_awex)",
    )
    ap.add_argument(
        "--path",
        default="public",
        choices=["public", "executor"],
        help="public (default): WeightsWriter / WeightsReader meeting at a MetaServer, as users run "
        "them; executor: the transport executors wired by hand (tuning runs)",
    )
    ap.add_argument(
        "--per-sync-model",
        default="qwen2-tiny",
        help="public path: each scenario also runs with this model (a few MB; integration/models/NAME.json) and its "
        "steady time, what a sync costs whatever its size, joins the cost model's prediction; 'none': left out",
    )
    ap.add_argument(
        "--delta",
        type=float,
        default=None,
        metavar="FRACTION",
        help="public path: delta syncs (WeightsWriter(delta=True)); before each timed sync the trainer changes about "
        "this fraction of its elements (not timed), and receivers check the last version bit for bit",
    )
    ap.add_argument(
        "--verify",
        action="store_true",
        help="public path: verify mode (WeightsWriter(verify=True)): every receiver compares digests of what it got "
        "with the trainer's before a version counts; the timed syncs include it",
    )
    ap.add_argument(
        "--timeline",
        action="store_true",
        help="public path: the first trainer rank's and receiver's steps on one time line per steady version "
        "(medians; awex_integration.benchmarks.timeline): each timed step costs microseconds, so read it for where "
        "the time goes, not for the time",
    )
    ap.add_argument(
        "--staged",
        nargs="?",
        const="device",
        choices=("device", "host"),
        help="public path: receivers take each version into staging (as vLLM's engines do with receive='staged', "
        "receiving while they generate), on the GPU ('device', the default) or in pinned host memory ('host'), and "
        "apply it by a copy into their live weights once it arrived; reports the sync until staged and the commit "
        "(the stall a generating engine would see) per version",
    )
    ap.add_argument(
        "--meta-server",
        choices=("embedded", "process"),
        default="embedded",
        help="public path: the MetaServer embedded in this process (default) or `awex-meta serve` in a process of "
        "its own, journalling",
    )
    ap.add_argument(
        "--step-seconds",
        type=_step_seconds,
        default=0.0,
        help="public path: every rank pauses this long before each timed sync (a training step's gap, not timed), "
        "so each version finds the MetaServer and the ranks idle, as in an RL loop",
    )
    ap.add_argument(
        "--waiting-receivers",
        action="store_true",
        help="with --step-seconds: only the trainers pause; the receivers call receive at once and wait through the "
        "step for the manifest (an engine waiting for new weights); the time runs from the trainer's write",
    )
    ap.add_argument("--out", default=None, help="write the results JSON here")
    return ap


def checked(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The rules between the flags (``ap.error`` for a combination that cannot run); baselines off where they
    cannot run."""
    if (args.fp8_on_receive or args.fp8_auto) and (not args.fp8 or args.path != "public"):
        ap.error("--fp8-on-receive and --fp8-auto need --fp8 and the public path")
    if args.fp8_on_receive and args.fp8_auto:
        ap.error("--fp8-on-receive or --fp8-auto, not both")
    if args.fp8_auto and args.baseline_iters:
        print("--fp8-auto: no baselines (the trainer publishes bf16)")
        args.baseline_iters = 0
    if args.fp8_on_receive and args.baseline_iters:
        print("--fp8-on-receive: no baselines (they move the trainer's FP8 tiles, which it does not make here)")
        args.baseline_iters = 0
    if args.delta is not None and (args.path != "public" or args.fp8 or not 0 < args.delta < 1):
        ap.error("--delta: a fraction between 0 and 1, on the public path, without --fp8")
    if args.verify and args.path != "public":
        ap.error("--verify: on the public path")
    if args.timeline and args.path != "public":
        ap.error("--timeline: on the public path")
    if args.staged and args.path != "public":
        ap.error("--staged: on the public path")
    if args.waiting_receivers and not args.step_seconds:
        ap.error("--waiting-receivers: with --step-seconds (the step the receivers wait through)")
