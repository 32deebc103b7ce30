"""Host relays: what every rank of a version reads alike reaches each host once.

Over the version channel (``awex.engines.sync.channel``) every rank reads each version's manifest, and every trainer
rank the first one's record of every outcome: one waited read each, served one after another by the event loop of
the store the first trainer rank hosts (at 1,024 ranks most of a steady version's serial work: docs/performance.md).
Where several ranks of a plan run on one host, the lowest of them (the host's relay) reads them from the channel
and hands them to the others over local datagrams (Linux's abstract socket namespace, shared by the processes of
one network namespace, as ``host_identity`` counts hosts): a blocking receive that wakes at once, no polling and
no file to remove.

Who relays to whom is a pure function of the plan and of where its ranks run (:func:`roles`): every rank computes
the same, once a plan. A datagram carries a MAC keyed by the channel's secret (as the channel's values do): a
process without it can delay a version, never change what a rank reads. Nothing depends on a relay: a rank whose
relay sends nothing (gone, its datagram refused, a manifest too large) reads the channel or the MetaServer itself
once its slice of waiting ends, as it would without one.
"""

from __future__ import annotations

import hmac
import json
import logging
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from awex.engines.sync import keys
from awex.engines.sync.channel import VersionChannel
from awex.meta import Plan, Role
from awex.meta.errors import AwexError

log = logging.getLogger("awex.engines")

MAX_DATAGRAM = 60 << 10  # larger documents are not relayed: the peer reads them itself
_MAC = 64  # hex digits of an HMAC-SHA256, ahead of the JSON payload
_DOMAIN = b"awex-relay\0"  # a datagram's MAC never matches a channel value's (those cover a key name)


class RelayTimeout(AwexError, TimeoutError):
    """Nothing for the version asked came from the relay within the slice."""


@dataclass(frozen=True)
class Roles:
    """One rank's part in its host's relays: whom it hears the manifest and the record of every outcome from (a
    sync rank, or ``None``), and whom it hands them to."""

    manifest_from: int | None = None
    manifest_to: tuple[int, ...] = ()
    outcomes_from: int | None = None
    outcomes_to: tuple[int, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.manifest_to or self.outcomes_to) or (self.manifest_from, self.outcomes_from) != (None, None)


def roles(plan: Plan, hosts: Mapping[tuple[str, int], str], rank: int) -> Roles:
    """Sync rank ``rank``'s relay roles in ``plan``, where ``hosts`` says each rank's host (``(instance, local
    rank)`` -> host; a rank without one relays nothing and hears nothing). On each host of two or more ranks the
    lowest relays the manifest to the others, except on the host of the first trainer rank (which posts it there
    on its host board); the lowest trainer rank relays the record of every outcome to the host's other trainer
    ranks (the first trainer rank: the record it made)."""
    here = hosts.get((plan.ranks[rank].instance, plan.ranks[rank].local_rank))
    if not here:
        return Roles()
    host_of = {r.rank: hosts.get((r.instance, r.local_rank)) for r in plan.ranks}
    local = sorted(r for r, h in host_of.items() if h == here)
    trainers = [r for r in local if plan.ranks[r].role == Role.TRAINER]
    announcer = plan.ranks_of(Role.TRAINER)[0].rank
    manifest_from, manifest_to = None, ()
    if announcer not in local and len(local) > 1:
        if rank == local[0]:
            manifest_to = tuple(local[1:])
        else:
            manifest_from = local[0]
    outcomes_from, outcomes_to = None, ()
    if rank in trainers and len(trainers) > 1:
        if rank == trainers[0]:
            outcomes_to = tuple(trainers[1:])
        else:
            outcomes_from = trainers[0]
    return Roles(manifest_from, manifest_to, outcomes_from, outcomes_to)


