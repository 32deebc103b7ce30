"""A running Megatron-core job's parallel sizes (:func:`megatron_parallel`), read from ``parallel_state`` and the
model; sizes given by hand are checked against them."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from awex.meta.errors import AwexValueError
from awex.meta.layouts import MegatronParallel


class ParallelMismatchError(AwexValueError):
    """Sizes given by hand differ from the running Megatron job's."""


def megatron_parallel(
    model: torch.nn.Module | Sequence[torch.nn.Module],
    config: Mapping[str, Any],
    given: MegatronParallel | None = None,
) -> MegatronParallel:
    """This Megatron job's :class:`MegatronParallel`, read from ``parallel_state`` (initialised) and the model
    (its chunks under VPP): sizes, uneven first/last pipeline stages, the vocabulary padding. ``given`` (sizes
    typed by hand) must agree: :class:`ParallelMismatchError` names every field that differs."""
    from megatron.core import parallel_state as ps

    from awex.meta.layouts.common import pad_to

    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    module = getattr(chunks[0], "module", chunks[0])  # a DDP / Float16Module wrapper holds the GPTModel
    tconfig = module.config
    tp = ps.get_tensor_model_parallel_world_size()
    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or len(chunks)
    job = {
        "tp": tp,
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
        "cp": ps.get_context_parallel_world_size(),
        "vpp": vpp,
        "first": getattr(tconfig, "num_layers_in_first_pipeline_stage", None) or 0,
        "last": getattr(tconfig, "num_layers_in_last_pipeline_stage", None) or 0,
    }
    q_lora = getattr(tconfig, "q_lora_rank", None)
    if q_lora and tp > 1:  # latent attention: the local spec splits the down-projections over TP, TE duplicates them
        down = next((m for n, m in module.named_modules() if n.endswith("self_attention.linear_q_down_proj")), None)
        job["latent_down_split"] = down is not None and down.weight.shape[0] < q_lora
    if getattr(tconfig, "num_moe_experts", None):  # expert sizes only mean something where experts exist
        job.update(ep=ps.get_expert_model_parallel_world_size(), etp=ps.get_expert_tensor_parallel_world_size())
    else:
        job.update(ep=given.ep if given else 1, etp=given.etp if given else 1)
    vocab, padded = int(config["vocab_size"]), int(module.vocab_size)  # GPTModel.vocab_size: padded, as built
    candidates = [given.vocab_pad] if given is not None else [128, padded // tp]
    pad = next((c for c in candidates if pad_to(vocab, c * tp) == padded), None)
    if pad is None:
        got = pad_to(vocab, candidates[0] * tp)
        raise ParallelMismatchError(
            f"megatron: vocab_pad={candidates[0]} pads the vocabulary of {vocab} to {got} rows with tp={tp}; the "
            f"model was built with {padded} (its --make-vocab-size-divisible-by)"
        )
    found = MegatronParallel(**job, vocab_pad=pad)
    if given is not None:
        wrong = [f"{k}={getattr(given, k)} (the job has {v})" for k, v in job.items() if getattr(given, k) != v]
        if wrong:
            raise ParallelMismatchError(
                "megatron: the sizes given do not match this job's parallel_state and model: "
                + ", ".join(wrong)
                + "; leave them out to use the job's"
            )
    return found
