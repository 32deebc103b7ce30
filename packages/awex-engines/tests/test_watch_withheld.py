"""Point-to-point receivers wait on the wire, not for ready signals: while they wait (about once a second) their link
asks whether a sender they receive from withheld the version (``SyncPeerLink.watch``; ``Signals.withheld`` on the
host board, the version channel, through host relays, the MetaServer) and fails the version naming it, instead of
waiting for bytes that never come until the deadline. A rank that is not one of its senders changes nothing."""

from __future__ import annotations

import pytest
from test_relay import HOSTS, MANIFEST, PLAN

from awex.engines.sync.board import HostBoard
from awex.engines.sync.channel import VersionChannel
from awex.engines.sync.peer_link import SyncPeerLink
from awex.engines.sync.relayed import with_relays
from awex.engines.sync.signals import BoardSignals, ChannelSignals, MetaSignals
from awex.meta.client import MetaClient
from awex.meta.server import start_embedded
from awex.transport.base import TransferError

RECEIVER = 7  # vllm-1's second rank (alone on its host)


def _senders(rank: int) -> list[int]:
    steps = PLAN.schedule(rank)
    return sorted(({s.peer for s in steps if s.op == "recv"} | {s.bucket.src for s in steps}) - {rank})


@pytest.fixture
def media(tmp_path):
    """Each medium's signals for every rank of the plan (a connection of their own where it has them)."""
    server = start_embedded()
    board = HostBoard.create(str(tmp_path))
    channel = VersionChannel.host()
    conn = VersionChannel.connect(channel.address, channel.secret)  # one for every rank: one thread asks
    relays = []
    processes = {who: (host, 1, None) for who, host in HOSTS.items()}

    def relayed(r):
        _, relay, signals = with_relays(PLAN, r, processes, ChannelSignals(conn), conn)
        relays.extend([relay] if relay is not None else [])
        return signals

    made = {
        "board": lambda r: BoardSignals(board, None),
        "channel": lambda r: ChannelSignals(conn),
        "meta": lambda r: MetaSignals(MetaClient(server.address, job="watch")),
        "relays": relayed,
    }
    yield {name: {r: make(r) for r in range(PLAN.world_size)} for name, make in made.items()}
    for closing in (*relays, conn, channel, board):
        closing.close()
    server.stop()


@pytest.mark.parametrize("medium", ["board", "channel", "meta", "relays"])
def test_a_receiver_on_the_wire_learns_at_once_that_a_sender_withheld_the_version(media, medium):
    signals = media[medium]
    link = SyncPeerLink(PLAN, RECEIVER, signals[RECEIVER], None, MANIFEST, "p2p", {})
    senders = _senders(RECEIVER)
    others = [r for r in range(PLAN.world_size) if PLAN.ranks[r].role.value == "trainer" and r not in senders]
    assert senders and others, (senders, others)
    link.watch()  # nothing said: nothing raised
    other = PLAN.ranks[others[-1]]
    signals[others[-1]].withhold("p2p", MANIFEST, other)  # not one of its senders
    link.watch()
    failing = PLAN.ranks[senders[-1]]
    signals[senders[-1]].withhold("p2p", MANIFEST, failing)
    with pytest.raises(TransferError, match=f"'v1' from sender {failing.instance}:{failing.local_rank} were withheld"):
        link.watch()
    later = SyncPeerLink(PLAN, RECEIVER, signals[RECEIVER], None, MANIFEST.renamed("v1", MANIFEST.seq + 1), "p2p", {})
    later.watch()  # a retry (a higher count) is another attempt: its senders said nothing yet


def test_a_failing_first_trainer_rank_withholds_every_senders_bytes_through_the_relays(media):
    signals = media["relays"]
    first = PLAN.ranks[0]
    assert 0 not in _senders(RECEIVER)  # it sends nothing to this receiver, and still every wait ends
    signals[0].withhold("p2p", MANIFEST, first)
    with pytest.raises(TransferError, match="were withheld"):
        SyncPeerLink(PLAN, RECEIVER, signals[RECEIVER], None, MANIFEST, "p2p", {}).watch()


def test_a_sender_on_the_wire_learns_at_once_that_a_receiver_failed_the_version():
    """A receiver that fails before it receives (its views refused, say) never takes the bytes pushed at it: its
    failure, which always goes to the MetaServer, ends its senders' wait too. A receiver that applied changes
    nothing."""
    from awex.engines.sync import outcomes

    server = start_embedded()
    try:
        client = MetaClient(server.address, job="watch")
        sender = _senders(RECEIVER)[-1]
        receivers = sorted({s.peer for s in PLAN.schedule(sender) if s.op == "send"} - {sender})
        assert RECEIVER in receivers and len(receivers) > 1, receivers
        link = SyncPeerLink(PLAN, sender, None, client, MANIFEST, "p2p", {})
        link.watch()  # nobody said anything
        fine = PLAN.ranks[next(r for r in receivers if r != RECEIVER)]
        outcomes.report(client, PLAN, (fine.instance, fine.local_rank), None, MANIFEST, True, None, False)
        link.watch()  # an applied outcome on the MetaServer
        failing = PLAN.ranks[RECEIVER]
        who = (failing.instance, failing.local_rank)
        outcomes.report(client, PLAN, who, None, MANIFEST, False, "its views are on the CPU", False)
        with pytest.raises(TransferError, match=r"receiver vllm-1:1 failed version 'v1': .*its views are on the CPU"):
            link.watch()
    finally:
        server.stop()
