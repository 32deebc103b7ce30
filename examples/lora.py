"""
LoRA: a PEFT trainer trains two adapters and Awex sends only the adapters (kilobytes here, megabytes for a real
model) into the vLLM engine that serves them, straight into the adapters' tensors in the engine: no files per
version, no merged model. Each version, vLLM's greedy output with each adapter equals the trainer's model with that
adapter merged.

How it is set up:
- The engine serves the adapters once, from PEFT's save of the untrained adapters (`add_lora`, or
  `vllm serve --enable-lora --lora-modules math=...`); Awex keeps them served from then on.
- The trainer's source is the adapters alone: `AwexSource.lora(peft_model, ["math", "code"])` (or
  `{"default": "math"}` to serve PEFT's default adapter as "math").
- `AwexTrainerInitInfo(lora={"math": 1, "code": 2})` maps each served name to the `lora_int_id` the engine
  serves it under; everything else (pause, verify, staged receive, failures) is as for a whole model.

Runs on CPU as shipped (vLLM's CPU build, a tiny model made locally, float32). On GPUs: pass --model, use bfloat16;
vLLM keeps adapters in pinned host memory, which Awex writes from the GPU. The GPU path was not run with vLLM's GPU
build here.
"""

import argparse
import copy
import os
import tempfile

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer
from vllm import LLM, SamplingParams
from vllm.config import WeightTransferConfig
from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
from vllm.lora.request import LoRARequest

from awex.engines.vllm_offline import LLMClient
from awex.engines.vllm_trainer import AwexSource, AwexTrainerInitInfo
from awex.meta.server import start_embedded

PROMPTS = ["the quick brown fox", "the capital of france is", "reward policy gradient"]
TEXTS = {"math": ["the speed of light in vacuum is"], "code": ["the chemical formula of water is"]}
ADAPTERS = {"math": LoraConfig(r=4, lora_alpha=8), "code": LoraConfig(r=8, lora_alpha=16, use_rslora=True)}
IDS = {"math": 1, "code": 2}  # each adapter's lora_int_id in the engine
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
STEPS = 3
MAX_TOKENS = 16


def greedy(model, tokenizer, device) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = tokenizer(p, return_tensors="pt").input_ids.to(device)
            gen = model.generate(ids, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
            out.append(gen[0, ids.shape[1] :].tolist())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--model", help="an HF checkpoint (default: a tiny model made locally)")
    args = parser.parse_args()
    if args.model is None:
        from tiny import tiny_model

        args.model = tiny_model(os.path.join(tempfile.gettempdir(), "awex-examples", "tiny"))
    gpu = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # vLLM-CPU; not read on GPUs

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    trainer = None
    for name, config in ADAPTERS.items():  # the adapters, each saved once for the engine to serve at first
        config.target_modules = MODULES
        if trainer is None:
            trainer = get_peft_model(base, config, adapter_name=name)
        else:
            trainer.add_adapter(name, config)
    saved = tempfile.mkdtemp(prefix="awex-lora-")
    trainer.save_pretrained(saved, selected_adapters=list(ADAPTERS))  # PEFT: saved/<name>/ for each adapter

    meta = start_embedded()  # where trainer and engine meet (`awex-meta serve` in a real job)
    llm = LLM(
        model=args.model,
        enforce_eager=True,
        dtype=dtype,
        max_model_len=256,
        enable_lora=True,
        max_lora_rank=8,
        max_loras=len(ADAPTERS),
        weight_transfer_config=WeightTransferConfig(backend="awex"),
        **(dict(gpu_memory_utilization=0.4) if gpu else dict(kv_cache_memory_bytes=64 << 20)),
    )
    requests = {name: LoRARequest(name, IDS[name], os.path.join(saved, name)) for name in ADAPTERS}
    for request in requests.values():
        llm.llm_engine.add_lora(request)
    engine = WeightTransferTrainerFactory.trainer_init(
        AwexTrainerInitInfo(rank=0, meta_address=meta.address, instances=("vllm-0",), lora=IDS),
        client=LLMClient(llm),
        source=AwexSource.lora(trainer, list(ADAPTERS)),
    )
    optimizer = torch.optim.Adam([p for n, p in trainer.named_parameters() if "lora_" in n], lr=5e-2)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    whole = sum(p.numel() * p.element_size() for p in base.parameters())

    def serve(request) -> list[list[int]]:
        outputs = llm.generate(PROMPTS, params, lora_request=request, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    untrained = {name: serve(request) for name, request in requests.items()}  # B = 0: the base model's output

    for step in range(1, STEPS + 1):
        for name, texts in TEXTS.items():  # one step of each adapter on its own text
            trainer.set_adapter(name)
            batch = tokenizer(texts, return_tensors="pt").to(device)
            loss = trainer(**batch, labels=batch.input_ids).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        version = engine.send_weights()
        sent, stall = engine.writer.last_stats.bytes_sent, engine.last_stalls["vllm-0"]
        for name, request in requests.items():
            served = serve(request)
            reference = copy.deepcopy(trainer)
            reference.set_adapter(name)
            expected = greedy(reference.merge_and_unload(), tokenizer, device)
            assert served == expected, f"{version}: vLLM's output with {name} differs from the merged model's"
        print(
            f"PASS {version}: {sent} bytes sent ({sent / whole:.1%} of the model), generation stalled "
            f"{stall.stall_seconds * 1e3:.0f} ms; vLLM's greedy output with each adapter = the merged model's"
        )

    for name, request in requests.items():
        assert serve(request) != untrained[name], f"{name}: the trained adapter serves what the untrained one did"
    engine.shutdown()
    meta.stop()
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
