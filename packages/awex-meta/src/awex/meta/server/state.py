"""In-memory state of the MetaServer: per job, a key-value store, participants, events and agreements.

Values are JSON documents held as the bytes that arrived (validated as JSON, never evaluated). Waiters wait on a
topic (one key, the job's events, one agreement) and only a change to that topic wakes them: a write wakes the
requests that wait for it, not every request parked on the server.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import secrets
import time
from bisect import bisect_left, insort
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable

from awex.meta.server.journal import Claim, Kept


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
    last_sync: dict[str, Any] | None = None  # the last version reported: version, at (time), bytes, seconds

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "role": self.role,
            "instance": self.instance,
            "world_size": self.world_size,
            "host": self.host,
            "weight_version": self.weight_version,
            "last_sync": self.last_sync,
            "registered_at": self.registered_at,
            "last_seen": self.last_seen,
            "info": self.info,
        }


@dataclass
class Agreement:
    """One agreement's values, with the distinct ones counted as they arrive (linear in the participants)."""

    expected: int
    values: dict[str, str] = field(default_factory=dict)  # participant -> its value as canonical JSON
    value_bytes: int = 0  # values and participant names, as charged
    counts: Counter[str] = field(default_factory=Counter)  # canonical value -> participants that gave it
    first: dict[str, Any] = field(default_factory=dict)  # canonical value -> the value, in order of arrival
    gather: bool = False  # the complete answer carries every participant's value
    _gathered: bytes | None = None  # that answer, encoded once
    aborted: tuple[str, str] | None = None  # (participant, cause): given up before it was complete; never completes

    def holds(self, participant: str, value: Any) -> bool:
        """Whether ``participant`` gave ``value`` (a retry of its request, once complete: nothing changes)."""
        return self.values.get(participant) == json.dumps(value, sort_keys=True, separators=(",", ":"))

    def give(self, participant: str, value: Any) -> None:
        key = json.dumps(value, sort_keys=True, separators=(",", ":"))
        old = self.values.get(participant)
        if old is not None:
            self.counts[old] -= 1
            if not self.counts[old]:
                del self.counts[old], self.first[old]
        self.values[participant] = key
        self.counts[key] += 1
        self.first.setdefault(key, value)

    @property
    def complete(self) -> bool:
        return self.aborted is None and len(self.values) >= self.expected

    def answer(self) -> dict[str, Any]:
        """What an aborted agreement answers every participant."""
        by, cause = self.aborted or ("", "")
        return {"complete": False, "arrived": len(self.values), "expected": self.expected, "aborted": cause, "by": by}

    def gathered(self) -> bytes:
        """The complete gather's answer (JSON), encoded once from the canonical values as they are."""
        if self._gathered is None:
            distinct = list(self.first.values())
            values = ",".join(f"{json.dumps(p)}:{v}" for p, v in sorted(self.values.items()))
            head = {"complete": True, "arrived": len(self.values), "expected": self.expected, "distinct": len(distinct)}
            self._gathered = (json.dumps(head)[:-1] + ',"distinct_values":' + json.dumps(distinct[:8])
                              + ',"values":{' + values + "}}").encode()  # fmt: skip
        return self._gathered


