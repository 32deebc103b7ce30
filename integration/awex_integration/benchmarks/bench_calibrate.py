"""Calibration of a GPU benchmark run: the link and copy rates of the machine it runs on, measured before the
syncs (``bench_gpu --calibrate``)."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path


def calibrate_worker(rank: int, world: int, port: int, nbytes: int, out_file: str) -> None:
    """Ranks 0..world-1 on GPUs 0..world-1: pair send 0->1, two into one (0,1 -> 2), device copy on GPU 0."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, device_id=torch.device("cuda", rank)
    )
    buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    res = {}

    def timed(fn, reps=5):
        ts = []
        for _ in range(reps):
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            t = torch.tensor([time.perf_counter() - t0], device="cuda")
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            ts.append(float(t))
        return statistics.median(ts[1:])

    def pair():
        if world < 2:
            return
        if rank == 0:
            dist.send(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)

    res["pair_seconds"] = timed(pair)
    res["pair_bps"] = nbytes / res["pair_seconds"] if world >= 2 else 0.0
    if world >= 2:  # the same link driven by the copy engines (what colocated CUDA IPC syncs use)
        peer = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", 1)) if rank == 0 else None

        def dma():
            if peer is not None:
                peer.copy_(buf, non_blocking=True)
                torch.cuda.synchronize(peer.device)

        res["dma_seconds"] = timed(dma)
        res["dma_bps"] = nbytes / res["dma_seconds"]
        del peer
    if world >= 3:
        half = buf[: nbytes // 2]
        other = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")

        def two_into_one():
            ops = []
            if rank in (0, 1):
                ops.append(dist.P2POp(dist.isend, half, 2))
            elif rank == 2:
                ops += [dist.P2POp(dist.irecv, half, 0), dist.P2POp(dist.irecv, other, 1)]
            if ops:
                for w in dist.batch_isend_irecv(ops):
                    w.wait()

        res["two_into_one_seconds"] = timed(two_into_one)
        res["two_into_one_bps"] = nbytes / res["two_into_one_seconds"]
    # the host side of the shm transport: page-locked host memory <-> GPU on the copy engines
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) if rank < 2 else None

    def d2h():
        if rank == 0:
            pinned.copy_(buf, non_blocking=True)
            torch.cuda.synchronize()

    def h2d():
        if rank == 0:
            buf.copy_(pinned, non_blocking=True)
            torch.cuda.synchronize()

    def d2h_while_h2d():  # GPU 0 to host while host to GPU 1: a sender filling while a receiver empties
        if rank == 0:
            pinned.copy_(buf, non_blocking=True)
        elif rank == 1:
            buf.copy_(pinned, non_blocking=True)
        torch.cuda.synchronize()

    res["d2h_seconds"] = timed(d2h)
    res["d2h_bps"] = nbytes / res["d2h_seconds"]
    res["h2d_seconds"] = timed(h2d)
    res["h2d_bps"] = nbytes / res["h2d_seconds"]
    if world >= 2:
        res["d2h_while_h2d_seconds"] = timed(d2h_while_h2d)
        res["d2h_while_h2d_bps"] = nbytes / res["d2h_while_h2d_seconds"]  # each direction's rate meanwhile
    dst = torch.empty_like(buf)
    res["copy_seconds"] = timed(lambda: dst.copy_(buf))
    res["copy_bps"] = nbytes / res["copy_seconds"]  # bytes copied per second (each read once, written once)
    if rank == 0:
        Path(out_file).write_text(json.dumps(res))
    dist.destroy_process_group()
