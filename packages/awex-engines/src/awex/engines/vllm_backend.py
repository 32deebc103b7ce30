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

Each worker builds its layout from vLLM's own model and parallel config (``awex.meta.layouts.vllm``) and, when
it starts, routes every canonical tensor it holds (``awex.engines.vllm_params``):

- **in place** (the default, ``receive="in_place"``): boxes land directly in the storage of vLLM's live
  parameters (fused ``qkv_proj`` / ``gate_up_proj``, padded vocabulary, MoE experts; ``awex.convert.vllm``). No
  staging copy of the shard, no full-size temporary, no loader call; the extra memory is the transport's wave
  staging (about twice the writer's ``wave_bytes``; over CUDA IPC none on the trainer's GPU, up to 512 MiB of
  bounce ring reading another GPU). A sync that fails part-way leaves the
  engine with partly new weights: it reports no consistent version until the next successful sync.
- **through vLLM's loaders**: only the modules vLLM transformed after loading (vLLM-CPU's prepacked linears and
  MoE experts, quantisation methods that repack) receive into staging, and are loaded one module at a time
  inside a layerwise reload (``initialize_layerwise_reload`` ... ``finalize_layerwise_reload`` on that module).
- ``receive="staged"``: everything arrives in staging first, and is applied once the whole version has arrived:
  copied into the live parameters where they take it in place, through vLLM's loaders elsewhere (all of it, where a
  parameter does not match what Awex computes). A failed transfer then leaves the model untouched (the previous
  version keeps serving), at the cost of a staging copy of the rank's whole shard (plus one full-size tensor at a
  time for what goes through the loaders). With ``stage=True`` in the update info
  the version is received on a thread while the engine keeps generating, and applied (or dropped) by a second
  ``update_weights`` with ``commit=True`` (``False``), which the trainer sends once every rank of every engine
  holds the whole version, after pausing them (``awex.engines.staged_version``, ``awex.engines.vllm_sender``).

After each version the worker logs how many tensors and bytes went each way and publishes it, with the peak
extra memory the sync took in this process (measured, ``awex.engines.memory``), at
``received/<version>/<instance>:<rank>`` on the MetaServer (:class:`ReceiveReport`). ``shutdown()`` closes the
reader: memory opened over CUDA IPC is released before the trainer may free it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from awex.convert.live import LiveTensors
from awex.convert.vllm import vllm_param_dtypes, vllm_param_shapes, vllm_views
from awex.engines.memory import PeakMemory
from awex.engines.reader import WeightsReader
from awex.engines.receive_report import ReceiveReport, publish_report
from awex.engines.staged_version import DROP_WAIT_SECONDS, StagedVersion
from awex.engines.staging import Staging, StagingBuffers, check_staging, shard_bytes, transport_device
from awex.engines.staging import commit as commit_staged
from awex.engines.sync import keys
from awex.engines.vllm_fixups import (
    check_cpu_moe_reloadable,
    check_mla_reloadable,
    refresh_cpu_moe_experts,
    refresh_tied_lm_head,
)
from awex.engines.vllm_learned import LearnedLayout, learn_vllm_layout, learned_views
from awex.engines.vllm_params import Destinations, route, transformed_reason
from awex.meta import Box, Fp8BlockQuant
from awex.meta.client import MetaClient
from awex.meta.errors import AwexValueError
from awex.meta.layouts import VllmParallel, vllm_engine_layout
from awex.meta.models import model_dims, table_architecture
from awex.transport import LocalShards
from awex.transport.shards import torch_dtype

log = logging.getLogger("awex.engines.vllm")


@dataclass
class AwexInitInfo(WeightTransferInitInfo):
    """Where the MetaServer is and which instance this engine is."""

    meta_address: str
    instance: str = "vllm"
    job: str = "default"
    token: str | None = None
    timeout: float = 300.0
    receive: str = "in_place"  # or "staged": receive everything first, then load (atomic, a shard's memory more)
    layout: str = "auto"  # "table", "learned" (from vLLM's loaders), or "auto": the table where there is one
    staging_budget_bytes: int | None = None  # staged: the most staging may hold; a larger shard receives in place
    staging: str = "device"  # staged: where the version is held, "device" or "host" (pinned; awex.engines.staging)
    lora: dict[str, int] | None = None  # receive LoRA adapters, {served name: lora_int_id} (awex.engines.vllm_lora)


