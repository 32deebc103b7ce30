"""Outcomes: a version counts as applied only when every receiving rank said so. A receiving rank reports where
every rank of the sync reads per-version signals (host board, version channel or MetaServer; a failure's cause
always goes to the MetaServer); a trainer rank collects them until its deadline. ``session`` is the rank's
:class:`~awex.engines.session.SyncSession`."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from awex.engines import keys
from awex.engines.manifest import SyncManifest

if TYPE_CHECKING:
    from awex.engines.session import SyncSession

log = logging.getLogger("awex.engines")


def report(session: SyncSession, manifest: SyncManifest, ok: bool, cause: str | None, partial: bool) -> None:
    """A receiving rank's outcome of ``manifest``'s version (after its transfer, and any apply or validation
    step): ``ok``, or failed with ``cause`` (``partial``: its weights were changed part-way). Every trainer
    rank waits for it (:func:`collect`); over CUDA IPC it also says this rank stopped reading the
    trainers' memory. A failure's cause always goes to the MetaServer too. Never raises on a failure report
    (the sync's own error is what the caller must see)."""
    plan = session._plan
    me = None
    try:
        me = plan.rank(session.instance, session.local_rank) if plan is not None else None
    except KeyError:
        pass
    doc = {"ok": ok, "cause": (cause or "")[:2000] or None, "partial": partial}
    try:
        with session.phases("done"):
            if not ok or me is None or session.signals == "meta":
                session.client.put(
                    keys.outcome(manifest.version, manifest.seq, session.instance, session.local_rank), doc
                )
            if me is None:
                return
            if session.signals == "board":
                session.board.ring(me.rank, manifest.seq, 0 if ok else 1)
            elif session.signals == "channel":
                session.channel.put(
                    keys.channel_outcome(manifest.version, manifest.seq, me.instance, me.local_rank), doc
                )
    except Exception as e:
        if ok:
            raise
        log.warning(
            "%s:%d could not report its failure of %s: %s", session.instance, session.local_rank, manifest.version, e
        )


def collect(session: SyncSession, manifest: SyncManifest, deadline: float) -> dict[tuple[str, int], dict | None]:
    """A trainer rank: every receiving rank's outcome of ``manifest``'s version, waiting until ``deadline``
    (``time.monotonic()``); ``None`` for a rank that did not report by then (dead or stuck)."""
    plan = session._plan
    receivers = [r for r in plan.ranks if r.role.value != "trainer"]
    left = lambda: max(0.0, deadline - time.monotonic())  # noqa: E731
    out: dict[tuple[str, int], dict | None] = {}
    with session.phases("done"):
        if session.signals == "board":
            slots = [r.rank for r in receivers]
            waited = time.monotonic()
            try:
                details = session.board.wait(slots, manifest.seq, left(), expect=session._outcomes_after)
                session._outcomes_after = time.monotonic() - waited  # about as long next time
            except TimeoutError:
                details = session.board.signalled(slots, manifest.seq)
            for r, detail in zip(receivers, details):
                out[(r.instance, r.local_rank)] = (
                    None if detail is None else {"ok": True} if detail == 0 else _failure_of(session, manifest, r)
                )
        elif session.signals == "channel":
            names = [keys.channel_outcome(manifest.version, manifest.seq, r.instance, r.local_rank) for r in receivers]
            try:
                docs = session.channel.wait(names, max(0.001, left()))
            except TimeoutError:
                docs = [session.channel.get(k) for k in names]
            for r, doc in zip(receivers, docs):
                out[(r.instance, r.local_rank)] = doc if isinstance(doc, dict) else None
        else:
            for r in receivers:
                try:
                    doc = session.client.get(
                        keys.outcome(manifest.version, manifest.seq, r.instance, r.local_rank), timeout=left()
                    )
                except TimeoutError:
                    doc = None
                out[(r.instance, r.local_rank)] = doc if isinstance(doc, dict) else None
    return out


def _failure_of(session: SyncSession, manifest: SyncManifest, rank) -> dict:
    doc = None
    try:
        doc = session.client.get(
            keys.outcome(manifest.version, manifest.seq, rank.instance, rank.local_rank), timeout=2.0
        )
    except Exception as e:  # the board said it failed; the cause is a detail
        log.warning("cause of %s:%d's failure unknown: %s", rank.instance, rank.local_rank, e)
    return doc if isinstance(doc, dict) and doc.get("ok") is False else {"ok": False, "cause": None}
