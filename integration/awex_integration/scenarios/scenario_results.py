"""What the scenario runner returns (:class:`ScenarioResult`, one JSON line) and collects while it runs: trainer
events from the MetaServer (:func:`wait_trainers`), the receive reports of vLLM workers
(:meth:`ScenarioResult.add_receive_reports`), errors of the threads it starts (:func:`catching`)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from awex.meta.client import MetaClient


@dataclass
class StepResult:
    """One version: what moved, how long the sync took, what the checks found."""

    version: str
    bytes: int
    sync_seconds: float
    tensors_checked: int
    tensors_mismatched: int
    greedy_match: bool | None  # None: nothing generates (layout-only engines)


@dataclass
class ScenarioResult:
    """A scenario's outcome. ``ok`` only when every version was applied, every received tensor equals the trainer's
    and greedy output equals the reference's (float32); the optional fields are set where they apply and left out
    of the JSON otherwise (:meth:`to_json`)."""

    ok: bool = True
    steps: int = 0
    model_bytes: int = 0
    bytes: list[int] = field(default_factory=list)  # per version, every trainer rank's
    sync_seconds: list[float] = field(default_factory=list)
    tensors_checked: int = 0
    tensors_mismatched: int = 0
    greedy_match: bool | None = True
    per_step: list[StepResult] = field(default_factory=list)
    scenario: dict[str, Any] = field(default_factory=dict)  # the arguments it ran with
    transport: str | list[str] | None = None  # what the trainers' writers used ("gloo" for p2p on CPU)
    # a failed version: the error, and what the engines serve after it
    error: str | None = None
    failed_step: int | None = None
    error_seconds: float | None = None
    errors: list[str] | None = None
    kept_previous_output: bool | None = None
    reported_versions: dict[str, str | None] | None = None
    failure_events: list[str] | None = None
    trainer_errors: dict[str, str] | None = None
    engine_failed_before_sync: bool | None = None  # the engine could not generate before any sync
    # what the checks found, where they ran
    mismatched: dict[str, Any] | None = None  # per receiving rank's validation report: the tensors that differ
    state_differences: dict[str, Any] | None = None  # vLLM: tensors (derived ones too) unlike a fresh load's
    in_place_check: list[dict] | None = None
    in_place_verified: bool | None = None
    in_place_bytes: int | None = None
    loader_bytes: int | None = None
    in_place_tensors: int | None = None
    loader_tensors: int | None = None
    receiver_peak_extra_bytes: int | None = None
    receive_reports: list[list[dict]] | None = None
    engine_weight_versions: dict[str, str | None] | None = None
    stalls: list[dict] | None = None  # vLLM's trainer API: pause, sync and stall seconds per version and engine
    placement: dict[str, Any] | None = None  # Ray: where each rank ran

    def add_step(self, step: StepResult) -> None:
        self.bytes.append(step.bytes)
        self.sync_seconds.append(step.sync_seconds)
        self.tensors_checked += step.tensors_checked
        self.tensors_mismatched += step.tensors_mismatched
        self.greedy_match = None if step.greedy_match is None else (self.greedy_match and step.greedy_match)
        self.per_step.append(step)

    def add_receive_reports(self, reports: list[dict], steady: bool) -> None:
        """Fold one version's receive reports (one per vLLM worker) in."""
        if not reports:
            return
        for key in ("in_place_bytes", "loader_bytes", "in_place_tensors", "loader_tensors"):
            setattr(self, key, sum(r[key] for r in reports))
        if steady:
            peaks = [r["peak_extra_bytes"] + r["held_bytes"] for r in reports if r["peak_extra_bytes"] is not None]
            if peaks:
                self.receiver_peak_extra_bytes = max(peaks + [self.receiver_peak_extra_bytes or 0])
        self.receive_reports = [*(self.receive_reports or []), reports]

    def to_json(self) -> dict[str, Any]:
        """The JSON line (optional fields that are unset left out)."""
        return {k: v for k, v in asdict(self).items() if v is not None or k == "greedy_match"}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ScenarioResult:
        """A result read back; ``ValueError`` for a field this record does not have (the runner and its readers
        agree on one schema)."""
        unknown = set(doc) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"scenario result fields unknown to ScenarioResult: {sorted(unknown)}")
        steps = [StepResult(**s) for s in doc.get("per_step", [])]
        return cls(**{**doc, "per_step": steps})


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
