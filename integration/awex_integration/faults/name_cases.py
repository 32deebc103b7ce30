"""Fault cases on version names across a MetaServer restart: a name once applied is never written again, neither by
a writer whose report of it was lost and that was then replaced, nor by another trainer instance. Each on the
embedded MetaServer (restarted on its journal) and on two MetaServers on etcd (the leader killed)."""

from __future__ import annotations

from awex_integration.faults.fault_cases import Case, _server_restart, _steps
from awex_integration.faults.fault_checks import failed_fast, refused_naming, reported


def refused_again(version: str, party: str, why: str, then=None):
    """``party``'s last write of ``version`` was refused saying ``why``, every earlier one succeeded; ``then``: a
    further check."""

    def check(run: dict) -> list[str]:
        recs = [rec for p, rec in run["records"].get(version, []) if p.startswith(party)]
        if not recs or recs[-1]["ok"] or why not in recs[-1].get("error", "") or not all(r["ok"] for r in recs[:-1]):
            return [f"{party}'s last write of {version} was not refused saying {why!r}: {recs}"]
        return then(run) if then else []

    return check


def name_cases(server: str = "embedded") -> list[Case]:
    suffix, where = ("", "") if server == "embedded" else (f"_{server}", " (two MetaServers on etcd)")
    return [
        Case(
            "report_lost_then_name_reused" + suffix,
            "the trainer's report that v-2 was applied never arrives; the MetaServer restarts, the trainer dies and, "
            "restarted, writes v-2 again: refused before any byte moves (the engines hold v-2 of the writer it "
            "replaced); v-3 is served" + where,
            trainer=[
                _steps("v-1")
                + [{"version": "v-2", "fault": "lose_report"}, {"version": "v-3", "pause": True, "fault": "die_before"}]
            ],
            engine=[_steps("v-1", "v-2") + [{"version": "v-3", "pause": True}]] * 2,
            restart={("trainer", 0): _steps("v-2", "v-3")},
            server=server,
            between=_server_restart,
            check=refused_again("v-2", "trainer", "written once", then=reported("v-3")),
        ),
        Case(
            "wrong_address_said_then_served" + suffix,
            "the trainer's first writer is given a MetaServer address where nothing listens: it fails within "
            "seconds saying the address was never reached, the trainer restarts with the right one, and v-1 and "
            "v-2 are served" + where,
            trainer=[[{"version": "v-1", "fault": "wrong_address"}]],
            engine=[_steps("v-1", "v-2")] * 2,
            restart={("trainer", 0): _steps("v-1", "v-2")},
            server=server,  # (no event: the MetaServer was never reached)
            check=failed_fast("v-1", 7.0, side="trainer", then=refused_naming("v-1", "never reached", reported("v-2"))),
        ),
        Case(
            "name_reused_by_another_instance" + suffix,
            "the MetaServer restarts, then a second trainer instance writes v-1, which the first applied: refused "
            "before any byte moves; the first instance's v-3 is served" + where,
            trainer=[_steps("v-1", "v-2") + [{"version": "v-3", "pause": True}]],
            engine=[_steps("v-1", "v-2") + [{"version": "v-3", "pause": True}]] * 2,
            zombie=_steps("v-1"),
            zombie_instance="trainer-b",
            server=server,
            between=_server_restart,
            check=refused_again("v-1", "zombie", "already announced", then=reported("v-3")),
        ),
    ]
