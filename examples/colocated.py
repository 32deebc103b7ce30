"""
Colocated: the trainer and a vLLM `LLM` in one script, on one device (one GPU in production), weights synced by
Awex through vLLM's RL API. The trainer sends its weights from where they are: on GPUs, vLLM's worker process
reads them over CUDA IPC straight into its live parameters (transport "auto" picks "ipc"); on CPU, through host
shared memory ("shm"). Generation is paused around each update and resumed after it.

Memory rules on one GPU (what this script does when CUDA is there; on CPU there is nothing to free):
- vLLM takes a share of the GPU, not all of it: gpu_memory_utilization=0.4 leaves the rest to the trainer
  (weights, gradients, optimizer state, activations).
- vLLM sleeps while the trainer trains: llm.sleep(level=1) frees its KV cache and moves its weights to host
  memory; enable_sleep_mode=True is needed for that.
- Before a sync, wake the weights only: llm.wake_up(tags=["weights"]). Awex writes into vLLM's live
  parameters, so they must be on the GPU; the KV cache stays freed during the sync, which needs no staging copy
  of the model (the engine reads each tensor once from the trainer's memory).
- After the sync, wake the KV cache (llm.wake_up(tags=["kv_cache"])) and generate.
- The trainer's weights stay where they are between its step and the sync: Awex reads the trainer's parameters
  in place. A trainer that offloads its parameters (FSDP CPU offload, sleep modes) must have them back before it
  sends, and passes hold_trainer_memory=False to AwexTrainerInitInfo, so that the engine and the writer let go of
  that memory after each version and offloading gives it back.

Runs on CPU as shipped (vLLM's CPU build, a tiny model made locally, float32). On one GPU: pass --model; the script
then uses the GPU, bfloat16 and the sleep calls above. The GPU path was not run with vLLM's GPU build here.
"""

import argparse
import os
import tempfile

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from vllm import LLM, SamplingParams
from vllm.config import WeightTransferConfig
from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.base import ModuleSource

from awex.engines.vllm_offline import LLMClient
from awex.engines.vllm_trainer import AwexTrainerInitInfo
from awex.meta.server import start_embedded

PROMPTS = ["the quick brown fox", "the capital of france is", "reward policy gradient"]
TEXTS = ["the quick brown fox jumps over the lazy dog", "the capital of france is the largest city in france"]
STEPS = 3
MAX_TOKENS = 16


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

    meta = start_embedded()  # where trainer and engine meet (`awex-meta serve` in a real job)
    llm = LLM(
        model=args.model,
        enforce_eager=True,
        dtype=dtype,
        max_model_len=256,
        weight_transfer_config=WeightTransferConfig(backend="awex"),
        **(dict(gpu_memory_utilization=0.4, enable_sleep_mode=True) if gpu else dict(kv_cache_memory_bytes=64 << 20)),
    )
    trainer = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    optimizer = torch.optim.Adam(trainer.parameters(), lr=1e-2)
    engine = WeightTransferTrainerFactory.trainer_init(  # LLMClient: vLLM's client protocol over this LLM
        AwexTrainerInitInfo(rank=0, meta_address=meta.address, instances=("vllm-0",)),
        client=LLMClient(llm),
        source=ModuleSource(trainer),
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

    for step in range(1, STEPS + 1):
        if gpu:
            llm.sleep(level=1)  # KV cache freed, weights to host memory: the GPU is the trainer's
        batch = tokenizer(TEXTS, return_tensors="pt", padding=True).to(device)
        loss = trainer(**batch, labels=batch.input_ids.masked_fill(batch.attention_mask == 0, -100)).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if gpu:
            llm.wake_up(tags=["weights"])  # Awex writes into the live weights: they must be on the GPU
        version = engine.send_weights()
        if gpu:
            llm.wake_up(tags=["kv_cache"])
        stall = engine.last_stalls["vllm-0"]

        served = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        expected = []
        with torch.no_grad():
            for p in PROMPTS:
                ids = tokenizer(p, return_tensors="pt").input_ids.to(device)
                gen = trainer.generate(ids, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
                expected.append(gen[0, ids.shape[1] :].tolist())
        assert served == expected, f"{version}: vLLM's greedy output differs from the trainer's"
        print(
            f"PASS {version} (loss {loss.item():.3f}): sync {stall.sync_seconds * 1e3:.0f} ms, "
            f"generation stalled {stall.stall_seconds * 1e3:.0f} ms; vLLM's greedy output = the trainer's"
        )

    engine.shutdown()
    meta.stop()
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
