"""The MetaServer's safety state in etcd (``awex-meta serve --store etcd://host:port,...``): several MetaServer
processes on one etcd cluster, one serving at a time, the others standing by to take over.

What the journal keeps (``awex.meta.server.journal``: fences and their epochs, claimed names and who wrote them,
the claim lease, the version each participant serves) is kept here as one etcd key per item, under
``<prefix>/jobs/<job>/<kind>/<name>``, a request's changes written in one transaction before it is answered.
Leadership is an etcd key held by a lease (``<prefix>/leader``): a server takes it with a transaction that succeeds
only while no one holds it, then restores the state from etcd before it listens; the others wait for the key to go
(its holder stopped, or died and its lease ran out) and take it then. Every change is a transaction that holds
only while the key is still the one this server created, so a server that lost the lead (frozen past its lease,
cut off from etcd) cannot change anything: its change is refused, its request answered 503, and it stops.
Between two renewals a server serves only while its lease surely lasts (counted from when it sent the renewal,
less a margin), so two servers never answer at once. Values, events and agreements stay in the serving process,
as with the journal: the next server is asked for them again (clients publish again what they own on its new epoch).
A client given every server's address (``MetaClient("http://a:1,http://b:2")``) moves to the one that answers.

etcd keeps the data on its members (three survive one's loss); who may reach etcd may change what makes versions
safe, so give it the MetaServer's network and etcd's own authentication.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
import urllib.parse
from typing import Any, Callable, Sequence

from awex.meta.errors import AwexValueError
from awex.meta.server.etcd import Etcd, EtcdError, created, delete, endpoints_of, get, put, ranged, revision_of
from awex.meta.server.journal import JournalError, Kept

log = logging.getLogger("awex.meta.server")

LEADER_TTL = 5  # seconds a leader's etcd lease lasts without renewal (a dead leader is replaced after this)
MARGIN = 1.0  # seconds before its lease would end that a leader stops answering, unless renewed
TXN_OPS = 100  # changes per transaction (etcd allows 128 by default)
_ORDER = {"fence": 0, "claim": 1, "lease": 2, "participant": 3, "serves": 4}  # serves after their participant


def _quote(name: str) -> str:
    return urllib.parse.quote(name, safe="")


class EtcdStore:
    """The safety state of every job in the etcd cluster at ``url`` (``etcd://host:port[,...][/prefix]``), this
    server its leader once :meth:`load` returned. ``address``: where this server will listen (told to the others
    while they wait). ``lost()``: called once if the lead is lost (the server stops)."""

    def __init__(self, url: str, address: str = "", ttl: int = LEADER_TTL, lost: Callable[[], None] | None = None):
        if not 2 <= ttl <= 3600:
            raise AwexValueError(f"leader lease of {ttl} s: 2 to 3600")
        endpoints, self.prefix = endpoints_of(url)
        self.url, self.ttl, self.address = url, int(ttl), address
        self.etcd = Etcd(endpoints)
        self.lost = lost
        self._key = f"{self.prefix}/leader".encode()
        self._lease = 0
        self._revision = 0  # the leader key's create revision while this server holds it
        self._until = 0.0  # time.monotonic() until which this server surely leads
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._deposed = False
        self._pending: dict[bytes, dict] = {}  # key -> its change, until flushed
        self.transactions = 0  # changes written (each one transaction with a request's changes)

    # -- the lead --------------------------------------------------------------------------------------------
    def lead(self) -> None:
        """Take the lead, waiting as long as another server holds it; :class:`JournalError` when etcd cannot be
        reached."""
        me = json.dumps({"address": self.address, "id": secrets.token_hex(8)}).encode()
        said = None
        while True:
            try:
                holder = self.etcd.range(self._key)  # a lease is asked for only when the key is free
                if not holder:
                    sent = time.monotonic()
                    lease = self.etcd.grant(self.ttl)
                    ok, answer = self.etcd.txn([created(self._key, 0)], [put(self._key, me, lease)], [get(self._key)])
                    if ok:
                        self._lease, self._revision = lease, revision_of(answer)
                        self._until = sent + self.ttl - MARGIN
                        break
                    self.etcd.revoke(lease)  # another server took it first
                    holder = ranged(answer)
            except EtcdError as e:
                raise JournalError(f"cannot reach etcd at {self.url}: {e}") from None
            if holder and holder[0].value != said:
                said = holder[0].value
                log.info("MetaServer standing by: another server leads (%s)", said.decode(errors="replace"))
            time.sleep(max(0.2, self.ttl / 5))
        log.info("MetaServer leads on etcd at %s (prefix %s)", self.url, self.prefix)
        self._thread = threading.Thread(target=self._renew, name="awex-meta-lead", daemon=True)
        self._thread.start()

    def serving(self) -> bool:
        """Whether this server surely leads now (its lease renewed within its length less the margin)."""
        return not self._deposed and time.monotonic() < self._until

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl / 4):
            sent = time.monotonic()
            try:
                left = self.etcd.keepalive(self._lease)  # counted from when it was sent, however long it took
            except EtcdError as e:
                if time.monotonic() >= self._until:
                    log.warning("MetaServer cannot renew its lead on etcd (%s); not answering until it does", e)
                continue
            if left <= 0:
                self._depose("its etcd lease ended (another server may lead now)")
                return
            self._until = sent + left - MARGIN

    def _depose(self, why: str) -> None:
        if self._deposed:
            return
        self._deposed = True
        log.error("MetaServer lost the lead: %s; it stops serving", why)
        if self.lost is not None:
            self.lost()

    # -- the state -------------------------------------------------------------------------------------------
    def load(self) -> dict[str, Kept]:
        """Take the lead (:meth:`lead`, if not yet) and read back every job's safety state."""
        if not self._revision:
            self.lead()
        try:
            items = self.etcd.range(f"{self.prefix}/jobs/".encode(), prefix=True)
        except EtcdError as e:
            raise JournalError(f"cannot read the MetaServer state from etcd at {self.url}: {e}") from None
        records = []
        for kv in items:
            try:
                record = json.loads(kv.value)
                if not isinstance(record, dict) or record.get("op") not in _ORDER:
                    raise AwexValueError("not a record")
                records.append(record)
            except ValueError as e:
                raise JournalError(
                    f"the MetaServer state in etcd is damaged at {kv.key.decode(errors='replace')} ({e}); refusing "
                    "to serve on a state that may have lost fences or claims"
                ) from None
        jobs: dict[str, Kept] = {}
        for record in sorted(records, key=lambda r: _ORDER[r["op"]]):
            try:
                jobs.setdefault(str(record["job"]), Kept()).apply(record)
            except (ValueError, KeyError) as e:
                raise JournalError(f"the MetaServer state in etcd holds a bad record ({e}): {record}") from None
        log.info("MetaServer state from etcd: %d jobs, %d records", len(jobs), len(records))
        return jobs

    def append(self, record: dict[str, Any], everything: Any = None) -> None:
        """Keep one change: held until :meth:`flush`, which the server calls before it answers any request (so a
        request's changes reach etcd in one transaction, before its answer); :class:`JournalError` (the change is
        not made, the request answered 503) while this server does not lead."""
        if not self.serving():
            raise JournalError("this MetaServer does not lead (any more): ask another")
        op, job = record["op"], _quote(record["job"])
        base = f"{self.prefix}/jobs/{job}/"
        if op in ("fence", "claim", "release"):
            name = record["id"] if op == "fence" else record["key"]
            key = f"{base}{'fence' if op == 'fence' else 'claim'}/{_quote(name)}".encode()
        elif op in ("lease", "unlease"):
            key = f"{base}lease".encode()
        elif op in ("participant", "serves"):
            key = f"{base}{op}/{_quote(record['name'])}".encode()
        else:
            raise JournalError(f"no etcd key for a {op!r} record")
        self._pending.pop(key, None)  # one operation per key in a transaction: the last change
        self._pending[key] = (
            delete(key) if op in ("release", "unlease") else put(key, json.dumps(record, sort_keys=True).encode())
        )

    def append_all(self, records: Sequence[dict[str, Any]], everything: Any = None) -> None:
        """:meth:`append` each (held together until :meth:`flush` anyway)."""
        for record in records:
            self.append(record)

    def flush(self) -> None:
        """Write the changes held since the last flush, in transactions that hold only while this server leads;
        when one cannot be written the server loses the lead (its memory holds changes etcd does not: it must not
        answer again) and :class:`JournalError` says so."""
        while self._pending:
            keys = list(self._pending)[:TXN_OPS]
            changes = [self._pending[k] for k in keys]
            try:
                # not bounded by the lease: the compare alone decides (a transaction made after the lead was lost
                # fails), and etcd electing a new leader of its own (a member lost) may take a second or two
                ok, _ = self.etcd.txn([created(self._key, self._revision)], changes)
            except EtcdError as e:
                self._depose(f"a change could not be kept in etcd ({e})")
                raise JournalError(f"cannot keep a change in etcd at {self.url}: {e}") from None
            if not ok:
                self._depose("its leader key is gone or another's")
                raise JournalError("this MetaServer lost the lead: ask another")
            for k in keys:
                del self._pending[k]
            self.transactions += 1

    def close(self) -> None:
        """Give the lead back (another server takes it at once) and stop renewing."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
        if self._lease and not self._deposed:
            try:
                self.etcd.revoke(self._lease)
            except EtcdError as e:
                log.warning("MetaServer could not give its lead back (it ends with its lease): %s", e)
        self._lease = self._revision = 0
