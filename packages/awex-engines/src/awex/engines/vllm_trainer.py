"""vLLM's trainer-side weight-transfer API, backend ``awex``: an RL loop written against vLLM's API switches to
Awex by the backend name.

    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from awex.engines.vllm_trainer import AwexTrainerInitInfo

    engine = WeightTransferTrainerFactory.trainer_init(
        AwexTrainerInitInfo(rank=rank, meta_address=server.address, instances=("vllm-0",), pause="keep"),
        client=HTTPVLLMWeightSyncClient("http://vllm-0:8000"), source=ModuleSource(model))
    for step in ...:
        train_step()
        engine.send_weights()                                  # on every trainer rank

``source``: vLLM's ``ModuleSource``, any HF ``nn.Module`` (FSDP2-sharded ones too), or a
:class:`~awex.engines.source.TrainerSource` (``TrainerSource.megatron(...)`` for Megatron-core ranks).

Every trainer rank sends its own shards (no gather, nothing through rank 0): each builds a ``WeightsWriter`` over its
views. Rank 0 (the sender) also drives each vLLM engine through vLLM's client (``awex.engines.vllm_sender``): it pauses
generation (``pause``: ``keep``, ``abort``, ``wait`` or ``none``; caches cleared), then runs ``start_weight_update`` and
``update_weights`` concurrently with the writers, ``finish_weight_update`` and resumes. With ``receive="staged"`` the
engines receive each version into staging while they keep generating, and are paused only once every rank of every
engine holds it whole, for the commit (``update_weights`` with ``commit=True``: the load step), then resumed; a version
that fails before that is dropped (``commit=False``) with no pause and nothing changed. A version counts as applied only
when every engine's update call succeeded *and* every receiving rank of every engine published its receive report
(``received/<version>/<instance>:<rank>``); the sender then publishes the verdict and every other trainer rank waits for
it, so all trainer ranks return, or raise :class:`~awex.engines.errors.SyncFailedError`, alike.
:attr:`AwexTrainerEngine.last_stalls` says what the version cost each engine's generation (pause, sync and stall
seconds).

Several engines: pass ``instances`` with one name each and ``client`` as ``{instance: client}`` (or one
``RayVLLMWeightSyncClient`` over as many actor handles as ``instances`` names).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping, Sequence

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, TrainerInitInfo, TrainerWeightTransferEngine, WeightSource

from awex.engines.errors import SyncFailedError
from awex.engines.lora import check_adapters
from awex.engines.pause import VersionStall, check_pause_mode, pauser_for
from awex.engines.source import TrainerSource
from awex.engines.staging import check_staging
from awex.engines.sync import keys
from awex.engines.sync.options import SyncOptions
from awex.engines.vllm_sender import SLACK, Engine, VersionSender
from awex.engines.writer import WeightsWriter
from awex.meta import Box, Layout, PlanOptions
from awex.meta.client import MetaClient
from awex.meta.errors import AwexValueError
from awex.transport.shards import torch_dtype

__all__ = ["AwexSource", "AwexTrainerEngine", "AwexTrainerInitInfo"]

log = logging.getLogger("awex.engines.vllm")


class AwexSource(WeightSource):
    """What the awex trainer engine sends: this rank's canonical layout and views of its own parameters.

    Not iterated: Awex never materialises full tensors; each rank sends the boxes it holds.
    """

    def __init__(
        self,
        layout: Layout,
        local_rank: int,
        view_of: Callable[[str, Box], torch.Tensor | Sequence[tuple[Box, torch.Tensor]]],
        refresh: Callable[[], None] | None = None,
    ):
        self.layout = layout
        self.local_rank = local_rank
        self.view_of = view_of
        self.refresh = refresh

    @classmethod
    def of(cls, source: TrainerSource) -> AwexSource:
        """The same rank as a :class:`~awex.engines.source.TrainerSource` (``TrainerSource.megatron``, ``.fsdp``,
        ``.hf``)."""
        return cls(source.layout, source.local_rank, source.view_of, source.refresh)

    @classmethod
    def hf(cls, *args: Any, **kwargs: Any) -> AwexSource:
        """An HF transformers model held whole by this rank: :meth:`TrainerSource.hf
        <awex.engines.source.TrainerSource.hf>`'s arguments."""
        return cls.of(TrainerSource.hf(*args, **kwargs))

    @classmethod
    def fsdp(cls, *args: Any, **kwargs: Any) -> AwexSource:
        """An FSDP2 (``fully_shard``) model, each rank's local DTensor shards its boxes: :meth:`TrainerSource.fsdp
        <awex.engines.source.TrainerSource.fsdp>`'s arguments."""
        return cls.of(TrainerSource.fsdp(*args, **kwargs))

    @classmethod
    def lora(cls, *args: Any, **kwargs: Any) -> AwexSource:
        """A PEFT LoRA model's adapters alone: :meth:`TrainerSource.lora <awex.engines.source.TrainerSource.lora>`'s
        arguments (the engines serve the adapters and receive with ``lora=`` in their init info)."""
        return cls.of(TrainerSource.lora(*args, **kwargs))

    @classmethod
    def megatron(cls, *args: Any, **kwargs: Any) -> AwexSource:
        """A Megatron-core ``GPTModel`` rank: the arguments of :meth:`TrainerSource.megatron
        <awex.engines.source.TrainerSource.megatron>` (its sizes and position are read from ``parallel_state``)."""
        return cls.of(TrainerSource.megatron(*args, **kwargs))

    @classmethod
    def from_any(cls, source: Any) -> AwexSource:
        """The source of vLLM's trainer API as Awex sends it: an :class:`AwexSource` or
        :class:`~awex.engines.source.TrainerSource` as it is; vLLM's ``ModuleSource``, or any module with
        ``named_parameters``, as an HF model (held whole, or FSDP2-sharded: its DTensor shards are its boxes)."""
        if isinstance(source, AwexSource):
            return source
        if isinstance(source, TrainerSource):
            return cls.of(source)
        module = getattr(source, "_module", None) if type(source).__name__ == "ModuleSource" else source
        if isinstance(module, torch.nn.Module):
            from torch.distributed.tensor import DTensor

            sharded = any(isinstance(p, DTensor) for p in module.parameters())
            return cls.fsdp(module) if sharded else cls.hf(module)
        raise TypeError(
            f"the awex trainer engine sends an nn.Module (vLLM's ModuleSource, an HF or FSDP2 model) or a "
            f"TrainerSource (TrainerSource.megatron(...) for Megatron-core), not {type(source).__name__}"
        )

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(t.spec.name, torch_dtype(t.spec.dtype), tuple(t.spec.shape)) for t in self.layout.tensors]

    def held_names(self) -> list[str]:
        return sorted(self.layout.rank_boxes(self.local_rank))

    def __iter__(self):
        raise TypeError("AwexSource is not iterated: the awex trainer engine sends each rank's own boxes in place")


