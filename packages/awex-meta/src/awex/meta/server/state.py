"""In-memory state of the MetaServer: per job, a key-value store, participants, events and agreements.

Values are JSON documents held as the bytes that arrived (validated as JSON, never evaluated). Every change
notifies an asyncio condition so that long-polling readers wake at once.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Participant:
    name: str
    role: str
    instance: str
    world_size: int
    host: str
    registered_at: float
    last_seen: float
    weight_version: str | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "role": self.role,
            "instance": self.instance,
            "world_size": self.world_size,
            "host": self.host,
            "weight_version": self.weight_version,
            "registered_at": self.registered_at,
            "last_seen": self.last_seen,
            "info": self.info,
        }


@dataclass
class Agreement:
    expected: int
    values: dict[str, Any] = field(default_factory=dict)  # participant -> value


class JobState:
    """One job's state. All methods run on the server's event loop."""

    def __init__(self, name: str, max_events: int, max_keys: int):
        self.name = name
        self.kv: dict[str, bytes] = {}
        self.kv_bytes = 0
        self.max_keys = max_keys
        self.participants: dict[str, Participant] = {}
        self.events: deque[dict[str, Any]] = deque(maxlen=max_events)
        self.next_seq = 1
        self.agreements: dict[str, Agreement] = {}
        self.changed = asyncio.Condition()

    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def wait_until(self, predicate, timeout: float) -> bool:
        """Wait until ``predicate()`` holds or ``timeout`` seconds pass; returns whether it holds."""
        deadline = time.monotonic() + timeout
        async with self.changed:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                try:
                    await asyncio.wait_for(self.changed.wait(), left)
                except asyncio.TimeoutError:
                    return predicate()
            return True

    def add_event(self, kind: str, source: str, version: str | None, data: Any) -> dict[str, Any]:
        event = {"seq": self.next_seq, "time": time.time(), "kind": kind, "source": source,
                 "version": version, "data": data}
        self.next_seq += 1
        self.events.append(event)
        return event

    def summary(self, recent: int) -> dict[str, Any]:
        return {
            "participants": [p.to_json() for p in sorted(self.participants.values(), key=lambda p: p.name)],
            "keys": len(self.kv),
            "key_bytes": self.kv_bytes,
            "agreements": len(self.agreements),
            "recent_events": list(self.events)[-recent:],
        }
