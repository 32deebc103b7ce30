"""How one bucket's transfers lie in one message: offsets aligned to :data:`ALIGN` bytes, the same on both ends. Used
by the point-to-point executors (waves, delta) and the CUDA IPC delta path."""

from __future__ import annotations

from collections.abc import Sequence

from awex.meta.plan import Transfer

ALIGN = 16


def align(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-n // ALIGN) * ALIGN


def message_offsets(transfers: Sequence[Transfer]) -> tuple[list[int], int]:
    """Byte offset of each transfer inside one message, and the message size (offsets aligned to ``ALIGN``)."""
    offsets = []
    pos = 0
    for t in transfers:
        pos = -(-pos // ALIGN) * ALIGN
        offsets.append(pos)
        pos += t.nbytes
    return offsets, pos
