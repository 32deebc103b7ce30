"""One HTTP exchange with the MetaServer over the calling thread's kept-alive connection: reconnecting while the
server cannot be reached (until the deadline), and sending again once when a kept-alive connection turns out closed
(a write carries its request id, so the server applies it once). What the answer means is the client's business
(``awex.meta.client``)."""

from __future__ import annotations

import http.client
import logging
import math
import socket
import threading
import time

from awex.meta.errors import MetaConnectionError, MetaTimeoutError
from awex.meta.protocol import EPOCH_HEADER

log = logging.getLogger("awex.meta.client")

SLACK = 1.0  # seconds an exchange may take beyond its deadline (the server's answer on its way)


class Busy(Exception):
    """The server answered 503 busy/overloaded: ask again after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after


def retry_after(doc: dict) -> float:
    """The pause a busy answer asks for (1 s where it names none, or nothing sensible)."""
    hint = doc.get("retry_after")
    if isinstance(hint, (int, float)) and not isinstance(hint, bool) and math.isfinite(hint) and hint >= 0:
        return float(hint)
    return 1.0


class Exchanges:
    """Each thread's connection to one server; connections stay in their process (not pickled)."""

    def __init__(self, host: str, port: int, address: str):
        self.host, self.port, self.address = host, port, address
        self._local = threading.local()

    def __getstate__(self) -> dict:
        return {"host": self.host, "port": self.port, "address": self.address}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._local = threading.local()

    def close(self) -> None:
        """Close this thread's connection (others close with their threads)."""
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()

    def exchange(
        self, method: str, path: str, data: bytes | None, headers: dict[str, str], deadline: float
    ) -> tuple[int, bytes, str | None]:
        """Send one request and read its answer by ``deadline`` (``time.monotonic()``) plus :data:`SLACK`:
        ``(status, body, the server's epoch header)``."""
        delay = 0.05
        while True:
            conn = getattr(self._local, "conn", None)
            reused = conn is not None
            budget = max(0.05, deadline - time.monotonic()) + SLACK
            if conn is None:
                conn = http.client.HTTPConnection(self.host, self.port, timeout=budget)
            keep = False
            try:
                if conn.sock is not None:
                    conn.sock.settimeout(budget)
                conn.request(method, path, body=data, headers=headers)
                resp = conn.getresponse()
                payload = resp.read()
                status = resp.status
                epoch = resp.getheader(EPOCH_HEADER)
                keep = not resp.will_close
                break
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) if reused else () as e:
                # the server closed this kept-alive connection while it was idle (or the reply was lost: a
                # write goes again with its request id)
                log.debug("MetaServer connection closed (%s); reconnecting", e)
                continue
            except (
                ConnectionRefusedError,
                socket.gaierror,
                ConnectionResetError,
                BrokenPipeError,
                http.client.RemoteDisconnected,
            ) as e:
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
