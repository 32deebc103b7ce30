"""
An FSDP2 trainer (two ranks, Ray actors) updates two vLLM `LLM` engines (Ray actors) through vLLM's own RL API
with backend "awex": each trainer rank sends its local shards (nothing is gathered), one RayVLLMWeightSyncClient
drives both engines, and each version arrives while the engines keep generating (receive="staged"): they are paused
for its commit alone, once every rank of both holds it.

Each step is a real training step (next-token loss on a few sentences, Adam), then the new weights are sent; after
each version both engines' greedy output must equal the trained model's (gathered once, here, only to check).

Runs on CPU as shipped (gloo, vLLM's CPU build, a tiny model made locally, float32). On GPUs: pass --model, give
each trainer and engine actor num_gpus=1 (or place them with placement groups of {"GPU": 1} bundles), use "nccl"
and init_device_mesh("cuda", ...), and bfloat16 (or keep an FP32 trainer and pass allow_cast=("*",) to narrow into
a bfloat16 engine).
"""

import argparse
import os
import tempfile

import ray
import torch

from awex.meta.server import start_embedded

TRAINERS = 2
ENGINES = ("vllm-0", "vllm-1")
STEPS = 2
PROMPTS = ["the quick brown fox", "the capital of france is", "reward policy gradient"]
TEXTS = ["the quick brown fox jumps over the lazy dog", "the capital of france is the largest city in france"]
MAX_TOKENS = 16


@ray.remote(num_cpus=1)
class Trainer:
    def __init__(self, rank: int, port: int, model_path: str):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import AutoModelForCausalLM, AutoTokenizer

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TRAINERS)
        self.rank = rank
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        mesh = init_device_mesh("cpu", (TRAINERS,))
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-2)

    def init_weight_transfer(self, meta_address: str, engines: list) -> None:
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient

        from awex.engines.vllm_trainer import AwexTrainerInitInfo

        self.engine = WeightTransferTrainerFactory.trainer_init(
            AwexTrainerInitInfo(rank=self.rank, meta_address=meta_address, instances=ENGINES, receive="staged"),
            client=RayVLLMWeightSyncClient(engines),  # one engine per name in instances
            source=ModuleSource(self.model),  # FSDP2: each rank sends its own DTensor shards
        )

    def train_step(self) -> float:
        batch = self.tokenizer(TEXTS, return_tensors="pt", padding=True)
        loss = self.model(**batch, labels=batch.input_ids.masked_fill(batch.attention_mask == 0, -100)).loss
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def send_weights(self) -> tuple[str, dict]:
        version = self.engine.send_weights()  # on every trainer rank
        stalls = self.engine.last_stalls if self.rank == 0 else {}  # rank 0 drives the engines
        return version, {k: (s.stall_seconds, s.commit_seconds) for k, s in stalls.items()}

    @torch.no_grad()
    def reference_greedy(self) -> list[list[int]] | None:
        """The trained model's greedy output (gathered on every rank, answered by rank 0): what the engines must
        generate."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from transformers import AutoModelForCausalLM

        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        if self.rank != 0:
            return None
        reference = AutoModelForCausalLM.from_config(self.model.config, dtype=torch.float32)
        reference.load_state_dict(full)
        out = []
        for p in PROMPTS:
            ids = self.tokenizer(p, return_tensors="pt").input_ids
            gen = reference.generate(ids, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
            out.append(gen[0, ids.shape[1] :].tolist())
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--model", help="an HF checkpoint (default: a tiny model made locally)")
    args = parser.parse_args()
    if args.model is None:
        from tiny import tiny_model

        args.model = tiny_model(os.path.join(tempfile.gettempdir(), "awex-examples", "tiny"))
    from vllm import LLM, SamplingParams
    from vllm.config import WeightTransferConfig

    from awex.transport.net import free_port

    # vLLM-CPU: OpenMP threads unpinned (not read on GPUs); four actors on this machine's cores
    ray.init(num_cpus=TRAINERS + len(ENGINES), runtime_env={"env_vars": {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}})
    meta = start_embedded()  # where trainer and engine ranks meet (`awex-meta serve` in a real job)
    engine_args = dict(
        model=args.model,
        enforce_eager=True,
        dtype="float32",
        max_model_len=256,
        kv_cache_memory_bytes=64 << 20,
        weight_transfer_config=WeightTransferConfig(backend="awex"),
    )
    engines = [ray.remote(num_cpus=1)(LLM).remote(**engine_args) for _ in ENGINES]
    port = free_port()
    trainers = [Trainer.remote(rank, port, args.model) for rank in range(TRAINERS)]
    ray.get([t.init_weight_transfer.remote(meta.address, engines) for t in trainers])
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

    for step in range(1, STEPS + 1):
        losses = ray.get([t.train_step.remote() for t in trainers])
        versions, stalls = zip(*ray.get([t.send_weights.remote() for t in trainers]))
        expected = ray.get([t.reference_greedy.remote() for t in trainers])[0]
        for name, engine in zip(ENGINES, engines):
            outputs = ray.get(engine.generate.remote(PROMPTS, params, use_tqdm=False))
            served = [list(o.outputs[0].token_ids) for o in outputs]
            assert served == expected, f"{versions[0]}: {name}'s greedy output differs from the trained model's"
        print(f"PASS step {step} (loss {losses[0]:.3f}): {versions[0]} on {', '.join(ENGINES)}, greedy = trainer's")
        ms = {k: f"{stall * 1e3:.0f} ms (commit {commit * 1e3:.0f} ms)" for k, (stall, commit) in stalls[0].items()}
        print(f"  generation stalled {ms} (the commit alone)")

    for engine in engines:
        ray.get(engine.__ray_call__.remote(lambda llm: llm.llm_engine.engine_core.shutdown()))
    meta.stop()
    ray.shutdown()


if __name__ == "__main__":
    main()
