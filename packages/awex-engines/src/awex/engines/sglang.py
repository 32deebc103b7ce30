"""SGLang binding: SGLang's TP workers receive each version in place, through SGLang's own weight-update API.

Start SGLang with Awex's receive function allowed as a custom weight loader::

    python -m sglang.launch_server --model-path MODEL --tp-size 4 \\
        --custom-weight-loader awex.engines.sglang.receive_weights

Per version, while every trainer rank's ``WeightsWriter.write("step-7", ["sglang-0"])`` runs, the driver updates
the engine through SGLang's documented sequence (pause generation, update, flush the cache, continue), with
:class:`SglangHttpUpdater` for a server or :class:`SglangEngineUpdater` for an in-process ``sglang.Engine``::

    updater = SglangHttpUpdater("http://sglang-0:30000", AwexSglangInfo(meta_address, instance="sglang-0"))
    updater.update("step-7")  # returns once every TP worker applied it; raises otherwise

SGLang calls :func:`receive_weights` in each TP worker with its live model: the request travels as the name of
one empty tensor (JSON, checked field by field; no Awex data is unpickled), the worker builds its layout from its
own parallel state (``awex.meta.layouts.sglang``: TP, PP, EP, DP attention) and its model's config, checks
that the model's parameters are the ones Awex's views expect (names, shapes, dtypes) before any byte moves, and
receives every box straight into the storage of SGLang's parameters (``awex.convert.sglang``): no staging copy, no
loader call. The reader is kept between versions (one per model in the process); each version's
:class:`~awex.engines.receive_report.ReceiveReport` is published like the vLLM binding's.

With ``AwexSglangInfo(receive="staged")`` the workers receive each version into staging (on the GPU or in pinned
host memory: ``staging``, ``staging_budget_bytes``, ``awex.engines.staging``) on a thread of their own while SGLang
keeps generating, and apply it by a copy only when :class:`SglangHttpUpdater` commits it, SGLang paused for that
alone (the request's steps: ``awex.engines.sglang_request``).

Verified on CPU against SGLang 0.5.23's own model classes (``sglang_layout`` nox session: layouts, loaders, and a
sync from an HF trainer into SGLang models built by SGLang's classes, through this function). A running SGLang
server needs CUDA here: ``integration/tests/test_sglang_server.py`` runs where SGLang and a GPU are present.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping, Sequence

import torch

from awex.convert.sglang import sglang_param_dtypes, sglang_param_shapes, sglang_views
from awex.engines.memory import PeakMemory
from awex.engines.reader import WeightsReader
from awex.engines.receive_report import ReceiveReport, publish_report
from awex.engines.sglang_request import (  # noqa: F401  (LOADER, REQUEST_PREFIX: re-exported, as before the split)
    LOADER,
    REQUEST_PREFIX,
    AwexSglangInfo,
    SglangUpdateRequest,
)
from awex.engines.sglang_updaters import SglangEngineUpdater, SglangHttpUpdater
from awex.engines.staged_version import DROP_WAIT_SECONDS, StagedVersion
from awex.engines.staging import Staging, StagingBuffers, shard_bytes, transport_device
from awex.engines.staging import commit as commit_staged
from awex.engines.sync import keys
from awex.meta.client import MetaClient
from awex.meta.errors import AwexValueError
from awex.meta.layouts import SglangParallel, sglang_engine_layout
from awex.meta.models import model_dims
from awex.transport import LocalShards

__all__ = [
    "AwexSglangInfo",
    "SglangEngineUpdater",
    "SglangHttpUpdater",
    "SglangReceiver",
    "SglangUpdateRequest",
    "close_receivers",
    "receive_weights",
    "sglang_runtime_parallel",
]

log = logging.getLogger("awex.engines.sglang")


def sglang_runtime_parallel() -> tuple[SglangParallel, int]:
    """This SGLang worker's parallel sizes and its rank in the engine (``tp * pp_rank + tp_rank``), read from
    SGLang's published parallel state."""
    from sglang.srt.runtime_context import get_parallel

    p = get_parallel()
    parallel = SglangParallel(
        tp=p.tp_size,
        pp=p.pp_size,
        ep=p.moe_ep_size,
        attn_dp=p.attn_dp_size if p.attn_dp_enabled else 1,
        moe_dp=p.moe_dp_size,
        dp_lm_head=bool(getattr(p, "enable_dp_lm_head", False)) and p.attn_dp_enabled,
    )
    return parallel, p.tp_size * p.pp_rank + p.tp_rank


