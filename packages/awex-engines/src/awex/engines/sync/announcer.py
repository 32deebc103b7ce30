"""Rank 0 of a writer: what it alone does around a version, off the other ranks' route. It announces each version
(:meth:`Announcer.announce`: the manifest on the host board, the version channel and the MetaServer; hosting both),
takes a failed attempt back (:meth:`Announcer.withdraw`), reports which version each destination serves
(:meth:`Announcer.report`) and drops the records of versions older than the last ``keep_versions``
(:meth:`Announcer.forget_old`, from the writer's background thread)."""

from __future__ import annotations

import logging
import time
from collections import deque
from functools import partial
from typing import Callable, Sequence

from awex.engines.errors import ClaimRefusedError
from awex.engines.sync import keys
from awex.engines.sync.board import HostBoard, host_identity
from awex.engines.sync.channel import VersionChannel
from awex.engines.sync.forgetting import CLOSE_SECONDS, Forgetting
from awex.engines.sync.keys import version_records
from awex.engines.sync.lease import ClaimLease
from awex.engines.sync.manifest import SyncManifest
from awex.engines.sync.options import SyncOptions
from awex.engines.sync.session import SyncSession
from awex.engines.sync.signals import says_ready
from awex.meta import Plan, Role
from awex.meta.client import MetaClient
from awex.meta.errors import AwexValueError, MetaConflictError, MetaFencedError, MetaNotRegisteredError, MetaServerError
from awex.transport.net import free_port
from awex.transport.registry import TRANSPORTS

log = logging.getLogger("awex.engines")

# how long a notice of a version this writer refused itself stays up: receivers waiting for it read it within
# microseconds (host board) or a round trip (version channel); a retry's receivers, later, must not
NOTICE_SECONDS = 0.5


