"""The fault suite's cases (:func:`cases`, :func:`nccl_cases`; those of shared memory and rdma:
:mod:`awex_integration.faults.transport_cases`): each a
:class:`Case`, the scripts of its trainer and engine ranks, what it injects where, and what it must find. The
runner is :mod:`awex_integration.faults.fault_suite`."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from awex_integration.faults.fault_checks import (
    failed_fast,
    flat,
    refused_naming,
    reported,
    reuse_refused,
    reuse_refused_then,
    stale_writer_fenced,
    unchanged_then,
    written_at_once,
)

RECEIVER_DEADLINES = 3  # an engine's deadline, in trainer deadlines


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
    server: str = "embedded"  # "process": a standalone `awex-meta serve` the case may kill or stop; "etcd": two on etcd
    between: Callable[[Any, Path], None] | None = None  # run by the harness while ranks wait for "go" files
    train_tp: int = 1
    infer_tp: int = 2
    check: Callable[[dict], list[str]] | None = None  # extra checks of the run's record: problems found
    zombie: list[dict] | None = None  # a second trainer process (rank 0 of the same instance) started at "go"
    transport: str = "p2p"  # the writers' (gloo on CPU; run_case may override it)
    verify: bool = False  # the writers' verify mode
    zombie_instance: str = "trainer"  # the second trainer process's Awex instance


def _steps(*versions: str, **faults: str) -> list[dict]:
    """A script: these versions in order; ``v_2="fault"`` injects a fault into the first attempt at ``v-2``."""
    out, seen = [], set()
    for v in versions:
        fault = faults.get(v.replace("-", "_")) if v not in seen else None
        seen.add(v)
        out.append({"version": v, **({"fault": fault} if fault else {})})
    return out


def _server_restart(server, work: Path) -> None:
    server.restart()


def cases() -> list[Case]:
    out = _cases()
    stale = next(c for c in out if c.name == "stale_writer_fenced")
    return out + [
        replace(
            stale,
            name="stale_writer_fenced_across_restart",
            what="as stale_writer_fenced, with the MetaServer restarted (on its journal) after the frozen writer's "
            "v-2, before its replacement starts: the replacement's epoch follows the frozen writer's (not 1 again), "
            "so the frozen writer is still refused",
            between=_server_restart,
        ),
        Case(
            "name_reused_across_restarts",
            "the MetaServer restarts (on its journal) between versions, then the trainer dies and, restarted, writes "
            "v-1 again (applied, its records dropped): refused before any byte moves, as without a restart; the "
            "next version succeeds",
            trainer=[_steps("v-1", "v-2") + [{"version": "v-3", "pause": True, "fault": "die_before"}]],
            engine=[_steps("v-1", "v-2") + [{"version": "v-3", "pause": True}]] * 2,
            restart={("trainer", 0): _steps("v-1", "v-3")},
            between=_server_restart,
            check=reuse_refused_then("v-3", "already announced"),
        ),
        freed_parameter(),
    ]


def freed_parameter(server: str = "embedded") -> Case:
    """A trainer parameter offloaded and not loaded back (``untyped_storage().resize_(0)``) at v-2: the write is
    refused naming it before any byte moves (never a crash), the waiting engines learn it within seconds, and v-3
    goes once it is back."""
    return Case(
        "freed_parameter_refused" + ("" if server == "embedded" else f"_{server}"),
        "a trainer parameter freed in place (offloaded, not loaded back) at v-2: refused naming it before any byte "
        "moves, the engines told within seconds; v-3 goes once it is back"
        + ("" if server == "embedded" else " (two MetaServers on etcd)"),
        trainer=[_steps("v-1") + [{"version": "v-2", "fault": "free_param"}, {"version": "v-3"}]],
        engine=[_steps("v-1", "v-2", "v-3")] * 2,
        server=server,
        expect_failed={"v-2"},
        check=failed_fast("v-2", 5.0, then=refused_naming("v-2", "holds 0 bytes", then=reported("v-3"))),
    )


def _cases() -> list[Case]:
    return [
        Case(
            "receiver_rank_dies_after_transfer",
            "a receiver rank dies once its bytes arrived, its instance's other rank succeeds; the rank restarts",
            trainer=[_steps("v-1", "v-2", "v-2", "v-3")],
            engine=[_steps("v-1", "v-2", "v-2", "v-3"), _steps("v-1", "v-2", v_2="die_after_transfer")],
            restart={("engine", 1): _steps("v-2", "v-3")},
            restart_delay=2.0,  # the trainer notices the death on its host within a second and retries at once
            expect_failed={"v-2"},
            check=reported("v-3"),
        ),
        Case(
            "relay_peer_dies_mid_transfer",
            "the engine rank that forwards replicated tensors to the other (a relay, gloo) dies as it starts "
            "forwarding: the other rank fails within seconds, not at its deadline; the restarted rank and the retry "
            "succeed",
            trainer=[_steps("v-1", "v-2", "v-2", "v-3")],
            engine=[_steps("v-1", "v-2", v_2="die_relaying"), _steps("v-1", "v-2", "v-2", "v-3")],
            restart={("engine", 0): _steps("v-2", "v-3")},
            restart_delay=2.0,
            expect_failed={"v-2"},
            check=failed_fast("v-2", 5.0, then=reported("v-3")),
        ),
        Case(
            "receiver_raises_in_apply",
            "a receiver rank's load step raises after its bytes arrived (weights changed part-way)",
            trainer=[_steps("v-1", "v-2", "v-2", "v-3")],
            engine=[_steps("v-1", "v-2", "v-2", "v-3"), _steps("v-1", "v-2", "v-2", "v-3", v_2="raise_in_apply")],
            expect_failed={"v-2"},
            check=reported("v-3"),
        ),
        Case(
            "strict_validation_mismatch_in_place",
            "strict validation finds other values than the reference after receiving in place",
            trainer=[_steps("v-1", "v-2", "v-3")],
            engine=[_steps("v-1", "v-2", "v-3", v_2="strict_mismatch"), _steps("v-1", "v-2", "v-3")],
            expect_failed={"v-2"},
            check=reported("v-3"),
        ),
        Case(
            "receiver_interrupted",
            "KeyboardInterrupt in a receiver rank's load step",
            trainer=[_steps("v-1", "v-2", "v-3")],
            engine=[_steps("v-1", "v-2", "v-3"), _steps("v-1", "v-2", "v-3", v_2="interrupt_in_apply")],
            expect_failed={"v-2"},
            check=reported("v-3"),
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
            check=unchanged_then("v-1", "v-3"),
        ),
        Case(
            "receivers_time_out_before_the_version",
            "every receiver rank gives up waiting for a version its trainer has not written yet (a long training "
            "step); asked again, they take the trainer's steady write of it at once, not at its deadline",
            trainer=[[{"version": "v-1"}, {"version": "v-2", "delay": 3.0}, {"version": "v-3"}]],
            engine=[
                _steps("v-1", "v-2", "v-2", "v-3", v_2="time_out_waiting"),
                _steps("v-1", "v-2", "v-2", "v-3", v_2="time_out_waiting"),
            ],
            check=written_at_once("v-2", within=3.0 + 4.0, then=reported("v-3")),
        ),
        Case(
            "trainer_rank_dies",
            "one of two trainer ranks dies at the start of a sync; it restarts and the retry succeeds",
            trainer=[_steps("v-1", "v-2", "v-2", "v-3"), _steps("v-1", "v-2", v_2="die_before")],
            engine=[_steps("v-1", "v-2", "v-2", "v-3"), _steps("v-1", "v-2", "v-2", "v-3")],
            restart={("trainer", 1): _steps("v-2", "v-3")},
            expect_failed={"v-2"},
            train_tp=2,
            check=reported("v-3"),
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
            check=reported("v-3"),
        ),
        Case(
            "metaserver_restarted_between_syncs",
            "the MetaServer restarts between two versions: clients publish again what they own, syncs go on",
            trainer=[_steps("v-1") + [{"version": "v-2", "pause": True}, {"version": "v-3"}]],
            engine=[_steps("v-1") + [{"version": "v-2", "pause": True}, {"version": "v-3"}]] * 2,
            between=_server_restart,
            check=reported("v-3"),
        ),
        Case(
            "metaserver_killed_and_restarted_standalone",
            "a standalone MetaServer is killed (SIGKILL) and started again between versions",
            trainer=[_steps("v-1") + [{"version": "v-2", "pause": True}, {"version": "v-3"}]],
            engine=[_steps("v-1") + [{"version": "v-2", "pause": True}, {"version": "v-3"}]] * 2,
            server="process",
            between=_server_restart,
            check=reported("v-3"),
        ),
        Case(
            "metaserver_frozen_between_syncs",
            "a standalone MetaServer is frozen (SIGSTOP) for 3 s between versions, then thawed",
            trainer=[_steps("v-1") + [{"version": "v-2", "pause": True}, {"version": "v-3"}]],
            engine=[_steps("v-1") + [{"version": "v-2", "pause": True}, {"version": "v-3"}]] * 2,
            server="process",
            between=_freeze(3.0),
            check=reported("v-3"),
        ),
        Case(
            "two_hundred_syncs",
            "200 versions in a row: memory, threads and file descriptors stay flat on every rank",
            trainer=[_many(200)],
            engine=[_many(200)] * 2,
            check=flat,
        ),
        Case(
            "metaserver_frozen_during_first_sync",
            "a standalone MetaServer is frozen (SIGSTOP) for 3 s while the first sync plans and agrees",
            trainer=[[{"version": "v-1", "pause": True}, {"version": "v-2"}]],
            engine=[[{"version": "v-1", "pause": True}, {"version": "v-2"}]] * 2,
            server="process",
            between=_freeze(3.0, wait=False),
            check=reported("v-2"),
        ),
        Case(
            "metaserver_killed_during_first_sync",
            "a standalone MetaServer is killed (SIGKILL) as the first sync starts and is back 2 s later on its "
            "journal: the sync succeeds or fails within its deadline, and the next version succeeds",
            trainer=[[{"version": "v-1", "pause": True}, {"version": "v-2"}]],
            engine=[[{"version": "v-1", "pause": True}, {"version": "v-2"}]] * 2,
            server="process",
            between=_kill_for(2.0),
            check=reported("v-2"),
        ),
        Case(
            "stale_writer_fenced",
            "the trainer's writer freezes after v-2; a replacement of the same trainer rank starts and writes v-3; "
            "the frozen writer resumes and is refused (fenced) before any byte moves: it deletes, reports and "
            "announces nothing",
            trainer=[_steps("v-1", "v-2") + [{"version": "v-4", "pause": True, "until_writers": 2}]],
            engine=[_steps("v-1", "v-2") + [{"version": "v-3", "pause": True}]] * 2,
            zombie=_steps("v-3"),
            between=lambda server, work: None,
            recovers=False,
            check=stale_writer_fenced,
        ),
        Case(
            "corrupted_in_flight_verified",
            "verify mode: one bit of what a receiver rank gets is flipped as it lands, before the wave that brought "
            "it is digested (a transport or memory fault): its digest differs from the trainer's, the version fails "
            "on every side instead of counting as applied; the next version succeeds",
            trainer=[_steps("v-1", "v-2", "v-3")],
            engine=[_steps("v-1", "v-2", "v-3"), _steps("v-1", "v-2", "v-3", v_2="corrupt_after_transfer")],
            expect_failed={"v-2"},
            verify=True,
            check=reported("v-3"),
        ),
        Case(
            "version_name_reused",
            "the trainer writes a version name twice: refused before any byte moves; the next version succeeds",
            trainer=[_steps("v-1", "v-1", "v-2")],
            engine=[_steps("v-1", "v-2"), _steps("v-1", "v-2")],
            check=reuse_refused,
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
            check=reported("v-3"),
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
            check=reported("v-3"),
        ),
        Case(
            "nccl_watchdog_follows_deadline",
            "a sync with a 45 s deadline whose engine comes 30 s late, after a first sync with a short one: "
            "PyTorch's watchdog (set from the first) neither kills the trainer nor ends the sync",
            trainer=[[{"version": "v-1"}, {"version": "v-2", "timeout": 45.0}, {"version": "v-3"}]],
            engine=[[{"version": "v-1"}, {"version": "v-2", "delay": 30.0}, {"version": "v-3"}]],
            infer_tp=1,
            check=reported("v-3"),
        ),
        Case(
            "nccl_corrupted_in_flight_verified",
            "verify mode over NCCL: one bit of what the engine rank gets is flipped as a wave lands, before that wave "
            "is digested: the version fails on both sides instead of counting as applied; the next one succeeds",
            trainer=[_steps("v-1", "v-2", "v-3")],
            engine=[_steps("v-1", "v-2", "v-3", v_2="corrupt_after_transfer")],
            expect_failed={"v-2"},
            verify=True,
            infer_tp=1,
            check=reported("v-3"),
        ),
        Case(
            "nccl_two_hundred_syncs",
            "200 versions over NCCL: CUDA memory, host memory, threads and descriptors stay flat",
            trainer=[_many(200)],
            engine=[_many(200)],
            infer_tp=1,
            check=flat,
        ),
    ]


def _many(n: int, at: tuple[int, ...] = (30, 200)) -> list[dict]:
    return [{"version": f"v-{i}", **({"measure": True} if i in at else {})} for i in range(1, n + 1)]


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
