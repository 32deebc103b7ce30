"""How fast GPUs read each other's memory in the patterns CUDA IPC receivers make, by copy engines and by kernels.

Two receivers (GPUs 2 and 3) read 4 GiB each from two sources (GPUs 0 and 1): one source each (as a receiver of
a matching shard does), or both sources, alternating 64-MiB chunks (as a receiver of a resharded model does, while
the other receiver does the same). Each pattern is run by copy engines (``cuMemcpyAsync`` on three streams of the
reading GPU, issued in its context: :func:`awex.transport.peer_dma.pull_bytes`) and by one kernel launch of the
reading GPU (:class:`awex.transport.batched_copy.BatchedCopy`, its loads crossing NVLink), the medians of five runs
as GB/s per receiver and as a ratio to one copy-engine pull from one source measured in the same run.
``IpcOptions.kernel_reads`` follows from it (docs/performance.md). Needs 4 GPUs with peer access.

    python -m awex_integration.benchmarks.peer_reads [--out integration/results/peer-reads-4xh200.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import datetime, timezone

CHUNK = 64 << 20
STREAMS = 3


def main(argv: list[str] | None = None) -> int:
    import torch

    from awex.transport.batched_copy import BatchedCopy
    from awex.transport.peer_dma import enable_peer_access, pull_bytes

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=int, default=4, help="GiB each receiver reads")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if torch.cuda.device_count() < 4:
        print(f"needs 4 GPUs, this machine has {torch.cuda.device_count()}")
        return 1
    n = a.gib << 30
    k = n // CHUNK
    buf = {g: torch.empty(n, dtype=torch.uint8, device=f"cuda:{g}") for g in range(4)}
    for x in range(4):
        for y in range(4):
            enable_peer_access(torch.device(f"cuda:{x}"), torch.device(f"cuda:{y}"))
    streams = {d: [torch.cuda.Stream(f"cuda:{d}") for _ in range(STREAMS)] for d in (2, 3)}

    def by_copy_engines(plan: dict[int, list[int]]):
        def run():
            for d, order in plan.items():
                torch.cuda.set_device(d)  # each copy in the reading GPU's context
                for i, s in enumerate(order):
                    at = i * CHUNK
                    pull_bytes(buf[d].data_ptr() + at, buf[s].data_ptr() + at, CHUNK, streams[d][i % STREAMS])

        return run

    def by_kernels(plan: dict[int, list[int]]):
        launches = {}
        for d, order in plan.items():
            torch.cuda.set_device(d)
            pairs = [
                (buf[d][i * CHUNK : (i + 1) * CHUNK], buf[s][i * CHUNK : (i + 1) * CHUNK]) for i, s in enumerate(order)
            ]
            launches[d] = BatchedCopy([], spread=pairs)

        def run():
            for d, launch in launches.items():
                torch.cuda.set_device(d)
                with torch.cuda.stream(streams[d][0]):
                    launch()

        return run

    def seconds(run) -> float:
        run()
        times = []
        for _ in range(5):
            for g in range(4):
                torch.cuda.synchronize(g)
            t0 = time.perf_counter()
            run()
            for g in range(4):
                torch.cuda.synchronize(g)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    patterns = {
        "one receiver, one source": {2: [0] * k},
        "one source each": {2: [0] * k, 3: [1] * k},
        "both sources each, alternating": {2: [0, 1] * (k // 2), 3: [1, 0] * (k // 2)},
        "one receiver, both sources": {2: [0, 1] * (k // 2)},
    }
    rows = []
    reference = seconds(by_copy_engines(patterns["one receiver, one source"]))
    for name, plan in patterns.items():
        for how, make in (("copy engines", by_copy_engines), ("kernels", by_kernels)):
            s = seconds(make(plan))
            rows.append(
                {
                    "pattern": name,
                    "by": how,
                    "seconds": round(s, 6),
                    "gb_per_s_per_receiver": round(n / s / 1e9, 1),
                    "over_one_pull": round(s / reference, 3),
                }
            )
            print(
                f"{name:32s} {how:12s} {n / s / 1e9:6.1f} GB/s per receiver ({s / reference:.2f}x one pull)", flush=True
            )
    doc = {
        "what": __doc__.split("\n\n")[0],
        "device": f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}",
        "date": datetime.now(timezone.utc).date().isoformat(),
        "bytes_per_receiver": n,
        "runs": rows,
    }
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