def _names(value: Any, what: str) -> tuple[str, ...]:
    items = (value,) if isinstance(value, str) else tuple(value)
    if not all(isinstance(v, str) and v for v in items):
        raise AwexValueError(f"awex: {what} must be non-empty strings, got {value!r}")
    return items


@dataclass(kw_only=True)
class AwexTrainerInitInfo(TrainerInitInfo):
    """Where the MetaServer is, which vLLM engines this trainer updates, and how (checked when made)."""

    backend: ClassVar[str] = "awex"

    meta_address: str
    instances: tuple[str, ...] = ("vllm",)  # the engines' Awex instance names (one per client)
    job: str = "default"
    token: str | None = None
    timeout: float = SyncOptions.timeout  # per version (the writer's options take SyncOptions' defaults, as here)
    wave_bytes: int = SyncOptions.wave_bytes
    transport: str = SyncOptions.transport
    host: str = (
        SyncOptions.host
    )  # where the trainer's sync group and version channel listen: an address every rank reaches
    receive: str = "in_place"  # the engines' receive mode: "in_place", or "staged" (atomic; received while they
    # generate, paused for the commit alone)
    staging_budget_bytes: int | None = None  # staged: the most each engine rank may stage (a larger shard: in place)
    staging: str = "device"  # staged: where the engines hold it, "device" (their GPU) or "host" (pinned host memory)
    version_prefix: str = "step-"  # send_weights() without a version names them step-1, step-2, ...
    pause: str = "keep"  # generation around each version: "keep", "abort", "wait" or "none" (awex.engines.pause)
    allow_cast: tuple[str, ...] = SyncOptions.allow_cast  # globs that may narrow (("*",): fp32 into a bf16 engine)
    delta: bool = SyncOptions.delta  # only the words that changed (transport "p2p" or "ipc"; see WeightsWriter)
    quantize_on_receive: bool | str = SyncOptions.quantize_on_receive  # FP8 engines on its GPUs quantise; or "auto"
    verify: bool = SyncOptions.verify  # engines compare digests of what they got with the trainer's
    hold_trainer_memory: bool = SyncOptions.hold_trainer_memory  # False: the trainer offloads after each version
    lora: dict[str, int] | None = None  # the engines receive LoRA adapters: {served name: lora_int_id} (source: .lora)

    def __post_init__(self) -> None:
        self.instances = _names(self.instances, "instances")
        if len(set(self.instances)) != len(self.instances):
            raise AwexValueError(f"awex: instances {list(self.instances)} name an engine twice")
        self.allow_cast = () if not self.allow_cast else _names(self.allow_cast, "allow_cast patterns")
        check_pause_mode(self.pause)
        if self.receive not in ("in_place", "staged"):
            raise AwexValueError(f"awex: receive={self.receive!r}; use 'in_place' or 'staged'")
        check_staging(self.staging, self.staging_budget_bytes, self.receive)
        try:  # the writer's own rules (awex.engines.sync.options), before any engine is touched
            self.sync_options().check()
        except ValueError as e:
            raise AwexValueError(f"awex: {e}") from None
        if self.lora is not None:
            self.lora = check_adapters(self.lora)
        if not isinstance(self.version_prefix, str) or "/" in self.version_prefix:
            raise AwexValueError(f"awex: version_prefix={self.version_prefix!r}; a string without '/'")

    def sync_options(self) -> SyncOptions:
        """The writer options this carries (unchecked)."""
        return SyncOptions(
            host=self.host,
            wave_bytes=self.wave_bytes,
            timeout=self.timeout,
            transport=self.transport,
            allow_cast=self.allow_cast,
            delta=self.delta,
            quantize_on_receive=self.quantize_on_receive,
            verify=self.verify,
            hold_trainer_memory=self.hold_trainer_memory,
        )


