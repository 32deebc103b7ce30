"""Fault cases on a MetaServer pair on etcd (``faults.servers.EtcdServers``: two ``awex-meta serve --store
etcd://...`` processes on a local etcd cluster of three, one leading): the leader killed or frozen mid-run, a
replaced writer across the hand-over, an etcd member lost. The ranks get both servers' addresses. Each needs an
etcd binary (:func:`available`)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from awex_integration.faults.fault_cases import Case, _cases, _freeze, _server_restart, _steps, freed_parameter
from awex_integration.faults.fault_checks import reported, reuse_refused_then
from awex_integration.faults.name_cases import name_cases


def available() -> str | None:
    """Why these cases cannot run here, or ``None``."""
    from awex.meta.server.etcd_local import ETCD, MISSING

    return None if ETCD else MISSING


def _kill_leader(server, work: Path) -> None:
    server.kill()  # as the ranks go on: the standby takes the lead once the dead leader's lease ends


def _lose_member(server, work: Path) -> None:
    server.lose_member(0)


def _all_first_time(*versions: str):
    """Every party's every attempt at ``versions`` succeeded (none failed and was retried)."""

    def check(run: dict) -> list[str]:
        return [
            f"{party}'s attempt at {version} failed: {rec.get('error', '')[:300]}"
            for version in versions
            for party, rec in run["records"].get(version, [])
            if not rec["ok"]
        ] + reported(versions[-1])(run)

    return check


def etcd_cases() -> list[Case]:
    stale = next(c for c in _cases() if c.name == "stale_writer_fenced")
    relay = next(c for c in _cases() if c.name == "relay_peer_dies_mid_transfer")
    two = [_steps("v-1") + [{"version": "v-2", "pause": True}, {"version": "v-3"}]]
    first = [[{"version": "v-1", "pause": True}, {"version": "v-2"}]]
    return name_cases("etcd") + [
        freed_parameter("etcd"),
        replace(
            relay,
            name="relay_peer_dies_mid_transfer_etcd",
            what=relay.what + " (two MetaServers on etcd)",
            server="etcd",
        ),
        Case(
            "etcd_leader_killed_during_first_sync",
            "the leading MetaServer of two on etcd is killed (SIGKILL) as the first sync starts; the other takes the "
            "lead within its lease: the sync succeeds or fails within its deadline, and the next version succeeds",
            trainer=first,
            engine=first * 2,
            server="etcd",
            between=_kill_leader,
            check=reported("v-2"),
        ),
        Case(
            "etcd_leader_frozen_between_syncs",
            "the leading MetaServer is frozen (SIGSTOP) for 3 s, past its 2-s lease, between versions: the other "
            "takes the lead; thawed, the frozen one answers nothing and stops; the next version succeeds",
            trainer=two,
            engine=two * 2,
            server="etcd",
            between=_freeze(3.0),
            check=reported("v-3"),
        ),
        replace(
            stale,
            name="etcd_stale_writer_fenced_across_failover",
            what="as stale_writer_fenced, with the leading MetaServer killed after the frozen writer's v-2 and "
            "another leading from etcd: the replacement's epoch follows the frozen writer's, which stays refused",
            server="etcd",
            between=_server_restart,
        ),
        Case(
            "etcd_name_reused_across_failover",
            "the leading MetaServer is killed between versions, then the trainer dies and, restarted, writes v-1 "
            "again (applied): refused by the new leader before any byte moves; the next version succeeds",
            trainer=[_steps("v-1", "v-2") + [{"version": "v-3", "pause": True, "fault": "die_before"}]],
            engine=[_steps("v-1", "v-2") + [{"version": "v-3", "pause": True}]] * 2,
            restart={("trainer", 0): _steps("v-1", "v-3")},
            server="etcd",
            between=_server_restart,
            check=reuse_refused_then("v-3", "already announced"),
        ),
        Case(
            "etcd_member_lost_between_syncs",
            "one etcd member of three is killed between versions (the one the servers ask first): every later "
            "version succeeds at its first attempt",
            trainer=two,
            engine=two * 2,
            server="etcd",
            between=_lose_member,
            check=_all_first_time("v-2", "v-3"),
        ),
    ]
