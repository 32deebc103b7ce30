"""Claim leases: a writer that holds its job's lease claims version names without waiting for the server's answer.

A version name's claim (``awex.meta.server.claims``) is what lets bytes move: made by a round trip before the
transfer, it costs a version that round trip on its critical path. A writer (``<epoch>:<identity>``, its fence) may
instead hold the job's *claim lease* on a key prefix (``POST /v1/jobs/{job}/lease``, renewed every few seconds): while
it is live no other writer's claim is made and no other client writes a key under the prefix (answered 503 busy until
it ends), and no newer writer of the holder's identity takes an epoch (``fences.take`` waits the same way), so the
holder alone names versions. Knowing every name claimed and every key under the prefix before (the grant carries
their digests, :func:`awex.meta.protocol.claim_digest`), it decides a fresh name's claim itself, sends
the claim without waiting for the answer and lets the bytes move; its claim is still made here, journalled, before
the version can be reported applied.

Safety rests on time measured on each side: the holder counts its lease from when it *sent* the request, the server
from when it answered, so the holder's lease ends first (less a margin the holder keeps for its claims' travel).
Anyone who wants what the lease holds (another writer's claim, a newer epoch of the holder's identity, a lease of
its own) marks it wanted: it is not renewed, and leases of the job are refused for :data:`CONTENDED_SECONDS` after
(a job with several writers claims each name by a round trip). A journalled lease is restored live for its whole
length from the restart (the server cannot know how much of it had passed); without a journal a restarted server
forgets leases as it forgets fences and claims.
"""

from __future__ import annotations

import re
import time
from typing import Any, Callable, Protocol

from aiohttp import web

from awex.meta.protocol import FENCE_HEADER, LEASE_MAX_SECONDS, claim_digest
from awex.meta.server.errors import BadRequest, Busy, fields
from awex.meta.server.state import JobState, Lease

MIN_SECONDS, MAX_SECONDS = 1.0, LEASE_MAX_SECONDS
_PREFIX = re.compile(r"^[A-Za-z0-9_.:@/-]{1,128}\Z")
CONTENDED_SECONDS = 60.0  # after a lease was wanted by another writer, leases of the job are refused this long


def live(job: JobState, now: float | None = None) -> Lease | None:
    """The job's lease while it lasts."""
    lease = job.lease
    if lease is not None and lease.until > (time.monotonic() if now is None else now):
        return lease
    return None


def grant(job: JobState, fence: str | None, seconds: float, prefix: str, names: bool) -> dict:
    """Grant or renew the job's lease on the keys under ``prefix`` to the writer fenced ``fence`` for ``seconds``; the
    answer says whether (``granted``), for how long, and, with ``names``, the digests of every name claimed in the
    job and of every key under ``prefix``."""
    if fence is None:
        raise BadRequest("a claim lease is for a fenced writer (X-Awex-Fence)")
    if not _PREFIX.match(prefix):
        raise BadRequest(f"bad lease prefix {prefix[:140]!r} (1 to 128 letters, digits, _.:@/-)")
    if isinstance(seconds, bool) or not (isinstance(seconds, (int, float)) and MIN_SECONDS <= seconds <= MAX_SECONDS):
        raise BadRequest(f"seconds must be between {MIN_SECONDS:g} and {MAX_SECONDS:g}")
    now = time.monotonic()
    held = _wanted(job, lambda lease: lease.holder != fence)
    if held is not None:
        return {"granted": False, "retry_after": round(held[1], 3), "why": "held by another writer"}
    lease = live(job, now)
    if lease is not None and lease.wanted:
        return {"granted": False, "why": "another writer waits for it"}
    if now < job.lease_contended_until:
        return {"granted": False, "why": "several writers claimed names in this job lately"}
    if lease is None or (lease.seconds, lease.prefix) != (seconds, prefix):  # a renewal changes nothing journalled
        job.note("lease", id=fence, seconds=float(seconds), prefix=prefix)
    job.lease = Lease(fence, now + seconds, prefix, float(seconds))
    answer: dict = {"granted": True, "seconds": seconds}
    if names:
        taken = set(job.claims).union(job.keys_under(prefix))
        answer["names"] = "".join(claim_digest(key) for key in taken)
    return answer


def release(job: JobState, fence: str | None) -> bool:
    """The holder gives its lease back (a writer that closes); whether it held one."""
    if job.lease is None or job.lease.holder != fence:
        return False
    job.note("unlease")
    job.lease = None
    return True


def _wanted(job: JobState, against: Callable[[Lease], bool]) -> tuple[Lease, float] | None:
    """The live lease and the seconds it has left, where it stands ``against`` what someone asks: it is then wanted
    (not renewed), and leases of the job are refused for :data:`CONTENDED_SECONDS`."""
    now = time.monotonic()
    lease = live(job, now)
    if lease is None or not against(lease):
        return None
    lease.wanted = True
    job.lease_contended_until = max(job.lease_contended_until, now + CONTENDED_SECONDS)
    return lease, lease.until - now


def wait_for_claim(job: JobState, key: str, claim: bool, fence: str | None) -> None:
    """Raise :class:`Busy` (retried by the client) while another writer holds the lease and the put of ``key`` is a
    ``claim`` or writes a key under the lease's prefix: it waits for the lease."""
    held = _wanted(job, lambda lease: lease.holder != fence and (claim or key.startswith(lease.prefix)))
    if held is not None:
        raise Busy(f"writer {held[0].holder} holds this job's claim lease; ask again", held[1])


def wait_for_epoch(job: JobState, identity: str) -> None:
    """Raise :class:`Busy` while an older writer of ``identity`` holds the lease: a new epoch waits until it ends
    (a writer that closed gave it back; one that died holds it at most its length)."""
    held = _wanted(job, lambda lease: lease.holder.partition(":")[2] == identity)
    if held is not None:
        raise Busy(
            f"the writer {held[0].holder} this one replaces holds the claim lease for {held[1]:.1f} s more "
            "(it did not close); waiting for it to end",
            held[1],
        )


class Server(Protocol):
    """What the lease routes need of the server (``awex.meta.server.app.MetaServerApp``)."""

    async def body_json(self, request: web.Request) -> tuple[bytes, Any]: ...
    def job_of(self, request: web.Request, create: bool = True) -> JobState | None: ...


async def take(server: Server, request: web.Request) -> web.Response:
    """``POST /v1/jobs/{job}/lease`` ``{"seconds": S, "prefix": P, "names": bool}``: grant or renew (:func:`grant`)."""
    _, doc = await server.body_json(request)
    f = fields(doc, {"seconds": (int, float), "prefix": str, "names": bool}, optional=("names",))
    job = server.job_of(request)
    assert job is not None
    fence = request.headers.get(FENCE_HEADER)
    return web.json_response(grant(job, fence, f["seconds"], f["prefix"], f.get("names", False)))


async def give_back(server: Server, request: web.Request) -> web.Response:
    """``DELETE /v1/jobs/{job}/lease``: the holder releases it (:func:`release`)."""
    job = server.job_of(request, create=False)
    held = job is not None and release(job, request.headers.get(FENCE_HEADER))
    return web.json_response({"ok": True, "released": held})
