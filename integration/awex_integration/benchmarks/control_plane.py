"""The control plane at scale: a standalone MetaServer (``awex-meta serve``) and 256 to 1,024 ranks of a Kimi-K2-shaped
sync (real writers and readers over a transport that moves no byte: ``control_plane_ranks``), timing per phase
the first sync (registration and layouts, device exchange, agreement, manifest, signals, outcomes; planning is
timed apart) and the steady versions after it, with the server's CPU time and peak memory.

    python -m awex_integration.benchmarks.control_plane --ranks 256,512,1024 \
        --out integration/control-plane-results.json

On a machine with fewer cores than ranks the ranks' own Python shares the cores: a version's wall time here is what
every rank's client work costs in turn, an upper bound of the critical path on a cluster (each rank on its own
CPU). Each row therefore also gives the busiest single rank's CPU time per version and the server's, the
serial parts that remain on a cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

STEADY_GOAL_SECONDS = 0.005  # per version, at 1,024 ranks (issue's goal)
FIRST_GOAL_SECONDS = 10.0  # first sync's control, planning excluded, at 1,024 ranks
FIRST_PHASES = ("layouts", "devices", "plan", "agreement", "signals", "done", "manifest")


CHANNEL_THREAD = "pt_tcpstore_uv"  # the event loop of torch's TCPStore server: the version channel's host


def _proc_cpu(pid: int) -> float:
    """Seconds process ``pid`` ran on a CPU so far: the sum of its live threads' ``schedstat`` (nanoseconds; a
    server's work runs on its event loop's thread, which lives as long as it does), where the kernel keeps it; else
    user plus system time from ``stat``, in clock ticks (10 ms: coarse for a steady version's few milliseconds)."""
    threads = _threads_cpu(pid)
    if threads:
        return sum(threads.values())
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _threads_cpu(pid: int, thread: str | None = None) -> dict[tuple[int, str], float]:
    """Seconds each live thread of process ``pid`` ran so far, by ``(pid, thread id)``, from ``schedstat``; with
    ``thread``, only the threads of that name (``comm``). Empty where the kernel keeps no ``schedstat``."""
    out = {}
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            if thread is None or Path(task, "comm").read_text().strip() == thread:
                out[(pid, task.name)] = int(Path(task, "schedstat").read_text().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):  # a thread that just ended, or no schedstat here
            continue
    return out


def _proc_peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


class _Sampler:
    """Processes' CPU seconds over time, summed (every 20 ms, in a thread), to split them by version."""

    def __init__(self, *pids: int, thread: str | None = None):
        import threading

        self.pids, self.thread = pids, thread
        self.threads: list[tuple[float, dict]] = []  # with ``thread``: each such thread's seconds, over time
        self.samples, self._stop = [(time.time(), self._cpu())], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            try:
                self.samples.append((time.time(), self._cpu()))
            except OSError:  # the server is gone: the run fails on its own
                return

    def _cpu(self) -> float:
        if self.thread is None:
            return sum(_proc_cpu(pid) for pid in self.pids)
        each = {k: v for pid in self.pids for k, v in _threads_cpu(pid, self.thread).items()}
        self.threads.append((time.time(), each))
        return sum(each.values())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        try:
            self.samples.append((time.time(), self._cpu()))
        except OSError:
            pass

    def at(self, when: float) -> float:
        """CPU seconds at wall time ``when`` (the last sample before it)."""
        return max((cpu for t, cpu in self.samples if t <= when), default=self.samples[0][1])

    def busiest(self, began: float, ended: float) -> tuple[float, int]:
        """The most CPU seconds one thread ran between two wall times, and how many threads ran at all."""
        at = lambda when: next((each for t, each in reversed(self.threads) if t <= when), {})  # noqa: E731
        start, end = at(began), at(ended)
        ran = [cpu - start.get(k, 0.0) for k, cpu in end.items() if cpu > start.get(k, 0.0)]
        return max(ran, default=0.0), len(ran)


def run(ranks: int, processes: int, versions: int, timeout: float, store: str = "journal", profile: str = "") -> dict:
    """One rank count: a fresh server (on its journal, or leading on a local etcd cluster of three with another
    standing by), ``processes`` worker processes; the row of the results. ``profile``: ranks (``trainer:0,...``)
    whose steady versions cProfile records, each in ``<rank>.prof`` in the working folder (Python 3.11: from 3.12
    cProfile hooks every thread of a process, and a rank is one thread of many)."""
    from awex.meta.client import MetaClient
    from awex_integration.faults.servers import server_for

    # on etcd with `awex-meta serve`'s default lease (5 s): every rank's client shares this machine's cores with the
    # servers and etcd, and the fault suite's 2-s lease would end under that load
    server = server_for("process") if store == "journal" else server_for("etcd", ttl=5)
    leader = server.proc if store == "journal" else server.procs[server.leader]
    sampler = _Sampler(leader.pid)
    etcd = _Sampler(*(p.pid for p in server.cluster.procs if p is not None)) if store == "etcd" else None
    status = MetaClient(server.address, timeout=30).status
    asked = status()["requests"]
    here = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")]))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            outs = [Path(tmp) / f"slice-{i}.json" for i in range(processes)]
            started = time.perf_counter()
            procs = [
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "awex_integration.benchmarks.control_plane_ranks",
                        "--address",
                        server.address,
                        "--ranks",
                        str(ranks),
                        "--slice",
                        f"{i}/{processes}",
                        "--versions",
                        str(versions),
                        "--timeout",
                        str(timeout),
                        "--out",
                        str(outs[i]),
                        "--barrier",
                        tmp,
                        "--profile",
                        profile,
                    ],
                    env=env,
                )  # fmt: skip
                for i in range(processes)
            ]
            channel = _Sampler(*(p.pid for p in procs), thread=CHANNEL_THREAD)  # hosted by the first trainer rank
            try:
                for p in procs:
                    p.wait(timeout=max(1.0, started + timeout + 120 - time.perf_counter()))
            except subprocess.TimeoutExpired:
                for p in procs:
                    p.kill()
                raise
            wall = time.perf_counter() - started
            docs = [json.loads(o.read_text()) for o in outs if o.exists()]
            for prof in Path(tmp).glob("*.prof"):  # slice-<i>.json.<rank>.prof
                shutil.copy(prof, prof.name.split(".json.", 1)[1])
        requests = status()["requests"] - asked - 1  # the ranks' (not the two status calls)
        sampler.stop()
        channel.stop()
        if etcd is not None:
            etcd.stop()
        server_rss = _proc_peak_rss(leader.pid)
    finally:
        server.stop()
    errors = [e for d in docs for e in d["errors"]] + [f"a worker exited {p.returncode}" for p in procs if p.returncode]
    if errors or len(docs) != processes:
        raise SystemExit(f"{ranks} ranks: {len(errors)} error(s): {errors[:10]}")
    rows = {name: r for d in docs for name, r in d["ranks"].items()}
    row = summarise(ranks, rows, sampler, max(d["plan_seconds"] for d in docs), channel)
    row["store"] = store
    if etcd is not None:  # etcd's own CPU (three members), by the same versions' times
        first, steady = _spans(rows)
        row["first_sync_etcd_cpu_seconds"] = round(etcd.at(first[1]) - etcd.at(first[0]), 3)
        row["steady_etcd_cpu_seconds_per_version"] = round((etcd.at(steady[1]) - etcd.at(steady[0])) / steady[2], 5)
    media = [m for d in docs for m in d["media"].values()]
    row["signals"] = {m: media.count(m) for m in sorted(set(media), key=str)}  # where per-version signals went
    heard = [k for d in docs for kinds in d.get("heard", {}).values() for k in kinds]  # from host relays
    row["heard_from_relays"] = {k: heard.count(k) for k in ("manifest", "outcomes", "ready", "outcome_to_lead")}
    row.update(processes=processes, server_peak_rss_bytes=server_rss, wall_seconds=round(wall, 2))
    row["server_requests_per_rank"] = round(requests / ranks, 2)  # the whole run: the first sync and the steady ones
    return row


