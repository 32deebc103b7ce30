"""Two hosts on one machine: two network namespaces joined by a veth pair, for syncs that cross a network.

Each namespace has its loopback and one end of the veth pair (``10.231.<n>.1`` and ``.2``), and no default route
(name lookups then fail at once instead of waiting for an unreachable DNS server): a process in one reaches the
other only through the veth pair, as across hosts (no shared loopback; /dev/shm stays shared, as it is for the
machine, but Awex counts separate network namespaces as separate hosts). Processes join one with :func:`enter`
(the calling thread, before it opens sockets or starts threads). Needs root (or CAP_NET_ADMIN) and iproute2;
:func:`unavailable` says why not where that is missing.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass

CLONE_NEWNET = 0x40000000
NETNS_DIR = "/var/run/netns"


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {out.stderr.strip()}")


def unavailable() -> str | None:
    """Why two namespaces cannot be made here, or ``None``."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    name = f"awex-probe-{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", name)
    except OSError as e:
        return f"cannot create a network namespace ({e}); needs root or CAP_NET_ADMIN"
    try:
        _ip("netns", "delete", name)
    except OSError:
        pass
    return None


def enter(namespace: str) -> None:
    """Move the calling thread into network namespace ``namespace`` (sockets it opens from now on live there;
    threads and processes it starts from now on start there)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(os.path.join(NETNS_DIR, namespace), os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {namespace}: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)


def in_namespace(namespace: str, fn, *args):
    """``fn(*args)`` in network namespace ``namespace`` (for spawned processes: a picklable target)."""
    enter(namespace)
    return fn(*args)


@dataclass
class TwoHosts:
    """Namespaces ``a`` and ``b`` with addresses ``address_a`` and ``address_b``; remove them with :meth:`close`
    (also removes the veth pair)."""

    a: str
    b: str
    address_a: str
    address_b: str

    @classmethod
    def create(cls) -> TwoHosts:
        tag = secrets.token_hex(3)
        subnet = 10 + int(tag[:2], 16) % 200  # 10.231.10-209.x: unlikely to meet a real network here
        hosts = cls(f"awex-{tag}-a", f"awex-{tag}-b", f"10.231.{subnet}.1", f"10.231.{subnet}.2")
        veth_a, veth_b = f"awx{tag}a", f"awx{tag}b"
        try:
            for ns in (hosts.a, hosts.b):
                _ip("netns", "add", ns)
            _ip("link", "add", veth_a, "type", "veth", "peer", "name", veth_b)
            for ns, dev, addr in ((hosts.a, veth_a, hosts.address_a), (hosts.b, veth_b, hosts.address_b)):
                _ip("link", "set", dev, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except OSError:
            hosts.close()
            raise
        return hosts

    def close(self) -> None:
        for ns in (self.a, self.b):
            try:
                _ip("netns", "delete", ns)
            except OSError:
                pass

    def __enter__(self) -> TwoHosts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
