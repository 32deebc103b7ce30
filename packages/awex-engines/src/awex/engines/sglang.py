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

Verified on CPU against SGLang 0.5.23's own model classes (``sglang_layout`` nox session: layouts, loaders, and a
sync from an HF trainer into SGLang models built by SGLang's classes, through this function). A running SGLang
server needs CUDA here: ``integration/tests/test_sglang_server.py`` runs where SGLang and a GPU are present.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable, Mapping, Sequence

import torch

from awex.convert.sglang import sglang_param_dtypes, sglang_param_shapes, sglang_views
from awex.engines.memory import PeakMemory
from awex.engines.pause import check_pause_mode
from awex.engines.reader import WeightsReader
from awex.engines.receive_report import ReceiveReport, publish_report
from awex.meta.client import MetaClient
from awex.meta.layouts import SglangParallel, sglang_engine_layout
from awex.meta.models import model_dims

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

LOADER = "awex.engines.sglang.receive_weights"  # the value of SGLang's --custom-weight-loader and load_format
REQUEST_PREFIX = "awex-request:"  # the request tensor's name starts with this; the JSON follows


@dataclass(frozen=True)
class AwexSglangInfo:
    """Where the MetaServer is and which instance this engine is (constant across versions)."""

    meta_address: str
    instance: str = "sglang"
    job: str = "default"
    token: str | None = None
    timeout: float = 300.0


@dataclass(frozen=True)
class SglangUpdateRequest:
    """One version to receive, as it crosses into SGLang's workers (JSON in a tensor name)."""

    version: str
    info: AwexSglangInfo
    validate: str | None = None  # an HF safetensors checkpoint to compare every received tensor with

    def to_named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        body = {"version": self.version, "validate": self.validate, **asdict(self.info)}
        return [(REQUEST_PREFIX + json.dumps(body, sort_keys=True), torch.empty(0, dtype=torch.uint8))]

    @classmethod
    def from_named_tensors(cls, named_tensors: Sequence[tuple[str, Any]]) -> SglangUpdateRequest:
        """Parse and check the request (``ValueError`` naming what is wrong, before anything else happens)."""
        if len(named_tensors) != 1 or not str(named_tensors[0][0]).startswith(REQUEST_PREFIX):
            names = [str(n)[:60] for n, _ in list(named_tensors)[:3]]
            raise ValueError(
                f"{LOADER} expects one request made by SglangUpdateRequest.to_named_tensors(), got {names} "
                f"({len(named_tensors)} tensors)"
            )
        try:
            body = json.loads(named_tensors[0][0][len(REQUEST_PREFIX) :])
        except json.JSONDecodeError as e:
            raise ValueError(f"{LOADER}: the request is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise ValueError(f"{LOADER}: the request must be a JSON object")
        expected = {
            "version": str,
            "validate": (str, type(None)),
            "meta_address": str,
            "instance": str,
            "job": str,
            "token": (str, type(None)),
            "timeout": (int, float),
        }
        unknown = sorted(set(body) - set(expected))
        missing = sorted({"version", "meta_address"} - set(body))
        if unknown or missing:
            raise ValueError(f"{LOADER}: request fields unknown {unknown}, missing {missing}")
        for key, kind in expected.items():
            if key in body and not isinstance(body[key], kind):
                raise ValueError(f"{LOADER}: request field {key!r} has type {type(body[key]).__name__}")
        if not body["version"] or body.get("timeout", 1) <= 0:
            raise ValueError(f"{LOADER}: the version must be non-empty and the timeout positive")
        info = AwexSglangInfo(**{f.name: body[f.name] for f in fields(AwexSglangInfo) if f.name in body})
        return cls(body["version"], info, body.get("validate"))


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
    raise ValueError(
        f"sglang: the model's parameters are not the ones Awex maps ({len(diffs)} differ; first: {diffs[:5]}); "
        "a quantised or unmapped model class? nothing was received"
    )


class SglangReceiver:
    """One SGLang worker's side of Awex syncs: its reader over views of the model's live parameters."""

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
        self.info = info
        self.device = next(iter(params.values())).device
        self.reader = WeightsReader(
            client, layout, rank, sglang_views(params, dims, parallel, rank), timeout=info.timeout
        )
        shards = self.reader.shards
        self.bytes = sum(view.nbytes for name in shards.names() for _, view in shards.pairs(name))
        self.tensors = len(shards.names())
        self.last_report: ReceiveReport | None = None
        log.info("awex sglang receiver ready: %s rank %d, %d tensors in place", info.instance, rank, self.tensors)

    def receive(self, version: str, validate: str | None = None) -> ReceiveReport:
        started = time.monotonic()
        with PeakMemory(self.device) as peak:
            self.reader.receive(version, validate=validate, in_place=True)
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
            self.reader.held_bytes(),
        )
        self.last_report = report
        log.info(
            "awex sglang: %s:%d received %s in place (%d bytes), %.3f s",
            report.instance,
            report.rank,
            version,
            report.in_place_bytes,
            report.seconds,
        )
        publish_report(self.reader.client, report, log)
        return report

    def close(self) -> None:
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
    receiver.receive(request.version, request.validate)


