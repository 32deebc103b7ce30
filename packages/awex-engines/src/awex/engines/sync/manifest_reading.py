"""Where a rank reads each version's manifest (:class:`ManifestReading`, part of
:class:`~awex.engines.sync.session.SyncSession`): the host board where this rank is on the writer's host, else the
version channel (through its host's relay where it has one), else the MetaServer, which also has every manifest; a
steady writer's manifest, equal to the last one but for its version and count, is not parsed again; a manifest names
the board and channel a rank then joins; a trainer's refusal notice raises :class:`VersionRefusedError`."""

from __future__ import annotations

import logging
import time
from typing import Any

from awex.engines.errors import VersionRefusedError
from awex.engines.sync import keys
from awex.engines.sync.board import HostBoard, host_identity
from awex.engines.sync.channel import ChannelError, VersionChannel
from awex.engines.sync.manifest import Attempt, SyncManifest, _count
from awex.engines.sync.relay import HostRelay, channel_manifest
from awex.meta.client import MetaClient
from awex.meta.errors import AwexValueError

log = logging.getLogger("awex.engines")


class ManifestReading:
    """The manifest-reading part of a rank's sync session (its fields are the session's)."""

    client: MetaClient
    instance: str
    local_rank: int
    channel: VersionChannel | None
    board: HostBoard | None
    relay: HostRelay | None
    _parsed: tuple[dict, SyncManifest] | None
    _last_attempt: Attempt | None
    _link: Any

    def fetch_manifest(self, version: str, timeout: float) -> SyncManifest:
        """Version ``version``'s manifest: from the host board or the version channel once one is known (checking
        the MetaServer every second, in case another writer took over), else from the MetaServer. Once this rank
        took part in an attempt at ``version`` (it succeeded or failed), only a later attempt's manifest is taken
        (the writer announces a retry with a higher count)."""
        self._link = None  # a new version: nothing moved into this rank's views yet (touched)
        deadline = time.monotonic() + timeout
        asked = 0.0
        while True:
            manifest = self._fetch_manifest_once(version, deadline)
            if self._new_attempt(manifest):
                return manifest
            if time.monotonic() - asked >= 0.5:  # a restarted writer announces on a board and channel of its own
                asked = time.monotonic()
                key = keys.manifest(version)
                if key in self.client.keys(key):
                    other = self._parse(self.client.get(key, timeout=max(0.1, min(1.0, deadline - asked))))
                    if self._new_attempt(other):
                        return self._adopt(other)
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"no new attempt at version {version!r} within {timeout:g} s (this rank took "
                    f"part in attempt {self._last_attempt.seq} already)"
                )
            time.sleep(0.002)

    def _new_attempt(self, manifest: SyncManifest) -> bool:
        return manifest.attempt.follows(self._last_attempt)

    def _fetch_manifest_once(self, version: str, deadline: float) -> SyncManifest:
        while True:
            left = max(0.001, deadline - time.monotonic())
            try:
                if self.board is not None:
                    return self._adopt(self._parse(self.board.manifest(version, min(1.0, left))))
                if self.channel is not None:  # its secret is never on the channel: it checked the value with it
                    doc = channel_manifest(self.channel, self.relay, version, min(1.0, left))
                    if isinstance(doc, dict):
                        doc = dict(doc, channel_secret=self.channel.secret)
                    return self._adopt(self._parse(doc))
            except ChannelError as e:  # its host is gone: the MetaServer has the manifest too
                log.info("%s:%d: version channel gone (%s); asking the MetaServer", self.instance, self.local_rank, e)
                self.channel = None
                continue
            except TimeoutError:  # BoardTimeout, ChannelTimeout: a writer with another channel, or none yet?
                key = keys.manifest(version)
                if key in self.client.keys(key):
                    return self._adopt(self._parse(self.client.get(key, timeout=1.0)))
                if time.monotonic() >= deadline:
                    raise
                continue
            return self._adopt(self._parse(self.client.get(keys.manifest(version), timeout=left)))

    def _parse(self, doc: Any) -> SyncManifest:
        """``SyncManifest.from_json``, except that a manifest differing from the last one parsed only in its version
        and count (a steady writer's) reuses that one's checked fields. A trainer's refusal notice raises."""
        if isinstance(doc, dict) and isinstance(doc.get("refused"), str):
            cause = str(doc.get("cause"))[:500]
            raise VersionRefusedError(f"the trainer refused version {doc['refused']!r} before any byte moved: {cause}")
        if isinstance(doc, dict):
            same = dict(doc, version=None, seq=None)
            last = self._parsed
            if last is not None and "version" in doc and same == last[0]:
                try:
                    return last[1].renamed(str(doc["version"]), _count(doc.get("seq", 0)))
                except ValueError as e:
                    raise AwexValueError(f"malformed sync manifest: {e}") from None
            manifest = SyncManifest.from_json(doc)
            self._parsed = (same, manifest)
            return manifest
        return SyncManifest.from_json(doc)

    def _adopt(self, manifest: SyncManifest) -> SyncManifest:
        """Join the manifest's version channel and host board if this rank does not use them yet."""
        if manifest.channel and (
            self.channel is None
            or self.channel.address != manifest.channel
            or self.channel.secret != manifest.channel_secret
        ):
            try:
                self.channel = VersionChannel.connect(
                    manifest.channel, manifest.channel_secret, home=f"{self.instance}:{self.local_rank}"
                )
            except ChannelError as e:
                log.warning(
                    "%s:%d: %s; per-version signals go through the MetaServer", self.instance, self.local_rank, e
                )
                self.channel = None
        if (  # this host's identity asked only for a board not joined yet (it reads /proc: not every version)
            manifest.board
            and (self.board is None or self.board.path != manifest.board)
            and manifest.board_host == host_identity()
        ):
            try:
                self.board = HostBoard.attach(manifest.board)
            except (OSError, ValueError) as e:
                log.info("%s:%d: cannot use the host board %s (%s)", self.instance, self.local_rank, manifest.board, e)
                self.board = None
        return manifest
