"""A small etcd v3 client over etcd's JSON gateway (``/v3/kv/...``, ``/v3/lease/...``; etcd 3.4 and newer), with
nothing beyond the standard library: what the MetaServer's etcd store needs (ranges, transactions, leases), each
call bounded by a deadline and tried on every endpoint of the cluster in turn, so that losing one member of three
changes nothing. Keys and values are bytes (base64 on the wire, as the gateway wants); etcd's 64-bit integers travel
as strings and come back as ``int``."""

from __future__ import annotations

import base64
import http.client
import json
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

from awex.meta.errors import AwexError, AwexValueError

CALL_SECONDS = 5.0  # one call, over every endpoint, at most this long unless told otherwise


class EtcdError(AwexError, RuntimeError):
    """No endpoint of the cluster answered the call in time, or one answered an error."""


def endpoints_of(url: str) -> tuple[list[str], str]:
    """``etcd://host:port[,host:port...][/prefix]`` as ``(["http://host:port", ...], "/prefix")`` (prefix ``/awex``
    when none is given); ``ValueError`` for anything else."""
    if not url.startswith("etcd://"):
        raise AwexValueError(f"an etcd store looks like etcd://host:port[,host:port...][/prefix], got {url!r}")
    hosts, slash, prefix = url[len("etcd://") :].partition("/")
    endpoints = []
    for host in hosts.split(","):
        parsed = urllib.parse.urlsplit("http://" + host.strip())
        if not parsed.hostname or parsed.port is None or parsed.path or parsed.username:
            raise AwexValueError(f"etcd endpoint {host!r} in {url!r}: host:port")
        endpoints.append(f"http://{host.strip()}")
    prefix = "/" + prefix.strip("/") if slash and prefix.strip("/") else "/awex"
    return endpoints, prefix


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


class Etcd:
    """Calls to one etcd cluster (``endpoints``: ``http://host:port`` of its members)."""

    def __init__(self, endpoints: list[str], timeout: float = CALL_SECONDS):
        if not endpoints:
            raise AwexValueError("etcd: no endpoint")
        self.endpoints = list(endpoints)
        self.timeout = timeout
        self._first = 0  # the endpoint that answered last: asked first next time
        self._local = threading.local()  # each thread's kept-alive connections, by endpoint

    def call(self, path: str, body: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """POST ``body`` to ``/v3/<path>`` on the first member that answers, by the deadline (each thread keeps a
        connection per member)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        data = json.dumps(body).encode()
        errors: list[str] = []
        delay = 0.05
        while True:
            for i in range(len(self.endpoints)):
                at = (self._first + i) % len(self.endpoints)
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    status, raw = self._post(at, f"/v3/{path}", data, min(left, 2.0))
                    doc = json.loads(raw or b"{}")
                except (OSError, http.client.HTTPException, ValueError) as e:  # refused, reset, timed out, not JSON
                    self._drop(at)
                    errors.append(f"{self.endpoints[at]}: {e or type(e).__name__}")
                    continue
                if status in (400, 404):  # the request itself is wrong: no other member answers otherwise
                    raise EtcdError(f"etcd {self.endpoints[at]} refused /v3/{path}: {status} {raw[:300]!r}")
                if status != 200 or not isinstance(doc, dict):
                    errors.append(f"{self.endpoints[at]}: {status} {raw[:300]!r}")
                    continue
                self._first = at
                return doc
            if time.monotonic() + delay >= deadline:
                raise EtcdError(f"no etcd member answered /v3/{path} in time: {'; '.join(errors[-3:]) or 'timeout'}")
            time.sleep(delay)
            delay = min(2 * delay, 0.5)

    def _post(self, at: int, path: str, data: bytes, timeout: float) -> tuple[int, bytes]:
        conns = self._local.__dict__.setdefault("conns", {})
        conn = conns.get(at)
        if conn is None:
            parsed = urllib.parse.urlsplit(self.endpoints[at])
            conn = conns[at] = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=timeout)
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        reply = conn.getresponse()
        return reply.status, reply.read()

    def _drop(self, at: int) -> None:
        conn = self._local.__dict__.get("conns", {}).pop(at, None)
        if conn is not None:
            conn.close()

    # -- keys ----------------------------------------------------------------------------------------------
    def range(self, key: bytes, prefix: bool = False) -> list[KeyValue]:
        """The key (or every key under it, with ``prefix``), in key order."""
        body: dict[str, Any] = {"key": _b64(key)}
        if prefix:
            body["range_end"] = _b64(_prefix_end(key))
        return [_kv(kv) for kv in self.call("kv/range", body).get("kvs", [])]

    def txn(
        self, compare: list[dict], success: list[dict], failure: list[dict] | None = None, timeout: float | None = None
    ) -> tuple[bool, dict]:
        """One transaction: ``(succeeded, the answer)``; build its parts with :func:`put`, :func:`delete`,
        :func:`get` and :func:`created`."""
        doc = self.call("kv/txn", {"compare": compare, "success": success, "failure": failure or []}, timeout)
        return bool(doc.get("succeeded", False)), doc

    # -- leases --------------------------------------------------------------------------------------------
    def grant(self, ttl: int) -> int:
        """A new lease of ``ttl`` seconds: its ID."""
        doc = self.call("lease/grant", {"TTL": int(ttl)})
        if "ID" not in doc:
            raise EtcdError(f"etcd did not grant a lease: {doc}")
        return int(doc["ID"])

    def keepalive(self, lease: int, timeout: float | None = None) -> int:
        """Renew ``lease``: the seconds it has from now (0: it expired, or was revoked)."""
        doc = self.call("lease/keepalive", {"ID": str(lease)}, timeout)
        return int(doc.get("result", {}).get("TTL", 0) or 0)

    def revoke(self, lease: int) -> None:
        """End ``lease`` now (its keys go with it)."""
        self.call("lease/revoke", {"ID": str(lease)})


def put(key: bytes, value: bytes, lease: int = 0) -> dict:
    op: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease:
        op["lease"] = str(lease)
    return {"request_put": op}


def delete(key: bytes) -> dict:
    return {"request_delete_range": {"key": _b64(key)}}


def get(key: bytes) -> dict:
    return {"request_range": {"key": _b64(key)}}


def created(key: bytes, revision: int) -> dict:
    """A compare: ``key`` was created at ``revision`` (0: it does not exist)."""
    return {"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": str(revision)}


def ranged(answer: dict, index: int = 0) -> list[KeyValue]:
    """The keys the ``index``-th operation of a transaction read (:func:`get`)."""
    responses = answer.get("responses", [])
    if index >= len(responses):
        return []
    return [_kv(kv) for kv in responses[index].get("response_range", {}).get("kvs", [])]


def revision_of(answer: dict) -> int:
    """The revision a transaction made (the header's)."""
    return int(answer.get("header", {}).get("revision", 0))


def _kv(doc: dict) -> KeyValue:
    return KeyValue(
        base64.b64decode(doc.get("key", "")),
        base64.b64decode(doc.get("value", "")),
        int(doc.get("create_revision", 0)),
        int(doc.get("mod_revision", 0)),
        int(doc.get("lease", 0)),
    )


def _prefix_end(key: bytes) -> bytes:
    """The first key after every key starting with ``key``."""
    end = bytearray(key)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"
