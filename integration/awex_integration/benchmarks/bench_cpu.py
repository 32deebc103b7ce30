"""CPU transports through the public path: a trainer rank and receiver ranks in their own processes, syncing through
``WeightsWriter`` / ``WeightsReader`` and an embedded MetaServer, over gloo, host shared memory and rdma (Mooncake's
transfer engine over TCP here).

    python -m awex_integration.benchmarks.bench_cpu [--model qwen3-8b --layers 4] [--receivers 1] [--iters 7] [--out F]

Each transport's steady-state sync (median; every rank starts each timed sync at one instant, the time runs to the
last rank finishing) is given as a ratio to a limit measured in the same run: the sender's copy of the model (shm:
into its segment; gloo: at least into the socket; rdma: into its registered buffer) and each receiver's copy out,
all at once, at the rate this machine's cores copy together (1 + receivers processes copying at once). The older
bound, the two copies one after the other at one process's memcpy rate, is kept beside it. Every received tensor
is checked.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

MODELS = Path(__file__).resolve().parents[2] / "models"


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


def _copier_process(nbytes: int, rounds: int, barrier, out) -> None:
    import torch

    torch.set_num_threads(1)
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages
    times = []
    for _ in range(rounds):
        barrier.wait()
        started = time.perf_counter()
        dst.copy_(src)
        times.append((started, time.perf_counter()))
    out.put(times)


def concurrent_copy_rate(copiers: int, nbytes: int = 512 << 20, rounds: int = 5) -> float:
    """Bytes per second that ``copiers`` processes copying at once move together (each its own buffer of
    ``nbytes``, started together; best of ``rounds``): the rate when a sender and its receivers all copy at once."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(copiers), ctx.Queue()
    procs = [ctx.Process(target=_copier_process, args=(nbytes, rounds, barrier, out)) for _ in range(copiers)]
    for p in procs:
        p.start()
    per_proc = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(30)
    spans = [max(t[i][1] for t in per_proc) - min(t[i][0] for t in per_proc) for i in range(rounds)]
    return copiers * nbytes / min(spans)


def run(model: str, layers: int | None, receivers: int, transport: str, iters: int) -> dict:
    from awex.meta.server import start_embedded
    from awex_integration.scenarios.spawn import run_processes

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
    ap.add_argument("--transports", default="p2p,shm,rdma")
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--device", default="CPU", help="how the results name this machine")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = [run(args.model, args.layers, args.receivers, t, args.iters) for t in args.transports.split(",")]
    nbytes = rows[0]["model_bytes"]
    rate = memcpy_rate(nbytes)
    together = concurrent_copy_rate(1 + args.receivers)
    for row in rows:
        row["bound_seconds"] = (1 + args.receivers) * nbytes / together
        row["ratio"] = round(row["seconds"] / row["bound_seconds"], 3)
        row["one_after_the_other_seconds"] = 2 * nbytes / rate
        row["ratio_one_after_the_other"] = round(row["seconds"] / row["one_after_the_other_seconds"], 3)
        print(
            f"{row['transport']}: {row['seconds'] * 1e3:.1f} ms for {nbytes / 1e6:.0f} MB to {args.receivers} "
            f"receiver(s); bound {row['bound_seconds'] * 1e3:.1f} ms (all copies at once; one after the other "
            f"{row['one_after_the_other_seconds'] * 1e3:.1f} ms); ratio {row['ratio']}; mismatched "
            f"{row['mismatched_tensors']}",
            flush=True,
        )
    result = {
        "device": args.device,
        "date": time.strftime("%Y-%m-%d"),
        "memcpy_bytes_per_s": round(rate),
        "copies_at_once_bytes_per_s": round(together),
        "bound": "(1 + receivers) x model bytes / the rate at which 1 + receivers processes copy together (the "
        "sender's copy and every receiver's, all at once: what a pipelined transport can reach); also the older "
        "bound, 2 x model bytes / one process's memcpy rate (the sender's copy, then the receivers')",
        "model": args.model,
        "layers": args.layers,
        "receivers": args.receivers,
        "rows": rows,
        "command": "python -m awex_integration.benchmarks.bench_cpu "
        + " ".join(sys.argv[1:] if argv is None else argv),
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if all(r["mismatched_tensors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
