"""Outcomes: a version counts as applied only when every receiving rank said so. A receiving rank reports through
the plan's :class:`~awex.engines.sync.signals.Signals` (a failure's cause, and the outcome of a rank outside any plan,
always go to the MetaServer too); a trainer rank collects them until its deadline. Functions of
``(plan, rank, signals)``: nothing here reads a sync session."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from functools import partial

from awex.engines.outcome import APPLIED, Outcome, Outcomes, all_applied
from awex.engines.sync import keys, places
from awex.engines.sync.manifest import SyncManifest
from awex.engines.sync.peer_link import LIVENESS_SECONDS, Process, exited_here
from awex.engines.sync.relay import HostRelay
from awex.engines.sync.signals import Signals
from awex.meta import Plan, Role
from awex.meta.client import MetaClient

log = logging.getLogger("awex.engines")


def report(
    client: MetaClient,
    plan: Plan | None,
    who: tuple[str, int],
    signals: Signals | None,
    manifest: SyncManifest,
    ok: bool,
    cause: str | None,
    partial: bool,
) -> None:
    """Receiving rank ``who`` = ``(instance, local rank)``'s outcome of ``manifest``'s version (after its transfer,
    and any apply or validation step): ``ok``, or failed with ``cause`` (``partial``: its weights were changed
    part-way). Every trainer rank waits for it (:func:`collect`); over CUDA IPC it also says this rank stopped
    reading the trainers' memory. A failure's cause always goes to the MetaServer too, as does the outcome of a
    rank with no plan (it failed before planning). Never raises on a failure report (the sync's own error is what
    the caller must see)."""
    me = None
    try:
        me = plan.rank(*who) if plan is not None else None
    except KeyError:
        pass
    outcome = APPLIED if ok else Outcome.failed(cause, partial)
    doc = outcome.to_wire()
    if not ok:  # ranks still in the attempt's device gather or plan agreement learn it at once
        places.abandon(client, manifest, who, outcome.cause)
    try:
        if not ok or me is None or signals is None or signals.medium == "meta":
            client.put(keys.outcome(manifest.version, manifest.seq, *who), doc)
        if me is not None and signals is not None and signals.medium != "meta":
            signals.report(manifest, me, doc)
    except Exception as e:
        if ok:
            raise
        log.warning("%s:%d could not report its failure of %s: %s", *who, manifest.version, e)


def collect(
    plan: Plan,
    signals: Signals,
    manifest: SyncManifest,
    deadline: float,
    processes: Mapping[tuple[str, int], Process] | None = None,
    rank: int = 0,
    relay: HostRelay | None = None,
) -> Outcomes:
    """Trainer rank ``rank`` (sync rank): every receiving rank's outcome of ``manifest``'s version, waiting until
    ``deadline`` (``time.monotonic()``); ``None`` for a rank that did not report by then (stuck, or dead on another
    host). With ``processes`` (where each rank runs), every :data:`LIVENESS_SECONDS` it checks the silent receivers on
    this host: one that exited has failed (its cause says so) and is not waited for.

    Where the signals share outcomes (version channel, MetaServer), only the first trainer rank reads them and
    publishes them in one record (the failed and the silent by name) that the other trainer ranks read: one read
    per rank instead of one per receiver (O(N) per version instead of O(N^2) at N ranks). A missing record (the
    first rank gone) counts every receiver as silent: the version failed. The first rank itself reads one record
    per group of receivers (an engine instance, or an instance's ranks on one host: :func:`aggregate`) and, one by
    one, the outcomes of the ranks that no record says (a rank in no group, a record missing or malformed, a rank
    its record calls silent).

    With ``relay`` (``awex.engines.sync.relay``), a trainer rank hears the record from its host's trainer relay
    instead, and a relay hands the record it read or made to its host's other trainer ranks (``None`` where it has
    none: they read it themselves)."""
    receivers, first = plan.ranks_of(Role.INFERENCE), plan.ranks_of(Role.TRAINER)[0].rank  # indexed once a plan
    if signals.shares_outcomes and rank != first:
        doc = None
        try:
            if relay is not None and relay.hears_outcomes:
                read = partial(signals.collected, manifest)
                doc = relay.outcomes(manifest.version, manifest.seq, deadline, read, LIVENESS_SECONDS)
            else:
                doc = signals.collected(manifest, max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            pass
        finally:
            if relay is not None:
                relay.forward_outcomes(manifest.version, manifest.seq, doc)
        return from_record(doc, receivers)
    got = _by_record(plan, signals, manifest, deadline, processes) if signals.shares_outcomes else {}
    if len(got) < len(receivers):  # ranks no record said (every group's record says all of its ranks: none)
        unsaid = [r for r in receivers if (r.instance, r.local_rank) not in got]
        got.update(_each(unsaid, signals, manifest, deadline, processes))
    got = {(r.instance, r.local_rank): got[(r.instance, r.local_rank)] for r in receivers}
    if signals.shares_outcomes:
        record = to_record(got)
        try:
            signals.publish_outcomes(manifest, record)
        except Exception as e:  # the other trainer ranks then fail at their deadline: never a false success
            log.warning("could not publish the outcomes of %s for the other trainer ranks: %s", manifest.version, e)
        if relay is not None:
            relay.forward_outcomes(manifest.version, manifest.seq, record)
    return got


def aggregate(plan: Plan, signals: Signals, manifest: SyncManifest, who: tuple[str, int], deadline: float) -> None:
    """Receiving rank ``who``, after its own report: where the signals share outcomes and its outcome goes into a
    record (:meth:`~awex.engines.sync.signals.Signals.record_groups`: an engine instance's ranks, or those of an
    instance on one host through its relay), the group's first rank gathers the group's outcomes until ``deadline``
    (by instance: at most :data:`~awex.engines.sync.signals.AGGREGATE_SECONDS`) and publishes them in one record for
    the first trainer rank (an engine's ranks receive together: the call that updates an engine returns when all of
    them did anyway); the others wait until their outcome is on its way. The record is a shortcut, never a
    dependency: the trainer reads rank by rank the ranks it calls silent, and every rank in no group. Never raises."""
    if not signals.shares_outcomes:
        return
    me = plan.rank(*who)
    name = signals.record_of(plan, me.rank)
    if name is None:
        return
    group = signals.record_groups(plan)[name]
    try:
        docs = signals.gather(manifest, me, group, deadline)
        if docs is not None:
            got = {(r.instance, r.local_rank): None if d is None else Outcome.from_wire(d) for r, d in zip(group, docs)}
            signals.publish_instance(manifest, name, to_record(got))
    except Exception as e:
        log.warning("%s:%d could not collect its group's outcomes of %s: %s", *who, manifest.version, e)


def _by_record(
    plan: Plan,
    signals: Signals,
    manifest: SyncManifest,
    deadline: float,
    processes: Mapping[tuple[str, int], Process] | None,
) -> Outcomes:
    """The outcomes the groups' records say (:func:`aggregate`), waiting until ``deadline``; with ``processes``, a
    group one of whose ranks exited on this host is left to be read rank by rank. Ranks a record calls silent are
    not in the result."""
    pending = dict(signals.record_groups(plan))
    got: Outcomes = {}
    while pending:
        until = min(deadline, time.monotonic() + LIVENESS_SECONDS) if processes else deadline
        for name, doc in zip(list(pending), signals.instances(manifest, list(pending), until)):
            if doc is not None:
                said = from_record(doc, pending.pop(name))
                got.update(said if all_applied(said) else {who: d for who, d in said.items() if d is not None})
        if time.monotonic() >= deadline:
            break
        for name, ranks in list(pending.items()):
            if any(exited_here(processes or {}, r.instance, r.local_rank) is not None for r in ranks):
                del pending[name]
    return got


def to_record(got: Outcomes) -> dict:
    """Outcomes as one record: the failed ones with their documents, the silent ones by name; the rest applied."""
    if all_applied(got):
        return {"failed": {}, "silent": []}
    return {
        "failed": {f"{i}:{r}": o.to_wire() for (i, r), o in sorted(got.items()) if o is not None and not o.ok},
        "silent": [f"{i}:{r}" for (i, r), o in sorted(got.items()) if o is None],
    }


def from_record(doc: object, receivers: list) -> Outcomes:
    """The outcomes a record of :func:`to_record` says (checked: a record that is not one, or names a rank outside
    ``receivers``, counts every receiver as silent)."""
    failed = doc.get("failed") if isinstance(doc, dict) else None
    silent = doc.get("silent") if isinstance(doc, dict) else None
    if failed == {} and silent == []:  # every receiver applied it (every steady version): nothing to check by name
        return {(r.instance, r.local_rank): APPLIED for r in receivers}
    names = {f"{r.instance}:{r.local_rank}": (r.instance, r.local_rank) for r in receivers}
    if (
        not isinstance(failed, dict)
        or not isinstance(silent, list)
        or not all(k in names and isinstance(v, dict) and v.get("ok") is False for k, v in failed.items())
        or not all(isinstance(k, str) and k in names for k in silent)
    ):
        if doc is not None:
            log.warning("malformed record of every receiver's outcome: %.200r", doc)
        return {who: None for who in names.values()}
    out: Outcomes = {}
    for name, who in names.items():
        if name in failed:
            out[who] = Outcome.from_wire(failed[name])  # a failure (checked above): never read as applied
        else:
            out[who] = None if name in silent else APPLIED
    return out


def _failed_elsewhere(signals: Signals, manifest: SyncManifest, silent: list) -> Outcomes:
    """The failures of ``silent`` receivers that reached the MetaServer but not these signals (a rank that failed
    before it joined this attempt's board or channel: a failure always goes to the MetaServer too); one request
    when none failed. Asked once a second while receivers stay silent, never in a steady version."""
    client = getattr(signals, "client", None)
    if not silent or client is None or signals.medium == "meta":
        return {}
    try:
        there = set(client.keys(keys.attempt_outcomes(f"{manifest.version}/{manifest.seq}")))
        out: Outcomes = {}
        for r in silent:
            key = keys.outcome(manifest.version, manifest.seq, r.instance, r.local_rank)
            doc = client.try_get(key) if key in there else None
            if isinstance(doc, dict) and doc.get("ok") is False:
                out[(r.instance, r.local_rank)] = Outcome.from_wire(doc)
        return out
    except Exception as e:  # the signals' own wait goes on until the deadline
        log.debug("could not read failures of %s from the MetaServer: %s", manifest.version, e)
        return {}


def _each(
    receivers: list,
    signals: Signals,
    manifest: SyncManifest,
    deadline: float,
    processes: Mapping[tuple[str, int], Process] | None,
) -> Outcomes:
    """Every receiver's outcome, read one by one (see :func:`collect`)."""
    got: Outcomes = {}
    while True:
        left = [r for r in receivers if (r.instance, r.local_rank) not in got]
        if not left:
            break
        until = min(deadline, time.monotonic() + LIVENESS_SECONDS)
        for r, doc in zip(left, signals.outcomes(manifest, left, until)):
            if doc is not None:
                got[(r.instance, r.local_rank)] = Outcome.from_wire(doc)
        silent = [r for r in left if (r.instance, r.local_rank) not in got]
        if not silent or time.monotonic() >= deadline:  # every one reported: no process looked at (a steady version)
            break
        got.update(_failed_elsewhere(signals, manifest, silent))
        for r in silent:
            pid = exited_here(processes or {}, r.instance, r.local_rank)
            if pid is not None and (r.instance, r.local_rank) not in got:
                cause = f"{r.instance}:{r.local_rank} (pid {pid}, the trainer's host) exited before it reported"
                log.warning("%s; version %r failed", cause, manifest.version)
                got[(r.instance, r.local_rank)] = Outcome.failed(cause, partial=True)
    return {(r.instance, r.local_rank): got.get((r.instance, r.local_rank)) for r in receivers}
