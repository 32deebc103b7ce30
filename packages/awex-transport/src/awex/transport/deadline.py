"""Waiting for the GPU with a deadline: poll a CUDA event instead of blocking, so a sync never hangs."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import torch

from awex.transport.base import TransferError, TransferTimeout

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


class Abortable(Protocol):
    def abort(self) -> None: ...


def wait_group_event(
    event: torch.cuda.Event,
    group: Abortable,
    what: str,
    deadline: float,
    timeout: float,
    watch: Callable[[], None] | None = None,
    every: float = WATCH_SECONDS,
    expect_at: float = 0.0,
) -> None:
    """:func:`wait_event` for work queued on a process group's communicator (NCCL, HCCL): at the deadline, or once
    ``watch`` raises (a peer failed the version: it will never send, or never take what this rank sends), the group
    is aborted, so its kernels end rather than wait for the peer, and the wait fails naming ``what``
    (:class:`TransferTimeout` / :class:`TransferError`). ``expect_at``: as :func:`wait_event`'s."""

    def late() -> TransferTimeout:
        group.abort()
        return TransferTimeout(f"{what}: not done within the sync's {timeout:g} s deadline; the sync group was aborted")

    def watched() -> None:
        try:
            watch()
        except Exception as e:
            group.abort()
            raise TransferError(f"{what}: {e}; the sync group was aborted") from e

    wait_event(event, deadline, late, expect_at, watch=watched if watch is not None else None, every=every)


def timed_out(error: BaseException, deadline: float) -> bool:
    """Whether a failed wait was the deadline: it has passed, or the backend says so (gloo's and NCCL's
    "timed out" / "timeout")."""
    text = str(error).lower()
    return time.monotonic() >= deadline or "timed out" in text or "timeout" in text
