"""One receiving rank's outcome of one version, as a typed record: what a receiver reports and a trainer reads.

An outcome crosses processes (the version channel, the host board's cause on the MetaServer, the MetaServer, records
of many) as plain data; :meth:`Outcome.from_wire` reads it untrusted: only a document that says exactly ``ok: true``
is a success, anything else that claims to be an outcome is a failure (a malformed one says so, and counts as
having changed weights: nothing another process says can make a version count as applied)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CAUSE_CHARS = 2000  # the most of a cause kept (a traceback's worth)


@dataclass(frozen=True, slots=True)
class Outcome:
    """``ok``: the rank applied the version; else ``cause`` says why not and ``partial`` whether its weights were
    changed part-way."""

    ok: bool
    cause: str | None = None
    partial: bool = False

    def to_wire(self) -> dict[str, Any]:
        return {"ok": self.ok, "cause": self.cause, "partial": self.partial}

    @classmethod
    def failed(cls, cause: str | None, partial: bool) -> Outcome:
        """A failure, its cause cut to :data:`CAUSE_CHARS` (``None`` where none is known)."""
        return cls(False, None if cause is None else str(cause)[:CAUSE_CHARS] or None, partial is True)

    @classmethod
    def from_wire(cls, doc: Any) -> Outcome:
        """The outcome a document says: ``APPLIED`` only for exactly ``{"ok": true, ...}``; a failure's cause and
        ``partial`` as said (``partial`` only where exactly ``true``: a failure whose cause went missing is not made
        a partial one); anything malformed a partial failure naming it."""
        if not isinstance(doc, dict) or not isinstance(doc.get("ok"), bool):
            return cls(False, f"malformed outcome {str(doc)[:200]!r}", True)
        if doc["ok"]:
            return APPLIED
        cause = doc.get("cause")
        return cls.failed(cause if isinstance(cause, str) else None, doc.get("partial") is True)


APPLIED = Outcome(True)

Outcomes = dict[tuple[str, int], "Outcome | None"]  # by (instance, local rank); None: the rank never reported


def all_applied(outcomes: Outcomes) -> bool:
    """Whether every rank's outcome is a success. Every steady version's case is told without a Python call per rank
    (each is the one ``APPLIED``, counted by identity): a first trainer rank reads hundreds a version."""
    values = list(outcomes.values())
    if values.count(APPLIED) == len(values):
        return True
    return all(o is not None and o.ok for o in values)


__all__ = ["APPLIED", "CAUSE_CHARS", "Outcome", "Outcomes", "all_applied"]
