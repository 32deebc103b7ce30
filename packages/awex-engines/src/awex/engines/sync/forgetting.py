"""Old versions' records on the MetaServer, dropped a batch of versions at a time (:class:`Forgetting`)."""

from __future__ import annotations

import logging

from awex.meta.client import MetaClient
from awex.meta.errors import MetaServerError

log = logging.getLogger("awex.engines")

CLOSE_SECONDS = 2.0
"""How long a closing writer waits for the last batch's request (a server that is gone does not hold the close up)."""

FORGET_EVERY = 8
"""Versions whose records one request drops. A request a version was about a fifth of the MetaServer's CPU a steady
version at 1,024 ranks (docs/performance.md); the server keeps up to this many more versions' records meanwhile."""


class Forgetting:
    """Versions whose MetaServer records nobody needs any more (``names`` and ``prefixes`` for
    :meth:`MetaClient.forget`), dropped in one request once :data:`FORGET_EVERY` of them wait, and on :meth:`flush`
    (the writer's close). A failed request only costs server memory: it is logged, and those records stay."""

    def __init__(self, client: MetaClient, every: int | None = None):
        self.client, self.every = client, every or FORGET_EVERY
        self._versions: list[str] = []
        self._names: list[str] = []
        self._prefixes: list[str] = []

    @property
    def waiting(self) -> list[str]:
        """Versions whose records wait for the next request, oldest first."""
        return list(self._versions)

    def add(self, version: str, names: list[str], prefixes: list[str]) -> None:
        self._versions.append(version)
        self._names += names
        self._prefixes += prefixes
        if len(self._versions) >= self.every:
            self.flush()

    def flush(self, timeout: float | None = None) -> None:
        """Drop the records waiting now, in one request (``timeout``: its own, where not the client's)."""
        if not self._versions:
            return
        versions, names, prefixes = self._versions, self._names, self._prefixes
        self._versions, self._names, self._prefixes = [], [], []
        try:
            gone = self.client.forget(names, prefixes, timeout=timeout)
            log.debug("forgot versions %s: %s", versions, gone)
        except (MetaServerError, OSError) as e:  # the writes themselves succeeded; the records only cost memory
            log.warning("could not drop the MetaServer records of versions %s: %s", versions, e)
