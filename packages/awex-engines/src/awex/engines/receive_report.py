"""What one engine rank received of one version (published at ``received/<version>/<instance>:<rank>``)."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

from awex.engines.sync import keys
from awex.meta.client import MetaClient


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


def publish_report(client: MetaClient, report: ReceiveReport, log: logging.Logger) -> None:
    """Put ``report`` at ``received/<version>/<instance>:<rank>``; a failure is logged, not raised (the version is
    applied already: the report is for monitoring)."""
    try:
        client.put(keys.received(report.version, report.instance, report.rank), report.to_json())
    except Exception as e:  # noqa: BLE001 - monitoring must not fail an applied version
        log.warning("could not publish the receive report of %s: %s", report.version, e)
