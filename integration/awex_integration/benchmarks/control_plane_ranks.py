"""Ranks of the control-plane load test (``awex_integration.benchmarks.control_plane``): one process hosting a slice
of a large sync world as threads, each a real ``WeightsWriter`` or ``WeightsReader`` with its own ``MetaClient``,
through the real control path (registration, layouts, device exchange, agreement, manifest, version channel,
ready signals, outcomes), over :class:`NullTransport`: a pull transport that moves no byte (a sender says ready,
a receiver waits for its senders' ready signals), so only the control plane is timed.

What stands in for a cluster: each rank reports a host of its own node (8 ranks a node, trainer and engines on
nodes apart), so per-version signals go over the version channel as on a cluster, not over the host board of one
machine; the plan is computed once per process before the clock starts (planning is timed apart: every rank of a
real job plans at once, on its own CPU).

    python -m awex_integration.benchmarks.control_plane_ranks --address URL --ranks 256 --slice 0/8 --versions 6 \
        --out slice-0.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any

from awex.transport.base import TransferStats, Transport, timed

GPUS_PER_NODE = 8
_here = threading.local()


class NullTransport(Transport):
    """Moves nothing: every trainer rank says its bytes are ready (as the pull transports' do), receivers wait for
    every sender they read from."""

    name = "null"
    signals_ready = True

    def __init__(self):
        self._state: tuple[Any, int, list[int], bool] | None = None

    def prepare(self, plan, rank: int, setup, phases) -> None:
        steps = plan.schedule(rank)
        senders = sorted({s.bucket.src for s in steps if s.op == "recv"})
        self._state = (plan, rank, senders, plan.ranks[rank].role.value == "trainer")

    def run(self, shards, link, deadline: float, phases, refresh_by_wave=None) -> TransferStats:
        plan, rank, senders, trainer = self._prepared(self._state)
        with timed(phases, "signals"):
            if trainer:  # every trainer rank says ready
                link.ready(1)
            if senders:
                link.await_ready(senders, deadline)
                link.moving()
        return TransferStats()

    def let_go(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def close(self) -> None:
        self._state = None


def tiny_kimi_config() -> dict:
    """Kimi-K2's architecture (DeepSeek-V3 style: MLA, 1 dense layer then MoE) cut to 8 layers of 64 small experts:
    a plan of the same structure as the real model's, with views of a few MB per rank."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 8,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "n_shared_experts": 1,
        "n_routed_experts": 64,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 8,
        "vocab_size": 2048,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 0,
        "torch_dtype": "float32",
        "n_group": 1,
        "topk_group": 1,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000,
        "max_position_embeddings": 4096,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
    }


def specs(ranks: int) -> tuple[str, str]:
    """The trainer and engine specs of a world of ``ranks`` (half each): Megatron TP=8 PP=8 EP=8 with DP filling
    half the ranks; vLLM engines of 32 GPUs (TP=8 x DP=4, EP=32), as many as fill the other half."""
    if ranks % 128:
        raise ValueError(f"--ranks {ranks}: a multiple of 128 (64 trainer ranks per DP replica, 32 per engine)")
    half = ranks // 2
    return f"megatron:tp=8,pp=8,ep=8,dp={half // 64}", f"vllm:tp=8,dp=4,ep=32,instances={half // 32}"


def layouts(ranks: int):
    """``(trainer layout, engine layouts)`` of a world of ``ranks``."""
    from awex.meta.layouts import layouts_for, parse_engine_spec
    from awex.meta.layouts.vllm import vllm_tensors
    from awex.meta.models import canonical_tensors, model_dims

    config = tiny_kimi_config()
    dims = model_dims(config, "float32")
    trainer, engine = specs(ranks)
    (source,) = layouts_for(parse_engine_spec(trainer), canonical_tensors(dims), "trainer", prefix="trainer")
    spec = parse_engine_spec(engine)
    return source, layouts_for(spec, vllm_tensors(config, "float32"), "inference", prefix="vllm")


def node_of(rank: int, trainer_ranks: int) -> str:
    """The simulated host of sync rank ``rank`` (trainer ranks first; nodes of 8, engines on nodes of their own)."""
    if rank < trainer_ranks:
        return f"sim-node-t{rank // GPUS_PER_NODE}"
    return f"sim-node-i{(rank - trainer_ranks) // GPUS_PER_NODE}"


