"""Requests kept off a sync's critical path: events, version reports, dropping old records, a steady version's log
line.

A writer or reader hands them to :class:`Background`, which sends them in order on one daemon thread (with its
own MetaServer connection), each at least ``delay`` seconds after it was handed over: the sync that handed it
over returns to its caller first, without this thread competing with it for the interpreter. They inform
observers; a failure is logged, never raised into a sync. Anything that must be seen in order after them (a
failure report) calls :meth:`Background.flush` first. A process that exits first waits up to
:data:`EXIT_FLUSH_SECONDS` for what is queued (its last version's events, dropped records and log line), then its
last word (:meth:`Background.last_word`: what only matters once the process stops, run at its close or exit).
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from functools import partial
from typing import Any, Callable

log = logging.getLogger("awex.engines")
EXIT_FLUSH_SECONDS = 2.0
_STARTED: weakref.WeakSet = weakref.WeakSet()  # every Background whose thread runs


@atexit.register
def _flush_at_exit() -> None:
    """At interpreter exit (before daemon threads stop): what each queue holds still goes out, within a bound."""
    deadline = time.monotonic() + EXIT_FLUSH_SECONDS  # for all of them together
    for background in list(_STARTED):
        background.flush(max(0.0, deadline - time.monotonic()))
        background.say_last_word()


class Background:
    """One ordered queue of fire-and-forget calls, on a thread started at the first call."""

    def __init__(self, name: str, limit: int = 1024, delay: float = 0.002):
        self.name = name
        self.delay = delay
        self._queue: queue.Queue = queue.Queue(maxsize=limit)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._last: tuple[str, Callable[[], Any]] | None = None  # the last word, not said yet

    def submit(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Run ``fn(*args, **kwargs)`` after everything submitted before it; ``what`` names it in logs. When the
        queue is full (the MetaServer is far slower than the syncs), the call runs here instead."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"awex-background-{self.name}", daemon=True)
                self._thread.start()
                _STARTED.add(self)
        try:
            self._queue.put_nowait((time.monotonic() + self.delay, what, fn, args, kwargs))
        except queue.Full:
            self._call(what, fn, args, kwargs)

    def log_line(self, line: str, now: bool) -> None:
        """Log ``line`` at INFO (where INFO is on): ``now``, or after what was submitted before, off the critical path
        (a line costs about 0.15 ms where it is written: a steady version's would follow its outcome)."""
        if not log.isEnabledFor(logging.INFO):
            return
        if now:
            log.info("%s", line)
        else:
            self.submit("logging the sync", log.info, "%s", line)

    def log_calls(self, line: str) -> list[tuple[str, Callable[[], Any]]]:
        """What logs ``line`` at INFO, as a ``(what, fn)`` pair for :meth:`run_each` (to go in the hand-over of a
        version's other calls: one wake-up of the thread); none where INFO is off."""
        return [("logging the sync", partial(log.info, "%s", line))] if log.isEnabledFor(logging.INFO) else []

    def last_word(self, what: str, fn: Callable[[], Any]) -> None:
        """Keep ``fn`` to run once, when this process's syncing stops (:meth:`say_last_word`: at the writer's close,
        or at exit); a later last word replaces it. For what only matters once the caller is gone (the record a
        version channel carried, for ranks that find the channel gone with it)."""
        self._last = (what, fn)
        _STARTED.add(self)

    def say_last_word(self) -> None:
        """Run the last word kept (:meth:`last_word`), if any, here and now; once."""
        last, self._last = self._last, None
        if last is not None:
            self._call(*last, (), {})

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything submitted so far was sent (or ``timeout`` passed); whether it was."""
        if self._thread is None:
            return True
        done = threading.Event()
        try:
            self._queue.put_nowait((0.0, "flush", done.set, (), {}))  # no delay of its own
        except queue.Full:
            return False
        return done.wait(max(0.0, timeout))

    def _run(self) -> None:
        while True:
            not_before, what, fn, args, kwargs = self._queue.get()
            wait = not_before - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            self._call(what, fn, args, kwargs)

    @classmethod
    def run_each(cls, calls) -> None:
        """Run ``(what, fn)`` pairs in order, each failure logged on its own (to hand several over at once)."""
        for what, fn in calls:
            cls._call(what, fn, (), {})

    @staticmethod
    def _call(what: str, fn, args, kwargs) -> None:
        started = time.monotonic()
        try:
            fn(*args, **kwargs)
        except Exception as e:  # informational requests: the sync's outcome does not depend on them
            log.warning("%s failed after %.2f s: %s", what, time.monotonic() - started, e)