def _split_clients(info: AwexTrainerInitInfo, client: Any) -> dict[str, Any]:
    """``{instance: client}``: a mapping as given (one client per instance), one client for one instance, or one
    Ray client over as many actor handles as instances (split, one handle each)."""
    if isinstance(client, Mapping):
        if set(client) != set(info.instances):
            raise AwexValueError(
                f"awex: one client per instance: instances {list(info.instances)}, clients for {sorted(client)}"
            )
        return dict(client)
    handles = getattr(client, "handles", None) if type(client).__name__ == "RayVLLMWeightSyncClient" else None
    if handles is not None and len(handles) > 1:
        if len(handles) != len(info.instances):
            raise AwexValueError(
                f"awex: the Ray client drives {len(handles)} engines but instances names {len(info.instances)}: "
                "each engine is an Awex instance of its own; pass one name per actor handle in instances"
            )
        return {name: type(client)(h) for name, h in zip(info.instances, handles)}
    if len(info.instances) != 1:
        raise AwexValueError(f"awex: {len(info.instances)} instances need a {{instance: client}} mapping")
    return {info.instances[0]: client}


def _numbered_after(meta: MetaClient, prefix: str) -> int:
    """The highest N of a version ``<prefix>N`` this job applied before (a predecessor of this trainer), else 0."""
    pattern = re.compile(re.escape(keys.applied(prefix)) + r"(\d+)$")
    found = [int(m.group(1)) for k in meta.keys(keys.applied(prefix)) if (m := pattern.match(k))]
    return max(found, default=0)