def simulate_hosts() -> None:
    """Every rank thread reports the host it was given (``_here.host``): the sync's modules ask ``host_identity``."""
    from awex.engines.sync import announcer, board, peer_link, places, session

    real = board.host_identity

    def host_identity() -> str:
        return getattr(_here, "host", None) or real()

    for module in (board, announcer, peer_link, places, session):
        module.host_identity = host_identity


_DELETES = [0]  # keys this process's writer dropped from the version channel (its background thread)
_DELETES_LOCK = threading.Lock()


def count_channel_ops() -> None:
    """Count each rank thread's version-channel operations (``_here.ops``: a put, a waited read or a look, each one;
    the store's own requests behind them are not counted) and the keys this process drops from it (``_DELETES``)."""
    from awex.engines.sync.channel import VersionChannel

    def counting(real):
        def op(self, *args, **kwargs):
            _here.ops = getattr(_here, "ops", 0) + 1
            return real(self, *args, **kwargs)

        return op

    for name in ("put", "wait", "get"):
        setattr(VersionChannel, name, counting(getattr(VersionChannel, name)))
    real_delete = VersionChannel.delete

    def delete(self, keys):
        with _DELETES_LOCK:
            _DELETES[0] += len(keys)
        return real_delete(self, keys)

    VersionChannel.delete = delete


def share_plans() -> dict:
    """Plans computed once per process (keyed by the instances and options; the null transport's plan depends on
    nothing else); returns the memo, filled ahead by :func:`warm`."""
    from awex.engines.sync import version_plan

    memo: dict = {}
    lock = threading.Lock()
    real = version_plan.plan_transfers

    def plan_transfers(sources, destinations, options=None, progress=None):
        key = (tuple(x.instance for x in sources), tuple(x.instance for x in destinations), options)
        with lock:
            if key not in memo:
                memo[key] = real(sources, destinations, options, progress)
            return memo[key]

    version_plan.plan_transfers = plan_transfers
    return memo


def warm(source, engines, wave_bytes: int) -> float:
    """Plan the null transport's plan once, as every rank will ask for it; the seconds it took."""
    from awex.engines.sync import version_plan
    from awex.meta import PlanOptions

    started = time.perf_counter()
    version_plan.plan_transfers([source], list(engines), PlanOptions(wave_bytes=wave_bytes, relay=False))
    return time.perf_counter() - started


def _views(layout, local_rank: int):
    import torch

    from awex.convert.live import fingerprinted

    held: dict = {}

    def view_of(name, box):
        key = (name, box.offsets)
        if key not in held:
            held[key] = torch.zeros(box.sizes)
        return held[key]

    return fingerprinted(view_of, held)  # as awex.convert's views: the writer re-derives views only when moved


def _rank(args, layout, local_rank: int, sync_rank: int, trainer_ranks: int, destinations, out: dict) -> None:
    from awex.engines import WeightsReader, WeightsWriter
    from awex.meta.client import MetaClient

    _here.host = node_of(sync_rank, trainer_ranks)
    client = MetaClient(args.address, job=args.job)
    rows: list[dict] = []
    out["ranks"][f"{layout.instance}:{local_rank}"] = {"sync_rank": sync_rank, "versions": rows}
    try:
        if layout.instance == "trainer":
            side = WeightsWriter(client, layout, local_rank, _views(layout, local_rank), transport="null",
                                 timeout=args.timeout)  # fmt: skip
            step = lambda v: side.write(v, destinations)  # noqa: E731
        else:
            side = WeightsReader(client, layout, local_rank, _views(layout, local_rank), timeout=args.timeout)
            step = side.receive
        out["built"].append(sync_rank)
        out["ready"].wait()  # every rank of every process is up: the clock starts with the first version
        name = f"{layout.instance}:{local_rank}"
        profile = _profiler() if name in args.profile.split(",") else None
        for k in range(args.versions):
            started, cpu, wall = time.perf_counter(), time.thread_time(), time.time()
            ops, deletes = getattr(_here, "ops", 0), _DELETES[0]
            if profile is not None and k > 0:  # the steady versions, this rank's own thread
                profile.runcall(step, f"v{k}")
            else:
                step(f"v{k}")
            rows.append(
                {
                    "seconds": time.perf_counter() - started,
                    "cpu_seconds": time.thread_time() - cpu,
                    "channel_ops": getattr(_here, "ops", 0) - ops,
                    "channel_deletes": _DELETES[0] - deletes,  # the process's writer, in the background
                    "began": wall,
                    "ended": time.time(),
                    "phases": {p: round(s, 6) for p, s in side.last_phases.items()},
                }
            )
        side.flush()
        if profile is not None:
            profile.dump_stats(f"{args.out}.{name.replace(':', '-')}.prof")
        out["media"][f"{layout.instance}:{local_rank}"] = getattr(side._session.signals, "medium", None)
        relay = side._session.relay  # what this rank heard from its host's relay instead of reading the channel
        heard = {"manifest": relay and relay.hears_manifests, "outcomes": relay and relay.hears_outcomes}
        heard["ready"] = relay and relay.listening and relay.roles.receivers_from is not None
        heard["outcome_to_lead"] = relay and relay.listening and relay.roles.outcome_from is not None  # told, not read
        out["heard"][f"{layout.instance}:{local_rank}"] = [k for k, on in heard.items() if on]
        out["finished"].wait()  # closing (its gc.collect holds this process's GIL) waits for every rank's last version
        side.close()
    except BaseException as e:  # noqa: BLE001 - reported in the results, the run fails
        out["errors"].append(f"{layout.instance}:{local_rank}: {type(e).__name__}: {e}")
    finally:
        client.close()


