# SPDX-License-Identifier: Apache-2.0
# Adapted from vLLM's examples/offline_inference/new_weight_syncing/rlhf.py (Copyright contributors to the vLLM
# project): weight transfer backend "awex" instead of "nccl".
"""
Reinforcement learning with vLLM and Ray, weights synced by Awex through vLLM's native weight-syncing API.

* A Hugging Face model is the trainer, in a Ray actor.
* A 2x tensor-parallel vLLM engine, in a Ray actor, starts from dummy (random) weights.
* Generating before the sync gives gibberish; the trainer sends its weights (each trainer rank sends what it
  holds, straight into vLLM's live parameters; generation is paused around the update); generating after it gives
  the trainer's own greedy output, token for token.

Differences from the NCCL version: no process group to set up by hand (a MetaServer, started here, is where both
sides meet: the trainer engine initialises vLLM's side itself), no metadata to gather (every rank describes what
it holds), and vLLM is paused and its caches cleared around the update.

Runs on CPU as shipped (vLLM's CPU build, a tiny model made locally, float32). On GPUs: pass --model (e.g.
Qwen/Qwen3-0.6B), give the trainer actor num_gpus=1, place the engine in a placement group of two
{"GPU": 1} bundles with distributed_executor_backend="ray" (as vLLM's original), and use dtype="bfloat16".
"""

import argparse
import os
import tempfile

import ray
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from vllm import LLM, SamplingParams
from vllm.config import WeightTransferConfig

from awex.meta.server import start_embedded

PROMPTS = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
MAX_TOKENS = 16


@ray.remote(num_cpus=1)
class TrainModel:
    """Ray actor that wraps the training model (on GPUs: num_gpus=1 and .to("cuda"))."""

    def __init__(self, model_name: str):
        self.model = AutoModelForCausalLM.from_pretrained(model_name, dtype=torch.float32)
        self.tokenizer = AutoTokenizer.from_pretrained(model_name)

    def init_weight_transfer(self, meta_address: str, llm) -> None:
        """Awex's trainer engine through vLLM's factory: it reaches the engine through vLLM's Ray client."""
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient

        from awex.engines.vllm_trainer import AwexTrainerInitInfo

        self.engine = WeightTransferTrainerFactory.trainer_init(
            AwexTrainerInitInfo(rank=0, meta_address=meta_address, instances=("vllm-0",)),
            client=RayVLLMWeightSyncClient(llm),
            source=ModuleSource(self.model),
        )

    def send_weights(self) -> str:
        """Send the weights to the inference engine; returns the version once every engine rank applied it."""
        return self.engine.send_weights()

    @torch.inference_mode()
    def greedy(self, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
        out = []
        for p in prompts:
            ids = self.tokenizer(p, return_tensors="pt").input_ids
            gen = self.model.generate(
                ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False
            )
            out.append(gen[0, ids.shape[1] :].tolist())
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--model", help="an HF checkpoint (default: a tiny model made locally)")
    args = parser.parse_args()
    if args.model is None:
        from tiny import tiny_model

        args.model = tiny_model(os.path.join(tempfile.gettempdir(), "awex-examples", "tiny"))

    # vLLM-CPU: its OpenMP threads unpinned (the trainer shares the cores); not read on GPUs
    ray.init(runtime_env={"env_vars": {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}})
    meta = start_embedded()  # where trainer and engine ranks meet (`awex-meta serve` in a real job)
    train_model = TrainModel.remote(args.model)

    # The engine starts from dummy weights; its TP workers run as processes inside the actor (on GPUs: Ray workers
    # in a placement group, as in vLLM's original example).
    llm = ray.remote(num_cpus=1)(LLM).remote(
        model=args.model,
        enforce_eager=True,
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
        dtype="float32",
        max_model_len=256,
        kv_cache_memory_bytes=64 << 20,
        weight_transfer_config=WeightTransferConfig(backend="awex"),
        load_format="dummy",
    )
    sampling_params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def generate() -> list:
        outputs = ray.get(llm.generate.remote(PROMPTS, sampling_params, use_tqdm=False))
        print("-" * 50)
        for output in outputs:
            print(f"Prompt: {output.prompt!r}\nGenerated text: {output.outputs[0].text!r}")
            print("-" * 50)
        return [list(o.outputs[0].token_ids) for o in outputs]

    before = generate()  # gibberish: the weights are random

    ray.get(train_model.init_weight_transfer.remote(meta.address, llm))
    version = ray.get(train_model.send_weights.remote())
    print(f"weights sent: {version}; vLLM serves {ray.get(llm.get_weight_version.remote())!r}")

    after = generate()  # the trainer's model now
    expected = ray.get(train_model.greedy.remote(PROMPTS, MAX_TOKENS))
    assert after == expected, f"vLLM's greedy output differs from the trainer's: {after} != {expected}"
    assert after != before
    print(f"PASS: vLLM's greedy output equals the trainer's for all {len(PROMPTS)} prompts")

    ray.get(llm.__ray_call__.remote(lambda engine: engine.llm_engine.engine_core.shutdown()))
    meta.stop()
    ray.shutdown()


if __name__ == "__main__":
    main()
