"""The naive baselines a GPU benchmark runs beside Awex in the same process group: gather to one rank and
broadcast, and the other published schemes, each timed on the same weights."""

from __future__ import annotations

import json
from pathlib import Path

from awex_integration.benchmarks.bench_common import (
    GIB,
    bits,
    mismatches,
)


def baselines(a, scenario, plan, layouts, shards, layout, trainer, device, barrier, timed, quant=None) -> dict:
    """The usual approaches on the same layouts; with FP8 they move the trainer's already quantised tiles (the
    quantisation itself is not timed here, unlike in Awex's syncs)."""
    import torch
    import torch.distributed as dist

    from awex.transport.ipc import IpcExecutor, IpcExport, export_shards, open_export
    from awex.transport.shards import torch_dtype

    out: dict = {}
    names = sorted({t.name for t in plan.tensors})
    specs = {t.name: t for t in plan.tensors}
    ranks = plan.ranks
    trainer_ranks = [r.rank for r in ranks if r.role.value == "trainer"]
    receiver_ranks = [r.rank for r in ranks if r.role.value == "inference"]
    if scenario.transport == "ipc":
        # per-update IPC: the trainer exports handles for every update, receivers open them and copy
        exports = Path(a.workdir) / f"ipc-base-{a.scenario}"
        exports.mkdir(exist_ok=True)

        def per_update(i: int) -> None:
            if trainer:
                (exports / f"{a.rank}-{i}.json").write_text(json.dumps(export_shards(shards).to_wire()))
            barrier()
            if not trainer:
                peers = sorted({s.peer for s in plan.schedule(a.rank)})
                opened = {
                    p: open_export(IpcExport.from_wire(json.loads((exports / f"{p}-{i}.json").read_text())))
                    for p in peers
                }
                IpcExecutor(plan, a.rank, shards, opened).run()

        out["ipc_handles_per_update"] = [timed(lambda i=i: per_update(i)) for i in range(a.baseline_iters)]
        trainer_gpus = {g for e in scenario.engines if e.kind == "megatron" for g in e.gpus}
        if any(g in trainer_gpus for e in scenario.engines if e.kind == "vllm" for g in e.gpus):
            return out  # colocated: the NCCL baselines below need GPUs of their own

    tgroup = dist.new_group(trainer_ranks, backend="nccl") if len(trainer_ranks) > 1 else None
    root = trainer_ranks[0]
    bgroup = dist.new_group([root] + receiver_ranks, backend="nccl")
    in_b = a.rank == root or a.rank in receiver_ranks

    def gather_full(name: str):
        """Trainer rank 0 assembles the canonical tensor from every trainer rank's boxes (P2P)."""
        spec = specs[name]
        full = torch.empty(spec.shape, dtype=torch_dtype(spec.dtype), device=device) if a.rank == root else None
        if a.rank == root:
            for box, view in shards.pairs(name):
                full[box.slices()].copy_(view)
        for src in trainer_ranks[1:]:
            lay = next(x for x in layouts if x.instance == ranks[src].instance)
            for box in lay.rank_boxes(ranks[src].local_rank).get(name, ()):
                if a.rank == src:
                    buf = torch.empty(box.sizes, dtype=torch_dtype(spec.dtype), device=device)
                    shards.copy_out(name, box.offsets, box.sizes, buf)
                    dist.send(bits(buf), root, group=tgroup)
                elif a.rank == root:
                    buf = torch.empty(box.sizes, dtype=torch_dtype(spec.dtype), device=device)
                    dist.recv(bits(buf), src, group=tgroup)
                    full[box.slices()].copy_(buf)
        return full

    def take(name: str, full):
        for box, view in shards.pairs(name):
            view.copy_(full[box.slices()])

    def per_tensor():
        for name in names:
            full = gather_full(name) if trainer else None
            if in_b:
                if full is None:
                    full = torch.empty(specs[name].shape, dtype=torch_dtype(specs[name].dtype), device=device)
                dist.broadcast(bits(full), root, group=bgroup)
                if not trainer:
                    take(name, full)

    def packed(bucket_bytes: int = GIB):
        batch: list[str] = []
        size = 0
        groups: list[list[str]] = []
        for name in names:
            n = specs[name].nbytes
            if batch and size + n > bucket_bytes:
                groups.append(batch)
                batch, size = [], 0
            batch.append(name)
            size += n
        if batch:
            groups.append(batch)
        for g in groups:
            total = sum(specs[n].nbytes for n in g)
            fulls = {n: gather_full(n) for n in g} if trainer else {}
            if not in_b:
                continue
            buf = torch.empty(total, dtype=torch.uint8, device=device)
            pos = 0
            views = {}
            for n in g:
                v = buf[pos : pos + specs[n].nbytes].view(torch_dtype(specs[n].dtype)).view(specs[n].shape)
                views[n] = v
                if a.rank == root:
                    v.copy_(fulls[n])
                pos += specs[n].nbytes
            dist.broadcast(buf, root, group=bgroup)
            if not trainer:
                for n in g:
                    take(n, views[n])

    for label, fn in (("gather_then_per_tensor_broadcast", per_tensor), ("gather_then_packed_1GiB_broadcast", packed)):
        out[label] = [timed(fn) for _ in range(a.baseline_iters)]
        if not trainer:
            out[label + "_bad"] = mismatches(shards, layout, 2, device, quant)[:5]
    return out
