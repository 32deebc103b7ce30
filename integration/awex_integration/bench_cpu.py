"""CPU transports through the public path: a trainer rank and receiver ranks in their own processes, syncing through
``WeightsWriter`` / ``WeightsReader`` and an embedded MetaServer, over gloo and over host shared memory.

    python -m awex_integration.bench_cpu [--model qwen3-8b --layers 4] [--receivers 1] [--iters 7] [--out F]

Each transport's steady-state sync (median; every rank starts each timed sync at one instant, the time runs to the
last rank finishing) is given as a ratio to a limit measured in the same run: this machine's memory copy rate
(one process copying a buffer as large as the model, best of 5). The bound: two copies of the model at that rate,
one after the other: the sender's (shm: into its segment; gloo: at least into the socket) and the receivers' (out
of it, each receiver on its own core, at once). Every received tensor is checked.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

MODELS = Path(__file__).resolve().parents[1] / "models"


def _tensors(model: str, layers: int | None):
    from awex.meta import canonical_tensors

    config = json.loads((MODELS / f"{model}.json").read_text())
    if layers is not None:
        config["num_hidden_layers"] = layers
    return canonical_tensors(config, dtype="bfloat16")


def _layouts(model: str, layers: int | None, receivers: int):
    from awex.meta.layouts import MegatronParallel, VllmParallel, megatron_layout, vllm_layout

    tensors = _tensors(model, layers)
    return (
        megatron_layout(tensors, MegatronParallel(tp=1), instance="trainer"),
        [vllm_layout(tensors, VllmParallel(tp=1), instance=f"vllm-{i}") for i in range(receivers)],
    )


def _views(layout, value: float | None):
    import torch

    held = {}

    def view_of(name, box):
        key = (name, box.offsets)
        if key not in held:
            held[key] = torch.full(box.sizes, -1.0 if value is None else value, dtype=torch.bfloat16)
        return held[key]

    return view_of, held


def rank_main(
    address: str, role: str, model: str, layers: int | None, receivers: int, transport: str, iters: int
) -> dict:
    import torch

    from awex.engines.reader import WeightsReader
    from awex.engines.writer import WeightsWriter
    from awex.meta.client import MetaClient

    torch.set_num_threads(1)
    client = MetaClient(address, job=f"bench-{transport}", timeout=120)
    trainer, engines = _layouts(model, layers, receivers)
    ranks = 1 + receivers
    times, bad = [], 0
    if role == "trainer":
        view_of, held = _views(trainer, 0.0)
        side = WeightsWriter(client, trainer, 0, view_of, transport=transport, timeout=120)
    else:
        layout = next(e for e in engines if e.instance == role)
        view_of, held = _views(layout, None)
        side = WeightsReader(client, layout, 0, view_of, timeout=120)
    for step in range(iters + 1):  # the first sync plans and builds: not timed
        if role == "trainer":
            for t in held.values():
                t.fill_(float(step + 1))
        client.agree(f"bench/ready/{step}", role, ranks, "go", timeout=120)
        if role == "trainer":
            client.put(f"bench/when/{step}", time.time() + 0.05)
        at = client.get(f"bench/when/{step}", timeout=60)
        while time.time() < at:
            pass
        started = time.time()
        if role == "trainer":
            side.write(f"v{step}", [e.instance for e in engines])
        else:
            side.receive(f"v{step}")
        finished = time.time()
        if role != "trainer":  # checked outside the timed span
            bad += sum(not bool((t == float(step + 1)).all()) for t in held.values())
        if step:
            times.append((started, finished))
    used = side.transport_in_use if role == "trainer" else None
    if role == "trainer":
        side.flush()
    side.close()
    return {
        "times": times,
        "bad": bad,
        "transport": used,
        "bytes": sum(t.numel() * t.element_size() for t in held.values()),
    }


def memcpy_rate(nbytes: int) -> float:
    """Bytes per second one process copies a buffer of ``nbytes`` (best of 5)."""
    import torch

    torch.set_num_threads(1)
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - started)
    return nbytes / best


def run(model: str, layers: int | None, receivers: int, transport: str, iters: int) -> dict:
    from awex.meta.server import start_embedded
    from awex_integration.spawn import run_processes

    server = start_embedded()
    try:
        roles = ["trainer", *[f"vllm-{i}" for i in range(receivers)]]
        out = run_processes(
            [(r, rank_main, (server.address, r, model, layers, receivers, transport, iters)) for r in roles],
            timeout=600,
        )
    finally:
        server.stop()
    failed = {k: v for k, (s, v) in out.items() if s != "ok"}
    if failed:
        raise RuntimeError(f"{transport}: {failed}")
    spans = [
        max(out[r][1]["times"][i][1] for r in roles) - min(out[r][1]["times"][i][0] for r in roles)
        for i in range(iters)
    ]
    return {
        "transport": out["trainer"][1]["transport"],
        "seconds": statistics.median(spans),
        "seconds_all": [round(x, 6) for x in spans],
        "model_bytes": out["trainer"][1]["bytes"],
        "mismatched_tensors": sum(out[r][1]["bad"] for r in roles),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--receivers", type=int, default=1)
    ap.add_argument("--transports", default="p2p,shm")
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--device", default="CPU", help="how the results name this machine")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = [run(args.model, args.layers, args.receivers, t, args.iters) for t in args.transports.split(",")]
    nbytes = rows[0]["model_bytes"]
    rate = memcpy_rate(nbytes)
    for row in rows:
        row["bound_seconds"] = 2 * nbytes / rate
        row["ratio"] = round(row["seconds"] / row["bound_seconds"], 3)
        print(
            f"{row['transport']}: {row['seconds'] * 1e3:.1f} ms for {nbytes / 1e6:.0f} MB to {args.receivers} "
            f"receiver(s); bound {row['bound_seconds'] * 1e3:.1f} ms; ratio {row['ratio']}; mismatched "
            f"{row['mismatched_tensors']}",
            flush=True,
        )
    result = {
        "device": args.device,
        "date": time.strftime("%Y-%m-%d"),
        "memcpy_bytes_per_s": round(rate),
        "bound": "2 x model bytes / memcpy rate (the sender's copy, then the receivers' copies at once)",
        "model": args.model,
        "layers": args.layers,
        "receivers": args.receivers,
        "rows": rows,
        "command": "python -m awex_integration.bench_cpu " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if all(r["mismatched_tensors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
