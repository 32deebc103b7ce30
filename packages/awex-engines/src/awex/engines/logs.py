"""Awex's log lines where nobody set logging up: a Ray actor, an engine's worker process, a bare script. Python then
prints only warnings (its last-resort handler), and the lines that say what a sync did (``awex.engines`` at INFO:
each version sent and received, its phases) go nowhere. So, as vLLM does for its own logger, importing
``awex.engines`` gives the ``awex`` logger a handler of its own on standard error, at ``AWEX_LOGGING_LEVEL``
(``INFO`` by default), where neither it nor the root logger has one yet; an application that configured logging
first keeps its own setup, and ``AWEX_LOGGING_LEVEL=NONE`` leaves logging alone."""

from __future__ import annotations

import logging
import os
import sys

ENV = "AWEX_LOGGING_LEVEL"
FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def configure() -> logging.Handler | None:
    """Give the ``awex`` logger its handler where logging is not set up (see the module); the handler, or ``None``
    where nothing was changed."""
    level = os.environ.get(ENV, "INFO").strip().upper()
    logger = logging.getLogger("awex")
    if level == "NONE" or logger.handlers or logging.getLogger().handlers:
        return None
    if level not in LEVELS:
        print(f"awex: {ENV}={level!r} is not one of {', '.join(LEVELS)} or NONE; logging at INFO", file=sys.stderr)
        level = "INFO"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False  # set up later, the root's handlers would print each line a second time
    return handler
