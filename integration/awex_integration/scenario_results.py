"""What the scenario runner collects while it runs: trainer events from the MetaServer (:func:`wait_trainers`), the
receive reports of vLLM workers (:func:`add_receive_reports`), errors of the threads it starts (:func:`catching`)."""

from __future__ import annotations

import time

from awex.meta.client import MetaClient


def add_receive_reports(results: dict, reports: list[dict], steady: bool) -> None:
    """Fold one version's receive reports (one per vLLM worker) into the result."""
    if not reports:
        return
    for key in ("in_place_bytes", "loader_bytes", "in_place_tensors", "loader_tensors"):
        results[key] = sum(r[key] for r in reports)
    if steady:
        peaks = [r["peak_extra_bytes"] + r["held_bytes"] for r in reports if r["peak_extra_bytes"] is not None]
        if peaks:
            results["receiver_peak_extra_bytes"] = max(peaks + [results.get("receiver_peak_extra_bytes", 0)])
    results.setdefault("receive_reports", []).append(reports)


def wait_trainers(client: MetaClient, kind: str, version: str | None, count: int, after: int, timeout: float) -> list:
    """Wait for ``count`` trainer events of ``kind``; a ``trainer_failed`` event raises at once."""
    deadline = time.monotonic() + timeout
    found = []
    while len(found) < count:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{len(found)} of {count} trainer ranks sent {kind!r} within {timeout:g} s")
        for e in client.events(after, timeout=left):
            after = max(after, e["seq"])
            if e["kind"] == "trainer_failed":
                raise RuntimeError(f"{e['source']} failed: {e['data']}")
            if e["kind"] == kind and (version is None or e.get("version") == version):
                found.append(e)
    return found


def catching(errors: list, fn, *args):
    def run_it():
        try:
            fn(*args)
        except Exception as e:  # reported in the result, with any notes the library attached
            errors.append(" ".join([f"{type(e).__name__}: {e}", *getattr(e, "__notes__", [])]))

    return run_it
