"""The control plane alone: every rank of a small RL job discovers its peers through an embedded MetaServer,
computes the transfer plan on its own, and proves that all ranks computed the same plan; then the planner dry-runs
a Qwen3-235B-shaped MoE model on 1,000 ranks.

This demo moves no weights: the main job (``integration/demo.py``) and ``examples/`` move them through the
transports and engine bindings.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path

from awex.meta import canonical_tensors, load_config, plan_transfers
from awex.meta.client import MetaClient
from awex.meta.layouts import MegatronParallel, VllmParallel, megatron_layout, vllm_layout
from awex.meta.server import start_embedded

MODELS = Path(__file__).resolve().parent / "models"
VERSION = "step-1"


def rank_main(
    address: str, token: str, instance: str, local_rank: int, world: int, peers: list[str], out: dict
) -> None:
    """What one rank does at set-up: fetch every layout, plan, agree on the plan's digest."""
    client = MetaClient(address, job="demo", token=token, timeout=30.0)
    layouts = [client.fetch_layout(name, VERSION) for name in peers]
    sources = [lay for lay in layouts if lay.role.value == "trainer"]
    dests = [lay for lay in layouts if lay.role.value == "inference"]
    plan = plan_transfers(sources, dests)
    me = plan.rank(instance, local_rank)
    agreed = client.agree(f"plan/{VERSION}", f"{instance}:{local_rank}", world, plan.digest, timeout=30.0)
    out[(instance, local_rank)] = (agreed, len(plan.schedule(me.rank)), plan)


def main() -> int:
    token = secrets.token_hex(16)
    server = start_embedded(token=token)
    print(f"[1/4] MetaServer embedded at {server.address} (token required)")
    tensors = canonical_tensors(load_config(MODELS / "qwen2-tiny.json"))
    trainer = megatron_layout(tensors, MegatronParallel(tp=2, pp=2, dp=2, vocab_pad=1), instance="trainer")
    engines = [vllm_layout(tensors, VllmParallel(tp=2), instance=f"vllm-{i}") for i in range(2)]
    client = MetaClient(server.address, job="demo", token=token)
    for layout in (trainer, *engines):
        client.register(layout.instance, role=layout.role.value, instance=layout.instance, world_size=layout.world_size)
        client.publish_layout(layout, VERSION)
    print(
        f"[2/4] published layouts: trainer Megatron tp=2 pp=2 dp=2 ({trainer.world_size} ranks), "
        f"2 x vLLM tp=2 ({len(tensors)} canonical tensors of a tiny Qwen2)"
    )

    peers = [trainer.instance, *(e.instance for e in engines)]
    world = trainer.world_size + sum(e.world_size for e in engines)
    results: dict = {}
    threads = [
        threading.Thread(target=rank_main, args=(server.address, token, lay.instance, r, world, peers, results))
        for lay in (trainer, *engines)
        for r in range(lay.world_size)
    ]
    started = time.perf_counter()
    [t.start() for t in threads]
    [t.join() for t in threads]
    digests = {agreed for agreed, _, _ in results.values()}
    if len(results) != world or len(digests) != 1:
        print(f"FAILED: {len(results)} of {world} ranks finished, digests {digests}")
        return 1
    plan = next(iter(results.values()))[2]
    s = plan.summary()
    print(
        f"[3/4] {world} ranks planned independently and agree on digest {digests.pop()[:16]} "
        f"in {time.perf_counter() - started:.2f} s: {s['ops']} transfers, {s['total_bytes']:,} bytes, "
        f"busiest sender {s['max_rank_send_bytes']:,} B (lower bound {s['lower_bound_send_bytes']:,} B)"
    )
    for e in engines:
        client.report_version(e.instance, VERSION)
    subprocess.run([sys.executable, "-m", "awex.meta.cli", "status", server.address, "--token", token], check=True)
    server.stop()

    print(
        "\n[4/4] planner dry run: Qwen3-235B-A22B-shaped MoE, Megatron tp=4 pp=8 ep=8 dp=16 (512 ranks) "
        "-> 61 vLLM engines tp=8 ep=8 (488 ranks)"
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "awex.meta.cli",
            "plan",
            "--model",
            str(MODELS / "qwen3-235b-a22b.json"),
            "--trainer",
            "megatron:tp=4,pp=8,ep=8,dp=16,first=11,last=11",
            "--inference",
            "vllm:tp=8,ep=8,instances=61",
            "--link-gbps",
            "50",
            "--json",
        ],
        capture_output=True,
        text=True,
    )
    print(out.stdout.rstrip())
    if out.returncode != 0:
        print(out.stderr, file=sys.stderr)
        return out.returncode
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    return 0 if doc["coverage_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
