"""Pause policy names, the pauser chosen per client, and the refusals that come before any byte moves. vLLM's own
pause routes are exercised against real engines in integration/tests/test_vllm_serve.py and test_vllm_pause.py."""

from __future__ import annotations

import http.server
import threading

import pytest

from awex.engines.pause import (
    PAUSE_MODES,
    HttpPauser,
    NoPause,
    Pauser,
    RayPauser,
    VersionStall,
    check_pause_mode,
    pauser_for,
)


def test_modes_are_vllms_three_and_none():
    assert PAUSE_MODES == ("keep", "abort", "wait", "none")
    for mode in PAUSE_MODES:
        assert check_pause_mode(mode) == mode
    for bad in ("retract", "KEEP", "", None, 1):
        with pytest.raises(ValueError, match="pause mode"):
            check_pause_mode(bad)


class HTTPVLLMWeightSyncClient:  # named as vLLM's client: the pauser is chosen by what reaches the engine
    def __init__(self, base_url: str, timeout: float = 300):
        self.base_url, self.timeout = base_url, timeout


class RayVLLMWeightSyncClient:
    def __init__(self, handles):
        self.handles = handles


class OwnClient:
    def check(self) -> None: ...

    def pause(self, mode: str) -> None: ...

    def resume(self) -> None: ...


def test_the_pauser_follows_the_client():
    http = pauser_for(HTTPVLLMWeightSyncClient("http://h:1/", timeout=7), "keep")
    assert isinstance(http, HttpPauser) and http.base_url == "http://h:1" and http.timeout == 7
    assert isinstance(pauser_for(RayVLLMWeightSyncClient(["a", "b"]), "abort"), RayPauser)
    own = OwnClient()
    assert isinstance(own, Pauser) and pauser_for(own, "wait") is own
    assert isinstance(pauser_for(object(), "none"), NoPause)  # the stack pauses itself: any client goes


def test_a_client_that_cannot_pause_is_refused_naming_what_to_pass():
    with pytest.raises(TypeError, match="pause='none'"):
        pauser_for(object(), "keep")
    with pytest.raises(ValueError, match="pause mode"):
        pauser_for(OwnClient(), "retract")


class _Actor:  # an actor handle's surface: the methods its class has
    def __init__(self, *methods: str):
        for m in methods:
            setattr(self, m, lambda *a, **k: None)


def test_ray_actors_must_have_vllms_pause_or_sleep_api():
    llm_actor = _Actor("sleep", "wake_up", "reset_prefix_cache")
    RayPauser([_Actor("pause_generation", "resume_generation"), llm_actor]).check()
    with pytest.raises(TypeError, match="neither pause_generation"):
        RayPauser([_Actor("generate")]).check()


@pytest.fixture
def old_server():
    """An HTTP server without vLLM's RL routes (every path 404), as a vLLM without the pause API answers."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_error(404)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_vllm_without_the_pause_routes_is_refused_at_set_up(old_server):
    with pytest.raises(RuntimeError, match="no /is_paused route"):
        HttpPauser(old_server, timeout=5).check()


def test_a_stall_says_whether_the_engine_resumed():
    stall = VersionStall("step-3", "vllm-0", "keep", 0.0123456789, 0.5, 0.52)
    assert stall.resumed and stall.to_json() == {
        "version": "step-3",
        "instance": "vllm-0",
        "mode": "keep",
        "pause_seconds": 0.012346,
        "sync_seconds": 0.5,
        "stall_seconds": 0.52,
    }
    assert not VersionStall("step-4", "vllm-0", "keep", 0.01, 0.5, None).resumed
    staged = VersionStall("step-5", "vllm-0", "keep", 0.01, 2.0, 0.05, commit_seconds=0.0400004)
    assert staged.to_json()["commit_seconds"] == 0.04 and staged.to_json()["sync_seconds"] == 2.0
