"""A MetaServer's limits and security settings."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    """Limits and security settings of a MetaServer."""

    token: str | None = None
    max_payload_bytes: int = 64 << 20  # one request body
    max_wait_seconds: float = 60.0
    max_keys_per_job: int = 100_000
    max_jobs: int = 1_000
    max_events_per_job: int = 10_000
    recent_events: int = 20
    max_job_bytes: int = 1 << 30  # keys, events, participants and agreement values of one job
    max_total_bytes: int = 4 << 30  # the same over every job
    max_small_bytes: int = 64 << 10  # one event's data, one agreement value, one participant's info
    max_agreements_per_job: int = 100_000
    max_participants_per_job: int = 100_000
    max_agreement_size: int = 1 << 20  # participants one agreement may expect
    max_depth: int = 64  # JSON nesting
    max_connections: int = 4096
    body_seconds: float = 30.0  # to read one request body
    idle_seconds: float = 120.0  # a connection with no request in flight is closed after this long
    remembered_replies: int = 8192  # answers kept for retried writes (by request id)
