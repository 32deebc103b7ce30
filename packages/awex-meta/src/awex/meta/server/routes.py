"""What the route modules (``agreements``, ``kv``, ``fences``...) need of the server: one protocol, met by
``awex.meta.server.app.MetaServerApp``, so those modules never import the app (which imports them)."""

from __future__ import annotations

from typing import Any, Protocol

from aiohttp import web

from awex.meta.server.config import ServerConfig
from awex.meta.server.parking import Parking
from awex.meta.server.state import JobState


class Server(Protocol):
    """The server's state and request helpers, as route functions use them."""

    config: ServerConfig
    parking: Parking

    def key_of(self, request: web.Request, name: str = "key") -> str: ...
    async def body_json(self, request: web.Request) -> tuple[bytes, Any]: ...
    def job_of(self, request: web.Request, create: bool = True) -> JobState | None: ...
    async def job_waiting(self, request: web.Request, wait: float) -> tuple[JobState | None, float]: ...
    def charge(self, job: JobState, grow: int) -> None: ...
    def small(self, value: Any, what: str) -> int: ...
    def wait_of(self, request: web.Request) -> float: ...
