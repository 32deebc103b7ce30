"""Waiting for the GPU with a deadline: poll a CUDA event instead of blocking, so a sync never hangs."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

POLL_SECONDS = 20e-6


def wait_event(event: torch.cuda.Event, deadline: float, timed_out: Callable[[], BaseException]) -> None:
    """Return once ``event`` has completed; raise ``timed_out()`` once ``time.monotonic()`` passes ``deadline``."""
    while not event.query():
        if time.monotonic() >= deadline:
            raise timed_out()
        time.sleep(POLL_SECONDS)
