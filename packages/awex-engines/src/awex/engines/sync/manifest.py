"""The manifest of one weight version's sync: what the trainer's first rank publishes and every rank checks."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, fields
from typing import Any

from awex.engines.sync.options import SyncOptions
from awex.meta.errors import AwexValueError
from awex.transport.net import split_ports


@dataclass(frozen=True)
class Attempt:
    """One attempt at a version: the writer's version channel, the version and the writer's count (a retry of a
    failed version is announced with a higher count; a restarted writer brings a channel of its own)."""

    channel: str | None
    version: str
    seq: int

    @property
    def name(self) -> str:
        """``<version>/<count>``: what the attempt's own records are keyed by."""
        return f"{self.version}/{self.seq}"

    def follows(self, last: Attempt | None) -> bool:
        """Whether this attempt is a new one after ``last`` (the one a rank took part in, if any)."""
        return last is None or (self.channel, self.version) != (last.channel, last.version) or self.seq > last.seq


@dataclass(frozen=True)
class SyncManifest:
    """What one weight version's sync involves. Published by the trainer at ``sync/<version>``."""

    version: str
    sources: tuple[str, ...]
    destinations: tuple[str, ...]
    host: str
    port: int
    # what the writer asks of the version: one record (awex.engines.sync.options), its defaults the writer's; the
    # transport: "p2p" (NCCL on CUDA, gloo on CPU), "ipc" (CUDA engines on one host), "shm" (CPU ranks on one host),
    # "rdma", or "auto" (every rank publishes its device and all choose the same: awex.meta.transport_choice)
    options: SyncOptions = SyncOptions()
    refresh_by_wave: bool = False  # the senders derive what they send wave by wave (FP8 on the fly): for "auto"
    channel: str | None = None  # the version channel ("host:port", awex.engines.sync.channel) and its key secret
    channel_secret: str | None = None
    seq: int = 0  # the writer's count of versions written (signals on the host board carry it)
    board: str | None = None  # the host board (awex.engines.sync.board) and the host it is on
    board_host: str | None = None
    epoch: int = 0  # the announcing writer's epoch (its fence on the MetaServer): a newer writer may take over

    def to_json(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["sources"] = list(self.sources)
        d["destinations"] = list(self.destinations)
        d["options"] = self.options.to_wire()
        for name in ("channel", "channel_secret", "board", "board_host"):
            if d[name] is None:
                del d[name]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SyncManifest:
        try:
            return cls(
                version=str(d["version"]),
                sources=tuple(d["sources"]),
                destinations=tuple(d["destinations"]),
                host=str(d["host"]),
                port=int(d["port"]),
                options=SyncOptions.from_wire(d["options"]),  # every writer says each: none to disagree with
                refresh_by_wave=_flag(d.get("refresh_by_wave", False)),
                channel=_channel_address(d.get("channel")),
                channel_secret=_channel_secret(d),
                seq=_count(d.get("seq", 0)),
                board=_optional_str(d.get("board")),
                board_host=_optional_str(d.get("board_host")),
                epoch=_count(d.get("epoch", 0)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise AwexValueError(f"malformed sync manifest: {e}") from None

    @property
    def attempt(self) -> Attempt:
        return Attempt(self.channel, self.version, self.seq)

    def renamed(self, version: str, seq: int) -> SyncManifest:
        """This manifest for another version of the same writer (fields are checked where a manifest is parsed,
        :meth:`from_json`, not here). Both sides of every steady version make one before any byte moves: its fields
        are copied as they are (``dataclasses.replace`` runs the constructor: 17-20 us a call on a 1x H200 host)."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__, version=version, seq=seq)
        return new

    def rendezvous(self) -> tuple:
        return (self.host, self.port, self.sources, self.destinations, self.options.transport)


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise AwexValueError(f"a flag must be true or false, not {value!r}")
    return value


def _channel_address(value: Any) -> str | None:
    """``host:port``, or ``host:port0,port1,...`` for a channel of several lanes (at most 64)."""
    if value is None:
        return None
    try:
        host, lanes = split_ports(value)
    except ValueError:
        raise AwexValueError(f"channel address {value!r} is not host:port[,port...]") from None
    return f"{host}:{','.join(str(p) for p in lanes)}"


def _channel_secret(d: dict) -> str | None:
    secret = d.get("channel_secret")
    if d.get("channel") is None:
        return None
    if not isinstance(secret, str) or not 16 <= len(secret) <= 128 or not secret.isalnum():
        raise AwexValueError("a channel needs its secret (16 to 128 letters and digits)")
    return secret


def _count(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 40:
        raise AwexValueError(f"{value!r} is not a version count")
    return value


def _optional_str(value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or len(value) > 1024):
        raise AwexValueError(f"{str(value)[:80]!r} is not a short string")
    return value


def group_secret(channel_secret: str | None) -> str:
    """What every member of a plan's p2p sync group proves it holds (``awex.transport.group_auth``): derived from
    the version channel's secret, which the channel itself never carries; ``""`` (no proof) without a channel."""
    if not channel_secret:
        return ""
    return hmac.new(channel_secret.encode(), b"awex-sync-group", hashlib.sha256).hexdigest()
