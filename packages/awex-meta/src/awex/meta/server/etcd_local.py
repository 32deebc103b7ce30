"""A real etcd cluster on this machine (three members on loopback by default) for tests and trials of the
MetaServer's etcd store (``awex.meta.server.etcd_store``): Debian's ``etcd-server``, or any ``etcd`` on the PATH
(``AWEX_ETCD`` names another binary). Not for production: a deployment runs its own etcd, its members on machines
of their own."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
import uuid

ETCD = os.environ.get("AWEX_ETCD") or shutil.which("etcd")
MISSING = "no etcd binary (Debian's etcd-server, or AWEX_ETCD=/path/to/etcd)"


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Cluster:
    """``members`` etcd members (``stop(i)`` / ``start(i)`` one of them); :meth:`url` a store address with a fresh
    prefix (users of one cluster share it, never their keys). ``RuntimeError`` without an etcd binary."""

    def __init__(self, members: int = 3):
        if ETCD is None:
            raise RuntimeError(MISSING)
        self.dir = tempfile.mkdtemp(prefix="awex-etcd-")
        ports = _free_ports(2 * members)
        self.clients = ports[:members]
        self.peers = ports[members:]
        self.names = [f"m{i}" for i in range(members)]
        self.initial = ",".join(f"{n}=http://127.0.0.1:{p}" for n, p in zip(self.names, self.peers))
        self.procs: list[subprocess.Popen | None] = [None] * members
        for i in range(members):
            self.start(i, new=True)
        self.wait_healthy()

    def start(self, i: int, new: bool = False) -> None:
        args = [
            ETCD,
            f"--name={self.names[i]}",
            f"--data-dir={self.dir}/{self.names[i]}",
            f"--listen-client-urls=http://127.0.0.1:{self.clients[i]}",
            f"--advertise-client-urls=http://127.0.0.1:{self.clients[i]}",
            f"--listen-peer-urls=http://127.0.0.1:{self.peers[i]}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{self.peers[i]}",
            f"--initial-cluster={self.initial}",
            f"--initial-cluster-state={'new' if new else 'existing'}",
            "--initial-cluster-token=awex-test",
            "--heartbeat-interval=50",
            "--election-timeout=500",
        ]
        log = open(f"{self.dir}/{self.names[i]}.log", "ab")
        self.procs[i] = subprocess.Popen(args, stdout=log, stderr=log)

    def stop(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None:
            proc.kill()
            proc.wait(10)
        self.procs[i] = None

    def wait_healthy(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                for i, p in enumerate(self.clients):
                    if self.procs[i] is None:
                        continue
                    with urllib.request.urlopen(f"http://127.0.0.1:{p}/health", timeout=2) as r:
                        if b'"true"' not in r.read():
                            raise OSError("not healthy")
                return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"etcd cluster not healthy within {timeout} s (logs in {self.dir})")

    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.clients)
        return f"etcd://{hosts}/awex-test-{uuid.uuid4().hex[:8]}"

    def close(self) -> None:
        for i in range(len(self.procs)):
            self.stop(i)
        shutil.rmtree(self.dir, ignore_errors=True)
