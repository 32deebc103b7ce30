"""The fault suite: real multi-process syncs on CPU (gloo or shared memory, a MetaServer) with faults injected,
checking what every party says against what happened. Every case also checks that no segment or host board of
its processes is left in /dev/shm.

    python -m awex_integration.faults.fault_suite [--cases NAME,...] [--timeout S]

Each case runs trainer and engine ranks in their own processes (``awex_integration.faults.fault_ranks``) through a
script of versions, kills, raises in or interrupts ranks at chosen points, restarts dead ranks and the MetaServer, and
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
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from awex_integration.faults import etcd_cases, fault_ranks
from awex_integration.faults.fault_cases import RECEIVER_DEADLINES, Case, cases
from awex_integration.faults.name_cases import name_cases
from awex_integration.faults.server_load import LoadCase, load_cases, run_load_case
from awex_integration.faults.servers import server_for
from awex_integration.faults.transport_cases import rdma_cases, shm_cases

LEVEL = "AWEX_LOGGING_LEVEL"  # awex.engines.logs.ENV: the ranks log warnings only, unless the caller says otherwise
SLACK = 5.0  # seconds a step may take beyond its deadline before it counts as a hang (process start-up included)


def run_on_server(case: LoadCase) -> dict:
    """A load case against a standalone server of its own."""
    server = server_for("process")
    try:
        result = run_load_case(case, server.address)
    finally:
        server.stop()
    for line in result["problems"]:
        print(f"    {case.name}: {line}", flush=True)
    print(f"    {case.name}: {json.dumps(result['measured'])}", flush=True)
    return result


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
    level = os.environ.get(LEVEL)
    os.environ[LEVEL] = level or "WARNING"  # the ranks' per-version INFO lines: not in the summary
    try:
        return _run_case(case, timeout, device, transport, work)
    finally:  # the ranks inherited it; the caller's process (a test session) keeps its own
        if level is None:
            os.environ.pop(LEVEL, None)
        shutil.rmtree(work, ignore_errors=True)


def _run_case(case: Case, timeout: float, device: str, transport: str | None, work: Path) -> dict:
    transport = transport or case.transport
    server = server_for(case.server)
    job_name = case.name.replace("_", "-")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs: dict[tuple[str, int, int], Any] = {}  # (role, rank, life) -> process

    def start(role: str, rank: int, script: list[dict], life: int) -> None:
        # an engine waits for the trainer (as vLLM's update call does): its deadline covers the trainer's
        trainer = role in ("trainer", "zombie")
        job = fault_ranks.RankJob(
            server.address,
            job_name,
            rank,
            case.train_tp,
            case.infer_tp,
            script,
            timeout if trainer else RECEIVER_DEADLINES * timeout,
            str(work),
            device,
            transport,
            verify=case.verify,
            trainer_instance=case.zombie_instance if role == "zombie" else "trainer",
        )
        fn, args = (fault_ranks.trainer_rank if trainer else fault_ranks.receiver_rank), (job,)
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--timeout", type=float, default=8.0, help="every write and receive's deadline (seconds)")
    args = ap.parse_args(argv)
    missing = etcd_cases.available()
    if missing:
        print(f"the etcd cases do not run: {missing}", flush=True)
    every = cases() + name_cases() + shm_cases() + rdma_cases() + ([] if missing else etcd_cases.etcd_cases())
    every += load_cases()
    chosen = [c for c in every if not args.cases or c.name in args.cases.split(",")]
    started = time.monotonic()
    results = []
    for case in chosen:
        result = run_case(case, args.timeout) if isinstance(case, Case) else run_on_server(case)
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
