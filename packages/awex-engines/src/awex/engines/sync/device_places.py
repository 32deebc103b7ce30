"""Where a rank of a sync runs (:class:`DevicePlaces`, part of :class:`~awex.engines.sync.session.SyncSession`): its
physical device, the devices whose memory it can read over CUDA IPC, and the exchange of both with every rank of a
plan (:func:`awex.engines.sync.places.exchange`), which also finds where every rank can take per-version signals."""

from __future__ import annotations

from typing import Sequence

from awex.engines.sync import places
from awex.engines.sync.board import HostBoard
from awex.engines.sync.channel import VersionChannel
from awex.meta import Layout
from awex.meta.client import MetaClient


class DevicePlaces:
    """The device part of a rank's sync session (its fields are the session's)."""

    client: MetaClient
    instance: str
    local_rank: int
    device: object
    device_key: str | None
    device_reach: tuple[str, ...] | None
    board: HostBoard | None
    channel: VersionChannel | None
    _signals: str

    def physical_device(self) -> str | None:
        """This rank's physical device as ``host/GPU-uuid`` (CUDA), or ``device_key`` when set."""
        if self.device_key is None:
            self.device_key = places.physical_device(self.device)
        return self.device_key

    def reachable_devices(self) -> tuple[str, ...]:
        """The devices whose memory this rank can read over CUDA IPC (``device_reach`` when set)."""
        if self.device_reach is not None:
            return tuple(self.device_reach)
        return places.reachable_devices(self.device, self.physical_device())

    def _devices(
        self, attempt: str, names: Sequence[str], layouts: dict[str, Layout], deadline: float, in_place: bool = True
    ) -> places.Places:
        """Where every rank runs (:func:`awex.engines.sync.places.exchange`); also where every rank can take
        per-version signals."""
        mine = (self.physical_device() or "") if in_place else ""
        doc = places.describe(
            self.device,
            mine,
            self.reachable_devices() if mine else (),
            in_place,
            [kind for kind, have in (("board", self.board), ("channel", self.channel)) if have],
        )
        found = places.exchange(self.client, attempt, (self.instance, self.local_rank), doc, names, layouts, deadline)
        self._signals = found.signals
        return found