@dataclass
class AwexUpdateInfo(WeightTransferUpdateInfo):
    """Which weight version to receive, and optionally a checkpoint to validate it against."""

    version: str
    timeout: float | None = None
    validate: str | None = None  # HF safetensors checkpoint: compare every received tensor with it
    strict: bool = False  # with validate: a mismatch is an error and the version is not applied
    stage: bool = False  # receive="staged": receive on a thread while the engine generates, apply on the word below
    commit: bool | None = None  # the trainer's word on the version staged: apply it (True) or drop it (False)


def _vllm_parallel(vllm_config) -> VllmParallel:
    pc = vllm_config.parallel_config
    return VllmParallel(
        tp=pc.tensor_parallel_size,
        pp=pc.pipeline_parallel_size,
        dp=pc.data_parallel_size,
        ep=bool(getattr(pc, "enable_expert_parallel", False)),
    )


def engine_layout(vllm_config, instance: str):
    """The canonical layout of a vLLM engine from its own config (FP8 block-quantised checkpoints included)."""
    model_config = vllm_config.model_config
    dtype = str(model_config.dtype).removeprefix("torch.")
    return vllm_engine_layout(model_config.hf_config.to_dict(), dtype, _vllm_parallel(vllm_config), instance=instance)


class AwexWeightTransferEngine(WeightTransferEngine[AwexInitInfo, AwexUpdateInfo]):
    """vLLM worker side of an Awex sync (one per worker process)."""

    init_info_cls = AwexInitInfo
    update_info_cls = AwexUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.reader: WeightsReader | None = None
        self.destinations: Destinations | None = None
        self.last_report: ReceiveReport | None = None
        self.learned: LearnedLayout | None = None  # the layout learned from vLLM's loaders, where one was
        self.timeout = 300.0
        self._staging: StagingBuffers | None = None
        self._bytes = (0, 0)  # in place, through the loaders (per version)
        self._tied = False
        self._staged_bytes = 0  # receive buffers of the loader path, kept between versions
        self._mode = "in_place"
        self._pending: StagedVersion | None = None  # a version received while generating, awaiting its word
        self._commit: Destinations | None = None  # staged: how an arrived version is applied (see _route)
        self._live = None  # the live parameters' views (what in-place receives and staged commits write)
        self._after_apply = None  # what a version needs once it is whole in the live tensors (LoRA: the GPU slots)

    def init_transfer_engine(self, init_info: AwexInitInfo) -> None:
        if init_info.receive not in ("in_place", "staged"):
            raise AwexValueError(f"awex backend: receive={init_info.receive!r}; use 'in_place' or 'staged'")
        check_staging(init_info.staging, init_info.staging_budget_bytes, init_info.receive, "awex backend")
        if self.reader is not None:  # set up again (a trainer reconnecting, another job): the old reader goes
            self.shutdown()
        if init_info.layout not in ("auto", "table", "learned"):
            raise AwexValueError(f"awex backend: layout={init_info.layout!r}; use 'auto', 'table' or 'learned'")
        pc = self.parallel_config
        local_rank = pc.data_parallel_index * pc.world_size + pc.rank
        client = MetaClient(init_info.meta_address, job=init_info.job, token=init_info.token, timeout=init_info.timeout)
        hf_config = self.model_config.hf_config.to_dict()
        dtype = str(self.model_config.dtype).removeprefix("torch.")
        self._after_apply = None
        if init_info.lora is not None:
            layout, live, tied = self._lora(init_info, local_rank)
        elif init_info.layout == "learned" or (init_info.layout == "auto" and table_architecture(hf_config) is None):
            layout, live, tied = self._learn(client, init_info, local_rank, dtype)
        else:
            layout, live, tied = self._table(init_info, local_rank, hf_config, dtype)
        if init_info.receive == "staged":  # staging within the budget, or in place (said, never silently)
            need = shard_bytes(layout, local_rank)
            staging = Staging.decide(need, init_info.staging_budget_bytes, init_info.staging)
            client.put(keys.staging(init_info.instance, local_rank), staging.record())
            if not staging.staged:
                log.warning(
                    "awex backend: %s rank %d receives in place: %s", init_info.instance, local_rank, staging.reason
                )
                return self.init_transfer_engine(
                    replace(init_info, receive="in_place", staging_budget_bytes=None, staging="device")
                )
        check_mla_reloadable(self.model)  # refuse now what could not be reloaded later
        if self.loaded_through_vllm:
            check_cpu_moe_reloadable(self.model)
        through_loader = set(self.destinations.loader)
        staging = self._staging = StagingBuffers(layout, init_info.staging, self.device)  # kept between versions

        def view_of(name: str, box: Box) -> torch.Tensor:
            return staging(name, box) if name in through_loader else live(name, box)

        # staging never moves: the views move where live's do (re-pointed where none is staged: its buffers lie in
        # none of live's tensors, so views are derived again where some are)
        for attr in ("fingerprint", "addresses", "forms", "sources"):
            if callable(getattr(live, attr, None)):
                setattr(view_of, attr, getattr(live, attr))
        self.timeout, self._mode, self._live = init_info.timeout, init_info.receive, live
        lora_in_place = init_info.lora is not None and init_info.receive == "in_place"  # vLLM holds adapters on host
        where = transport_device("host" if lora_in_place else init_info.staging, self.device)  # the GPU copies there
        self.reader = WeightsReader(client, layout, local_rank, view_of, timeout=init_info.timeout, device=where)
        shards = self.reader.shards
        nbytes = {name: sum(view.nbytes for _, view in shards.pairs(name)) for name in shards.names()}
        self._bytes = (
            sum(nbytes[n] for n in self.destinations.in_place),
            sum(nbytes[n] for n in self.destinations.loader),
        )
        self._tied = tied
        self._staged_bytes = staging.nbytes
        log.info("awex backend ready: %s rank %d: %s", layout.instance, local_rank, self.destinations.summary())

    def _table(self, init_info: AwexInitInfo, local_rank: int, hf_config: dict, dtype: str):
        """The layout and views from Awex's table of the architecture (``UnknownModelError`` without one)."""
        layout = engine_layout(self.vllm_config, init_info.instance)
        dims = model_dims(hf_config, dtype)
        parallel = _vllm_parallel(self.vllm_config)
        quant = Fp8BlockQuant.from_hf_config(hf_config)
        pc = self.parallel_config
        tp_rank, pp_rank, dp_rank = pc.rank % parallel.tp, pc.rank // parallel.tp, pc.data_parallel_index
        shapes = vllm_param_shapes(dims, parallel, tp_rank, pp_rank, quant=quant, dp_rank=dp_rank)
        self.destinations = self._route(
            init_info.receive,
            self.model,
            sorted(layout.rank_boxes(local_rank)),
            dims.tie_embeddings,
            shapes,
            vllm_param_dtypes(shapes, dtype, quant, dims.architecture),
        )
        live = vllm_views(
            LiveTensors(self.model, buffers=False),  # where each parameter is at each call (it may be re-allocated)
            dims,
            parallel,
            fp8_block=quant.block if quant else (128, 128),
            tp_rank=tp_rank,
            dp_rank=dp_rank,
        )
        return layout, live, dims.tie_embeddings

    def _route(self, receive: str, *args, **kwargs) -> Destinations:
        """Where each tensor lands for ``receive``; staged, also how a version is applied once it arrived
        (``self._commit``: copied into the live parameters where they take it in place, through the loaders
        elsewhere; all through the loaders where a parameter does not match what Awex computes)."""
        self._commit = None
        if receive == "in_place":
            return route(*args, in_place=True, **kwargs)
        try:
            self._commit = route(*args, in_place=True, **kwargs)
        except ValueError as e:
            log.info("awex backend: a staged version is applied through vLLM's loaders alone: %s", e)
        return route(*args, in_place=False, **kwargs)

    def _lora(self, init_info: AwexInitInfo, local_rank: int):
        """The LoRA adapters the engine serves (``awex.engines.vllm_lora``): each version lands in the adapters'
        tensors, then in their GPU slots."""
        from awex.engines.vllm_lora import lora_receiver

        world = _vllm_parallel(self.vllm_config).world_size
        layout, live, self._after_apply = lora_receiver(self.model, init_info.lora, init_info.instance, world)
        names = [t.spec.name for t in layout.tensors]
        staged = init_info.receive == "staged"
        self._commit = Destinations(in_place=names) if staged else None
        self.destinations = Destinations(loader=names) if staged else Destinations(in_place=names)
        return layout, live, False

    def _learn(self, client: MetaClient, init_info: AwexInitInfo, local_rank: int, dtype: str):
        """The layout and views learned from vLLM's own loaders (``awex.engines.vllm_learned``)."""
        hf_config = self.model_config.hf_config
        self.learned = learn_vllm_layout(
            self.model,
            hf_config,
            dtype,
            client,
            init_info.instance,
            local_rank,
            _vllm_parallel(self.vllm_config).world_size,
            self.device,
            init_info.timeout,
            tolerate_loader_errors=any(transformed_reason(m) for m in self.model.modules()),
            vllm_config=self.vllm_config,
        )
        layout = self.learned.layout
        self.destinations = self._route(
            init_info.receive,
            self.model,
            sorted(layout.rank_boxes(local_rank)),
            False,
            native=self.learned.native,
            forced=self.learned.loader,
        )
        live = learned_views(LiveTensors(self.model, buffers=False), self.learned)
        return layout, live, bool(getattr(hf_config, "tie_word_embeddings", False))

    @property
    def loaded_through_vllm(self) -> list[str]:
        """The tensors a version's apply step loads through vLLM's loaders (staged: those its commit cannot copy)."""
        dest = self._commit if self._commit is not None else self.destinations
        return [] if dest is None else list(dest.loader)

    def start_weight_update(self) -> None:
        """Nothing to prepare: in-place tensors land as they arrive, loader tensors are loaded after."""
        if self.reader is None:
            raise RuntimeError("awex backend: call init_weight_transfer_engine first")
        self._drop_pending("a new weight update began")

    def receive_weights(self, update_info: AwexUpdateInfo) -> None:
        """Receive a version (and apply it); with ``stage`` (``receive="staged"``) start receiving it on a thread and
        return at once, the engine generating meanwhile (``awex.engines.staged_version``); with ``commit`` apply
        (``True``) or drop (``False``) the version so staged."""
        if self.reader is None:
            raise RuntimeError("awex backend: call init_weight_transfer_engine first")
        pending = self._pending
        if update_info.commit is not None:
            if pending is None or pending.version != update_info.version:
                held = "none" if pending is None else repr(pending.version)
                raise AwexValueError(
                    f"awex backend: no staged version {update_info.version!r} to decide on (staged: {held})"
                )
            self._pending = None
            pending.decide(update_info.commit, timeout=self.reader.timeout)
            return
        if pending is not None:
            raise RuntimeError(
                f"awex backend: version {pending.version!r} is staged and not yet applied or dropped; "
                f"{update_info.version!r} cannot be received before the trainer decides on it"
            )
        if update_info.timeout:
            self.reader.timeout = update_info.timeout
        if not update_info.stage:
            self._receive(update_info, None)
            return
        if self._mode != "staged":
            raise AwexValueError(
                "awex backend: stage=True receives while the engine generates into staging, which needs "
                f"receive='staged' (this engine receives {self._mode!r})"
            )
        reader, version = self.reader, update_info.version
        where = keys.staged(version, reader.layout.instance, reader.local_rank)
        self._pending = StagedVersion(
            version,
            lambda gate: self._receive(update_info, gate),
            lambda: reader.client.put(where, {"version": version}),
        )
        self._pending.start(reader.timeout)

    def _drop_pending(self, why: str) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            log.warning("awex backend: %s while %s was staged: dropped", why, pending.version)
            try:  # a receive still waiting for bytes ends at its own deadline (or when the reader closes)
                pending.decide(False, timeout=DROP_WAIT_SECONDS)
            except TimeoutError as e:
                log.error("%s", e)

    def _receive(self, update_info: AwexUpdateInfo, before_apply) -> None:
        dest = self.destinations
        started = time.monotonic()
        apply = self._apply_staged if dest.loader else self._apply_in_place if self._after_apply else None
        with PeakMemory(self.device) as peak:
            self.reader.receive(
                update_info.version,
                apply=apply,
                validate=update_info.validate,
                strict=update_info.strict,
                in_place=bool(dest.in_place),
                before_apply=before_apply,
            )
        report = ReceiveReport(
            update_info.version,
            self.reader.layout.instance,
            self.reader.local_rank,
            len(dest.in_place),
            self._bytes[0],
            len(dest.loader),
            self._bytes[1],
            round(time.monotonic() - started, 6),
            peak.extra_bytes,
            self.reader.held_bytes() + self._staged_bytes,
        )
        self.last_report = report
        log.info(
            "awex backend: %s:%d received %s: %d tensors (%d bytes) in place, %d (%d bytes) through vLLM's "
            "loaders, %.3f s, peak extra memory %s bytes",
            report.instance,
            report.rank,
            report.version,
            report.in_place_tensors,
            report.in_place_bytes,
            report.loader_tensors,
            report.loader_bytes,
            report.seconds,
            report.peak_extra_bytes,
        )
        publish_report(self.reader.client, report, log)

    def _apply_in_place(self, shards: LocalShards) -> None:
        """In place, once the whole version landed and before its outcome goes out: what it still needs (LoRA: the
        adapters' GPU slots). A failure here fails the version, the weights changed."""
        self._after_apply()

    def _apply_staged(self, shards: LocalShards) -> None:
        """Apply what arrived in staging: copied into the live parameters where they take it in place (the staged
        version's commit is then a copy), through vLLM's loaders elsewhere."""
        commit = self._commit
        if commit is None:
            self._load_through_vllm(shards, self.destinations)
            return
        commit_staged(shards, commit.in_place, self._live, self.device)
        if commit.loader:
            self._load_through_vllm(shards, commit)
        if self._after_apply is not None:
            self._after_apply()

    def _load_through_vllm(self, shards: LocalShards, dest: Destinations) -> None:
        """Load the tensors ``dest`` routes through vLLM's loaders, one module at a time (a layerwise
        reload of that module: its loaders re-run its post-loading processing, e.g. prepacking)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        layout = self.reader.layout
        by_module: dict[str, list[str]] = {}
        for name in dest.loader:
            by_module.setdefault(dest.unit[name], []).append(name)
        modules = dict(self.model.named_modules())
        for module_name, names in by_module.items():
            module = modules[module_name]
            initialize_layerwise_reload(module)
            try:
                for name in names:
                    spec = layout.tensor(name).spec
                    full = torch.zeros(spec.shape, dtype=torch_dtype(spec.dtype), device=self.device)
                    for box, view in shards.pairs(name):
                        full[box.slices()] = view
                    self.model.load_weights([(name, full)])
                    del full
            finally:
                finalize_layerwise_reload(module, self.model_config)
        refresh_tied_lm_head(self.model)
        refresh_cpu_moe_experts(self.model, set(by_module))

    def finish_weight_update(self) -> None:
        """Loading finished in ``update_weights``; a version still staged without a decision is dropped."""
        self._drop_pending("the weight update finished without a decision")

    def shutdown(self) -> None:
        """Close the reader (releases staging and memory opened over CUDA IPC); the engine keeps its weights."""
        self._drop_pending("the weight transfer engine shut down")
        if self.reader is not None:
            self.reader.close()
        self.reader = None
        self._staging = None
