"""``POST /v1/jobs/{job}/agree/{name}``: a participant contributes its value and waits until the expected number
did; the answer says whether all values were equal. Linear in the participants: distinct values are counted as they
arrive, waiters wake once (when the last value arrives), and an answer names at most :data:`SHOWN` distinct values
and their number.

With ``"gather": true`` (every participant of one name alike) the complete answer also carries every participant's
value (``"values": {participant: value}``): one request per participant where each would otherwise read every
other's record (the ranks' device exchange). Its body is encoded once, when the last value arrives, and sent to
every participant as it is."""

from __future__ import annotations

from typing import Any, Protocol

from aiohttp import web

from awex.meta.server.config import ServerConfig
from awex.meta.server.errors import BadRequest, error, fields
from awex.meta.server.parking import Parking
from awex.meta.server.state import Agreement, JobState

SHOWN = 8  # distinct values an answer lists (the client names a few in its error)


class Server(Protocol):
    """What an agreement needs of the server (``awex.meta.server.app.MetaServerApp``)."""

    config: ServerConfig
    parking: Parking

    def key_of(self, request: web.Request, name: str = "key") -> str: ...
    async def body_json(self, request: web.Request) -> tuple[bytes, Any]: ...
    def job_of(self, request: web.Request, create: bool = True) -> JobState | None: ...
    def charge(self, job: JobState, grow: int) -> None: ...
    def small(self, value: Any, what: str) -> int: ...
    def wait_of(self, request: web.Request) -> float: ...


async def agree(server: Server, request: web.Request) -> web.Response:
    name = server.key_of(request)
    _, doc = await server.body_json(request)
    f = fields(doc, {"participant": str, "expected": int, "value": object, "gather": bool}, ("gather",))
    gather = f.get("gather", False)
    config = server.config
    if not 1 <= f["expected"] <= config.max_agreement_size:
        raise BadRequest(f"expected must be 1 to {config.max_agreement_size}")
    participant = f["participant"]
    if len(participant) > 256:
        raise BadRequest("participant names are at most 256 characters")
    size = server.small(f["value"], "an agreement value") + len(participant)
    job = server.job_of(request)
    a = job.agreements.get(name)
    if a is None:
        if len(job.agreements) >= config.max_agreements_per_job:
            raise BadRequest(
                f"too many agreements in job {job.name!r} "
                f"(limit {config.max_agreements_per_job}; writers forget old versions')"
            )
        server.charge(job, len(name))
        a = job.agreements[name] = Agreement(f["expected"], gather=gather)
        job.add_agreement_bytes(a, len(name))
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
        job.topics, f"agree:{name}", lambda: a.complete, server.wait_of(request), request.remote or ""
    )
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
