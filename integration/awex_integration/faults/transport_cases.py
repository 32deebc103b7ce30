"""The fault suite's cases of the pull transports (:func:`shm_cases`, :func:`rdma_cases`): :class:`Case` records
as :mod:`awex_integration.faults.fault_cases` makes them, run with the transport they name."""

from __future__ import annotations

from dataclasses import replace

from awex_integration.faults.fault_cases import Case, _steps, cases
from awex_integration.faults.fault_checks import failed_fast, reported, unchanged_then


def _killed_in_v1(name: str, what: str, fault: str) -> Case:
    """The trainer (over shared memory) dies at ``fault`` in its first version and is restarted 3 s later: both
    engine ranks fail ``v-1`` within seconds, and ``v-2`` goes."""
    return Case(
        name,
        what,
        trainer=[_steps("v-1", "v-2", v_1=fault)],
        engine=[_steps("v-1", "v-2") for _ in range(2)],
        restart={("trainer", 0): _steps("v-2")},
        restart_delay=3.0,
        expect_failed={"v-1"},
        check=failed_fast("v-1", 5.0, then=reported("v-2")),
        transport="shm",
    )


def shm_cases() -> list[Case]:
    """Cases for the shared-memory transport (run with ``transport="shm"``; CPU ranks on one host)."""
    return [
        _killed_in_v1(
            "shm_trainer_killed_in_first_version",
            "the trainer is killed as it is about to say its new shared-memory segment is ready: the "
            "receivers notice its process is gone within seconds (not at their deadline), the segment is removed "
            "(no /dev/shm leak), the restarted trainer's next version succeeds",
            "die_before_ready",
        ),
        _killed_in_v1(
            "shm_trainer_killed_while_filling",
            "the trainer said ready and dies with its segment half filled: the receivers, which copied that half, "
            "notice within seconds that it is gone and fail (changed part-way); the restarted trainer's next "
            "version succeeds",
            "die_while_filling",
        ),
        Case(
            "shm_trainer_fails_before_ready",
            "the trainer's refresh raises once the version is announced, before its bytes are ready (its process runs "
            "on): the receivers fail within seconds naming it, nothing moved into them (the instance still serves the "
            "last version), the trainer's write fails as soon; the retry succeeds",
            trainer=[_steps("v-1", "v-2", "v-2", "v-3", v_2="raise_before_ready")],
            engine=[_steps("v-1", "v-2", "v-2", "v-3"), _steps("v-1", "v-2", "v-2", "v-3")],
            expect_failed={"v-2"},
            check=failed_fast(
                "v-2", 5.0, then=failed_fast("v-2", 5.0, side="trainer", then=unchanged_then("v-1", "v-3"))
            ),
            transport="shm",
        ),
        Case(
            "shm_segment_altered_verified",
            "verify mode over shared memory: a byte of the trainer's filled segment is altered before the receivers "
            "copy it: their digests differ from the trainer's, the version fails instead of counting as applied; the "
            "next version succeeds",
            trainer=[_steps("v-1", "v-2", "v-3", v_2="alter_segment")],
            engine=[_steps("v-1", "v-2", "v-3"), _steps("v-1", "v-2", "v-3")],
            expect_failed={"v-2"},
            verify=True,
            check=reported("v-3"),
            transport="shm",
        ),
        Case(
            "shm_receiver_dies_before_reading",
            "an engine rank on the trainer's host dies after the plan agreement, before it reads the segment: the "
            "trainer's write fails within seconds (that process is gone), not at its deadline; the restarted rank "
            "and the retry succeed",
            trainer=[_steps("v-1", "v-2", "v-2", "v-3")],
            engine=[_steps("v-1", "v-2", "v-2", "v-3"), _steps("v-1", "v-2", v_2="die_after_agreement")],
            restart={("engine", 1): _steps("v-2", "v-3")},
            restart_delay=2.0,
            expect_failed={"v-2"},
            check=failed_fast("v-2", 5.0, then=reported("v-3"), side="trainer"),
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
