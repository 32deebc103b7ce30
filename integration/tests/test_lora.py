"""LoRA adapters synced in place into vLLM's CPU build through its RL API (``awex.engines.lora``,
``awex.engines.vllm_lora``): a PEFT trainer with two adapters (one rsLoRA, on fewer modules) and one TP=2 engine
serving both. Each version: every rank's adapter tensors equal what the trainer sent (A, and B times its scale),
tensor by tensor; the engine's greedy output with each adapter equals the trainer's model with that adapter merged
(float32: no near-ties); only the adapters' bytes moved. Also: staged receive with verify, bad input refused before
any byte moves with the next version applied, two FSDP2 ranks sending their own shards into the same engine, and
the refusals of the trainer's source."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch

from awex.meta.errors import AwexValueError

pytest.importorskip("vllm", reason="vLLM is not installed in this environment")
peft = pytest.importorskip("peft", reason="PEFT is not installed in this environment")

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
IDS = {"math": 1, "code": 2}
PROMPTS = ["hello world", "the capital of", "one two three four"]
TOKENS = 12
MODELS = Path(__file__).parents[1] / "models"


def _peft(
    model_dir, seed: int = 0, code_rank: int = 8, code_modules: tuple[str, ...] = ("q_proj", "v_proj", "down_proj")
):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, target_modules=MODULES, init_lora_weights=False), adapter_name="math"
    )
    code = LoraConfig(r=code_rank, lora_alpha=8, use_rslora=True, target_modules=list(code_modules))
    model.add_adapter("code", code)
    return model


def _perturb(model, scale: float = 0.3) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn_like(p) * scale)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from awex_integration.engines.tiny_model import load_json, make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("lora") / "qwen2", load_json(MODELS / "qwen2-tiny.json"))


@pytest.fixture(scope="module")
def lora_engine(model_dir, tmp_path_factory):
    """One TP=2 engine serving both adapters, first from PEFT's save of the trainer's initial adapters."""
    from vllm import LLM
    from vllm.lora.request import LoRARequest

    from awex.meta.server import start_embedded
    from awex_integration.scenarios.instances import llm_options

    saved = tmp_path_factory.mktemp("adapters")
    _peft(model_dir).save_pretrained(str(saved), selected_adapters=list(IDS))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    options = llm_options(model_dir, 2, "float32")
    llm = LLM(**options, enable_lora=True, max_lora_rank=8, max_loras=2)
    requests = {name: LoRARequest(name, i, str(saved / name)) for name, i in IDS.items()}
    for request in requests.values():
        llm.llm_engine.add_lora(request)
    meta = start_embedded()
    yield llm, requests, model_dir, meta
    meta.stop()
    llm.llm_engine.engine_core.shutdown()


def _trainer(lora_engine, model, **options):
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from awex.engines.vllm_offline import LLMClient
    from awex.engines.vllm_trainer import AwexSource, AwexTrainerInitInfo

    llm, _, _, meta = lora_engine
    info = AwexTrainerInitInfo(
        rank=0, meta_address=meta.address, instances=("vllm-0",), lora=options.pop("lora", IDS), **options
    )
    return WeightTransferTrainerFactory.trainer_init(
        info, client=LLMClient(llm), source=AwexSource.lora(model, list(IDS))
    )


def _check_version(lora_engine, model, engine, version: str) -> None:
    """Every rank holds what the trainer sent; the engine's greedy output with each adapter is the merged model's."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from awex_integration.engines.tiny_model import hf_greedy
    from awex_integration.engines.vllm_worker_probe import tensor_digest

    llm, requests, model_dir, _ = lora_engine
    source = engine.source
    sent = {name: tensor_digest(source.view_of(name, _whole(source, name))) for name in source.layout.names}
    for rank, held in enumerate(llm.collective_rpc("awex_probe_lora", args=(IDS,))):
        slots = held.pop("slots")
        assert held == sent, f"{version}: rank {rank} holds other adapter bytes than the trainer sent"
        assert sorted(slots) == [1, 2], slots  # both pinned, each in a slot
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    for name, request in requests.items():
        served = [
            list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, lora_request=request, use_tqdm=False)
        ]
        reference = copy.deepcopy(model)
        reference.set_adapter(name)
        expected = hf_greedy(reference.merge_and_unload(), tokenizer, PROMPTS, TOKENS)
        assert served == expected, f"{version}: vLLM's output with {name} is not the merged model's"


