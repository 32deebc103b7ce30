"""The MetaServer's safety state on disk: what decides whether bytes may move or a version counts, journalled as it
changes and restored before a restarted server answers anything.

Kept per job: each writer identity's fence epoch (``awex.meta.server.fences``), each claimed name (a key created
with ``create=1``: who claimed it, and whether a version under it was applied), the claim lease
(``awex.meta.server.leases``), and each participant with the version it serves. Not kept: values, events,
agreements (a restarted server is asked for them again; clients publish again what they own).

The file is one record a line, ``<crc32 as 8 hex digits> <JSON object>``, appended before the request that made the
change is answered. A line cut short at the end (the server stopped while writing it, so its request was never
answered) is dropped with a warning; any other damage (a checksum or JSON that does not match, an unknown record)
is refused with an error naming the line: nothing is served on a state that may have forgotten a fence. One server
at a time: a second server on the same journal is refused (an exclusive lock on ``<journal>.lock``). The journal is
rewritten from the state (compacted) when it opens and whenever it grew well past it; records are written to the
operating system at once (they survive the server process being killed) and, with ``fsync``, to the disk too
(they survive the machine losing power, at the cost of a disk flush per change).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from awex.meta.errors import AwexError, AwexValueError

log = logging.getLogger("awex.meta.server")

COMPACT_AFTER = 10_000  # records appended before the journal is rewritten (at least; and 4x the state's)
_JSON = json.JSONEncoder(separators=(",", ":"), sort_keys=True).encode  # made once (json.dumps makes one a call)


class JournalError(AwexError, RuntimeError):
    """The journal cannot be used: damaged, held by another server, or not writable."""


@dataclass
class Claim:
    by: str | None  # the fence ("<epoch>:<identity>") of the writer that holds it, or None
    applied: bool = False  # a version under this name was reported applied: never written again


@dataclass
class Kept:
    """One job's safety state, as restored."""

    fences: dict[str, int] = field(default_factory=dict)
    claims: dict[str, Claim] = field(default_factory=dict)
    participants: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> role, instance, world_size, serves
    lease: tuple[str, float, str] | None = None  # the claim lease's holder, length in seconds, prefix (leases.py)

    def apply(self, r: dict[str, Any]) -> None:
        op = r["op"]
        if op == "fence":
            self.fences[_text(r, "id")] = _count(r, "epoch")
        elif op == "claim":
            self.claims[_text(r, "key")] = Claim(_optional(r, "by"), bool(r.get("applied", False)))
        elif op == "release":
            self.claims.pop(_text(r, "key"), None)
        elif op == "lease":
            seconds = r.get("seconds")
            if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not 0 < seconds <= 3600:
                raise AwexValueError("seconds is not a lease's length")
            self.lease = (_text(r, "id"), float(seconds), _text(r, "prefix"))
        elif op == "unlease":
            self.lease = None
        elif op == "participant":
            old = self.participants.get(_text(r, "name"), {})
            self.participants[r["name"]] = {
                "role": _text(r, "role"),
                "instance": _text(r, "instance"),
                "world_size": _count(r, "world_size"),
                "serves": old.get("serves"),
            }
        elif op == "serves":
            entry = self.participants.setdefault(_text(r, "name"), {"role": "inference", "instance": r["name"]})
            entry.setdefault("world_size", 1)
            entry["serves"] = _optional(r, "version")
        else:
            raise AwexValueError(f"unknown record {op!r}")

    def records(self, job: str) -> list[dict[str, Any]]:
        """This state as the records that rebuild it."""
        out: list[dict[str, Any]] = [{"op": "fence", "job": job, "id": i, "epoch": e} for i, e in self.fences.items()]
        out += [{"op": "claim", "job": job, "key": k, "by": c.by, "applied": c.applied} for k, c in self.claims.items()]
        for name, p in self.participants.items():
            out.append({"op": "participant", "job": job, "name": name, **{k: p[k] for k in ("role", "instance")}})
            out[-1]["world_size"] = p.get("world_size", 1)
            if p.get("serves") is not None:
                out.append({"op": "serves", "job": job, "name": name, "version": p["serves"]})
        if self.lease is not None:
            holder, seconds, prefix = self.lease
            out.append({"op": "lease", "job": job, "id": holder, "seconds": seconds, "prefix": prefix})
        return out


def _text(r: dict, name: str) -> str:
    value = r.get(name)
    if not isinstance(value, str):
        raise AwexValueError(f"{name} is not a string")
    return value


def _optional(r: dict, name: str) -> str | None:
    return None if r.get(name) is None else _text(r, name)


def _count(r: dict, name: str) -> int:
    value = r.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise AwexValueError(f"{name} is not a non-negative integer")
    return value


