"""One HTTP exchange with the MetaServer over the calling thread's kept-alive connection: reconnecting while the
server cannot be reached (until the deadline), and sending again once when a kept-alive connection turns out closed
(a write carries its request id, so the server applies it once). :meth:`Exchanges.send` splits one exchange in two:
the request leaves now, its answer is read when the caller asks for it (work done meanwhile costs no round trip).
What the answer means is the client's business (``awex.meta.client``)."""

from __future__ import annotations

import http.client
import logging
import math
import socket
import threading
import time
import urllib.parse
from typing import Callable

from awex.meta.errors import (
    AwexValueError,
    MetaAuthError,
    MetaConflictError,
    MetaConnectionError,
    MetaFencedError,
    MetaPayloadError,
    MetaRestartError,
    MetaServerError,
    MetaTimeoutError,
)
from awex.meta.http_wire import Connection
from awex.meta.protocol import EPOCH_HEADER

log = logging.getLogger("awex.meta.client")

SLACK = 1.0  # seconds an exchange may take beyond its deadline (the server's answer on its way)
_EPOCH = EPOCH_HEADER.lower()
FIRST_CONTACT_SECONDS = 5.0  # a server never reached that refuses connections this long: a wrong address, said so


class Busy(Exception):
    """The server answered 503 busy/overloaded: ask again after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after


def server_address(address: str) -> tuple[str, str, int]:
    """``(http://host:port, host, port)`` of a MetaServer address (``host:port`` alone means http); a user or
    password in it is refused without echoing it (not in errors, not in logs)."""
    if "://" not in address:
        address = "http://" + address
    parsed = urllib.parse.urlsplit(address)
    if parsed.username is not None or parsed.password is not None:
        raise AwexValueError("MetaServer address: no user or password in it (pass the token as token=...)")
    if parsed.scheme != "http" or not parsed.hostname or not parsed.port:
        raise AwexValueError(f"MetaServer address must look like http://host:port, got {address!r}")
    return f"http://{parsed.netloc}", parsed.hostname, parsed.port


def server_addresses(address: str) -> list[tuple[str, str, int]]:
    """:func:`server_address` of each of the comma-separated addresses of one job's servers (an etcd store's: one
    leads at a time); duplicates refused."""
    servers = [server_address(part.strip()) for part in address.split(",")]
    if len({s[0] for s in servers}) != len(servers):
        raise AwexValueError(f"MetaServer addresses: one given twice in {address!r}")
    return servers


def _standby(status: int, payload: bytes) -> bool:
    """Whether an answer says its server does not lead (an etcd store's: another server of the job does)."""
    return status == 503 and b'"standby"' in payload[:200]


def retry_after(doc: dict) -> float:
    """The pause a busy answer asks for (1 s where it names none, or nothing sensible)."""
    hint = doc.get("retry_after")
    if isinstance(hint, (int, float)) and not isinstance(hint, bool) and math.isfinite(hint) and hint >= 0:
        return float(hint)
    return 1.0


def message(doc: object) -> str:
    """The message of an error answer."""
    if isinstance(doc, dict):
        return str(doc.get("message") or doc.get("error") or doc)
    return str(doc)


def refusal(status: int, doc: object, method: str, path: str, address: str) -> None:
    """Raise the error an answer names (:class:`Busy` for a busy server); nothing for a success or a 404."""
    if status == 401:
        raise MetaAuthError(f"MetaServer at {address} rejected the token: {message(doc)}")
    if status in (400, 413):
        raise MetaPayloadError(f"MetaServer rejected {method} {path}: {message(doc)}")
    if status == 410 and isinstance(doc, dict) and doc.get("error") == "restarted":
        raise MetaRestartError(f"the MetaServer at {address} restarted: {message(doc)}")
    if status == 409:
        if isinstance(doc, dict) and doc.get("error") == "fenced":
            raise MetaFencedError(message(doc))
        raise MetaConflictError(message(doc))
    if status == 503 and isinstance(doc, dict) and doc.get("error") in ("busy", "overloaded"):
        raise Busy(message(doc), retry_after(doc))
    if status >= 500:
        raise MetaServerError(f"MetaServer error on {method} {path}: {status} {message(doc)}")


class Exchanges:
    """Each thread's connection to one server, of ``servers`` (``(http://host:port, host, port)``: one job's
    servers, tried in turn when the one in use refuses or does not lead); connections stay in their process (not
    pickled)."""

    def __init__(self, servers: list[tuple[str, str, int]]):
        self.servers = list(servers)
        self._at = 0  # the server in use (every thread's)
        self._local = threading.local()
        self.reached = False  # some exchange was answered: refusals from now on are a restart, waited out

    @property
    def address(self) -> str:
        return self.servers[self._at][0]

    def __getstate__(self) -> dict:
        return {"servers": self.servers}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["servers"])

    def _connection(self, budget: float) -> Connection:
        """This thread's kept-alive connection to the server in use (a new one if it has none, or one to another)."""
        conn, at = getattr(self._local, "conn", None), getattr(self._local, "at", None)
        self._local.conn = None
        if conn is not None and at == self._at:
            conn.settimeout(budget)
            return conn
        if conn is not None:
            conn.close()
        _, host, port = self.servers[self._at]
        return Connection(host, port, budget)

    def _keep(self, conn: Connection | None) -> None:
        self._local.conn, self._local.at = conn, self._at

    def _next(self, why: object) -> bool:
        """Move to the next server (where there are several); whether that began a new round of them."""
        if len(self.servers) == 1:
            return True
        before = self.address
        self._at = (self._at + 1) % len(self.servers)
        log.info("MetaServer at %s: %s; trying %s", before, why, self.address)
        return self._at == 0

    def _refused(self, e: OSError, since: float, now: float, deadline: float, delay: float) -> None:
        """A connection refused (or a name not found) ``since`` then: raise once the deadline comes, or after
        :data:`FIRST_CONTACT_SECONDS` for a server this process never reached (a wrong address, not a restart)."""
        if now + delay > deadline:
            raise MetaConnectionError(f"cannot reach MetaServer at {self.address}: {e}") from None
        if not self.reached and now - since >= FIRST_CONTACT_SECONDS:
            raise MetaConnectionError(
                f"cannot reach MetaServer at {self.address}: {e} (for {now - since:.0f} s, and never reached: is "
                "the address right, and is the server running?)"
            ) from None
        if now == since:
            log.warning(
                "MetaServer at %s refuses connections (%s); trying again %s",
                self.address,
                e,
                "until the deadline" if self.reached else f"for {FIRST_CONTACT_SECONDS:g} s",
            )

    def _answer_on(self, conn: Connection) -> tuple[int, bytes, str | None, bool]:
        """Read the answer of the request sent on ``conn``: status, body, the server's epoch, and whether the
        connection stays open."""
        resp = conn.getresponse()
        self.reached = True
        return resp.status, resp.body, resp.headers.get(_EPOCH), not resp.will_close

    def close(self) -> None:
        """Close this thread's connection (others close with their threads)."""
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()

    def send(
        self, method: str, path: str, data: bytes | None, headers: dict[str, str], deadline: float
    ) -> Callable[[], tuple[int, bytes, str | None]]:
        """Send one request now and return what reads its answer, as :meth:`exchange` would answer it. The thread
        must read that answer before its next request (the connection is the thread's). Trouble sending or reading
        falls back to :meth:`exchange`, which sends the request again (a write carries its request id: the server
        applies it once)."""
        budget = max(0.05, deadline - time.monotonic()) + SLACK
        conn = None  # in flight: nothing else of this thread's may use it until its answer is read
        try:
            conn = self._connection(budget)
            conn.request(method, path, body=data, headers=headers)
        except (OSError, http.client.HTTPException) as e:
            log.debug("sending %s %s failed (%s); the exchange goes again", method, path, e)
            if conn is not None:
                conn.close()
            return lambda: self.exchange(method, path, data, headers, deadline)
        sent = conn

        def answer() -> tuple[int, bytes, str | None]:
            keep = False
            try:
                status, payload, epoch, keep = self._answer_on(sent)
                if _standby(status, payload):  # another server of the job leads: find it
                    return self.exchange(method, path, data, headers, deadline)
                return status, payload, epoch
            except (socket.timeout, TimeoutError):
                raise MetaTimeoutError(f"MetaServer at {self.address} did not answer {method} {path} in time") from None
            except (OSError, http.client.HTTPException) as e:  # closed while idle, or the reply lost: again
                log.debug("reading the answer to %s %s failed (%s); the exchange goes again", method, path, e)
                return self.exchange(method, path, data, headers, deadline)
            finally:
                if keep:
                    self._keep(sent)
                else:
                    sent.close()

        return answer

    def exchange(
        self, method: str, path: str, data: bytes | None, headers: dict[str, str], deadline: float
    ) -> tuple[int, bytes, str | None]:
        """Send one request and read its answer by ``deadline`` (``time.monotonic()``) plus :data:`SLACK`:
        ``(status, body, the server's epoch header)``."""
        delay = 0.05
        since: float | None = None  # the first refusal of this exchange
        while True:
            reused = getattr(self._local, "conn", None) is not None
            budget = max(0.05, deadline - time.monotonic()) + SLACK
            conn = self._connection(budget)
            keep = False
            try:
                conn.request(method, path, body=data, headers=headers)
                status, payload, epoch, keep = self._answer_on(conn)
                if not _standby(status, payload):
                    break
                if self._next("it does not lead") and not self._pause(deadline, delay, "no server led"):
                    break  # the deadline: the standby answer is the answer
                delay = min(delay * 2, 1.0)
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) if reused else () as e:
                # the server closed this kept-alive connection while it was idle (or the reply was lost: a
                # write goes again with its request id)
                log.debug("MetaServer connection closed (%s); reconnecting", e)
                continue
            except (ConnectionRefusedError, socket.gaierror) as e:
                now = time.monotonic()
                since = now if since is None else since
                if self._next(e):
                    self._refused(e, since, now, deadline, delay)
                    time.sleep(delay)
                    delay = min(delay * 2, 1.0)
            except (socket.timeout, TimeoutError):
                raise MetaTimeoutError(f"MetaServer at {self.address} did not answer {method} {path} in time") from None
            except OSError as e:  # reset, unreachable network and the like: the caller's deadline decides
                if self._next(e):
                    if time.monotonic() + delay > deadline:
                        raise MetaConnectionError(f"cannot reach MetaServer at {self.address}: {e}") from None
                    time.sleep(delay)
                    delay = min(delay * 2, 1.0)
            finally:
                if keep:
                    self._keep(conn)
                else:
                    conn.close()
        return status, payload, epoch

    @staticmethod
    def _pause(deadline: float, delay: float, why: str) -> bool:
        """Sleep ``delay`` before another round of the servers, unless the deadline comes first (``False``)."""
        if time.monotonic() + delay > deadline:
            log.warning("MetaServer: %s until the deadline", why)
            return False
        time.sleep(delay)
        return True
