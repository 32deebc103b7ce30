"""Drivers of an SGLang engine through one version: :class:`SglangHttpUpdater` for a server (SGLang's documented RL
sequence: pause generation, update through Awex's loader, continue), :class:`SglangEngineUpdater` for an in-process
``sglang.Engine``. With ``receive="staged"`` in the info, the HTTP updater has the engine receive while it generates
and pauses it for the commit alone (:meth:`SglangHttpUpdater.update`)."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from awex.engines.pause import VersionStall, check_pause_mode
from awex.engines.sglang_request import LOADER, AwexSglangInfo, SglangUpdateRequest
from awex.engines.sync import keys
from awex.meta.client import MetaClient
from awex.meta.errors import AwexValueError

log = logging.getLogger("awex.engines.sglang")


class SglangEngineUpdater:
    """Drives an in-process ``sglang.Engine`` through one version (its ``update_weights_from_tensor`` with Awex's
    loader; SGLang pauses scheduling of the update against generation itself and flushes the cache)."""

    def __init__(self, engine: Any, info: AwexSglangInfo):
        if info.receive != "in_place":
            raise AwexValueError(
                "sglang: receive='staged' is driven over HTTP (SglangHttpUpdater: it pauses the server for the commit "
                "alone); an in-process engine updates in place"
            )
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
            raise AwexValueError(
                "sglang: pause='wait' has no SGLang mode; use 'keep' (SGLang's retract), 'abort', 'none'"
            )
        self.url, self.info, self.tp_size = url.rstrip("/"), info, tp_size
        self.pause, self.api_key = pause, api_key
        self.left_paused = False
        self.staged: bool | None = None  # receive="staged": whether every rank stages (known after the first update)
        self.world = 0
        self.last_stall: VersionStall | None = None

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

    def _update(self, request: SglangUpdateRequest, flush: bool) -> None:
        """``/update_weights_from_tensor`` with ``request`` for every TP rank; raises where it did not succeed."""
        body = {
            "serialized_named_tensors": [self._serialize(request.to_named_tensors())] * self.tp_size,  # one per rank
            "load_format": LOADER,
            "flush_cache": flush,
        }
        if flush:
            body["weight_version"] = request.version
        out = self._post("/update_weights_from_tensor", body, self.info.timeout + 60.0)
        _check_result(out, request.version, self.info.instance)

    def update(self, version: str, validate: str | None = None) -> VersionStall | None:
        """Apply ``version`` (every TP worker received it); raises otherwise. In place, the engine is paused for the
        whole transfer. With ``receive="staged"``: the version is received while SGLang keeps generating (a pause in
        place, requests frozen a few milliseconds, around the request that starts it: SGLang runs an update on an
        unpaused server only once its running requests end), then, once every rank holds it, the engine is paused
        in the user's mode for the commit alone and resumed; a version that fails before its commit is dropped on
        every rank, the engine never paused for it and still serving its weights. Returns the version's stall
        (``VersionStall``, also :attr:`last_stall`) when staged."""
        if self.info.receive == "staged" and self.staged is None:
            self._prepare()
        if self.info.receive == "staged" and self.staged:
            self.last_stall = self._update_staged(version, validate)
            return self.last_stall
        self._paused_update(
            SglangUpdateRequest(version, self.info, validate), "apply", " (its weights may mix two versions)"
        )
        return None

    def _paused_update(self, request: SglangUpdateRequest, what: str, risk: str = "") -> tuple[float, float]:
        """``request`` (cache flushed, ``weight_version`` set) with the server paused in the policy's mode around it:
        when it was paused and when the update returned (monotonic). A failure leaves the server paused
        (:attr:`left_paused`: ``what`` did not happen, ``risk`` says what that may mean) and raises."""
        if self.pause != "none":
            self._post("/pause_generation", {"mode": SGLANG_PAUSE[self.pause]}, 60.0)
        paused = time.monotonic()
        try:
            self._update(request, flush=True)
        except Exception as e:
            if self.pause != "none":
                self.left_paused = True
                log.error("sglang: %s left paused after %s failed: %s", self.info.instance, request.version, e)
                raise RuntimeError(
                    f"sglang: {self.info.instance} did not {what} {request.version} and stays paused{risk} until a "
                    f"later version applies: {e}"
                ) from e
            raise
        applied = time.monotonic()
        if self.pause != "none":
            self._post("/continue_generation", {}, 60.0)
        self.left_paused = False
        return paused, applied

    def _meta(self) -> MetaClient:
        i = self.info
        return MetaClient(i.meta_address, job=i.job, token=i.token, timeout=i.timeout)

    def _in_place_pause(self, request: SglangUpdateRequest) -> None:
        """``request`` with the server paused in place around it (nothing changes the weights: no cache flush)."""
        self._post("/pause_generation", {"mode": "in_place"}, 60.0)
        try:
            self._update(request, flush=False)
        finally:
            self._post("/continue_generation", {}, 60.0)

    def _prepare(self) -> None:
        """Before the first staged version: set the receivers up and read whether each rank stages (its budget);
        one that cannot makes every version of this engine go in place, paused for the transfer (said here)."""
        self._in_place_pause(SglangUpdateRequest("awex-prepare", self.info, step="prepare"))
        meta = self._meta()
        world = meta.fetch_layout(self.info.instance, "current").world_size
        said = {rank: meta.get(keys.staging(self.info.instance, rank)) for rank in range(world)}
        unstaged = {rank: s.get("reason") for rank, s in said.items() if not (isinstance(s, dict) and s.get("staged"))}
        self.staged, self.world = not unstaged, world
        if unstaged:
            log.warning(
                "sglang: %s cannot receive while it generates, every version pauses it for the transfer: %s",
                self.info.instance,
                "; ".join(f"rank {r}: {why}" for r, why in sorted(unstaged.items())),
            )

    def _update_staged(self, version: str, validate: str | None) -> VersionStall:
        started = time.monotonic()
        deadline = started + self.info.timeout
        meta = self._meta()
        try:
            self._in_place_pause(SglangUpdateRequest(version, self.info, validate, step="stage"))
            for rank in range(self.world):
                meta.get(
                    keys.staged(version, self.info.instance, rank), timeout=max(0.001, deadline - time.monotonic())
                )
        except Exception as e:
            try:
                self._in_place_pause(SglangUpdateRequest(version, self.info, step="drop"))
            except Exception as drop_error:  # the ranks drop it at their own deadline
                log.error("sglang: dropping %s on %s failed: %s", version, self.info.instance, drop_error)
            raise RuntimeError(
                f"sglang: {self.info.instance} did not stage {version}; dropped before its commit, never paused, "
                f"it serves its previous weights: {e}"
            ) from e
        staged = time.monotonic()
        paused, committed = self._paused_update(SglangUpdateRequest(version, self.info, step="commit"), "commit")
        resumed = time.monotonic()
        return VersionStall(
            version,
            self.info.instance,
            self.pause,
            paused - staged,
            staged - started,
            resumed - paused,
            commit_seconds=committed - paused,
        )


def _check_result(out: Any, version: str, instance: str) -> None:
    success, message = (out.get("success"), out.get("message")) if isinstance(out, dict) else (out[0], out[1])
    if not success:
        raise RuntimeError(f"sglang: {instance} did not apply {version}: {message}")
