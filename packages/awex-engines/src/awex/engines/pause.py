"""Generation paused around a weight version: the policy names, the pausers of each way an engine is reached, and
what the pause cost (:class:`VersionStall`).

Bytes of a version land in an in-place engine's live parameters while it may be generating: a request running
then reads a mix of two versions, and prefix-cache blocks computed with the old weights keep serving after it.
So before the first byte lands the engine is paused with its own API, in the mode the user picks, and its caches
are cleared; it is resumed once the version is applied on every rank:

- ``"keep"`` (the default): running requests freeze and continue on the new version once resumed; their KV
  cache is dropped with the rest and recomputed (vLLM's ``pause_generation(mode="keep")``).
- ``"abort"``: running requests are aborted (they end with finish reason ``abort``).
- ``"wait"``: running requests finish on the old version first; new ones wait.
- ``"none"``: the stack pauses the engine itself; Awex neither pauses nor resumes it.

A pauser is chosen once per engine from what reaches it (:func:`pauser_for`): vLLM's HTTP client (``/pause``,
``/resume``; ``/is_paused`` is probed at set-up), vLLM's Ray client (``AsyncLLM`` actors: ``pause_generation`` /
``resume_generation``; ``LLM`` actors: ``sleep(level=0)``, ``reset_prefix_cache``, ``wake_up(["scheduling"])``),
or any client with ``pause(mode)`` / ``resume()`` of its own (:class:`awex.engines.vllm_offline.LLMClient`).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable

from awex.meta.errors import AwexValueError

PAUSE_MODES = ("keep", "abort", "wait", "none")
FAILED_VERSION_PREFIX = "awex-failed:"  # the weight version an engine left paused on mixed weights names


def check_pause_mode(mode: Any) -> str:
    """``mode`` if it is one of :data:`PAUSE_MODES`, else a ``ValueError`` saying which are."""
    if mode not in PAUSE_MODES:
        raise AwexValueError(f"pause mode {mode!r}: one of {', '.join(PAUSE_MODES)} (awex.engines.pause)")
    return mode


@dataclass(frozen=True)
class VersionStall:
    """What one version cost one engine's generation, in seconds: ``pause_seconds`` from asking for the pause to
    the engine being paused, ``sync_seconds`` from paused to the version applied (or failed) on every rank,
    ``stall_seconds`` from paused to resumed (``None`` where the engine was left paused: the version failed on
    weights it had already changed). With mode ``"none"`` the pause is the stack's own: the times start when
    the update was asked for. With ``receive="staged"`` the engines generate while the version arrives:
    ``sync_seconds`` runs from asking for the update to every rank holding it staged (no pause), ``pause_seconds``
    from then to paused, and ``commit_seconds`` from paused to the version applied; the stall covers the commit."""

    version: str
    instance: str
    mode: str
    pause_seconds: float
    sync_seconds: float
    stall_seconds: float | None
    commit_seconds: float | None = None  # receive="staged": from paused to the version applied on every rank

    @property
    def resumed(self) -> bool:
        return self.stall_seconds is not None

    def to_json(self) -> dict[str, Any]:
        out = {
            "version": self.version,
            "instance": self.instance,
            "mode": self.mode,
            "pause_seconds": round(self.pause_seconds, 6),
            "sync_seconds": round(self.sync_seconds, 6),
            "stall_seconds": None if self.stall_seconds is None else round(self.stall_seconds, 6),
        }
        if self.commit_seconds is not None:  # received while generating (staged): the pause covered the commit
            out["commit_seconds"] = round(self.commit_seconds, 6)
        return out


@runtime_checkable
class Pauser(Protocol):
    """Pauses one engine's generation and clears its caches (:meth:`pause`), and resumes it."""

    def check(self) -> None:
        """Raise, saying what is missing, when the engine cannot be paused (called once, before any version)."""

    def pause(self, mode: str) -> None: ...

    def resume(self) -> None: ...


class NoPause:
    """Mode ``"none"``: the stack pauses and resumes the engine itself."""

    def check(self) -> None:
        pass

    def pause(self, mode: str) -> None:
        pass

    def resume(self) -> None:
        pass


class HttpPauser:
    """A ``vllm serve`` engine through vLLM's RL routes (``POST /pause?mode=..&clear_cache=true``, ``POST
    /resume``, ``GET /is_paused``)."""

    def __init__(self, base_url: str, timeout: float = 300.0):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout

    def _call(self, method: str, route: str, timeout: float | None = None) -> dict:
        return _http(self.base_url, method, route, timeout=timeout or self.timeout)

    def check(self) -> None:
        try:
            self._call("GET", "/is_paused", timeout=min(30.0, self.timeout))
        except urllib.error.HTTPError as e:
            if e.code == 404:
                raise RuntimeError(
                    f"{self.base_url} has no /is_paused route: this vLLM server cannot be paused around a weight "
                    "update (start it with VLLM_SERVER_DEV_MODE=1 and a vLLM with the RL routes, or pass "
                    "pause='none' if your stack pauses the engine itself)"
                ) from None
            raise

    def pause(self, mode: str) -> None:
        query = urllib.parse.urlencode({"mode": mode, "clear_cache": "true"})
        self._call("POST", f"/pause?{query}")

    def paused(self) -> bool:
        """Whether the server is paused now (``GET /is_paused``)."""
        return bool(self._call("GET", "/is_paused", timeout=min(30.0, self.timeout)).get("is_paused"))

    def resume(self) -> None:
        self._call("POST", "/resume")


