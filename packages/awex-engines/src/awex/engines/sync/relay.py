"""Host relays: what every rank of a version reads alike reaches each host once.

Over the version channel (``awex.engines.sync.channel``) every rank reads each version's manifest, and every trainer
rank the first one's record of every outcome: one waited read each, served one after another by the event loop of
the store the first trainer rank hosts (at 1,024 ranks most of a steady version's serial work: docs/performance.md).
Where several ranks of one group run on one host (a host's trainer ranks, or an engine instance's receiving ranks:
ranks that one call moves together), the lowest of them (the group's relay) reads them from the channel and hands
them to the others over local datagrams (Linux's abstract socket namespace, shared by the processes of
one network namespace, as ``host_identity`` counts hosts): a blocking receive that wakes at once, no polling and
no file to remove.

Who relays to whom is a pure function of the plan and of where its ranks run (:func:`roles`): every rank computes
the same, once a plan. A datagram carries a MAC keyed by the channel's secret (as the channel's values do): a
process without it can delay a version, never change what a rank reads. Nothing depends on a relay: a rank whose
relay sends nothing (gone, its datagram refused, a manifest too large) reads the channel or the MetaServer itself
once its slice of waiting ends, as it would without one.
"""

from __future__ import annotations

import collections
import hmac
import json
import logging
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from awex.engines.sync import keys
from awex.engines.sync.channel import VersionChannel
from awex.meta import Plan, Role
from awex.meta.errors import AwexError

log = logging.getLogger("awex.engines")

LOOK_SECONDS = 0.1  # a look at the channel itself after a slice without a word (a round trip even under load)
TELL_SECONDS = 5.0  # the longest a rank waits for room in its lead's datagram queue
MAX_DATAGRAM = 60 << 10  # larger documents are not relayed: the peer reads them itself
_MAC = 64  # hex digits of an HMAC-SHA256, ahead of the JSON payload
_DOMAIN = b"awex-relay\0"  # a datagram's MAC never matches a channel value's (those cover a key name)


class RelayTimeout(AwexError, TimeoutError):
    """Nothing for the version asked came from the relay within the slice."""


@dataclass(frozen=True)
class Roles:
    """One rank's part in its host's relays, each a sync rank it hears from (or ``None``) and the ranks it hands on
    to: the manifest (the rank's group on its host: the host's trainer ranks, or an engine's receiving ranks there),
    the trainer ranks' group (the record of every outcome handed on; each trainer rank's ready signal gathered into
    one key of the host), and an engine's receiving ranks on the host: their senders' ready signals (read once and
    handed on) and their outcomes (gathered into one record, ``awex.engines.sync.relayed``)."""

    manifest_from: int | None = None
    manifest_to: tuple[int, ...] = ()
    trainers_from: int | None = None
    trainers_to: tuple[int, ...] = ()
    receivers_from: int | None = None
    receivers_to: tuple[int, ...] = ()
    outcome_from: int | None = None
    outcome_to: tuple[int, ...] = ()

    @property
    def hears(self) -> bool:
        """Whether this rank has a datagram address of its own: it hears from a relay, or gathers its group's."""
        heard = (self.manifest_from, self.trainers_from, self.receivers_from, self.outcome_from)
        return heard != (None, None, None, None) or bool(self.trainers_to or self.outcome_to)

    @property
    def sends(self) -> bool:
        """Whether this rank sends datagrams: it relays, or tells its lead."""
        told = self.trainers_from is not None or self.outcome_from is not None
        return told or bool(self.manifest_to or self.trainers_to or self.receivers_to or self.outcome_to)

    def __bool__(self) -> bool:
        return self.hears or self.sends