def address(secret: str, rank: int) -> bytes:
    """Sync rank ``rank``'s datagram address for the channel of ``secret`` (abstract: a leading NUL byte)."""
    tag = hmac.digest(secret.encode(), b"awex-relay-address", "sha256")[:8].hex()
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
        if roles.manifest_from is not None or roles.outcomes_from is not None:
            inbox = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            try:
                inbox.bind(address(secret, rank))
            except OSError as e:  # taken (by another process): this rank reads for itself
                inbox.close()
                log.info("sync rank %d: no relay datagrams (%s); it reads the version channel itself", rank, e)
            else:
                self._inbox = inbox
        if roles.manifest_to or roles.outcomes_to:
            self._outbox = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @property
    def hears_manifests(self) -> bool:
        return self._inbox is not None and self.roles.manifest_from is not None

    @property
    def hears_outcomes(self) -> bool:
        return self._inbox is not None and self.roles.outcomes_from is not None

    def close(self) -> None:
        for s in (self._inbox, self._outbox):
            if s is not None:
                s.close()
        self._inbox = self._outbox = None

    # -- sending ------------------------------------------------------------------------------------------------
    def _seal(self, message: dict) -> bytes:
        payload = json.dumps(message, separators=(",", ":")).encode()
        return hmac.digest(self._key, _DOMAIN + payload, "sha256").hex().encode() + payload

    def _send(self, peers: tuple[int, ...], message: dict) -> None:
        if self._outbox is None or not peers:
            return
        raw = self._seal(message)
        if len(raw) > MAX_DATAGRAM:
            raw = self._seal(dict(message, doc=None))  # too large: each peer reads it itself
        for peer in peers:
            try:
                self._outbox.sendto(raw, socket.MSG_DONTWAIT, address(self.secret, peer))
            except OSError as e:  # not listening, or its queue is full: it reads for itself after its slice
                if peer not in self._refused:
                    self._refused.add(peer)
                    log.info("sync rank %d: relay to sync rank %d refused (%s)", self.rank, peer, e)

    def forward_manifest(self, version: str, doc: Any) -> None:
        """A relay: hand ``doc``, the manifest it read from the channel for ``version``, to its peers (once per
        attempt: a manifest read again is not sent again)."""
        if not self.roles.manifest_to:
            return
        seen = (version, doc.get("seq") if isinstance(doc, dict) else None)
        if seen == self._sent:
            return
        self._sent = seen
        self._send(self.roles.manifest_to, {"kind": "manifest", "version": version, "doc": doc})

    def forward_outcomes(self, version: str, seq: int, record: Any) -> None:
        """A trainer relay: hand the record of every outcome of attempt ``seq`` (``None``: it has none; each peer
        then reads the channel itself) to its host's other trainer ranks."""
        self._send(self.roles.outcomes_to, {"kind": "outcomes", "version": version, "seq": seq, "doc": record})

    # -- hearing ------------------------------------------------------------------------------------------------
    def _hear(self, kind: str, version: str, seq: int | None, timeout: float) -> dict:
        """The first message of ``kind`` for ``version`` (and attempt ``seq``, if given) within ``timeout``;
        others (older versions', forged ones) are dropped."""
        inbox = self._inbox
        if inbox is None:
            raise RelayTimeout(f"sync rank {self.rank} hears no relay")
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
            if (
                isinstance(message, dict)
                and message.get("kind") == kind
                and message.get("version") == version
                and (seq is None or message.get("seq") == seq)
            ):
                return message

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
        return self._hear("manifest", version, None, timeout)["doc"]

    def outcomes(self, version: str, seq: int, deadline: float, read: Callable[[float], Any], slice_: float) -> Any:
        """The first trainer rank's record of every outcome of attempt ``seq``, from the host's trainer relay, until
        ``deadline``; ``read(timeout)`` reads it from the channel, as this rank would without a relay: where the
        relay had none, and after each ``slice_`` of seconds without a word (a relay that failed sends nothing)."""
        while True:
            left = deadline - time.monotonic()
            try:
                doc = self._hear("outcomes", version, seq, max(0.001, min(slice_, left)))["doc"]
                return doc if doc is not None else read(max(0.001, deadline - time.monotonic()))
            except RelayTimeout:
                pass
            try:
                return read(0.001 if time.monotonic() < deadline else 0.01)
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
            wait = 0.001
    doc = channel.wait([keys.channel_manifest(version)], wait)[0]
    if relay is not None:
        relay.forward_manifest(version, doc)
    return doc
