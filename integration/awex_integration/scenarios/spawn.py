"""Run functions in spawned processes and collect their results (test and scenario harness)."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
import traceback
from typing import Any, Callable, Sequence

from awex.transport.net import free_port  # noqa: F401  (the harness's import)


def _run(fn: Callable, key: Any, args: tuple, results) -> None:
    try:
        results.put((key, "ok", fn(*args)))
    except BaseException as e:  # reported to the parent
        results.put((key, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_processes(jobs: Sequence[tuple[Any, Callable, tuple]], timeout: float) -> dict[Any, tuple[str, Any]]:
    """Start ``fn(*args)`` for each ``(key, fn, args)`` in its own spawned process; returns key -> (status, value).

    A process that dies without reporting shows as ``("died", exitcode)``; one still running at the deadline is
    killed and shows as ``("timeout", None)``.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = {}
    for key, fn, args in jobs:
        p = ctx.Process(target=_run, args=(fn, key, args, results), daemon=False)
        p.start()
        procs[key] = p
    out: dict[Any, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    while len(out) < len(procs) and time.monotonic() < deadline:
        try:
            key, status, value = results.get(timeout=0.5)
            out[key] = (status, value)
        except queue.Empty:
            for key, p in procs.items():
                if key not in out and not p.is_alive() and p.exitcode not in (0, None):
                    out[key] = ("died", p.exitcode)
    for key, p in procs.items():
        p.join(max(0.1, min(10.0, deadline - time.monotonic())))
        if p.is_alive():
            p.kill()
            p.join(5)
            out.setdefault(key, ("timeout", None))
    return out
