"""The scenario runner's command line (``python -m awex_integration.scenarios.scenario --help``)."""

from __future__ import annotations

import argparse
from pathlib import Path

DESCRIPTION = "Scenario runner: a trainer layout x an inference layout x a transport x a model, for N RL-like steps."
DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "models" / "qwen2-tiny.json"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scenario", description=DESCRIPTION)
    p.add_argument(
        "--trainer",
        choices=["megatron", "hf", "fsdp"],
        default="megatron",
        help="fsdp: an HF model sharded with FSDP2 over --train-dp ranks (gloo)",
    )
    p.add_argument("--train-tp", type=int, default=1)
    p.add_argument("--train-pp", type=int, default=1)
    p.add_argument("--train-dp", type=int, default=1)
    p.add_argument("--train-vpp", type=int, default=1)
    p.add_argument("--train-ep", type=int, default=1, help="Megatron expert parallelism (MoE models)")
    p.add_argument(
        "--inference",
        choices=["vllm", "hf", "layout"],
        default="vllm",
        help="layout: no engine, plain tensors in vLLM's exact layout per rank (awex.convert.vllm), the "
        "in-place path of a GPU vLLM; tensors are checked, there is no generation",
    )
    p.add_argument("--infer-tp", type=int, default=1)
    p.add_argument("--infer-ep", action="store_true", help="vLLM expert parallelism (enable_expert_parallel)")
    p.add_argument("--instances", type=int, default=1)
    p.add_argument(
        "--transport",
        choices=["gloo", "shm", "rdma", "auto"],
        default="gloo",
        help="gloo: point to point over a gloo group; shm: host shared memory; rdma: one-sided reads through "
        "Mooncake's transfer engine (TCP where there is no RDMA NIC); auto: the writers choose",
    )
    p.add_argument(
        "--hosts",
        type=int,
        choices=[1, 2],
        default=1,
        help="2: the MetaServer and the trainers in one network namespace, the engines in another, joined by a veth "
        "pair (two hosts on one machine; needs root)",
    )
    p.add_argument(
        "--control",
        choices=["awex", "vllm-http", "vllm-ray"],
        default="awex",
        help="vllm-http: `vllm serve` engines driven by the trainers through vLLM's trainer API; vllm-ray (with "
        "--launcher ray): vLLM's LLM as a Ray actor, driven by the trainers through vLLM's Ray client",
    )
    p.add_argument(
        "--receive",
        choices=["in_place", "staged"],
        default="in_place",
        help="the vLLM backend's receive mode (staged: everything arrives before anything is loaded)",
    )
    p.add_argument(
        "--vllm-weights",
        choices=["plain", "prepacked"],
        default="plain",
        help="plain: vLLM-CPU computes from its live weights as on GPUs (harness patch); prepacked: "
        "vLLM-CPU as shipped",
    )
    p.add_argument("--wave-mb", type=float, default=None, help="the writers' wave size in MiB (default: the writer's)")
    p.add_argument(
        "--check-in-place",
        action="store_true",
        help="probe every vLLM worker: storage pointers and load_weights calls during the syncs",
    )
    p.add_argument("--model-config", default=str(DEFAULT_MODEL), help="an HF config.json of a supported architecture")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument(
        "--fp8",
        action="store_true",
        help="receivers hold FP8 block-quantised weights (e4m3, 128x128 tiles, weight_scale_inv); "
        "trainers quantise their own weights on the fly",
    )
    p.add_argument(
        "--fp8-auto",
        action="store_true",
        help="with --fp8: the trainers' writers take quantize_on_receive='auto' with their bf16 weights (who quantises "
        "is picked when the ranks plan) instead of FP8 views of their own",
    )
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=180.0)
    p.add_argument("--workdir", default=None, help="where to make the model (default: a temporary folder)")
    p.add_argument(
        "--infer-model-config",
        default=None,
        help="give the receivers a different model (bad-input check: the sync must refuse it)",
    )
    p.add_argument("--fail-rank", type=int, default=None, help="fault check: this trainer rank dies ...")
    p.add_argument("--fail-step", type=int, default=None, help="... at the start of this step's sync")
    p.add_argument(
        "--log-level",
        choices=["warning", "info", "debug"],
        default="warning",
        help="info: every rank logs each sync, and the phases of each new plan (planning, agreement, set-up, transfer)",
    )
    p.add_argument(
        "--launcher",
        choices=["spawn", "ray"],
        default="spawn",
        help="ray: trainer ranks as Ray tasks and engines as Ray actors, placed by placement groups on a local "
        "Ray cluster (with --hosts 2: a head node and a worker node in two network namespaces)",
    )
    args = p.parse_args(argv)
    if args.launcher == "ray" and (args.control == "vllm-http" or args.check_in_place or args.inference == "layout"):
        p.error("--launcher ray: vLLM (offline) or HF receivers, without --control vllm-http or --check-in-place")
    if args.fp8_auto and not args.fp8:
        p.error("--fp8-auto: with --fp8")
    if args.control == "vllm-ray" and (args.launcher != "ray" or args.inference != "vllm" or args.fp8):
        p.error("--control vllm-ray: with --launcher ray and --inference vllm, without --fp8")
    return args
