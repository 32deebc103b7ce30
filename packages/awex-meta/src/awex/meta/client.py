"""A small synchronous client for the MetaServer (standard library HTTP, JSON only).

Every call has a deadline. Waits are long-polls repeated until the caller's deadline, so a missing peer
produces :class:`~awex.meta.errors.MetaTimeoutError` naming what was awaited, never a hang. The client is
thread-safe: each thread keeps one connection open (``awex.meta.http_wire``).

    client = MetaClient("http://127.0.0.1:8765", job="grpo-run-7", token=os.environ.get("AWEX_META_TOKEN"))
    client.register("trainer", role="trainer", instance="trainer", world_size=8)
    client.publish_layout(layout, version="step-1")
    layout = client.fetch_layout("vllm-0", version="step-1", timeout=60)
"""

from __future__ import annotations

import functools
import json
import logging
import re
import secrets
import threading
import time
import urllib.parse
from typing import Any, Callable, Sequence

from awex.meta import layout_store
from awex.meta.agreement_calls import POLL_SLICE as _POLL_SLICE
from awex.meta.agreement_calls import Agreements
from awex.meta.durations import seconds as seconds  # re-exported: how timeouts are checked
from awex.meta.errors import (
    AwexValueError,
    MetaBusyError,
    MetaNotRegisteredError,
    MetaServerError,
    MetaTimeoutError,
)
from awex.meta.http_exchange import SLACK as SLACK  # re-exported: a call's answer may come this much late
from awex.meta.http_exchange import Busy as _Busy
from awex.meta.http_exchange import Exchanges, message, refusal, server_addresses
from awex.meta.layout import Layout
from awex.meta.protocol import FENCE_HEADER, LEASE_MAX_SECONDS, REQUEST_ID_HEADER

__all__ = ["MetaClient"]

log = logging.getLogger("awex.meta.client")
_JOB = re.compile(r"[A-Za-z0-9_.:@-]{1,128}")  # as the server accepts them


DEFAULT_TIMEOUT = 60.0
_MAX_RETRY_AFTER = 5.0  # the longest pause a busy server's hint may ask for