class Topics:
    """Futures parked per topic; :meth:`fire` wakes the ones of one topic."""

    def __init__(self) -> None:
        self._waiters: dict[str, set[asyncio.Future]] = {}

    def fire(self, topic: str) -> None:
        for fut in self._waiters.pop(topic, ()):
            if not fut.done():
                fut.set_result(None)

    def waiting(self) -> int:
        return sum(len(w) for w in self._waiters.values())

    async def wait_until(self, topic: str, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``predicate()`` holds (checked whenever ``topic`` fires) or ``timeout`` seconds pass."""
        deadline = time.monotonic() + timeout
        loop = asyncio.get_running_loop()
        while not predicate():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            fut = loop.create_future()
            self._waiters.setdefault(topic, set()).add(fut)
            try:
                await asyncio.wait_for(fut, left)
            except asyncio.TimeoutError:
                return predicate()
            finally:
                waiters = self._waiters.get(topic)
                if waiters is not None:
                    waiters.discard(fut)
                    if not waiters:
                        del self._waiters[topic]
        return True


_SEQ_BASE = 1 << 40  # event numbers stay below 2**53 (exact in every JSON reader)


@dataclass
class Lease:
    """A writer's claim lease (``awex.meta.server.leases``)."""

    holder: str  # the fence of the writer holding it
    until: float  # time.monotonic() when it ends, here
    prefix: str  # the keys it holds: no other writer claims or writes one while it lasts
    seconds: float  # its length (journalled once; a restarted server restores it live this long)
    wanted: bool = False  # someone waits for it: not renewed


class JobState:
    """One job's state. All methods run on the server's event loop."""

    def __init__(self, name: str, max_events: int, max_keys: int):
        self.name = name
        self.kv: dict[str, bytes] = {}
        self._ordered: list[str] = []  # kv's keys, sorted: the keys under a prefix by bisection, not a scan of all
        self.kv_bytes = 0
        self.max_keys = max_keys
        self.participants: dict[str, Participant] = {}
        self.participant_bytes = 0
        self.events: deque[dict[str, Any]] = deque(maxlen=max_events)
        self.event_bytes: deque[int] = deque(maxlen=max_events)
        self.events_held = 0  # sum(event_bytes)
        self.agreement_bytes = 0  # the agreements' value_bytes summed
        # event numbers of this job on this server begin at a random point, so a cursor (``after``) from an
        # earlier server process or another job is told apart per request (``cursor_ok``), whoever saw what
        self.base = _SEQ_BASE + secrets.randbelow(_SEQ_BASE)
        self.next_seq = self.base + 1
        self.agreements: dict[str, Agreement] = {}
        self.topics = Topics()
        self.fences: dict[str, int] = {}  # writer identity -> its current epoch (awex.meta.server.fences)
        self.claims: dict[str, Claim] = {}  # keys created once (create=1): never created again, kept when forgotten
        self.lease: Lease | None = None  # who alone may claim names now (awex.meta.server.leases)
        self.lease_contended_until = 0.0  # time.monotonic() until which no lease is granted (several writers)
        # the journal's append_all (awex.meta.server.journal): records written together, before their changes
        self.remember: Callable[[list[dict[str, Any]]], None] | None = None

    def note(self, op: str, **fields: Any) -> None:
        """Journal one change of the safety state, before it is made and answered (nothing without a journal)."""
        if self.remember is not None:
            self.remember([{"op": op, "job": self.name, **fields}])

    def note_all(self, notes: list[tuple[str, dict[str, Any]]]) -> None:
        """:meth:`note` for several changes ``(op, fields)`` of one request, in one write, before any is made."""
        if self.remember is not None and notes:
            self.remember([{"op": op, "job": self.name, **fields} for op, fields in notes])

    def kept(self) -> Kept:
        """The safety state, as the journal keeps it."""
        participants = {
            p.name: {"role": p.role, "instance": p.instance, "world_size": p.world_size, "serves": p.weight_version}
            for p in self.participants.values()
        }
        lease = self.lease
        live = lease is not None and lease.until > time.monotonic()
        held = (lease.holder, lease.seconds, lease.prefix) if live else None  # its whole length, as journalled
        return Kept(dict(self.fences), dict(self.claims), participants, held)

    def restore(self, kept: Kept) -> None:
        """Take back the safety state a journal kept (a restarted server, before it answers anything)."""
        self.fences, self.claims = dict(kept.fences), dict(kept.claims)
        if kept.lease is not None:  # live for its whole length from now: how much of it had passed is unknown
            holder, seconds, prefix = kept.lease
            self.lease = Lease(holder, time.monotonic() + seconds, prefix, seconds)
        now = time.time()
        for name, p in kept.participants.items():
            self.participants[name] = Participant(
                name, p["role"], p["instance"], p.get("world_size", 1), "", now, now, weight_version=p.get("serves")
            )
            self.participant_bytes += len(name) + len(p["instance"]) + 2  # as registered, with no info

    @staticmethod
    def kv_cost(key: str, raw: bytes | None) -> int:
        """What a key holds against the job's byte limit: its value and its name (0 if absent)."""
        return 0 if raw is None else len(raw) + len(key)

    def set_kv(self, key: str, raw: bytes) -> None:
        old = self.kv.get(key)
        if old is None:
            insort(self._ordered, key)
        self.kv_bytes += self.kv_cost(key, raw) - self.kv_cost(key, old)
        self.kv[key] = raw

    def pop_kv(self, key: str) -> bytes | None:
        raw = self.kv.pop(key, None)
        if raw is not None:
            del self._ordered[bisect_left(self._ordered, key)]
        self.kv_bytes -= self.kv_cost(key, raw)
        return raw

    def keys_under(self, prefix: str) -> list[str]:
        """The keys that start with ``prefix``, sorted (``""``: every key): found by bisection, so a request
        that reads or drops one version's records costs what it finds, not the job's size."""
        ordered = self._ordered
        start = end = bisect_left(ordered, prefix)
        while end < len(ordered) and ordered[end].startswith(prefix):
            end += 1
        return ordered[start:end]

    def cursor_ok(self, after: int) -> bool:
        """Whether ``after`` (0: from the start) names an event number of this job on this server."""
        return after == 0 or self.base <= after < self.next_seq

    def after(self, after: int, kind: str | None) -> list[dict[str, Any]]:
        """The events numbered above ``after`` (of ``kind``, if given), reading only those (not the whole log)."""
        newer = min(len(self.events), self.next_seq - 1 - max(after, self.base))
        tail = list(itertools.islice(reversed(self.events), max(0, newer)))[::-1]
        return [e for e in tail if kind is None or e["kind"] == kind]

    def held_bytes(self) -> int:
        """What this job holds, counted as the bytes that arrived (names included); kept as writes happen."""
        return self.kv_bytes + self.events_held + self.participant_bytes + self.agreement_bytes

    def add_agreement_bytes(self, a: Agreement, nbytes: int) -> None:
        a.value_bytes += nbytes
        self.agreement_bytes += nbytes

    def drop_agreement(self, name: str) -> None:
        self.agreement_bytes -= self.agreements.pop(name).value_bytes

    def add_event(self, kind: str, source: str, version: str | None, data: Any, nbytes: int = 0) -> dict[str, Any]:
        event = {
            "seq": self.next_seq,
            "time": time.time(),
            "kind": kind,
            "source": source,
            "version": version,
            "data": data,
        }
        self.next_seq += 1
        if len(self.events) == self.events.maxlen:  # the oldest goes
            self.events_held -= self.event_bytes[0]
        self.events.append(event)
        self.event_bytes.append(nbytes)
        self.events_held += nbytes
        self.topics.fire("events")
        return event

    def summary(self, recent: int, participants: int | None = None) -> dict[str, Any]:
        """What ``/v1/status`` says of this job: every participant, or (``participants``) the first ones by name
        without their ``info`` (the status of many large jobs stays small)."""
        listed = sorted(self.participants.values(), key=lambda p: p.name)
        if participants is not None:
            listed = listed[:participants]
        docs = [p.to_json() for p in listed]
        if participants is not None:
            for doc in docs:
                del doc["info"]
        return {
            "participants": docs,
            "participants_total": len(self.participants),
            "keys": len(self.kv),
            "key_bytes": self.kv_bytes,
            "held_bytes": self.held_bytes(),
            "agreements": len(self.agreements),
            "recent_events": list(self.events)[-recent:],
        }
