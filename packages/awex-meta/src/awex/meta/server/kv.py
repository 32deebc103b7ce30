"""The key-value routes of the MetaServer (``/v1/jobs/{job}/kv/...``, ``/keys``, ``/forget``): values are JSON,
stored as the bytes received and answered as they are; a key created with ``create=1`` is a claim
(``awex.meta.server.claims``), none written under another writer's claim lease (``awex.meta.server.leases``)."""

from __future__ import annotations

import json

from aiohttp import web

from awex.meta.protocol import FENCE_HEADER
from awex.meta.server import claims, leases
from awex.meta.server.errors import BadRequest, error, fields
from awex.meta.server.routes import Server


async def put_value(server: Server, request: web.Request) -> web.Response:
    key = server.key_of(request)
    raw, _ = await server.body_json(request)
    job = server.job_of(request)
    create, fence = request.query.get("create") == "1", request.headers.get(FENCE_HEADER)
    refused = claims.refusal(job, key, create, fence)
    if refused is not None:
        return refused
    leases.wait_for_claim(job, key, create or key in job.claims, fence)  # none under another's claim lease
    if key not in job.kv and len(job.kv) >= job.max_keys:
        raise BadRequest(f"too many keys in job {job.name!r} (limit {job.max_keys})")
    server.charge(job, job.kv_cost(key, raw) - job.kv_cost(key, job.kv.get(key)))
    claims.record(job, key, create, fence)
    job.set_kv(key, raw)
    job.topics.fire(f"kv:{key}")
    return web.json_response({"ok": True})


async def get_value(server: Server, request: web.Request) -> web.Response:
    key = server.key_of(request)
    job, wait = await server.job_waiting(request, server.wait_of(request))
    if job is not None and key not in job.kv and wait > 0:
        await server.parking.wait_until(job.topics, f"kv:{key}", lambda: key in job.kv, wait, request.remote or "")
    raw = job.kv.get(key) if job is not None else None
    if raw is None:
        return error(404, "not_found", f"no key {key!r} in job {request.match_info['job']!r}")
    return web.Response(body=raw, content_type="application/json")


async def delete_value(server: Server, request: web.Request) -> web.Response:
    key = server.key_of(request)
    job = server.job_of(request, create=False)
    raw = job.pop_kv(key) if job is not None else None
    return web.json_response({"ok": True, "deleted": raw is not None})


async def forget(server: Server, request: web.Request) -> web.Response:
    """Drop keys and agreements by exact name or prefix (a finished weight version's records). Claims stay,
    except those named in ``release`` by the writer that holds them (a failed attempt, never applied)."""
    _, doc = await server.body_json(request)
    f = fields(doc, {"names": list, "prefixes": list, "release": list}, optional=("names", "prefixes", "release"))
    given = [*f.get("names", []), *f.get("prefixes", []), *f.get("release", [])]
    if not all(isinstance(x, str) and x for x in given):
        raise BadRequest("names and prefixes must be non-empty strings")
    job = server.job_of(request, create=False)
    if job is None:
        return web.json_response({"ok": True, "keys": 0, "agreements": 0})
    names = set(f.get("names", []))
    prefixes = tuple(f.get("prefixes", []))

    def gone(name: str) -> bool:
        return name in names or name.startswith(prefixes)

    keys = {k for k in names if k in job.kv}.union(*(job.keys_under(p) for p in prefixes))
    for k in keys:
        job.pop_kv(k)
    agreements = [a for a in job.agreements if gone(a)]
    for a in agreements:
        job.drop_agreement(a)
    claims.release(job, f.get("release", []), request.headers.get(FENCE_HEADER))
    return web.json_response({"ok": True, "keys": len(keys), "agreements": len(agreements)})


async def list_keys(server: Server, request: web.Request) -> web.Response:
    """The keys under ``prefix``; with ``values=1`` their values too (``null`` where more bytes than a request
    may carry: read them one by one): one request where a reader would make one per key."""
    job = server.job_of(request, create=False)
    prefix = request.query.get("prefix", "")
    found = job.keys_under(prefix) if job else []
    if request.query.get("values") != "1":
        return web.json_response({"keys": found})
    raws = [job.kv[k] for k in found] if job else []
    if sum(map(len, raws)) > server.config.max_payload_bytes:
        return web.json_response({"keys": found, "values": None})
    values = b",".join(json.dumps(k).encode() + b":" + raw for k, raw in zip(found, raws))
    return web.Response(
        body=b'{"keys":%s,"values":{%s}}' % (json.dumps(found).encode(), values), content_type="application/json"
    )
