"""Layouts on the MetaServer by content: an instance's layout is published as a small reference
(``layouts/<version>/<instance>``: its instance name and the digest of its tensor table) and the table once under its
digest (``tables/<digest>``), so a rank reading every engine's layout downloads each distinct table once, not once
per engine (engines alike share one table: at 1,024 ranks of 16 engines alike this cut the bytes a first sync serves
from the layouts' 17 copies per rank to two). A table read is checked against its digest before it is decoded; a
full layout under the reference's key (from an older publisher) is read as before.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Protocol

from awex.meta.errors import MetaServerError
from awex.meta.layout import Layout
from awex.meta.serialize import content_key, layout_from_wire, layout_to_wire


class Store(Protocol):
    """What the store needs of a MetaServer client (``awex.meta.client.MetaClient`` is one): no import of the
    client here, which imports this module."""

    def put(self, key: str, value: Any, *, create_only: bool = False, keep: bool = False) -> None: ...

    def get(self, key: str, timeout: float | None = None) -> Any: ...

    def values(self, prefix: str) -> dict[str, Any] | None: ...


REFERENCE = "layout-ref"
_DIGEST = re.compile(r"[0-9a-f]{64}")


def table_of(layout: Layout) -> tuple[str, dict[str, Any]]:
    """``layout``'s tensor table (its wire document without the instance name) and the table's digest: the
    content key ``awex.meta.serialize.layout_from_wire`` keeps decoded layouts under, as hex."""
    doc = layout_to_wire(layout)
    key = content_key(doc)
    assert key is not None  # a layout's own document is plain data
    return key.hex(), {k: v for k, v in doc.items() if k != "instance"}


def publish(client: Store, layout: Layout, version: str) -> None:
    """Publish ``layout`` for ``version``: its table under its digest, then the reference (both again after a server
    restart)."""
    digest, table = table_of(layout)
    client.put(f"tables/{digest}", table, keep=True)
    ref = {"kind": REFERENCE, "instance": layout.instance, "table": digest}
    client.put(f"layouts/{version}/{layout.instance}", ref, keep=True)


def fetch(
    client: Store, instance: str, version: str, timeout: float | None, known: dict[bytes, Layout], doc: Any = None
) -> Layout:
    """The layout ``instance`` published for ``version`` (waiting up to ``timeout`` for it; ``doc``: what its key
    holds, read already); a table decoded before (``known``, by digest) is not downloaded again."""
    if doc is None:
        doc = client.get(f"layouts/{version}/{instance}", timeout)
    if not (isinstance(doc, dict) and doc.get("kind") == REFERENCE):
        return layout_from_wire(doc, known)
    digest = doc.get("table")
    if doc.get("instance") != instance or not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise MetaServerError(f"the layout reference of {instance!r} ({version}) is malformed")
    hit = known.get(bytes.fromhex(digest))
    if hit is not None:
        return hit.renamed(instance)
    table = client.get(f"tables/{digest}", timeout)
    if not isinstance(table, dict) or "instance" in table:
        raise MetaServerError(f"the tensor table {digest[:12]}... of {instance!r} is malformed")
    doc = dict(table, instance=instance)
    if content_key(doc) != bytes.fromhex(digest):
        raise MetaServerError(f"the tensor table of {instance!r} does not match its digest {digest[:12]}...")
    return layout_from_wire(doc, known)


def fetch_many(
    client: Store, instances: Sequence[str], version: str, timeout: float | None, known: dict[bytes, Layout]
) -> dict[str, Layout]:
    """:func:`fetch` of each of ``instances``: every reference of ``version`` read in one request, then each distinct
    table not decoded before; an instance not published yet is waited for as :func:`fetch` does."""
    prefix = f"layouts/{version}/"
    found = client.values(prefix) or {}
    return {name: fetch(client, name, version, timeout, known, found.get(prefix + name)) for name in instances}
