"""Building relayed signals for tests of host relays (test_relay, test_relay_outcomes)."""

from __future__ import annotations

from awex.engines.sync.channel import VersionChannel
from awex.engines.sync.relayed import with_relays
from awex.engines.sync.signals import ChannelSignals


def relayed_signals(plan, processes: dict, channel, ranks, made: list) -> tuple:
    """The plan's host groups and each of ``ranks``' signals through its host's relays, on a channel connection of
    its own (as ranks in their processes); ``processes``: each rank's ``(host, pid, start)``. Relays go to ``made``."""
    groups, out = None, {}
    for r in ranks:
        conn = VersionChannel.connect(channel.address, channel.secret)
        groups, mine, signals = with_relays(plan, r, processes, ChannelSignals(conn), conn)
        made.extend([mine] if mine is not None else [])
        out[r] = signals
    return groups, out