def _cpu(rows: dict, which, version: int) -> list[float]:
    return [r["versions"][version]["cpu_seconds"] for name, r in rows.items() if which(name)]


def _spans(rows: dict) -> tuple[tuple[float, float], tuple[float, float, int]]:
    """The first sync's wall-clock span (every rank's) and the steady versions' (the writer's), with their count."""
    writer = rows["trainer:0"]["versions"]
    began = min(r["versions"][0]["began"] for r in rows.values())
    ended = max(r["versions"][0]["ended"] for r in rows.values())
    return (began, ended), (writer[1]["began"], writer[-1]["ended"], len(writer) - 1)


def summarise(ranks: int, rows: dict, server, plan: float, channel=None) -> dict:
    """The results row of one rank count from every rank's per-version records and the server's CPU samples.

    Measured here: wall seconds (every rank's client work shares this machine's cores) and CPU seconds of each
    rank's thread, of the server and of the version channel's host (``channel``: the event loop of the store the
    first trainer rank hosts, serving every rank's per-version signals). ``*_serial_cpu_seconds``: the work that
    stays serial with a core per rank (the server's, the channel host's, the first trainer rank's, the busiest
    other trainer rank's and receiver's), the floor of the critical path on a cluster before network round
    trips."""
    writer = rows["trainer:0"]["versions"]
    first, steady = writer[0], writer[1:]
    n = len(steady)
    is_trainer = lambda name: name.startswith("trainer:") and name != "trainer:0"  # noqa: E731
    is_receiver = lambda name: not name.startswith("trainer:")  # noqa: E731
    (first_began, first_ended), (steady_began, steady_ended, _) = _spans(rows)
    server_first = server.at(first_ended) - server.at(first_began)
    server_steady = (server.at(steady_ended) - server.at(steady_began)) / n if n else float("nan")
    channel_first = channel.at(first_ended) - channel.at(first_began) if channel else 0.0
    channel_steady = (channel.at(steady_ended) - channel.at(steady_began)) / n if channel and n else 0.0
    # a channel of several lanes is as many event loops (threads), each on a core of its own: its busiest is serial
    lane_steady, lanes = channel.busiest(steady_began, steady_ended) if channel and n else (0.0, 0)
    lane_steady = lane_steady / n if n else 0.0
    first_cpu = {
        "first_trainer_rank": round(first["cpu_seconds"], 4),
        "other_trainer_ranks_max": round(max(_cpu(rows, is_trainer, 0)), 4),
        "receivers_max": round(max(_cpu(rows, is_receiver, 0)), 4),
        "receivers_median": round(_median(_cpu(rows, is_receiver, 0)), 4),
    }
    per_version = [
        (
            rows["trainer:0"]["versions"][k]["cpu_seconds"],
            max(_cpu(rows, is_trainer, k)),
            max(_cpu(rows, is_receiver, k)),
            sum(_cpu(rows, lambda _: True, k)),
        )
        for k in range(1, len(writer))
    ]
    steady_cpu = {
        "first_trainer_rank": round(_median([v[0] for v in per_version]), 5),
        "other_trainer_ranks_max": round(_median([v[1] for v in per_version]), 5),
        "receivers_max": round(_median([v[2] for v in per_version]), 5),
        "all_ranks_sum": round(_median([v[3] for v in per_version]), 4),
    }
    serial_first = (
        server_first
        + channel_first
        + first_cpu["first_trainer_rank"]
        + max(first_cpu["other_trainer_ranks_max"], first_cpu["receivers_max"])
    )
    # what the version channel's host serves a steady version, counted (not timed): every rank's puts, waited reads
    # and looks, and the keys the writer drops (in its background thread, about one version's worth each version)
    channel_ops = [sum(r["versions"][k].get("channel_ops", 0) for r in rows.values()) for k in range(1, len(writer))]
    channel_deletes = sum(v.get("channel_deletes", 0) for v in steady) / n if n else 0.0
    ranks_steady = ("first_trainer_rank", "other_trainer_ranks_max", "receivers_max")
    serial_steady = server_steady + lane_steady + sum(steady_cpu[k] for k in ranks_steady)
    return {
        "ranks": ranks,
        "trainer_ranks": sum(1 for name in rows if name.startswith("trainer:")),
        "inference_ranks": sum(1 for name in rows if is_receiver(name)),
        "plan_seconds_once": round(plan, 3),
        "first_sync_control_seconds": round(first["seconds"] - first["phases"].get("plan", 0.0), 3),
        "first_sync_phases": {p: round(first["phases"].get(p, 0.0), 4) for p in FIRST_PHASES},
        "first_sync_slowest_rank_seconds": round(max(r["versions"][0]["seconds"] for r in rows.values()), 3),
        "first_sync_cpu_seconds": first_cpu,
        "first_sync_server_cpu_seconds": round(server_first, 3),
        "first_sync_channel_host_cpu_seconds": round(channel_first, 3),
        "first_sync_serial_cpu_seconds": round(serial_first, 3),
        "steady_control_seconds_per_version": round(_median([v["seconds"] for v in steady]), 5),
        "steady_channel_ops_per_version": _median(channel_ops) if channel_ops else 0,
        "steady_channel_deletes_per_version": round(channel_deletes, 1),
        "steady_phases": {
            p: round(_median([v["phases"].get(p, 0.0) for v in steady]), 5) for p in ("manifest", "signals", "done")
        },
        "steady_cpu_seconds_per_version": steady_cpu,
        "steady_server_cpu_seconds_per_version": round(server_steady, 5),
        "steady_channel_host_cpu_seconds_per_version": round(channel_steady, 5),
        "steady_channel_lanes": lanes,
        "steady_channel_busiest_lane_cpu_seconds_per_version": round(lane_steady, 5),
        "steady_serial_cpu_seconds_per_version": round(serial_steady, 5),
        "versions": len(writer),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="256,512,1024", help="rank counts, comma-separated (multiples of 128)")
    ap.add_argument("--processes", type=int, default=8, help="worker processes the ranks are spread over")
    ap.add_argument("--versions", type=int, default=6, help="versions per run (the first plans and joins)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--out", default=None, help="results file (JSON)")
    ap.add_argument(
        "--store",
        default="journal",
        choices=["journal", "etcd"],
        help="the server's safety state: its journal (default), or a local etcd cluster of three (etcd on the PATH)",
    )
    ap.add_argument(
        "--profile", default="", help="ranks (trainer:0,...) whose steady versions cProfile records (Python 3.11)"
    )
    args = ap.parse_args(argv)
    if args.profile and sys.version_info >= (3, 12):
        ap.error(profile_refusal(sys.version_info))
    results: list[dict] = []
    for n in (int(x) for x in args.ranks.split(",")):
        try:
            row = run(n, args.processes, args.versions, args.timeout, args.store, args.profile)
        except (SystemExit, subprocess.TimeoutExpired) as e:  # written down, and the run fails
            row = {"ranks": n, "failed": str(e)[:2000]}
        print(json.dumps(row), flush=True)
        results.append(row)
        if args.out:  # after every rank count: a later one that fails leaves the earlier rows
            _write(args.out, results)
    return 1 if any("failed" in r for r in results) else 0


