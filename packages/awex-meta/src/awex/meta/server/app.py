"""HTTP routes of the MetaServer (JSON in, JSON out; nothing received is ever executed or unpickled).

All routes live under ``/v1``. ``GET /v1/health`` is open; everything else needs ``Authorization: Bearer
<token>`` when the server has a token. Waits are long-polls: ``?wait=SECONDS`` (capped by the server) parks the
request until the thing appears or the wait ends (then 404 / an empty list, and the client decides whether
its own deadline has passed).

=======================================================  ==================================================
route                                                    what it does
=======================================================  ==================================================
``GET /v1/health``                                       liveness, server version, epoch
``GET /v1/status[?job=J]``                               every job (or J): participants, versions, events
``PUT /v1/jobs/{job}/kv/{key}[?create=1]``               store a JSON value (``create=1``: 409 if present)
``GET /v1/jobs/{job}/kv/{key}[?wait=S]``                 fetch a value, waiting up to S seconds
``DELETE /v1/jobs/{job}/kv/{key}``                       delete a value
``GET /v1/jobs/{job}/keys[?prefix=P][&values=1]``        list keys (with their values)
``POST /v1/jobs/{job}/forget``                           drop keys and agreements by name or prefix
``POST /v1/jobs/{job}/participants``                     register a participant (name, role, instance...)
``POST /v1/jobs/{job}/participants/{name}/version``      report the weight version a participant serves
``POST /v1/jobs/{job}/versions``                         report several participants' versions at once
``POST /v1/jobs/{job}/events``                           publish an event (kind, source, version, data)
``GET /v1/jobs/{job}/events?after=N[&wait=S][&kind=K]``  events after number N (410 if N is not this server's)
``POST /v1/jobs/{job}/agree/{name}``                     contribute a value; wait until all arrived
``POST /v1/jobs/{job}/fences/{identity}``                take a writer's new epoch (``fences``)
``POST /v1/jobs/{job}/lease``                            take or renew the claim lease (``leases``)
``DELETE /v1/jobs/{job}/lease``                          give the claim lease back
=======================================================  ==================================================

Every answer carries ``X-Awex-Epoch``, a random name of this server process: a client that sees it change
knows the server restarted (its state, event numbers included, is gone). A job's event numbers begin at a random
point, so an event cursor from an earlier server process is refused per request (410 ``restarted``). A write carrying
``X-Awex-Request-Id`` is answered once: a retry with the same id (the reply was lost) gets the first answer
again instead of being applied twice; one carrying ``X-Awex-Fence`` is refused (409) once a newer writer of that
identity took over (``awex.meta.server.fences``). Limits (bytes per job and in all, keys, events, agreements,
participants, JSON nesting, body-read time) answer 4xx with a message naming the limit.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import os
import re
import secrets
import socket
import time
from collections import OrderedDict
from typing import Any, Callable

from aiohttp import web

from awex.meta.protocol import EPOCH_HEADER, FENCE_HEADER, REQUEST_ID_HEADER
from awex.meta.server import agreements, claims, fences, kv, leases
from awex.meta.server.config import ServerConfig
from awex.meta.server.errors import BadRequest, Busy, TooLarge, busy, error, fields, json_depth
from awex.meta.server.etcd_store import EtcdStore
from awex.meta.server.journal import Journal, JournalError
from awex.meta.server.parking import Parking
from awex.meta.server.state import JobState, Participant, Topics

log = logging.getLogger("awex.meta.server")

_NAME = re.compile(r"^[A-Za-z0-9_.:@-]{1,128}\Z")
_KEY = re.compile(r"^[A-Za-z0-9_.:@/-]{1,512}\Z")
SERVER_VERSION = "1"
_REQUEST_ID = re.compile(r"^[A-Za-z0-9_-]{8,64}\Z")


class MetaServerApp:
    """The MetaServer's state and its route handlers (``make_app`` wires them into an aiohttp application)."""

    def __init__(self, config: ServerConfig, lost: Callable[[], None] | None = None):
        self.config = config = config.sized()  # every derived limit filled in (caps of parked long-polls)
        self.epoch = secrets.token_hex(8)
        self.jobs: dict[str, JobState] = {}
        self.job_topics = Topics()  # "job:<name>" fires when that job is created
        self.replies: OrderedDict[tuple[str, str], tuple[int, bytes]] = OrderedDict()
        self.parking = Parking(config.max_parked, config.max_parked_per_client)
        self.requests = 0  # received so far (/v1/status): what a sync costs the server, counted
        self.journal = _store(config, lost)
        if self.journal is not None:  # the safety state back before anything is answered
            for name, kept in self.journal.load().items():
                self.new_job(name).restore(kept)

    def new_job(self, name: str) -> JobState:
        job = self.jobs[name] = JobState(name, self.config.max_events_per_job, self.config.max_keys_per_job)
        if self.journal is not None:
            everything = lambda: {n: j.kept() for n, j in self.jobs.items()}  # noqa: E731 - the journal's rewrite
            job.remember = functools.partial(self.journal.append_all, everything=everything)
        return job

    async def cleanup(self, app: web.Application) -> None:
        if self.journal is not None:  # its lock goes with it: a new server may take the journal
            self.journal.close()

    # -- helpers -------------------------------------------------------------------------------------------
    def total_bytes(self) -> int:
        return sum(j.held_bytes() for j in self.jobs.values())

    def job_of(self, request: web.Request, create: bool = True) -> JobState | None:
        """The request's job; created on writes, ``None`` for reads of a job that does not exist."""
        name = request.match_info["job"]
        if not _NAME.match(name):
            raise BadRequest(f"bad job name {name!r} (letters, digits, _.:@- ; at most 128)")
        job = self.jobs.get(name)
        if job is None and create:
            if len(self.jobs) >= self.config.max_jobs:
                raise BadRequest(f"too many jobs (limit {self.config.max_jobs})")
            job = self.new_job(name)
            self.job_topics.fire(f"job:{name}")
        return job

    async def job_waiting(self, request: web.Request, wait: float) -> tuple[JobState | None, float]:
        """The request's job, waiting up to ``wait`` seconds for it to be created; the wait left."""
        job = self.job_of(request, create=False)
        if job is None and wait > 0:
            name = request.match_info["job"]
            started = time.monotonic()
            await self.parking.wait_until(
                self.job_topics, f"job:{name}", lambda: name in self.jobs, wait, request.remote or ""
            )
            job = self.jobs.get(name)
            wait = max(0.0, wait - (time.monotonic() - started))
        return job, wait

    @staticmethod
    def key_of(request: web.Request, name: str = "key") -> str:
        key = request.match_info[name]
        if not _KEY.match(key) or ".." in key.split("/"):
            raise BadRequest(f"bad key {key!r} (letters, digits, _.:@/- ; at most 512)")
        return key

    def wait_of(self, request: web.Request) -> float:
        try:
            wait = float(request.query.get("wait", "0"))
        except ValueError:
            raise BadRequest("wait must be a number of seconds") from None
        if wait != wait or wait < 0:
            raise BadRequest("wait must be a non-negative number of seconds")
        return min(wait, self.config.max_wait_seconds)

    async def body_json(self, request: web.Request) -> tuple[bytes, Any]:
        if request.content.is_eof():  # it came with the headers (every small body): read without a task to time it
            raw = await request.read()
        else:
            try:
                raw = await asyncio.wait_for(request.read(), self.config.body_seconds)
            except asyncio.TimeoutError:
                raise BadRequest(f"the body did not arrive within {self.config.body_seconds:g} s") from None
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise BadRequest(f"body is not valid JSON: {e}") from None
        except RecursionError:
            raise BadRequest(f"body nests deeper than {self.config.max_depth} levels") from None
        # a body can nest no deeper than it has brackets (those in strings counted too): most are walked never
        if (
            raw.count(b"{") + raw.count(b"[") > self.config.max_depth
            and json_depth(doc, self.config.max_depth) > self.config.max_depth
        ):
            raise BadRequest(f"body nests deeper than {self.config.max_depth} levels")
        return raw, doc

    def charge(self, job: JobState, grow: int) -> None:
        """Refuse a write that would take ``job`` or the server beyond their byte limits."""
        if grow <= 0:
            return
        if job.held_bytes() + grow > self.config.max_job_bytes:
            raise TooLarge(
                f"job {job.name!r} would hold more than {self.config.max_job_bytes} bytes "
                "(forget finished versions' records, or raise --max-job-mb)"
            )
        if self.total_bytes() + grow > self.config.max_total_bytes:
            raise TooLarge(f"the server would hold more than {self.config.max_total_bytes} bytes in all")

    def small(self, value: Any, what: str) -> int:
        size = len(json.dumps(value))
        if size > self.config.max_small_bytes:
            raise TooLarge(f"{what} is {size} bytes (limit {self.config.max_small_bytes})")
        return size

    # -- middleware ----------------------------------------------------------------------------------------
    @web.middleware
    async def middleware(self, request: web.Request, handler):
        self.requests += 1
        response = await self._answer(request, handler)
        response.headers[EPOCH_HEADER] = self.epoch
        return response

    async def _answer(self, request: web.Request, handler) -> web.StreamResponse:
        config = self.config
        if self.journal is not None and not self.journal.serving():  # an etcd store's server that does not lead
            return error(503, "standby", "this MetaServer does not lead now: ask another of its job's servers")
        if config.token and request.path != "/v1/health":
            header = request.headers.get("Authorization", "")
            given = header[7:] if header.startswith("Bearer ") else ""
            if not hmac.compare_digest(given.encode(), config.token.encode()):
                return error(401, "unauthorized", "missing or wrong token (Authorization: Bearer <token>)")
        fence = request.headers.get(FENCE_HEADER)
        if fence is not None and request.method != "GET" and "job" in request.match_info:
            refused = fences.refusal(self.jobs.get(request.match_info["job"]), fence)
            if refused is not None:
                return refused
        rid = request.headers.get(REQUEST_ID_HEADER)
        remembered = None
        if rid is not None and request.method in ("PUT", "POST", "DELETE") and "/agree/" not in request.path:
            if not _REQUEST_ID.match(rid):
                return error(400, "bad_request", f"bad {REQUEST_ID_HEADER} (8 to 64 letters, digits, _ or -)")
            remembered = (request.path, rid)
            if remembered in self.replies:  # a retry of a write already done: the same answer, nothing applied
                status, body = self.replies[remembered]
                return web.Response(status=status, body=body, content_type="application/json")
        try:
            response = await handler(request)
        except web.HTTPRequestEntityTooLarge:
            response = error(413, "too_large", f"payload exceeds {config.max_payload_bytes} bytes")
        except web.HTTPException:
            raise
        except Busy as e:
            response = busy(e.code, str(e), e.retry_after)
        except BadRequest as e:
            response = error(e.status, e.code, str(e))
        except JournalError as e:  # nothing changed: the change is journalled before it is made
            log.error("%s", e)
            response = error(503, "journal", str(e))
        if self.journal is not None:
            try:  # every change made so far kept before anything is answered (etcd: in one transaction)
                self.journal.flush()
            except JournalError as e:  # that server stops serving: it holds what was not kept
                log.error("%s", e)
                response = error(503, "journal", str(e))
        if remembered is not None and response.status < 500 and isinstance(response, web.Response):
            self.replies[remembered] = (response.status, response.body)
            while len(self.replies) > config.remembered_replies:
                self.replies.popitem(last=False)
        return response

    # -- routes --------------------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        doc = {"ok": True, "server": "awex-meta", "version": SERVER_VERSION, "auth": bool(self.config.token)}
        return web.json_response(dict(doc, epoch=self.epoch))

    async def status(self, request: web.Request) -> web.Response:
        """Every job, each with its first participants (``?job=NAME``: that job, every participant in full)."""
        one, cap, recent = request.query.get("job"), self.config.status_participants, self.config.recent_events
        jobs = {n: j.summary(recent, None if one else cap) for n, j in sorted(self.jobs.items()) if one in (None, n)}
        return web.json_response(
            {
                "server": "awex-meta",
                "version": SERVER_VERSION,
                "time": time.time(),
                "epoch": self.epoch,
                "held_bytes": self.total_bytes(),
                "waiting": self.parking.parked,  # long-polls parked now
                "busy_answers": self.parking.refused,  # long-polls answered 503 busy (beyond a cap) so far
                "requests": self.requests,  # requests received so far, this one included
                "jobs": jobs,
            }
        )

    async def register(self, request: web.Request) -> web.Response:
        _, doc = await self.body_json(request)
        f = fields(
            doc,
            {"name": str, "role": str, "instance": str, "world_size": int, "host": str, "info": dict},
            optional=("world_size", "host", "info"),
        )
        if not _NAME.match(f["name"]):
            raise BadRequest(f"bad participant name {f['name']!r}")
        if f["role"] not in ("trainer", "inference"):
            raise BadRequest("role must be 'trainer' or 'inference'")
        if not _NAME.match(f["instance"]):
            raise BadRequest(f"bad instance name {f['instance']!r}")
        size = self.small(f.get("info", {}), "the participant's info") + len(f["name"]) + len(f["instance"])
        job = self.job_of(request)
        old = job.participants.get(f["name"])
        if old is None and len(job.participants) >= self.config.max_participants_per_job:
            raise BadRequest(
                f"too many participants in job {job.name!r} (limit {self.config.max_participants_per_job})"
            )
        self.charge(job, size)
        world = f.get("world_size", 1)
        job.note("participant", name=f["name"], role=f["role"], instance=f["instance"], world_size=world)
        now = time.time()
        job.participants[f["name"]] = Participant(
            name=f["name"],
            role=f["role"],
            instance=f["instance"],
            world_size=f.get("world_size", 1),
            host=f.get("host", request.remote or "")[:256],
            registered_at=old.registered_at if old else now,
            last_seen=now,
            weight_version=old.weight_version if old else None,
            last_sync=old.last_sync if old else None,
            info=f.get("info", {}),
        )
        job.participant_bytes += size - (len(json.dumps(old.info)) + len(old.name) + len(old.instance) if old else 0)
        event = job.add_event("register", f["name"], None, {"role": f["role"], "instance": f["instance"]})
        return web.json_response({"ok": True, "seq": event["seq"]})

    async def report_version(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        _, doc = await self.body_json(request)
        f = _report_fields(doc)
        job = self.job_of(request, create=False)
        p = job.participants.get(name) if job is not None else None
        if p is None:
            return error(
                404, "not_found", f"participant {name!r} is not registered in job {request.match_info['job']!r}"
            )
        return web.json_response({"ok": True, "seq": _serve_all(job, {name: f})[name]})

    async def report_versions(self, request: web.Request) -> web.Response:
        """Several participants' versions in one request (a writer reporting every engine it synced): each as
        ``report_version`` would; those not registered are named in ``missing`` and left alone."""
        _, doc = await self.body_json(request)
        reports = fields(doc, {"reports": dict})["reports"]
        if len(reports) > self.config.max_participants_per_job:
            raise BadRequest(f"at most {self.config.max_participants_per_job} reports in one request")
        checked = {str(name): _report_fields(r) for name, r in reports.items()}  # all checked before any applies
        job = self.job_of(request, create=False)
        known = job.participants if job is not None else {}
        _serve_all(job, {name: f for name, f in checked.items() if name in known})
        return web.json_response({"ok": True, "missing": [name for name in checked if name not in known]})

    async def publish_event(self, request: web.Request) -> web.Response:
        _, doc = await self.body_json(request)
        f = fields(
            doc,
            {"kind": str, "source": str, "version": (str, type(None)), "data": object},
            optional=("version", "data"),
        )
        if not _NAME.match(f["kind"]):
            raise BadRequest(f"bad event kind {f['kind']!r}")
        if len(f["source"]) > 256 or (f.get("version") is not None and len(f["version"]) > 512):
            raise BadRequest("event source (256) or version (512 characters) too long")
        size = self.small(f.get("data"), "the event's data")
        size += len(f["kind"]) + len(f["source"]) + len(f.get("version") or "")
        job = self.job_of(request)
        self.charge(job, size)
        if f["source"] in job.participants:
            job.participants[f["source"]].last_seen = time.time()
        event = job.add_event(f["kind"], f["source"], f.get("version"), f.get("data"), size)
        return web.json_response({"ok": True, "seq": event["seq"]})

    async def take_fence(self, request: web.Request) -> web.Response:
        job = self.job_of(request)
        leases.wait_for_epoch(job, request.match_info["identity"])  # the writer it replaces may hold the lease
        epoch = fences.take(job, request.match_info["identity"])
        return web.json_response({"ok": True, "epoch": epoch})

    async def get_events(self, request: web.Request) -> web.Response:
        try:
            after = int(request.query.get("after", "0"))
        except ValueError:
            raise BadRequest("after must be an integer") from None
        if after < 0:
            raise BadRequest("after must not be negative")
        kind = request.query.get("kind")
        job, wait = await self.job_waiting(request, self.wait_of(request))
        if after and (job is None or not job.cursor_ok(after)):
            return error(
                410, "restarted", f"event {after} is not one of this server's (it restarted, or another job's)"
            )
        if job is None:
            return web.json_response({"events": [], "last": 0})
        if wait > 0 and not job.after(after, kind):
            await self.parking.wait_until(
                job.topics, "events", lambda: bool(job.after(after, kind)), wait, request.remote or ""
            )
        return web.json_response({"events": job.after(after, kind), "last": job.next_seq - 1})


def _report_fields(doc: Any) -> dict[str, Any]:
    f = fields(
        doc,
        {"version": (str, type(None)), "bytes": int, "seconds": (int, float), "claim": str},
        ("bytes", "seconds", "claim"),
    )
    if f["version"] is not None and len(f["version"]) > 512:
        raise BadRequest("version names are at most 512 characters")
    return f


def _serve_all(job: JobState, serving: dict[str, dict[str, Any]]) -> dict[str, int]:
    """Each registered participant named in ``serving`` serves its ``f["version"]`` now (its claim, if named, is
    never written again): journalled in one write before any change; the number of each one's ``version`` event."""
    if not serving:
        return {}
    claimed = sorted({f.get("claim") for f in serving.values() if f["version"] is not None} - {None})
    job.note_all(
        claims.applied_notes(job, claimed)
        + [("serves", {"name": n, "version": f["version"]}) for n, f in serving.items()]
    )
    claims.mark_applied(job, claimed)
    seqs = {}
    for name, f in serving.items():
        p = job.participants[name]
        p.weight_version, p.last_seen = f["version"], time.time()
        p.last_sync = {"version": f["version"], "at": p.last_seen, **{k: f[k] for k in ("bytes", "seconds") if k in f}}
        seqs[name] = job.add_event("version", name, f["version"], None)["seq"]
    return seqs


SERVER_KEY = web.AppKey("awex_meta_server", MetaServerApp)


ROUTES = (  # (method, path, handler: a method's name or a function of the server and the request): the table above
    ("GET", "/v1/health", "health"),
    ("GET", "/v1/status", "status"),
    ("PUT", "/v1/jobs/{job}/kv/{key:.+}", kv.put_value),
    ("GET", "/v1/jobs/{job}/kv/{key:.+}", kv.get_value),
    ("DELETE", "/v1/jobs/{job}/kv/{key:.+}", kv.delete_value),
    ("GET", "/v1/jobs/{job}/keys", kv.list_keys),
    ("POST", "/v1/jobs/{job}/forget", kv.forget),
    ("POST", "/v1/jobs/{job}/participants", "register"),
    ("POST", "/v1/jobs/{job}/participants/{name}/version", "report_version"),
    ("POST", "/v1/jobs/{job}/versions", "report_versions"),
    ("POST", "/v1/jobs/{job}/events", "publish_event"),
    ("GET", "/v1/jobs/{job}/events", "get_events"),
    ("POST", "/v1/jobs/{job}/agree/{key:.+}", agreements.agree),
    ("POST", "/v1/jobs/{job}/fences/{identity}", "take_fence"),
    ("POST", "/v1/jobs/{job}/lease", leases.take),
    ("DELETE", "/v1/jobs/{job}/lease", leases.give_back),
)


def _store(config: ServerConfig, lost: Callable[[], None] | None) -> Journal | EtcdStore | None:
    """Where the safety state is kept: etcd (this server leading), a journal file, or nowhere."""
    if config.store is not None:
        if config.journal is not None:
            raise JournalError("a journal and an etcd store: pick one")
        return EtcdStore(config.store, f"{socket.gethostname()} pid {os.getpid()}", config.leader_ttl, lost)
    return Journal(config.journal, config.journal_fsync) if config.journal else None


def make_app(config: ServerConfig | None = None, lost: Callable[[], None] | None = None) -> web.Application:
    """Build the aiohttp application (used by the embedded and the standalone server, and by tests); ``lost()`` is
    called if a server on an etcd store loses the lead (it then answers nothing but 503 standby)."""
    server = MetaServerApp(config or ServerConfig(), lost)
    app = web.Application(client_max_size=server.config.max_payload_bytes, middlewares=[server.middleware])
    app[SERVER_KEY] = server
    app.on_cleanup.append(server.cleanup)
    for method, path, handler in ROUTES:
        bound = getattr(server, handler) if isinstance(handler, str) else functools.partial(handler, server)
        app.router.add_route(method, path, bound)
    return app
