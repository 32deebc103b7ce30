"""The fault suite: real multi-process syncs on CPU (gloo or shared memory, a MetaServer) with faults injected,
checking what every party says against what happened. Every case also checks that no segment or host board of
its processes is left in /dev/shm.

    python -m awex_integration.fault_suite [--cases NAME,...] [--timeout S]

Each case runs trainer and engine ranks in their own processes (``awex_integration.fault_ranks``) through a script
of versions, kills, raises in or interrupts ranks at chosen points, restarts dead ranks and the MetaServer, and
then checks: no call outlived its deadline plus slack (``hangs``); nobody said a version was applied where it
was not: a trainer's ``write`` returning, a receiver's ``receive`` returning while its bytes are another
version's, the MetaServer reporting a version for an instance not every rank of which applied it
(``false_success``); and whether the version after the fault succeeded everywhere (``recovered``). The last line
of the output is one JSON object: ``cases``, ``passed``, ``failed`` (names), ``hangs``, ``false_success``,
``recovered``, ``should_recover``, ``seconds``. Exit status 0 only when every case passed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from awex_integration import fault_ranks
from awex_integration.spawn import free_port

RECEIVER_DEADLINES = 3  # an engine's deadline, in trainer deadlines
SLACK = 5.0  # seconds a step may take beyond its deadline before it counts as a hang (process start-up included)


@dataclass
class Case:
    name: str
    what: str
    trainer: list[list[dict]]  # one script per trainer rank
    engine: list[list[dict]]  # one script per engine rank (instance "eng")
    restart: dict[tuple[str, int], list[dict]] = field(default_factory=dict)  # a rank that died runs this next
    restart_delay: float = 0.0  # seconds before it does; negative: -k = k trainer deadlines + 1 s
    expect_failed: set[str] = field(default_factory=set)  # versions whose first attempt must fail
    recovers: bool = True  # the last version must succeed everywhere
    server: str = "embedded"  # or "process": a standalone `awex-meta serve` the case may kill or stop
    between: Callable[[Any, Path], None] | None = None  # run by the harness while ranks wait for "go" files
    train_tp: int = 1
    infer_tp: int = 2
    check: Callable[[dict], list[str]] | None = None  # extra checks of the run's record: problems found
    zombie: list[dict] | None = None  # a second trainer process (rank 0 of the same instance) started at "go"
    transport: str = "p2p"  # the writers' (gloo on CPU; run_case may override it)


def _steps(*versions: str, **faults: str) -> list[dict]:
    """A script: these versions in order; ``v_2="fault"`` injects a fault into the first attempt at ``v-2``."""
    out, seen = [], set()
    for v in versions:
        fault = faults.get(v.replace("-", "_")) if v not in seen else None
        seen.add(v)
        out.append({"version": v, **({"fault": fault} if fault else {})})
    return out


# -- servers the harness can restart, kill and freeze ------------------------------------------------------------
class EmbeddedServer:
    def __init__(self):
        from awex.meta.server import start_embedded

        self._start = start_embedded
        self.server = start_embedded()
        self.port = self.server.port
        self.address = self.server.address

    def restart(self) -> None:
        self.server.stop()
        self.server = self._start(port=self.port)

    def stop(self) -> None:
        self.server.stop()


class ProcessServer:
    """``awex-meta serve`` in its own process (SIGSTOP freezes it, SIGKILL kills it)."""

    def __init__(self):
        self.port = free_port()
        self.address = f"http://127.0.0.1:{self.port}"
        self.proc = self._spawn()

    def _spawn(self) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-m", "awex.meta.cli", "serve", "--port", str(self.port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        line = proc.stdout.readline()
        if "serving on" not in line:
            raise RuntimeError(f"awex-meta serve did not start: {line}{proc.stdout.read()[:2000]}")
        return proc

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


# -- running one case ---------------------------------------------------------------------------------------
def _run_rank(fn, key, args, results) -> None:
    try:
        results.put((key, "ok", fn(*args)))
    except BaseException as e:
        results.put((key, "error", f"{type(e).__name__}: {e}"))


def run_case(case: Case, timeout: float, device: str = "cpu", transport: str | None = None) -> dict:
    """Run ``case``; on ``device="cuda"`` every rank's tensors live on GPU 0 (colocated ranks: CUDA IPC), on
    ``"cuda-per-rank"`` each rank has a GPU of its own (``fault_ranks.rank_device``); ``transport``: the
    writers' (default: the case's)."""
    work = Path(tempfile.mkdtemp(prefix=f"awex-fault-{case.name}-"))  # the ranks' records: removed after
    try:
        return _run_case(case, timeout, device, transport, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run_case(case: Case, timeout: float, device: str, transport: str | None, work: Path) -> dict:
    transport = transport or case.transport
    server = EmbeddedServer() if case.server == "embedded" else ProcessServer()
    job = case.name.replace("_", "-")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs: dict[tuple[str, int, int], Any] = {}  # (role, rank, life) -> process

    def start(role: str, rank: int, script: list[dict], life: int) -> None:
        if role in ("trainer", "zombie"):
            fn, args = (
                fault_ranks.trainer_rank,
                (
                    server.address,
                    job,
                    rank,
                    case.train_tp,
                    case.infer_tp,
                    script,
                    timeout,
                    ["eng"],
                    str(work),
                    device,
                    transport,
                ),
            )
        else:
            # an engine waits for the trainer (as vLLM's update call does): its deadline covers the trainer's
            fn, args = (
                fault_ranks.receiver_rank,
                (
                    server.address,
                    job,
                    "eng",
                    rank,
                    case.train_tp,
                    case.infer_tp,
                    script,
                    RECEIVER_DEADLINES * timeout,
                    str(work),
                    device,
                ),
            )
        p = ctx.Process(target=_run_rank, args=(fn, (role, rank, life), args, results), daemon=False)
        p.start()
        procs[(role, rank, life)] = p

    started = time.monotonic()
    for r, script in enumerate(case.trainer):
        start("trainer", r, script, 0)
    for r, script in enumerate(case.engine):
        start("engine", r, script, 0)
    versions = len({s["version"] for script in case.trainer + case.engine for s in script})
    limit = timeout * (3 * versions + 4) + 60
    out: dict[tuple[str, int, int], tuple[str, Any]] = {}
    between_done = case.between is None
    pending: list[tuple[float, str, int, list[dict]]] = []  # restarts due: (when, role, rank, script)
    while (len(out) < len(procs) or pending) and time.monotonic() - started < limit:
        if not between_done and all((work / f"at-{k[0]}-{k[1]}").exists() for k in procs if k[2] == 0 and k not in out):
            case.between(server, work)  # every rank waits for "go"
            if case.zombie is not None:
                start("zombie", 0, case.zombie, 0)
            (work / "go").write_text("")
            between_done = True
        try:
            key, status, value = results.get(timeout=0.2)
            out[key] = (status, value)
            continue
        except queue.Empty:
            pass
        for key, p in list(procs.items()):
            if key not in out and not p.is_alive():
                out[key] = ("died", (p.exitcode, fault_ranks.died_records(str(work), p.pid)))
                nxt = case.restart.get(key[:2]) if key[2] == 0 else None
                if nxt is not None and p.exitcode == fault_ranks.EXIT_CODE:
                    delay = -case.restart_delay * timeout + 1.0 if case.restart_delay < 0 else case.restart_delay
                    pending.append((time.monotonic() + delay, key[0], key[1], nxt))
        for item in [x for x in pending if x[0] <= time.monotonic()]:
            pending.remove(item)
            start(item[1], item[2], item[3], 1)
    hung = [k for k, p in procs.items() if k not in out]
    for key, p in procs.items():
        if p.is_alive():
            p.kill()
        p.join(5)
    history = _history(server)
    server.stop()
    result = _judge(case, out, hung, history, timeout, time.monotonic() - started)
    leaked = _segments_of({p.pid for p in procs.values()})
    if leaked:
        result["problems"].append(f"shared-memory segments left in /dev/shm: {leaked}")
        result["passed"] = False
    return result


def _segments_of(pids: set[int]) -> list[str]:
    """Shared-memory segments and host boards created by these processes that are still there."""
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return []
    return sorted(
        n
        for n in names
        if n.startswith(("awex-shm-", "awex-board-")) and n.split("-")[2].isdigit() and int(n.split("-")[2]) in pids
    )


def _history(server) -> dict:
    from awex.meta.client import MetaClient

    try:
        client = MetaClient(server.address, job="x", timeout=10)
        jobs = client.status()["jobs"]
    except Exception as e:
        return {"error": str(e)}
    job = next(iter(jobs.values()), {})
    client.job = next(iter(jobs), "x")
    events = client.events(0, timeout=0)
    return {
        "events": events,
        "versions": [(e["source"], e["version"]) for e in events if e["kind"] == "version"],
        "failures": [f"{e['source']}: {e.get('data')}" for e in events if e["kind"] == "sync_failed"],
        "participants": {p["name"]: p["weight_version"] for p in job.get("participants", [])},
    }


def _judge(case: Case, out: dict, hung: list, history: dict, timeout: float, seconds: float) -> dict:
    problems: list[str] = []
    records: dict[str, list[tuple[str, dict]]] = {}  # version -> [(party, step record)], in each party's order
    for key, (status, value) in sorted(out.items(), key=lambda kv: kv[0][2]):
        party = f"{key[0]}:{key[1]}"  # a restarted rank counts as its rank
        if status == "died":  # the steps it finished before it died count as well
            value, finished = value
            if value != fault_ranks.EXIT_CODE:
                problems.append(f"{party} died unexpectedly (exit {value})")
        for rec in value if status == "ok" else finished if status == "died" else []:
            records.setdefault(rec["version"], []).append((party, dict(rec, life=key[2])))
        if status == "error":
            problems.append(f"{party} raised outside a step: {value}")
    hangs = [f"{k[0]}:{k[1]} still running at the case's limit" for k in hung]
    false_success = []
    for version, recs in records.items():
        for party, rec in recs:
            deadline = rec.get("deadline") or timeout * (RECEIVER_DEADLINES if party.startswith("engine") else 1)
            if rec["seconds"] > deadline + SLACK:
                hangs.append(f"{party} took {rec['seconds']:.1f} s on {version} (deadline {deadline:g} s)")
            if rec["ok"] and party.startswith("engine") and not rec.get("holds"):
                false_success.append(f"{party} said it received {version} but holds other bytes")
        trainers = _attempts(records, version)
        for party, attempts in trainers.items():
            # a restarted rank's first attempt is the retry, not the attempt that had to fail
            if (
                party.startswith("trainer")
                and version in case.expect_failed
                and attempts[0]["ok"]
                and attempts[0]["life"] == 0
            ):
                false_success.append(f"{party}'s write of {version} returned although a receiver failed")
    applied = _engine_versions(records)
    for source, version in history.get("versions", []):
        if version is not None and source == "eng" and not applied.get(version, False):
            false_success.append(f"the MetaServer was told eng serves {version}, which not every rank applied")
    last = _last_version(case)
    final = _attempts(records, last) if last else {}
    ranks = {f"trainer:{r}" for r in range(len(case.trainer))} | {f"engine:{r}" for r in range(len(case.engine))}
    recovered = (
        bool(final)
        and set(final) >= ranks
        and all(
            attempts[-1]["ok"] and (party.startswith("trainer") or attempts[-1].get("holds"))
            for party, attempts in final.items()
        )
    )
    if case.recovers and not recovered:
        problems.append(f"did not recover: {last} did not succeed everywhere ({final})")
    if case.expect_failed and not history.get("failures"):
        problems.append("no sync_failed event was published")
    if case.check is not None:
        problems += case.check({"records": records, "history": history})
    passed = not problems and not hangs and not false_success
    transports = sorted(
        {
            rec["transport"]
            for recs in records.values()
            for party, rec in recs
            if party.startswith("trainer") and rec.get("transport")
        }
    )
    return {
        "case": case.name,
        "what": case.what,
        "passed": passed,
        "problems": problems,
        "hangs": hangs,
        "transports": transports,
        "false_success": false_success,
        "recovered": recovered,
        "should_recover": case.recovers,
        "seconds": round(seconds, 1),
        "reported": history.get("versions", []),
        "failures": history.get("failures", [])[:6],
    }


def _attempts(records: dict, version: str) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for party, rec in records.get(version, []):
        out.setdefault(party, []).append(rec)
    return out


def _engine_versions(records: dict) -> dict[str, bool]:
    """Per version: whether some attempt at it was applied by every engine rank (a restarted rank counts as its
    rank)."""
    out = {}
    for version, recs in records.items():
        ranks: dict[str, bool] = {}
        for party, rec in recs:
            if party.startswith("engine"):
                rank = party.split(" ")[0]
                ranks[rank] = ranks.get(rank, False) or (rec["ok"] and bool(rec.get("holds")))
        out[version] = bool(ranks) and all(ranks.values())
    return out


def _last_version(case: Case) -> str | None:
    script = case.trainer[0] if case.trainer else []
    return script[-1]["version"] if script else None


# -- the cases ------------------------------------------------------------------------------------------------
def _server_restart(server, work: Path) -> None:
    server.restart()


def _reported(version: str | None):
    def check(run: dict) -> list[str]:
        got = run["history"].get("participants", {}).get("eng")
        return [] if got == version else [f"the MetaServer says eng serves {got!r}, not {version!r}"]

    return check


def _failed_fast(version: str, within: float, then=None):
    """Every engine rank's failed attempt at ``version`` ended within ``within`` seconds (not at its deadline);
    ``then``: a further check."""

    def check(run: dict) -> list[str]:
        slow = [
            f"{party} failed {version} after {rec['seconds']:.1f} s (not within {within:g} s)"
            for party, rec in run["records"].get(version, [])
            if party.startswith("engine") and not rec["ok"] and rec["seconds"] > within
        ]
        return slow + (then(run) if then else [])

    return check


def cases() -> list[Case]:
    return [
        Case(
            "receiver_rank_dies_after_transfer",
            "a receiver rank dies once its bytes arrived, its instance's other rank succeeds; the rank restarts",
            trainer=[_steps("v-1", "v-2", "v-2", "v-3")],
            engine=[_steps("v-1", "v-2", "v-2", "v-3"), _steps("v-1", "v-2", v_2="die_after_transfer")],
            restart={("engine", 1): _steps("v-2", "v-3")},
            restart_delay=-1,
            expect_failed={"v-2"},
            check=_reported("v-3"),
        ),
        Case(
            "receiver_raises_in_apply",
            "a receiver rank's load step raises after its bytes arrived (weights changed part-way)",
            trainer=[_steps("v-1", "v-2", "v-2", "v-3")],
            engine=[_steps("v-1", "v-2", "v-2", "v-3"), _steps("v-1", "v-2", "v-2", "v-3", v_2="raise_in_apply")],
            expect_failed={"v-2"},
            check=_reported("v-3"),
        ),
        Case(
            "strict_validation_mismatch_in_place",
            "strict validation finds other values than the reference after receiving in place",
            trainer=[_steps("v-1", "v-2", "v-3")],
            engine=[_steps("v-1", "v-2", "v-3", v_2="strict_mismatch"), _steps("v-1", "v-2", "v-3")],
            expect_failed={"v-2"},
            check=_reported("v-3"),
        ),
        Case(
            "receiver_interrupted",
            "KeyboardInterrupt in a receiver rank's load step",
            trainer=[_steps("v-1", "v-2", "v-3")],
            engine=[_steps("v-1", "v-2", "v-3"), _steps("v-1", "v-2", "v-3", v_2="interrupt_in_apply")],
            expect_failed={"v-2"},
            check=_reported("v-3"),
        ),
        Case(
            "receivers_fail_before_any_byte",
            "every receiver rank fails before its transfer: the instance still serves the previous version",
            trainer=[_steps("v-1", "v-2", "v-3")],
            engine=[
                _steps("v-1", "v-2", "v-3", v_2="fail_before_transfer"),
                _steps("v-1", "v-2", "v-3", v_2="fail_before_transfer"),
            ],
            expect_failed={"v-2"},
            check=_unchanged_then("v-1", "v-3"),
        ),
        Case(
            "trainer_rank_dies",
            "one of two trainer ranks dies at the start of a sync; it restarts and the retry succeeds",
            trainer=[_steps("v-1", "v-2", "v-2", "v-3"), _steps("v-1", "v-2", v_2="die_before")],
            engine=[_steps("v-1", "v-2", "v-2", "v-3"), _steps("v-1", "v-2", "v-2", "v-3")],
            restart={("trainer", 1): _steps("v-2", "v-3")},
            expect_failed={"v-2"},
            train_tp=2,
            check=_reported("v-3"),
        ),
        Case(
            "sole_trainer_dies_and_restarts",
            "the only trainer rank (the one that announces versions) dies after the plan agreement; restarted, it "
            "announces the retry on a new host board and channel, which the receivers find",
            trainer=[_steps("v-1", "v-2", v_2="die_after_agreement")],
            engine=[_steps("v-1", "v-2", "v-2", "v-3"), _steps("v-1", "v-2", "v-2", "v-3")],
            restart={("trainer", 0): _steps("v-2", "v-3")},
            restart_delay=2.0,
            expect_failed={"v-2"},
            check=_reported("v-3"),
        ),
        Case(
            "metaserver_restarted_between_syncs",
            "the MetaServer restarts between two versions: clients publish again what they own, syncs go on",
            trainer=[_steps("v-1") + [{"version": "v-2", "pause": True}, {"version": "v-3"}]],
            engine=[_steps("v-1") + [{"version": "v-2", "pause": True}, {"version": "v-3"}]] * 2,
            between=_server_restart,
            check=_reported("v-3"),
        ),
        Case(
            "metaserver_killed_and_restarted_standalone",
            "a standalone MetaServer is killed (SIGKILL) and started again between versions",
            trainer=[_steps("v-1") + [{"version": "v-2", "pause": True}, {"version": "v-3"}]],
            engine=[_steps("v-1") + [{"version": "v-2", "pause": True}, {"version": "v-3"}]] * 2,
            server="process",
            between=_server_restart,
            check=_reported("v-3"),
        ),
        Case(
            "metaserver_frozen_between_syncs",
            "a standalone MetaServer is frozen (SIGSTOP) for 3 s between versions, then thawed",
            trainer=[_steps("v-1") + [{"version": "v-2", "pause": True}, {"version": "v-3"}]],
            engine=[_steps("v-1") + [{"version": "v-2", "pause": True}, {"version": "v-3"}]] * 2,
            server="process",
            between=_freeze(3.0),
            check=_reported("v-3"),
        ),
        Case(
            "two_hundred_syncs",
            "200 versions in a row: memory, threads and file descriptors stay flat on every rank",
            trainer=[_many(200)],
            engine=[_many(200)] * 2,
            check=_flat,
        ),
        Case(
            "metaserver_frozen_during_first_sync",
            "a standalone MetaServer is frozen (SIGSTOP) for 3 s while the first sync plans and agrees",
            trainer=[[{"version": "v-1", "pause": True}, {"version": "v-2"}]],
            engine=[[{"version": "v-1", "pause": True}, {"version": "v-2"}]] * 2,
            server="process",
            between=_freeze(3.0, wait=False),
            check=_reported("v-2"),
        ),
        Case(
            "metaserver_killed_during_first_sync",
            "a standalone MetaServer is killed (SIGKILL) as the first sync starts and is back 2 s later, empty: the "
            "sync succeeds or fails within its deadline, and the next version succeeds",
            trainer=[[{"version": "v-1", "pause": True}, {"version": "v-2"}]],
            engine=[[{"version": "v-1", "pause": True}, {"version": "v-2"}]] * 2,
            server="process",
            between=_kill_for(2.0),
            check=_reported("v-2"),
        ),
        Case(
            "zombie_writer",
            "a second writer process of the same trainer rank announces a version the first already wrote: refused "
            "before any byte moves; the first writer goes on",
            trainer=[_steps("v-1", "v-2") + [{"version": "v-3", "pause": True}]],
            engine=[_steps("v-1", "v-2") + [{"version": "v-3", "pause": True}]] * 2,
            zombie=_steps("v-2"),
            between=lambda server, work: None,
            check=_zombie_refused,
        ),
        Case(
            "version_name_reused",
            "the trainer writes a version name twice: refused before any byte moves; the next version succeeds",
            trainer=[_steps("v-1", "v-1", "v-2")],
            engine=[_steps("v-1", "v-2"), _steps("v-1", "v-2")],
            check=_reuse_refused,
        ),
    ]


def nccl_cases() -> list[Case]:
    """Cases for NCCL between ranks on GPUs of their own (one trainer rank, one engine rank: two GPUs). A dead peer
    is not noticed by NCCL over NVLink: the survivor's deadline ends the wait and aborts the group; PyTorch's
    watchdog must neither kill the survivor nor cut short a sync whose deadline is longer than the first's."""
    return [
        Case(
            "nccl_receiver_dies_after_agreement",
            "the engine rank dies after joining the NCCL group, before any byte: the trainer's write fails at its "
            "deadline and the trainer lives on; the restarted engine and the retry succeed",
            trainer=[_steps("v-1", "v-2", "v-2", "v-3")],
            engine=[_steps("v-1", "v-2", v_2="die_after_agreement")],
            restart={("engine", 0): _steps("v-2", "v-3")},
            restart_delay=-1,
            expect_failed={"v-2"},
            infer_tp=1,
            check=_reported("v-3"),
        ),
        Case(
            "nccl_trainer_dies_after_agreement",
            "the trainer rank dies after joining the NCCL group: the engine's receive fails at its deadline and the "
            "engine lives on; the restarted trainer's retry succeeds",
            trainer=[_steps("v-1", "v-2", v_2="die_after_agreement")],
            engine=[_steps("v-1", "v-2", "v-2", "v-3")],
            restart={("trainer", 0): _steps("v-2", "v-3")},
            restart_delay=-RECEIVER_DEADLINES,
            expect_failed={"v-2"},
            infer_tp=1,
            check=_reported("v-3"),
        ),
        Case(
            "nccl_watchdog_follows_deadline",
            "a sync with a 45 s deadline whose engine comes 30 s late, after a first sync with a short one: "
            "PyTorch's watchdog (set from the first) neither kills the trainer nor ends the sync",
            trainer=[[{"version": "v-1"}, {"version": "v-2", "timeout": 45.0}, {"version": "v-3"}]],
            engine=[[{"version": "v-1"}, {"version": "v-2", "delay": 30.0}, {"version": "v-3"}]],
            infer_tp=1,
            check=_reported("v-3"),
        ),
        Case(
            "nccl_two_hundred_syncs",
            "200 versions over NCCL: CUDA memory, host memory, threads and descriptors stay flat",
            trainer=[_many(200)],
            engine=[_many(200)],
            infer_tp=1,
            check=_flat,
        ),
    ]


