"""The version channel: per-version signals between the ranks of a sync, without the MetaServer's round trips.

Planning, agreement and discovery go through the MetaServer (once per layout). What every version needs
afterwards is a handful of small signals: the trainer's manifest of version V, each trainer rank's "my weights of
V are ready" (CUDA IPC), each receiver's outcome of V (applied, or failed and why). Through the MetaServer each is
an HTTP round trip and a long-poll wake-up: milliseconds per version (measured: docs/performance.md). The channel
carries
them over a ``torch.distributed.TCPStore`` that the trainer's first rank hosts (a C++ key-value server, tens of
microseconds per operation), listening on the address the writer was given and no other.

The store itself has no authentication: anyone who reaches its port can read and write any key. So every value
carries a MAC (HMAC-SHA256 over the key and the JSON value) keyed by a random secret that travels only in the
manifest on the token-protected MetaServer and the host board, never in a key name and never on the channel in
clear. A value that fails its check is dropped and logged, as if it were not there: a process without the secret
can delay a version (which then fails at its deadline), never turn a failure into success. Values are JSON, parsed
and checked by the caller.

A channel fails fast when its host is gone (a closed writer, a dead process): the reader then falls back to the
MetaServer for the next manifest.

*Lanes*: a channel of many ranks is several stores in the host's process (``host:port0,port1,...``), each with an
event loop of its own, so that their work runs on several cores instead of one. A key lives on one lane, chosen by
a hash of its name, except those many ranks read (:data:`awex.engines.sync.keys.CHANNEL_EVERYWHERE`: a version's
manifest, the trainers' record of its outcomes), which are put on every lane, each rank reading its own lane's
copy (its *home*, a hash of the name it joined with; the host's own connection's is the first lane), and those the
first trainer rank alone reads all at once (:data:`~awex.engines.sync.keys.CHANNEL_FIRST_LANE`), which are on the
first lane. A rank connects to a lane when it first uses it.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import time
import zlib
from datetime import timedelta
from typing import Any, Sequence

import torch.distributed as dist

from awex.engines.sync.keys import CHANNEL_EVERYWHERE, CHANNEL_FIRST_LANE
from awex.meta.errors import AwexError, AwexValueError
from awex.transport.group import bound_store
from awex.transport.net import split_ports

log = logging.getLogger("awex.engines")
MAC_BYTES = 64  # hex digits of an HMAC-SHA256, ahead of the JSON value
RANKS_PER_LANE = 32  # a lane of the version channel per this many trainer ranks ...
MAX_LANES = 4  # ... up to this many (at 1,024 ranks eight lanes cost more CPU than four and served no faster)


def lanes_for(trainer_ranks: int) -> int:
    """How many lanes the version channel of a trainer of ``trainer_ranks`` ranks has (one up to 32 ranks, four
    from 97): about as many ranks again receive, and each rank reads the channel once or twice a version."""
    return max(1, min(MAX_LANES, -(-trainer_ranks // RANKS_PER_LANE)))


FD_MARGIN = 256  # descriptors left for everything else the hosting process opens meanwhile


def open_files_for(connections: int, limits=None) -> int:
    """Make room for ``connections`` more open sockets in this process (the ranks joining the channel it hosts: up to
    one a rank and lane): raise the soft open-file limit toward the hard one where it is short, and say so in the log
    where even the hard limit is (ranks that cannot join then send their signals through the MetaServer, slower).
    ``limits``: ``(getrlimit, setrlimit)`` (tests); returns the soft limit in force after."""
    try:
        import resource

        get, set_ = limits or (resource.getrlimit, resource.setrlimit)
        which = resource.RLIMIT_NOFILE
    except ImportError:  # not a POSIX system: nothing to check
        return -1
    soft, hard = get(which)
    try:
        held = len(os.listdir("/proc/self/fd"))
    except OSError:
        held = 0
    need = held + connections + FD_MARGIN
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        if target > soft:
            try:
                set_(which, (target, hard))
                log.info(
                    "version channel: open-file limit raised %d -> %d for up to %d connections",
                    soft,
                    target,
                    connections,
                )
                soft = target
            except (ValueError, OSError) as e:
                log.warning("version channel: could not raise the open-file limit from %d: %s", soft, e)
        if soft < need:
            log.warning(
                "version channel: up to %d ranks' connections expected, but this process may open %d files (hard "
                "limit %d, %d open): ranks beyond it cannot join and send their signals through the MetaServer "
                "(raise `ulimit -n` where the trainer's first rank runs)",
                connections,
                soft,
                hard,
                held,
            )
    return soft


class ChannelError(AwexError, RuntimeError):
    """The channel's host cannot be reached (gone, or never there)."""


class ChannelTimeout(AwexError, TimeoutError):
    """What was awaited on the channel did not arrive within the deadline."""


class Forged(AwexValueError):
    """A value on the channel that fails its check (written without the secret, or altered)."""


