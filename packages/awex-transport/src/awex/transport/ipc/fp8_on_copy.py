"""FP8 on the copy: a CUDA IPC receiver that holds block-quantised FP8 weights quantises them straight from the
trainer's unquantised memory on its own GPU (``PlanOptions.quantize_on_receive``): the quantiser reads each piece
of the source once and writes the FP8 tiles and their ``weight_scale_inv`` into the engine's parameters, instead of
the trainer quantising into a buffer that the receiver then copies (which reads and writes the FP8 bytes once more).

The quantiser itself is given by the caller (``awex.convert.fp8.BatchedFp8Quantizer``: all pieces of a block size
in one launch; this package does not depend on the converters). Every piece must be whole tiles of the weight and
its scales one view; a piece that is not, or a source on another GPU (there the trainer quantises and FP8 moves
over NVLink: fewer bytes on the link), is refused when the executor is built, before any byte moves.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from awex.meta import Box
from awex.meta.errors import AwexValueError
from awex.meta.plan import Transfer
from awex.meta.spec import TensorSpec
from awex.transport.ipc.spans import paired_pieces
from awex.transport.shards import LocalShards

Piece = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (source, FP8 out, float32 scale_inv out)
# quantizer(pieces, block): built once, returns what quantises all the pieces when called (capturable)
Quantize = Callable[[list[Piece], tuple[int, int]], Callable[[], None]]


def quantize_pieces(
    spec: TensorSpec, scale: str, block: tuple[int, int], t: Transfer, shards: LocalShards, source: LocalShards
) -> list[Piece]:
    """What quantises transfer ``t`` of weight ``spec``: ``(source piece, this rank's FP8 piece, its scales)``
    (tensor ``scale``, one per ``block`` tile), each piece whole tiles."""
    out = []
    for d, s, both in paired_pieces(spec.name, t, shards, source):
        if s.device != d.device:
            raise AwexValueError(
                f"{spec.name}: quantising on receive reads the source on this GPU; it is on {s.device} "
                f"(quantise on the sender where engines read over NVLink)"
            )
        offsets = tuple(o + b.start for o, b in zip(t.offsets, both))
        sizes = tuple(b.stop - b.start for b in both)
        box = Box(offsets, sizes)
        if any(o % b for o, b in zip(offsets, block)) or any(
            n % b and o + n != full for o, n, b, full in zip(offsets, sizes, block, spec.shape)
        ):
            raise AwexValueError(
                f"{spec.name}: the piece {box} cuts through {block[0]}x{block[1]} tiles: a receiver "
                "quantises whole tiles only"
            )
        tiles = Box(tuple(o // b for o, b in zip(offsets, block)), tuple(-(-n // b) for n, b in zip(sizes, block)))
        pieces = shards.pieces(scale, tiles.offsets, tiles.sizes)
        if len(pieces) != 1 or (pieces[0][0] and any(sl != slice(0, n) for sl, n in zip(pieces[0][0], tiles.sizes))):
            raise AwexValueError(f"{scale}: this rank's scales of {box} are not one view")
        scale_view = pieces[0][1]
        out.append((s, d, scale_view))
    return out


def quantizers(pieces: dict[tuple[int, int], list[Piece]], quantize: Quantize) -> list[Callable[[], None]]:
    """One quantiser per tile block over all its pieces."""
    return [quantize(group, block) for block, group in pieces.items()]
