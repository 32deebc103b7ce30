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
"""

from __future__ import annotations

import hmac
import json
import logging
import secrets
import time
from datetime import timedelta
from typing import Any, Sequence

import torch.distributed as dist

from awex.meta.errors import AwexError, AwexValueError
from awex.transport.group import bound_store

log = logging.getLogger("awex.engines")
MAC_BYTES = 64  # hex digits of an HMAC-SHA256, ahead of the JSON value


class ChannelError(AwexError, RuntimeError):
    """The channel's host cannot be reached (gone, or never there)."""


class ChannelTimeout(AwexError, TimeoutError):
    """What was awaited on the channel did not arrive within the deadline."""


class Forged(AwexValueError):
    """A value on the channel that fails its check (written without the secret, or altered)."""


class VersionChannel:
    """One connection to a sync's version channel (``host()`` starts one, ``connect()`` joins one)."""

    def __init__(self, store: dist.TCPStore, address: str, secret: str, hosting: bool):
        self._store = store
        self.address = address
        self.secret = secret
        self.hosting = hosting

    @classmethod
    def host(cls, host: str = "127.0.0.1", timeout: float = 300.0) -> VersionChannel:
        """Start a channel in this process, on a free port of ``host``."""
        store = bound_store(host, 0, timedelta(seconds=timeout))
        return cls(store, f"{host}:{store.port}", secrets.token_hex(32), hosting=True)

    @classmethod
    def connect(cls, address: str, secret: str, timeout: float = 30.0) -> VersionChannel:
        """Join the channel at ``address`` (``host:port``); raises :class:`ChannelError` if nobody is there within
        ``timeout`` (a rank that cannot join sends every signal of its plan, and every rank of it, through the
        MetaServer: the wait allows for a thousand ranks joining at once)."""
        host, _, port = address.rpartition(":")
        try:
            store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=max(0.1, timeout)))
        except (RuntimeError, ValueError) as e:
            raise ChannelError(f"version channel at {address}: {e}") from None
        return cls(store, address, secret, hosting=False)

    def clone(self, timeout: float = 10.0) -> VersionChannel:
        """Another connection to the same channel (for another thread)."""
        return VersionChannel.connect(self.address, self.secret, timeout)

    def _mac(self, key: str, payload: bytes) -> bytes:
        return hmac.digest(self.secret.encode(), key.encode() + b"\0" + payload, "sha256").hex().encode()  # one C call

    def _seal(self, key: str, value: Any) -> bytes:
        payload = json.dumps(value).encode()
        return self._mac(key, payload) + payload

    def _open(self, key: str, raw: bytes) -> Any:
        """The value of ``raw`` under ``key``; :class:`Forged` where its MAC does not match, ``ChannelError`` where
        it is not JSON (a writer of ours always writes JSON)."""
        mac, payload = raw[:MAC_BYTES], raw[MAC_BYTES:]
        if len(mac) != MAC_BYTES or not hmac.compare_digest(mac, self._mac(key, payload)):
            raise Forged(f"a value under {key!r} on the version channel at {self.address} fails its check")
        try:
            return json.loads(payload)
        except ValueError as e:
            raise ChannelError(f"version channel at {self.address}: malformed value: {e}") from None

    def _dropped(self, error: Forged) -> None:
        log.warning("%s: dropped", error)

    @property
    def store(self) -> dist.TCPStore:
        if self._store is None:
            raise ChannelError(f"version channel at {self.address}: closed")
        return self._store

    def put(self, key: str, value: Any) -> None:
        try:
            self.store.set(key, self._seal(key, value))
        except RuntimeError as e:
            raise ChannelError(f"version channel at {self.address}: {e}") from None

    def wait(self, keys: Sequence[str], timeout: float) -> list[Any]:
        """The values under ``keys``, waiting up to ``timeout`` seconds for all of them. A value that fails its
        check is dropped (logged) and waited for again: the real one overwrites it.

        One round trip to the channel's host: the store's ``multi_get`` itself waits until every key is there
        (within the connection's timeout, set to what is left of ``timeout`` first, locally); a ``wait`` before it
        was a second round trip on the version's critical path."""
        deadline = time.monotonic() + timeout
        found: dict[str, Any] = {}
        while True:
            waiting = [k for k in keys if k not in found]
            store = self.store
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
            forged = False
            for k, v in zip(waiting, raw):
                try:
                    found[k] = self._open(k, v)
                except Forged as e:
                    self._dropped(e)
                    forged = True
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
            return self._open(key, self.store.get(key))
        except Forged as e:
            self._dropped(e)
            return None
        except (RuntimeError, ValueError):
            return None

    def _check(self, key: str) -> bool:
        try:
            return bool(self.store.check([key]))
        except RuntimeError:
            return False

    def delete(self, keys: Sequence[str]) -> None:
        for k in keys:
            self.store.delete_key(k)

    def close(self) -> None:
        """Drop this connection (a hosting channel stops serving once no reference to it is left)."""
        self._store = None