class Announcer:
    """Rank 0's side of a writer (see the module)."""

    def __init__(
        self,
        client: MetaClient,
        session: SyncSession,
        instance: str,
        keep_versions: int,
        epoch: int = 0,
        lease: float | None = None,
        lanes: int = 1,
        ranks: int = 1,
    ):
        self.client, self._session, self.instance, self.keep_versions = client, session, instance, keep_versions
        self.lanes = lanes  # of the version channel it hosts (awex.engines.sync.channel.lanes_for)
        self.ranks = ranks  # of its trainer
        self.epoch = epoch  # this writer's fence (the client carries it on every write)
        # claims sent on the lease are not waited for before the transfer (awex.engines.sync.lease)
        self.lease = None if lease is None or client.fence is None else ClaimLease(client, keys.manifest(""), lease)
        self._unsent: tuple[str, str, dict] | None = None  # (version, key, manifest) of a claim on the lease to send
        self._unconfirmed: tuple[str, Callable[[], None]] | None = None  # (version, its claim's answer) to read
        self._port: int | None = None
        self._channel: VersionChannel | None = None  # hosted here (awex.engines.sync.channel)
        self._cleaner: VersionChannel | None = None  # the background thread's connection to it
        self._bytes_of: dict[str, tuple[Plan, int]] = {}  # instance -> (plan, bytes it moves there)
        self._board: HostBoard | None = None  # the host board (awex.engines.sync.board), where /dev/shm allows
        self._seq = 0  # attempts announced: the manifest's count
        # (version, attempt, transport, signal medium), oldest first
        self._written: deque[tuple[str, int, str | None, str | None]] = deque()
        self._on_channel: set[str] = set()  # versions whose manifest this writer put on the version channel
        # failed attempts whose records and signals go with the next successful write: (version, attempt, medium)
        self._pending_forget: list[tuple[str, int, str | None]] = []
        self._forgetting = Forgetting(client)  # old versions' MetaServer records, dropped a batch at a time
        self._manifest: SyncManifest | None = None  # the last manifest, and as JSON
        self._options_given: SyncOptions | None = None  # the writer's options last announced, and as read
        self._options_wire = SyncOptions()
        self._manifest_doc: dict | None = None
        self._manifest_given: tuple = ()  # (destinations, options) the last manifest was made from
        self.last_phases: dict[str, float] = {}  # seconds of the last announcement's steps: claim, post

    def close(self) -> None:
        self.confirm(quiet=True)
        self._forgetting.flush(timeout=CLOSE_SECONDS)  # old versions' records still waiting for a batch
        if self.lease is not None:
            self.lease.close()
        self._channel = self._cleaner = None  # stops the version channel once the session dropped it too
        if self._board is not None:
            self._board.close()  # removes it
            self._board = None

    def withdraw(self, manifest: SyncManifest) -> None:
        """Rank 0: take a failed attempt's manifest back (board, channel, MetaServer records), so that a retry
        announces afresh, on a new rendezvous."""
        version = manifest.version
        self.confirm(quiet=True)  # its answer first: the claim is made before it is released
        self._manifest = self._manifest_doc = None
        self._port = None
        if self._board is not None:
            self._board.post({"version": None, "withdrawn": version, "seq": manifest.seq})
        try:
            if self._channel is not None and version in self._on_channel:
                self._channel.delete([keys.channel_manifest(version)])
                self._on_channel.discard(version)
        except Exception as e:
            log.warning("could not withdraw %s from the version channel: %s", version, e)
        names, prefixes = keys.withdrawn_records(version)
        # the rest, and its signals on the channel, with the next successful write
        self._pending_forget.append((version, manifest.seq, getattr(self._session.signals, "medium", None)))
        try:  # the name too, unless a version under it was applied (a retry may claim it again)
            self.client.forget(names, prefixes, release=[keys.manifest(version)])
        except MetaServerError as e:
            log.warning("could not drop the MetaServer records of the failed version %s: %s", version, e)

    def report(self, version: str, verdicts: dict[str, str], plan=None, seconds: float | None = None) -> None:
        """Tell the MetaServer which version each destination instance serves now, with the bytes its ranks
        received and the sync's time (as this rank saw it): one request for all of them."""
        reports = self._reports(version, verdicts, plan, seconds)
        if reports:
            self._reported(version, reports, lambda: self.client.report_versions(reports))

    def report_sent(
        self, version: str, verdicts: dict[str, str], plan=None, seconds: float | None = None
    ) -> Callable[[], None] | None:
        """:meth:`report`, in two: the request leaves now (before ``write`` returns: a version's report travels
        with its outcome, so a writer killed once ``write`` returned has said it); calling what this returns reads
        the answer (the thread's next request waits for that). ``None`` when there is nothing to report."""
        reports = self._reports(version, verdicts, plan, seconds)
        if not reports:
            return None
        try:
            answer = self.client.report_versions_sent(reports)
        except MetaServerError as e:  # reporting must not mask the sync's own outcome
            log.warning("could not report version %s of %s to the MetaServer: %s", version, sorted(reports), e)
            return None
        return partial(self._reported, version, reports, answer)

    def _reports(self, version: str, verdicts: dict[str, str], plan, seconds: float | None) -> dict[str, dict]:
        reports: dict[str, dict] = {}
        for instance, verdict in sorted(verdicts.items()):
            if verdict == "unchanged":
                continue
            serves = version if verdict == "applied" else None
            report: dict = {"version": serves}
            if plan is not None and serves is not None:
                report["bytes"] = self._received_bytes(plan, instance)
                if seconds is not None:
                    report["seconds"] = seconds
            if serves is not None:  # the name is never written again (the server keeps it, journalled)
                report["claim"] = keys.manifest(version)
            reports[instance] = report
        return reports

    def _received_bytes(self, plan: Plan, instance: str) -> int:
        """Bytes the plan moves to ``instance``'s ranks (counted once a plan: steady versions reuse it)."""
        known = self._bytes_of.get(instance)
        if known is None or known[0] is not plan:
            ranks = [r.rank for r in plan.instance_ranks(instance)]
            nbytes = sum(s.bucket.nbytes for r in ranks for s in plan.schedule(r) if s.op == "recv")
            known = self._bytes_of[instance] = (plan, nbytes)
        return known[1]

    def _reported(self, version: str, reports: dict[str, dict], answer: Callable[[], list[str]]) -> None:
        """Read a report's answer; register again the instances a restarted MetaServer did not know, and report
        them again."""
        try:
            missing = answer()
            for instance in missing:  # a MetaServer restarted while the instance had nothing to tell it
                layout = self._session.layout_of(instance)
                if layout is None:
                    raise MetaNotRegisteredError(f"{instance} is not registered, and its layout is unknown here")
                self.client.register(instance, role="inference", instance=instance, world_size=layout.world_size)
            if missing:
                self.client.report_versions({i: reports[i] for i in missing})
        except MetaServerError as e:  # reporting must not mask the sync's own outcome
            log.warning("could not report version %s of %s to the MetaServer: %s", version, sorted(reports), e)

    def announce(
        self,
        version: str,
        destinations: Sequence[str],
        options: SyncOptions,
        meanwhile: Callable[[], object] | None = None,
    ) -> SyncManifest:
        """Rank 0: claim version ``version`` on the MetaServer (its manifest, created once: a name another writer
        announced, or a writer replaced by a newer one of this instance, is refused here, before any rank can start),
        then publish the manifest on the host board and the version channel. ``meanwhile`` runs while the claim
        travels (an error there takes the claim back). A claim sent under the lease is answered later
        (:meth:`confirm`)."""
        self.keep_versions = options.keep_versions  # as the writer says now (it may change between versions)
        if self._board is not None:  # readers asleep on the board wake while this version is prepared
            self._board.heads_up()
        if self._port is None:
            self._port = free_port(options.host)
        if self._channel is None:
            layouts = [self._session.layout_of(d) for d in destinations]  # its own ranks', about as many again
            ranks = self.ranks + sum(x.world_size if x is not None else self.ranks for x in layouts)
            self._channel = self._session.channel = VersionChannel.host(
                options.host, options.timeout, self.lanes, ranks=ranks
            )
            try:
                self._board = self._session.board = HostBoard.create()
            except OSError as e:  # no /dev/shm here: the channel carries every signal
                log.info("no host board (%s); per-version signals go over the version channel", e)
        self._seq += 1
        last, given = self._manifest, (tuple(destinations), options)
        if last is not None and given == self._manifest_given:  # the same destinations and options equal to the
            fresh, same = last.renamed(version, self._seq), True  # last's: the rest of the manifest is this announcer's
        else:
            fresh = self._manifest_for(version, destinations, options)
            same = last is not None and last.renamed(version, self._seq) == fresh
        # options as before (a writer's options may change between versions), and every rank of this plan already
        # saw a manifest of ours
        steady = same and self._session.steady_for(fresh)
        doc = dict(self._manifest_doc, version=version, seq=self._seq) if steady else fresh.to_json()
        # the name is claimed before any rank can read the manifest (in steady state too): a name another writer
        # announced, or any write of a writer a newer one of this instance replaced (fenced), starts nothing. Under
        # this writer's claim lease a fresh name's claim is sent once the manifest is posted and its answer read after
        # the transfer began (no other writer can claim, and no newer one take over, while the lease lasts)
        key, lease = keys.manifest(version), self.lease
        # steady versions only: a first version or a new plan makes many round trips anyway, and its ranks start
        # from the server's state (a claim answered first keeps them from starting on a server that is down)
        leased = steady and lease is not None and lease.covers(key)  # its answer is read after the transfer began
        if lease is not None:
            lease.claiming(key)
        claiming = time.perf_counter()
        answer = None if leased else self.client.put_sent(key, doc, create_only=True)
        sent = time.perf_counter()
        if meanwhile is not None:
            try:
                meanwhile()
            except BaseException as e:
                if answer is not None:
                    self._take_back(version, answer)
                if isinstance(e, Exception):  # this writer's own views refused (memory offloaded, say)
                    self._refuse(version, f"{type(e).__name__}: {e}", withdraw_after=NOTICE_SECONDS)
                raise
        waiting = time.perf_counter()
        if answer is not None:
            self._claimed(version, doc, answer)
        posting = time.perf_counter()
        if self._board is not None:  # ranks on this host read it here, the others on the channel
            self._board.post(doc)
        manifest = fresh
        self._manifest, self._manifest_doc, self._manifest_given = manifest, doc, given
        if not steady or getattr(self._session.signals, "medium", "meta") != "board":  # not every rank maps the board
            self._channel.put(keys.channel_manifest(version), {k: v for k, v in doc.items() if k != "channel_secret"})
            self._on_channel.add(version)
        posted = time.perf_counter()
        if leased:  # sent once the transfer began (the lease keeps the name this writer's): answered later
            self._unsent = (version, key, doc)
        claimed = (sent - claiming) + (posting - waiting) + (time.perf_counter() - posted)
        self.last_phases = {"claim": claimed, "post": posted - posting}
        return manifest

    def send_claim(self) -> None:
        """Send the claim of a version announced under the lease (once its transfer began: off its critical
        path); :meth:`confirm` reads the answer."""
        unsent, self._unsent = self._unsent, None
        if unsent is not None:
            version, key, doc = unsent
            self._unconfirmed = (version, self.client.put_sent(key, doc, create_only=True))

    def confirm(self, quiet: bool = False) -> None:
        """Read the answer of a claim sent on the lease (sent now if it was not yet). A claim the server refused
        fails the version (``quiet``: a failed attempt being taken back: a claim not sent is not sent, nothing
        raised)."""
        if quiet:
            self._unsent = None
        self.send_claim()
        pending, self._unconfirmed = self._unconfirmed, None
        if pending is None:
            return
        version, answer = pending
        try:
            answer()
        except MetaServerError as e:
            if not quiet:
                raise ClaimRefusedError(
                    f"the MetaServer refused the claim of version {version!r}, sent under this writer's claim lease "
                    f"(was the lease lost with a server that restarted without a journal?): {e}"
                ) from e

    def _claimed(self, version: str, doc: dict, answer: Callable[[], None]) -> None:
        """Read a claim's answer before any rank may start: a name taken (unless it may be taken over), or a writer
        fenced, is refused here (and the receivers told at once)."""
        try:
            try:
                answer()
            except MetaFencedError:
                raise
            except MetaConflictError:
                if not self._may_take_over(version):
                    raise AwexValueError(
                        f"version {version!r} was already announced on the MetaServer (by another writer, "
                        "or an earlier run of this job): version names are written once"
                    ) from None
                self.client.put(keys.manifest(version), doc)  # fenced: refused if a newer writer took over meanwhile
                log.warning("%s took over version %s from the writer it replaced", self.instance, version)
        except ValueError as e:  # its receivers learn it at once, not at their deadline (a fenced writer, whose
            # receivers a newer one drives now, says nothing)
            self._refuse(version, str(e))
            raise

    def _wire(self, options: SyncOptions) -> SyncOptions:
        """The writer's options as every rank reads them from its manifest (made again only when they change)."""
        if options is not self._options_given:
            self._options_given, self._options_wire = options, SyncOptions.from_wire(options.to_wire())
        return self._options_wire

    def _manifest_for(self, version: str, destinations: Sequence[str], options: SyncOptions) -> SyncManifest:
        return SyncManifest(
            version,
            (self.instance,),
            tuple(sorted(destinations)),
            options.host,
            self._port,
            self._wire(options),
            refresh_by_wave=options.refresh_by_wave is not None,
            channel=self._channel.address,
            channel_secret=self._channel.secret,
            seq=self._seq,
            board=self._board.path if self._board else None,
            board_host=host_identity() if self._board else None,
            epoch=self.epoch,
        )

    def _refuse(self, version: str, cause: str, withdraw_after: float | None = None) -> None:
        """Tell the receivers waiting for ``version`` on this writer's board and channel that it was refused before
        it was announced (their receive raises ``VersionRefusedError``; nothing began, plan and group stay). With
        ``withdraw_after``: the notice is taken back after that many seconds (the receivers waiting now have read
        it), so that receivers of a retry under the same name (its cause mended) wait for its manifest instead."""
        notice = {"version": None, "refused": version, "cause": cause[:500]}
        try:
            if self._board is not None:
                self._board.post(dict(notice, seq=self._seq))
            if self._channel is not None:
                self._channel.put(keys.channel_manifest(version), notice)
            if withdraw_after is not None:
                time.sleep(withdraw_after)
                if self._board is not None:
                    self._board.post({"version": None, "seq": self._seq})  # no version's: read by nobody
                if self._channel is not None:
                    self._channel.delete([keys.channel_manifest(version)])
        except Exception as e:  # they then wait until their deadline
            log.warning("could not tell the receivers that %s was refused: %s", version, e)

    def _take_back(self, version: str, answer: Callable[[], None]) -> None:
        """The work beside a claim failed: read the claim's answer and, where it was claimed, drop it again (no rank
        saw it: it was posted nowhere else), so the name stays free for a retry."""
        try:
            answer()
        except MetaServerError:
            return  # not claimed (or unknown): nothing to take back
        try:
            self.client.forget(*keys.withdrawn_records(version), release=[keys.manifest(version)])
        except MetaServerError as e:
            log.warning("could not take back the claim of %s: %s", version, e)

    def _may_take_over(self, version: str) -> bool:
        """Whether ``version``'s claim is an unfinished one of a writer this one replaced: announced by this
        instance alone at an older epoch, and served by none of its destinations (a version that was applied is
        never written again, by any writer)."""
        try:
            claim = self.client.try_get(keys.manifest(version))
            if not isinstance(claim, dict) or claim.get("sources") != [self.instance]:
                return False
            epoch = claim.get("epoch", 0)
            if not isinstance(epoch, int) or isinstance(epoch, bool) or not 0 <= epoch < self.epoch:
                return False
            job = self.client.status(job=self.client.job)["jobs"].get(self.client.job, {})
            serving = {p.get("name"): p.get("weight_version") for p in job.get("participants", [])}
            return all(serving.get(d) != version for d in claim.get("destinations", []))
        except (MetaServerError, TypeError, AttributeError):
            return False

    def forget_old(
        self, version: str, seq: int, plan: Plan | None = None, kind: str | None = None, medium: str | None = None
    ) -> None:
        """Drop the MetaServer records of versions older than the last ``keep_versions`` (a long RL run writes
        thousands; the server's key store is bounded), :data:`~awex.engines.sync.forgetting.FORGET_EVERY` versions a
        request. This version's bytes reached every receiver (p2p) or every
        receiver said it is done (ipc), and a receiver finishes a version, validation report included, before it
        receives the next: the older versions' records are final and nobody waits on them (assuming, as training
        does, that this instance's ranks write versions in step, never ``keep_versions`` apart). ``kind``: the
        transport every rank of the version used (agreed with its plan), ``medium`` where its per-version signals
        went (``"channel"``, ``"board"``, ``"meta"``): what the version left on the version channel, and only
        that, is dropped from it (``None``: as if every transport's signals went there)."""
        self._written.append((version, seq, kind, medium))
        while self._pending_forget:  # failed attempts: records their ranks may have left after the first drop
            failed, failed_seq, failed_medium = self._pending_forget.pop()
            # its signals on the channel (any transport's ready signals; its manifest withdrawn already)
            self._forget_signals(failed, failed_seq, plan, None, failed_medium, manifest=False)
            if failed != version:
                names, prefixes = version_records(failed)
                try:
                    self.client.forget(names, prefixes)
                except MetaServerError as e:
                    log.warning("could not drop the MetaServer records of the failed version %s: %s", failed, e)
        while len(self._written) > self.keep_versions:
            old, old_seq, old_kind, old_medium = self._written.popleft()
            self._forget_signals(old, old_seq, plan, old_kind, old_medium)
            self._forgetting.add(old, *version_records(old))  # a request for several versions

    def _forget_signals(
        self, version: str, seq: int, plan: Plan | None, kind: str | None, medium: str | None, manifest: bool = True
    ) -> None:
        """Drop attempt ``seq`` of version ``version``'s keys from the version channel (from the background thread,
        on a connection of its own): a round trip each, so only those it left there: its manifest where this writer
        put it there (not with ``manifest=False``: a failed attempt's, withdrawn already, shares its key with a
        retry's), and where its signals went over the channel, the trainer ranks' ready signals (over a transport
        whose senders signal ready), the receivers' outcomes and the records of them."""
        channel = self._channel
        if channel is None:
            return
        names = []
        if manifest and version in self._on_channel:
            names.append(keys.channel_manifest(version))
            self._on_channel.discard(version)
        if medium in ("channel", None) and plan is not None:
            # every trainer rank says ready (over a transport that signals it: under its host's key where its host
            # has a lead, awex.engines.sync.relayed), every receiver reports
            trainers, groups = plan.ranks_of(Role.TRAINER), self._session.host_groups
            own, leads = groups.ready_keys([r.rank for r in trainers]) if groups else ([r.rank for r in trainers], [])
            own = [r.rank for r in trainers] if medium is None else own  # a failed attempt's: wherever they went
            senders = [(plan.ranks[r].instance, plan.ranks[r].local_rank) for r in own]
            # receivers' records of their groups' outcomes; keys of their own where they put them
            signals = self._session.signals
            records = signals.record_groups(plan) if signals is not None else {}
            reported = signals.own_outcomes(plan, version, seq) if signals is not None else []
            everywhere = medium is None or kind is None or signals is None  # a failed attempt's: wherever they went
            reported = plan.ranks_of(Role.INFERENCE) if everywhere else reported
            receivers = [(r.instance, r.local_rank) for r in reported]
            # a failed attempt's: every transport's (a sender that withheld it put a key over any transport)
            kinds = [k for k in [kind] if says_ready(k)] if kind else sorted(TRANSPORTS)
            relayed = groups is not None and (groups.relays_ready or kind is None)  # the first trainer rank's key
            names += keys.channel_signals(version, seq, senders, receivers, kinds, leads, sorted(records), relayed)
        if not names:
            return
        if self._cleaner is None or self._cleaner.address != channel.address:
            self._cleaner = channel.clone()
        self._cleaner.delete(names)