@dataclass(frozen=True)
class HostGroups:
    """A plan's ranks by host, as the device exchange found them (a pure function of the plan and the hosts; every
    rank computes the same). Ranks that one call moves together form a group on each host, led by its lowest: the
    host's trainer ranks (they write together) and each engine instance's receiving ranks there (an engine's ranks
    receive in one call; engines may be updated one after another, so no rank waits for another engine's)."""

    host_of: Mapping[int, str]
    on: Mapping[str, tuple[int, ...]]  # host -> its ranks, ascending
    trainers_on: Mapping[str, tuple[int, ...]]
    announcer: int  # the first trainer rank (its host reads the manifest on its host board)
    engine_groups: Mapping[int, tuple[int, ...]] = field(default_factory=dict)  # lead -> its group, lead first

    @classmethod
    def of(cls, plan: Plan, hosts: Mapping[tuple[str, int], str]) -> HostGroups:
        """``hosts``: each rank's host (``(instance, local rank)`` -> host; a rank without one is in no group)."""
        host_of = {r.rank: h for r in plan.ranks if (h := hosts.get((r.instance, r.local_rank)))}
        on: dict[str, list[int]] = {}
        engines: dict[tuple[str, str], list[int]] = {}
        for rank in sorted(host_of):
            on.setdefault(host_of[rank], []).append(rank)
            if plan.ranks[rank].role == Role.INFERENCE:
                engines.setdefault((plan.ranks[rank].instance, host_of[rank]), []).append(rank)
        return cls(
            host_of=host_of,
            on={h: tuple(ranks) for h, ranks in on.items()},
            trainers_on={h: tuple(r for r in ranks if plan.ranks[r].role == Role.TRAINER) for h, ranks in on.items()},
            announcer=plan.ranks_of(Role.TRAINER)[0].rank,
            engine_groups={g[0]: tuple(g) for g in engines.values() if len(g) > 1},
        )

    def roles(self, rank: int) -> Roles:
        """Sync rank ``rank``'s relay roles, each by the lowest rank of its group on its host: the manifest relayed
        to the group (not on the first trainer rank's host, which reads it on the trainer's host board); of the
        trainer ranks, the record of every outcome handed on and their ready signals gathered; of an engine's
        receiving ranks, the ready signals of their senders read for them and their outcomes gathered."""
        here = self.host_of.get(rank)
        if here is None:
            return Roles()
        trainers = self.trainers_on[here]
        engine = next((g for g in self.engine_groups.values() if rank in g), ()) if rank not in trainers else ()
        out: dict[str, object] = {}
        groups = [("manifest", () if self.announcer in self.on[here] else trainers if rank in trainers else engine)]
        groups += [("trainers", trainers), ("receivers", engine), ("outcome", engine)]
        for name, group in groups:
            if rank in group and len(group) > 1:
                if rank == group[0]:
                    out[f"{name}_to"] = group[1:]
                else:
                    out[f"{name}_from"] = group[0]
        return Roles(**out)  # type: ignore[arg-type]

    @property
    def relays_ready(self) -> bool:
        """Whether any host has two or more trainer ranks, or two or more receiving ranks of one engine (else every
        ready signal is a key of its own, read by each receiver itself, as without relays)."""
        return bool(self.engine_groups) or any(len(g) > 1 for g in self.trainers_on.values())

    def trainers_with(self, rank: int) -> tuple[int, ...]:
        """The trainer ranks on rank ``rank``'s host (none where its host is unknown)."""
        return self.trainers_on.get(self.host_of.get(rank, ""), ())

    def ready_holder(self, sender: int) -> int:
        """Under whose ready key trainer rank ``sender``'s ready signal is: its host's trainer group's lead's (one
        key for the host), or its own where it is alone."""
        group = self.trainers_with(sender)
        return group[0] if len(group) > 1 else sender

    def ready_keys(self, trainers: Sequence[int]) -> tuple[list[int], list[int]]:
        """Of ``trainers``: those that put a ready key of their own, and the leads that put their host's."""
        own = [t for t in trainers if len(self.trainers_with(t)) < 2]
        return own, sorted({self.ready_holder(t) for t in trainers if len(self.trainers_with(t)) >= 2})


def roles(plan: Plan, hosts: Mapping[tuple[str, int], str], rank: int) -> Roles:
    """Sync rank ``rank``'s relay roles in ``plan`` (:meth:`HostGroups.roles`)."""
    return HostGroups.of(plan, hosts).roles(rank)


