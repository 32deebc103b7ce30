"""Running the MetaServer: in-process on a background thread (embedded), or in the foreground (standalone)."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from aiohttp import web

from awex.meta.server.app import make_app
from awex.meta.server.config import ServerConfig
from awex.meta.server.site import LimitedSite, QuietLoopErrors, descriptor_limit

log = logging.getLogger("awex.meta.server")


class EmbeddedMetaServer:
    """A MetaServer on its own event-loop thread inside this process.

    ``address`` is ``http://HOST:PORT``; pass it to every client. Use as a context manager or call
    :meth:`stop`. Port 0 picks a free port.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, config: ServerConfig | None = None):
        self.host = host
        self.port = port
        self.config = config or ServerConfig()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 30.0) -> EmbeddedMetaServer:
        if self._thread is not None:
            raise RuntimeError("server already started")
        self._thread = threading.Thread(target=self._run, name="awex-meta-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"MetaServer did not start within {timeout} s")
        if self._error is not None:
            raise RuntimeError(f"MetaServer failed to start: {self._error}") from self._error
        log.info("MetaServer listening on %s (token %s)", self.address, "required" if self.config.token else "off")
        return self

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.set_exception_handler(QuietLoopErrors())
            config = self.config = self.config.sized(descriptor_limit())
            self._runner = _runner(config)
            loop.run_until_complete(self._runner.setup())
            site = LimitedSite(
                self._runner, self.host, self.port, config.max_connections, config.max_connections_per_client
            )
            loop.run_until_complete(site.start())
            sockets = site._server.sockets if site._server else []  # noqa: SLF001 - aiohttp exposes no getter
            if sockets:
                self.port = sockets[0].getsockname()[1]
        except BaseException as e:  # report start-up failures (port in use...) to the caller
            self._error = e
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving and join the thread (idempotent)."""
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
        self._thread = None

    def __enter__(self) -> EmbeddedMetaServer:
        return self if self._thread is not None else self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def start_embedded(
    token: str | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    journal: str | None = None,
    store: str | None = None,
    leader_ttl: int = 5,
) -> EmbeddedMetaServer:
    """Start a MetaServer in this process on a free loopback port and return it (``.address``, ``.stop()``).
    ``journal``: a file keeping fences, claimed version names and served versions, for a server started again on the
    same port (``awex.meta.server.journal``); ``store``: that state in etcd instead (``etcd://host:port,...``; the
    server starts once it leads: ``awex.meta.server.etcd_store``); with neither that state lives as long as this
    process."""
    config = ServerConfig(token=token, journal=journal, store=store, leader_ttl=leader_ttl)
    return EmbeddedMetaServer(host, port, config).start()


def serve_forever(host: str, port: int, config: ServerConfig, started=None) -> bool:
    """Run a MetaServer in the foreground until interrupted (``awex-meta serve``); ``OSError`` when it cannot
    listen there. ``started(port)`` is called once it listens. With an etcd store it first waits for the lead, and
    returns ``True`` once it lost it (it must not serve on)."""
    lost = False

    async def main() -> None:
        nonlocal lost
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(QuietLoopErrors())
        gone = asyncio.Event()
        sized = config.sized(descriptor_limit())
        log.info(
            "MetaServer limits: %d connections (%d per address), %d long-polls waiting (%d per address)",
            sized.max_connections,
            sized.max_connections_per_client,
            sized.max_parked,
            sized.max_parked_per_client,
        )
        runner = _runner(sized, lambda: loop.call_soon_threadsafe(gone.set))
        await runner.setup()
        try:
            site = LimitedSite(runner, host, port, sized.max_connections, sized.max_connections_per_client)
            await site.start()
            if started is not None:
                sockets = site._server.sockets if site._server else []  # noqa: SLF001 - aiohttp exposes no getter
                started(sockets[0].getsockname()[1] if sockets else port)
            await gone.wait()  # until interrupted, or the lead is lost
            lost = True
        finally:
            await runner.cleanup()

    asyncio.run(main())
    return lost


def _runner(config: ServerConfig, lost=None) -> web.AppRunner:
    # keepalive_timeout also closes connections that never send a request (aiohttp starts it on connect)
    return web.AppRunner(
        make_app(config, lost),
        access_log=None,
        handle_signals=False,
        shutdown_timeout=1.0,
        keepalive_timeout=config.idle_seconds,
    )