def encode(record: dict[str, Any]) -> bytes:
    body = _JSON(record).encode()
    return b"%08x %s\n" % (zlib.crc32(body), body)


def decode(line: bytes, number: int, path: str) -> dict[str, Any]:
    crc, _, body = line.partition(b" ")
    try:
        if len(crc) != 8 or int(crc, 16) != zlib.crc32(body):
            raise AwexValueError("its checksum does not match")
        record = json.loads(body)
        if not isinstance(record, dict) or not isinstance(record.get("job"), str):
            raise AwexValueError("not a record of a job")
    except ValueError as e:
        raise JournalError(
            f"the MetaServer journal {path} is damaged at line {number} ({e}); refusing to serve on a state that may "
            "have lost fences or claims: restore the file, or start with a new journal (and new job names)"
        ) from None
    return record


class Journal:
    """The journal at ``path`` (created if absent), held by this server alone; :meth:`load` before :meth:`append`."""

    def __init__(self, path: str, fsync: bool = False):
        self.path, self.fsync = os.path.abspath(path), fsync
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self._lock = os.open(self.path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise JournalError(f"cannot open the MetaServer journal {self.path}: {e}") from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock)
            raise JournalError(
                f"another MetaServer is serving on the journal {self.path} (two servers on one journal would each "
                "forget the other's fences): stop it, or give this one a journal of its own"
            ) from None
        self._fd: int | None = None
        self._appended = 0
        self._base = 0  # records in the journal as last rewritten

    def flush(self) -> None:
        """Nothing: :meth:`append` wrote the record already (etcd's store writes a request's changes here)."""

    def serving(self) -> bool:
        """Always: one server holds a journal (its lock), for as long as it runs (etcd's store may say no)."""
        return True

    def load(self) -> dict[str, Kept]:
        """The state the journal holds (empty for a new one); then the journal is rewritten from it."""
        jobs: dict[str, Kept] = {}
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            data = b""
        except OSError as e:
            raise JournalError(f"cannot read the MetaServer journal {self.path}: {e}") from None
        lines = data.split(b"\n")
        if lines[-1]:  # cut short as it was written: its request was never answered
            log.warning(
                "MetaServer journal %s: dropping its last record, cut short (%d bytes)", self.path, len(lines[-1])
            )
        for number, line in enumerate(lines[:-1], 1):
            record = decode(line, number, self.path)
            try:
                jobs.setdefault(record["job"], Kept()).apply(record)
            except (ValueError, KeyError) as e:
                raise JournalError(
                    f"the MetaServer journal {self.path} is damaged at line {number} ({e}); refusing to serve on it"
                ) from None
        self.rewrite(jobs)
        held = sum(len(k.fences) + len(k.claims) + len(k.participants) for k in jobs.values())
        log.info("MetaServer journal %s: %d jobs, %d records restored", self.path, len(jobs), held)
        return jobs

    def rewrite(self, jobs: dict[str, Kept]) -> None:
        """Replace the journal by the records of ``jobs`` (written aside, then renamed over it)."""
        records = [r for name, kept in sorted(jobs.items()) for r in kept.records(name)]
        aside = self.path + ".new"
        try:
            with open(aside, "wb") as f:
                f.write(b"".join(encode(r) for r in records))
                f.flush()
                os.fsync(f.fileno())
            os.replace(aside, self.path)
            if self._fd is not None:
                os.close(self._fd)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        except OSError as e:
            raise JournalError(f"cannot write the MetaServer journal {self.path}: {e}") from None
        self._appended, self._base = 0, len(records)

    def append(self, record: dict[str, Any], everything: Callable[[], dict[str, Kept]] | None = None) -> None:
        """Write one record (before its change is made and its request answered): :meth:`append_all`."""
        self.append_all([record], everything)

    def append_all(
        self, records: Sequence[dict[str, Any]], everything: Callable[[], dict[str, Kept]] | None = None
    ) -> None:
        """Write ``records`` in one write (and, with ``fsync``, one flush to the disk), before their changes are
        made; first rewrite the journal from ``everything()``, the whole state, when it grew well past it."""
        if self._fd is None:
            raise JournalError("the journal was not loaded")
        if everything is not None and self._appended > max(COMPACT_AFTER, 4 * self._base):
            self.rewrite(everything())
        data = memoryview(b"".join(encode(r) for r in records))
        try:
            while data:  # a regular file may take less than asked
                data = data[os.write(self._fd, data) :]
            if self.fsync:
                os.fsync(self._fd)
        except OSError as e:
            raise JournalError(f"cannot write the MetaServer journal {self.path}: {e}") from None
        self._appended += len(records)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        os.close(self._lock)  # releases the lock
