"""What learning a vLLM receiver's layout from vLLM's loaders costs at set-up, against the table's set-up, on one
engine (vLLM's CPU build, dummy weights, plain weights as on GPUs); prints one JSON line.

    python -m awex_integration.benchmarks.learn_cost integration/models/qwen3-8b.json --dtype bfloat16

Set-up is measured around ``init_weight_transfer_engine`` (twice: the table, then the learned layout, on the same
engine); the learned layout's own time is the worker's (``LearnedLayout.seconds``). Memory: the process's peak
resident size before and after (probes hold no data: the recording allocates nothing of the model's size).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker in this process: its memory is ours
    from awex_integration.engines import vllm_cpu_plain_weights

    os.environ[vllm_cpu_plain_weights.ENV] = "1"
    vllm_cpu_plain_weights.apply()
    from vllm import LLM

    from awex.meta.server.embedded import start_embedded
    from awex_integration.engines.tiny_model import load_json, make_tokenizer
    from awex_integration.scenarios.instances import llm_options

    config = load_json(args.config)
    with tempfile.TemporaryDirectory(prefix="awex-learn-cost-") as work:
        model = Path(work)
        (model / "config.json").write_text(json.dumps({**config, "torch_dtype": args.dtype}))
        make_tokenizer(model, int(config["vocab_size"]))
        server = start_embedded(token="cost")
        llm = LLM(**llm_options(model, args.tp, args.dtype), load_format="dummy")
        init = {"meta_address": server.address, "token": "cost", "instance": "vllm-0"}
        out = {}
        for layout in ("table", "learned"):
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
            started = time.perf_counter()
            llm.init_weight_transfer_engine({"init_info": {**init, "layout": layout}})
            out[layout] = {
                "init_seconds": round(time.perf_counter() - started, 3),
                "peak_rss_growth_bytes": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10) - rss,
            }
        cost = llm.collective_rpc("awex_learned_cost")[0]
        out["learned"].update(learn_seconds=round(cost["seconds"], 3), tensors=cost["tensors"])
        out["differences_from_table"] = llm.collective_rpc("awex_learned_vs_table")
        out["model"] = Path(args.config).name
        out["params_bytes"] = sum(p.numel() * p.element_size() for p in _model(llm).parameters())
        server.stop()
    print(json.dumps(out), flush=True)


def _model(llm):
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner.model


if __name__ == "__main__":
    main()
