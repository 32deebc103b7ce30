"""Per-version signals of one plan: a sender's "my bytes of this version are ready" and a receiver's outcome.

One interface (:class:`Signals`), one implementation per medium, chosen once per plan by what every rank of the
sync can use (:func:`awex.engines.sync.places.exchange` finds it; :func:`signals_for` makes it):

- :class:`BoardSignals`: the host board (``/dev/shm``), when every rank runs on the writer's host;
- :class:`ChannelSignals`: the writer's version channel, when every rank reached it;
- :class:`MetaSignals`: the MetaServer, always reachable.

Nothing here reads a sync session: peer links and outcomes take ``(plan, rank, signals)``."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from functools import lru_cache
from typing import Any, Protocol, Sequence

from awex.engines.sync import keys
from awex.engines.sync.board import DETAIL, HostBoard
from awex.engines.sync.channel import ChannelError, VersionChannel
from awex.engines.sync.manifest import SyncManifest
from awex.meta import Plan, RankDescriptor, Role
from awex.meta.client import MetaClient
from awex.meta.errors import AwexValueError
from awex.transport.registry import transport_class

log = logging.getLogger("awex.engines")

OK_DETAIL, FAILED_DETAIL = 0, 1  # a receiver's outcome on the host board (its cause goes to the MetaServer)
WITHHELD_DETAIL = DETAIL - 1  # a sender's slot: it failed the version before its bytes were ready (no generation)
WITHHELD = "withheld"  # what wait_ready gives for such a sender instead of its generation
AGGREGATE_SECONDS = 1.0  # the longest an instance's first rank waits for its ranks' outcomes (they finish together)


class Signals(Protocol):
    """Where one plan's per-version signals go. ``kind`` is the transport's name (ready keys carry it)."""

    medium: str  # "board", "channel" or "meta"
    shares_outcomes: bool  # the first trainer rank collects the outcomes for all (publish_outcomes / collected)

    def ready(self, kind: str, manifest: SyncManifest, me: RankDescriptor, generation: int) -> None:
        """A sender: this version's bytes are ready to be read (``generation``: of its export or segment)."""

    def wait_ready(self, kind: str, manifest: SyncManifest, senders: Sequence[RankDescriptor], timeout: float) -> list:
        """A receiver: each sender's generation once all said ready (:data:`WITHHELD` for one that withheld the
        version); ``TimeoutError`` after ``timeout`` seconds."""

    def withhold(self, kind: str, manifest: SyncManifest, me: RankDescriptor) -> None:
        """A sender that failed this version before (or while) its bytes were ready: its receivers' wait for it ends
        now, not at their deadline. The host board says it in the sender's own slot, the version channel and the
        MetaServer under its ready key (:data:`WITHHELD` for a generation; through host relays: its host's key and
        the first trainer rank's, ``awex.engines.sync.relayed``)."""

    def withheld(self, kind: str, manifest: SyncManifest, senders: Sequence[RankDescriptor]) -> list[RankDescriptor]:
        """Without waiting: those of ``senders`` that withheld the version (:meth:`withhold`). For receivers over a
        transport whose senders say no ready (p2p), asked about once a second while the bytes are awaited."""

    def report(self, manifest: SyncManifest, me: RankDescriptor, doc: dict) -> None:
        """A receiver's outcome ``doc`` (``{"ok", "cause", "partial"}``)."""

    def outcomes(self, manifest: SyncManifest, receivers: Sequence[RankDescriptor], deadline: float) -> list[Any]:
        """A trainer rank: each receiver's outcome document (``None`` where none came by ``deadline``)."""

    def publish_outcomes(self, manifest: SyncManifest, doc: dict) -> None:
        """The first trainer rank: every receiver's outcome in one record (``awex.engines.sync.outcomes``; where
        :attr:`shares_outcomes`: not on the host board, whose slots every rank reads at once)."""

    def collected(self, manifest: SyncManifest, timeout: float) -> Any:
        """The other trainer ranks: the first one's record of every outcome; ``TimeoutError`` after ``timeout``."""

    def publish_instance(self, manifest: SyncManifest, instance: str, doc: dict) -> None:
        """An instance's first receiving rank: its instance's outcomes in one record (where :attr:`shares_outcomes`)."""

    def instances(self, manifest: SyncManifest, names: Sequence[str], deadline: float) -> list[Any]:
        """The first trainer rank: each instance's record (``None`` where none came by ``deadline``)."""

    def record_groups(self, plan: Plan) -> Mapping[str, Sequence[RankDescriptor]]:
        """Where :attr:`shares_outcomes`: the receiving ranks whose outcomes come in one record, by the record's name
        (:meth:`publish_instance`); each group's first rank gathers them (:meth:`gather`). A rank in no group is
        read alone."""

    def record_of(self, plan: Plan, rank: int) -> str | None:
        """The name of the record sync rank ``rank``'s outcome goes into (:meth:`record_groups`), if any."""

    def own_outcomes(self, plan: Plan, version: str, seq: int) -> list[RankDescriptor]:
        """The first trainer rank, once attempt ``seq`` of ``version`` ended: the receivers that put an outcome key
        of their own (what its writer drops from the channel once the version is old)."""

    def gather(
        self, manifest: SyncManifest, me: RankDescriptor, group: Sequence[RankDescriptor], deadline: float
    ) -> list[Any] | None:
        """Rank ``me`` of ``group``, after its own :meth:`report`: its first rank gets each member's outcome
        document (``None`` where none came by ``deadline``); the others ``None``, once their outcome is on its way."""