def _whole(source, name):
    from awex.meta import Box

    return Box.full(tuple(source.layout.tensor(name).spec.shape))


def test_adapters_synced_in_place_equal_the_merged_model(lora_engine, model_dir):
    """Two versions in place (the second after vLLM dropped every adapter at the end of the first update: Awex keeps
    them served from what it received, not from the files); only the adapters' bytes move, to both ranks."""
    model = _peft(model_dir, seed=1)
    engine = _trainer(lora_engine, model)
    source = engine.source
    adapter_bytes = sum(source.view_of(n, _whole(source, n)).nbytes for n in source.layout.names)
    for _ in range(2):
        _perturb(model)
        version = engine.send_weights()
        assert engine.writer.last_stats.bytes_sent == 2 * adapter_bytes  # each of the two ranks holds the adapters
        _check_version(lora_engine, model, engine, version)
    engine.shutdown()


def test_staged_with_verify_after_adapters_unlike_the_engines_were_refused(lora_engine, model_dir):
    """An adapter of another rank, or on more modules, than the engine serves is refused before any byte moves,
    naming it; then staged receive with verify applies a version whole."""
    model = _peft(model_dir, seed=2)
    with pytest.raises(AwexValueError) as wrong_rank:
        _trainer(lora_engine, _peft(model_dir, seed=2, code_rank=6))
    assert "code/" in str(wrong_rank.value), wrong_rank.value  # names an adapter tensor whose shape differs
    more = _peft(model_dir, seed=2, code_modules=("q_proj", "v_proj", "down_proj", "o_proj"))
    with pytest.raises(AwexValueError, match=r"does not hold 4 tensor\(s\) this trainer sends.*code/"):
        _trainer(lora_engine, more)  # the engine's adapter lacks o_proj: refused, never left out unsaid
    engine = _trainer(lora_engine, model, receive="staged", verify=True)
    _perturb(model)
    version = engine.send_weights()
    assert engine.last_stalls["vllm-0"].commit_seconds is not None  # paused for the commit alone
    _check_version(lora_engine, model, engine, version)
    engine.shutdown()


def test_lora_b_is_sent_times_its_scale_and_refreshed(model_dir):
    """B is sent as B times its scale (alpha/r; rsLoRA alpha/sqrt(r)), recomputed at each refresh, A as it is."""
    from awex.engines.source import TrainerSource

    model = _peft(model_dir)
    source = TrainerSource.lora(model, ["math", "code"])
    params = dict(model.named_parameters())
    a = "base_model.model.model.layers.1.self_attn.v_proj.lora_{}.{}.weight"
    name = "{}/model.layers.1.self_attn.v_proj.lora_{}.weight"
    for adapter, scale in (("math", 8 / 4), ("code", 8 / 8**0.5)):
        b = params[a.format("B", adapter)]
        view = source.view_of(name.format(adapter, "B"), _box(b))
        assert torch.equal(view, b.detach() * scale)
        with torch.no_grad():
            b.add_(1.0)
        source.refresh()
        assert torch.equal(source.view_of(name.format(adapter, "B"), _box(b)), b.detach() * scale)
        a_view = source.view_of(name.format(adapter, "A"), _box(params[a.format("A", adapter)]))
        assert a_view.data_ptr() == params[a.format("A", adapter)].data_ptr()  # A itself, no copy