def address(secret: str, rank: int) -> bytes:
    """Sync rank ``rank``'s datagram address for the channel of ``secret`` (abstract: a leading NUL byte)."""
    return _address(_tag(secret), rank)


def _tag(secret: str) -> str:
    return hmac.digest(secret.encode(), b"awex-relay-address", "sha256")[:8].hex()


def _address(tag: str, rank: int) -> bytes:
    return f"\0awex-relay-{tag}-{rank}".encode()


class HostRelay:
    """One rank's relays of one plan (:func:`roles`): its own datagram socket where it hears from its relay, a
    socket to send from where it relays."""

    def __init__(self, roles: Roles, rank: int, secret: str):
        self.roles, self.rank, self.secret = roles, rank, secret
        self._key = secret.encode()
        self._inbox: socket.socket | None = None
        self._outbox: socket.socket | None = None
        self._sent: tuple[str, Any] | None = None  # the last manifest relayed: (version, its count)
        self._refused: set[int] = set()  # peers whose datagrams were refused (logged once each)
        self._early: collections.deque = collections.deque(maxlen=64)  # heard while waiting for something else
        self._tag = _tag(secret)  # of every peer's address (an HMAC: not again for each datagram)
        if roles.hears:
            inbox = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            try:
                inbox.bind(_address(self._tag, rank))
            except OSError as e:  # taken (by another process): this rank reads for itself
                inbox.close()
                log.info("sync rank %d: no relay datagrams (%s); it reads the version channel itself", rank, e)
            else:
                self._inbox = inbox
        if roles.sends:
            self._outbox = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @property
    def listening(self) -> bool:
        """Whether this rank hears its relays (its datagram address is its own)."""
        return self._inbox is not None

    @property
    def hears_manifests(self) -> bool:
        return self._inbox is not None and self.roles.manifest_from is not None

    @property
    def hears_outcomes(self) -> bool:
        return self._inbox is not None and self.roles.trainers_from is not None

    def close(self) -> None:
        for s in (self._inbox, self._outbox):
            if s is not None:
                s.close()
        self._inbox = self._outbox = None

    # -- sending ------------------------------------------------------------------------------------------------
    def _seal(self, message: dict) -> bytes:
        payload = json.dumps(message, separators=(",", ":")).encode()
        return hmac.digest(self._key, _DOMAIN + payload, "sha256").hex().encode() + payload

    def forward(self, peers: tuple[int, ...], message: dict) -> None:
        """Send ``message`` to ``peers`` (a peer that refuses it is logged once: it reads for itself after its
        slice; too large a document goes as ``None``: each peer then reads it itself)."""
        if self._outbox is None or not peers:
            return
        raw = self._seal(message)
        if len(raw) > MAX_DATAGRAM:
            raw = self._seal(dict(message, doc=None))  # too large: each peer reads it itself
        for peer in peers:
            try:
                self._outbox.sendto(raw, socket.MSG_DONTWAIT, _address(self._tag, peer))
            except OSError as e:  # not listening, or its queue is full: it reads for itself after its slice
                if peer not in self._refused:
                    self._refused.add(peer)
                    log.info("sync rank %d: relay to sync rank %d refused (%s)", self.rank, peer, e)

    def tell(self, peer: int, message: dict, timeout: float = TELL_SECONDS) -> None:
        """Send ``message`` to sync rank ``peer`` alone; while its queue is full (a host's datagram queue holds a
        few: ``net.unix.max_dgram_qlen``), again until ``timeout`` seconds passed. ``OSError`` where it is refused
        (not listening) or still full."""
        if self._outbox is None:
            raise OSError(f"sync rank {self.rank} relays nothing")
        raw, to = self._seal(message), _address(self._tag, peer)
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._outbox.sendto(raw, socket.MSG_DONTWAIT, to)
                return
            except BlockingIOError:  # its lead has not read its queue yet (busy with its own transfer)
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.0005)

    def forward_manifest(self, version: str, doc: Any) -> None:
        """A relay: hand ``doc``, the manifest it read from the channel for ``version``, to its peers (once per
        attempt: a manifest read again is not sent again)."""
        if not self.roles.manifest_to:
            return
        seen = (version, doc.get("seq") if isinstance(doc, dict) else None)
        if seen == self._sent:
            return
        self._sent = seen
        self.forward(self.roles.manifest_to, {"kind": "manifest", "version": version, "doc": doc})

    def forward_outcomes(self, version: str, seq: int, record: Any) -> None:
        """A trainer relay: hand the record of every outcome of attempt ``seq`` (``None``: it has none; each peer
        then reads the channel itself) to its host's other trainer ranks."""
        self.forward(self.roles.trainers_to, {"kind": "outcomes", "version": version, "seq": seq, "doc": record})

    # -- hearing ------------------------------------------------------------------------------------------------
    def hear(self, kind: str, version: str, seq: int | None, timeout: float) -> dict:
        """The first message of ``kind`` for ``version`` (and attempt ``seq``, if given) within ``timeout``;
        :class:`RelayTimeout` after it. Forged ones are dropped; others are kept a while for a later ``hear`` (a
        peer's ready signal may come before its relay asks for it), older ones fall out."""
        inbox = self._inbox
        if inbox is None:
            raise RelayTimeout(f"sync rank {self.rank} hears no relay")

        def wanted(m: Any) -> bool:
            return m.get("kind") == kind and m.get("version") == version and (seq is None or m.get("seq") == seq)

        for message in self._early:
            if wanted(message):
                self._early.remove(message)
                return message
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RelayTimeout(f"no {kind} of {version!r} from the host's relay within {timeout:g} s")
            inbox.settimeout(left)
            try:
                raw = inbox.recv(MAX_DATAGRAM + 1)
            except TimeoutError:
                continue
            message = self._open(raw)
            if isinstance(message, dict):
                if wanted(message):
                    return message
                self._early.append(message)

    def _open(self, raw: bytes) -> Any:
        mac, payload = raw[:_MAC], raw[_MAC:]
        expected = hmac.digest(self._key, _DOMAIN + payload, "sha256").hex().encode()
        if len(mac) != _MAC or not hmac.compare_digest(mac, expected):
            log.warning("sync rank %d: a relay datagram that fails its check: dropped", self.rank)
            return None
        try:
            return json.loads(payload)
        except ValueError:
            return None

    def manifest(self, version: str, timeout: float) -> Any:
        """The manifest of ``version`` as the host's relay read it from the channel (``None``: too large to relay:
        read it there); :class:`RelayTimeout` after ``timeout`` seconds."""
        return self.hear("manifest", version, None, timeout)["doc"]

    def outcomes(self, version: str, seq: int, deadline: float, read: Callable[[float], Any], slice_: float) -> Any:
        """The first trainer rank's record of every outcome of attempt ``seq``, from the host's trainer relay, until
        ``deadline``; ``read(timeout)`` reads it from the channel, as this rank would without a relay: where the
        relay had none, and after each ``slice_`` of seconds without a word (a relay that failed sends nothing)."""
        while True:
            left = deadline - time.monotonic()
            try:
                doc = self.hear("outcomes", version, seq, max(0.001, min(slice_, left)))["doc"]
                return doc if doc is not None else read(max(0.001, deadline - time.monotonic()))
            except RelayTimeout:
                pass
            try:
                return read(LOOK_SECONDS)
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise


def channel_manifest(channel: VersionChannel, relay: HostRelay | None, version: str, timeout: float) -> Any:
    """The manifest of ``version`` as the version channel has it (its secret left out), waiting up to ``timeout``
    seconds: from the host's relay where this rank hears one (after a slice without a word from it, a look at the
    channel itself), else read from the channel and, where this rank relays, handed on."""
    if relay is not None and relay.secret != channel.secret:  # a relay of another writer's channel
        relay = None
    wait = timeout
    if relay is not None and relay.hears_manifests:
        try:
            doc = relay.manifest(version, timeout)
            if doc is not None:
                return doc
        except RelayTimeout:
            wait = LOOK_SECONDS
    doc = channel.wait([keys.channel_manifest(version)], wait)[0]
    if relay is not None:
        relay.forward_manifest(version, doc)
    return doc
