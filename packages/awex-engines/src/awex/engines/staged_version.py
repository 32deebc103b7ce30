"""A version received into staging while the engine keeps generating, applied only on the sender's word.

An engine that receives ``staged`` holds a whole version apart from its live weights before anything is loaded. Run
on a thread of its own (:class:`StagedVersion`), that receive needs no pause: the engine serves the previous version
while the bytes arrive. Once this rank holds the whole version (verified and validated where asked) it says so on
the MetaServer (``awex.engines.sync.keys.staged``) and waits for the decision of the trainer that drives the
engines (``awex.engines.vllm_sender``): that one waits until every rank of every engine said so, pauses the engines
and commits (the load step runs, the rank's outcome goes to the trainers after it: a version counts as applied only
once committed), or drops the version (nothing loaded, no pause: the outcome is a failure with the weights
untouched). A rank never applies without the decision: one that does not come by the receive's deadline drops the
version.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from awex.meta.errors import AwexError

log = logging.getLogger("awex.engines.vllm")

DROP_WAIT_SECONDS = 5.0  # a staged version dropped: how long to wait for its receive to end (its own deadline)


class VersionDroppedError(AwexError, RuntimeError):
    """A staged version was dropped before anything was applied (the trainer's decision, or none by the deadline)."""


class StagedVersion:
    """One version's receive on a thread of its own (see the module). ``receive(before_apply)`` runs the whole
    receive (``WeightsReader.receive`` with its apply step) and calls ``before_apply`` once the version is staged;
    ``announce()`` tells the trainer that this rank holds it."""

    def __init__(self, version: str, receive: Callable[[Callable[[], None]], None], announce: Callable[[], None]):
        self.version = version
        self._receive, self._announce = receive, announce
        self._decided = threading.Event()
        self._commit = False
        self._deadline = float("inf")
        self.staged_at: float | None = None  # monotonic: when this rank held the whole version
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"awex-staged-{version}", daemon=True)

    def start(self, timeout: float) -> None:
        """Begin receiving; waits for the decision at most until ``timeout`` seconds from now."""
        self._deadline = time.monotonic() + timeout
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def decide(self, commit: bool, timeout: float) -> None:
        """The trainer's word: apply the staged version (``commit``) or drop it; waits until this rank's receive
        ended (at most ``timeout`` seconds). Raises what the receive raised when asked to commit (a drop asked for
        raises nothing: the version fails, the weights untouched); ``TimeoutError`` if the receive is still running."""
        self._commit = commit
        self._decided.set()
        self._thread.join(max(0.0, timeout))
        if self._thread.is_alive():
            raise TimeoutError(f"awex: version {self.version!r} still being received {timeout:g} s after the decision")
        if commit and self.error is not None:
            raise self.error

    def _gate(self) -> None:
        """Between the whole version arriving and its load step: say so, then wait for the decision."""
        self.staged_at = time.monotonic()
        self._announce()
        if not self._decided.wait(max(0.0, self._deadline - time.monotonic())):
            raise VersionDroppedError(
                f"version {self.version!r} was staged but no decision to apply it came by the deadline: dropped, "
                "the engine keeps serving its weights"
            )
        if not self._commit:
            raise VersionDroppedError(f"version {self.version!r} was dropped by the trainer before it was applied")

    def _run(self) -> None:
        try:
            self._receive(self._gate)
        except BaseException as e:  # the outcome went to the trainers; the decision reads it
            self.error = e
            if not isinstance(e, VersionDroppedError):
                log.error("awex: staged receive of %s failed: %s", self.version, e)
