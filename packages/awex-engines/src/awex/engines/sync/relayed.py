"""Ready signals through host relays: a pull transport's senders say ready once a host, its receivers hear once a
host (``awex.engines.sync.relay``).

Over the version channel each trainer rank's ready signal was a key of its own and each receiving rank read its
senders' keys itself: at 1,024 ranks about 500 sets, 500 waited reads and 500 deletes a version on the channel's
host. With two or more trainer ranks on a host, each tells the lowest of them (its group's lead) over a local
datagram, and the lead puts one key for the host with every generation (:func:`awex.engines.sync.keys.host_ready`)
once all said ready; a trainer rank alone on its host puts its own key as before. With two or more receiving ranks on
a host, the lowest reads the keys of every sender any of them reads from (one waited read) and hands the generations
to the others; a receiving rank alone reads its senders' keys itself. Where a key is is a pure function of the plan
and the hosts (:meth:`~awex.engines.sync.relay.HostGroups.ready_holder`), so every rank looks where the signal went.

What would make this wrong, and what notices: a lead that passes a generation nobody gave (the keys and datagrams
carry MACs under the channel's secret; a generation that is not one fails the receiver's check); a lead that never
puts its host's key (gone, failed: the receivers wait until their deadline and the version fails, as for a sender
that never said ready); a peer whose datagram its lead refuses (it raises: its version fails, never a false success).
Every other signal goes through the channel as before (:class:`~awex.engines.sync.signals.ChannelSignals`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Sequence

from awex.engines.sync import keys
from awex.engines.sync.channel import VersionChannel
from awex.engines.sync.manifest import SyncManifest
from awex.engines.sync.relay import LOOK_SECONDS, HostGroups, HostRelay, RelayTimeout
from awex.engines.sync.signals import ChannelSignals, Signals
from awex.meta import Plan, RankDescriptor
from awex.meta.errors import AwexValueError
from awex.transport.base import TransferError


class RelayedSignals(ChannelSignals):
    """:class:`ChannelSignals` whose ready signals go through host relays (the other signals as the channel's)."""

    def __init__(self, inner: ChannelSignals, plan: Plan, groups: HostGroups, relay: HostRelay | None, rank: int):
        super().__init__(inner.channel, inner.client)
        self.plan, self.groups, self.relay, self.rank = plan, groups, relay, rank
        self.roles = relay.roles if relay is not None else None
        self._senders: list[int] | None = None  # a receiving lead: every sender its host's receivers read from
        self._heard: tuple[tuple, dict[int, int]] | None = None  # (kind, version, count): generations read or heard

    # -- senders ------------------------------------------------------------------------------------------------
    def ready(self, kind: str, manifest: SyncManifest, me: RankDescriptor, generation: int) -> None:
        roles = self.roles
        if roles is not None and roles.trainers_from is not None:  # one of a host's trainer ranks: tell the lead
            message = {"kind": "ready", "version": manifest.version, "seq": manifest.seq, "rank": me.rank}
            try:
                self.relay.tell(roles.trainers_from, dict(message, generation=generation))
            except OSError as e:
                raise TransferError(
                    f"sync rank {me.rank} could not tell its host's lead (sync rank {roles.trainers_from}) that "
                    f"version {manifest.version!r} is ready: {e}"
                ) from None
            return
        if roles is None or not roles.trainers_to:  # alone on its host: a key of its own
            super().ready(kind, manifest, me, generation)
            return
        # the lead: every trainer rank of its host said ready, then one key for all
        generations = {me.rank: generation}
        deadline = time.monotonic() + manifest.options.timeout
        while len(generations) <= len(roles.trainers_to):
            message = self.relay.hear("ready", manifest.version, manifest.seq, max(0.001, deadline - time.monotonic()))
            rank, gen = message.get("rank"), message.get("generation")
            if rank in roles.trainers_to and _generation(gen):
                generations[rank] = gen
        key = keys.host_ready(kind, manifest.version, manifest.seq, me.rank)
        self.channel.put(key, {str(r): g for r, g in sorted(generations.items())})

    # -- receivers ----------------------------------------------------------------------------------------------
    def wait_ready(self, kind: str, manifest: SyncManifest, senders: Sequence[RankDescriptor], timeout: float) -> list:
        attempt = (kind, manifest.version, manifest.seq)
        roles, relay = self.roles, self.relay
        if self._heard is not None and self._heard[0] == attempt:  # heard or read already for this attempt
            got = self._heard[1]
        elif roles is not None and roles.receivers_from is not None and relay.listening:  # its host's lead reads
            got = self._from_lead(attempt, senders, timeout)
        elif roles is not None and roles.receivers_to:  # the lead: its host's receivers' senders', read once, handed on
            got = self._read(attempt, self._group_senders(), timeout)
            message = {"kind": "ready", "version": manifest.version, "seq": manifest.seq, "transport": kind}
            relay.forward(roles.receivers_to, dict(message, doc={str(r): g for r, g in got.items()}))
            self._heard = (attempt, got)
        else:  # alone on its host (or not listening): its senders' own
            got = self._read(attempt, [s.rank for s in senders], timeout)
        return [got.get(s.rank) for s in senders]  # one missing fails the link's check of its generation

    def _from_lead(self, attempt: tuple, senders: Sequence[RankDescriptor], timeout: float) -> dict[int, int]:
        kind, version, seq = attempt
        try:
            message = self.relay.hear("ready", version, seq, timeout)
        except RelayTimeout:  # a slice without a word (its lead failed, or is slow): a look at the channel itself
            return self._read(attempt, [s.rank for s in senders], LOOK_SECONDS)
        doc = message.get("doc")
        if doc is None:  # too large to hand on: read them here
            return self._read(attempt, [s.rank for s in senders], 0.001 + timeout)
        if not isinstance(doc, dict):
            raise AwexValueError(f"ready signals of {version!r} from the host's lead: not a record ({doc!r:.80})")
        got = {int(r): g for r, g in doc.items() if str(r).isdigit() and _generation(g)}
        missing = [s.rank for s in senders if s.rank not in got]
        if missing:  # a sender its lead did not read for it (none, where both read the plan alike): read here
            got.update(self._read(attempt, missing, timeout))
        self._heard = (attempt, got)
        return got

    def _group_senders(self) -> list[int]:
        """Every rank this host's receiving ranks read from (a pull transport's receiver reads from the peers of its
        schedule's receive steps), once a plan."""
        if self._senders is None:
            group = (self.rank, *self.roles.receivers_to)
            self._senders = sorted({s.peer for r in group for s in self.plan.schedule(r) if s.op == "recv"})
        return self._senders

    def _read(self, attempt: tuple, senders: Sequence[int], timeout: float) -> dict[int, int]:
        """Senders' generations from the channel: one waited read of the keys that hold them (a host's, or a
        sender's own)."""
        kind, version, seq = attempt
        holders = sorted({self.groups.ready_holder(s) for s in senders})
        names = [
            keys.host_ready(kind, version, seq, h)
            if len(self.groups.trainers_with(h)) > 1
            else keys.ready(kind, version, seq, self.plan.ranks[h].instance, self.plan.ranks[h].local_rank)
            for h in holders
        ]
        out: dict[int, int] = {}
        for h, value in zip(holders, self.channel.wait(names, timeout)):
            if isinstance(value, dict):  # a host's: its lead and its other trainer ranks
                group = self.groups.trainers_with(h)
                out.update(
                    (int(r), g) for r, g in value.items() if str(r).isdigit() and int(r) in group and _generation(g)
                )
            elif _generation(value):
                out[h] = value
        return out


def _generation(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def with_relays(
    plan: Plan,
    rank: int,
    processes: Mapping[tuple[str, int], tuple],
    signals: Signals,
    channel: VersionChannel | None,
) -> tuple[HostGroups | None, HostRelay | None, Signals]:
    """A new plan's host groups, this rank's relays and its signals through them, where the plan's signals go over
    the version channel (on the host board every rank reads the same shared memory; through the MetaServer no
    relay would be heard): every rank of such a plan alike, since where a ready signal goes depends on it.
    ``processes``: each rank's ``(host, pid, start)`` as the device exchange found them."""
    if not isinstance(signals, ChannelSignals) or channel is None:
        return None, None, signals
    groups = HostGroups.of(plan, {who: where[0] for who, where in processes.items()})
    mine = groups.roles(rank)
    relay = HostRelay(mine, rank, channel.secret) if mine else None
    return groups, relay, RelayedSignals(signals, plan, groups, relay, rank) if groups.relays_ready else signals
