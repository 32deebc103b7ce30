"""Baseline: upstream awex 0.9.0's transfer core on the benchmark's layouts.

Upstream's NCCL writer and reader (separated mode) plan with ``TransferPlanBuilder`` (each inference replica
of a parameter paired round robin with one training replica, one operation per overlapping region), then on
every update build one ``P2POp`` per operation (``nccl_build_send_ops`` / ``nccl_build_recv_ops``: the sender
makes non-contiguous slices contiguous, the receiver stages non-contiguous views), run them all as one
``batch_isend_irecv`` interleaved by peer (``batch_send_recv``), synchronise and meet at a barrier. This module
runs exactly those functions of the 0.9.0 wheel, with the ranks, boxes and dtypes of a benchmark scenario.

What it leaves out, in upstream's favour: its writer and reader live inside Megatron and vLLM / SGLang worker
classes that cannot run on these machines, so the tensors here are already in canonical form (upstream
converts the trainer's parameters on every update, and the receiver's converted views are copied back into
the engine); the time measured is a lower bound of an upstream update.

Upstream's top-level package is also called ``awex`` and its ``__init__`` imports its Megatron writer, so the
workers run in processes of their own, without this repository's packages, and register a bare ``awex``
package over the wheel's directory to import only ``awex.transfer`` and what it needs (benchmark only).
Workers read their spec from a JSON file and write results to JSON files; nothing is pickled between
processes.

    python -m awex_integration.benchmarks.bench_upstream_awex --spec spec.json   (launched by bench_gpu --upstream)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types
from pathlib import Path

VERSION = "awex 0.9.0"


# ----------------------------------------------------------------------------------------------- driver side


def scenario_spec(scenario, tensors, layouts, iters: int, workdir: str, port: int) -> dict:
    """Everything a worker needs, as JSON: the canonical tensors, every rank's boxes, its GPU and upstream rank.

    Upstream numbers inference ranks first (engine after engine), then training ranks."""
    engines = [e for e in scenario.engines if e.kind == "vllm"]
    trainer = next(e for e in scenario.engines if e.kind == "megatron")
    if len({e.tp for e in engines}) != 1:
        raise ValueError("upstream awex plans for inference engines of one size only")
    by_instance = {lay.instance: lay for lay in layouts}

    def boxes(instance: str, local_rank: int) -> dict:
        out = {}
        for name, bs in by_instance[instance].rank_boxes(local_rank).items():
            if len(bs) != 1:
                raise ValueError(f"{instance}:{local_rank} holds {len(bs)} boxes of {name}; upstream takes one")
            out[name] = [list(bs[0].offsets), list(bs[0].sizes)]
        return out

    ranks = []
    for e_idx, e in enumerate(engines):
        for r, gpu in enumerate(e.gpus):
            ranks.append(
                {"role": "inference", "engine": e_idx, "local_rank": r, "gpu": gpu, "boxes": boxes(e.instance, r)}
            )
    for r, gpu in enumerate(trainer.gpus):
        ranks.append({"role": "trainer", "engine": 0, "local_rank": r, "gpu": gpu, "boxes": boxes(trainer.instance, r)})
    return {
        "tensors": [{"name": t.spec.name, "shape": list(t.spec.shape), "dtype": t.spec.dtype} for t in tensors],
        "engines": len(engines),
        "engine_ranks": engines[0].tp,
        "trainer_ranks": trainer.tp,
        "ranks": ranks,
        "iters": iters,
        "workdir": workdir,
        "port": port,
    }


def run(upstream_dir: str, spec: dict, timeout: float = 300.0) -> dict:
    """Run one scenario's upstream baseline in fresh processes; returns its results (or ``error``)."""
    from awex_integration.benchmarks.bench_common import launch_workers

    work = Path(spec["workdir"])
    spec_file = work / "upstream-awex-spec.json"
    spec_file.write_text(json.dumps(spec))
    integration = str(Path(__file__).resolve().parents[2])
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([integration]), AWEX_UPSTREAM_DIR=upstream_dir, PYTHONUNBUFFERED="1"
    )
    outs = launch_workers(
        [["--spec", str(spec_file), "--rank", str(r)] for r in range(len(spec["ranks"]))],
        timeout,
        env,
        module="awex_integration.benchmarks.bench_upstream_awex",
    )
    if any(rc != 0 for rc, _ in outs):
        return {"version": VERSION, "error": "\n".join(o[-1500:] for rc, o in outs if rc != 0)[-3000:]}
    return json.loads((work / "upstream-awex-result.json").read_text())


# ----------------------------------------------------------------------------------------------- worker side


def _import_upstream(upstream_dir: str):
    """Upstream's transfer modules, without running its package ``__init__`` (which imports Megatron)."""
    pkg = types.ModuleType("awex")
    pkg.__path__ = [str(Path(upstream_dir) / "awex")]
    sys.modules["awex"] = pkg
    from awex.meta.weight_meta import ParameterMeta, ParameterReplicaMeta, ParameterShardMeta
    from awex.transfer.nccl_comm import batch_send_recv, nccl_build_recv_ops, nccl_build_send_ops
    from awex.transfer.transfer_plan import TransferPlanBuilder

    return types.SimpleNamespace(
        ParameterMeta=ParameterMeta,
        ParameterReplicaMeta=ParameterReplicaMeta,
        ParameterShardMeta=ParameterShardMeta,
        TransferPlanBuilder=TransferPlanBuilder,
        build_send=nccl_build_send_ops,
        build_recv=nccl_build_recv_ops,
        batch_send_recv=batch_send_recv,
    )


