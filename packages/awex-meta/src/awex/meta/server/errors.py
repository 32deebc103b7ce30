"""How the MetaServer refuses a request: JSON error answers, and the checks that raise them."""

from __future__ import annotations

from typing import Any

from aiohttp import web


def error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": code, "message": message}, status=status)


class BadRequest(ValueError):
    status = 400
    code = "bad_request"


class TooLarge(BadRequest):
    status = 413
    code = "too_large"


def json_depth(doc: Any) -> int:
    """How deeply ``doc`` nests (a scalar is 0), without recursion."""
    deepest = 0
    stack = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


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
