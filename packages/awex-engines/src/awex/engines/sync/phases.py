"""Seconds per named phase of one sync: what the benchmarks and the first sync's log line report."""

from __future__ import annotations

import time
from contextlib import contextmanager


class Phases(dict):
    """Seconds spent in each named phase of one sync (``phases("plan")`` as a context manager adds to it)."""

    def summary(self) -> str:
        """``plan 0.012 s, agreement 0.101 s, ...`` (phases in the order they ran; ``total`` last)."""
        items = [(k, v) for k, v in self.items() if k != "total"] + [(k, v) for k, v in self.items() if k == "total"]
        return ", ".join(f"{k} {v:.3f} s" for k, v in items)

    @contextmanager
    def __call__(self, name: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self[name] = self.get(name, 0.0) + time.perf_counter() - started
