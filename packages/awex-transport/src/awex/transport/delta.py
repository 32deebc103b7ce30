"""Delta syncs, the encoding: each bucket travels as the 16-bit words that changed since the last version, where
that is smaller.

RL steps change few bf16 values (most updates are below half a unit in the last place), so after the first sync
a sender keeps what it last sent of each bucket and, per bucket, sends the smallest of: the positions and values of
the words that changed (4 + 2 bytes each), a bit per word and the changed values (1/8 + 2 bytes per changed word),
or the whole bucket. Receivers take the
previous version from their own views (the engine's weights are the baseline: nothing extra is kept there),
apply the changes and copy the bucket back in place.

Exactness is checked, not assumed. Every bucket carries two checksums of the sender's words: of the version it
assumes the receiver holds, and of the new one. A receiver whose words do not match the first (it missed a version,
or something else wrote its weights) or whose result does not match the second asks for the bucket whole; a
bucket that arrives whole and still does not match fails the sync. A sender keeps a bucket's new words as it sends
them and their checksums once its receiver confirmed them; a bucket not confirmed when a sync fails is forgotten,
so a failed sync costs the next one a dense copy of what it did not confirm, never a wrong weight.

Who moves the bytes: :mod:`awex.transport.p2p.delta` (a process group) and :mod:`awex.transport.ipc.delta` (CUDA
IPC). A delta sync trades the overlap of
the wave executor for fewer bytes, which pays where bytes are what costs (across nodes). Plans without relays only
(a relay would forward words its own receiver has not checked yet). What a sender keeps is bounded by
``budget_bytes``: buckets beyond it are always sent whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from awex.transport.base import TransferError

DENSE, SPARSE, BITMAP = 0, 1, 2  # whole; positions (int32) and values; a bit per word and the changed values
_BITS = (1 << torch.arange(8, dtype=torch.int32)).to(torch.uint8)
OK, WHOLE = 0, 1  # a receiver's answer: applied and checked, or send the bucket whole


def encoding(words: int, changed: int) -> tuple[int, int]:
    """How a bucket of ``words`` 16-bit words with ``changed`` of them changed travels: ``(mode, payload bytes)``,
    the smallest of positions + values, a bit per word + values, and the whole bucket (``words`` a multiple of 8)."""
    sizes = {SPARSE: changed * 6, BITMAP: words // 8 + changed * 2, DENSE: words * 2}
    mode = min(sizes, key=lambda m: (sizes[m], m == DENSE))
    return (mode, sizes[mode]) if sizes[mode] < words * 2 else (DENSE, words * 2)


def encode(words: torch.Tensor, kept: torch.Tensor) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
    """How ``words`` (int16) travel against ``kept``, what the receiver holds: ``(mode, index, values)``, where
    ``index`` is the changed positions (int32, ``SPARSE``) or a bit per word (uint8, ``BITMAP``) and ``values`` the
    changed words; ``(DENSE, None, None)`` where neither is smaller than the words themselves."""
    differs = words != kept
    changed = torch.nonzero(differs).view(-1)
    mode = encoding(words.numel(), changed.numel())[0]
    if mode == DENSE:
        return DENSE, None, None
    if mode == SPARSE:
        index = changed.to(torch.int32)
    else:
        index = pack_bits(differs)
    return mode, index, words[changed].contiguous()


_GATHER_BITS = 0x0102040810204080  # sum of 2**(56 - 7j): byte j's low bit lands on bit 56 + j, nothing else above 55


def pack_bits(flags: torch.Tensor) -> torch.Tensor:
    """A bit per flag (a contiguous bool tensor of a multiple of 8 elements): flag ``8k + j`` is bit ``j`` of byte
    ``k``. Eight flags are one int64 whose bytes are 0 or 1; one multiplication gathers their low bits into its top
    byte (torch's reduction over rows of 8 took 6x longer)."""
    eight = flags.reshape(-1).view(torch.uint8).view(torch.int64)
    return ((eight * _GATHER_BITS) >> 56).to(torch.uint8)


def fill_words(staging: torch.Tensor, size: int, copies: Sequence[Callable[[], None]]) -> torch.Tensor:
    """Run ``copies`` into a zeroed ``staging[:size]`` (gaps between regions stay zero on both sides); its words."""
    staging[:size].zero_()
    for copy in copies:
        copy()
    return staging[:size].view(torch.int16)


def positions(mode: int, index: torch.Tensor, count: int, words: int, what: str) -> torch.Tensor:
    """The changed positions an ``index`` of ``mode`` names (``SPARSE``: int32 positions, ``BITMAP``: a bit per
    word), checked: ``count`` of them, each below ``words``; :class:`TransferError` naming ``what`` otherwise."""
    if mode == SPARSE:
        where = index.long()
        if where.numel() != count or (count and not bool(((where >= 0) & (where < words)).all())):
            raise TransferError(f"{what}: positions out of range or not {count}")
        return where
    where = torch.nonzero((index.unsqueeze(1) & _BITS.to(index.device)).view(-1)).view(-1)
    if where.numel() != count:
        raise TransferError(f"{what}: {where.numel()} bits set, {count} said")
    return where
