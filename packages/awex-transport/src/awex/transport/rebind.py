"""Re-binding a rank's views before a version: memory that moved (offloaded and loaded back, ``param.data``
replaced, resharded) gets new views before any byte moves, never the old memory's bytes; the same memory keeps the
views it had (a steady version asks for no view).

:func:`rebound` checks before any byte moves (by each tensor's address where ``quick``), :func:`confirm_bound` the
rest while the bytes move. Views of tensors that moved whole are re-pointed (``awex.transport.moved_views``),
others derived again (:meth:`~awex.transport.shards.LocalShards.from_layout`).
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch

from awex.meta import Box, Layout
from awex.transport.moved_views import recipe, repointed
from awex.transport.shards import LocalShards, ShardMismatchError

log = logging.getLogger("awex.transport")


def rebound(
    layout: Layout,
    local_rank: int,
    view_of: Callable[[str, Box], torch.Tensor | Sequence[tuple[Box, torch.Tensor]]],
    held: LocalShards,
    quick: bool = False,
) -> tuple[LocalShards, list[str]]:
    """The views ``view_of`` gives now, checked as :meth:`LocalShards.from_layout` checks them: ``(held, [])`` when
    each aliases the memory it did, else ``(new views, the tensors that moved)``. Memory that moved to another kind
    of device (a trainer that offloaded and did not load back) is refused, naming a tensor, before any byte moves.
    A re-bind is logged.

    A ``view_of`` with a ``fingerprint()`` (``awex.convert`` views: where every tensor they are taken from is now)
    is asked for its views only when the fingerprint changed since ``held`` was taken: checking a Qwen3-8B-shaped
    rank's 399 views every version took 10-12 ms, its fingerprint well under one. With ``quick`` and a ``view_of``
    that also has ``addresses()`` and ``forms()`` (its fingerprint is ``(addresses(), forms())``), ``held`` is kept
    when the addresses alone are unchanged (every tensor at the address and of the size it had: no byte can go
    to memory the views do not own) and marked unconfirmed: :func:`confirm_bound`, while the bytes move, checks
    the rest (a tensor changed in place at the same address)."""
    if quick and held.fingerprint is not None and callable(getattr(view_of, "forms", None)):
        if _asked(view_of, "addresses") == held.fingerprint[0]:
            held.unconfirmed = True
            return held, []
    now_print = _asked(view_of, "fingerprint")  # None: the views are asked again (and a tensor gone is named)
    held.unconfirmed = False
    if now_print is not None and now_print == held.fingerprint:
        return held, []
    tensors = _sources(view_of) if now_print is not None else None
    found = None
    if tensors is not None and held.sources_at is not None and held.fingerprint is not None:
        if held.recipe is None:  # where its views lie in the tensors, found once (kept while their forms are)
            held.recipe = recipe(held, held.sources_at, held.fingerprint[1])
        if held.recipe is not None:  # only the addresses changed: the views re-pointed, not derived again
            found = repointed(held, held.recipe, held.sources_at, tensors, now_print[1])
    if found is not None:
        now, moved, at = found
        now.recipe = held.recipe
    else:
        now = LocalShards.from_layout(layout, local_rank, view_of, held.device if held.on_host else None)
        moved = now.moved(held)
        at = tuple([t.data_ptr() for t in tensors]) if tensors is not None else None
    now.fingerprint, now.sources_at = now_print, at
    if not moved:
        held.fingerprint, held.sources_at = now_print, at
        return held, []
    _same_kind(layout, local_rank, now, held.device, moved)
    how = "re-pointed" if found is not None else "re-bound"
    log.info("%s:%d: %d tensor(s) moved (%s...): %s", layout.instance, local_rank, len(moved), moved[0], how)
    return now, moved


def taken_again(layout: Layout, local_rank: int, view_of: Callable, device: torch.device) -> LocalShards:
    """The views ``view_of`` gives now, taken whole, for a rank that let go of its last ones (a writer that holds no
    trainer memory between versions); memory now on another kind of device than ``device`` (weights offloaded and not
    loaded back) is refused, naming a tensor, before any byte moves."""
    now = LocalShards.from_layout(layout, local_rank, view_of)
    _same_kind(layout, local_rank, now, device, now.names())
    now.fingerprint = _asked(view_of, "fingerprint")  # the next version's quick check starts from these
    return now


def _same_kind(layout: Layout, local_rank: int, now: LocalShards, was: torch.device, names: Sequence[str]) -> None:
    if now.device.type != was.type:
        off = next(n for n in names if any(v.device.type != was.type for _, v in now.pairs(n)))
        raise ShardMismatchError(
            f"{layout.instance} rank {local_rank}: {off} is on {now.device} now, it was on {was}: weights "
            f"offloaded to another kind of device must be loaded back before they are sent"
        )


def _asked(view_of: Callable, what: str):
    """``view_of.<what>()`` where it has one; ``None`` where it has none or a tensor it reads is no longer one (a
    parameter set to ``None``, say): the views are then asked again, and the full check names that tensor."""
    method = getattr(view_of, what, None)
    try:
        return method() if callable(method) else None
    except (KeyError, AttributeError, TypeError):
        return None


def _sources(view_of: Callable) -> list[torch.Tensor] | None:
    """The tensors ``view_of`` derives its views from (its ``sources()``), if it names them and each is a tensor."""
    tensors = _asked(view_of, "sources")
    if tensors is None or not all(isinstance(t, torch.Tensor) for t in tensors):
        return None
    return tensors


def confirm_bound(layout: Layout, local_rank: int, view_of: Callable, held: LocalShards) -> None:
    """The rest of the check :func:`rebound` kept ``held`` on by its addresses (``quick``): raise
    :class:`ShardMismatchError` naming the tensors when one changed form in place at the same address (its bytes
    were sent or written as the old views lay them out: the version must fail), and forget ``held``'s fingerprint
    so that the next :func:`rebound` takes new views before any byte moves. Nothing to do after a full check."""
    if not held.unconfirmed:
        return
    held.unconfirmed = False
    if view_of.forms() == held.fingerprint[1]:
        return
    held.fingerprint = held.sources_at = None  # the next rebound derives the views again
    try:
        changed = LocalShards.from_layout(layout, local_rank, view_of, held.device if held.on_host else None).moved(
            held
        ) or ["a tensor"]
    except ShardMismatchError as e:  # views that no longer fit the layout at all
        changed = [str(e)]
    raise ShardMismatchError(
        f"{layout.instance} rank {local_rank}: {', '.join(changed[:5])} changed shape, strides or dtype in place (at "
        "the same address) after the version began: its bytes moved as the old views lay them out, so the version "
        "fails; the next one takes new views before any byte moves"
    )
