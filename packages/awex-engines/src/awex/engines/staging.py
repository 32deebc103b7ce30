"""Where a receiving rank stages a version (``receive="staged"``), and whether it stages at all: the policy the
engine bindings share.

- ``staging="device"`` (the default): the version is held in the engine's own device memory (the GPU); its commit
  is a copy on the GPU (a Qwen3-8B shape: about 16 GB more on the GPU, a commit of about 12 ms on an H200).
- ``staging="host"``: the version is held in pinned host memory; the transport's copies land there from the
  rank's GPU (CUDA IPC: copies from the trainer's memory, measured on an H200; NCCL: through its wave staging on the
  GPU, not yet run on two GPUs), and the
  commit copies it up to the GPU, so the GPU holds no second copy and the stall is a host-to-device copy of the
  shard (about 16 GB at 50 GB/s: about 0.3 s). On an engine that runs on the CPU both are host memory.

``staging_budget_bytes`` caps what a rank may stage, in either place: a rank whose shard does not fit receives in
place (paused for its transfer), said at ``staging/<instance>:<rank>`` on the MetaServer (:class:`Staging`'s
record) and in a warning, never silently.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from awex.meta import Box, Layout
from awex.meta.errors import AwexValueError
from awex.transport import LocalShards
from awex.transport.shards import torch_dtype

PLACES = ("device", "host")


def check_staging(where: object, budget: object, receive: str, who: str = "awex") -> None:
    """Refuse a staging place or budget that is not one, or that is given without ``receive="staged"``."""
    if where not in PLACES:
        raise AwexValueError(
            f"{who}: staging={where!r}; use 'device' (the engine's GPU) or 'host' (pinned host memory)"
        )
    if budget is not None and (type(budget) is not int or budget < 0):
        raise AwexValueError(f"{who}: staging_budget_bytes={budget!r}: a number of bytes (0 or more)")
    if receive != "staged" and (budget is not None or where != "device"):
        given = "staging_budget_bytes" if budget is not None else "staging='host'"
        raise AwexValueError(f"{who}: {given} is for receive='staged' (receive={receive!r})")


@dataclass(frozen=True)
class Staging:
    """One rank's staging: whether it stages (``staged``), where, the bytes its shard needs and the budget."""

    staged: bool
    where: str
    bytes: int
    budget: int | None

    @classmethod
    def decide(cls, need: int, budget: int | None, where: str) -> Staging:
        return cls(budget is None or need <= budget, where, need, budget)

    @property
    def reason(self) -> str | None:
        """Why the rank does not stage (``None`` where it does)."""
        if self.staged:
            return None
        return f"its shard ({self.bytes:,} bytes) does not fit the staging budget ({self.budget:,} bytes)"

    def record(self) -> dict:
        """What ``staging/<instance>:<rank>`` says on the MetaServer."""
        return {
            "staged": self.staged,
            "where": self.where,
            "bytes": self.bytes,
            "budget": self.budget,
            "reason": self.reason,
        }


def shard_bytes(layout: Layout, rank: int) -> int:
    """Bytes of the boxes ``layout`` gives ``rank``: what staging its whole shard takes."""
    return sum(
        box.numel * layout.tensor(name).spec.itemsize
        for name, boxes in layout.rank_boxes(rank).items()
        for box in boxes
    )


class StagingBuffers:
    """``view_of(name, box)`` answering one staging tensor per box (made at the first ask, kept between versions:
    :func:`buffer`). They never move: its fingerprint is constant (a steady version derives no view again)."""

    def __init__(self, layout: Layout, where: str, device: torch.device):
        self.layout, self.where, self.device = layout, where, device
        self.held: dict[tuple[str, Box], torch.Tensor] = {}

    def __call__(self, name: str, box: Box) -> torch.Tensor:
        t = self.held.get((name, box))
        if t is None:
            t = self.held[(name, box)] = buffer(
                box.sizes, torch_dtype(self.layout.tensor(name).spec.dtype), self.where, self.device
            )
        return t

    def fingerprint(self) -> tuple:
        return (), ()

    def addresses(self) -> tuple:
        return ()

    def forms(self) -> tuple:
        return ()

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.held.values())


def buffer(sizes: Sequence[int], dtype: torch.dtype, where: str, device: torch.device) -> torch.Tensor:
    """A staging tensor for a box of ``sizes``: on ``device``, or in pinned host memory (``where="host"`` on a GPU)."""
    if where == "host" and device.type != "cpu":
        return torch.empty(tuple(sizes), dtype=dtype, pin_memory=True)
    return torch.empty(tuple(sizes), dtype=dtype, device=device)


def transport_device(where: str, device: torch.device) -> torch.device | None:
    """The device a reader whose views are the staging tensors gives its transport (``LocalShards(device=)``): the
    GPU where they are in host memory, else ``None`` (the views' own)."""
    return device if where == "host" and device.type != "cpu" else None


def commit(staged: LocalShards, names: Iterable[str], target_of: Callable[[str, Box], Any], device: torch.device):
    """A staged version's commit: every box of ``names`` copied from the staged views into ``target_of(name, box)``
    (a view of the box's shape, or ``(sub-box, view)`` pieces that tile it), enqueued on the current stream and waited
    for once (from pinned host memory the copies run asynchronously; the staging is not written again before)."""
    for name in names:
        for box, _ in staged.pairs(name):
            target = target_of(name, box)
            for piece, t in [(box, target)] if isinstance(target, torch.Tensor) else target:
                for here, held in staged.pieces(name, piece.offsets, piece.sizes):
                    (t[here] if here else t).copy_(held, non_blocking=True)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
