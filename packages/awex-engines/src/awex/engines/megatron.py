"""Megatron-core trainer source: a :class:`~awex.engines.writer.WeightsWriter` for one rank of a GPTModel job.

    writer = megatron_writer(client, model, config)     # sizes read from parallel_state and the model
    writer.write("step-3", destinations=["vllm-0"])      # on every Megatron rank

Every rank sends only what it holds; data-parallel replicas share the load through the planner. The job's sizes
(TP, PP, VPP, CP, EP, expert TP, DP), its uneven pipeline stages and its padded vocabulary are read from Megatron's
``parallel_state`` and the model (:func:`megatron_parallel`); sizes given by hand are checked against them. The
rank's coordinates come from ``parallel_state``; its sync identity is ``(instance, global rank)``.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from awex.engines.megatron_job import ParallelMismatchError, megatron_parallel
from awex.engines.source import TrainerSource
from awex.engines.writer import WeightsWriter
from awex.meta.client import MetaClient
from awex.meta.layouts import MegatronParallel

__all__ = ["ParallelMismatchError", "megatron_parallel", "megatron_writer"]


def megatron_writer(
    client: MetaClient,
    model: torch.nn.Module | Sequence[torch.nn.Module],
    config: Mapping[str, Any],
    parallel: MegatronParallel | None = None,
    *,
    instance: str = "trainer",
    dtype: str | None = None,
    **writer_options: Any,
) -> WeightsWriter:
    """A writer for this Megatron rank (``torch.distributed`` and ``parallel_state`` must be initialised):
    ``WeightsWriter.from_source(client, TrainerSource.megatron(...))``. ``parallel``: optional, checked against
    the job (:func:`megatron_parallel`)."""
    source = TrainerSource.megatron(model, config, parallel, instance=instance, dtype=dtype)
    return WeightsWriter.from_source(client, source, **writer_options)
