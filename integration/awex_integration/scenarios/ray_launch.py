"""Scenario ranks as Ray tasks and actors, placed by placement groups (``scenario --launcher ray``), as Ray-based
RL stacks (verl, OpenRLHF, NeMo-RL) place theirs: trainer ranks in one group of bundles, each inference engine in
a bundle of its own.

One node: the driver starts a local Ray cluster. Two nodes (``--hosts 2``): a Ray head in the trainers' network
namespace and a Ray worker node in the engines' (``awex_integration.scenarios.netns``), each with a resource naming its
side, so the placement groups put trainer ranks on the first node and engines on the second; the driver joins
from the first namespace. Ray's own logs stay in its session folder; what the ranks return comes back through Ray.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

TRAINER_SIDE = "awex_trainer_side"  # custom resources: which node takes trainers and which engines (two nodes)
ENGINE_SIDE = "awex_engine_side"
RAY_PORT = 6379


def where() -> dict[str, str]:
    """The Ray node and network namespace this task or actor runs in."""
    import ray

    try:
        netns = os.readlink("/proc/thread-self/ns/net")
    except OSError:
        netns = "?"
    return {"node": ray.get_runtime_context().get_node_id(), "netns": netns, "pid": str(os.getpid())}


class RayCluster:
    """A Ray cluster for one scenario: :meth:`local` or :meth:`two_nodes`; :meth:`close` stops it."""

    def __init__(self, two_nodes: bool, stop: Sequence[Sequence[str]] = (), temp: str | None = None):
        self.two_nodes = two_nodes
        self._stop = list(stop)
        self._temp = temp

    @classmethod
    def local(cls, num_cpus: int = 8) -> RayCluster:
        import ray

        # Logical CPUs, not cores: placement needs a bundle per rank; the ranks share this machine's cores.
        ray.init(
            num_cpus=num_cpus,
            object_store_memory=256 << 20,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
        return cls(two_nodes=False)

    @classmethod
    def two_nodes(cls, hosts, num_cpus: int = 8) -> RayCluster:
        """A head node in ``hosts.a`` and a worker node in ``hosts.b``; the calling thread must be in ``hosts.a``
        (the driver joins from there)."""
        ray_bin = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))
        temp = tempfile.mkdtemp(prefix="awex-ray-")
        common = ["--num-cpus", str(num_cpus), "--object-store-memory", str(256 << 20), "--disable-usage-stats"]
        head = [ray_bin, "start", "--head", "--node-ip-address", hosts.address_a, "--port", str(RAY_PORT)]
        head += [*common, "--include-dashboard=false", f'--resources={{"{TRAINER_SIDE}": 100}}', "--temp-dir", temp]
        worker = [ray_bin, "start", "--address", f"{hosts.address_a}:{RAY_PORT}", "--node-ip-address"]
        worker += [hosts.address_b, *common, f'--resources={{"{ENGINE_SIDE}": 100}}']
        stop = [["ip", "netns", "exec", ns, ray_bin, "stop", "--force"] for ns in (hosts.b, hosts.a)]
        cluster = cls(two_nodes=True, stop=stop, temp=temp)
        # Token authentication between the nodes and the driver (Ray's default for clusters since 2.5x): one token
        # for this cluster, given to the head, the worker node and the driver through the environment.
        os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16))
        import ray  # after the token is in the environment: Ray reads its auth mode when first imported

        try:
            for ns, cmd in ((hosts.a, head), (hosts.b, worker)):
                out = subprocess.run(["ip", "netns", "exec", ns, *cmd], capture_output=True, text=True, timeout=180)
                if out.returncode != 0:
                    raise RuntimeError(f"ray start in {ns} failed: {out.stderr[-2000:]}")
            address = f"{hosts.address_a}:{RAY_PORT}"  # the driver is on the head node: its address, not a route out
            ray.init(
                address=address,
                _node_ip_address=hosts.address_a,
                _temp_dir=temp,
                log_to_driver=False,
                configure_logging=False,
            )
            deadline = time.monotonic() + 60
            while len([n for n in ray.nodes() if n["Alive"]]) < 2:
                if time.monotonic() > deadline:
                    raise RuntimeError("the Ray worker node in the engines' namespace did not join within 60 s")
                time.sleep(0.5)
        except BaseException:
            cluster.close()
            raise
        return cluster

    def bundle(self, side: str) -> dict[str, float]:
        """One rank's bundle: a logical CPU, on its side's node when there are two."""
        return {"CPU": 1, side: 1} if self.two_nodes else {"CPU": 1}

    def group(self, bundles: list[dict[str, float]], timeout: float = 120.0):
        """A placement group of ``bundles``, ready (PACK: on one node where they fit)."""
        import ray
        from ray.util.placement_group import placement_group

        pg = placement_group(bundles, strategy="PACK")
        ray.get(pg.ready(), timeout=timeout)
        return pg

    def close(self) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        for cmd in self._stop:
            subprocess.run(cmd, capture_output=True, timeout=120)
        if self._temp:
            shutil.rmtree(self._temp, ignore_errors=True)


def _placed(pg, index: int) -> dict[str, Any]:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {
        "num_cpus": 0,  # the bundle holds the placement; the ranks share the machine's cores
        "scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index),
    }


def _task(fn: Callable, args: tuple) -> Any:
    result = fn(*args)
    return {**result, "ray": where()} if isinstance(result, dict) else result


def run_tasks(
    cluster: RayCluster, jobs: Sequence[tuple[Any, Callable, tuple]], timeout: float
) -> dict[Any, tuple[str, Any]]:
    """``fn(*args)`` for each ``(key, fn, args)`` as a Ray task, one bundle each of one placement group on the
    trainers' side. Returns key -> ``("ok", value)`` (a dict value gains ``ray``: :func:`where` it ran),
    ``("error", text)`` or ``("timeout", None)``, as :func:`awex_integration.scenarios.spawn.run_processes` does."""
    import ray

    pg = cluster.group([cluster.bundle(TRAINER_SIDE) for _ in jobs])
    remote = ray.remote(max_calls=1, max_retries=0)(_task)  # a fresh worker process per rank (own torch.distributed)
    refs = {key: remote.options(**_placed(pg, i)).remote(fn, args) for i, (key, fn, args) in enumerate(jobs)}
    out: dict[Any, tuple[str, Any]] = {}
    pending = dict(refs)
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        done, _ = ray.wait(list(pending.values()), num_returns=1, timeout=max(0.1, deadline - time.monotonic()))
        for ref in done:
            key = next(k for k, r in pending.items() if r == ref)
            del pending[key]
            try:
                out[key] = ("ok", ray.get(ref))
            except Exception as e:  # the rank's exception, with its traceback, as Ray reports it
                out[key] = ("error", f"{type(e).__name__}: {e}")
    for key, ref in pending.items():
        ray.cancel(ref, force=True)
        out[key] = ("timeout", None)
    ray.util.remove_placement_group(pg)
    return out


class RemoteInstance:
    """An inference instance living in a Ray actor (one bundle on the engines' side): the scenario calls it as it
    calls a local one (``sync``, ``greedy``, ``close``); ``where`` says on which node it runs."""

    def __init__(self, cluster: RayCluster, cls: type, name: str, *args: Any, **kwargs: Any):
        import ray

        self.name = name
        self._pg = cluster.group([cluster.bundle(ENGINE_SIDE)])
        actor_class = ray.remote(max_restarts=0)(cls)
        self._actor = actor_class.options(**_placed(self._pg, 0)).remote(name, *args, **kwargs)
        self.where = ray.get(self._actor.__ray_call__.remote(lambda _self: where()), timeout=600)

    def _call(self, method: str, *args: Any) -> Any:
        import ray

        return ray.get(getattr(self._actor, method).remote(*args))

    def sync(self, version: str, reference) -> None:
        self._call("sync", version, reference)

    def greedy(self) -> list[list[int]]:
        return self._call("greedy")

    def close(self) -> None:
        import ray

        try:
            if hasattr(self._actor, "close"):
                self._call("close")
        finally:
            ray.kill(self._actor)
            ray.util.remove_placement_group(self._pg)


class RayLlmInstance:
    """vLLM's own ``LLM`` as a Ray actor with the ``awex`` weight-transfer backend (one bundle on the engines'
    side), as Ray RL stacks hold their rollout engines: the trainer ranks drive its weight updates themselves
    through vLLM's ``RayVLLMWeightSyncClient`` over :attr:`handle` (scenario ``--control vllm-ray``)."""

    def __init__(self, cluster: RayCluster, name: str, model_dir, tp: int, dtype: str, cpu: str, plain_weights=True):
        import ray
        from vllm import LLM

        from awex_integration.engines import vllm_cpu_plain_weights
        from awex_integration.scenarios.instances import llm_options

        self.name = name
        self._pg = cluster.group([cluster.bundle(ENGINE_SIDE)])
        env = {"VLLM_CPU_OMP_THREADS_BIND": cpu, vllm_cpu_plain_weights.ENV: "1" if plain_weights else "0"}
        integration = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [integration, os.environ.get("PYTHONPATH")]))
        options = {**_placed(self._pg, 0), "runtime_env": {"env_vars": env}}
        # vLLM's TP workers by multiprocessing inside the actor, not Ray actors of their own
        engine = llm_options(model_dir, tp, dtype, executor="mp")
        self.handle = ray.remote(max_restarts=0)(LLM).options(**options).remote(**engine)
        self.where = ray.get(self.handle.__ray_call__.remote(lambda _self: where()), timeout=600)

    def greedy(self) -> list[list[int]]:
        import ray
        from vllm import SamplingParams

        from awex_integration.engines.tiny_model import PROMPTS

        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        outputs = ray.get(self.handle.generate.remote(PROMPTS, params, use_tqdm=False))
        return [list(o.outputs[0].token_ids) for o in outputs]

    def weight_version(self) -> str | None:
        """The version vLLM itself says it serves (set by the trainers' ``finish_weight_update``)."""
        import ray

        return ray.get(self.handle.get_weight_version.remote())

    def close(self) -> None:
        import ray

        try:
            ray.get(self.handle.__ray_call__.remote(lambda llm: llm.llm_engine.engine_core.shutdown()), timeout=60)
        finally:
            ray.kill(self.handle)
            ray.util.remove_placement_group(self._pg)