def _fsdp_rank(rank: int, port: int, model_dir: str, meta: str, out: dict) -> None:
    """One rank of a two-rank FSDP2 job over gloo: its LoRA source's layout, rank and each view, then its write of
    version ``fsdp-1`` (adapters of seed 3) into the engine."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from awex.engines.source import TrainerSource
    from awex.engines.writer import WeightsWriter
    from awex.meta.client import MetaClient

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model = _peft(model_dir, seed=3)
        mesh = init_device_mesh("cpu", (2,))
        for layer in model.base_model.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        source = TrainerSource.lora(model, ["math", "code"])
        views = {}
        for name in source.layout.names:
            for box in source.layout.rank_boxes(source.local_rank).get(name, []):
                views[name] = (box.offsets, box.sizes, source.view_of(name, box).clone())
        out[rank] = (source.layout.world_size, source.local_rank, views)
        writer = WeightsWriter.from_source(MetaClient(meta, job="fsdp"), source, timeout=120.0)
        try:
            writer.write("fsdp-1", ["vllm-0"])
        finally:
            writer.close()
    finally:
        dist.destroy_process_group()


def test_fsdp2_sharded_adapters_sync_their_local_shards(lora_engine, model_dir):
    """Two FSDP2 ranks each send their own shard of every adapter tensor (B's times its scale), nothing gathered:
    the two ranks' boxes are the whole adapter of the unsharded model, and the engine then serves the merged
    model's output with each adapter."""
    import socket
    import threading

    import torch.multiprocessing as mp

    from awex.engines.source import TrainerSource
    from awex.engines.vllm_offline import LLMClient, apply_version

    llm, _, _, meta = lora_engine
    client = LLMClient(llm)
    client.init_weight_transfer_engine({"meta_address": meta.address, "job": "fsdp", "instance": "vllm-0", "lora": IDS})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    applied: dict = {}
    engine = threading.Thread(target=lambda: applied.update(stall=apply_version(client, "fsdp-1", instance="vllm-0")))
    engine.start()
    mp.spawn(_fsdp_rank, args=(port, str(model_dir), meta.address, out), nprocs=2, join=True)
    engine.join(120)
    assert "stall" in applied, "the engine did not apply fsdp-1"
    model = _peft(model_dir, seed=3)
    whole = TrainerSource.lora(model, ["math", "code"])
    assert {r: out[r][:2] for r in (0, 1)} == {0: (2, 0), 1: (2, 1)}
    for name in whole.layout.names:
        full = whole.view_of(name, _whole(whole, name))
        got = torch.zeros_like(full)
        held = [out[r][2][name] for r in (0, 1) if name in out[r][2]]
        assert len(held) == 2, name  # both ranks hold a shard (FSDP2 cuts dimension 0, r or out, in two)
        assert sum(torch.tensor(sizes).prod().item() for _, sizes, _ in held) == full.numel(), name
        for offsets, sizes, view in held:
            got[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))] = view
        assert torch.equal(got, full), name

    class Sent:  # what the engine must hold now: the unsharded model's adapters as the trainer sends them
        source = whole

    _check_version(lora_engine, model, Sent, "fsdp-1")


def test_lora_source_refusals(lora_engine, model_dir):
    """The trainer's source: an adapter the model lacks, one name for several adapters, DoRA, LoRA on embeddings;
    the engine's mapping: ids that are not vLLM's."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from awex.engines.lora import check_adapters
    from awex.engines.source import TrainerSource

    model = _peft(model_dir)
    with pytest.raises(AwexValueError, match=r"no adapter \['chat'\]"):
        TrainerSource.lora(model, ["math", "chat"])
    with pytest.raises(AwexValueError, match="holds 2 adapters"):
        TrainerSource.lora(model, "math")
    assert TrainerSource.lora(model, {"math": "algebra"}).layout.names[0].startswith("algebra/model.layers.0.")
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    dora = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(AwexValueError, match="DoRA"):
        TrainerSource.lora(dora, "math")
    emb = get_peft_model(base, LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"]))
    with pytest.raises(AwexValueError, match="embeddings"):
        TrainerSource.lora(emb, "math")
    from types import SimpleNamespace

    from awex.engines.vllm_lora import lora_manager, pin

    with pytest.raises(AwexValueError, match="enable_lora=True"):  # an engine that serves no adapters
        lora_manager(torch.nn.Linear(2, 2))
    pinned = []
    two_slots = SimpleNamespace(lora_slots=2, pin_adapter=pinned.append)
    with pytest.raises(AwexValueError, match="max_loras >= 3"):  # each pinned adapter keeps a slot
        pin(two_slots, {1, 2, 3})
    assert pinned == []  # refused before any adapter was pinned
    pin(two_slots, {2, 1})
    assert pinned == [1, 2]
    for bad in ({}, {"math": 0}, {"a/b": 1}, {"math": True}, {"math": 1, "code": 1}, ["math"]):
        with pytest.raises(AwexValueError):
            check_adapters(bad)
    # last on this engine: a refusal raised in vLLM's TP=2 workers leaves the other worker's reply queued in its
    # multiprocess executor, so the next call fails with this error (vLLM's bug, not Awex's state: vllm PR 57846)
    with pytest.raises(Exception, match=r"no adapter with id 7 is loaded in this engine; serve it first"):
        _trainer(lora_engine, model, lora={"math": 7, "code": 2})


def _box(t):
    from awex.meta import Box

    return Box.full(tuple(t.shape))
