"""Transports by name: adding one is a module with a :class:`~awex.transport.base.Transport` and a line here
(and its reasons in ``awex.meta.transport_choice``, for ``auto``)."""

from __future__ import annotations

import importlib

from awex.transport.base import Transport

TRANSPORTS: dict[str, str] = {
    "p2p": "awex.transport.p2p:P2pTransport",
    "ipc": "awex.transport.ipc.transport:IpcTransport",
    "shm": "awex.transport.pull.shm:ShmTransport",
    "rdma": "awex.transport.pull.rdma:RdmaTransport",
}
"""Name -> ``module:class``, imported when first made (rdma's module imports Mooncake only when used)."""


def transport_class(name: str) -> type[Transport]:
    """The class of transport ``name``; ``ValueError`` naming the known ones otherwise."""
    try:
        target = TRANSPORTS[name]
    except KeyError:
        raise ValueError(f"unknown transport {name!r}: known are {', '.join(sorted(TRANSPORTS))}") from None
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def make_transport(name: str) -> Transport:
    """A new, unprepared transport ``name``."""
    return transport_class(name)()
