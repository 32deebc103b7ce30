"""What NCCL point to point costs over its rate per grouped call and per message, between two GPUs.

Rank 0 (GPU 0) sends ``--gib`` GiB to rank 1 (GPU 1) as C grouped calls (``batch_isend_irecv``, one after the
other on the device, as the point-to-point executor posts its waves) of M equal messages each, for several (C, M);
the medians of five runs after a warm-up, in ms and GB/s, and each as a ratio to one call of one message measured in
the same run (NCCL's own rate). The wave executor's choices follow from it (docs/performance.md). Needs 2 GPUs.

    python -m awex_integration.benchmarks.nccl_messages [--out integration/results/nccl-messages-2xh200.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import datetime, timezone

SHAPES = ((1, 1), (64, 1), (64, 4), (16, 1), (16, 4), (16, 16), (4, 1), (4, 16), (1, 64), (1, 256))  # (calls, messages)


def _worker(rank: int, port: int, nbytes: int, out) -> None:
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, device_id=device)
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    op = dist.isend if rank == 0 else dist.irecv
    got = {}
    for calls, per in SHAPES:
        size = nbytes // (calls * per)
        chunks = [buf[i * size : (i + 1) * size] for i in range(calls * per)]
        times = []
        for run in range(6):
            dist.barrier()
            torch.cuda.synchronize()
            started = time.perf_counter()
            for c in range(calls):
                for work in dist.batch_isend_irecv([dist.P2POp(op, chunks[c * per + j], 1 - rank) for j in range(per)]):
                    work.wait()  # the device waits, the host goes on
            torch.cuda.synchronize()
            if run:  # the first is a warm-up
                times.append(time.perf_counter() - started)
        got[(calls, per)] = sorted(times)[len(times) // 2]
    if rank == 0:
        out.put({f"{c}x{m}": s for (c, m), s in got.items()})
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    import torch
    import torch.multiprocessing as mp

    from awex.transport.net import free_port

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=int, default=8, help="GiB sent in each run")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if torch.cuda.device_count() < 2:
        print(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
        return 1
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    nbytes = a.gib << 30
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, nbytes, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = out.get(timeout=600)
    for p in procs:
        p.join(60)
    one = got["1x1"]
    runs = []
    for calls, per in SHAPES:
        s = got[f"{calls}x{per}"]
        runs.append(
            {
                "calls": calls,
                "messages_per_call": per,
                "message_mib": nbytes // (calls * per) >> 20,
                "ms": round(s * 1e3, 3),
                "GB_per_s": round(nbytes / s / 1e9, 1),
                "ratio_to_one_message": round(s / one, 4),
                "us_over_one_message_per_message": round((s - one) / max(1, calls * per - 1) * 1e6, 2),
            }
        )
        print(f"{calls:3d} calls x {per:3d} messages: {s * 1e3:8.3f} ms {nbytes / s / 1e9:6.1f} GB/s", flush=True)
    if a.out:
        doc = {
            "what": f"NCCL point to point, GPU 0 -> GPU 1, {a.gib} GiB as C grouped calls of M messages, medians of 5",
            "device": f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}",
            "date": datetime.now(timezone.utc).date().isoformat(),
            "runs": runs,
        }
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
