"""A live SGLang engine receiving from an HF trainer through Awex, on a CUDA machine with SGLang installed.

An in-process ``sglang.Engine`` (TP=1, its scheduler in its own process) is started with
``custom_weight_loader=[awex.engines.sglang.LOADER]`` on a tiny Qwen3 model written locally; an HF trainer on the
same GPU changes every weight each step and writes the version (``transport="auto"``: CUDA IPC on one GPU) while
:class:`~awex.engines.sglang.SglangEngineUpdater` drives SGLang's update. After each step SGLang's own
``get_weights_by_name`` must return the trainer's values and its greedy output must equal the trainer's.

Never run so far: SGLang's model code needs its CUDA kernels (``sgl_kernel``) or, on CPU, AMX, which our CPU
machines lack, and our GPU machines reach no package registry to install SGLang. The CPU check of the same binding
against SGLang's own model classes runs in CI (``nox -s sglang_layout``).
"""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (SGLang's model code runs its CUDA kernels)", allow_module_level=True)
sglang = pytest.importorskip(
    "sglang", reason="needs SGLang installed (pip install awex-engines[sglang]); not installable on our GPU machines"
)

from conftest import MODELS  # noqa: E402

from awex.engines.sglang import LOADER, AwexSglangInfo, SglangEngineUpdater  # noqa: E402
from awex.engines.source import TrainerSource  # noqa: E402
from awex.engines.writer import WeightsWriter  # noqa: E402
from awex.meta.client import MetaClient  # noqa: E402
from awex.meta.server.embedded import start_embedded  # noqa: E402
from awex_integration.engines.tiny_model import load_json, make_tiny_model, perturb_  # noqa: E402

PROMPT_IDS = [[1, 5, 9, 13, 17], [2, 4, 6, 8]]


def _greedy_hf(model, prompts, tokens=8):
    out = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids], device=model.device)
            gen = model.generate(x, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
            out.append(gen[0, len(ids) :].tolist())
    return out


def test_engine_receives_each_version_in_place(tmp_path):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path / "model", load_json(MODELS / "qwen2-tiny.json"), dtype="bfloat16")
    trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
    server = start_embedded()
    engine = sglang.Engine(
        model_path=str(path),
        tp_size=1,
        mem_fraction_static=0.3,
        custom_weight_loader=[LOADER],
        disable_cuda_graph=True,
    )
    try:
        info = AwexSglangInfo(server.address, instance="sglang", timeout=120.0)
        writer = WeightsWriter.from_source(MetaClient(server.address), TrainerSource.hf(trainer), timeout=120.0)
        updater = SglangEngineUpdater(engine, info)
        for step in range(2):
            perturb_(trainer, step)
            version = f"step-{step}"
            thread = threading.Thread(target=writer.write, args=(version, ["sglang"]))
            thread.start()
            updater.update(version)
            thread.join(120)
            want = trainer.get_parameter("model.layers.0.mlp.down_proj.weight")
            got = engine.get_weights_by_name("model.layers.0.mlp.down_proj.weight", truncate_size=10**9)
            assert torch.equal(torch.tensor(got, dtype=torch.float32).flatten(), want.float().flatten().cpu())
            outs = engine.generate(
                input_ids=PROMPT_IDS, sampling_params={"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
            )
            assert [o["output_ids"] for o in outs] == _greedy_hf(trainer, PROMPT_IDS)
        writer.close()
    finally:
        engine.shutdown()
        server.stop()
