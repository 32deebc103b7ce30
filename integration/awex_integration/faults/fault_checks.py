"""What the fault suite's cases must find in a run's record (``run``: the ranks' records per version, the
MetaServer's history): each check returns the problems it found, none when the case passed."""

from __future__ import annotations


def reported(version: str | None):
    def check(run: dict) -> list[str]:
        got = run["history"].get("participants", {}).get("eng")
        return [] if got == version else [f"the MetaServer says eng serves {got!r}, not {version!r}"]

    return check


def failed_fast(version: str, within: float, then=None, side: str = "engine"):
    """Every failed attempt at ``version`` of a rank on ``side`` ended within ``within`` seconds (not at its
    deadline), and there was one; ``then``: a further check."""

    def check(run: dict) -> list[str]:
        failed = [(p, rec) for p, rec in run["records"].get(version, []) if p.startswith(side) and not rec["ok"]]
        slow = [
            f"{party} failed {version} after {rec['seconds']:.1f} s (not within {within:g} s)"
            for party, rec in failed
            if rec["seconds"] > within
        ]
        none = [] if failed else [f"no {side} rank's attempt at {version} failed"]
        return none + slow + (then(run) if then else [])

    return check


def written_at_once(version: str, within: float, then=None):
    """Every trainer rank's first write of ``version`` succeeded within ``within`` seconds; ``then``: a further
    check."""

    def check(run: dict) -> list[str]:
        late = [
            f"{party}'s write of {version}: ok={rec['ok']} after {rec['seconds']:.1f} s (want ok within {within:g} s)"
            for party, rec in run["records"].get(version, [])
            if party.startswith("trainer") and not (rec["ok"] and rec["seconds"] <= within)
        ]
        return late + (then(run) if then else [])

    return check


def flat(run: dict) -> list[str]:
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


def unchanged_then(before: str, after: str):
    def check(run: dict) -> list[str]:
        said = [v for source, v in run["history"].get("versions", []) if source == "eng"]
        problems = []
        if None in said:
            problems.append("eng was reported as serving no consistent version, although no byte had moved")
        return problems + reported(after)(run)

    return check


def stale_writer_fenced(run: dict) -> list[str]:
    problems = []
    stale = [rec for party, rec in run["records"].get("v-4", []) if party.startswith("trainer")]
    if len(stale) != 1 or stale[0]["ok"] or "replaced by a newer one" not in stale[0].get("error", ""):
        problems.append(f"the frozen writer's v-4 was not refused as fenced: {stale}")
    got = {party: rec["ok"] and rec.get("holds", True) for party, rec in run["records"].get("v-3", [])}
    if len(got) != 3 or not all(got.values()):  # the replacement and both engine ranks
        problems.append(f"the replacement's v-3 did not reach every engine rank: {got}")
    return problems + reported("v-3")(run)


def reuse_refused(run: dict) -> list[str]:
    return reuse_refused_then("v-2", "written once")(run)


def reuse_refused_then(after: str, why: str):
    """The trainer's second write of v-1 was refused (its error says ``why``), and ``after`` is served."""

    def check(run: dict) -> list[str]:
        recs = [rec for party, rec in run["records"].get("v-1", []) if party.startswith("trainer")]
        if len(recs) != 2 or not recs[0]["ok"] or recs[1]["ok"] or why not in recs[1].get("error", ""):
            return [f"the second write of v-1 was not refused as a reused name: {recs}"]
        return reported(after)(run)

    return check


def refused_naming(version: str, why: str, then=None):
    """The trainer's write of ``version`` failed saying ``why``; ``then``: a further check."""

    def check(run: dict) -> list[str]:
        recs = [rec for party, rec in run["records"].get(version, []) if party.startswith("trainer")]
        if not recs or recs[0]["ok"] or why not in recs[0].get("error", ""):
            return [f"the trainer's write of {version} was not refused saying {why!r}: {recs}"]
        return then(run) if then else []

    return check
