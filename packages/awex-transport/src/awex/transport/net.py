"""Addresses and ports: which of this host's addresses its peers reach it at, a free port to listen on."""

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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the caller listens on it soon after; another process may take it first)."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports free on ``host`` now."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
