"""Baseline: checkpoint-engine 0.4.2 (MoonshotAI), in its home setting: trainer and engine colocated on one GPU.

checkpoint-engine keeps the checkpoint in pinned host memory (``ParameterServer.register_checkpoint``), and each
``update`` copies it host -> GPU in buckets, broadcasts the buckets among its ranks, and hands each bucket to
the engine over ZMQ with a CUDA IPC handle; the engine's worker loads the bucket's tensors
(``checkpoint_engine.worker.update_weights_from_ipc``, what its vLLM worker extension calls). Here the engine
side loads into tensors in vLLM's layout through Awex's converters (no vLLM on the GPU machines), the same
tensors the Awex scenario ``colocated_1gpu_ipc`` fills, and checks them bit for bit.

Two numbers: ``register_seconds`` (the trainer's new weights into pinned host memory, once per version in an
RL loop) and ``update_seconds`` (median of ``--iters`` updates of an already registered version: its best
case). It runs in processes of its own: its ``ParameterServer`` owns torch.distributed's default group.

    python -m awex_integration.benchmarks.bench_checkpoint_engine --iters 3 --out ce.json

Needs ``checkpoint-engine==0.4.2`` and its imports (pyzmq, loguru, fastapi, pydantic) and one CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from awex_integration.benchmarks.bench_common import (
    SCENARIOS,
    fill,
    layouts_of,
    mismatches,
    model_tensors,
    native_params,
)

SCENARIO = next(s for s in SCENARIOS if s.name == "colocated_1gpu_ipc")


def _setup(role: str, model: str, layers: int | None):
    import torch

    from awex.transport import LocalShards

    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    dims, tensors = model_tensors(model, layers)
    engine = next(e for e in SCENARIO.engines if (e.kind == "megatron") == (role == "trainer"))
    layout = next(x for x in layouts_of(SCENARIO, tensors) if x.instance == engine.instance)
    params, view_of = native_params(engine, 0, dims, device)
    return torch, device, layout, LocalShards.from_layout(layout, 0, view_of), params


def trainer(model: str, layers: int | None, iters: int, workdir: str, port: int) -> dict:
    torch, device, layout, shards, _ = _setup("trainer", model, layers)
    from checkpoint_engine.ps import ParameterServer

    fill(shards, layout, 1, device)
    named = {}
    for name in shards.names():  # the canonical (HF) tensors, as an RL trainer would hand them over
        full = torch.empty(layout.tensor(name).spec.shape, dtype=torch.bfloat16, device=device)
        for box, view in shards.pairs(name):
            full[box.slices()].copy_(view)
        named[name] = full
    torch.cuda.synchronize()
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")  # its constructor reads them
    ps = ParameterServer(rank=0, world_size=1, master_addr="127.0.0.1", master_port=port)
    t0 = time.perf_counter()
    ps.register_checkpoint("v1", named_tensors=named)
    register = time.perf_counter() - t0
    del named
    torch.cuda.empty_cache()
    ps.gather_metas("v1")
    seconds = []
    for i in range(iters):

        def ask_engine(paths, i=i):  # checkpoint-engine's req_func: tell the engine where to connect
            Path(workdir, f"req-{i}.json.tmp").write_text(json.dumps(paths))
            os.replace(Path(workdir, f"req-{i}.json.tmp"), Path(workdir, f"req-{i}.json"))

        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ps.update("v1", ask_engine)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    return {"register_seconds": register, "update_seconds_all": seconds}


def engine(model: str, layers: int | None, iters: int, workdir: str) -> dict:
    torch, device, layout, shards, _ = _setup("engine", model, layers)
    import zmq
    from checkpoint_engine.worker import update_weights_from_ipc

    def load(weights) -> None:
        for name, tensor in weights:
            for box, view in shards.pairs(name):
                view.copy_(tensor[box.slices()])

    ctx = zmq.Context()
    for i in range(iters):
        req = Path(workdir, f"req-{i}.json")
        deadline = time.monotonic() + 300
        while not req.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no update request {i} from the parameter server")
            time.sleep(0.0005)
        paths = json.loads(req.read_text())
        update_weights_from_ipc(ctx, paths[0][1], device_id=device.index, run=load)
    torch.cuda.synchronize()
    return {"mismatches": mismatches(shards, layout, 1, device)[:10]}


def run(model: str = "qwen3-8b", layers: int | None = None, iters: int = 3, timeout: float = 400.0) -> dict:
    """Both processes; returns the numbers (or ``{"error": ...}``)."""
    import subprocess

    from awex.transport.net import free_ports

    with tempfile.TemporaryDirectory() as work:
        port = free_ports(1)[0]
        common = ["--model", model, "--iters", str(iters), "--workdir", work, "--port", str(port)]
        if layers:
            common += ["--layers", str(layers)]
        procs = {
            role: subprocess.Popen(
                [sys.executable, "-m", "awex_integration.benchmarks.bench_checkpoint_engine", "--role", role, *common],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for role in ("trainer", "engine")
        }
        outs = {}
        for role, p in procs.items():
            try:
                outs[role] = p.communicate(timeout=timeout)[0]
            except subprocess.TimeoutExpired:
                for q in procs.values():
                    q.kill()
                return {"error": f"checkpoint-engine {role} timed out"}
            if p.returncode != 0:
                return {"error": f"checkpoint-engine {role} failed: {outs[role][-1500:]}"}
        docs = {role: json.loads(out.strip().splitlines()[-1]) for role, out in outs.items()}
    times = docs["trainer"]["update_seconds_all"]
    return {
        "version": "checkpoint-engine 0.4.2",
        "register_seconds": round(docs["trainer"]["register_seconds"], 6),
        "update_seconds": round(statistics.median(times), 6),
        "update_seconds_all": [round(t, 6) for t in times],
        "correct": not docs["engine"]["mismatches"],
        "mismatches": docs["engine"]["mismatches"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", choices=("trainer", "engine"), help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.role == "trainer":
        print(json.dumps(trainer(args.model, args.layers, args.iters, args.workdir, args.port)), flush=True)
        return 0
    if args.role == "engine":
        print(json.dumps(engine(args.model, args.layers, args.iters, args.workdir)), flush=True)
        return 0
    result = run(args.model, args.layers, args.iters)
    print(json.dumps(result), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result.get("correct") else 1


if __name__ == "__main__":
    sys.exit(main())
