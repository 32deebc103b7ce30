"""Ready signals and outcomes through host relays: a pull transport's senders say ready once a host, its receivers
hear once a host, and an engine's receiving ranks on one host report in one record (``awex.engines.sync.relay``).

Over the version channel each trainer rank's ready signal was a key of its own and each receiving rank read its
senders' keys itself: at 1,024 ranks about 500 sets, 500 waited reads and 500 deletes a version on the channel's
host. With two or more trainer ranks on a host, each tells the lowest of them (its group's lead) over a local
datagram, and the lead puts one key for the host with every generation (:func:`awex.engines.sync.keys.host_ready`)
once all said ready; a trainer rank alone on its host puts its own key as before. The first trainer rank reads
those keys once all are there and puts every generation in one key (:func:`awex.engines.sync.keys.all_ready`, on
every lane of the channel). With two or more receiving ranks of one engine instance on a host, the lowest reads
that key (one waited read on its own lane; reading the host keys themselves took one a lane they lay on, about
four at 1,024 ranks) and hands its group's senders' generations to the others; a receiving rank alone of its
engine there reads it itself (engines may be updated one after another: no rank waits for another engine's
ranks). Where a host's key is is a pure function of the plan and the hosts
(:meth:`~awex.engines.sync.relay.HostGroups.ready_holder`), so the first trainer rank looks where the signal went.
A trainer rank that fails the version before its bytes are ready (:meth:`RelayedSignals.withhold`) passes a withheld
mark the same way: its receivers stop waiting at once, failed, nothing moved into them.

Outcomes the same way: an engine instance's receiving ranks on one host (they receive in one call of the engine,
so they finish together, and none waits for another engine's) tell the lowest of them their outcome; it puts one
record for them (:meth:`RelayedSignals.record_groups`) once all told it, and tells them whether theirs is in it. The
first trainer rank reads one record per group instead of one key per rank.

What would make this wrong, and what notices: a lead that passes a generation or an outcome nobody gave (the keys
and datagrams carry MACs under the channel's secret; a generation that is not one fails the receiver's check); a
lead that never puts its host's ready key (gone, failed) or a trainer rank silent until the sync's timeout (the
first trainer rank leaves it out of its key at that timeout: its receivers fail at their deadline, the others go
on); a peer whose ready datagram its lead refuses (it raises: its version fails, never a false success). An
outcome is never lost: a rank whose lead refuses its datagram, calls it silent (the lead's deadline passed first)
or exits puts its own key, which the first trainer rank reads for a rank its record does not say; a rank that exits
on its lead's host before it told it failed. Every other signal goes through the channel as before
(:class:`~awex.engines.sync.signals.ChannelSignals`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any, Sequence

from awex.engines.sync import keys
from awex.engines.sync.channel import ChannelTimeout, VersionChannel
from awex.engines.sync.manifest import SyncManifest
from awex.engines.sync.peer_link import LIVENESS_SECONDS, Process, exited_here
from awex.engines.sync.relay import LOOK_SECONDS, HostGroups, HostRelay, RelayTimeout
from awex.engines.sync.signals import WITHHELD, ChannelSignals, Signals, says_ready
from awex.meta import Plan, RankDescriptor, Role
from awex.meta.errors import AwexValueError
from awex.transport.base import TransferError

log = logging.getLogger("awex.engines")


class RelayedSignals(ChannelSignals):
    """:class:`ChannelSignals` whose ready signals and outcomes go through host relays (the others as the
    channel's)."""

    def __init__(
        self,
        inner: ChannelSignals,
        plan: Plan,
        groups: HostGroups,
        relay: HostRelay | None,
        rank: int,
        processes: Mapping[tuple[str, int], Process] | None = None,
    ):
        super().__init__(inner.channel, inner.client)
        self.plan, self.groups, self.relay, self.rank = plan, groups, relay, rank
        self.roles = relay.roles if relay is not None else None
        self.processes = processes or {}
        self._told: tuple[tuple, dict] | None = None  # (version, seq): the outcome this rank told its group's lead
        self._alone: dict[tuple[str, int], set[int]] = {}  # the first trainer rank: a group's ranks read by own key
        self._senders: list[int] | None = None  # a receiving lead: every sender its host's receivers read from
        self._heard: tuple[tuple, dict[int, int]] | None = None  # (kind, version, count): generations read or heard
        self._held: dict[tuple[int, ...], list[tuple[int, tuple[int, ...]]]] = {}  # senders -> the keys holding theirs
        self._all: list[int] | None = None  # every trainer rank of the plan, and each one's place among them
        self._position: dict[int, int] = {}

    # -- senders ------------------------------------------------------------------------------------------------
    def ready(self, kind: str, manifest: SyncManifest, me: RankDescriptor, generation: int) -> None:
        roles = self.roles
        if roles is not None and roles.trainers_from is not None:  # one of a host's trainer ranks: tell the lead
            message = {"kind": "ready", "version": manifest.version, "seq": manifest.seq, "rank": me.rank}
            try:
                self.relay.tell(roles.trainers_from, dict(message, generation=generation))
            except OSError as e:
                raise TransferError(
                    f"sync rank {me.rank} could not tell its host's lead (sync rank {roles.trainers_from}) that "
                    f"version {manifest.version!r} is ready: {e}"
                ) from None
            return
        if roles is None or not roles.trainers_to:  # alone on its host: a key of its own
            super().ready(kind, manifest, me, generation)
        else:  # the lead: every trainer rank of its host said ready, then one key for all
            generations = {me.rank: generation}
            deadline = time.monotonic() + manifest.options.timeout
            while len(generations) <= len(roles.trainers_to):
                left = max(0.001, deadline - time.monotonic())
                message = self.relay.hear("ready", manifest.version, manifest.seq, left)
                rank, gen = message.get("rank"), message.get("generation")
                if rank in roles.trainers_to and _said(gen):
                    generations[rank] = gen
            key = keys.host_ready(kind, manifest.version, manifest.seq, me.rank)
            self.channel.put(key, [generations[r] for r in (me.rank, *roles.trainers_to)])  # its host's, in order
        if me.rank == self.groups.announcer:
            self._all_ready(kind, manifest)

    def withhold(self, kind: str, manifest: SyncManifest, me: RankDescriptor) -> None:
        """:meth:`Signals.withhold` through the relays: a trainer rank with a lead tells it (its host's key then says
        so); a lead, which hears its host's ranks no more, puts its host's key with each of them withheld; the first
        trainer rank, the key of them all so (the attempt failed: every receiver stops waiting); a rank alone on its
        host, its own key."""
        roles = self.roles
        if not says_ready(kind) or roles is None or (roles.trainers_from is None and not roles.trainers_to):
            super().withhold(kind, manifest, me)  # its own key (over p2p no lead listens for ready signals)
        elif roles.trainers_from is not None:
            message = {"kind": "ready", "version": manifest.version, "seq": manifest.seq, "rank": me.rank}
            try:
                self.relay.tell(roles.trainers_from, dict(message, generation=WITHHELD))
            except OSError as e:  # its lead is gone: its receivers fail at their deadline
                log.info("sync rank %d could not tell its host's lead it failed %s: %s", me.rank, manifest.version, e)
        else:
            key = keys.host_ready(kind, manifest.version, manifest.seq, me.rank)
            self.channel.put(key, [WITHHELD] * (1 + len(roles.trainers_to)))
        if me.rank == self.groups.announcer:
            self.channel.put(keys.all_ready(kind, manifest.version, manifest.seq), [WITHHELD] * len(self._trainers()))

    def withheld(self, kind: str, manifest: SyncManifest, senders: Sequence[RankDescriptor]) -> list[RankDescriptor]:
        """Those of ``senders`` withheld under their own keys, or in the first trainer rank's key of them all."""
        found = {s.rank for s in super().withheld(kind, manifest, senders)}
        doc, trainers = self.channel.get(keys.all_ready(kind, manifest.version, manifest.seq)), self._trainers()
        if isinstance(doc, list) and len(doc) == len(trainers):
            at = self._position
            found.update(s.rank for s in senders if s.rank in at and doc[at[s.rank]] == WITHHELD)
        return [s for s in senders if s.rank in found]

    def _all_ready(self, kind: str, manifest: SyncManifest) -> None:
        """The first trainer rank: every trainer rank's generation, read from its host's key (or its own) once all
        are there, in one key on every lane (:func:`awex.engines.sync.keys.all_ready`); the receivers read that one.
        A trainer rank still silent at the sync's timeout is left out (its receivers fail: never a false success)."""
        attempt = (kind, manifest.version, manifest.seq)
        trainers = self._trainers()
        try:
            got = self._read_keys(attempt, trainers, manifest.options.timeout)
        except TimeoutError:
            got = self._read_keys(attempt, trainers, None)
            silent = [r for r in trainers if r not in got]
            log.warning(
                "sync rank %d: trainer ranks %s did not say %r ready within %g s; their receivers fail",
                self.rank,
                silent[:8],
                manifest.version,
                manifest.options.timeout,
            )
        self.channel.put(keys.all_ready(*attempt), [got.get(r) for r in trainers])  # in the plan's order

    def _trainers(self) -> list[int]:
        if self._all is None:
            self._all = [r.rank for r in self.plan.ranks_of(Role.TRAINER)]
            self._position = {r: i for i, r in enumerate(self._all)}
        return self._all

    # -- receivers ----------------------------------------------------------------------------------------------
    def wait_ready(self, kind: str, manifest: SyncManifest, senders: Sequence[RankDescriptor], timeout: float) -> list:
        attempt = (kind, manifest.version, manifest.seq)
        roles, relay = self.roles, self.relay
        if self._heard is not None and self._heard[0] == attempt:  # heard or read already for this attempt
            got = self._heard[1]
        elif roles is not None and roles.receivers_from is not None and relay.listening:  # its host's lead reads
            got = self._from_lead(attempt, senders, timeout)
        elif roles is not None and roles.receivers_to:  # the lead: its host's receivers' senders', read once, handed on
            got = self._read(attempt, self._group_senders(), timeout)
            message = {"kind": "ready", "version": manifest.version, "seq": manifest.seq, "transport": kind}
            relay.forward(roles.receivers_to, dict(message, doc={str(r): g for r, g in got.items()}))
            self._heard = (attempt, got)
        else:  # alone on its host (or not listening): its senders' own
            got = self._read(attempt, [s.rank for s in senders], timeout)
        return [got.get(s.rank) for s in senders]  # one missing fails the link's check of its generation

    def _from_lead(self, attempt: tuple, senders: Sequence[RankDescriptor], timeout: float) -> dict[int, int]:
        kind, version, seq = attempt
        try:
            message = self.relay.hear("ready", version, seq, timeout)
        except RelayTimeout:  # a slice without a word (its lead failed, or is slow): a look at the channel itself
            return self._read(attempt, [s.rank for s in senders], LOOK_SECONDS)
        doc = message.get("doc")
        if doc is None:  # too large to hand on: read them here
            return self._read(attempt, [s.rank for s in senders], 0.001 + timeout)
        if not isinstance(doc, dict):
            raise AwexValueError(f"ready signals of {version!r} from the host's lead: not a record ({doc!r:.80})")
        got = {int(r): g for r, g in doc.items() if str(r).isdigit() and _said(g)}
        missing = [s.rank for s in senders if s.rank not in got]
        if missing:  # a sender its lead did not read for it (none, where both read the plan alike): read here
            got.update(self._read(attempt, missing, timeout))
        self._heard = (attempt, got)
        return got

    def _group_senders(self) -> list[int]:
        """Every rank this host's receiving ranks read from (a pull transport's receiver reads from the peers of its
        schedule's receive steps), once a plan."""
        if self._senders is None:
            group = (self.rank, *self.roles.receivers_to)
            self._senders = sorted({s.peer for r in group for s in self.plan.schedule(r) if s.op == "recv"})
        return self._senders

    def _read(self, attempt: tuple, senders: Sequence[int], timeout: float) -> dict[int, int]:
        """Senders' generations from the channel: the first trainer rank's key of every trainer rank's (one waited
        read, on this rank's own lane; a list in the order of the plan's trainer ranks). A sender it leaves out
        (silent until the sync's timeout) stays missing: this rank's wait ends at its deadline, its version fails."""
        doc = self.channel.wait([keys.all_ready(*attempt)], timeout)[0]
        trainers = self._trainers()
        if not isinstance(doc, list) or len(doc) != len(trainers):
            raise AwexValueError(
                f"ready signals of {attempt[1]!r} from the first trainer rank: not one for each of the plan's "
                f"{len(trainers)} trainer ranks ({doc!r:.80})"
            )
        position = self._position
        got = {s: doc[position[s]] for s in senders if s in position}  # each checked as a generation by its link
        if len(got) < len(senders) or None in got.values():
            missing = [s for s in senders if got.get(s) is None]
            raise ChannelTimeout(
                f"sync ranks {missing[:8]} did not say {attempt[1]!r} ready within the sync's timeout (the first "
                "trainer rank's record of every ready signal leaves them out)"
            )
        return got

    def _read_keys(self, attempt: tuple, senders: Sequence[int], timeout: float | None) -> dict[int, Any]:
        """Senders' generations under their hosts' keys (a list in the order of the host's trainer ranks) or their
        own: one waited read a lane they lie on; with ``timeout=None`` those there now (no waiting). A host's key
        vouches for its own host's ranks only."""
        kind, version, seq = attempt
        held = self._holders(senders)
        names = [
            keys.host_ready(kind, version, seq, h)
            if len(group) > 1
            else keys.ready(kind, version, seq, self.plan.ranks[h].instance, self.plan.ranks[h].local_rank)
            for h, group in held
        ]
        values = self.channel.wait(names, timeout) if timeout is not None else [self.channel.get(n) for n in names]
        out: dict[int, Any] = {}  # each checked as a generation by the link of a receiver that reads it
        for (h, group), value in zip(held, values):
            if isinstance(value, list) and len(value) == len(group):  # a host's: its lead's and its other ranks'
                out.update(zip(group, value))
            elif len(group) < 2 and value is not None:
                out[h] = value
        return out

    def _holders(self, senders: Sequence[int]) -> list[tuple[int, tuple[int, ...]]]:
        """The ranks whose keys hold ``senders``' ready signals, each with its host's trainer ranks: the same every
        version of the plan, so worked out once (a few sender lists a plan: the group's, a receiver's own)."""
        given = tuple(senders)
        held = self._held.get(given)
        if held is None:
            holders = sorted({self.groups.ready_holder(s) for s in given})
            held = [(h, self.groups.trainers_with(h)) for h in holders]  # the host's trainer ranks, ascending
            if len(self._held) < 16:  # a retry's missing senders vary: not kept beyond a few
                self._held[given] = held
        return held

    # -- outcomes: an engine instance's receiving ranks on one host, one record ----------------------------------
    def _record_groups(self, plan: Plan) -> dict[str, list[RankDescriptor]]:
        """An engine instance's receiving ranks on one host (two or more), named ``<instance>/<lead's local rank>``;
        where no host has two, by instance (:class:`~awex.engines.sync.signals.InstanceRecords`)."""
        if not self.groups.engine_groups:
            return super()._record_groups(plan)
        out = {}
        for lead, group in self.groups.engine_groups.items():
            out[f"{plan.ranks[lead].instance}/{plan.ranks[lead].local_rank}"] = [plan.ranks[r] for r in group]
        return out

    def outcomes(self, manifest: SyncManifest, receivers: Sequence[RankDescriptor], deadline: float) -> list[Any]:
        docs = super().outcomes(manifest, receivers, deadline)
        if self.groups.engine_groups:  # a group's rank found under its own key: its lead did not record it
            grouped = self._cached(self.plan)[2]
            found = {r.rank for r, d in zip(receivers, docs) if d is not None and r.rank in grouped}
            if found:
                self._alone.setdefault((manifest.version, manifest.seq), set()).update(found)
        return docs

    def own_outcomes(self, plan: Plan, version: str, seq: int) -> list[RankDescriptor]:
        """The ranks in no group, and those of a group its first trainer rank found under their own key (its lead
        failed them: refused their datagram, exited, or called them silent at its deadline)."""
        if not self.groups.engine_groups:
            return super().own_outcomes(plan, version, seq)
        alone, grouped = self._alone.pop((version, seq), set()), self._cached(plan)[2]
        return [r for r in plan.ranks_of(Role.INFERENCE) if r.rank not in grouped or r.rank in alone]

    def report(self, manifest: SyncManifest, me: RankDescriptor, doc: dict) -> None:
        """A receiver's outcome: to its group's lead over a datagram where it has one (its own key where the lead
        refuses it: gone, or not listening), else its own key; a lead keeps its own for its record."""
        roles = self.roles
        self._told = None
        if roles is not None and roles.outcome_to:  # the lead: in its group's record (gather)
            self._told = ((manifest.version, manifest.seq), doc)
            return
        if roles is not None and roles.outcome_from is not None and self.relay.listening:
            told = dict(doc, cause=doc["cause"][:2000]) if isinstance(doc.get("cause"), str) else doc
            message = {"kind": "outcome", "version": manifest.version, "seq": manifest.seq, "rank": me.rank}
            try:
                self.relay.tell(roles.outcome_from, dict(message, doc=told), manifest.options.timeout)
                self._told = ((manifest.version, manifest.seq), doc)
                return
            except OSError as e:
                log.info("sync rank %d: its outcome goes on the channel (its lead refused it: %s)", me.rank, e)
        super().report(manifest, me, doc)

    def gather(
        self, manifest: SyncManifest, me: RankDescriptor, group: Sequence[RankDescriptor], deadline: float
    ) -> list[Any] | None:
        """The lead: its group's outcomes as they tell them, until all did or ``deadline``; a member that exited on
        this host failed. The others: wait until the lead says their outcome is in its record (or that it is not,
        or the lead exited, or the deadline passed: then on the channel under its own key)."""
        attempt = (manifest.version, manifest.seq)
        told = self._told if self._told is not None and self._told[0] == attempt else None
        if self.roles is None or self.groups.engine_groups.get(group[0].rank) is None:  # instance records
            return super().gather(manifest, me, group, deadline)
        if me.rank != group[0].rank:
            if told is not None:
                self._wait_recorded(manifest, me, group[0], told[1], deadline)
            return None
        docs: dict[int, Any] = {me.rank: told[1] if told is not None else None}
        members = {r.rank: r for r in group[1:]}
        alone: set[int] = set()  # members that put their own key (could not hear their lead): silent in the record
        while len(docs) + len(alone) < len(group) and self.relay.listening:
            try:
                message = self.relay.hear("outcome", *attempt, _slice(deadline))
            except RelayTimeout:
                if time.monotonic() >= deadline:
                    break
                for r in members.values():  # still silent after a slice: exited on this host, or reported alone
                    if r.rank in docs or r.rank in alone:
                        continue
                    pid = exited_here(self.processes, r.instance, r.local_rank)
                    if pid is not None:
                        cause = f"{r.instance}:{r.local_rank} (pid {pid}, its lead's host) exited before it reported"
                        docs[r.rank] = {"ok": False, "cause": cause, "partial": True}
                    elif self.channel.get(keys.channel_outcome(*attempt, r.instance, r.local_rank)) is not None:
                        alone.add(r.rank)
                continue
            rank = message.get("rank")
            if rank in members and isinstance(message.get("doc"), dict):
                docs[rank] = message["doc"]
        return [docs.get(r.rank) for r in group]

    def publish_instance(self, manifest: SyncManifest, instance: str, doc: dict) -> None:
        """The record; where a group's lead made it, then its members learn whether theirs is in it (all are
        silent where it could not be put: each then puts its own)."""
        roles = self.roles
        leads = roles is not None and roles.outcome_to and self.groups.engine_groups.get(self.rank) is not None
        message = {"kind": "recorded", "version": manifest.version, "seq": manifest.seq}
        try:
            super().publish_instance(manifest, instance, doc)
        except Exception:
            if leads:
                silent = [f"{self.plan.ranks[r].instance}:{self.plan.ranks[r].local_rank}" for r in roles.outcome_to]
                self._tell_all(roles.outcome_to, dict(message, silent=silent))
            raise
        if leads:
            self._tell_all(roles.outcome_to, dict(message, silent=doc.get("silent", [])))

    def _tell_all(self, peers: Sequence[int], message: dict) -> None:
        """Tell each of ``peers`` (waiting a while for room in a full queue; one that refuses it reads the record
        itself after its slice: :meth:`_wait_recorded`)."""
        for peer in peers:
            try:
                self.relay.tell(peer, message)
            except OSError as e:
                log.info("sync rank %d: could not tell sync rank %d its outcome is recorded: %s", self.rank, peer, e)

    def _wait_recorded(
        self, manifest: SyncManifest, me: RankDescriptor, lead: RankDescriptor, doc: dict, deadline: float
    ) -> None:
        """A group's member that told its lead: until the lead says whether its outcome is in its record (after each
        slice without a word, a look at the record itself); where it is not (the lead called it silent, exited, or
        nothing came by ``deadline``), its own key."""
        name = keys.instance_outcomes(manifest.version, manifest.seq, self.record_of(self.plan, lead.rank))
        while True:
            try:
                silent = self.relay.hear("recorded", manifest.version, manifest.seq, _slice(deadline)).get("silent")
            except RelayTimeout:
                record = self.channel.get(name)  # its word lost (a full queue): the record says it as well
                silent = record.get("silent") if isinstance(record, dict) else None
                gone = exited_here(self.processes, lead.instance, lead.local_rank)
                if silent is None and time.monotonic() < deadline and gone is None:
                    continue
            if isinstance(silent, list) and f"{me.instance}:{me.local_rank}" not in silent:
                return
            break
        super().report(manifest, me, doc)


def _slice(deadline: float) -> float:
    """A wait until ``deadline`` (``time.monotonic()``) of at most :data:`LIVENESS_SECONDS` (then a look at who
    exited on this host)."""
    return max(0.001, min(LIVENESS_SECONDS, deadline - time.monotonic()))


def _said(value: Any) -> bool:
    """A sender's ready signal: an export generation, or :data:`WITHHELD` (it failed the version)."""
    return value == WITHHELD or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)


def with_relays(
    plan: Plan,
    rank: int,
    processes: Mapping[tuple[str, int], tuple],
    signals: Signals,
    channel: VersionChannel | None,
) -> tuple[HostGroups | None, HostRelay | None, Signals]:
    """A new plan's host groups, this rank's relays and its signals through them, where the plan's signals go over
    the version channel (on the host board every rank reads the same shared memory; through the MetaServer no
    relay would be heard): every rank of such a plan alike, since where a ready signal goes depends on it.
    ``processes``: each rank's ``(host, pid, start)`` as the device exchange found them."""
    if not isinstance(signals, ChannelSignals) or channel is None:
        return None, None, signals
    groups = HostGroups.of(plan, {who: where[0] for who, where in processes.items()})
    mine = groups.roles(rank)
    relay = HostRelay(mine, rank, channel.secret) if mine else None
    relayed = RelayedSignals(signals, plan, groups, relay, rank, processes) if groups.relays_ready else signals
    return groups, relay, relayed
