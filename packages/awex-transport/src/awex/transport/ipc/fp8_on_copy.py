"""FP8 on the copy: a CUDA IPC receiver that holds block-quantised FP8 weights quantises them straight from the
trainer's unquantised memory on its own GPU (``PlanOptions.quantize_on_receive``): one kernel per piece reads the
source once and writes the FP8 tiles and their ``weight_scale_inv`` into the engine's parameters, instead of the
trainer quantising into a buffer that the receiver then copies (which reads and writes the FP8 bytes once more).

The quantiser itself is given by the caller (``awex.convert.fp8.quantize_fp8_blocks``: this package does not depend
on the converters). Every piece must be whole tiles of the weight and its scales one view; a piece that is not, or
a source on another GPU (there the trainer quantises and FP8 moves over NVLink: fewer bytes on the link), is refused
when the executor is built, before any byte moves.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from awex.meta import Box
from awex.meta.plan import Transfer
from awex.meta.spec import TensorSpec
from awex.transport.ipc.spans import paired_pieces
from awex.transport.shards import LocalShards

# quantize(source, fp8 out, scale_inv out, block): the FP8 block quantiser
Quantize = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, int]], object]


def quantize_ops(
    spec: TensorSpec,
    scale: str,
    block: tuple[int, int],
    t: Transfer,
    shards: LocalShards,
    source: LocalShards,
    quantize: Quantize,
) -> list[Callable[[], None]]:
    """The kernels that quantise transfer ``t`` of weight ``spec`` from ``source``'s memory into this rank's FP8
    pieces and their scales (tensor ``scale``, one per ``block`` tile)."""
    ops = []
    for d, s, both in paired_pieces(spec.name, t, shards, source):
        if s.device != d.device:
            raise ValueError(
                f"{spec.name}: quantising on receive reads the source on this GPU; it is on {s.device} "
                f"(quantise on the sender where engines read over NVLink)"
            )
        offsets = tuple(o + b.start for o, b in zip(t.offsets, both))
        sizes = tuple(b.stop - b.start for b in both)
        box = Box(offsets, sizes)
        if any(o % b for o, b in zip(offsets, block)) or any(
            n % b and o + n != full for o, n, b, full in zip(offsets, sizes, block, spec.shape)
        ):
            raise ValueError(
                f"{spec.name}: the piece {box} cuts through {block[0]}x{block[1]} tiles: a receiver "
                "quantises whole tiles only"
            )
        tiles = Box(tuple(o // b for o, b in zip(offsets, block)), tuple(-(-n // b) for n, b in zip(sizes, block)))
        pieces = shards.pieces(scale, tiles.offsets, tiles.sizes)
        if len(pieces) != 1 or (pieces[0][0] and any(sl != slice(0, n) for sl, n in zip(pieces[0][0], tiles.sizes))):
            raise ValueError(f"{scale}: this rank's scales of {box} are not one view")
        scale_view = pieces[0][1]
        ops.append(lambda s=s, d=d, sv=scale_view: quantize(s, d, sv, block))
    return ops
