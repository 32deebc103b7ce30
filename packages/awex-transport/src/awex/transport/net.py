"""Which of this host's addresses its peers reach it at."""

from __future__ import annotations

import socket


def local_address(peer_host: str, peer_port: int = 9) -> str:
    """This host's address on the route to ``peer_host`` (no packet is sent: connecting a UDP socket only picks
    the route); ``127.0.0.1`` where there is none. On a host with several interfaces this is the one its peers
    on that network see, which the machine's hostname often is not."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((peer_host, peer_port or 9))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"