class VersionChannel:
    """One connection to a sync's version channel (``host()`` starts one, ``connect()`` joins one)."""

    def __init__(self, stores: list, address: str, secret: str, hosting: bool, home: str = "", timeout: float = 30.0):
        self._stores = stores  # per lane: a store, or None until this connection first uses the lane
        self.address = address
        self._host, self._ports = _parse(address)
        self.secret = secret
        self._key = secret.encode()  # the MAC's key, made once (every value read or put is checked with it)
        self.hosting = hosting
        self.lanes = len(stores)
        self._home = zlib.crc32(home.encode()) % self.lanes  # the lane whose copy of an everywhere key it reads
        self._name = home
        self._timeout = timeout

    @classmethod
    def host(cls, host: str = "127.0.0.1", timeout: float = 300.0, lanes: int = 1, ranks: int = 0) -> VersionChannel:
        """Start a channel of ``lanes`` stores in this process, on free ports of ``host``, with room for ``ranks``
        ranks joining each lane (:func:`open_files_for`)."""
        if lanes < 1:
            raise AwexValueError(f"a version channel has at least one lane, not {lanes}")
        if ranks:
            open_files_for(ranks * lanes)
        stores = [bound_store(host, 0, timedelta(seconds=timeout)) for _ in range(lanes)]
        address = f"{host}:{','.join(str(store.port) for store in stores)}"
        return cls(stores, address, secret=secrets.token_hex(32), hosting=True)

    @classmethod
    def connect(cls, address: str, secret: str, timeout: float = 30.0, home: str = "") -> VersionChannel:
        """Join the channel at ``address`` (``host:port`` or ``host:port0,port1,...``) as ``home`` (a name for this
        rank: which lane's copy of an everywhere key it reads); raises :class:`ChannelError` if nobody is at its
        home lane within ``timeout`` (a rank that cannot join sends every signal of its plan, and every rank of it,
        through the MetaServer: the wait allows for a thousand ranks joining at once)."""
        channel = cls([None] * len(_parse(address)[1]), address, secret, hosting=False, home=home, timeout=timeout)
        channel._lane(channel._home)  # its home now: a host that is gone fails here
        return channel

    def clone(self, timeout: float = 10.0) -> VersionChannel:
        """Another connection to the same channel (for another thread)."""
        return VersionChannel.connect(self.address, self.secret, timeout, home=self._name)

    def _lane(self, lane: int) -> dist.TCPStore:
        if self._stores is None:
            raise ChannelError(f"version channel at {self.address}: closed")
        store = self._stores[lane]
        if store is None:
            try:
                store = dist.TCPStore(
                    self._host, self._ports[lane], is_master=False, timeout=timedelta(seconds=max(0.1, self._timeout))
                )
            except (RuntimeError, ValueError) as e:
                raise ChannelError(f"version channel at {self.address}: {e}") from None
            self._stores[lane] = store
        return store

    def _lane_of(self, key: str) -> int:
        if self.lanes == 1:
            return 0
        if key.startswith(CHANNEL_EVERYWHERE):
            return self._home
        if key.startswith(CHANNEL_FIRST_LANE):
            return 0
        return zlib.crc32(key.encode()) % self.lanes

    def _store_of(self, key: str) -> dist.TCPStore:
        return self._lane(self._lane_of(key))

    def _stores_holding(self, key: str) -> list[dist.TCPStore]:
        """Every lane's store that keeps ``key``: all of them for an everywhere key, else its one lane's."""
        if self.lanes > 1 and key.startswith(CHANNEL_EVERYWHERE):
            return [self._lane(lane) for lane in range(self.lanes)]
        return [self._store_of(key)]

    def _mac(self, key: str, payload: bytes) -> bytes:
        return hmac.digest(self._key, b"%s\0%s" % (key.encode(), payload), "sha256").hex().encode()  # one C call

    def _seal(self, key: str, value: Any) -> bytes:
        payload = json.dumps(value).encode()
        return self._mac(key, payload) + payload

    def _open(self, key: str, raw: bytes) -> Any:
        """The value of ``raw`` under ``key``; :class:`Forged` where its MAC does not match, ``ChannelError`` where
        it is not JSON (a writer of ours always writes JSON)."""
        payload = self._checked(key, raw)
        if payload is None:
            raise self._forged(key)
        return self._parse(payload)

    def _checked(self, key: str, raw: bytes) -> bytes | None:
        """The JSON payload of ``raw`` under ``key`` where its MAC matches, else ``None``."""
        mac, payload = raw[:MAC_BYTES], raw[MAC_BYTES:]
        return payload if len(mac) == MAC_BYTES and hmac.compare_digest(mac, self._mac(key, payload)) else None

    def _open_all(self, keys: Sequence[str], raws: Sequence[bytes], into: dict[str, Any]) -> bool:
        """:meth:`_open` for many values at once (into ``into``): each one's MAC checked, their JSON parsed in one
        call, as one list (a waited read of many keys, such as the first trainer rank's of every host's, costs one
        parse instead of one a key). Where the values together are not a list of one a key, each is parsed alone (and
        one that is not JSON fails as in :meth:`_open`); only a holder of the secret writes a value that passes its
        check, and ours write JSON. Whether any failed its check (dropped, logged)."""
        checked: list[tuple[str, bytes]] = []
        forged = False
        for key, raw in zip(keys, raws):
            payload = self._checked(key, raw)
            if payload is not None:
                checked.append((key, payload))
            else:
                self._dropped(self._forged(key))
                forged = True
        try:
            values = json.loads(b"[" + b",".join(p for _, p in checked) + b"]") if len(checked) > 1 else None
        except ValueError:
            values = None
        if values is None or len(values) != len(checked):  # one value, or one that is not JSON: each on its own
            values = [self._parse(payload) for _, payload in checked]
        into.update(zip((k for k, _ in checked), values))
        return forged

    def _forged(self, key: str) -> Forged:
        return Forged(f"a value under {key!r} on the version channel at {self.address} fails its check")

    def _parse(self, payload: bytes) -> Any:
        try:
            return json.loads(payload)
        except ValueError as e:
            raise ChannelError(f"version channel at {self.address}: malformed value: {e}") from None

    def _dropped(self, error: Forged) -> None:
        log.warning("%s: dropped", error)

    def put(self, key: str, value: Any) -> None:
        """Put ``value`` under ``key`` (on every lane where many ranks read it)."""
        sealed = self._seal(key, value)
        try:
            for store in self._stores_holding(key):
                store.set(key, sealed)
        except RuntimeError as e:
            raise ChannelError(f"version channel at {self.address}: {e}") from None

    def wait(self, keys: Sequence[str], timeout: float) -> list[Any]:
        """The values under ``keys``, waiting up to ``timeout`` seconds for all of them. A value that fails its
        check is dropped (logged) and waited for again: the real one overwrites it.

        One round trip to the channel's host: the store's ``multi_get`` itself waits until every key is there
        (within the connection's timeout, set to what is left of ``timeout`` first, locally); a ``wait`` before it
        was a second round trip on the version's critical path. Keys on several lanes: one such wait a lane."""
        deadline = time.monotonic() + timeout
        if not keys:
            return []
        if self.lanes == 1:
            return self._wait_lane(keys, deadline, timeout)
        by_lane: dict[int, list[str]] = {}
        for k in keys:
            by_lane.setdefault(self._lane_of(k), []).append(k)
        found = {}
        for lane, lane_keys in by_lane.items():
            found.update(zip(lane_keys, self._wait_lane(lane_keys, deadline, timeout, lane)))
        return [found[k] for k in keys]

    def _wait_lane(self, keys: Sequence[str], deadline: float, timeout: float, lane: int = 0) -> list[Any]:
        """:meth:`wait` for keys of one lane (``lane``: theirs)."""
        found: dict[str, Any] = {}
        store = self._lane(lane)
        while True:
            waiting = [k for k in keys if k not in found]
            before = store.timeout  # the connection's own, for its other operations
            try:
                store.set_timeout(timedelta(seconds=max(0.001, deadline - time.monotonic())))
                raw = store.multi_get(waiting)
            except dist.DistStoreError as e:  # the wait timed out
                missing = [k for k in waiting if not self._check(k)]
                raise ChannelTimeout(
                    f"{', '.join(missing[:4]) or ', '.join(waiting[:4])} did not arrive on the version "
                    f"channel within {timeout:g} s"
                ) from e
            except RuntimeError as e:  # DistNetworkError: the host is gone
                raise ChannelError(f"version channel at {self.address}: {e}") from None
            finally:
                store.set_timeout(before)
            forged = self._open_all(waiting, raw, found)
            if not forged:
                return [found[k] for k in keys]
            if time.monotonic() >= deadline:
                raise ChannelTimeout(
                    f"{', '.join(k for k in keys if k not in found)} arrived on the version channel only as values "
                    f"that fail their check within {timeout:g} s"
                )
            time.sleep(0.005)  # the real values overwrite the forged ones

    def get(self, key: str) -> Any | None:
        """The value under ``key`` now, or ``None`` if it is not there or fails its check (no waiting)."""
        if not self._check(key):
            return None
        try:
            return self._open(key, self._store_of(key).get(key))
        except Forged as e:
            self._dropped(e)
            return None
        except (RuntimeError, ValueError):
            return None

    def _check(self, key: str) -> bool:
        try:
            return bool(self._store_of(key).check([key]))
        except RuntimeError:
            return False

    def holds(self, key: str) -> bool:
        """Whether ``key`` is on the channel now (on every lane, where it is kept on every lane)."""
        return all(store.check([key]) for store in self._stores_holding(key))

    def num_keys(self) -> int:
        """Keys on the channel, every lane's counted (a store counts one key of its own besides)."""
        return sum(self._lane(lane).num_keys() for lane in range(self.lanes))

    def delete(self, keys: Sequence[str]) -> None:
        for k in keys:
            for store in self._stores_holding(k):
                store.delete_key(k)

    def close(self) -> None:
        """Drop this connection (a hosting channel stops serving once no reference to it is left)."""
        self._stores = None


def _parse(address: str) -> tuple[str, list[int]]:
    """``host:port`` or ``host:port0,port1,...`` -> the host and each lane's port."""
    try:
        return split_ports(address)
    except ValueError:
        raise ChannelError(f"version channel at {address!r}: not host:port[,port...]") from None
