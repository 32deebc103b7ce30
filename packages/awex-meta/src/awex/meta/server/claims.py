"""Claimed names: a key created with ``create=1`` (a version's manifest, as writers announce it) is claimed for good.
It is never created again, whether its value was forgotten or the server restarted (with a journal); only the writer
identity that claimed it may write it again (a newer writer of that identity taking over an unfinished attempt), and
not even that one once a version under the name was reported applied (``report_version`` naming the claim). The
claimant releases a claim whose attempt failed (``forget`` with ``release``), so that a retry may claim it anew.
"""

from __future__ import annotations

from aiohttp import web

from awex.meta.server.errors import error
from awex.meta.server.journal import Claim
from awex.meta.server.state import JobState


def same_writer(claimed_by: str | None, fence: str | None) -> bool:
    """Whether a request fenced by ``fence`` comes from the writer identity that holds a claim (the fence itself
    decided already that it is that identity's newest writer)."""
    return claimed_by is None or (fence is not None and fence.partition(":")[2] == claimed_by.partition(":")[2])


def refusal(job: JobState, key: str, create: bool, fence: str | None) -> web.Response | None:
    """The answer to a put ``key`` may not make, or ``None``."""
    claim = job.claims.get(key)
    if create:
        if key in job.kv or claim is not None:
            return error(409, "exists", f"key {key!r} already exists" + ("" if key in job.kv else " (claimed)"))
    elif claim is not None and claim.applied:
        return error(409, "exists", f"key {key!r} names a version that was applied: it is never written again")
    elif claim is not None and not same_writer(claim.by, fence):
        return error(409, "exists", f"key {key!r} was claimed by another writer ({claim.by})")
    return None


def record(job: JobState, key: str, create: bool, fence: str | None) -> None:
    """After :func:`refusal` let a put through: a created key is claimed; a claimed one written again (taken over)
    is held by the writer that wrote it."""
    if create or key in job.claims:
        job.note("claim", key=key, by=fence, applied=False)
        job.claims[key] = Claim(fence)


def release(job: JobState, keys: list[str], fence: str | None) -> None:
    """Release the claims on ``keys`` that the request's writer holds and that were never applied."""
    for key in keys:
        claim = job.claims.get(key)
        if claim is not None and not claim.applied and same_writer(claim.by, fence):
            job.note("release", key=key)
            del job.claims[key]


def applied_notes(job: JobState, keys: list[str]) -> list[tuple[str, dict]]:
    """The journal's records saying versions written under ``keys`` were applied (those claimed and not applied
    yet): journalled by the caller before :func:`mark_applied`."""
    held = [(k, job.claims.get(k)) for k in keys]
    return [("claim", {"key": k, "by": c.by, "applied": True}) for k, c in held if c is not None and not c.applied]


def mark_applied(job: JobState, keys: list[str]) -> None:
    """Versions written under ``keys`` were applied (:func:`applied_notes` journalled): the names are never written
    again."""
    for key in keys:
        claim = job.claims.get(key)
        if claim is not None:
            claim.applied = True
