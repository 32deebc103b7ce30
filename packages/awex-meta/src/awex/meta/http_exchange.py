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
        raise ValueError("MetaServer address: no user or password in it (pass the token as token=...)")
    if parsed.scheme != "http" or not parsed.hostname or not parsed.port:
        raise ValueError(f"MetaServer address must look like http://host:port, got {address!r}")
    return f"http://{parsed.netloc}", parsed.hostname, parsed.port


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
    """Each thread's connection to one server; connections stay in their process (not pickled)."""

    def __init__(self, host: str, port: int, address: str):
        self.host, self.port, self.address = host, port, address
        self._local = threading.local()
        self.reached = False  # some exchange was answered: refusals from now on are a restart, waited out

    def __getstate__(self) -> dict:
        return {"host": self.host, "port": self.port, "address": self.address}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._local = threading.local()
        self.reached = False

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
        conn = getattr(self._local, "conn", None)
        self._local.conn = None  # in flight: nothing else of this thread's may use it until its answer is read
        budget = max(0.05, deadline - time.monotonic()) + SLACK
        try:
            if conn is None:
                conn = Connection(self.host, self.port, budget)
            else:
                conn.settimeout(budget)
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
                return status, payload, epoch
            except (socket.timeout, TimeoutError):
                raise MetaTimeoutError(f"MetaServer at {self.address} did not answer {method} {path} in time") from None
            except (OSError, http.client.HTTPException) as e:  # closed while idle, or the reply lost: again
                log.debug("reading the answer to %s %s failed (%s); the exchange goes again", method, path, e)
                return self.exchange(method, path, data, headers, deadline)
            finally:
                if keep:
                    self._local.conn = sent
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
            conn = getattr(self._local, "conn", None)
            reused = conn is not None
            budget = max(0.05, deadline - time.monotonic()) + SLACK
            if conn is None:
                conn = Connection(self.host, self.port, budget)
            keep = False
            try:
                conn.settimeout(budget)
                conn.request(method, path, body=data, headers=headers)
                status, payload, epoch, keep = self._answer_on(conn)
                break
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) if reused else () as e:
                # the server closed this kept-alive connection while it was idle (or the reply was lost: a
                # write goes again with its request id)
                log.debug("MetaServer connection closed (%s); reconnecting", e)
                continue
            except (ConnectionRefusedError, socket.gaierror) as e:
                now = time.monotonic()
                since = now if since is None else since
                self._refused(e, since, now, deadline, delay)
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
            except (ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected) as e:
                if time.monotonic() + delay > deadline:
                    raise MetaConnectionError(f"cannot reach MetaServer at {self.address}: {e}") from None
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
            except (socket.timeout, TimeoutError):
                raise MetaTimeoutError(f"MetaServer at {self.address} did not answer {method} {path} in time") from None
            except OSError as e:  # unreachable network and the like: the caller's deadline decides
                if time.monotonic() + delay > deadline:
                    raise MetaConnectionError(f"cannot reach MetaServer at {self.address}: {e}") from None
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
            finally:
                if keep:
                    self._local.conn = conn
                else:
                    self._local.conn = None
                    conn.close()
        return status, payload, epoch
