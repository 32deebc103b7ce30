"""The main job: a real sync on CPU.

A tiny Qwen2-shaped model and tokenizer are made locally (no hub). An embedded MetaServer starts; a
Megatron-core trainer with TP=2 (two processes over gloo) and a `vllm serve` engine with TP=1 (the CPU build) load
the same weights. Three RL-like steps follow: every weight changes, and the trainer ranks update vLLM through
vLLM's own RL API on both sides (trainer: ``WeightTransferTrainerFactory.trainer_init`` + ``send_weights()``
with vLLM's HTTP client; server: ``--weight-transfer-config '{"backend": "awex"}'``), each rank sending its
shards straight into vLLM's live parameters. After each step the demo shows the version, bytes, sync time, and
that vLLM's greedy output equals an HF reference with the same weights (and every received tensor equals them
bit for bit).
"""

from __future__ import annotations

import sys

from awex_integration.scenarios.scenario import main

if __name__ == "__main__":
    args = [
        "--trainer",
        "megatron",
        "--train-tp",
        "2",
        "--inference",
        "vllm",
        "--infer-tp",
        "1",
        "--instances",
        "1",
        "--dtype",
        "float32",
        "--steps",
        "3",
        "--control",
        "vllm-http",
        "--log-level",
        "info",
        *sys.argv[1:],
    ]
    print(
        "Awex demo: Megatron-core TP=2 trainer -> vllm serve TP=1 (CPU) through vLLM's RL API, 3 steps, gloo",
        flush=True,
    )
    sys.exit(main(args))
