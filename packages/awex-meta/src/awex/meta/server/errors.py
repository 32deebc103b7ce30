"""How the MetaServer refuses a request: JSON error answers, and the checks that raise them."""

from __future__ import annotations

from typing import Any

from aiohttp import web


def error(status: int, code: str, message: str, **extra: Any) -> web.Response:
    return web.json_response({"error": code, "message": message, **extra}, status=status)


def busy(code: str, message: str, retry_after: float) -> web.Response:
    """A 503 the client retries after ``retry_after`` seconds (body and ``Retry-After``); the connection closes,
    so a client waiting to retry holds none."""
    response = error(503, code, message, retry_after=round(retry_after, 3))
    response.headers["Retry-After"] = str(max(1, round(retry_after)))
    response.force_close()
    return response


class BadRequest(ValueError):
    status = 400
    code = "bad_request"


class Busy(BadRequest):
    """Too many requests wait already (server-wide or from this address): retry after ``retry_after`` seconds."""

    status = 503
    code = "busy"

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after


class TooLarge(BadRequest):
    status = 413
    code = "too_large"


def json_depth(doc: Any, limit: int | None = None) -> int:
    """How deeply ``doc`` nests (a scalar is 0), without recursion: one level of containers at a time (scalars are
    never looked at again). Stops at ``limit + 1`` where given (deeper than ``limit``: the answer is enough)."""
    level = [doc] if type(doc) is dict or type(doc) is list else []
    depth = 0
    while level and (limit is None or depth <= limit):
        depth += 1
        level = [
            child
            for node in level
            for child in (node.values() if type(node) is dict else node)
            if type(child) is list or type(child) is dict
        ]
    return depth


def fields(doc: Any, spec: dict[str, type | tuple[type, ...]], optional: tuple[str, ...] = ()) -> dict[str, Any]:
    """The fields of a request body ``doc`` named in ``spec``, each of its type (``bool`` is not an ``int``);
    :class:`BadRequest` for anything else; fields in ``optional`` may be missing."""
    if not isinstance(doc, dict):
        raise BadRequest("body must be a JSON object")
    out = {}
    for name, typ in spec.items():
        if name not in doc:
            if name in optional:
                continue
            raise BadRequest(f"missing field {name!r}")
        value = doc[name]
        if isinstance(value, bool) and typ is int or not isinstance(value, typ):
            raise BadRequest(f"field {name!r} has the wrong type")
        out[name] = value
    return out
