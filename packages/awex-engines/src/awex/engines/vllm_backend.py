"""vLLM binding: a weight-transfer backend named ``awex`` for vLLM's native weight-transfer API.

    from vllm import LLM
    from vllm.config import WeightTransferConfig

    llm = LLM(model=..., weight_transfer_config=WeightTransferConfig(backend="awex"))
    llm.init_weight_transfer_engine({"init_info": {"meta_address": server.address, "job": "grpo",
                                                   "instance": "vllm-0"}})
    # per step, while the trainer's WeightsWriter.write("step-7", ["vllm-0"]) runs:
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": "step-7"}})
    llm.finish_weight_update(weight_version="step-7")

The backend is registered in every vLLM process by the ``vllm.general_plugins`` entry point of awex-engines
(lazily, by module path: nothing of Awex is imported until the backend is used).

Each worker builds its layout from vLLM's own model and parallel config (``awex.meta.layouts.vllm``), receives
its boxes of each canonical tensor from the trainer ranks that hold them, and loads them through vLLM's weight
loaders inside a layerwise reload (``initialize_layerwise_reload`` ... ``finalize_layerwise_reload``). That path
works whatever form vLLM keeps its parameters in (CPU-prepacked linears, quantized layers). Everything is
received before anything is loaded: a failed transfer leaves the model untouched, serving the previous
version. The loader path hands vLLM a full-shape tensor per canonical tensor in which only this rank's boxes
are filled (vLLM's loader reads only those); an in-place path for plain parameters comes with the GPU work.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from awex.meta import Box
from awex.meta.client import MetaClient
from awex.meta.layouts import VllmParallel, vllm_engine_layout
from awex.transport import LocalShards
from awex.transport.shards import torch_dtype

from awex.engines.reader import WeightsReader
from awex.engines.vllm_fixups import check_cpu_moe_reloadable, refresh_cpu_moe_experts, refresh_tied_lm_head

log = logging.getLogger("awex.engines.vllm")


@dataclass
class AwexInitInfo(WeightTransferInitInfo):
    """Where the MetaServer is and which instance this engine is."""

    meta_address: str
    instance: str = "vllm"
    job: str = "default"
    token: str | None = None
    timeout: float = 300.0


@dataclass
class AwexUpdateInfo(WeightTransferUpdateInfo):
    """Which weight version to receive, and optionally a checkpoint to validate it against."""

    version: str
    timeout: float | None = None
    validate: str | None = None  # HF safetensors checkpoint: compare every received tensor with it
    strict: bool = False  # with validate: a mismatch is an error and the version is not applied


def engine_layout(vllm_config, instance: str):
    """The canonical layout of a vLLM engine from its own config (FP8 block-quantised checkpoints included)."""
    model_config = vllm_config.model_config
    pc = vllm_config.parallel_config
    dtype = str(model_config.dtype).removeprefix("torch.")
    parallel = VllmParallel(tp=pc.tensor_parallel_size, pp=pc.pipeline_parallel_size,
                            dp=pc.data_parallel_size, ep=bool(getattr(pc, "enable_expert_parallel", False)))
    return vllm_engine_layout(model_config.hf_config.to_dict(), dtype, parallel, instance=instance)


class AwexWeightTransferEngine(WeightTransferEngine[AwexInitInfo, AwexUpdateInfo]):
    """vLLM worker side of an Awex sync (one per worker process)."""

    init_info_cls = AwexInitInfo
    update_info_cls = AwexUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.reader: WeightsReader | None = None
        self.timeout = 300.0

    def init_transfer_engine(self, init_info: AwexInitInfo) -> None:
        pc = self.parallel_config
        local_rank = pc.data_parallel_index * pc.world_size + pc.rank
        layout = engine_layout(self.vllm_config, init_info.instance)
        check_cpu_moe_reloadable(self.model)  # refuse now what could not be reloaded in place later
        client = MetaClient(init_info.meta_address, job=init_info.job, token=init_info.token,
                            timeout=init_info.timeout)
        self.timeout = init_info.timeout
        staging = {}

        def view_of(name: str, box: Box) -> torch.Tensor:
            t = staging[(name, box)] = torch.empty(box.sizes, dtype=torch_dtype(layout.tensor(name).spec.dtype),
                                                   device=self.device)
            return t

        self.reader = WeightsReader(client, layout, local_rank, view_of, timeout=init_info.timeout)
        log.info("awex backend ready: %s rank %d, %d canonical tensors", layout.instance, local_rank,
                 len(layout.rank_boxes(local_rank)))

    def start_weight_update(self) -> None:
        """Nothing to prepare: loading starts only after every byte of the version has arrived."""
        if self.reader is None:
            raise RuntimeError("awex backend: call init_weight_transfer_engine first")

    def receive_weights(self, update_info: AwexUpdateInfo) -> None:
        if self.reader is None:
            raise RuntimeError("awex backend: call init_weight_transfer_engine first")
        if update_info.timeout:
            self.reader.timeout = update_info.timeout
        self.reader.receive(update_info.version, apply=self._load_through_vllm, validate=update_info.validate,
                            strict=update_info.strict)

    def _load_through_vllm(self, shards: LocalShards) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        layout = self.reader.layout
        initialize_layerwise_reload(self.model)
        try:
            for name in shards.names():
                spec = layout.tensor(name).spec
                full = torch.zeros(spec.shape, dtype=torch_dtype(spec.dtype), device=self.device)
                for box, view in shards.pairs(name):
                    full[box.slices()] = view
                self.model.load_weights([(name, full)])
        finally:
            finalize_layerwise_reload(self.model, self.model_config)
        refresh_tied_lm_head(self.model)
        refresh_cpu_moe_experts(self.model)

    def finish_weight_update(self) -> None:
        """Loading finished in ``update_weights``; nothing is deferred."""

    def shutdown(self) -> None:
        self.reader = None