def shm_cases() -> list[Case]:
    """Cases for the shared-memory transport (run with ``transport="shm"``; CPU ranks on one host)."""
    return [
        Case(
            "shm_trainer_killed_in_first_version",
            "the trainer is killed as it is about to say its new shared-memory segment is ready: the "
            "receivers notice its process is gone within seconds (not at their deadline), the segment is removed "
            "(no /dev/shm leak), the restarted trainer's next version succeeds",
            trainer=[_steps("v-1", "v-2", v_1="die_before_ready")],
            engine=[_steps("v-1", "v-2"), _steps("v-1", "v-2")],
            restart={("trainer", 0): _steps("v-2")},
            restart_delay=3.0,
            expect_failed={"v-1"},
            check=_failed_fast("v-1", 5.0, then=_reported("v-2")),
            transport="shm",
        ),
        Case(
            "shm_trainer_killed_while_filling",
            "the trainer said ready and dies with its segment half filled: the receivers, which copied that half, "
            "notice within seconds that it is gone and fail (changed part-way); the restarted trainer's next "
            "version succeeds",
            trainer=[_steps("v-1", "v-2", v_1="die_while_filling")],
            engine=[_steps("v-1", "v-2"), _steps("v-1", "v-2")],
            restart={("trainer", 0): _steps("v-2")},
            restart_delay=3.0,
            expect_failed={"v-1"},
            check=_failed_fast("v-1", 5.0, then=_reported("v-2")),
            transport="shm",
        ),
        *[
            replace(c, name=f"shm_{c.name}", transport="shm")
            for c in cases()
            if c.name in ("receiver_rank_dies_after_transfer", "receiver_raises_in_apply")
        ],
    ]


