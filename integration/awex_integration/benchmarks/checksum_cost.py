"""What the delta checksum costs on a GPU: ``awex.transport.checksum`` over a random bucket, against the time to
read the bucket once at the device's copy rate measured in the same run (a device-to-device copy reads and writes
each byte; reading alone at that rate takes half its time).

    python -m awex_integration.benchmarks.checksum_cost [--mib 256] \
        [--out integration/results/checksum-cost-1xh100.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import datetime, timezone


def _median_ms(fn, iters: int) -> float:
    import torch

    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    import torch

    from awex.transport.checksum import checksum_kernel, checksum_torch

    ap = argparse.ArgumentParser(description="The delta checksum's cost on a GPU, against reading the bucket once.")
    ap.add_argument("--mib", type=int, default=256, help="bucket size in MiB (default 256)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("checksum_cost: needs a CUDA GPU", file=sys.stderr)
        return 2
    n = args.mib << 19  # 16-bit words
    g = torch.Generator(device="cuda").manual_seed(0)
    words = torch.randint(-(1 << 15), 1 << 15, (n,), generator=g, dtype=torch.int16, device="cuda")
    small = words[: 1 << 20]
    assert checksum_kernel(small) == checksum_torch(small.cpu()), "kernel and definition differ"
    dst = torch.empty_like(words)
    for _ in range(3):  # warm-up: the kernel's compilation, the copy
        checksum_kernel(words)
        dst.copy_(words)
    copy_ms = _median_ms(lambda: dst.copy_(words), args.iters)
    sum_ms = _median_ms(lambda: checksum_kernel(words), args.iters)
    read_bound_ms = copy_ms / 2  # a copy reads and writes every byte
    result = {
        "device": torch.cuda.get_device_name(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "bucket_mib": args.mib,
        "checksum_ms": round(sum_ms, 4),
        "read_bound_ms": round(read_bound_ms, 4),
        "ratio": round(sum_ms / read_bound_ms, 3),
        "copy_tb_per_s": round(2 * words.nbytes / copy_ms / 1e9, 3),
    }
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
