"""What crosses into SGLang's workers for one version: the engine's Awex settings (:class:`AwexSglangInfo`) and the
request (:class:`SglangUpdateRequest`), as JSON in the name of one empty tensor (SGLang's weight-update API carries
named tensors; no Awex data is unpickled), checked field by field before anything else happens.

A request's ``step`` is ``None`` (receive the version and apply it now) or, with ``receive="staged"``, one step of
the staged protocol that :class:`~awex.engines.sglang_updaters.SglangHttpUpdater` drives: ``"prepare"`` (set the
receiver up; each rank says at ``staging/<instance>:<rank>`` whether it stages), ``"stage"`` (start receiving on a
thread and return: SGLang keeps generating), then ``"commit"`` (apply what arrived, SGLang paused) or ``"drop"``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any, Sequence

import torch

from awex.engines.staging import check_staging
from awex.meta.errors import AwexValueError

LOADER = "awex.engines.sglang.receive_weights"  # the value of SGLang's --custom-weight-loader and load_format
REQUEST_PREFIX = "awex-request:"  # the request tensor's name starts with this; the JSON follows


@dataclass(frozen=True)
class AwexSglangInfo:
    """Where the MetaServer is and which instance this engine is (constant across versions)."""

    meta_address: str
    instance: str = "sglang"
    job: str = "default"
    token: str | None = None
    timeout: float = 300.0
    receive: str = "in_place"  # or "staged": received while SGLang generates, paused for the commit (SglangHttpUpdater)
    staging: str = "device"  # staged: "device" (the GPU) or "host" (pinned host memory): awex.engines.staging
    staging_budget_bytes: int | None = None  # staged: the most a rank may stage (a larger shard receives in place)

    def __post_init__(self) -> None:
        if self.receive not in ("in_place", "staged"):
            raise AwexValueError(f"sglang: receive={self.receive!r}; use 'in_place' or 'staged'")
        check_staging(self.staging, self.staging_budget_bytes, self.receive, "sglang")


STEPS = (None, "prepare", "stage", "commit", "drop")  # receive and apply now, or a step of the staged protocol


@dataclass(frozen=True)
class SglangUpdateRequest:
    """One version to receive, as it crosses into SGLang's workers (JSON in a tensor name)."""

    version: str
    info: AwexSglangInfo
    validate: str | None = None  # an HF safetensors checkpoint to compare every received tensor with
    step: str | None = None  # staged: "prepare" (set up, say whether it stages), "stage", then "commit" or "drop"

    def to_named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        body = {"version": self.version, "validate": self.validate, "step": self.step, **asdict(self.info)}
        return [(REQUEST_PREFIX + json.dumps(body, sort_keys=True), torch.empty(0, dtype=torch.uint8))]

    @classmethod
    def from_named_tensors(cls, named_tensors: Sequence[tuple[str, Any]]) -> SglangUpdateRequest:
        """Parse and check the request (``ValueError`` naming what is wrong, before anything else happens)."""
        if len(named_tensors) != 1 or not str(named_tensors[0][0]).startswith(REQUEST_PREFIX):
            names = [str(n)[:60] for n, _ in list(named_tensors)[:3]]
            raise AwexValueError(
                f"{LOADER} expects one request made by SglangUpdateRequest.to_named_tensors(), got {names} "
                f"({len(named_tensors)} tensors)"
            )
        try:
            body = json.loads(named_tensors[0][0][len(REQUEST_PREFIX) :])
        except json.JSONDecodeError as e:
            raise AwexValueError(f"{LOADER}: the request is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise AwexValueError(f"{LOADER}: the request must be a JSON object")
        expected = {
            "version": str,
            "validate": (str, type(None)),
            "meta_address": str,
            "instance": str,
            "job": str,
            "token": (str, type(None)),
            "timeout": (int, float),
            "receive": str,
            "staging": str,
            "staging_budget_bytes": (int, type(None)),
            "step": (str, type(None)),
        }
        unknown = sorted(set(body) - set(expected))
        missing = sorted({"version", "meta_address"} - set(body))
        if unknown or missing:
            raise AwexValueError(f"{LOADER}: request fields unknown {unknown}, missing {missing}")
        for key, kind in expected.items():
            if key in body and not isinstance(body[key], kind):
                raise AwexValueError(f"{LOADER}: request field {key!r} has type {type(body[key]).__name__}")
        if not body["version"] or body.get("timeout", 1) <= 0:
            raise AwexValueError(f"{LOADER}: the version must be non-empty and the timeout positive")
        if body.get("step") not in STEPS:
            raise AwexValueError(f"{LOADER}: request step {body.get('step')!r}; one of {STEPS}")
        info = AwexSglangInfo(**{f.name: body[f.name] for f in fields(AwexSglangInfo) if f.name in body})
        return cls(body["version"], info, body.get("validate"), body.get("step"))