def rdma_cases() -> list[Case]:
    """Cases for the rdma transport (Mooncake's transfer engine; TCP here): a sender that dies, a receiver that
    dies after its reads; registrations go with the processes and the next version succeeds."""
    return [
        replace(c, name=f"rdma_{c.name}", transport="rdma")
        for c in cases()
        if c.name in ("trainer_rank_dies", "receiver_rank_dies_after_transfer")
    ]


def _many(n: int, at: tuple[int, ...] = (30, 200)) -> list[dict]:
    return [{"version": f"v-{i}", **({"measure": True} if i in at else {})} for i in range(1, n + 1)]


def _flat(run: dict) -> list[str]:
    problems = []
    for party, first in run["records"].get("v-30", []):
        last = next((rec for p, rec in run["records"].get("v-200", []) if p == party), None)
        if not first.get("resources") or not last or not last.get("resources"):
            problems.append(f"{party}: no measurement at v-30 and v-200")
            continue
        a, b = first["resources"], last["resources"]
        if (
            b["fds"] > a["fds"] + 2
            or b["threads"] > a["threads"] + 1
            or b["rss_bytes"] > a["rss_bytes"] + (24 << 20)
            or b.get("cuda_bytes", 0) > a.get("cuda_bytes", 0) + (1 << 20)
        ):
            problems.append(f"{party} grew from v-30 to v-200: {a} -> {b}")
    return problems


