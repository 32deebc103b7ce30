"""vLLM's offline ``LLM`` in this process, driven through one version with generation paused around it.

    from awex.engines.vllm_offline import LLMClient, apply_version

    llm = LLM(model=path, weight_transfer_config=WeightTransferConfig(backend="awex"))
    client = LLMClient(llm)
    client.init_weight_transfer_engine({"meta_address": meta_address, "job": "grpo", "instance": "vllm-0"})
    # per step, while every trainer rank runs writer.write(f"step-{step}", ["vllm-0"]):
    stall = apply_version(client, f"step-{step}", pause="keep")

:class:`LLMClient` is vLLM's trainer-side client protocol over an ``LLM`` object (``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights``, ``finish_weight_update``) plus :meth:`LLMClient.pause` /
:meth:`LLMClient.resume`, so the trainer engine (``awex.engines.vllm_trainer``) can drive an engine in its own
process too. :func:`apply_version` is the hand-wired path (a ``WeightsWriter`` per trainer rank, the engine
updated by the caller) with the same rules as the trainer engine: paused before any byte lands, caches cleared,
resumed once applied; after a failure that may have changed weights in place the engine stays paused, names the
failed version as its weight version and says so, until a later version applies.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from awex.engines.pause import FAILED_VERSION_PREFIX, VersionStall, check_pause_mode, pauser_for, set_weight_version

__all__ = ["LLMClient", "apply_version"]

log = logging.getLogger("awex.engines.vllm")


class LLMClient:
    """vLLM's weight-sync client protocol, and pausing, over an offline ``vllm.LLM`` in this process. Pausing is
    ``sleep(level=0, mode=..)`` (scheduling stops; ``keep`` freezes running requests, ``abort`` ends them, ``wait``
    lets them finish) and ``reset_prefix_cache(reset_running_requests=True)``; resuming is
    ``wake_up(tags=["scheduling"])``."""

    def __init__(self, llm: Any, instance: str | None = None):
        self.llm = llm
        self.instance = instance

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version=weight_version)

    def update_weight_version(self, name: str) -> None:
        self.llm.update_weight_version(name)

    def check(self) -> None:
        missing = [m for m in ("sleep", "wake_up", "reset_prefix_cache") if not callable(getattr(self.llm, m, None))]
        if missing:
            raise TypeError(f"cannot pause {type(self.llm).__name__}: it has no {', '.join(missing)}")

    def pause(self, mode: str) -> None:
        self.llm.sleep(level=0, mode=mode)
        if not self.llm.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError("vLLM did not reset its prefix cache; the engine stays paused")

    def resume(self) -> None:
        self.llm.wake_up(tags=["scheduling"])


def apply_version(
    client: Any,
    version: str,
    *,
    pause: str = "keep",
    staged: bool = False,
    timeout: float | None = None,
    validate: str | None = None,
    instance: str = "vllm",
) -> VersionStall:
    """Apply weight version ``version`` to one engine (``client``: :class:`LLMClient`, or vLLM's HTTP or Ray
    client) while its writers send it: pause (``pause``: one of ``awex.engines.pause.PAUSE_MODES``), update,
    resume. Returns what the version cost the engine's generation. On failure re-raises the engine's error;
    the engine is resumed on its previous weights when it received ``staged`` (they were not touched), and stays
    paused otherwise (its weight version then reads ``awex-failed:<version>``) until a later version applies."""
    check_pause_mode(pause)
    pauser = pauser_for(client, pause)
    pauser.check()
    asked = time.monotonic()
    pauser.pause(pause)
    paused = time.monotonic()
    update: dict[str, Any] = {"version": version}
    if timeout is not None:
        update["timeout"] = timeout
    if validate is not None:
        update["validate"] = validate
    try:
        client.start_weight_update()
        client.update_weights(update)
        client.finish_weight_update(weight_version=version)
    except BaseException:
        synced = time.monotonic()
        if staged:
            pauser.resume()
            log.error("awex: %s failed on %s; staged receive: resumed on the previous weights", version, instance)
            _stall(version, instance, pause, asked, paused, synced, time.monotonic())
        else:
            try:
                set_weight_version(client, f"{FAILED_VERSION_PREFIX}{version}")
            except Exception as e:  # the engine's own error is what the caller needs
                log.warning("awex: could not mark %s as failed on %s: %s", version, instance, e)
            log.error(
                "awex: %s failed on %s after weights may have changed in place: generation stays paused until a "
                "later version applies",
                version,
                instance,
            )
        raise
    synced = time.monotonic()
    pauser.resume()
    return _stall(version, instance, pause, asked, paused, synced, time.monotonic())


def _stall(version, instance, mode, asked, paused, synced, resumed) -> VersionStall:
    return VersionStall(version, instance, mode, paused - asked, synced - paused, resumed - paused)
