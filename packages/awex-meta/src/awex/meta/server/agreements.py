"""``POST /v1/jobs/{job}/agree/{name}``: a participant contributes its value and waits until the expected number
did; the answer says whether all values were equal. Linear in the participants: distinct values are counted as they
arrive, waiters wake once (when the last value arrives), and an answer names at most :data:`SHOWN` distinct values
and their number.

A participant that cannot contribute (it failed first) may abort the agreement (``{"participant", "abort":
cause}``): every participant is answered at once with the cause and who gave it, instead of at its deadline.

With ``"gather": true`` (every participant of one name alike) the complete answer also carries every participant's
value (``"values": {participant: value}``): one request per participant where each would otherwise read every
other's record (the ranks' device exchange). Its body is encoded once, when the last value arrives, and sent to
every participant as it is."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from awex.meta.server.errors import BadRequest, error, fields
from awex.meta.server.routes import Server
from awex.meta.server.state import Agreement, JobState

SHOWN = 8  # distinct values an answer lists (the client names a few in its error)


async def agree(server: Server, request: web.Request) -> web.Response:
    name = server.key_of(request)
    _, doc = await server.body_json(request)
    if isinstance(doc, dict) and "abort" in doc:
        return _abort(server, request, name, doc)
    f = fields(doc, {"participant": str, "expected": int, "value": object, "gather": bool}, ("gather",))
    gather = f.get("gather", False)
    config = server.config
    if not 1 <= f["expected"] <= config.max_agreement_size:
        raise BadRequest(f"expected must be 1 to {config.max_agreement_size}")
    participant = _participant(f["participant"])
    size = server.small(f["value"], "an agreement value") + len(participant)
    job = server.job_of(request)
    a = job.agreements.get(name)
    if a is None:
        _room(server, job)
        server.charge(job, len(name))
        a = job.agreements[name] = Agreement(f["expected"], gather=gather)
        job.add_agreement_bytes(a, len(name))
    if a.aborted is not None:
        return web.json_response(a.answer())
    if a.expected != f["expected"]:
        return error(409, "conflict", f"agreement {name!r} expects {a.expected} participants, not {f['expected']}")
    if a.gather != gather:
        return error(409, "conflict", f"agreement {name!r} is {'' if a.gather else 'not '}a gather")
    if a.complete and participant in a.values and not a.holds(participant, f["value"]):
        return error(409, "conflict", f"agreement {name!r} is complete: {participant!r}'s value is final")
    if participant not in a.values:
        if a.complete:
            return error(
                409,
                "conflict",
                f"agreement {name!r} already has its {a.expected} participants; {participant!r} is not one of them",
            )
        server.charge(job, size)
        job.add_agreement_bytes(a, size)
    a.give(participant, f["value"])
    if a.complete:
        job.topics.fire(f"agree:{name}")
    await server.parking.wait_until(
        job.topics, f"agree:{name}", lambda: a.complete or a.aborted is not None, server.wait_of(request),
        request.remote or "",
    )  # fmt: skip
    if a.aborted is not None:
        return web.json_response(a.answer())
    done = a.complete
    if done and a.gather:
        return web.Response(body=a.gathered(), content_type="application/json")
    return web.json_response(
        {
            "complete": done,
            "arrived": len(a.values),
            "expected": a.expected,
            "distinct": len(a.counts) if done else 0,
            "distinct_values": list(a.first.values())[:SHOWN] if done else [],
        }
    )


def _abort(server: Server, request: web.Request, name: str, doc: Any) -> web.Response:
    """``{"participant", "abort": cause}``: give agreement ``name`` up (a participant failed before it could
    contribute): every participant waiting, and every one that comes, is answered at once with the cause, instead of
    waiting out its deadline. A complete agreement is final: the abort changes nothing there."""
    f = fields(doc, {"participant": str, "abort": str})
    participant = _participant(f["participant"])
    job = server.job_of(request)
    a = job.agreements.get(name)
    if a is not None and a.complete:
        return web.json_response({"ok": True, "aborted": False})
    if a is None or a.aborted is None:
        aborted = (participant, f["abort"][:2000])
        grow = len(aborted[0]) + len(aborted[1]) + (len(name) if a is None else 0)
        if a is None:
            _room(server, job)
        server.charge(job, grow)  # before anything changes: the agreement is created only where it fits
        if a is None:  # aborted before anyone contributed: later contributions are answered with the cause
            a = job.agreements[name] = Agreement(0)
        a.aborted = aborted
        job.add_agreement_bytes(a, grow)
        job.topics.fire(f"agree:{name}")
    return web.json_response({"ok": True, "aborted": True})


def _participant(name: str) -> str:
    if len(name) > 256:
        raise BadRequest("participant names are at most 256 characters")
    return name


def _room(server: Server, job: JobState) -> None:
    """Refuse a new agreement beyond the job's limit."""
    limit = server.config.max_agreements_per_job
    if len(job.agreements) >= limit:
        raise BadRequest(f"too many agreements in job {job.name!r} (limit {limit}; writers forget old versions')")