def profile_refusal(version: tuple) -> str:
    """Why ``--profile`` cannot run on Python ``version`` (3.12 and later): a rank is one thread of a worker process,
    and from 3.12 cProfile (on ``sys.monitoring``) records every thread of the process, so a rank's profile would
    hold its neighbours' work too."""
    return (
        f"--profile needs Python 3.11: on {version[0]}.{version[1]} cProfile records every thread of a process, and "
        "each worker process runs many ranks as threads (a rank's profile would hold all of theirs)"
    )


def _write(out: str, results: list[dict]) -> None:
    doc = {
        "what": "The control plane of a Kimi-K2-shaped sync (Megatron TP=8 PP=8 EP=8 -> vLLM engines TP=8 x DP=4, "
        "EP=32; a tiny model of the same structure) through the public writer and reader over a transport that "
        "moves no byte, against a standalone MetaServer; planning once per process, timed apart",
        "machine": f"{os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}",
        "date": datetime.now(timezone.utc).date().isoformat(),
        "serial_cpu": "*_serial_cpu_seconds: the server's CPU plus the version channel's host's (the event loop of "
        "the store the first trainer rank hosts; in steady state, of a channel of several lanes, the busiest lane's "
        "event loop: each runs on a thread of its own) plus the first trainer rank's plus the busiest other trainer "
        "rank's and receiver's: the work that stays serial with a core per rank, the floor of the "
        "critical path on a cluster before network round trips; the wall seconds are measured here, every "
        "rank's client work sharing this machine's cores",
        "goals": {
            "steady_seconds_per_version": STEADY_GOAL_SECONDS,
            "first_sync_control_seconds": FIRST_GOAL_SECONDS,
        },
        "runs": results,
    }
    Path(out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
