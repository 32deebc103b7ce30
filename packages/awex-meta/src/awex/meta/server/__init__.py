"""The MetaServer: a job-level service for discovery, metadata exchange and events.

Built on aiohttp (server side): one small dependency that gives a mature asyncio HTTP/1.1 server with
request-size limits, so waits are long-polls parked per topic (one key, the events, one agreement) rather than busy
polling threads.
Run it embedded (:class:`EmbeddedMetaServer`, one call, in-process on a free loopback port) or standalone
(``awex-meta serve``).
"""

from awex.meta.server.app import make_app
from awex.meta.server.config import ServerConfig
from awex.meta.server.embedded import EmbeddedMetaServer, start_embedded

__all__ = ["EmbeddedMetaServer", "ServerConfig", "make_app", "start_embedded"]
