"""Megatron-core trainer source: a :class:`~awex.engines.writer.WeightsWriter` for one rank of a GPTModel job.

    writer = megatron_writer(client, model, config, MegatronParallel(tp=2, pp=2, dp=2))
    writer.write("step-3", destinations=["vllm-0"])      # on every Megatron rank

Every rank sends only what it holds; data-parallel replicas share the load through the planner. The rank's
coordinates come from Megatron's ``parallel_state``; its sync identity is ``(instance, global rank)``.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from awex.convert import MegatronNames, megatron_views
from awex.engines.writer import WeightsWriter
from awex.meta import canonical_tensors
from awex.meta.client import MetaClient
from awex.meta.layouts import MegatronParallel, megatron_layout
from awex.meta.models import model_dims


def megatron_writer(
    client: MetaClient,
    model: torch.nn.Module | Sequence[torch.nn.Module],
    config: Mapping[str, Any],
    parallel: MegatronParallel,
    *,
    instance: str = "trainer",
    dtype: str | None = None,
    **writer_options: Any,
) -> WeightsWriter:
    """A writer for this Megatron rank (``torch.distributed`` and ``parallel_state`` must be initialised)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    dims = model_dims(config, dtype)
    layout = megatron_layout(canonical_tensors(dims), parallel, instance=instance)
    where = MegatronNames(
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel,
        ep_rank=parallel_state.get_expert_model_parallel_rank() if parallel.ep > 1 else 0,
    )
    return WeightsWriter(client, layout, dist.get_rank(), megatron_views(model, dims, where), **writer_options)
