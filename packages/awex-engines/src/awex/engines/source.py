"""One shape for every trainer: a :class:`TrainerSource` is this rank's canonical layout, its rank in it, views
of its own parameters by canonical box, and (optionally) what to refresh before each write. Built the same way
for Megatron-core, FSDP2 and HF models; :meth:`awex.engines.writer.WeightsWriter.from_source` makes the writer.

    source = TrainerSource.megatron(model, config)   # sizes from parallel_state; or .fsdp(model), .hf(model)
    source = TrainerSource.lora(peft_model, "math")  # a LoRA adapter alone (awex.engines.lora)
    writer = WeightsWriter.from_source(client, source, transport="auto")
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from awex.meta import Box, Layout, canonical_tensors
from awex.meta.layouts import MegatronParallel, megatron_layout
from awex.meta.models import UnknownModelError, model_dims

ViewOf = Callable[[str, Box], "torch.Tensor | Sequence[tuple[Box, torch.Tensor]]"]


@dataclass(frozen=True)
class TrainerSource:
    layout: Layout
    local_rank: int
    view_of: ViewOf
    refresh: Callable[[], None] | None = None  # recompute derived views before each write (FP8 tiles)

    @classmethod
    def hf(cls, model: torch.nn.Module, instance: str = "trainer", dtype: str | None = None) -> TrainerSource:
        """An HF transformers model held whole by this rank."""
        from awex.convert.hf import hf_views
        from awex.engines.hf import hf_model_layout

        return cls(hf_model_layout(model, "trainer", instance, dtype), 0, hf_views(model))

    @classmethod
    def fsdp(cls, model: torch.nn.Module, instance: str = "trainer", dtype: str | None = None) -> TrainerSource:
        """An FSDP2 (``fully_shard``) model: each rank's local DTensor shards are its boxes, nothing gathered."""
        from awex.engines.fsdp import dtensor_local_rank, dtensor_model_layout, dtensor_views

        return cls(dtensor_model_layout(model, instance, dtype), dtensor_local_rank(model), dtensor_views(model))

    @classmethod
    def lora(
        cls,
        model: torch.nn.Module,
        adapters: str | Sequence[str] | Mapping[str, str],
        instance: str = "trainer",
    ) -> TrainerSource:
        """A PEFT LoRA model's adapters alone (whole, or FSDP2-sharded): ``adapters`` is the name the model's one
        adapter is served under, a list of its adapters, or ``{peft_name: served_name}`` (``awex.engines.lora``).
        Each write sends B times its scale, recomputed by ``refresh``."""
        from awex.engines.lora import lora_source_parts

        layout, local_rank, view_of, refresh = lora_source_parts(model, adapters, instance)
        return cls(layout, local_rank, view_of, refresh)

    @classmethod
    def megatron(
        cls,
        model: torch.nn.Module | Sequence[torch.nn.Module],
        config: Mapping[str, Any],
        parallel: MegatronParallel | None = None,
        instance: str = "trainer",
        dtype: str | None = None,
    ) -> TrainerSource:
        """This rank of a Megatron-core ``GPTModel`` job (``torch.distributed`` and ``parallel_state`` initialised;
        ``model``: its chunks under virtual pipeline parallelism). Its sizes are read from the job; ``parallel``,
        if given, must agree (:func:`awex.engines.megatron_job.megatron_parallel`). Its sync identity is its global
        rank."""
        try:  # before anything of the job is read: a model without a table is refused first
            dims = model_dims(config, dtype)
        except UnknownModelError as e:
            raise UnknownModelError(
                f"{e}. A Megatron-core trainer needs Awex's table of its architecture (Megatron's fused and split "
                "tensors have no other description here); HF and FSDP2 trainers sync any model, and vLLM receivers "
                "learn their layout from vLLM's loaders"
            ) from None
        import torch.distributed as dist
        from megatron.core import parallel_state

        from awex.convert import MegatronNames, megatron_views
        from awex.engines.megatron_job import megatron_parallel

        parallel = megatron_parallel(model, config, parallel)
        layout = megatron_layout(canonical_tensors(dims), parallel, instance=instance)
        where = MegatronNames(
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_pipeline_model_parallel_rank(),
            parallel,
            ep_rank=parallel_state.get_expert_model_parallel_rank() if parallel.ep > 1 else 0,
        )
        return cls(layout, dist.get_rank(), megatron_views(model, dims, where))
