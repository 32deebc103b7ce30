"""A MetaServer's limits and security settings."""

from __future__ import annotations

from dataclasses import dataclass, replace

RESERVED_DESCRIPTORS = 128  # open files a server keeps for itself beyond its connections (logs, listeners...)


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
    status_participants: int = 100  # listed per job in the status of every job (all of them with ?job=)
    max_job_bytes: int = 1 << 30  # keys, events, participants and agreement values of one job
    max_total_bytes: int = 4 << 30  # the same over every job
    max_small_bytes: int = 64 << 10  # one event's data, one agreement value, one participant's info
    max_agreements_per_job: int = 100_000
    max_participants_per_job: int = 100_000
    max_agreement_size: int = 1 << 20  # participants one agreement may expect
    max_depth: int = 64  # JSON nesting
    max_connections: int = 16384  # sized down to the open-file limit at start-up (``sized``)
    max_connections_per_client: int | None = None  # from one address; None: 3/4 of max_connections
    max_parked: int | None = None  # long-polls waiting at once; None: 3/4 of max_connections
    max_parked_per_client: int | None = None  # from one address; None: 1/2 of max_parked
    body_seconds: float = 30.0  # to read one request body
    idle_seconds: float = 120.0  # a connection with no request in flight is closed after this long
    remembered_replies: int = 8192  # answers kept for retried writes (by request id)
    journal: str | None = None  # a file keeping fences, claims and served versions across restarts (journal.py)
    journal_fsync: bool = False  # flush each record to the disk (survives power loss), not only to the system
    store: str | None = (
        None  # "etcd://host:port,...[/prefix]": that state in etcd, servers leading in turn (etcd_store.py)
    )
    leader_ttl: int = 5  # with an etcd store: seconds a dead leader keeps the lead before another takes it

    def sized(self, descriptors: int | None = None) -> ServerConfig:
        """This configuration with every derived limit filled in: connections at most ``descriptors`` (the open-file
        limit) less :data:`RESERVED_DESCRIPTORS`; long-polls parked at once (3/4 of the connections, so other
        requests always find room) and the per-address caps (3/4 of the connections, 1/2 of the parked)."""
        connections = self.max_connections
        if descriptors is not None:
            connections = max(16, min(connections, descriptors - RESERVED_DESCRIPTORS))
        parked = self.max_parked or max(1, connections * 3 // 4)
        return replace(
            self,
            max_connections=connections,
            max_connections_per_client=self.max_connections_per_client or max(1, connections * 3 // 4),
            max_parked=min(parked, connections),
            max_parked_per_client=self.max_parked_per_client or max(1, parked // 2),
        )
