"""The inference instances a scenario syncs into: offline vLLM ``LLM`` engines (:class:`VllmInstance`), ``vllm serve``
processes driven over HTTP (:class:`VllmServeInstance`), HF models (:class:`HfInstance`) and layout-only receivers
(:class:`LayoutInstance`), and the engine options they start with (:func:`llm_options`)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

from awex.meta.client import MetaClient
from awex.transport.shards import torch_dtype
from awex_integration.engines.tiny_model import (
    PROMPTS,
    dtype_kwarg,
    hf_greedy,
    vllm_greedy,
)
from awex_integration.scenarios.scenario_results import catching
from awex_integration.scenarios.spawn import free_port

ENGINE_STOP_SECONDS = 0.5  # how long a stopped vLLM engine may take to exit before it is killed


def llm_options(
    model_dir: Path, tp: int, dtype: str, ep: bool = False, executor: str | None = None, awex: bool = True
) -> dict:
    """vLLM ``LLM`` arguments of the scenario's engines (CPU build, small KV cache, the ``awex`` backend and the
    in-place probe), alike wherever the engine runs (this process or a Ray actor). ``awex=False``: a reference engine
    with the same settings and no weight-transfer backend (it loads its weights from ``model_dir``)."""
    from vllm.config import WeightTransferConfig

    from awex_integration.engines.vllm_worker_probe import WORKER_EXTENSION

    options = dict(
        model=str(model_dir),
        tensor_parallel_size=tp,
        dtype=dtype,
        enforce_eager=True,
        enable_expert_parallel=ep,
        max_model_len=256,
        seed=0,
        kv_cache_memory_bytes=128 << 20,
        worker_extension_cls=WORKER_EXTENSION,
        distributed_executor_backend=executor,
        **engine_attention(model_dir),
    )
    if awex:
        options["weight_transfer_config"] = WeightTransferConfig(backend="awex")
    return options


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


def stop_engine(llm) -> None:
    """Stop an ``LLM``'s engine within :data:`ENGINE_STOP_SECONDS`, then its processes are killed: vLLM's own grace
    is 5 s and its CPU engine core outlives it at every stop (the workers exit after about 3 s, the engine core
    never within it), and the harness has read all it needs by then."""
    llm.llm_engine.engine_core.shutdown(timeout=ENGINE_STOP_SECONDS)


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

        from awex_integration.engines import vllm_cpu_plain_weights

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
        stop_engine(self.llm)

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

        from awex_integration.engines import vllm_cpu_plain_weights
        from awex_integration.engines.vllm_worker_probe import WORKER_EXTENSION

        self.name, self.model_dir = name, model_dir
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        env = {
            **os.environ,
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": cpu,
            vllm_cpu_plain_weights.ENV: "1" if plain_weights else "0",
            "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]),
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
            threading.Thread(target=catching(errors, r.receive, version, None, str(reference) if reference else None))
            for r in self.readers
        ]
        [t.start() for t in threads]
        [t.join() for t in threads]
        if errors:
            raise RuntimeError(errors[0])

    def greedy(self) -> None:
        return None
