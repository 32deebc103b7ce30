"""Transports by name. Awex's own are lines of :data:`TRANSPORTS` (with their reasons in
``awex.meta.transport_choice``, for ``auto``); a transport of your own is made available with :func:`register`
(asked for by name: ``auto`` never picks it)."""

from __future__ import annotations

import importlib
import re

from awex.meta.errors import AwexValueError
from awex.transport.base import Transport

TRANSPORTS: dict[str, str | type[Transport]] = {
    "p2p": "awex.transport.p2p:P2pTransport",
    "ipc": "awex.transport.ipc.transport:IpcTransport",
    "shm": "awex.transport.pull.shm:ShmTransport",
    "rdma": "awex.transport.pull.rdma:RdmaTransport",
}
"""Name -> ``module:class`` (imported when first made: rdma's module imports Mooncake only when used) or a class."""

_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}$")


def register(name: str, target: str | type[Transport], replace: bool = False) -> None:
    """Make transport ``name`` available (``WeightsWriter(transport=name)``): ``target`` is its
    :class:`~awex.transport.base.Transport` subclass or ``"module:class"`` (imported when first made). Every process
    of the job registers it before its writer or reader starts (a receiver makes the transport its manifest names).
    Planned as ``ipc``, ``shm`` and ``rdma`` are: each receiver reads what it needs from the ranks that hold it (no
    relays); its class attributes say what it supports (``carries_delta``, ``quantizes_on_receive``,
    ``needs_cuda``, ...). A name in use is refused unless ``replace``."""
    if not isinstance(name, str) or not _NAME.match(name) or name == "auto":
        raise AwexValueError(
            f"transport name {name!r}: 1-32 of a-z, 0-9, '_' and '-', starting with a letter, not 'auto'"
        )
    if isinstance(target, str):
        module, colon, attr = target.partition(":")
        if not (module and colon and attr):
            raise AwexValueError(f"transport {name!r}: target {target!r} is not 'module:class'")
    elif not (isinstance(target, type) and issubclass(target, Transport)):
        raise AwexValueError(f"transport {name!r}: {target!r} is not a Transport subclass (awex.transport.base)")
    if name in TRANSPORTS and not replace and TRANSPORTS[name] is not target:
        raise AwexValueError(f"transport {name!r} is registered already ({TRANSPORTS[name]!r}); pass replace=True")
    TRANSPORTS[name] = target


def transport_class(name: str) -> type[Transport]:
    """The class of transport ``name``; ``AwexValueError`` naming the known ones otherwise."""
    try:
        target = TRANSPORTS[name]
    except KeyError:
        raise AwexValueError(f"unknown transport {name!r}: known are {', '.join(sorted(TRANSPORTS))}") from None
    if not isinstance(target, str):
        return target
    module, _, attr = target.partition(":")
    cls = getattr(importlib.import_module(module), attr)
    if not (isinstance(cls, type) and issubclass(cls, Transport)):
        raise AwexValueError(f"transport {name!r}: {target} is not a Transport subclass (awex.transport.base)")
    return cls


def make_transport(name: str) -> Transport:
    """A new, unprepared transport ``name``."""
    return transport_class(name)()
