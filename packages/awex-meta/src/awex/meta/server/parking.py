"""Long-polls parked on the MetaServer, counted and capped: in all (so requests that do not wait always find a
connection, the writer that would release the waiters included) and per client address (so one host cannot take
them all). A request that would park beyond a cap is answered at once with 503 ``busy`` and a retry hint; the
client waits that long and asks again (``awex.meta.client``)."""

from __future__ import annotations

import random
from collections import Counter
from typing import Callable

from awex.meta.server.errors import Busy
from awex.meta.server.state import Topics

RETRY_SECONDS = (0.2, 1.0)  # a busy answer's hint: uniform in this range, stretched by how full the server is


class Parking:
    """How many long-polls wait now, in all and per client address, and the caps on both."""

    def __init__(self, limit: int, per_client: int):
        self.limit, self.per_client = limit, per_client
        self.parked = 0
        self.by_client: Counter[str] = Counter()
        self.refused = 0  # busy answers given

    def retry_after(self) -> float:
        low, high = RETRY_SECONDS
        return low + random.random() * (high - low) * (1.0 + self.parked / max(1, self.limit))

    async def wait_until(
        self, topics: Topics, topic: str, predicate: Callable[[], bool], wait: float, client: str
    ) -> bool:
        """Park until ``predicate()`` holds (checked when ``topic`` fires) or ``wait`` seconds pass; raises
        :class:`Busy` instead of parking beyond a cap."""
        if wait <= 0 or predicate():
            return predicate()
        if self.parked >= self.limit or self.by_client[client] >= self.per_client:
            self.refused += 1
            whose = "in all" if self.parked >= self.limit else f"from {client}"
            cap = self.limit if self.parked >= self.limit else self.per_client
            raise Busy(f"{cap} requests wait already {whose}; ask again shortly", self.retry_after())
        self.parked += 1
        self.by_client[client] += 1
        try:
            return await topics.wait_until(topic, predicate, wait)
        finally:
            self.parked -= 1
            self.by_client[client] -= 1
            if not self.by_client[client]:
                del self.by_client[client]
