"""Point to point over a process group of the sync's own: :mod:`~awex.transport.p2p.waves` (the wave executor),
:mod:`~awex.transport.p2p.delta` (delta buckets), :mod:`~awex.transport.p2p.transport` (the transport)."""

from awex.transport.messages import ALIGN, message_offsets
from awex.transport.p2p.delta import DeltaExecutor
from awex.transport.p2p.transport import P2pTransport
from awex.transport.p2p.waves import WaveExecutor, broadcast_groups, bucket_messages, run_p2p

__all__ = [
    "ALIGN",
    "DeltaExecutor",
    "P2pTransport",
    "WaveExecutor",
    "broadcast_groups",
    "bucket_messages",
    "message_offsets",
    "run_p2p",
]