def check_params(params: Mapping[str, torch.Tensor], want: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
    """``ValueError`` listing the first differences between a model's parameters and what Awex's views expect."""
    have = {n: (tuple(p.shape), p.dtype) for n, p in params.items()}
    if have == dict(want):
        return
    diffs = [
        f"{n}: SGLang {have.get(n)}, Awex {want.get(n)}"
        for n in sorted(set(have) | set(want))
        if have.get(n) != want.get(n)
    ]
    raise AwexValueError(
        f"sglang: the model's parameters are not the ones Awex maps ({len(diffs)} differ; first: {diffs[:5]}); "
        "a quantised or unmapped model class? nothing was received"
    )


class SglangReceiver:
    """One SGLang worker's side of Awex syncs: its reader over views of the model's live parameters, or, with
    ``receive="staged"``, over staging buffers (``awex.engines.staging``) that a commit copies into them."""

    def __init__(
        self,
        model: torch.nn.Module,
        info: AwexSglangInfo,
        parallel: SglangParallel,
        rank: int,
        hf_config: Mapping[str, Any] | None = None,
    ):
        config = dict(hf_config) if hf_config is not None else model.config.to_dict()
        params = dict(model.named_parameters())
        dtype = str(next(iter(params.values())).dtype).removeprefix("torch.")
        dims = model_dims(config, dtype)
        layout = sglang_engine_layout(config, dtype, parallel, instance=info.instance)
        shapes = sglang_param_shapes(dims, parallel, rank)
        dtypes = sglang_param_dtypes(shapes, dtype)
        check_params(params, {n: (s, dtypes[n]) for n, s in shapes.items()})
        client = MetaClient(info.meta_address, job=info.job, token=info.token, timeout=info.timeout)
        self.info, self.rank = info, rank
        self.device = next(iter(params.values())).device
        self._live = views = sglang_views(params, dims, parallel, rank)
        self._staging: StagingBuffers | None = None
        self._pending: StagedVersion | None = None
        self.unstaged: str | None = None  # receive="staged" but this rank's shard exceeds the budget: why
        device = None
        if info.receive == "staged":  # within the budget; else in place, said at staging/<instance>:<rank>
            staging = Staging.decide(shard_bytes(layout, rank), info.staging_budget_bytes, info.staging)
            client.put(keys.staging(info.instance, rank), staging.record())
            if staging.staged:
                self._staging = views = StagingBuffers(layout, info.staging, self.device)
                device = transport_device(info.staging, self.device)
            else:
                self.unstaged = staging.reason
                log.warning("awex sglang: %s rank %d receives in place: %s", info.instance, rank, staging.reason)
        self.reader = WeightsReader(client, layout, rank, views, timeout=info.timeout, device=device)
        shards = self.reader.shards
        self.bytes = sum(view.nbytes for name in shards.names() for _, view in shards.pairs(name))
        self.tensors = len(shards.names())
        self.last_report: ReceiveReport | None = None
        how = "in place" if self._staging is None else f"staged ({info.staging})"
        log.info("awex sglang receiver ready: %s rank %d, %d tensors %s", info.instance, rank, self.tensors, how)

    def receive(self, version: str, validate: str | None = None, step: str | None = None) -> ReceiveReport | None:
        """Receive ``version`` and apply it (``step=None``); or one step of the staged protocol
        (``awex.engines.sglang_request``): ``"stage"`` starts receiving it on a thread and returns at once (SGLang
        keeps generating), ``"commit"`` applies it once held (waiting for it), ``"drop"`` drops it (nothing
        changes; a version not staged here is nothing to drop); ``"prepare"`` does nothing more than set up."""
        pending = self._pending
        if step in ("commit", "drop"):
            if pending is None or pending.version != version:
                if step == "drop":
                    return None
                held = None if pending is None else pending.version
                raise AwexValueError(f"sglang: no staged version {version!r} to commit (staged: {held!r})")
            if step == "commit":
                self._pending = None
                pending.decide(True, timeout=self.reader.timeout)
                return self.last_report
            try:
                pending.decide(False, timeout=DROP_WAIT_SECONDS)
            except TimeoutError as e:  # kept: a new version is refused until this receive ends (applying nothing)
                log.warning("%s; it ends at its own deadline, applying nothing", e)
                return None
            self._pending = None
            return None
        if step == "prepare":
            return None
        if pending is not None and pending.running:
            raise RuntimeError(
                f"sglang: version {pending.version!r} is staged and not yet committed or dropped; {version!r} "
                "cannot be received before (never mixed)"
            )
        self._pending = None
        if step != "stage":
            return self._receive(version, validate, None)
        if self._staging is None:
            why = self.unstaged or "receive='in_place'"
            raise AwexValueError(f"sglang: {self.info.instance} rank {self.rank} does not stage ({why})")
        where = keys.staged(version, self.info.instance, self.rank)
        self._pending = StagedVersion(
            version,
            lambda gate: self._receive(version, validate, gate),
            lambda: self.reader.client.put(where, {"version": version}),
        )
        self._pending.start(self.reader.timeout)
        return None

    def _apply(self, shards: LocalShards) -> None:
        """A staged version's commit: every box copied from staging into the live parameters."""
        commit_staged(shards, shards.names(), self._live, self.device)

    def _receive(self, version: str, validate: str | None, gate: Callable[[], None] | None) -> ReceiveReport:
        started = time.monotonic()
        staged = self._staging is not None
        with PeakMemory(self.device) as peak:
            self.reader.receive(
                version,
                validate=validate,
                in_place=not staged,
                apply=self._apply if staged else None,
                before_apply=gate,
            )
        report = ReceiveReport(
            version,
            self.reader.layout.instance,
            self.reader.local_rank,
            self.tensors,
            self.bytes,
            0,
            0,
            round(time.monotonic() - started, 6),
            peak.extra_bytes,
            self.reader.held_bytes() + (self._staging.nbytes if staged else 0),
        )
        self.last_report = report
        log.info(
            "awex sglang: %s:%d received %s %s (%d bytes), %.3f s",
            report.instance,
            report.rank,
            version,
            "staged, committed" if staged else "in place",
            report.in_place_bytes,
            report.seconds,
        )
        publish_report(self.reader.client, report, log)
        return report

    def close(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None and pending.running:
            try:
                pending.decide(False, timeout=5.0)
            except TimeoutError as e:
                log.error("%s", e)
        self.reader.close()


_RECEIVERS: dict[int, SglangReceiver] = {}  # one per live model in this process (id(model))


def receive_weights(
    model: torch.nn.Module,
    named_tensors: Sequence[tuple[str, Any]],
    runtime: Callable[[], tuple[SglangParallel, int]] = sglang_runtime_parallel,
) -> None:
    """SGLang's custom weight loader (``--custom-weight-loader awex.engines.sglang.receive_weights``): receive the
    requested version into ``model`` in place; raises (SGLang reports the update as failed) on any failure.
    ``runtime``: where the worker's parallel sizes and rank come from (SGLang's parallel state)."""
    request = SglangUpdateRequest.from_named_tensors(named_tensors)
    receiver = _RECEIVERS.get(id(model))
    if receiver is not None and receiver.info != request.info:
        receiver.close()
        receiver = None
    if receiver is None:
        parallel, rank = runtime()
        receiver = _RECEIVERS[id(model)] = SglangReceiver(model, request.info, parallel, rank)
    receiver.receive(request.version, request.validate, request.step)


def close_receivers() -> None:
    """Close every receiver of this process (before the trainer's processes exit, for CUDA IPC)."""
    while _RECEIVERS:
        _RECEIVERS.popitem()[1].close()