def _profiler():
    import cProfile

    # this thread's CPU, not its waits; Python 3.11: from 3.12 cProfile (on sys.monitoring) hooks every thread
    return cProfile.Profile(time.thread_time)


def _barrier(folder: str | None, name: str, count: int) -> None:
    """Wait until every worker process got as far (a file ``<stage>-<index>`` each in ``folder``)."""
    if not folder:
        return
    from pathlib import Path

    Path(folder, name).touch()
    stage = name.rsplit("-", 1)[0]
    while len(list(Path(folder).glob(f"{stage}-*"))) < count:
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--address", required=True, help="the MetaServer")
    ap.add_argument("--job", default="control-plane")
    ap.add_argument("--ranks", type=int, required=True, help="ranks of the whole sync world")
    ap.add_argument("--slice", required=True, help="I/P: this process runs every P-th rank from rank I")
    ap.add_argument("--versions", type=int, default=6)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--wave-mb", type=float, default=256.0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--barrier", default=None, help="a folder where the worker processes meet before closing")
    ap.add_argument(
        "--profile", default="", help="ranks (e.g. trainer:0) whose steady versions cProfile records: <out>.<rank>.prof"
    )
    args = ap.parse_args(argv)
    from awex.transport.registry import register

    register("null", f"{__name__}:NullTransport", replace=True)
    simulate_hosts()
    share_plans()
    count_channel_ops()
    index, _, count = args.slice.partition("/")
    index, count = int(index), int(count)
    source, engines = layouts(args.ranks)
    plan_seconds = warm(source, engines, int(args.wave_mb * (1 << 20)))
    world = [(source, r) for r in range(source.world_size)] + [(e, r) for e in engines for r in range(e.world_size)]
    mine = [(i, layout, r) for i, (layout, r) in enumerate(world) if i % count == index]
    out: dict = {"ranks": {}, "errors": [], "built": [], "media": {}, "heard": {}}
    out.update(ready=threading.Event(), finished=threading.Event())
    destinations = [e.instance for e in engines]
    threads = [
        threading.Thread(
            target=_rank,
            args=(args, layout, r, i, source.world_size, destinations, out),
            name=f"{layout.instance}-{r}",
            daemon=True,
        )
        for i, layout, r in mine
    ]
    for t in threads:
        t.start()
    while len(out["built"]) + len(out["errors"]) < len(threads):
        time.sleep(0.05)
    _barrier(args.barrier, f"built-{index}", count)
    out["ready"].set()
    while any(len(out["ranks"].get(f"{layout.instance}:{r}", {}).get("versions", ())) < args.versions
              and t.is_alive() for t, (_, layout, r) in zip(threads, mine)):  # fmt: skip
        time.sleep(0.05)
    _barrier(args.barrier, f"done-{index}", count)
    out["finished"].set()
    for t in threads:
        t.join()
    doc = {k: out[k] for k in ("ranks", "errors", "media", "heard")}
    doc["plan_seconds"] = plan_seconds
    with open(args.out, "w") as f:
        json.dump(doc, f)
    return 1 if out["errors"] else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # not through interpreter teardown: with hundreds of rank threads' TCPStore clients and the channel's server
    # alive in one process, torch's teardown aborts now and then ("terminate called without an active exception")
    # after the results were written; a real rank is one process and closes its writer or reader first
    os._exit(code)
