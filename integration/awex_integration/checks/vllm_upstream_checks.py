"""Does vLLM still need the fixups in ``awex.engines.vllm_fixups``? Each check reproduces, without Awex, the
upstream behaviour a fixup exists for, and then shows that the fixup mends it:

1. build a tiny model, start vLLM (CPU build) on it;
2. change the weights the fixup is about, save them, and reload them with vLLM's own
   ``reload_weights(weights_path=...)``;
3. compare vLLM's greedy output with HF's on the changed weights (``stale``: they differ without the fixup);
4. apply the fixup inside the worker and compare again (``fixed``: they are equal).

    python -m awex_integration.checks.vllm_upstream_checks moe|tied-head

prints one JSON line ``{"check", "stale", "fixed", "refreshed"}``. ``stale == false`` means upstream changed and
the fixup can go (integration/tests/test_vllm_fixups.py turns that into a failing test).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from awex_integration.engines.tiny_model import PROMPTS, dtype_kwarg, hf_greedy, load_json, make_tiny_model

MODELS = Path(__file__).resolve().parents[2] / "models"
CHECKS = {
    # fixup name, model, which HF parameters change
    "moe": ("refresh_cpu_moe_experts", "qwen3-moe-tiny.json", lambda name: ".experts." in name),
    "tied-head": ("refresh_tied_lm_head", "qwen3-tiny-tied.json", lambda name: "embed_tokens" in name),
}


def _apply_fixup(worker, fixup: str):
    """Runs inside the vLLM worker (collective_rpc)."""
    from awex.engines import vllm_fixups

    return getattr(vllm_fixups, fixup)(worker.model_runner.model)


def run(check: str) -> dict:
    root = Path(tempfile.mkdtemp(prefix="awex-upstream-"))  # two tiny checkpoints: removed after
    try:
        return _run(check, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run(check: str, root: Path) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams

    fixup, model_config, changes = CHECKS[check]
    first = make_tiny_model(root / "first", load_json(MODELS / model_config))
    model = AutoModelForCausalLM.from_pretrained(first, **dtype_kwarg(torch.float32)).eval()
    tokenizer = AutoTokenizer.from_pretrained(first)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        changed = [name for name, p in model.named_parameters() if changes(name)]
        for name, p in model.named_parameters():
            if changes(name):
                p.add_(0.5 * torch.randn(p.shape, generator=g))
    if not changed:
        raise RuntimeError(f"{check}: no parameter of {model_config} matches; the check tests nothing")
    second = root / "second"
    model.save_pretrained(second)
    tokenizer.save_pretrained(second)
    reference = hf_greedy(model, tokenizer)

    llm = LLM(
        model=str(first), dtype="float32", max_model_len=128, enforce_eager=True, seed=0, kv_cache_memory_bytes=64 << 20
    )
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def greedy() -> list[list[int]]:
        prompts = [{"prompt_token_ids": tokenizer(p)["input_ids"]} for p in PROMPTS]
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(second)})
    stale = greedy() != reference
    refreshed = llm.collective_rpc(_apply_fixup, args=(fixup,))
    fixed = greedy() == reference
    return {"check": check, "changed_tensors": len(changed), "stale": stale, "fixed": fixed, "refreshed": refreshed}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] not in CHECKS:
        raise SystemExit(f"usage: python -m awex_integration.checks.vllm_upstream_checks {{{'|'.join(CHECKS)}}}")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the fixup runs in this process's worker
    print(json.dumps(run(argv[0])), flush=True)


if __name__ == "__main__":
    main()
