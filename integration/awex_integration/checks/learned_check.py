"""A vLLM engine (CPU build, plain weights) set up with a layout learned from its own loaders, compared with
Awex's table of the architecture on every worker (``WorkerProbe.awex_learned_vs_table``); prints one JSON line.

    python -m awex_integration.checks.learned_check integration/models/qwen2-moe-tiny.json --tp 2
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", help="an HF config.json of an architecture with a table")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from awex_integration.engines import vllm_cpu_plain_weights

    os.environ[vllm_cpu_plain_weights.ENV] = "1"  # weights vLLM-CPU would prepack stay plain: in place, as on GPUs
    from vllm import LLM

    from awex.meta.server.embedded import start_embedded
    from awex_integration.engines.tiny_model import load_json, make_tiny_model
    from awex_integration.scenarios.instances import llm_options

    with tempfile.TemporaryDirectory(prefix="awex-learned-") as work:
        model = make_tiny_model(Path(work) / "model", load_json(args.config), dtype=args.dtype)
        server = start_embedded(token="learned")
        llm = LLM(**llm_options(model, args.tp, args.dtype))  # the scenario's engine: backend awex, the probe
        init = {"meta_address": server.address, "token": "learned", "instance": "vllm-0", "layout": "learned"}
        llm.init_weight_transfer_engine({"init_info": init})
        differences = llm.collective_rpc("awex_learned_vs_table")
        tensors = llm.collective_rpc("awex_learned_tensors")
        llm.llm_engine.engine_core.shutdown()
        server.stop()
    print(json.dumps({"ranks": len(differences), "tensors": min(tensors), "differences": differences}), flush=True)


if __name__ == "__main__":
    main()
