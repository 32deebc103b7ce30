"""Rank 0's claim lease: while the MetaServer lets this writer alone claim version names in its job
(``awex.meta.server.leases``), a fresh name's claim is sent and not waited for, so a steady version's critical path has
no round trip to the MetaServer.

A thread takes the lease and renews it every quarter of its length. The lease counts here from when the request was
sent and there from when it was answered, so it ends here first; :data:`MARGIN` more is kept for a claim's travel.
The lease holds the keys of version names (``sync/...``): no other client writes one while it lasts. A name is fresh
when neither the grant's digests (every name claimed in the job, and every such key, when it was granted) nor this
writer's own claims since name it; any other name (a retry of a failed attempt, a name another writer used) is
claimed by a round trip as before. A renewal refused (another writer wants the lease, or this writer was replaced)
ends the lease here at once; a renewal that fails lets it run out. A version whose claim the server refuses in the
end (only when the lease was lost with a server that restarted without a journal) fails.
"""

from __future__ import annotations

import logging
import threading
import time

from awex.meta.client import MetaClient
from awex.meta.errors import AwexValueError, MetaFencedError, MetaServerError
from awex.meta.protocol import claim_digest

log = logging.getLogger("awex.engines")

DEFAULT_SECONDS = 10.0  # a lease's length: also the longest a replacement waits for a writer that died holding it
MARGIN = 1.0  # seconds of a lease not used here: a claim sent on the lease reaches the server before it ends there


def checked(seconds: object) -> float:
    """A claim lease's length as ``WeightsWriter(claim_lease=...)`` accepts it, else ``ValueError``."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not MARGIN * 2 < seconds <= 60:
        raise AwexValueError(f"claim_lease={seconds!r}: seconds, more than {MARGIN * 2:g} and at most 60 (or None)")
    return float(seconds)


class ClaimLease:
    """Keeps this writer's claim lease (see the module); :meth:`covers` says whether a name's claim need not wait."""

    def __init__(self, client: MetaClient, prefix: str, seconds: float = DEFAULT_SECONDS):
        self.client, self.prefix, self.seconds = client, prefix, checked(seconds)
        self._server: str | None = None  # the MetaServer process that granted it (a restart there ends it here)
        self._lock = threading.Lock()
        self._until = 0.0  # time.monotonic() until which claims here need not wait
        self._names: set[str] | None = None  # digests of the names claimed in the job (None: not granted yet)
        self._mine: set[str] = set()  # digests of the names this writer sent claims for
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="awex-claim-lease", daemon=True)
        self._thread.start()

    def covers(self, key: str) -> bool:
        """Whether a claim of ``key`` may be sent without waiting for its answer: the lease lasts for more than
        :data:`MARGIN` and nobody claimed ``key`` before."""
        digest = claim_digest(key)
        with self._lock:
            return (
                key.startswith(self.prefix)
                and self._names is not None
                and self.client.epoch == self._server
                and time.monotonic() + MARGIN < self._until
                and digest not in self._names
                and digest not in self._mine
            )

    def claiming(self, key: str) -> None:
        """A claim of ``key`` was sent (by whichever path): never again one that is not waited for."""
        with self._lock:
            self._mine.add(claim_digest(key))

    @property
    def held(self) -> bool:
        with self._lock:
            return time.monotonic() + MARGIN < self._until

    def close(self) -> None:
        """Stop renewing and give the lease back (a replacement need not wait for it to end)."""
        self._stop.set()
        self._thread.join(timeout=self.client.timeout + 2)
        with self._lock:
            held, self._until = self._until > time.monotonic(), 0.0
        if held:
            try:
                self.client.lease(self.seconds, give_back=True)
            except MetaServerError as e:
                log.info("could not give the claim lease back (it ends by itself within %g s): %s", self.seconds, e)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self._renew()
                except MetaFencedError:
                    log.info("claim lease: this writer was replaced; no lease from now on")
                    return
                except Exception as e:  # the lease runs out by itself; tried again at the next turn
                    log.debug("claim lease not renewed: %s", e)
                self._stop.wait(self.seconds / 4)
        finally:
            self.client.close()  # this thread's connection

    def _renew(self) -> None:
        sent = time.monotonic()
        with self._lock:  # a lease not live here may have lapsed there too: other writers may have claimed since
            names = self._names is None or sent >= self._until
        answer = self.client.lease(self.seconds, self.prefix, names=names)
        with self._lock:
            if not answer.get("granted"):
                if self._until:
                    why = answer.get("why")
                    log.info("claim lease not renewed (%s): version names are claimed by a round trip", why)
                self._until = 0.0
                return
            if names:
                digests = answer.get("names", "")
                if not isinstance(digests, str) or len(digests) % 16:
                    raise MetaServerError("claim lease: the names' digests are malformed")
                self._names = {digests[i : i + 16] for i in range(0, len(digests), 16)}
            self._until = sent + min(float(answer.get("seconds", 0)), self.seconds)
            self._server = self.client.epoch
