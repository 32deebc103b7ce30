"""What one engine rank received of one version (published at ``received/<version>/<instance>:<rank>``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ReceiveReport:
    """What one worker received of one version, and what it cost in memory (published on the MetaServer)."""

    version: str
    instance: str
    rank: int
    in_place_tensors: int
    in_place_bytes: int
    loader_tensors: int
    loader_bytes: int
    seconds: float
    peak_extra_bytes: int | None  # peak during the sync above what the process held before it
    held_bytes: int  # sync buffers kept between versions (staging), not counted in peak_extra_bytes

    def to_json(self) -> dict:
        return asdict(self)