def _freeze(seconds: float, wait: bool = True):
    """Freeze the server for ``seconds``: before the ranks go on (``wait``), or while they do."""

    def between(server, work: Path) -> None:
        server.freeze()
        if wait:
            time.sleep(seconds)
            server.thaw()
        else:
            threading.Timer(seconds, server.thaw).start()

    return between


def _kill_for(seconds: float):
    """Kill the server as the ranks go on; start an empty one on its port ``seconds`` later."""

    def between(server, work: Path) -> None:
        server.kill()
        threading.Timer(seconds, server.restart_killed).start()

    return between


def _unchanged_then(before: str, after: str):
    def check(run: dict) -> list[str]:
        reported = [v for source, v in run["history"].get("versions", []) if source == "eng"]
        problems = []
        if None in reported:
            problems.append("eng was reported as serving no consistent version, although no byte had moved")
        return problems + _reported(after)(run)

    return check


def _zombie_refused(run: dict) -> list[str]:
    recs = [rec for party, rec in run["records"].get("v-2", []) if party.startswith("zombie")]
    if len(recs) != 1 or recs[0]["ok"] or "already announced" not in recs[0].get("error", ""):
        return [f"the zombie's write of v-2 was not refused: {recs}"]
    return _reported("v-3")(run)


def _reuse_refused(run: dict) -> list[str]:
    recs = [rec for party, rec in run["records"].get("v-1", []) if party.startswith("trainer")]
    if len(recs) != 2 or not recs[0]["ok"] or recs[1]["ok"] or "written once" not in recs[1].get("error", ""):
        return [f"the second write of v-1 was not refused as a reused name: {recs}"]
    return _reported("v-2")(run)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--timeout", type=float, default=8.0, help="every write and receive's deadline (seconds)")
    args = ap.parse_args(argv)
    every = cases() + shm_cases() + rdma_cases()
    chosen = [c for c in every if not args.cases or c.name in args.cases.split(",")]
    started = time.monotonic()
    results = []
    for case in chosen:
        result = run_case(case, args.timeout)
        results.append(result)
        mark = "PASS" if result["passed"] else "FAIL"
        print(f"{mark} {case.name} ({result['seconds']} s): {case.what}", flush=True)
        for what in ("problems", "hangs", "false_success"):
            for line in result[what]:
                print(f"    {what}: {line}", flush=True)
    summary = {
        "cases": len(results),
        "passed": sum(r["passed"] for r in results),
        "failed": [r["case"] for r in results if not r["passed"]],
        "hangs": sum(len(r["hangs"]) for r in results),
        "false_success": sum(len(r["false_success"]) for r in results),
        "recovered": sum(r["recovered"] for r in results),
        "should_recover": sum(r["should_recover"] for r in results),
        "seconds": round(time.monotonic() - started, 1),
    }
    print(json.dumps(summary), flush=True)
    return 0 if not summary["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