class RayPauser:
    """vLLM engines as Ray actors (one or more handles, paused and resumed together): an ``AsyncLLM`` actor through
    ``pause_generation(mode=.., clear_cache=True)`` / ``resume_generation()``; an ``LLM`` actor (no requests run
    while it updates, calls to an actor are serial, but its prefix cache still holds old blocks) through
    ``sleep(level=0, mode=..)``, ``reset_prefix_cache(reset_running_requests=True)`` and
    ``wake_up(tags=["scheduling"])``."""

    def __init__(self, handles: Sequence[Any]):
        self.handles = list(handles)

    @staticmethod
    def _is_async(handle: Any) -> bool:
        return _has(handle, "pause_generation") and _has(handle, "resume_generation")

    def check(self) -> None:
        for h in self.handles:
            if not self._is_async(h) and not all(_has(h, m) for m in ("sleep", "wake_up", "reset_prefix_cache")):
                raise TypeError(
                    f"cannot pause the Ray actor {h!r}: it has neither pause_generation/resume_generation (AsyncLLM) "
                    "nor sleep/wake_up/reset_prefix_cache (LLM); pass pause='none' if your stack pauses it itself"
                )

    def pause(self, mode: str) -> None:
        import ray

        ray.get([h.pause_generation.remote(mode=mode, clear_cache=True) for h in self.handles if self._is_async(h)])
        llms = [h for h in self.handles if not self._is_async(h)]
        ray.get([h.sleep.remote(level=0, mode=mode) for h in llms])
        ray.get([h.reset_prefix_cache.remote(reset_running_requests=True) for h in llms])

    def paused(self) -> bool | None:
        """Whether every handle's engine is paused now, where each can say (``AsyncLLM.is_paused``); else ``None``."""
        import ray

        if not all(self._is_async(h) and _has(h, "is_paused") for h in self.handles):
            return None
        return all(ray.get([h.is_paused.remote() for h in self.handles]))

    def resume(self) -> None:
        import ray

        ray.get(
            [
                h.resume_generation.remote() if self._is_async(h) else h.wake_up.remote(tags=["scheduling"])
                for h in self.handles
            ]
        )


def paused_now(pauser: Pauser) -> bool | None:
    """Whether the engine behind ``pauser`` is paused now, where its pauser can say (a ``paused()`` method: vLLM's
    ``GET /is_paused``, an ``AsyncLLM`` actor's ``is_paused``); ``None`` where it cannot."""
    ask = getattr(pauser, "paused", None)
    return ask() if callable(ask) else None


def _http(base_url: str, method: str, route: str, body: dict | None = None, timeout: float = 300.0) -> dict:
    """One request to a vLLM server's route (a JSON body where given); its JSON answer, ``{}`` when empty."""
    data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
    headers = {"Content-Type": "application/json"} if body is not None else {}
    req = urllib.request.Request(base_url.rstrip("/") + route, data=data, method=method, headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        answer = r.read()
    return json.loads(answer) if answer else {}


def _has(obj: Any, name: str) -> bool:
    try:
        return callable(getattr(obj, name))
    except Exception:  # a Ray actor handle raises AttributeError for a method its class lacks
        return False


def set_weight_version(client: Any, name: str) -> None:
    """Name the weight version an engine serves without updating it (vLLM's ``update_weight_version``): through a
    client's own method, vLLM's HTTP route, or each Ray actor handle."""
    if callable(getattr(client, "update_weight_version", None)):
        client.update_weight_version(name)
    elif type(client).__name__ == "HTTPVLLMWeightSyncClient":
        timeout = float(getattr(client, "timeout", 300.0))
        _http(client.base_url, "POST", "/update_weight_version", {"new_version": name}, timeout)
    elif type(client).__name__ == "RayVLLMWeightSyncClient":
        import ray

        ray.get([h.update_weight_version.remote(name) for h in client.handles])
    else:
        raise TypeError(f"cannot name the weight version through a {type(client).__name__}")


def pauser_for(client: Any, mode: str) -> Pauser:
    """The pauser of an engine reached through ``client`` (vLLM's HTTP or Ray client, or a client with ``pause`` /
    ``resume`` of its own); :class:`NoPause` for mode ``"none"``. Raises ``TypeError`` for a client through which
    generation cannot be paused, saying what to pass instead."""
    check_pause_mode(mode)
    if mode == "none":
        return NoPause()
    if isinstance(client, Pauser):
        return client
    kind = type(client).__name__
    if kind == "HTTPVLLMWeightSyncClient" and hasattr(client, "base_url"):
        return HttpPauser(client.base_url, float(getattr(client, "timeout", 300.0)))
    if kind == "RayVLLMWeightSyncClient" and hasattr(client, "handles"):
        return RayPauser(client.handles)
    raise TypeError(
        f"cannot pause generation through a {kind}: use vLLM's HTTPVLLMWeightSyncClient or "
        "RayVLLMWeightSyncClient, a client with pause(mode) and resume(), or pass pause='none' if your stack "
        "pauses the engine itself"
    )
