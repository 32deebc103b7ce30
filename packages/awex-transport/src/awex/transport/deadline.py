"""Waiting for the GPU with a deadline: poll a CUDA event instead of blocking, so a sync never hangs."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

POLL_SECONDS = 20e-6
SPIN_SECONDS = 300e-6  # around an expected completion, poll without sleeping (a sleep overshoots by 50-100 us)
WATCH_SECONDS = 1.0  # a wait's ``watch`` runs this often (it asks other processes: not at every poll)


def wait_event(
    event: torch.cuda.Event,
    deadline: float,
    timed_out: Callable[[], BaseException],
    expect_at: float = 0.0,
    watch: Callable[[], None] | None = None,
    every: float = WATCH_SECONDS,
) -> None:
    """Return once ``event`` has completed; raise ``timed_out()`` once ``time.monotonic()`` passes ``deadline``.
    ``expect_at``: when (``time.monotonic()``) it should complete: from shortly before until shortly after, the
    poll does not sleep. ``watch``: called every ``every`` seconds while the event is pending (the first time
    after ``every``); what it raises ends the wait (a peer said the work will never complete)."""
    spin_from, spin_until = expect_at - SPIN_SECONDS, expect_at + 2 * SPIN_SECONDS
    look = time.monotonic() + every if watch is not None else float("inf")
    while not event.query():
        now = time.monotonic()
        if now >= deadline:
            raise timed_out()
        if now >= look:
            watch()
            look = time.monotonic() + every
        if not spin_from <= now <= spin_until:
            time.sleep(POLL_SECONDS)


def timed_out(error: BaseException, deadline: float) -> bool:
    """Whether a failed wait was the deadline: it has passed, or the backend says so (gloo's and NCCL's
    "timed out" / "timeout")."""
    text = str(error).lower()
    return time.monotonic() >= deadline or "timed out" in text or "timeout" in text
