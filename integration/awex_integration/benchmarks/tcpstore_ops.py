"""What one operation of torch's TCP store costs its server: the version channel's host
(``awex.engines.sync.channel``) serves every rank's per-version signals on one event loop, so its CPU per operation
times the operations a version asks is serial work on every version's critical path.

N client threads (each its own connection) set a key and wait for another client's key (``multi_get``), for a few
rounds; then one client deletes every key. Then one client alone, call by call: what each kind of call costs the
server (a ``multi_get`` or ``get`` is two requests, a wait and then the read; a ``set`` is not answered, so sets
arrive batched). The server's threads (those the hosting store started) are read from ``/proc`` (``schedstat``,
nanoseconds) before and after; one JSON line per backend and client count.

    python -m awex_integration.benchmarks.tcpstore_ops --clients 64,256 --out integration/results/tcpstore-ops.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path


def _threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _cpu(threads: set[str]) -> float:
    """CPU seconds of this process's threads ``threads`` (ids) so far."""
    total = 0
    for tid in threads:
        try:
            total += int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):  # a thread that ended
            continue
    return total / 1e9


def measure(clients: int, libuv: bool = True, rounds: int = 5, value_bytes: int = 200, calls: int = 2000) -> dict:
    """One server and ``clients`` connections: the server's CPU per set or ``multi_get``, and per delete; then
    ``calls`` calls of each kind from one client."""
    import torch
    import torch.distributed as dist

    before = _threads()
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), use_libuv=libuv)
    served_by = _threads() - before  # what the hosting store started: its event loop
    names = sorted({Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in served_by})
    conns = [
        dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30), use_libuv=libuv)
        for _ in range(clients)
    ]
    value = b"x" * value_bytes

    def work(i: int, conn) -> None:
        for r in range(rounds):
            conn.set(f"k/{r}/{i}", value)
            conn.multi_get([f"k/{r}/{(i + 1) % clients}"])  # waits until that client set it

    threads = [threading.Thread(target=work, args=(i, c)) for i, c in enumerate(conns)]
    cpu, started = _cpu(served_by), time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ops_cpu, wall = _cpu(served_by) - cpu, time.perf_counter() - started
    cpu = _cpu(served_by)
    for r in range(rounds):
        for i in range(clients):
            conns[0].delete_key(f"k/{r}/{i}")
    deletes_cpu = _cpu(served_by) - cpu
    conn, per_call = conns[0], {}
    conn.set("held", value)
    for kind, call in (
        ("set", lambda i: conn.set(f"one/{i}", value)),
        ("check", lambda i: conn.check(["held"])),
        ("multi_get", lambda i: conn.multi_get(["held"])),
        ("wait", lambda i: conn.wait(["held"])),
        ("delete_key", lambda i: conn.delete_key(f"one/{i}")),
    ):
        cpu = _cpu(served_by)
        for i in range(calls):
            call(i)
        conn.check(["held"])  # answered: every earlier request of this connection was served (sets are not)
        per_call[kind] = round((_cpu(served_by) - cpu) / calls * 1e6, 2)
    if not served_by or ops_cpu <= 0:
        raise RuntimeError("the store's server threads were not found or read no CPU: nothing measured")
    return {
        "torch": torch.__version__,
        "libuv": libuv,
        "clients": clients,
        "server_threads": names,
        "us_per_op": round(ops_cpu / (clients * rounds * 2) * 1e6, 2),
        "us_per_delete": round(deletes_cpu / (clients * rounds) * 1e6, 2),
        "us_per_call_one_client": per_call,
        "wall_s": round(wall, 3),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default="64,256", help="client counts, comma-separated")
    ap.add_argument("--backends", default="libuv,legacy", help="libuv (torch's default), legacy, or both")
    ap.add_argument("--out", default=None, help="results file (JSON lines: a header, then one line per run)")
    args = ap.parse_args(argv)
    machine = f"{os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}"
    lines = [
        {
            "what": "CPU of torch's TCP store server (its event loop's threads, from schedstat) per operation: N "
            "client threads each set a key and multi_get another client's key, 5 rounds; then one client deletes "
            "every key",
            "machine": machine,
            "date": datetime.now(timezone.utc).date().isoformat(),
        }
    ]
    for backend in args.backends.split(","):
        for n in (int(x) for x in args.clients.split(",")):
            row = measure(n, libuv=backend.strip() == "libuv")
            print(json.dumps(row), flush=True)
            lines.append(row)
    if args.out:
        Path(args.out).write_text("".join(json.dumps(line) + "\n" for line in lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
