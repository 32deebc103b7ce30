"""Awex in verl's checkpoint-engine slot (``awex.engines.verl_engine``), driven as verl's ``CheckpointEngineManager``
drives a backend: the module imported by name as verl's ``custom_backend_module`` does, the engine made by verl's
registry from the configuration's ``engine_kwargs``, then per step ``prepare`` on every worker, ``build_topology``,
``init_process_group`` with each worker's share, every actor rank's ``send_weights`` (the full tensors verl's actor
yields, the same on every rank) beside every rollout worker's ``receive_weights``, and ``finalize``. Two actor ranks,
two rollout workers, a tiny Qwen2 trained between steps: each rollout worker yields exactly the trainer's tensors,
and an HF model loaded from them generates the trainer's greedy output. Needs verl (the ``verl`` nox session
installs it beside its transformers)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("verl.checkpoint_engine.base", reason="verl is not installed in this environment (nox -s verl)")

import torch  # noqa: E402
from conftest import MODELS  # noqa: E402

from awex.meta.errors import AwexValueError  # noqa: E402
from awex.meta.server import start_embedded  # noqa: E402
from awex_integration.engines.tiny_model import load_json  # noqa: E402


def _model():
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(load_json(MODELS / "qwen2-tiny.json"))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(spec.pop("model_type"), **spec)).float().eval()


async def _step(actors, rollouts, state, step):
    async def take(engine):
        return {name: t.clone() async for name, t in engine.receive_weights(global_steps=step)}

    async def streamed():  # verl's actors may yield asynchronously too
        for pair in state.items():
            yield pair

    sends = [
        a.send_weights(iter(list(state.items())) if i else streamed(), global_steps=step) for i, a in enumerate(actors)
    ]
    results = await asyncio.gather(*sends, *[take(r) for r in rollouts])
    return results[: len(actors)], results[len(actors) :]


def test_awex_is_a_verl_checkpoint_engine_chosen_by_configuration():
    from verl.checkpoint_engine.base import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    import_external_libs("awex.engines.verl_engine")  # checkpoint_engine.custom_backend_module
    backend = CheckpointEngineRegistry.get("awex")
    with pytest.raises(AwexValueError, match="give the MetaServer's address"):
        CheckpointEngineRegistry.new("awex", bucket_size=1 << 20)
    meta = start_embedded()
    kwargs = {"meta_address": meta.address, "job": "verl-step", "timeout": 60.0}  # engine_kwargs.awex
    actors = [CheckpointEngineRegistry.new("awex", bucket_size=1 << 20, **kwargs) for _ in range(2)]
    rollouts = [CheckpointEngineRegistry.new("awex", bucket_size=1 << 20, **kwargs) for _ in range(2)]
    trainer, reference = _model(), _model()
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    try:
        for step in (1, 2):
            metadata = [e.prepare() for e in actors + rollouts]
            a_kwargs, r_kwargs = backend.build_topology(len(actors), len(rollouts), metadata)
            for side, engines in ((a_kwargs, actors), (r_kwargs, rollouts)):
                for i, engine in enumerate(engines):
                    engine.init_process_group(**{k: v[i] for k, v in side.items()})
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
            state = {n: t.detach() for n, t in trainer.state_dict().items()}
            sent, received = asyncio.run(_step(actors, rollouts, state, step))
            for engine in actors + rollouts:
                engine.finalize()
            assert sent[0]["awex/bytes_sent"] > 0 and sent[1] == {}  # the first actor rank sends, the other drains
            for got in received:
                assert set(got) == set(state) and all(torch.equal(got[n], state[n]) for n in state), step
            reference.load_state_dict(received[1])
            want = trainer.generate(ids, max_new_tokens=8, do_sample=False)
            assert torch.equal(reference.generate(ids, max_new_tokens=8, do_sample=False), want), step
        bad = dict(state)
        bad["lm_head.weight"] = bad["lm_head.weight"][:-1]
        with pytest.raises(AwexValueError, match="lm_head.weight is"):
            asyncio.run(actors[0].send_weights(iter(bad.items()), global_steps=3))
    finally:
        for engine in actors + rollouts:
            engine.close()
        meta.stop()