def close_receivers() -> None:
    """Close every receiver of this process (before the trainer's processes exit, for CUDA IPC)."""
    while _RECEIVERS:
        _RECEIVERS.popitem()[1].close()


class SglangEngineUpdater:
    """Drives an in-process ``sglang.Engine`` through one version (its ``update_weights_from_tensor`` with Awex's
    loader; SGLang pauses scheduling of the update against generation itself and flushes the cache)."""

    def __init__(self, engine: Any, info: AwexSglangInfo):
        self.engine, self.info = engine, info

    def update(self, version: str, validate: str | None = None) -> None:
        request = SglangUpdateRequest(version, self.info, validate)
        out = self.engine.update_weights_from_tensor(request.to_named_tensors(), load_format=LOADER, flush_cache=True)
        _check_result(out, version, self.info.instance)


SGLANG_PAUSE = {"keep": "retract", "abort": "abort"}  # Awex's pause policy -> SGLang's /pause_generation mode


class SglangHttpUpdater:
    """Drives an SGLang server through one version as SGLang documents it for RL: ``/pause_generation``,
    ``/update_weights_from_tensor`` (Awex's loader, cache flushed, ``weight_version`` set), ``/continue_generation``.

    ``pause`` takes the policy names of the vLLM path: ``"keep"`` (SGLang's ``retract``: running requests go back
    to the queue, their caches freed, and continue on the new version), ``"abort"``, or ``"none"`` for stacks that
    pause the server themselves; SGLang has no mode that lets running requests finish first, so ``"wait"`` is
    refused. A failed update leaves the server paused (the version lands in place: its weights may mix two
    versions) until a later version applies; :attr:`left_paused` says so. Needs ``sglang`` importable here for its
    tensor serializer."""

    def __init__(
        self, url: str, info: AwexSglangInfo, tp_size: int = 1, pause: str = "keep", api_key: str | None = None
    ):
        check_pause_mode(pause)
        if pause == "wait":
            raise ValueError("sglang: pause='wait' has no SGLang mode; use 'keep' (SGLang's retract), 'abort', 'none'")
        self.url, self.info, self.tp_size = url.rstrip("/"), info, tp_size
        self.pause, self.api_key = pause, api_key
        self.left_paused = False

    def _post(self, path: str, body: dict, timeout: float) -> Any:
        import urllib.request

        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url + path, json.dumps(body).encode(), headers, method="POST")
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read() or b"null")

    @staticmethod
    def _serialize(named: list) -> str:
        from sglang.srt.utils import MultiprocessingSerializer

        return MultiprocessingSerializer.serialize(named, output_str=True)

    def update(self, version: str, validate: str | None = None) -> None:
        payload = self._serialize(SglangUpdateRequest(version, self.info, validate).to_named_tensors())
        if self.pause != "none":
            self._post("/pause_generation", {"mode": SGLANG_PAUSE[self.pause]}, 60.0)
        try:
            out = self._post(
                "/update_weights_from_tensor",
                {
                    "serialized_named_tensors": [payload] * self.tp_size,  # one per TP rank
                    "load_format": LOADER,
                    "flush_cache": True,
                    "weight_version": version,
                },
                self.info.timeout + 60.0,
            )
            _check_result(out, version, self.info.instance)
        except Exception as e:
            if self.pause != "none":
                self.left_paused = True
                log.error("sglang: %s left paused after %s failed in place: %s", self.info.instance, version, e)
                raise RuntimeError(
                    f"sglang: {self.info.instance} did not apply {version} and stays paused (its weights may mix "
                    f"two versions) until a later version applies: {e}"
                ) from e
            raise
        if self.pause != "none":
            self._post("/continue_generation", {}, 60.0)
        self.left_paused = False


def _check_result(out: Any, version: str, instance: str) -> None:
    success, message = (out.get("success"), out.get("message")) if isinstance(out, dict) else (out[0], out[1])
    if not success:
        raise RuntimeError(f"sglang: {instance} did not apply {version}: {message}")
