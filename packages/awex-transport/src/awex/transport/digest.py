"""A digest of regions of canonical tensors that does not depend on how the memory holding them is cut up: the
trainer's views and an engine's views hold the same region in different pieces, layouts and dtypes, and each side
computes the same digest from its own (``verify`` mode: ``awex.engines.sync.verify``).

Each element at global position ``g`` (its flat index in the whole canonical tensor) is taken in the tensor's plan
dtype as 16-bit words (1-byte dtypes: each byte zero-extended); word ``j`` of it sits at position
``P = g * words + j``, keyed by the tensor's name (``salt``): ``p = ((P + salt + SEED) * POS) mod 2^32``, hashed as
in :mod:`awex.transport.checksum` (two 32-bit finalisers of ``p ^ w`` and ``p ^ (w << 16)``), summed mod 2^64. Sums
are order-free, so a region's digest is the sum of its pieces' and a rank's the sum of its regions'; positions and
the salt make a word moved to another place or another tensor count as a change.
"""

from __future__ import annotations

import zlib
from math import prod

import torch

from awex.transport.checksum import MASK, MIX_A, MIX_B, POS, SEED, mix
from awex.transport.shards import LocalShards, torch_dtype

MOD = 1 << 64
ROWS_ELEMENTS = 1 << 22  # elements hashed at a time (bounds the temporaries)

Digest = tuple[int, int]


def salt(name: str) -> int:
    return zlib.crc32(name.encode()) * 0x9E3779B1 & MASK


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as 16-bit words (int64, unsigned), shape ``t.shape + (words per element,)``."""
    t = t.contiguous()
    if t.element_size() == 1:
        return t.view(torch.uint8).to(torch.int64).unsqueeze(-1)
    return (t.view(torch.int16).to(torch.int64) & 0xFFFF).reshape(*t.shape, t.element_size() // 2)


def piece_digest(piece: torch.Tensor, offsets: tuple[int, ...], shape: tuple[int, ...], key: int) -> Digest:
    """The digest of ``piece``: the box of the canonical tensor of ``shape`` starting at ``offsets`` (in the tensor's
    plan dtype), its positions salted by ``key``."""
    if piece.numel() == 0:
        return 0, 0
    strides = [prod(shape[d + 1 :]) for d in range(len(shape))]
    if piece.dim() == 0:
        piece, offsets, strides = piece.reshape(1), (0,), [1]
    rows = max(1, ROWS_ELEMENTS // max(1, prod(piece.shape[1:])))
    sums = torch.zeros(2, dtype=torch.int64, device=piece.device)
    for r0 in range(0, piece.shape[0], rows):
        chunk = piece[r0 : r0 + rows]
        words = _words(chunk)
        n = words.shape[-1]
        g = torch.zeros((), dtype=torch.int64, device=piece.device)
        for d, size in enumerate(chunk.shape):
            start = offsets[d] + (r0 if d == 0 else 0)
            at = torch.arange(start, start + size, device=piece.device, dtype=torch.int64) * strides[d]
            g = g.unsqueeze(-1) + at if d else at
        if chunk.dim() > 1:
            g = g.reshape(chunk.shape)
        pos = g.unsqueeze(-1) * n + torch.arange(n, device=piece.device, dtype=torch.int64)
        p = (((pos + key + SEED) & MASK) * POS) & MASK
        sums[0] += mix(p ^ words, MIX_A).sum()
        sums[1] += mix(p ^ (words << 16), MIX_B).sum()
    a, b = sums.tolist()
    return a % MOD, b % MOD


def region_digest(
    shards: LocalShards, name: str, shape: tuple[int, ...], dtype: str, offsets: tuple[int, ...], sizes: tuple[int, ...]
) -> Digest:
    """The digest of region ``offsets``/``sizes`` of canonical tensor ``name`` (``shape``, plan dtype ``dtype``)
    as ``shards`` hold it (views of another dtype are read as the plan's: a float32 view holding a bfloat16
    tensor is narrowed, exactly); raises unless ``shards`` hold all of it."""
    want = torch_dtype(dtype)
    key = salt(name)
    a = b = 0
    for index, view in shards.pieces(name, offsets, sizes):
        starts = tuple(o + (s.start or 0) for o, s in zip(offsets, index)) if index else offsets
        da, db = piece_digest(view if view.dtype == want else view.to(want), starts, shape, key)
        a, b = (a + da) % MOD, (b + db) % MOD
    return a, b


def add(x: Digest, y: Digest) -> Digest:
    return (x[0] + y[0]) % MOD, (x[1] + y[1]) % MOD
