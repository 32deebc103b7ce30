"""Waiting for the GPU with a deadline: poll a CUDA event instead of blocking, so a sync never hangs."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

POLL_SECONDS = 20e-6
SPIN_SECONDS = 300e-6  # around an expected completion, poll without sleeping (a sleep overshoots by 50-100 us)


def wait_event(
    event: torch.cuda.Event, deadline: float, timed_out: Callable[[], BaseException], expect_at: float = 0.0
) -> None:
    """Return once ``event`` has completed; raise ``timed_out()`` once ``time.monotonic()`` passes ``deadline``.
    ``expect_at``: when (``time.monotonic()``) it should complete: from shortly before until shortly after, the
    poll does not sleep."""
    spin_from, spin_until = expect_at - SPIN_SECONDS, expect_at + 2 * SPIN_SECONDS
    while not event.query():
        now = time.monotonic()
        if now >= deadline:
            raise timed_out()
        if not spin_from <= now <= spin_until:
            time.sleep(POLL_SECONDS)


def timed_out(error: BaseException, deadline: float) -> bool:
    """Whether a failed wait was the deadline: it has passed, or the backend says so (gloo's and NCCL's
    "timed out" / "timeout")."""
    text = str(error).lower()
    return time.monotonic() >= deadline or "timed out" in text or "timeout" in text
