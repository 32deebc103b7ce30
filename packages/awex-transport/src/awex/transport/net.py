"""Addresses and ports: which of this host's addresses its peers reach it at, a free port to listen on."""

from __future__ import annotations

import random
import socket

from awex.meta.errors import AwexValueError


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


def split_ports(address: str, most: int = 64) -> tuple[str, list[int]]:
    """``host:port`` or ``host:port0,port1,...`` (at most ``most`` ports) -> the host and its ports; ``AwexValueError``
    where it is not one (no host, a port that is not a number in 1..65535, too many)."""
    host, _, tail = str(address).rpartition(":")
    try:
        ports = [int(p) for p in tail.split(",")]
    except ValueError:
        ports = []
    if not host or not 0 < len(ports) <= most or not all(0 < p < 65536 for p in ports):
        raise AwexValueError(f"{address!r} is not host:port[,port...] (at most {most} ports)")
    return host, ports


EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LISTEN_PORTS = (20000, 32767)  # where ports to listen on are drawn from, outside the ephemeral range


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the caller listens on it soon after; another process may take it first)."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports free on ``host`` now, drawn outside the kernel's ephemeral range where it can be
    read: the port is free between this call and the caller's listen, and the kernel hands ephemeral ports to every
    ``connect`` and ``bind(0)`` of the host meanwhile (gloo pairs, HTTP clients, other stores), so a port drawn from
    that range can be taken before the caller listens on it; one drawn outside it only by another explicit choice."""
    low, high = _listen_range()
    rng = random.SystemRandom()
    socks: list[socket.socket] = []
    try:
        for _ in range(64 * n):
            if len(socks) == n or low > high:
                break
            s = socket.socket()
            try:
                s.bind((host, rng.randint(low, high)))
            except OSError:
                s.close()
                continue
            socks.append(s)
        while len(socks) < n:  # no room outside the ephemeral range: the kernel's choice
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _listen_range() -> tuple[int, int]:
    """:data:`LISTEN_PORTS` less the ephemeral range where it overlaps (empty: ``low > high``)."""
    low, high = LISTEN_PORTS
    try:
        with open(EPHEMERAL_RANGE_FILE) as f:
            first, last = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        return low, high
    if first <= high and last >= low:  # overlap: keep the larger part below or above it
        below, above = (low, first - 1), (last + 1, high)
        return max(below, above, key=lambda r: r[1] - r[0])
    return low, high
