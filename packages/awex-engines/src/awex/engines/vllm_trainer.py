"""vLLM's trainer-side weight-transfer API, backend ``awex``: an RL loop written against vLLM's API switches to
Awex by the backend name.

    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from awex.engines.vllm_trainer import AwexSource, AwexTrainerInitInfo

    source = AwexSource.megatron(model, dims, where)          # or .fsdp(model) / .hf(model)
    engine = WeightTransferTrainerFactory.trainer_init(
        AwexTrainerInitInfo(rank=rank, meta_address=server.address, instances=("vllm-0",)),
        client=HTTPVLLMWeightSyncClient("http://vllm-0:8000"), source=source)
    for step in ...:
        train_step()
        engine.send_weights()                                  # on every trainer rank

Every trainer rank sends its own shards (no gather, nothing through rank 0): each builds a ``WeightsWriter``
over its views. Rank 0 (the sender) also drives each vLLM engine through vLLM's client, concurrently with the
writers: ``start_weight_update``, ``update_weights`` (the backend receives while the writers send), then
``finish_weight_update``. A version counts as applied only when every engine's update call succeeded *and* every
receiving rank of every engine published its receive report (``received/<version>/<instance>:<rank>``); the
sender then publishes the verdict at ``applied/<version>`` and every other trainer rank waits for it, so all
trainer ranks return, or raise, alike.

Several engines: pass ``instances`` with one name each and ``client`` as ``{instance: client}``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping, Sequence

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, TrainerInitInfo, TrainerWeightTransferEngine, WeightSource

from awex.engines import keys
from awex.engines.source import TrainerSource
from awex.engines.writer import WeightsWriter
from awex.meta import Box, Layout
from awex.meta.client import MetaClient
from awex.transport.shards import torch_dtype

log = logging.getLogger("awex.engines.vllm")

SLACK = 30.0  # seconds an engine's update call may outlive the sync's deadline (its own HTTP/RPC round trip)


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
    def hf(cls, model: torch.nn.Module, instance: str = "trainer") -> AwexSource:
        """An HF transformers model held whole by this rank."""
        return cls.of(TrainerSource.hf(model, instance))

    @classmethod
    def fsdp(cls, model: torch.nn.Module, instance: str = "trainer") -> AwexSource:
        """An FSDP2 (``fully_shard``) model: each rank's local DTensor shards are its boxes."""
        return cls.of(TrainerSource.fsdp(model, instance))

    @classmethod
    def megatron(cls, model, dims, names, rank: int, instance: str = "trainer") -> AwexSource:
        """A Megatron-core ``GPTModel`` rank from its ``awex.convert.MegatronNames`` (TP/PP/EP position and parallel
        sizes) and its rank in the trainer's world (``TrainerSource.megatron`` reads both from ``parallel_state``)."""
        from awex.convert import megatron_views
        from awex.meta import canonical_tensors
        from awex.meta.layouts import megatron_layout

        layout = megatron_layout(canonical_tensors(dims), names.parallel, instance=instance)
        return cls(layout, rank, megatron_views(model, dims, names))

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(t.spec.name, torch_dtype(t.spec.dtype), tuple(t.spec.shape)) for t in self.layout.tensors]

    def held_names(self) -> list[str]:
        return sorted(self.layout.rank_boxes(self.local_rank))

    def __iter__(self):
        raise TypeError("AwexSource is not iterated: the awex trainer engine sends each rank's own boxes in place")


