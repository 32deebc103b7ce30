"""Where the MetaServer listens: connections capped in all and per client address, each refused one answered
(503 ``overloaded`` with a retry hint, not a silent close); the open-file limit read (and its soft limit raised) at
start-up to size those caps; the event loop's own error reports (an ``accept`` that failed for want of descriptors)
rate-limited instead of one traceback per attempt."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections import Counter
from typing import Any

from aiohttp import web

from awex.meta.server.parking import RETRY_SECONDS

log = logging.getLogger("awex.meta.server")

WANTED_DESCRIPTORS = 1 << 16  # the soft open-file limit a server raises itself to (at most the hard limit)
REFUSED_WAIT = 5.0  # seconds a refused connection may take to send its request before it is closed unanswered
BACKLOG = 4096  # connections waiting to be accepted (the kernel caps it at net.core.somaxconn): a burst of
# clients connecting at once is not made to retry its handshakes for seconds
LOG_EVERY = 10.0  # seconds between two reports of the same event-loop error


def descriptor_limit(wanted: int = WANTED_DESCRIPTORS) -> int | None:
    """This process's open-file limit, its soft limit first raised towards ``wanted`` (never above the hard
    limit); ``None`` where the platform has none."""
    try:
        import resource
    except ImportError:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            log.info("MetaServer: open-file limit raised from %d to %d", soft, target)
            soft = target
        except (ValueError, OSError) as e:
            log.warning("MetaServer: could not raise the open-file limit from %d: %s", soft, e)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def overloaded_answer(why: str) -> bytes:
    low, high = RETRY_SECONDS
    body = json.dumps(
        {"error": "overloaded", "message": why, "retry_after": round(low + random.random() * (high - low), 3)}
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class _Gate(asyncio.Protocol):
    """One connection: handed to aiohttp's handler if the caps allow it; otherwise its first request is answered
    503 ``overloaded`` and the connection closed (after reading what arrived, so the answer is not lost to a reset)."""

    def __init__(self, site: LimitedSite):
        self.site = site
        self.inner: asyncio.Protocol | None = None
        self.peer = ""
        self.refusal: bytes | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        why = self.site.admit(self.peer)
        if why is not None:
            self.refusal = overloaded_answer(why)
            asyncio.get_running_loop().call_later(REFUSED_WAIT, transport.close)
            return
        self.site.by_client[self.peer] += 1
        self.inner = self.site.handler()
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.inner is not None:
            self.inner.data_received(data)
        elif self.refusal is not None and self.transport is not None:
            # answer, stop writing, and keep reading (and dropping) what the client still sends until it closes
            # (or REFUSED_WAIT passes): closing at once would reset a client still writing its body, and the
            # answer would be lost
            self.transport.write(self.refusal)
            self.refusal = None
            if self.transport.can_write_eof():
                self.transport.write_eof()
            else:
                self.transport.close()

    def eof_received(self) -> bool | None:
        if self.inner is None:
            return False  # the transport closes itself
        return self.inner.eof_received()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.inner is not None:
            self.site.by_client[self.peer] -= 1
            if not self.site.by_client[self.peer]:
                del self.site.by_client[self.peer]
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()


class LimitedSite(web.TCPSite):
    """A TCP site that admits at most ``max_connections`` connections, ``per_client`` of them from one address
    (so idle or half-open connections cannot exhaust the process's descriptors or lock other hosts out; idle ones
    are closed after ``ServerConfig.idle_seconds``). A burst may overshoot the limit by what one accept round
    takes (the listen backlog): connections count once set up."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, max_connections: int, per_client: int):
        super().__init__(runner, host, port, backlog=BACKLOG)
        self.max_connections, self.per_client = max_connections, per_client
        self.by_client: Counter[str] = Counter()
        self.refused = 0

    def handler(self) -> asyncio.Protocol:
        server = self._runner.server
        assert server is not None
        return server()

    def admit(self, peer: str) -> str | None:
        """``None`` to admit a connection from ``peer``, else why not."""
        open_ = len(self._runner.server.connections) if self._runner.server is not None else 0
        if open_ >= self.max_connections:
            why = f"{open_} connections open (limit {self.max_connections}); retry shortly"
        elif self.by_client[peer] >= self.per_client:
            why = f"{self.by_client[peer]} connections open from {peer} (limit {self.per_client}); retry shortly"
        else:
            return None
        self.refused += 1
        if self.refused in (1, 10, 100) or self.refused % 1000 == 0:
            log.warning("MetaServer: %s; refused %d so far", why, self.refused)
        return why

    async def start(self) -> None:
        await web.BaseSite.start(self)
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _Gate(self),
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
        )


class QuietLoopErrors:
    """An event-loop exception handler that reports each kind of error at most once per :data:`LOG_EVERY` seconds
    (with how many were left out), so a loop that fails to accept for want of descriptors does not flood the log."""

    def __init__(self) -> None:
        self.last: dict[str, float] = {}
        self.left_out: Counter[str] = Counter()

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        kind = f"{context.get('message', '')}|{type(exc).__name__ if exc else ''}"
        now = time.monotonic()
        if now - self.last.get(kind, -LOG_EVERY) < LOG_EVERY:
            self.left_out[kind] += 1
            return
        self.last[kind] = now
        skipped = self.left_out.pop(kind, 0)
        log.error(
            "MetaServer event loop: %s%s%s",
            context.get("message", "error"),
            f": {exc!r}" if exc else "",
            f" ({skipped} more like it in the last {LOG_EVERY:g} s)" if skipped else "",
        )
