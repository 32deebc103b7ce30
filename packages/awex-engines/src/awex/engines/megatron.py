"""Megatron-core trainer source: a :class:`~awex.engines.writer.WeightsWriter` for one rank of a GPTModel job.

    writer = megatron_writer(client, model, config, MegatronParallel(tp=2, pp=2, dp=2))
    writer.write("step-3", destinations=["vllm-0"])      # on every Megatron rank

Every rank sends only what it holds; data-parallel replicas share the load through the planner. The rank's
coordinates come from Megatron's ``parallel_state``; its sync identity is ``(instance, global rank)``.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from awex.engines.source import TrainerSource
from awex.engines.writer import WeightsWriter
from awex.meta.client import MetaClient
from awex.meta.layouts import MegatronParallel


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
    """A writer for this Megatron rank (``torch.distributed`` and ``parallel_state`` must be initialised):
    ``WeightsWriter.from_source(client, TrainerSource.megatron(...))``."""
    source = TrainerSource.megatron(model, config, parallel, instance=instance, dtype=dtype)
    return WeightsWriter.from_source(client, source, **writer_options)
