"""Functions that run inside spawned Megatron ranks (importable, for multiprocessing spawn)."""

from __future__ import annotations

import torch

from awex.convert import MegatronNames, megatron_views
from awex.meta import canonical_tensors
from awex.meta.layouts import MegatronParallel, megatron_layout
from awex.meta.models import model_dims
from awex.transport import LocalShards
from awex.transport.shards import torch_dtype
from awex_integration.engines.tiny_model import dtype_kwarg


def megatron_rank(rank: int, world: int, port: int, parallel: MegatronParallel, config: dict):
    """Initialise this Megatron rank and build its model; returns (model, dims, layout, shards, tp, pp)."""
    from awex_integration.engines.megatron_cpu import build_gpt, coordinates, expert_rank, init_distributed

    init_distributed(rank, world, port, parallel)
    dims = model_dims(config)
    model = build_gpt(dims, parallel, torch_dtype(dims.dtype))
    tp_rank, pp_rank = coordinates(parallel)
    layout = megatron_layout(canonical_tensors(dims), parallel, instance="trainer")
    where = MegatronNames(tp_rank, pp_rank, parallel, ep_rank=expert_rank())
    shards = LocalShards.from_layout(layout, rank, megatron_views(model, dims, where))
    return model, dims, layout, shards, tp_rank, pp_rank


def load_hf_into(shards: LocalShards, hf: dict[str, torch.Tensor]) -> None:
    """Write canonical HF tensors into this rank's native Megatron parameters through the converter's views."""
    for name in shards.names():
        for box, _ in shards.pairs(name):
            shards.copy_in(name, box.offsets, box.sizes, hf[name][box.slices()])


def check_conversion(rank: int, world: int, port: int, parallel: MegatronParallel, config: dict, model_dir: str):
    """HF -> Megatron -> HF round trip through the views, completeness of the mapping, and logits vs HF."""
    from safetensors.torch import load_file

    from awex_integration.engines.megatron_cpu import logits

    model, dims, layout, shards, tp_rank, pp_rank = megatron_rank(rank, world, port, parallel, config)
    chunks = model if isinstance(model, list) else [model]
    # the names and shapes awex.convert says this rank has (used where the model is not built, e.g. benchmarks)
    from awex.convert import megatron_param_shapes
    from awex_integration.engines.megatron_cpu import expert_rank

    said = megatron_param_shapes(dims, MegatronNames(tp_rank, pp_rank, parallel, ep_rank=expert_rank()))
    # the sizes read from the job (parallel_state and the model) are the ones it was built with; others refused
    from dataclasses import replace

    from awex.engines.megatron import ParallelMismatchError, megatron_parallel

    read = megatron_parallel(model, config)  # the vocabulary padding read back may be another number, same rows
    assert megatron_layout(canonical_tensors(dims), read) == layout, (read, parallel)
    assert megatron_parallel(model, config, parallel) == parallel
    rows = (model[0] if isinstance(model, list) else model).vocab_size
    for wrong, message in (
        (replace(parallel, tp=parallel.tp * 2), "the job has"),
        (replace(parallel, pp=parallel.pp + 1), "the job has"),
        (replace(parallel, vocab_pad=rows + 1), f"the model was built with {rows}"),
    ):
        try:
            megatron_parallel(model, config, wrong)
        except ParallelMismatchError as e:
            assert message in str(e), e
        else:
            raise AssertionError(f"{wrong} was accepted for a job built with {parallel}")
    real = [{n: tuple(p.shape) for n, p in m.named_parameters()} for m in chunks]
    assert said == real, f"megatron_param_shapes differs from the real model: said {said}, real {real}"
    hf = load_file(f"{model_dir}/model.safetensors")
    if dims.tie_embeddings:
        hf.pop("lm_head.weight", None)
    with torch.no_grad():
        for m in chunks:
            for p in m.parameters():
                p.fill_(float("nan"))
        load_hf_into(shards, hf)
    # every native element is reached by some canonical box, except vocabulary padding rows
    untouched = []
    for m in chunks:
        for name, p in m.named_parameters():
            nan = torch.isnan(p)
            if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                real = max(0, min(p.shape[0], dims.vocab - tp_rank * p.shape[0]))
                nan = nan[:real]
                with torch.no_grad():
                    p[real:] = 0
            if nan.any():
                untouched.append(name)
    assert not untouched, f"native parameters not covered by any canonical box: {untouched}"
    # round trip: read back through the views, bit-exact
    for name in shards.names():
        for box, _ in shards.pairs(name):
            out = torch.empty(box.sizes, dtype=hf[name].dtype)
            shards.copy_out(name, box.offsets, box.sizes, out)
            assert torch.equal(out, hf[name][box.slices()]), f"{name} {box} differs after the round trip"
    result = {"rank": rank, "tp": tp_rank, "pp": pp_rank, "tensors": len(list(shards.names()))}
    if parallel.pp == 1 and not dims.num_experts:  # MoE routing numerics differ between the two stacks
        from transformers import AutoModelForCausalLM

        ref = AutoModelForCausalLM.from_pretrained(model_dir, **dtype_kwarg(torch.float32)).eval()
        ids = torch.tensor([[1, 5, 9, 42, 7, 3, 99, 12]])
        with torch.no_grad():
            want = ref(ids).logits[0]
            got = logits(chunks[0], ids)[0]
        block = got.shape[-1]
        lo, hi = tp_rank * block, min((tp_rank + 1) * block, dims.vocab)
        diff = (got[:, : hi - lo] - want[:, lo:hi]).abs().max().item()
        assert diff < 1e-4, f"logits differ from HF by {diff}"
        result["max_logit_diff"] = diff
    return result