class InstanceRecords:
    """Outcome records by engine instance (where the signals share outcomes): an instance of two or more receiving
    ranks is one group, whose first rank reads its ranks' outcomes for at most :data:`AGGREGATE_SECONDS` (they
    finish together; a rank it calls silent is read alone). Computed once a plan."""

    _groups: tuple[Plan, dict[str, list[RankDescriptor]], dict[int, str]] | None = None

    def _record_groups(self, plan: Plan) -> dict[str, list[RankDescriptor]]:
        groups: dict[str, list[RankDescriptor]] = {}
        for r in plan.ranks_of(Role.INFERENCE):
            groups.setdefault(r.instance, []).append(r)
        return {name: ranks for name, ranks in groups.items() if len(ranks) > 1}

    def _cached(self, plan: Plan) -> tuple[Plan, dict[str, list[RankDescriptor]], dict[int, str]]:
        if self._groups is None or self._groups[0] is not plan:
            groups = self._record_groups(plan)
            self._groups = (plan, groups, {r.rank: name for name, ranks in groups.items() for r in ranks})
        return self._groups

    def record_groups(self, plan: Plan) -> Mapping[str, Sequence[RankDescriptor]]:
        return self._cached(plan)[1]

    def record_of(self, plan: Plan, rank: int) -> str | None:
        return self._cached(plan)[2].get(rank)

    def own_outcomes(self, plan: Plan, version: str, seq: int) -> list[RankDescriptor]:
        return plan.ranks_of(Role.INFERENCE)  # every receiver reports under its own key; a group's lead reads them

    def gather(
        self, manifest: SyncManifest, me: RankDescriptor, group: Sequence[RankDescriptor], deadline: float
    ) -> list[Any] | None:
        if me.rank != group[0].rank:
            return None  # its outcome is on the channel already (report)
        return self.outcomes(manifest, group, min(deadline, time.monotonic() + AGGREGATE_SECONDS))


class MetaSignals(InstanceRecords):
    """Every signal a key on the MetaServer (``awex.engines.sync.keys.ready`` / ``outcome``)."""

    medium = "meta"
    shares_outcomes = True

    def __init__(self, client: MetaClient):
        self.client = client

    def ready(self, kind: str, manifest: SyncManifest, me: RankDescriptor, generation: int) -> None:
        self.client.put(keys.ready(kind, manifest.version, manifest.seq, me.instance, me.local_rank), generation)

    def withhold(self, kind: str, manifest: SyncManifest, me: RankDescriptor) -> None:
        self.client.put(keys.ready(kind, manifest.version, manifest.seq, me.instance, me.local_rank), WITHHELD)

    def withheld(self, kind: str, manifest: SyncManifest, senders: Sequence[RankDescriptor]) -> list[RankDescriptor]:
        v, seq, get = manifest.version, manifest.seq, self.client.try_get
        return [s for s in senders if get(keys.ready(kind, v, seq, s.instance, s.local_rank)) == WITHHELD]

    def wait_ready(self, kind: str, manifest: SyncManifest, senders: Sequence[RankDescriptor], timeout: float) -> list:
        deadline = time.monotonic() + timeout
        return [
            self.client.get(
                keys.ready(kind, manifest.version, manifest.seq, s.instance, s.local_rank),
                timeout=max(0.001, deadline - time.monotonic()),
            )
            for s in senders
        ]

    def report(self, manifest: SyncManifest, me: RankDescriptor, doc: dict) -> None:
        self.client.put(keys.outcome(manifest.version, manifest.seq, me.instance, me.local_rank), doc)

    def outcomes(self, manifest: SyncManifest, receivers: Sequence[RankDescriptor], deadline: float) -> list[Any]:
        out = []
        for r in receivers:
            try:
                key = keys.outcome(manifest.version, manifest.seq, r.instance, r.local_rank)
                out.append(self.client.get(key, timeout=max(0.0, deadline - time.monotonic())))
            except TimeoutError:
                out.append(None)
        return out

    def publish_outcomes(self, manifest: SyncManifest, doc: dict) -> None:
        self.client.put(keys.outcomes(manifest.version, manifest.seq), doc)

    def collected(self, manifest: SyncManifest, timeout: float) -> Any:
        return self.client.get(keys.outcomes(manifest.version, manifest.seq), timeout=max(0.001, timeout))

    def publish_instance(self, manifest: SyncManifest, instance: str, doc: dict) -> None:
        self.client.put(keys.instance_outcomes(manifest.version, manifest.seq, instance), doc)

    def instances(self, manifest: SyncManifest, names: Sequence[str], deadline: float) -> list[Any]:
        out = []
        for name in names:
            try:
                key = keys.instance_outcomes(manifest.version, manifest.seq, name)
                out.append(self.client.get(key, timeout=max(0.001, deadline - time.monotonic())))
            except TimeoutError:
                out.append(None)
        return out


