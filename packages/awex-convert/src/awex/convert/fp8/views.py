"""A sender's FP8 views of its own weights (:class:`Fp8Views`), quantised before each write.

The format (``awex.meta.quant``): ``X.weight`` in ``float8_e4m3fn`` and ``X.weight_scale_inv`` in float32, one
scale per 128 x 128 tile, ``weight ~= fp8 * scale_inv``. A tile's scale is its largest magnitude over the FP8
maximum (448 for e4m3), as vLLM's and DeepSeek's quantisers compute it, so each tile uses the whole FP8 range.

A trainer that trains in bf16/fp32 and feeds FP8 inference engines quantises on the fly::

    quant = Fp8BlockQuant.from_hf_config(inference_config)
    fp8_layout = quantize_layout(layout, quant)                  # what this rank sends, scales included
    fp8 = Fp8Views(fp8_layout, rank, view_of, quant)             # buffers for this rank's FP8 tiles
    writer = WeightsWriter(client, fp8_layout, rank, fp8.view_of, refresh=fp8.quantize)

Before each write the writer calls ``fp8.quantize()``, which quantises this rank's current weights into those
buffers (extra memory: one byte per quantised weight element, plus the scales); the transport then sends them
as they are: FP8 and scales on the wire, never a silently dequantised copy.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch

from awex.convert.fp8.batched import BatchedFp8Quantizer, Piece
from awex.convert.fp8.blocks import quantize_fp8_blocks
from awex.meta import Box, Layout
from awex.meta.errors import AwexValueError
from awex.meta.quant import Fp8BlockQuant, scale_name

log = logging.getLogger("awex.convert.fp8")


ViewOf = Callable[[str, Box], "torch.Tensor | Sequence[tuple[Box, torch.Tensor]]"]


class Fp8Views:
    """A sender rank's FP8 views: for each quantised weight box it holds, an FP8 buffer and its scale tiles.

    ``view_of`` answers for the FP8 layout (quantised weights and scales from the buffers, everything else from
    the wrapped ``view_of``); :meth:`quantize` refills the buffers from the current weights (call it before
    each write: ``WeightsWriter(..., refresh=fp8.quantize)`` does).

    Every box, and every piece of a box the native layout splits (Megatron's per-group QKV) where the pieces are
    whole tiles, is quantised where it lies by one :class:`BatchedFp8Quantizer` launch (other boxes are assembled
    first). On CUDA the whole quantisation is captured as one CUDA graph on the second call and replayed from then
    on (``cuda_graph=False`` keeps it eager). Weights that move (offloaded and loaded back, ``param.data``
    replaced) are followed where the wrapped ``view_of`` has a ``fingerprint()`` (``awex.convert``'s views do):
    the quantisers and graphs are built again from where the weights are now; ``view_of`` carries that
    fingerprint, so the writer re-derives views only then.
    """

    def __init__(self, layout: Layout, local_rank: int, view_of: ViewOf, quant: Fp8BlockQuant, cuda_graph: bool = True):
        self.quant = quant
        self.cuda_graph = cuda_graph
        self._graph: torch.cuda.CUDAGraph | None = None
        self._all: Callable[[], None] | None = None  # quantises every box (built on the first call)
        self._calls = 0
        self._source = view_of
        self._dtype = getattr(torch, quant.dtype)
        self._weights: dict[tuple[str, Box], torch.Tensor] = {}
        self._scales: dict[tuple[str, Box], tuple[torch.Tensor, str, Box]] = {}
        self._scale_of: dict[tuple[str, Box], torch.Tensor] = {}
        self.quantized_bytes = 0
        for name, boxes in layout.rank_boxes(local_rank).items():
            spec = layout.tensor(name).spec
            if spec.dtype != quant.dtype or scale_name(name) not in layout:
                continue
            for box in boxes:
                if not quant.whole_tiles(box, spec.shape):
                    raise AwexValueError(
                        f"{layout.instance} rank {local_rank}: {name} {box} cuts through "
                        f"{quant.block} FP8 tiles; a sender must hold whole tiles"
                    )
                device = _device_of(view_of(name, box))
                weight = torch.empty(box.sizes, dtype=self._dtype, device=device)
                image = quant.block_image(box)
                scale = torch.empty(image.sizes, dtype=torch.float32, device=device)
                self._weights[(name, box)] = weight
                self._scales[(scale_name(name), image)] = (scale, name, box)
                self._scale_of[(name, box)] = scale
                self.quantized_bytes += weight.numel() + 4 * scale.numel()

        self._source_print = getattr(view_of, "fingerprint", None)
        self._print = self._source_print() if callable(self._source_print) else None
        self._moves = 0
        self.view_of: ViewOf = self._fingerprinted_view_of()

    def _fingerprinted_view_of(self) -> ViewOf:
        """What the writer asks for views: the FP8 buffers (which never move) and the wrapped ``view_of``'s views,
        with its ``fingerprint()`` where it has one (the writer then re-derives views only when it changed), and its
        ``addresses()`` and ``forms()`` where it has those (a steady version then checks the addresses before any
        byte moves and the forms beside the transfer, as for bf16 views: ``awex.transport.rebind.rebound``)."""

        def view_of(name: str, box: Box):
            return self._view(name, box)

        if callable(self._source_print):
            view_of.fingerprint = self._source_print
            for part in ("addresses", "forms"):
                found = getattr(self._source, part, None)
                if callable(found):
                    setattr(view_of, part, found)
        return view_of

    def _generation(self) -> int:
        """How many times the weights moved since the quantisers were first built (by the wrapped ``view_of``'s
        fingerprint): each time they are built again, from the weights where they are now. Without a fingerprint
        the weights must stay where they are (every ``awex.convert`` view has one)."""
        if callable(self._source_print):
            now = self._source_print()
            if now != self._print:
                self._print, self._moves = now, self._moves + 1
                self._graph = self._all = None
                self._calls = 0
                log.info("weights moved: FP8 quantisation rebuilt from where they are now")
        return self._moves

    def _view(self, name: str, box: Box):
        buf = self._weights.get((name, box))
        if buf is not None:
            return buf
        scale = self._scales.get((name, box))
        if scale is not None:
            return scale[0]
        return self._source(name, box)

    @torch.no_grad()
    def quantize(self) -> None:
        """Quantise this rank's current weights into the FP8 buffers (before each write)."""
        self._generation()
        self._calls += 1
        on_cuda = any(w.is_cuda for w in self._weights.values())
        if self._graph is None and self.cuda_graph and on_cuda and self._calls >= 2:  # the first call compiled
            try:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    self._quantize_eagerly()
                self._graph = graph
            except RuntimeError as e:  # capture is an optimisation
                log.warning("CUDA graph capture of FP8 quantisation failed (%s); quantising eagerly", e)
                self.cuda_graph = False
        if self._graph is not None:
            self._graph.replay()
        else:
            self._quantize_eagerly()

    def _quantize_eagerly(self) -> None:
        if self._all is None:
            self._all = self._runner(list(self._weights))
        self._all()
        log.debug("quantised %d FP8 boxes (%d bytes)", len(self._weights), self.quantized_bytes)

    def _runner(self, keys: Sequence[tuple[str, Box]]) -> Callable[[], None]:
        """What quantises the boxes ``keys``: one :class:`BatchedFp8Quantizer` over every piece of whole tiles (a
        box's own view, or each piece of a box the native layout splits, such as Megatron's per-group QKV, straight
        from where it lies), and, for a box whose pieces cut through tiles, its pieces assembled first."""
        pieces: list[Piece] = []
        apart: list[tuple[str, Box]] = []
        for key in keys:
            found = self._pieces_of(key)
            if found is None:
                apart.append(key)
            else:
                pieces.extend(found)
        batched = BatchedFp8Quantizer(pieces, self.quant.block) if pieces else None

        def run() -> None:
            if batched is not None:
                batched()
            for key in apart:
                self._quantize_box(key)

        return run

    def _pieces_of(self, key: tuple[str, Box]) -> list[Piece] | None:
        """``(source piece, FP8 piece, scale tiles)`` for each piece of a box, or ``None`` where a piece is not
        whole tiles of the box."""
        name, box = key
        answer = self._source(name, box)
        out, scale = self._weights[key], self._scale_of[key]
        if isinstance(answer, torch.Tensor):
            return [(answer, out, scale)]
        pieces = []
        for sub, view in answer:
            rel = sub.relative_to(box)
            if view.dim() != 2 or not self.quant.whole_tiles(rel, box.sizes):
                return None
            tiles = self.quant.block_image(rel)
            pieces.append((view, out[rel.slices()], scale[tiles.slices()]))
        return pieces

    @torch.no_grad()
    def _capture_waves(self, per_wave: list[list[tuple[str, Box]]]) -> list | None:
        """One CUDA graph per wave (a launch each instead of one per box), or ``None`` (CPU, or capture failed).

        Captured here, before any sync runs, after one eager pass that compiles the kernels; the graphs share a
        memory pool and are replayed in capture order, one wave after the other. Each graph is kept with the runner
        it captured: a graph reads its runner's launch tables (device memory the runner owns) at every replay, and
        tables freed once capture returned were reused by the next allocations (an illegal memory access, or FP8
        tiles quantised from another tensor's bytes, from the second version on).
        """
        if not self.cuda_graph or not any(w.is_cuda for w in self._weights.values()):
            return None
        runners = [self._runner(keys) if keys else None for keys in per_wave]
        for run in runners:
            if run is not None:
                run()
        pool = torch.cuda.graph_pool_handle()
        graphs: list = []
        try:
            for run in runners:
                if run is None:
                    graphs.append(None)
                    continue
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    run()
                graphs.append((graph, run))  # the runner lives as long as its graph
        except RuntimeError as e:  # capture is an optimisation
            log.warning("CUDA graph capture of per-wave FP8 quantisation failed (%s); quantising eagerly", e)
            return None
        return graphs

    def _quantize_box(self, key: tuple[str, Box]) -> None:
        name, box = key
        source = _assemble(self._source(name, box), box)
        quantize_fp8_blocks(
            source, self.quant.block, self._dtype, out=self._weights[key], scale_out=self._scale_of[key]
        )

    def by_wave(self, sent: Sequence[Sequence[tuple[str, tuple[int, ...], tuple[int, ...]]]]) -> Callable[[int], None]:
        """Quantise wave by wave instead of all at once: ``sent[i]`` lists the regions ``(name, offsets, sizes)``
        the sender's wave ``i`` sends (``WaveExecutor.sent_regions``); the returned ``quantize_wave(i)``
        quantises the boxes wave ``i`` is the first to read (weights or scales), so quantising overlaps the
        earlier waves on the wire (``WaveExecutor.run(before_pack=...)``). Boxes no wave reads are skipped.
        """
        holders: dict[str, list[tuple[Box, tuple[str, Box]]]] = {}
        for key in self._weights:
            holders.setdefault(key[0], []).append((key[1], key))
        for (sname, image), (_, name, box) in self._scales.items():
            holders.setdefault(sname, []).append((image, (name, box)))
        first: dict[tuple[str, Box], int] = {}
        for i, regions in enumerate(sent):
            for name, offsets, sizes in regions:
                region = Box(tuple(offsets), tuple(sizes))
                for box, key in holders.get(name, ()):
                    if key not in first and box.intersect(region) is not None:
                        first[key] = i
        per_wave: list[list[tuple[str, Box]]] = [[] for _ in sent]
        for key in self._weights:  # in this rank's box order
            if key in first:
                per_wave[first[key]].append(key)
        graphs = self._capture_waves(per_wave)
        captured = self._moves
        eager: dict[int, Callable[[], None]] = {}

        @torch.no_grad()
        def quantize_wave(i: int) -> None:
            nonlocal graphs, captured
            if i == 0 and self._generation() != captured:  # the weights moved: capture from where they are now
                eager.clear()
                graphs, captured = self._capture_waves(per_wave), self._moves
            if graphs is not None:
                if graphs[i] is not None:
                    graphs[i][0].replay()
                return
            if per_wave[i]:
                if i not in eager:
                    eager[i] = self._runner(per_wave[i])
                eager[i]()

        return quantize_wave


def _device_of(answer) -> torch.device:
    if isinstance(answer, torch.Tensor):
        return answer.device
    return next(iter(answer))[1].device


def _assemble(answer, box: Box) -> torch.Tensor:
    """One tensor of the box's shape from a view or from ``(sub_box, view)`` pieces (copied together)."""
    if isinstance(answer, torch.Tensor):
        return answer
    pieces = list(answer)
    out = torch.empty(box.sizes, dtype=pieces[0][1].dtype, device=pieces[0][1].device)
    for sub, view in pieces:
        out[sub.relative_to(box).slices()] = view
    return out