@dataclass(kw_only=True)
class AwexTrainerInitInfo(TrainerInitInfo):
    """Where the MetaServer is and which vLLM engines this trainer updates."""

    backend: ClassVar[str] = "awex"

    meta_address: str
    instances: tuple[str, ...] = ("vllm",)  # the engines' Awex instance names (one per client)
    job: str = "default"
    token: str | None = None
    timeout: float = 300.0  # per version
    wave_bytes: int = 256 << 20
    transport: str = "auto"
    host: str = "127.0.0.1"  # where the trainer's sync group and version channel listen: an address every rank reaches
    receive: str = "in_place"  # the engines' receive mode: "in_place" or "staged" (atomic)
    version_prefix: str = "step-"  # send_weights() without a version names them step-1, step-2, ...


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
    ):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info = info
        self.writer = writer
        self.meta = meta
        self.sent = 0

    @staticmethod
    def _clients(info: AwexTrainerInitInfo, client: Any) -> dict[str, Any]:
        if isinstance(client, Mapping):
            missing = sorted(set(info.instances) - set(client))
            if missing or len(client) != len(info.instances):
                raise ValueError(
                    f"awex: one client per instance: instances {list(info.instances)}, clients for {sorted(client)}"
                )
            return dict(client)
        if len(info.instances) != 1:
            raise ValueError(f"awex: {len(info.instances)} instances need a {{instance: client}} mapping")
        return {info.instances[0]: client}

    @classmethod
    def trainer_init(
        cls, init_info: AwexTrainerInitInfo, *, client: Any, source: WeightSource | None = None
    ) -> AwexTrainerEngine:
        if not isinstance(source, AwexSource):
            raise TypeError(
                f"the awex trainer engine needs an AwexSource (layout and views of this rank's "
                f"parameters), got {type(source).__name__}"
            )
        if init_info.receive not in ("in_place", "staged"):
            raise ValueError(f"awex: receive={init_info.receive!r}; use 'in_place' or 'staged'")
        clients = cls._clients(init_info, client)
        meta = MetaClient(init_info.meta_address, job=init_info.job, token=init_info.token, timeout=init_info.timeout)
        writer = WeightsWriter(
            meta,
            source.layout,
            source.local_rank,
            source.view_of,
            wave_bytes=init_info.wave_bytes,
            timeout=init_info.timeout,
            transport=init_info.transport,
            host=init_info.host,
            refresh=source.refresh,
        )
        engine = cls(
            client=clients, source=source, is_sender=init_info.is_sender, info=init_info, writer=writer, meta=meta
        )
        if engine.is_sender:
            for instance, c in clients.items():
                c.init_weight_transfer_engine(
                    {
                        "meta_address": init_info.meta_address,
                        "job": init_info.job,
                        "token": init_info.token,
                        "instance": instance,
                        "timeout": init_info.timeout,
                        "receive": init_info.receive,
                    }
                )
        log.info(
            "awex trainer engine ready: rank %d of %s, %d instance(s)%s",
            source.local_rank,
            source.layout.instance,
            len(clients),
            " (sender)" if engine.is_sender else "",
        )
        return engine

    def send_weights(self, version: str | None = None, validate: str | None = None) -> str:
        """Send this rank's shards of a new version to every engine; returns the version's name once it is
        applied on every receiving rank, raises otherwise (on every trainer rank alike). ``validate``: an HF
        checkpoint the engines compare every received tensor with (reports at ``validation/<version>/``)."""
        self.sent += 1
        version = version or f"{self.info.version_prefix}{self.sent}"
        started = time.monotonic()
        if not self.is_sender:
            self.writer.write(version, self.info.instances)
            verdict = self.meta.get(keys.applied(version), timeout=self.info.timeout + SLACK)
            if not verdict.get("ok"):
                raise RuntimeError(f"version {version!r} was not applied: {verdict.get('error')}")
            return version
        errors: dict[str, BaseException] = {}
        update = {"version": version, "timeout": self.info.timeout, "validate": validate}

        def drive(instance: str, client: Any) -> None:
            try:
                client.start_weight_update()
                client.update_weights(update)
            except BaseException as e:  # reported below, with the instance named
                errors[instance] = e

        threads = [
            threading.Thread(target=drive, args=item, name=f"awex-update-{item[0]}", daemon=True)
            for item in self.client.items()
        ]
        for t in threads:
            t.start()
        try:
            self.writer.write(version, self.info.instances)
        except BaseException as e:
            errors[self.source.layout.instance] = e
        for t in threads:
            t.join(max(0.0, started + self.info.timeout + SLACK - time.monotonic()))
            if t.is_alive():
                errors[t.name.removeprefix("awex-update-")] = TimeoutError(
                    f"update_weights did not return within {self.info.timeout + SLACK:g} s"
                )
        if not errors:
            missing = self._missing_reports(version, max(0.1, started + self.info.timeout - time.monotonic()))
            if missing:
                errors["receivers"] = RuntimeError(f"no receive report from {', '.join(missing[:8])}")
        for instance, c in self.client.items():
            try:
                c.finish_weight_update(weight_version=None if errors else version)
            except BaseException as e:
                errors.setdefault(instance, e)
        if errors:
            error = "; ".join(f"{k}: {type(e).__name__}: {e}" for k, e in errors.items())
            self.meta.put(keys.applied(version), {"ok": False, "error": error[:4000]})
            raise RuntimeError(f"version {version!r} was not applied: {error}")
        self.meta.put(keys.applied(version), {"ok": True})
        log.info(
            "awex: %s applied on %s in %.3f s", version, ", ".join(self.info.instances), time.monotonic() - started
        )
        return version

    def _missing_reports(self, version: str, timeout: float) -> list[str]:
        """The receiving ranks whose report of ``version`` is not on the MetaServer (waiting up to ``timeout``)."""
        deadline = time.monotonic() + timeout
        missing = []
        for instance in self.info.instances:
            world = self.meta.fetch_layout(
                instance, "current", timeout=max(0.1, deadline - time.monotonic())
            ).world_size
            for rank in range(world):
                try:
                    self.meta.get(keys.received(version, instance, rank), timeout=max(0.1, deadline - time.monotonic()))
                except Exception:
                    missing.append(f"{instance}:{rank}")
        return missing

    def shutdown(self) -> None:
        self.writer.close()


from awex.engines.vllm_plugin import register  # noqa: E402

register()
