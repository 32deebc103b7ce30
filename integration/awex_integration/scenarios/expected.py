"""What a scenario's receivers must hold and produce: FP8 checkpoints of the expected weights, reference models with
the same weights, and fresh vLLM engines to compare greedy output and engine state with."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from awex.transport.shards import torch_dtype
from awex_integration.engines.tiny_model import (
    dtype_kwarg,
    load_json,
    vllm_greedy,
)
from awex_integration.scenarios.instances import llm_options, stop_engine


def fp8_checkpoint(weights: dict[str, torch.Tensor], quant) -> dict[str, torch.Tensor]:
    """What FP8 receivers must hold: every quantised weight as FP8 tiles plus its scales (same function as the
    trainers use, applied to the expected full weights)."""
    from awex.convert import quantize_fp8_blocks

    out = {}
    for name, t in weights.items():
        if quant.quantises(name, tuple(t.shape)):
            out[name], out[name + "_scale_inv"] = quantize_fp8_blocks(t, quant.block, torch_dtype(quant.dtype))
        else:
            out[name] = t
    return out


def reference_model(model_dir: Path, weights_dir: Path, dtype: str):
    """HF loaded from the step's reference checkpoint through ``from_pretrained`` (which applies transformers'
    own checkpoint conversions, e.g. per-expert tensors into fused experts); every parameter must be loaded."""

    from transformers import AutoModelForCausalLM

    shutil.copy(model_dir / "config.json", weights_dir / "config.json")
    model, info = AutoModelForCausalLM.from_pretrained(
        weights_dir, **dtype_kwarg(torch_dtype(dtype)), output_loading_info=True
    )
    if info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]:
        raise RuntimeError(f"reference checkpoint does not fit the model: {info}")
    return model.eval()


def write_fp8_model(model_dir: Path, out: Path, quant) -> Path:
    """An FP8 block-quantised copy of a model directory (weights, scales, ``quantization_config``), as FP8
    checkpoints ship."""

    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out, dirs_exist_ok=True)
    save_file(fp8_checkpoint(load_file(str(model_dir / "model.safetensors")), quant), str(out / "model.safetensors"))
    config = load_json(out / "config.json")
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(quant.block),
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def state_differences(synced: list[dict[str, str]], fresh: list[dict[str, str]]) -> list[str]:
    """Tensors (``worker:module.attribute``) whose digests differ between a synced engine and a fresh one."""
    out = []
    for worker, (a, b) in enumerate(zip(synced, fresh, strict=True)):
        out += [f"{worker}:{name}" for name in sorted(set(a) | set(b)) if a.get(name) != b.get(name)]
    return out


def fresh_vllm_greedy(
    model_dir: Path, weights_dir: Path, dtype: str, tp: int = 1
) -> tuple[list[list[int]], list[dict[str, str]]]:
    """Greedy output of a new vLLM engine (TP ``tp``, as the synced ones) loaded from ``weights_dir`` (with
    ``model_dir``'s config and tokenizer), and the digests of every tensor it holds, per worker."""

    from vllm import LLM

    for f in model_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, weights_dir / f.name)
    llm = LLM(**llm_options(weights_dir, tp, dtype, awex=False))
    out = vllm_greedy(llm)
    state = llm.collective_rpc("awex_probe_state")
    stop_engine(llm)
    return out, state