class AwexTrainerEngine(TrainerWeightTransferEngine[AwexTrainerInitInfo]):
    """Trainer side of the ``awex`` backend (one per trainer rank)."""

    init_info_cls = AwexTrainerInitInfo

    def __init__(
        self,
        *,
        client: Any,
        source: AwexSource,
        is_sender: bool,
        info: AwexTrainerInitInfo,
        writer: WeightsWriter,
        meta: MetaClient,
        sender: VersionSender | None = None,
    ):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info = info
        self.writer = writer
        self.meta = meta
        self.sender = sender
        self.sent = 0  # send_weights calls (alike on every rank)
        self.numbered_after = _numbered_after(meta, info.version_prefix)
        if self.numbered_after:
            log.info(
                "awex: versions of job %r continue after %s%d (applied before this trainer started)",
                info.job,
                info.version_prefix,
                self.numbered_after,
            )
        self.last_stalls: dict[str, VersionStall] = {}  # per engine, of the last version (every trainer rank)
        self._names: set[str] = set()
        self._busy = threading.Lock()

    @classmethod
    def trainer_init(
        cls, init_info: AwexTrainerInitInfo, *, client: Any, source: WeightSource | None = None
    ) -> AwexTrainerEngine:
        awex_source = AwexSource.from_any(source)
        clients = _split_clients(init_info, client)
        sender = None
        if init_info.is_sender:  # refuse an engine that cannot be paused before anything is set up
            engines = [Engine(name, c, pauser_for(c, init_info.pause)) for name, c in clients.items()]
            for e in engines:
                e.pauser.check()
        meta = MetaClient(init_info.meta_address, job=init_info.job, token=init_info.token, timeout=init_info.timeout)
        writer = WeightsWriter.from_source(
            meta,
            TrainerSource(awex_source.layout, awex_source.local_rank, awex_source.view_of, awex_source.refresh),
            **init_info.sync_options().given(),
        )
        if init_info.is_sender:
            sender = VersionSender(
                engines, meta, mode=init_info.pause, staged=init_info.receive == "staged", timeout=init_info.timeout
            )
            for instance, c in clients.items():
                c.init_weight_transfer_engine(
                    {
                        "meta_address": init_info.meta_address,
                        "job": init_info.job,
                        "token": init_info.token,
                        "instance": instance,
                        "timeout": init_info.timeout,
                        "receive": init_info.receive,
                        **(
                            {"staging_budget_bytes": init_info.staging_budget_bytes}
                            if init_info.staging_budget_bytes is not None
                            else {}
                        ),
                        **({"staging": init_info.staging} if init_info.staging != "device" else {}),
                        **({"lora": dict(init_info.lora)} if init_info.lora is not None else {}),
                    }
                )
            # "auto": the receivers may hold FP8 of the bf16 weights (whoever quantises them)
            on_receive = init_info.quantize_on_receive is not False
            options = PlanOptions(allow_cast=init_info.allow_cast, quantize_on_receive=on_receive)
            sender.preflight(awex_source.layout, options, exact=init_info.lora is not None)
        engine = cls(
            client=clients,
            source=awex_source,
            is_sender=init_info.is_sender,
            info=init_info,
            writer=writer,
            meta=meta,
            sender=sender,
        )
        log.info(
            "awex trainer engine ready: rank %d of %s, %d instance(s), pause %r%s",
            awex_source.local_rank,
            awex_source.layout.instance,
            len(clients),
            init_info.pause,
            " (sender)" if engine.is_sender else "",
        )
        return engine

    def send_weights(
        self, version: str | None = None, validate: str | None = None, instances: Sequence[str] | None = None
    ) -> str:
        """Send this rank's shards of a new version to every engine (or to ``instances``); returns the version's name
        once it is applied on every receiving rank, raises :class:`SyncFailedError` otherwise (on every trainer rank
        alike). ``validate``: an HF checkpoint the engines compare every received tensor with (reports at
        ``validation/<version>/``). Call it on every trainer rank, one version at a time."""
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("awex: a version is already in flight on this trainer engine; send one at a time")
        try:
            targets = list(self.info.instances) if instances is None else list(_names(instances, "instances"))
            unknown = sorted(set(targets) - set(self.info.instances))
            if unknown:
                raise AwexValueError(
                    f"awex: unknown engine(s) {unknown}; this trainer updates {list(self.info.instances)}"
                )
            self.sent += 1
            version = version or f"{self.info.version_prefix}{self.numbered_after + self.sent}"
            if version in self._names:
                raise AwexValueError(
                    f"awex: version {version!r} was already sent by this trainer: name each version anew"
                )
            self._names.add(version)
            started = time.monotonic()
            if self.is_sender:
                self.last_stalls = self._lead(version, targets, validate)
            else:
                self.last_stalls = self._follow(version, targets)
            log.info(
                "awex: %s applied on %s in %.3f s%s",
                version,
                ", ".join(targets),
                time.monotonic() - started,
                "".join(
                    f"; {s.instance}: pause {s.pause_seconds:.3f} s, sync {s.sync_seconds:.3f} s, "
                    f"stall {s.stall_seconds:.3f} s"
                    for s in self.last_stalls.values()
                    if s.stall_seconds is not None
                ),
            )
            return version
        finally:
            self._busy.release()

    def _lead(self, version: str, targets: list[str], validate: str | None) -> dict[str, VersionStall]:
        def write() -> None:
            self.writer.write(version, targets)

        try:
            stalls = self.sender.send(version, self.sent, targets, write, validate)
        except SyncFailedError as e:
            self.meta.put(keys.verdict(version, self.sent), {"ok": False, "error": str(e)[:4000]})
            raise
        self.meta.put(keys.verdict(version, self.sent), {"ok": True, "stalls": [s.to_json() for s in stalls.values()]})
        self.meta.put(keys.applied(version), {"ok": True})
        return stalls

    def _follow(self, version: str, targets: list[str]) -> dict[str, VersionStall]:
        wait = self.info.timeout + SLACK
        go = self.meta.get(keys.go(version, self.sent), timeout=wait)
        if not go.get("ok"):
            raise SyncFailedError(version, {}, {"pause": str(go.get("error"))})
        try:
            self.writer.write(version, targets)
        except SyncFailedError:
            raise
        except Exception as e:
            raise SyncFailedError(version, {}, {f"trainer rank {self.source.local_rank}": f"{type(e).__name__}: {e}"})
        verdict = self.meta.get(keys.verdict(version, self.sent), timeout=wait)
        if not verdict.get("ok"):
            raise SyncFailedError(version, {}, {"sender": str(verdict.get("error"))})
        stalls = {}
        for s in verdict.get("stalls", []):
            stalls[s["instance"]] = VersionStall(
                s["version"], s["instance"], s["mode"], s["pause_seconds"], s["sync_seconds"], s["stall_seconds"]
            )
        return stalls

    def abort_weight_update(self, resume: bool = False) -> list[str]:
        """Give up on a version that failed after changing an engine's weights in place (those engines stay paused,
        naming ``awex-failed:<version>``): with ``resume=True`` they generate again on the weights they hold, a mix
        of two versions; otherwise they stay paused until the next version applies. Returns the engines still
        paused. A version in flight is not interrupted: its own deadline ends it. Sender only (others: ``[]``)."""
        return self.sender.abort(resume) if self.sender is not None else []

    @property
    def paused_engines(self) -> list[str]:
        """The engines a failed version left paused (sender; ``[]`` on the other ranks)."""
        return sorted(self.sender.left_paused) if self.sender is not None else []

    def shutdown(self) -> None:
        self.writer.close()


from awex.engines.vllm_plugin import register  # noqa: E402

register()
