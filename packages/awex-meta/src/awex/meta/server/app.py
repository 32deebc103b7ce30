"""HTTP routes of the MetaServer (JSON in, JSON out; nothing received is ever executed or unpickled).

All routes live under ``/v1``. ``GET /v1/health`` is open; everything else needs ``Authorization: Bearer
<token>`` when the server has a token. Waits are long-polls: ``?wait=SECONDS`` (capped by the server) parks the
request until the thing appears or the wait ends (then 404 / an empty list, and the client decides whether
its own deadline has passed).

=======================================================  ==================================================
route                                                    what it does
=======================================================  ==================================================
``GET /v1/health``                                       liveness, server version
``GET /v1/status``                                       every job: participants, versions, recent events
``PUT /v1/jobs/{job}/kv/{key}[?create=1]``               store a JSON value (``create=1``: 409 if present)
``GET /v1/jobs/{job}/kv/{key}[?wait=S]``                 fetch a value, waiting up to S seconds
``DELETE /v1/jobs/{job}/kv/{key}``                       delete a value
``GET /v1/jobs/{job}/keys[?prefix=P]``                   list keys
``POST /v1/jobs/{job}/participants``                     register a participant (name, role, instance...)
``POST /v1/jobs/{job}/participants/{name}/version``      report the weight version a participant serves
``POST /v1/jobs/{job}/events``                           publish an event (kind, source, version, data)
``GET /v1/jobs/{job}/events?after=N[&wait=S][&kind=K]``  events after sequence number N
``POST /v1/jobs/{job}/agree/{name}``                     contribute a value; wait until all arrived
=======================================================  ==================================================
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from awex.meta.server.state import Agreement, JobState, Participant

log = logging.getLogger("awex.meta.server")

_NAME = re.compile(r"^[A-Za-z0-9_.:@-]{1,128}$")
_KEY = re.compile(r"^[A-Za-z0-9_.:@/-]{1,512}$")
SERVER_VERSION = "1"


@dataclass(frozen=True)
class ServerConfig:
    """Limits and security settings of a MetaServer."""

    token: str | None = None
    max_payload_bytes: int = 64 << 20
    max_wait_seconds: float = 60.0
    max_keys_per_job: int = 100_000
    max_jobs: int = 1_000
    max_events_per_job: int = 10_000
    recent_events: int = 20


def _error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": code, "message": message}, status=status)


def make_app(config: ServerConfig | None = None) -> web.Application:
    """Build the aiohttp application (used by the embedded and the standalone server, and by tests)."""
    config = config or ServerConfig()
    jobs: dict[str, JobState] = {}

    @web.middleware
    async def auth_and_errors(request: web.Request, handler):
        if config.token and request.path != "/v1/health":
            header = request.headers.get("Authorization", "")
            given = header[7:] if header.startswith("Bearer ") else ""
            if not hmac.compare_digest(given.encode(), config.token.encode()):
                return _error(401, "unauthorized", "missing or wrong token (Authorization: Bearer <token>)")
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge:
            return _error(413, "too_large", f"payload exceeds {config.max_payload_bytes} bytes")
        except web.HTTPException:
            raise
        except _BadRequest as e:
            return _error(400, "bad_request", str(e))

    app = web.Application(client_max_size=config.max_payload_bytes, middlewares=[auth_and_errors])

    def job_of(request: web.Request, create: bool = True) -> JobState:
        name = request.match_info["job"]
        if not _NAME.match(name):
            raise _BadRequest(f"bad job name {name!r} (letters, digits, _.:@- ; at most 128)")
        job = jobs.get(name)
        if job is None:
            if not create:
                raise _BadRequest(f"unknown job {name!r}")
            if len(jobs) >= config.max_jobs:
                raise _BadRequest(f"too many jobs (limit {config.max_jobs})")
            job = jobs[name] = JobState(name, config.max_events_per_job, config.max_keys_per_job)
        return job

    def key_of(request: web.Request) -> str:
        key = request.match_info["key"]
        if not _KEY.match(key) or ".." in key.split("/"):
            raise _BadRequest(f"bad key {key!r} (letters, digits, _.:@/- ; at most 512)")
        return key

    def wait_of(request: web.Request) -> float:
        try:
            wait = float(request.query.get("wait", "0"))
        except ValueError:
            raise _BadRequest("wait must be a number of seconds") from None
        if wait != wait or wait < 0:
            raise _BadRequest("wait must be a non-negative number of seconds")
        return min(wait, config.max_wait_seconds)

    async def body_json(request: web.Request) -> tuple[bytes, Any]:
        raw = await request.read()
        try:
            return raw, json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise _BadRequest(f"body is not valid JSON: {e}") from None

    def fields(doc: Any, spec: dict[str, type | tuple[type, ...]], optional: tuple[str, ...] = ()) -> dict[str, Any]:
        if not isinstance(doc, dict):
            raise _BadRequest("body must be a JSON object")
        out = {}
        for name, typ in spec.items():
            if name not in doc:
                if name in optional:
                    continue
                raise _BadRequest(f"missing field {name!r}")
            value = doc[name]
            if isinstance(value, bool) and typ is int or not isinstance(value, typ):
                raise _BadRequest(f"field {name!r} has the wrong type")
            out[name] = value
        return out

    # -- routes ----------------------------------------------------------------------------------------
    async def health(request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "server": "awex-meta", "version": SERVER_VERSION,
                                  "auth": bool(config.token)})

    async def status(request: web.Request) -> web.Response:
        return web.json_response({"server": "awex-meta", "version": SERVER_VERSION, "time": time.time(),
                                  "jobs": {n: j.summary(config.recent_events) for n, j in sorted(jobs.items())}})

    async def put_value(request: web.Request) -> web.Response:
        job = job_of(request)
        key = key_of(request)
        raw, _ = await body_json(request)
        if request.query.get("create") == "1" and key in job.kv:
            return _error(409, "exists", f"key {key!r} already exists")
        if key not in job.kv and len(job.kv) >= job.max_keys:
            raise _BadRequest(f"too many keys in job {job.name!r} (limit {job.max_keys})")
        job.kv_bytes += len(raw) - len(job.kv.get(key, b""))
        job.kv[key] = raw
        await job.notify()
        return web.json_response({"ok": True})

    async def get_value(request: web.Request) -> web.Response:
        job = job_of(request)
        key = key_of(request)
        wait = wait_of(request)
        if key not in job.kv and wait > 0:
            await job.wait_until(lambda: key in job.kv, wait)
        raw = job.kv.get(key)
        if raw is None:
            return _error(404, "not_found", f"no key {key!r} in job {job.name!r}")
        return web.Response(body=raw, content_type="application/json")

    async def delete_value(request: web.Request) -> web.Response:
        job = job_of(request)
        key = key_of(request)
        raw = job.kv.pop(key, None)
        if raw is not None:
            job.kv_bytes -= len(raw)
        return web.json_response({"ok": True, "deleted": raw is not None})

    async def forget(request: web.Request) -> web.Response:
        """Drop keys and agreements by exact name or prefix (a finished weight version's records)."""
        job = job_of(request)
        _, doc = await body_json(request)
        f = fields(doc, {"names": list, "prefixes": list}, optional=("names", "prefixes"))
        names = set(f.get("names", []))
        prefixes = tuple(f.get("prefixes", []))
        if not all(isinstance(x, str) and x for x in (*names, *prefixes)):
            raise _BadRequest("names and prefixes must be non-empty strings")

        def gone(name: str) -> bool:
            return name in names or name.startswith(prefixes)

        keys = [k for k in job.kv if gone(k)]
        for k in keys:
            job.kv_bytes -= len(job.kv.pop(k))
        agreements = [a for a in job.agreements if gone(a)]
        for a in agreements:
            del job.agreements[a]
        return web.json_response({"ok": True, "keys": len(keys), "agreements": len(agreements)})

    async def list_keys(request: web.Request) -> web.Response:
        job = job_of(request)
        prefix = request.query.get("prefix", "")
        return web.json_response({"keys": sorted(k for k in job.kv if k.startswith(prefix))})

    async def register(request: web.Request) -> web.Response:
        job = job_of(request)
        _, doc = await body_json(request)
        f = fields(doc, {"name": str, "role": str, "instance": str, "world_size": int, "host": str, "info": dict},
                   optional=("world_size", "host", "info"))
        if not _NAME.match(f["name"]):
            raise _BadRequest(f"bad participant name {f['name']!r}")
        if f["role"] not in ("trainer", "inference"):
            raise _BadRequest("role must be 'trainer' or 'inference'")
        now = time.time()
        old = job.participants.get(f["name"])
        job.participants[f["name"]] = Participant(
            name=f["name"], role=f["role"], instance=f["instance"], world_size=f.get("world_size", 1),
            host=f.get("host", request.remote or ""), registered_at=old.registered_at if old else now,
            last_seen=now, weight_version=old.weight_version if old else None, info=f.get("info", {}),
        )
        event = job.add_event("register", f["name"], None, {"role": f["role"], "instance": f["instance"]})
        await job.notify()
        return web.json_response({"ok": True, "seq": event["seq"]})

    async def report_version(request: web.Request) -> web.Response:
        job = job_of(request)
        name = request.match_info["name"]
        _, doc = await body_json(request)
        f = fields(doc, {"version": (str, type(None))})
        p = job.participants.get(name)
        if p is None:
            return _error(404, "not_found", f"participant {name!r} is not registered in job {job.name!r}")
        p.weight_version = f["version"]
        p.last_seen = time.time()
        event = job.add_event("version", name, f["version"], None)
        await job.notify()
        return web.json_response({"ok": True, "seq": event["seq"]})

    async def publish_event(request: web.Request) -> web.Response:
        job = job_of(request)
        _, doc = await body_json(request)
        f = fields(doc, {"kind": str, "source": str, "version": (str, type(None)), "data": object},
                   optional=("version", "data"))
        if not _NAME.match(f["kind"]):
            raise _BadRequest(f"bad event kind {f['kind']!r}")
        if f["source"] in job.participants:
            job.participants[f["source"]].last_seen = time.time()
        event = job.add_event(f["kind"], f["source"], f.get("version"), f.get("data"))
        await job.notify()
        return web.json_response({"ok": True, "seq": event["seq"]})

    async def get_events(request: web.Request) -> web.Response:
        job = job_of(request)
        try:
            after = int(request.query.get("after", "0"))
        except ValueError:
            raise _BadRequest("after must be an integer") from None
        kind = request.query.get("kind")
        wait = wait_of(request)

        def matching() -> list[dict[str, Any]]:
            return [e for e in job.events if e["seq"] > after and (kind is None or e["kind"] == kind)]

        if wait > 0 and not matching():
            await job.wait_until(lambda: bool(matching()), wait)
        return web.json_response({"events": matching(), "last": job.next_seq - 1})

    async def agree(request: web.Request) -> web.Response:
        job = job_of(request)
        name = key_of(request)
        _, doc = await body_json(request)
        f = fields(doc, {"participant": str, "expected": int, "value": object})
        if f["expected"] < 1:
            raise _BadRequest("expected must be positive")
        a = job.agreements.get(name)
        if a is None:
            a = job.agreements[name] = Agreement(f["expected"])
        if a.expected != f["expected"]:
            return _error(409, "conflict", f"agreement {name!r} expects {a.expected} participants, not {f['expected']}")
        a.values[f["participant"]] = f["value"]
        await job.notify()
        wait = wait_of(request)
        await job.wait_until(lambda: len(a.values) >= a.expected, wait)
        done = len(a.values) >= a.expected
        distinct = []
        for v in a.values.values():
            if v not in distinct:
                distinct.append(v)
        return web.json_response({"complete": done, "arrived": len(a.values), "expected": a.expected,
                                  "distinct_values": distinct if done else []})

    app.router.add_get("/v1/health", health)
    app.router.add_get("/v1/status", status)
    app.router.add_put("/v1/jobs/{job}/kv/{key:.+}", put_value)
    app.router.add_get("/v1/jobs/{job}/kv/{key:.+}", get_value)
    app.router.add_delete("/v1/jobs/{job}/kv/{key:.+}", delete_value)
    app.router.add_get("/v1/jobs/{job}/keys", list_keys)
    app.router.add_post("/v1/jobs/{job}/forget", forget)
    app.router.add_post("/v1/jobs/{job}/participants", register)
    app.router.add_post("/v1/jobs/{job}/participants/{name}/version", report_version)
    app.router.add_post("/v1/jobs/{job}/events", publish_event)
    app.router.add_get("/v1/jobs/{job}/events", get_events)
    app.router.add_post("/v1/jobs/{job}/agree/{key:.+}", agree)
    return app


class _BadRequest(ValueError):
    pass