class ChannelSignals(InstanceRecords):
    """Signals through the writer's version channel (a failure's cause goes to the MetaServer too: outcomes)."""

    medium = "channel"
    shares_outcomes = True

    def __init__(self, channel: VersionChannel, client: MetaClient | None = None):
        self.channel, self.client = channel, client

    def ready(self, kind: str, manifest: SyncManifest, me: RankDescriptor, generation: int) -> None:
        self.channel.put(keys.ready(kind, manifest.version, manifest.seq, me.instance, me.local_rank), generation)

    def withhold(self, kind: str, manifest: SyncManifest, me: RankDescriptor) -> None:
        self.channel.put(keys.ready(kind, manifest.version, manifest.seq, me.instance, me.local_rank), WITHHELD)

    def withheld(self, kind: str, manifest: SyncManifest, senders: Sequence[RankDescriptor]) -> list[RankDescriptor]:
        v, seq, get = manifest.version, manifest.seq, self.channel.get
        return [s for s in senders if get(keys.ready(kind, v, seq, s.instance, s.local_rank)) == WITHHELD]

    def wait_ready(self, kind: str, manifest: SyncManifest, senders: Sequence[RankDescriptor], timeout: float) -> list:
        names = [keys.ready(kind, manifest.version, manifest.seq, s.instance, s.local_rank) for s in senders]
        return self.channel.wait(names, timeout)

    def report(self, manifest: SyncManifest, me: RankDescriptor, doc: dict) -> None:
        self.channel.put(keys.channel_outcome(manifest.version, manifest.seq, me.instance, me.local_rank), doc)

    def outcomes(self, manifest: SyncManifest, receivers: Sequence[RankDescriptor], deadline: float) -> list[Any]:
        names = [keys.channel_outcome(manifest.version, manifest.seq, r.instance, r.local_rank) for r in receivers]
        try:
            return self.channel.wait(names, max(0.001, deadline - time.monotonic()))
        except TimeoutError:
            return [self.channel.get(k) for k in names]

    def publish_outcomes(self, manifest: SyncManifest, doc: dict) -> None:
        self.channel.put(keys.channel_record(manifest.version, manifest.seq), doc)

    def collected(self, manifest: SyncManifest, timeout: float) -> Any:
        """From the channel; where it is gone (the first rank closed its writer once its last version was
        applied), from the MetaServer, where that writer puts its last version's record as it closes or its process
        exits (``Background.last_word``)."""
        deadline = time.monotonic() + timeout
        try:
            return self.channel.wait([keys.channel_record(manifest.version, manifest.seq)], max(0.001, timeout))[0]
        except ChannelError:
            if self.client is None:
                raise
            key = keys.outcomes(manifest.version, manifest.seq)
            return self.client.get(key, timeout=max(0.001, deadline - time.monotonic()))

    def publish_instance(self, manifest: SyncManifest, instance: str, doc: dict) -> None:
        self.channel.put(keys.instance_outcomes(manifest.version, manifest.seq, instance), doc)

    def instances(self, manifest: SyncManifest, names: Sequence[str], deadline: float) -> list[Any]:
        found = [keys.instance_outcomes(manifest.version, manifest.seq, name) for name in names]
        try:
            return self.channel.wait(found, max(0.001, deadline - time.monotonic()))
        except TimeoutError:
            return [self.channel.get(k) for k in found]


