"""MetaServers the fault suite can restart, kill and freeze: embedded in the harness (journalling), ``awex-meta serve``
in a process of its own (journalling), or two ``awex-meta serve --store etcd://...`` processes on a local etcd
cluster of three (one leads, the other stands by; :func:`server_for` picks by a case's ``server``)."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

from awex_integration.scenarios.spawn import free_port

LEADER_TTL = 2  # seconds: the etcd pair's dead leader is replaced this soon


class EmbeddedServer:
    """A MetaServer in the harness's process, journalling (a restart keeps fences, claims and served versions)."""

    def __init__(self):
        from awex.meta.server import start_embedded

        self._start = start_embedded
        self._dir = tempfile.mkdtemp(prefix="awex-fault-meta-")
        self.journal = os.path.join(self._dir, "meta.journal")
        self.server = start_embedded(journal=self.journal)
        self.port = self.server.port
        self.address = self.server.address

    def restart(self) -> None:
        self.server.stop()
        self.server = self._start(port=self.port, journal=self.journal)

    def stop(self) -> None:
        self.server.stop()
        shutil.rmtree(self._dir, ignore_errors=True)


def _serve(port: int, store: list[str], leads: bool) -> subprocess.Popen:
    """``awex-meta serve`` on ``port`` with ``store`` (its journal or etcd options); once it listens where it
    ``leads``, else at once (standing by). What it logs is read (and dropped) so a full pipe never blocks it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "awex.meta.cli", "serve", "--port", str(port), *store],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    if leads:
        seen = []
        for line in proc.stdout:  # its log lines come first (limits), then "serving on"
            seen.append(line)
            if "serving on" in line or len(seen) > 50:
                break
        if not seen or "serving on" not in seen[-1]:
            raise RuntimeError(f"awex-meta serve did not start: {''.join(seen)[-2000:]}")
    threading.Thread(target=lambda out=proc.stdout: [None for _ in out], daemon=True).start()
    return proc


class ProcessServer:
    """``awex-meta serve`` in its own process (SIGSTOP freezes it, SIGKILL kills it), on its journal."""

    def __init__(self):
        self.port = free_port()
        self.address = f"http://127.0.0.1:{self.port}"
        self._dir = tempfile.mkdtemp(prefix="awex-fault-meta-")  # its journal: a restart keeps the safety state
        self.proc = self._spawn()

    def _spawn(self) -> subprocess.Popen:
        return _serve(self.port, ["--journal", os.path.join(self._dir, "meta.journal")], leads=True)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def restart(self) -> None:
        self.kill()
        self.proc = self._spawn()

    def restart_killed(self) -> None:
        self.proc = self._spawn()

    def freeze(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        self.thaw()
        self.kill()
        shutil.rmtree(self._dir, ignore_errors=True)


_CLUSTER: list = []  # one local etcd cluster for every case of this process


def etcd_cluster():
    """This process's local etcd cluster of three (started on first use, stopped at exit)."""
    if not _CLUSTER:
        from awex.meta.server.etcd_local import Cluster

        _CLUSTER.append(Cluster())
        atexit.register(_CLUSTER[0].close)
    return _CLUSTER[0]


class EtcdServers:
    """Two ``awex-meta serve`` processes on one etcd store: the first leads, the second stands by. ``kill``,
    ``freeze`` and ``thaw`` act on the leader (the other takes over once its lease runs out); ``restart`` kills the
    leader and starts a new server on its port (it stands by); ``lose_member`` kills one etcd member (started again
    when the case ends). Clients get both addresses."""

    def __init__(self, ttl: int = LEADER_TTL):
        self.cluster = etcd_cluster()
        self._store = ["--store", self.cluster.url(), "--leader-ttl", str(ttl)]
        self.ports = [free_port(), free_port()]
        self.address = ",".join(f"http://127.0.0.1:{p}" for p in self.ports)
        self.procs = [_serve(self.ports[0], self._store, leads=True), _serve(self.ports[1], self._store, leads=False)]
        self.leader = 0  # the process that leads (as far as the harness made it)
        self._lost: list[int] = []

    def kill(self) -> None:
        self.procs[self.leader].kill()
        self.procs[self.leader].wait(10)
        self._dead = self.leader
        self.leader = 1 - self.leader  # the standby takes over once the dead leader's lease ends

    def restart_killed(self) -> None:
        self.procs[self._dead] = _serve(self.ports[self._dead], self._store, leads=False)

    def restart(self) -> None:
        self.kill()
        self.restart_killed()

    def freeze(self) -> None:
        os.kill(self.procs[self.leader].pid, signal.SIGSTOP)
        self._frozen = self.leader
        self.leader = 1 - self.leader  # past its lease the other leads; thawed, the frozen one stops

    def thaw(self) -> None:
        proc = self.procs[self._frozen]
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)

    def lose_member(self, i: int = 0) -> None:
        self.cluster.stop(i)
        self._lost.append(i)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
            proc.wait(10)
        for i in self._lost:
            self.cluster.start(i)
        if self._lost:
            self.cluster.wait_healthy()


def server_for(kind: str, **options):
    """The server a case asks for: ``"embedded"``, ``"process"`` or ``"etcd"`` (``options``: the etcd pair's)."""
    return {"embedded": EmbeddedServer, "process": ProcessServer, "etcd": EtcdServers}[kind](**options)
