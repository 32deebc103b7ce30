"""The version channel: per-version signals between the ranks of a sync, without the MetaServer's round trips.

Planning, agreement and discovery go through the MetaServer (once per layout). What every version needs
afterwards is a handful of small signals: the trainer's manifest of version V, each trainer rank's "my weights of
V are ready" (CUDA IPC), each receiver's outcome of V (applied, or failed and why). Through the MetaServer each is
an HTTP round trip and a long-poll wake-up: milliseconds per version (measured: docs/performance.md). The channel
carries
them over a ``torch.distributed.TCPStore`` that the trainer's first rank hosts (a C++ key-value server, tens of
microseconds per operation). Its address travels in the manifest on the MetaServer; every key carries a random
secret, also only in the manifest, so a process that cannot read the (token-protected) MetaServer cannot forge
signals. Values are JSON, parsed and checked by the caller.

A channel fails fast when its host is gone (a closed writer, a dead process): the reader then falls back to the
MetaServer for the next manifest.
"""

from __future__ import annotations

import json
import secrets
from datetime import timedelta
from typing import Any, Sequence

import torch.distributed as dist


class ChannelError(RuntimeError):
    """The channel's host cannot be reached (gone, or never there)."""


class ChannelTimeout(TimeoutError):
    """What was awaited on the channel did not arrive within the deadline."""


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
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout))
        return cls(store, f"{host}:{store.port}", secrets.token_hex(16), hosting=True)

    @classmethod
    def connect(cls, address: str, secret: str, timeout: float = 10.0) -> VersionChannel:
        """Join the channel at ``address`` (``host:port``); raises :class:`ChannelError` if nobody is there."""
        host, _, port = address.rpartition(":")
        try:
            store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=max(0.1, timeout)))
        except (RuntimeError, ValueError) as e:
            raise ChannelError(f"version channel at {address}: {e}") from None
        return cls(store, address, secret, hosting=False)

    def clone(self, timeout: float = 10.0) -> VersionChannel:
        """Another connection to the same channel (for another thread)."""
        return VersionChannel.connect(self.address, self.secret, timeout)

    def _key(self, key: str) -> str:
        return f"{self.secret}/{key}"

    @property
    def store(self) -> dist.TCPStore:
        if self._store is None:
            raise ChannelError(f"version channel at {self.address}: closed")
        return self._store

    def put(self, key: str, value: Any) -> None:
        try:
            self.store.set(self._key(key), json.dumps(value).encode())
        except RuntimeError as e:
            raise ChannelError(f"version channel at {self.address}: {e}") from None

    def wait(self, keys: Sequence[str], timeout: float) -> list[Any]:
        """The values under ``keys``, waiting up to ``timeout`` seconds for all of them."""
        full = [self._key(k) for k in keys]
        try:
            self.store.wait(full, timedelta(seconds=max(0.001, timeout)))
            raw = self.store.multi_get(full)
        except dist.DistStoreError as e:  # the wait timed out
            missing = [k for k in keys if not self._check(k)]
            raise ChannelTimeout(
                f"{', '.join(missing[:4]) or ', '.join(keys[:4])} did not arrive on the version "
                f"channel within {timeout:g} s"
            ) from e
        except RuntimeError as e:  # DistNetworkError: the host is gone
            raise ChannelError(f"version channel at {self.address}: {e}") from None
        try:
            return [json.loads(v) for v in raw]
        except ValueError as e:
            raise ChannelError(f"version channel at {self.address}: malformed value: {e}") from None

    def get(self, key: str) -> Any | None:
        """The value under ``key`` now, or ``None`` if it is not there (no waiting)."""
        if not self._check(key):
            return None
        try:
            return json.loads(self.store.get(self._key(key)))
        except (RuntimeError, ValueError):
            return None

    def _check(self, key: str) -> bool:
        try:
            return bool(self.store.check([self._key(key)]))
        except RuntimeError:
            return False

    def delete(self, keys: Sequence[str]) -> None:
        for k in keys:
            self.store.delete_key(self._key(k))

    def close(self) -> None:
        """Drop this connection (a hosting channel stops serving once no reference to it is left)."""
        self._store = None