class BoardSignals:
    """Signals as numbers in the host board's slots, one per sync rank: a sender's export generation, a receiver's
    :data:`OK_DETAIL` / :data:`FAILED_DETAIL` (whose cause a trainer then reads from the MetaServer). Every trainer
    rank reads the receivers' slots itself (shared memory: no request, no record of them all)."""

    medium = "board"
    shares_outcomes = False  # no records: every trainer rank reads the receivers' slots

    def __init__(self, board: HostBoard, client: MetaClient):
        self.board, self.client = board, client
        self._outcomes_after = 0.0  # how long the last wait for outcomes took (polling sleeps until about then)

    # the Signals protocol's record methods: no group shares a record here
    def record_groups(self, plan: Plan) -> Mapping[str, Sequence[RankDescriptor]]:
        return {}

    def record_of(self, plan: Plan, rank: int) -> str | None:
        return None

    def own_outcomes(self, plan: Plan, version: str, seq: int) -> list[RankDescriptor]:
        return []

    def gather(
        self, manifest: SyncManifest, me: RankDescriptor, group: Sequence[RankDescriptor], deadline: float
    ) -> list[Any] | None:
        return None

    def ready(self, kind: str, manifest: SyncManifest, me: RankDescriptor, generation: int) -> None:
        if generation >= WITHHELD_DETAIL:
            raise AwexValueError(f"export generation {generation} does not fit a host board slot")
        self.board.ring(me.rank, manifest.seq, generation)

    def withhold(self, kind: str, manifest: SyncManifest, me: RankDescriptor) -> None:
        self.board.ring(me.rank, manifest.seq, WITHHELD_DETAIL)

    def wait_ready(self, kind: str, manifest: SyncManifest, senders: Sequence[RankDescriptor], timeout: float) -> list:
        details = self.board.wait([s.rank for s in senders], manifest.seq, timeout)
        return [WITHHELD if d == WITHHELD_DETAIL else d for d in details]

    def withheld(self, kind: str, manifest: SyncManifest, senders: Sequence[RankDescriptor]) -> list[RankDescriptor]:
        details = self.board.signalled([s.rank for s in senders], manifest.seq)
        return [s for s, d in zip(senders, details) if d == WITHHELD_DETAIL]

    def report(self, manifest: SyncManifest, me: RankDescriptor, doc: dict) -> None:
        self.board.ring(me.rank, manifest.seq, OK_DETAIL if doc.get("ok") else FAILED_DETAIL)

    def outcomes(self, manifest: SyncManifest, receivers: Sequence[RankDescriptor], deadline: float) -> list[Any]:
        slots = [r.rank for r in receivers]
        waited = time.monotonic()
        try:
            details = self.board.wait(slots, manifest.seq, max(0.0, deadline - time.monotonic()), self._outcomes_after)
            self._outcomes_after = time.monotonic() - waited  # about as long next time
        except TimeoutError:
            details = self.board.signalled(slots, manifest.seq)
        return [
            None if d is None else {"ok": True} if d == OK_DETAIL else self._cause(manifest, r)
            for r, d in zip(receivers, details)
        ]

    def _cause(self, manifest: SyncManifest, rank: RankDescriptor) -> dict:
        doc = None
        try:
            doc = self.client.get(
                keys.outcome(manifest.version, manifest.seq, rank.instance, rank.local_rank), timeout=2.0
            )
        except Exception as e:  # the board said it failed; the cause is a detail
            log.warning("cause of %s:%d's failure unknown: %s", rank.instance, rank.local_rank, e)
        return doc if isinstance(doc, dict) and doc.get("ok") is False else {"ok": False, "cause": None}


@lru_cache(maxsize=None)  # asked every version (a registry's classes do not change)
def says_ready(kind: str) -> bool:
    """Whether the senders of transport ``kind`` signal ready (True where it cannot be told: a key too many is
    dropped in vain, never one left behind)."""
    try:
        return bool(transport_class(kind).signals_ready)
    except Exception:  # noqa: BLE001 - a transport whose module cannot be imported here
        return True


def signals_for(
    medium: str, client: MetaClient, channel: VersionChannel | None, board: HostBoard | None
) -> MetaSignals | ChannelSignals | BoardSignals:
    """The signals of a plan whose ranks can all use ``medium`` (what the device exchange found: this rank said it
    has the board or channel it names)."""
    if medium == "board":
        if board is None:
            raise RuntimeError("per-version signals on the host board, but this rank has none")
        return BoardSignals(board, client)
    if medium == "channel":
        if channel is None:
            raise RuntimeError("per-version signals on the version channel, but this rank has none")
        return ChannelSignals(channel, client)
    if medium != "meta":
        raise AwexValueError(f"unknown signal medium {medium!r}")
    return MetaSignals(client)