class MetaClient(Agreements):
    """Talks to one job on a MetaServer at ``address`` (``http://host:port``; several, comma-separated, for servers
    that lead in turn on one etcd: the one that leads answers)."""

    def __init__(self, address: str, job: str = "default", token: str | None = None, timeout: float = DEFAULT_TIMEOUT):
        servers = server_addresses(address)
        self.address = ",".join(s[0] for s in servers)
        if not isinstance(job, str) or not _JOB.fullmatch(job):
            raise AwexValueError(f"job name {job!r}: 1 to 128 letters, digits, _ . : @ -")
        self.job = job
        self.token = token
        self.timeout = seconds(timeout, "timeout", positive=True)
        self._http = Exchanges(servers)  # each thread's kept-alive connection
        self._lock = threading.Lock()
        self._epoch: str | None = None  # the server's epoch as last seen
        self._owned: dict[str, tuple[str, str, bytes | None]] = {}  # published again after a server restart
        self._layouts: dict[bytes, Layout] = {}  # layouts fetched, by content (engines alike are decoded once)
        self.restarts = 0  # server restarts this client noticed
        self.fence: str | None = None  # "<epoch>:<identity>" on every write (see fenced())

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for name in ("_lock", "_owned", "_layouts"):  # what this process published or read stays with it (and _http)
            del state[name]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._owned, self._layouts = {}, {}

    def close(self) -> None:
        """Close this thread's connection (others close with their threads)."""
        self._http.close()

    # -- transport -------------------------------------------------------------------------------------
    def _request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        deadline: float,
        raw: bytes | None = None,
        query: dict[str, Any] | None = None,
        own: str | None = None,
        rid: str | None = None,
    ) -> tuple[int, Any]:
        """One request, answered by ``deadline`` (``time.monotonic()``) plus ``SLACK`` seconds at the latest.
        A server that cannot be reached is tried again until then; a write whose reply was lost is sent again
        with the same request id, which the server answers without applying it twice; a server that says it is
        busy (503 with a retry hint) is asked again after the time it names (a long-poll with the wait left),
        until the deadline (then :class:`MetaBusyError`)."""
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        if rid is None and method != "GET" and "/agree/" not in path:  # given: a request already sent once
            rid = secrets.token_hex(12)
        while True:
            asked = dict(query) if query else None
            if asked and "wait" in asked:
                asked["wait"] = f"{max(0.0, min(float(asked['wait']), deadline - time.monotonic())):.3f}"
            try:
                return self._request_once(method, path, data, rid, deadline=deadline, query=asked, own=own)
            except _Busy as busy:
                pause = min(busy.retry_after, _MAX_RETRY_AFTER)
                log.debug("MetaServer busy (%s %s): %s; asking again in %.1f s", method, path, busy, pause)
                if time.monotonic() + pause > deadline:
                    raise MetaBusyError(
                        f"MetaServer at {self.address} stayed busy until the deadline ({method} {path}): {busy}"
                    ) from None
                time.sleep(pause)

    def _request_once(
        self,
        method: str,
        path: str,
        data: bytes | None,
        rid: str | None,
        *,
        deadline: float,
        query: dict[str, Any] | None,
        own: str | None,
    ) -> tuple[int, Any]:
        path, headers = self._prepared(path, data, rid, method, query)
        status, payload, epoch = self._http.exchange(method, path, data, headers, deadline)
        status, doc = self._answered(method, path, status, payload, epoch)
        if own is not None and status < 300:  # published again if the server restarts
            with self._lock:
                self._owned[own] = (method, path.split("?", 1)[0], data)
        return status, doc

    def _prepared(
        self, path: str, data: bytes | None, rid: str | None, method: str, query: dict[str, Any] | None
    ) -> tuple[str, dict[str, str]]:
        """The request's path with its query, and its headers."""
        if query:
            path += "?" + urllib.parse.urlencode(query)
        headers = {"Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        if rid is not None:  # agreements are idempotent by participant
            headers[REQUEST_ID_HEADER] = rid
        if method != "GET" and self.fence is not None:
            headers[FENCE_HEADER] = self.fence
        return path, headers

    def _answered(self, method: str, path: str, status: int, payload: bytes, epoch: str | None) -> tuple[int, Any]:
        """What an answer means: its document, or the error it names."""
        try:
            doc = json.loads(payload) if payload else None
        except ValueError:
            raise MetaServerError(f"MetaServer answered {method} {path} with non-JSON ({status})") from None
        if epoch:
            self._saw_epoch(epoch)
        refusal(status, doc, method, path, self.address)
        return status, doc

    def _saw_epoch(self, epoch: str) -> None:
        """Note the server's epoch; on a new one (a restart), publish again what this client owns."""
        with self._lock:
            if self._epoch == epoch:
                return
            restarted = self._epoch is not None
            self._epoch = epoch
            self.restarts += restarted
            owned = list(self._owned.values()) if restarted else []
        if restarted:
            log.warning(
                "MetaServer at %s restarted (epoch %s): publishing again %d registrations and keys this client owns",
                self.address,
                epoch,
                len(owned),
            )
            for method, path, data in owned:
                try:
                    self._request(method, path, raw=data, deadline=time.monotonic() + self.timeout)
                except MetaServerError as e:
                    log.warning("could not publish %s again after the MetaServer restarted: %s", path, e)

    @property
    def epoch(self) -> str | None:
        """The server's epoch as last seen (``None`` before the first answer); it changes when the server restarts."""
        return self._epoch

    def _job_path(self, *parts: str) -> str:
        return (
            "/v1/jobs/"
            + urllib.parse.quote(self.job, safe="")
            + "/"
            + "/".join(urllib.parse.quote(p, safe="/") for p in parts)
        )

    def _by(self, timeout: float | None = None) -> float:
        return time.monotonic() + (self.timeout if timeout is None else seconds(timeout))

    # -- service ---------------------------------------------------------------------------------------
    def health(self, timeout: float = 10.0) -> dict[str, Any]:
        return self._request("GET", "/v1/health", deadline=self._by(timeout))[1]

    def status(self, timeout: float = 10.0, job: str | None = None) -> dict[str, Any]:
        """Every job (each with its first 100 participants, without info) or ``job`` alone, in full."""
        return self._request("GET", "/v1/status", deadline=self._by(timeout), query={"job": job} if job else None)[1]

    # -- key-value -------------------------------------------------------------------------------------
    def put(
        self, key: str, value: Any, *, create_only: bool = False, keep: bool = False, timeout: float | None = None
    ) -> None:
        """Store a JSON value under ``key`` (``create_only``: fail with MetaConflictError if it exists; ``keep``:
        this client publishes it again if the server restarts, until it deletes it; ``timeout``: seconds, this
        client's own by default)."""
        query = {"create": "1"} if create_only else None
        path = self._job_path("kv", key)
        self._request("PUT", path, value, deadline=self._by(timeout), query=query, own=path if keep else None)

    def put_sent(self, key: str, value: Any, *, create_only: bool = False) -> Callable[[], None]:
        """:meth:`put`, in two: the request leaves now; calling what this returns reads its answer (raising what
        ``put`` raises). This thread makes no other request until then; the work it does meanwhile overlaps the
        round trip."""
        path, data = self._job_path("kv", key), json.dumps(value).encode()
        rid, deadline = secrets.token_hex(12), self._by()
        full, headers = self._prepared(path, data, rid, "PUT", {"create": "1"} if create_only else None)
        pending = self._http.send("PUT", full, data, headers, deadline)
        return functools.partial(self._put_answered, pending, path, full, data, rid, deadline, create_only)

    def _put_answered(self, pending, path: str, full: str, data: bytes, rid: str, deadline: float, create_only: bool):
        """Read the answer of a put sent before (:meth:`put_sent`)."""
        try:
            self._answered("PUT", full, *pending())
        except _Busy:  # asked again, by the same request id, as put would
            query = {"create": "1"} if create_only else None
            self._request("PUT", path, raw=data, deadline=deadline, query=query, rid=rid)

    def try_get(self, key: str) -> Any | None:
        """The value under ``key``, or ``None`` if absent (no waiting)."""
        status, doc = self._request("GET", self._job_path("kv", key), deadline=self._by())
        return None if status == 404 else doc

    def get(self, key: str, timeout: float | None = None) -> Any:
        """The value under ``key``, waiting for it up to ``timeout`` seconds (long-poll); raises within the
        timeout plus ``SLACK`` seconds."""
        timeout = self.timeout if timeout is None else seconds(timeout)
        deadline = time.monotonic() + timeout
        while True:
            wait = max(0.0, min(deadline - time.monotonic(), _POLL_SLICE))
            status, doc = self._request(
                "GET", self._job_path("kv", key), deadline=deadline, query={"wait": f"{wait:.3f}"}
            )
            if status != 404:
                return doc
            if time.monotonic() >= deadline:
                raise MetaTimeoutError(f"key {key!r} of job {self.job!r} did not appear within {timeout:g} s")

    def delete(self, key: str) -> bool:
        path = self._job_path("kv", key)
        with self._lock:
            self._owned.pop(path, None)
        return bool(self._request("DELETE", path, deadline=self._by())[1]["deleted"])

    def forget(
        self,
        names: Sequence[str] = (),
        prefixes: Sequence[str] = (),
        release: Sequence[str] = (),
        timeout: float | None = None,
    ) -> dict[str, int]:
        """Drop keys and agreements named exactly ``names`` or starting with one of ``prefixes``; returns how
        many of each went (``{"keys": n, "agreements": m}``). Writers call it for finished versions. Names created
        once stay claimed, except those in ``release`` that this writer claimed and never applied (a failed attempt:
        ``awex.meta.server.claims``). ``timeout``: this request's, where not the client's."""
        body = {"names": list(names), "prefixes": list(prefixes), **({"release": list(release)} if release else {})}
        doc = self._request("POST", self._job_path("forget"), body, deadline=self._by(timeout))[1]
        return {"keys": int(doc["keys"]), "agreements": int(doc["agreements"])}

    def keys(self, prefix: str = "") -> list[str]:
        return self._request("GET", self._job_path("keys"), deadline=self._by(), query={"prefix": prefix})[1]["keys"]

    def values(self, prefix: str) -> dict[str, Any] | None:
        """Every key under ``prefix`` with its value, in one request; ``None`` where they are too many bytes for one
        answer (read them one by one)."""
        doc = self._request("GET", self._job_path("keys"), deadline=self._by(), query={"prefix": prefix, "values": 1})
        values = doc[1].get("values")
        return values if isinstance(values, dict) else None

    # -- writer fences --------------------------------------------------------------------------------
    def take_fence(self, identity: str) -> int:
        """A new epoch for writer ``identity`` (a trainer instance): the server refuses the writes of every client
        fenced with an older one from now on (:meth:`fenced`); waits out the claim lease the replaced writer holds."""
        deadline = time.monotonic() + max(self.timeout, LEASE_MAX_SECONDS + 2)
        return int(self._request("POST", self._job_path("fences", identity), {}, deadline=deadline)[1]["epoch"])

    def lease(self, seconds: float, prefix: str = "", names: bool = False, give_back: bool = False) -> dict[str, Any]:
        """Take or renew this fenced writer's claim lease of the job on keys under ``prefix`` for ``seconds``
        (``names``: with the digests of every name claimed and key under it), or give it back; the server's answer
        (``awex.meta.server.leases``)."""
        if give_back:
            return self._request("DELETE", self._job_path("lease"), deadline=self._by())[1]
        body = {"seconds": seconds, "prefix": prefix, "names": names}
        return self._request("POST", self._job_path("lease"), body, deadline=self._by())[1]

    def fenced(self, identity: str, epoch: int) -> MetaClient:
        """A client of the same server and job whose every write carries writer ``identity``'s ``epoch``: once a
        newer writer of ``identity`` took an epoch, each raises :class:`MetaFencedError` and changes nothing."""
        other = MetaClient(self.address, job=self.job, token=self.token, timeout=self.timeout)
        other.fence = f"{int(epoch)}:{identity}"
        return other

    # -- participants, versions, events ----------------------------------------------------------------
    def register(
        self,
        name: str,
        *,
        role: str,
        instance: str,
        world_size: int = 1,
        host: str = "",
        info: dict[str, Any] | None = None,
    ) -> None:
        """Announce a participant (an engine instance or one of its ranks) to the job; announced again if the
        server restarts."""
        body = {"name": name, "role": role, "instance": instance, "world_size": world_size, "info": info or {}}
        if host:
            body["host"] = host
        self._request("POST", self._job_path("participants"), body, deadline=self._by(), own=f"participant:{name}")

    def report_version(
        self,
        name: str,
        version: str | None,
        nbytes: int | None = None,
        seconds: float | None = None,
        claim: str | None = None,
    ) -> None:
        """Record the weight version participant ``name`` now serves (``None``: no complete version), and what
        its sync moved into it (``nbytes``) in how long (``seconds``), shown by ``/v1/status``; ``claim``: the key
        the version was claimed under, never written again from now on. Raises
        :class:`MetaServerError` when ``name`` is not registered (after a server restart, this client
        registers its participants again and reports once more)."""
        path = self._job_path("participants", name, "version")
        for _ in range(2):
            restarts = self.restarts
            body = {"version": version, "bytes": nbytes, "seconds": seconds, "claim": claim}
            body = {k: v for k, v in body.items() if v is not None or k == "version"}
            status, doc = self._request("POST", path, body, deadline=self._by())
            if status != 404:
                return
            if self.restarts == restarts:
                break
        raise MetaNotRegisteredError(f"cannot report version {version!r}: {message(doc)}")

    def report_versions(self, reports: dict[str, dict[str, Any]]) -> list[str]:
        """:meth:`report_version` of several participants in one request (``{name: {"version", "bytes",
        "seconds", "claim"}}``, the last three optional); returns the names not registered there (left alone)."""
        missing: list[str] = []
        for _ in range(2):  # once more after a server restart this client noticed: its own are registered again
            restarts = self.restarts
            doc = self._request("POST", self._job_path("versions"), {"reports": reports}, deadline=self._by())[1]
            missing = [str(m) for m in doc.get("missing", ())]
            if not missing or self.restarts == restarts:
                break
        return missing

    def report_versions_sent(self, reports: dict[str, dict[str, Any]]) -> Callable[[], list[str]]:
        """:meth:`report_versions`, in two: the request leaves now; calling what this returns reads its answer (the
        names not registered there; raising what ``report_versions`` raises). This thread makes no other request
        until then."""
        path = self._job_path("versions")
        data = json.dumps({"reports": reports}).encode()
        rid, deadline = secrets.token_hex(12), self._by()
        full, headers = self._prepared(path, data, rid, "POST", None)
        pending = self._http.send("POST", full, data, headers, deadline)
        return functools.partial(self._versions_answered, pending, path, full, data, rid, deadline)

    def _versions_answered(self, pending, path: str, full: str, data: bytes, rid: str, deadline: float) -> list[str]:
        """Read the answer of version reports sent before (:meth:`report_versions_sent`)."""
        try:
            doc = self._answered("POST", full, *pending())[1]
        except _Busy:  # asked again, by the same request id, as report_versions would
            doc = self._request("POST", path, raw=data, deadline=deadline, rid=rid)[1]
        return [str(m) for m in doc.get("missing", ())]

    def publish_event(self, kind: str, source: str, version: str | None = None, data: Any = None) -> int:
        """Publish an event; returns its sequence number."""
        body = {"kind": kind, "source": source, "version": version, "data": data}
        return int(self._request("POST", self._job_path("events"), body, deadline=self._by())[1]["seq"])

    def events(self, after: int = 0, kind: str | None = None, timeout: float = 0.0) -> list[dict[str, Any]]:
        """Events with sequence number > ``after``; waits up to ``timeout`` seconds for at least one. Raises
        :class:`MetaRestartError` if ``after`` is not an event number of the server now answering (it restarted
        since ``after`` was read, whoever noticed first: events after ``after`` may have been lost)."""
        deadline = time.monotonic() + seconds(timeout)
        while True:
            wait = max(0.0, min(deadline - time.monotonic(), _POLL_SLICE))
            query: dict[str, Any] = {"after": after, "wait": f"{wait:.3f}"}
            if kind:
                query["kind"] = kind
            found = self._request("GET", self._job_path("events"), deadline=deadline, query=query)[1]["events"]
            if found or time.monotonic() >= deadline:
                return found

    def wait_event(
        self, kind: str, after: int = 0, timeout: float | None = None, version: str | None = None
    ) -> dict[str, Any]:
        """The first event of ``kind`` (and ``version``, if given) after ``after``; MetaTimeoutError if none."""
        timeout = self.timeout if timeout is None else seconds(timeout)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            for e in self.events(after, kind, timeout=max(0.0, left)):
                after = max(after, e["seq"])
                if version is None or e.get("version") == version:
                    return e
            if time.monotonic() >= deadline:
                raise MetaTimeoutError(
                    f"no {kind!r} event (version {version!r}) in job {self.job!r} within {timeout:g} s"
                )

    # -- metadata helpers ------------------------------------------------------------------------------
    def publish_layout(self, layout: Layout, version: str = "current") -> None:
        """Publish an engine instance's layout for weight version ``version`` (again if the server restarts)."""
        layout_store.publish(self, layout, version)  # its table once under its digest, and a reference to it

    def fetch_layout(self, instance: str, version: str = "current", timeout: float | None = None) -> Layout:
        """Fetch (waiting for) the layout an instance published; validated, never evaluated (a tensor table read
        before, by any instance, is neither downloaded nor decoded again: ``awex.meta.layout_store``)."""
        return layout_store.fetch(self, instance, version, timeout, self._layouts)

    def fetch_layouts(
        self, instances: Sequence[str], version: str = "current", timeout: float | None = None
    ) -> dict[str, Layout]:
        """:meth:`fetch_layout` of each of ``instances``, their references read in one request (one a rank, where a
        rank reading one per instance made a thousand ranks ask 17,000 times)."""
        return layout_store.fetch_many(self, instances, version, timeout, self._layouts)