def _overlaps(a, b) -> bool:
    return all(oa < ob + sb and ob < oa + sa for oa, sa, ob, sb in zip(a[0], a[1], b[0], b[1]))


def parameter_metas(up, spec: dict, role: str, torch) -> list:
    """Upstream's ``ParameterMeta`` per tensor for one side: a shard per rank box, grouped into replicas
    (sets of non-overlapping boxes, first fit in rank order: TP shards form one replica, a tensor every
    rank holds whole gives one replica per rank)."""
    ranks = [r for r in spec["ranks"] if r["role"] == role and r["engine"] == 0]
    world = len(ranks)
    metas = []
    for t in spec["tensors"]:
        name, shape = t["name"], tuple(t["shape"])
        dtype = getattr(torch, t["dtype"])
        shards, replicas = [], []
        for r in ranks:
            box = r["boxes"].get(name)
            if box is None:
                continue
            offsets, sizes = tuple(box[0]), tuple(box[1])
            numel = 1
            for n in sizes:
                numel *= n
            shard = up.ParameterShardMeta(
                tp_rank=r["local_rank"],
                attn_tp_rank=r["local_rank"],
                pp_rank=0,
                ep_rank=0,
                ep_tp_rank=0,
                global_rank=r["local_rank"],
                world_size=world,
                engine_rank=0,
                name=name,
                shape=sizes,
                numel=numel,
                dtype=dtype,
                global_offset=offsets if offsets else (0,),
            )
            shards.append(shard)
            for rep in replicas:
                if not any(_overlaps((offsets, sizes), (tuple(s.global_offset), s.shape)) for s in rep):
                    rep.append(shard)
                    break
            else:
                replicas.append([shard])
        if not shards:
            continue
        total = 1
        for n in shape:
            total *= n
        complete = [rep for rep in replicas if sum(s.numel for s in rep) == total]
        metas.append(
            up.ParameterMeta(
                name=name,
                global_numel=total,
                global_shape=shape,
                dtype=dtype,
                shards=shards,
                replicas=[up.ParameterReplicaMeta(shards=rep) for rep in complete],
            )
        )
    return metas


def worker(spec_file: str, rank: int) -> None:
    import torch
    import torch.distributed as dist

    from awex_integration.benchmarks.bench_common import canonical_value

    spec = json.loads(Path(spec_file).read_text())
    up = _import_upstream(os.environ["AWEX_UPSTREAM_DIR"])
    me = spec["ranks"][rank]
    world = len(spec["ranks"])
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", me["gpu"]) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{spec['port']}",
        rank=rank,
        world_size=world,
        **({"device_id": device} if cuda else {}),
    )
    infer_world = spec["engines"] * spec["engine_ranks"]
    builder = up.TransferPlanBuilder(infer_world, spec["trainer_ranks"], spec["engines"])
    started = time.perf_counter()
    plan = builder.build_local_transfer_plan(
        parameter_metas(up, spec, "inference", torch), parameter_metas(up, spec, "trainer", torch), rank
    )
    plan_seconds = time.perf_counter() - started
    trainer = me["role"] == "trainer"
    shapes = {t["name"]: (tuple(t["shape"]), getattr(torch, t["dtype"])) for t in spec["tensors"]}

    def values(step: int) -> dict:
        out = {}
        for name, (offsets, sizes) in me["boxes"].items():
            shape, dtype = shapes[name]
            full = canonical_value(name, shape, step, device).to(dtype)
            out[name] = full[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))].contiguous()
        return out

    params = (
        values(1)
        if trainer
        else {n: torch.zeros(tuple(s), dtype=shapes[n][1], device=device) for n, (_, s) in me["boxes"].items()}
    )

    def update() -> None:  # what upstream's writer / reader do on every update (separated mode)
        if trainer:
            ops, _, _ = up.build_send(params, plan, None, -1, True)
            up.batch_send_recv(send_ops=ops, recv_ops=[], blocking=True, use_group=True)
        else:
            ops, pairs, _ = up.build_recv(params, plan, None, True)
            up.batch_send_recv(send_ops=[], recv_ops=ops, blocking=True, use_group=True)
            for original, staged in pairs:
                original.copy_(staged)
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()

    def timed() -> float:
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        update()
        x = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        x = x.to(device) if cuda else x
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        return float(x.item())

    first = timed()
    steady = [timed() for _ in range(spec["iters"])]
    bad = []
    if not trainer:
        expected = values(1)
        bad = [n for n in sorted(params) if not torch.equal(params[n], expected[n])]
    count = torch.tensor([len(bad)], dtype=torch.int64)
    count = count.to(device) if cuda else count
    dist.all_reduce(count)
    if rank == 0:
        Path(spec["workdir"], "upstream-awex-result.json").write_text(
            json.dumps(
                {
                    "version": VERSION,
                    "first_update_seconds": round(first, 6),
                    "update_seconds": round(statistics.median(steady), 6),
                    "update_seconds_all": [round(x, 6) for x in steady],
                    "plan_seconds": round(plan_seconds, 3),
                    "correct": int(count.item()) == 0,
                    "mismatches": bad[:5],
                    "note": "transfer core only, tensors already canonical (a lower bound of an upstream update)",
                }
            )
        )
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", required=True)
    ap.add_argument("--rank", type=int, required=True)
    args = ap.parse_args(argv)
    worker(args.spec, args.rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
