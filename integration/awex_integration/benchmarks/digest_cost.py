"""What verify mode's digests cost: every tensor of a model (bf16) digested as verify mode does (on CUDA the regions
laid out once, :mod:`awex.transport.digest_batch`; elsewhere region by region), against the time to read the same
bytes once at the device's copy rate measured in the same run (a copy reads and writes each byte; reading alone at
that rate takes half its time). Two cuts: whole tensors (a trainer's views), and the right half of every matrix's
columns (a tensor-parallel engine's row-parallel shards: strided rows). On CUDA also region by region (a launch
each), for comparison.

    python -m awex_integration.benchmarks.digest_cost [--model qwen3-8b] [--device cuda] \
        [--out integration/results/digest-cost-1xh200.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from functools import partial


def _median_s(fn, iters: int, sync) -> float:
    times = []
    for _ in range(iters):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    import torch

    from awex.meta import Box
    from awex.transport import LocalShards
    from awex.transport.digest import piece_digest_torch, region_digest, salt
    from awex.transport.digest_batch import batch
    from awex_integration.benchmarks.bench_common import model_tensors

    ap = argparse.ArgumentParser(description="Verify mode's digests over a model, against reading it once.")
    ap.add_argument("--model", default="qwen3-8b", help="integration/models/NAME.json (default qwen3-8b)")
    ap.add_argument("--layers", type=int, default=None, help="keep this many layers (default: all)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("digest_cost: --device cuda needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    _, tensors = model_tensors(args.model, args.layers)
    g = torch.Generator(device=device).manual_seed(0)
    weights = {
        t.name: torch.randint(-(1 << 15), 1 << 15, t.spec.shape, generator=g, dtype=torch.int16, device=device).view(
            torch.bfloat16
        )
        for t in tensors
    }
    nbytes = sum(w.nbytes for w in weights.values())
    shapes = {t.name: tuple(t.spec.shape) for t in tensors}
    whole = LocalShards({n: [(Box((0,) * w.dim(), tuple(w.shape)), w)] for n, w in weights.items()})

    def halves():  # the right half of every matrix's columns (strided rows), vectors whole
        out = {}
        for n, w in weights.items():
            if w.dim() == 2:
                c = w.shape[1] // 2
                out[n] = (w[:, c:], (0, c))
            else:
                out[n] = (w, (0,) * w.dim())
        return out

    cut = halves()
    cut_shards = LocalShards({n: [(Box(o, tuple(v.shape)), v)] for n, (v, o) in cut.items()})
    cut_bytes = sum(v.nbytes for v, _ in cut.values())

    def one_by_one(shards, regions):
        for n, (o, s) in regions.items():
            region_digest(shards, n, shapes[n], "bfloat16", o, s)

    def batched(shards, regions):
        laid_out = batch(shards, [(n, shapes[n], "bfloat16", o, s) for n, (o, s) in regions.items()])
        return laid_out.sums

    cuda = device.type == "cuda"

    whole_regions = {n: ((0,) * w.dim(), tuple(w.shape)) for n, w in weights.items()}
    cut_regions = {n: (o, tuple(v.shape)) for n, (v, o) in cut.items()}
    small = next(iter(weights.values()))[:64]  # the kernel (CUDA) against the definition
    assert region_digest(LocalShards({"x": [(Box((0, 0), tuple(small.shape)), small)]}), "x", tuple(small.shape),
                         "bfloat16", (0, 0), tuple(small.shape)) == piece_digest_torch(
        small.cpu(), (0, 0), tuple(small.shape), salt("x"))  # fmt: skip
    dst = {n: torch.empty_like(w) for n, w in weights.items()}

    def copy_all():
        for n, w in weights.items():
            dst[n].copy_(w)

    if cuda:  # as verify mode runs: laid out once, then a few launches per version
        run_whole, run_cut = batched(whole, whole_regions), batched(cut_shards, cut_regions)
    else:
        run_whole, run_cut = partial(one_by_one, whole, whole_regions), partial(one_by_one, cut_shards, cut_regions)
    for _ in range(2):  # warm-up: the kernels' compilation, the copies
        copy_all()
        run_whole()
        run_cut()
    copy_s = _median_s(copy_all, args.iters, sync)
    whole_s = _median_s(run_whole, args.iters, sync)
    cut_s = _median_s(run_cut, args.iters, sync)
    each_s = _median_s(partial(one_by_one, whole, whole_regions), args.iters, sync) if cuda else None
    read_s = copy_s / 2  # a copy reads and writes every byte
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "model": args.model + (f" ({args.layers} layers)" if args.layers else ""),
        "tensors": len(weights),
        "bytes": nbytes,
        "copy_seconds": round(copy_s, 6),
        "read_bound_seconds": round(read_s, 6),
        "digest_whole_seconds": round(whole_s, 6),
        "digest_whole_ratio": round(whole_s / read_s, 3),
        "digest_column_half_bytes": cut_bytes,
        "digest_column_half_seconds": round(cut_s, 6),
        "digest_column_half_ratio": round(cut_s / (read_s * cut_bytes / nbytes), 3),
        "copy_gb_per_s": round(2 * nbytes / copy_s / 1e9, 3),
        **({"digest_whole_one_launch_per_region_seconds": round(each_s, 6)} if each_s is not None else {}),
    }
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
