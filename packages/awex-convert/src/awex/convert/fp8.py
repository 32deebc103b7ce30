"""Block-quantised FP8: quantise and dequantise tiles, and a sender's FP8 views of its own weights.

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

from awex.meta import Box, Layout
from awex.meta.quant import Fp8BlockQuant, scale_name

log = logging.getLogger("awex.convert.fp8")

ViewOf = Callable[[str, Box], "torch.Tensor | Sequence[tuple[Box, torch.Tensor]]"]
_CHUNK_ELEMENTS = 1 << 24  # float32 temporaries while quantising: at most ~64 MiB at a time


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def quantize_fp8_blocks(
    weight: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    out: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a 2-D weight tile by tile: returns ``(fp8 weight, float32 scale_inv)``.

    Tiles start at ``weight[0, 0]`` (a box of whole tiles of a larger tensor quantises exactly as the whole
    tensor would); the last row and column of tiles may be short. ``out`` / ``scale_out`` receive the result in
    place when given. An all-zero tile gets the smallest positive scale and quantises to zeros. On CUDA a Triton
    kernel does it in one pass (bit-identical to the portable path, checked by the GPU tests).
    """
    if weight.dim() != 2:
        raise ValueError(f"FP8 block quantisation needs a 2-D weight, got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    br, bc = block
    n_r, n_c = -(-rows // br), -(-cols // bc)
    q = out if out is not None else torch.empty((rows, cols), dtype=dtype, device=weight.device)
    s = scale_out if scale_out is not None else torch.empty((n_r, n_c), dtype=torch.float32, device=weight.device)
    if tuple(q.shape) != (rows, cols) or q.dtype != dtype:
        raise ValueError(f"out must be {dtype} of shape {(rows, cols)}, got {q.dtype} {tuple(q.shape)}")
    if tuple(s.shape) != (n_r, n_c) or s.dtype != torch.float32:
        raise ValueError(f"scale_out must be float32 of shape {(n_r, n_c)}, got {s.dtype} {tuple(s.shape)}")
    fmax = fp8_max(dtype)
    tiny = torch.finfo(torch.float32).tiny
    if weight.is_cuda and rows and cols and not (br & (br - 1) or bc & (bc - 1)) and _triton_kernel() is not None:
        _quantize_cuda(weight, block, q, s, fmax, tiny)
        return q, s
    step = max(1, _CHUNK_ELEMENTS // max(1, br * n_c * bc))  # tile rows per chunk
    for t0 in range(0, n_r, step):
        t1 = min(n_r, t0 + step)
        r0, r1 = t0 * br, min(rows, t1 * br)
        part = weight[r0:r1].float()
        padded = part
        if (r1 - r0) != (t1 - t0) * br or cols != n_c * bc:  # pad the short last tiles with zeros
            padded = part.new_zeros(((t1 - t0) * br, n_c * bc))
            padded[: r1 - r0, :cols] = part
        tiles = padded.view(t1 - t0, br, n_c, bc)
        scale = (tiles.abs().amax(dim=(1, 3), keepdim=True) / fmax).clamp_(min=tiny)
        quantised = (tiles / scale).clamp_(-fmax, fmax).view((t1 - t0) * br, n_c * bc)
        q[r0:r1].copy_(quantised[: r1 - r0, :cols])
        s[t0:t1].copy_(scale.view(t1 - t0, n_c))
    return q, s


_KERNELS: dict = {}


def _triton_kernel():
    """The Triton kernel quantising one tile per program of one weight, or ``None`` where Triton is not
    installed; built on first use."""
    return _kernels().get("one")


def _kernels() -> dict:
    """``{"one": kernel over one weight, "batched": kernel over the tiles of many}`` (both through one tile
    function, so their results are the same bits), or ``{}`` without Triton."""
    if "built" in _KERNELS:
        return _KERNELS["built"]
    try:
        import triton
        import triton.language as tl
    except ImportError:
        _KERNELS["built"] = {}
        return {}

    @triton.jit
    def quantize_tile(
        x,
        q,
        s,
        tr,
        tc,
        rows,
        cols,
        sxr,
        sxc,
        sqr,
        sqc,
        fmax,
        tiny,
        BR: tl.constexpr,
        BC: tl.constexpr,
        SUB: tl.constexpr,
    ):
        # Two passes over the tile in SUB-row chunks: its largest magnitude, then the quotients (the second read
        # hits the cache, which the first asks to keep the tile). A correctly rounded division per element costs
        # more than the memory traffic (docs/performance.md), so each quotient is q0 = v * RN(1/scale), corrected
        # once: RN(q0 + RN(v - q0 * scale) * RN(1/scale)) with FMAs. By Markstein's theorem (a reciprocal within
        # half an ulp, a first quotient within one ulp, exact FMA remainders) that is the correctly rounded
        # quotient, as torch's division gives, except below the normal range, where every quotient becomes an
        # FP8 zero anyway. Signed zeros are kept as they are.
        # Returns the tile's scale; ``s`` is where to store it.
        c = tc * BC + tl.arange(0, BC)
        amax = 0.0
        for i in tl.static_range(BR // SUB):
            r = tr * BR + i * SUB + tl.arange(0, SUB)
            mask = (r[:, None] < rows) & (c[None, :] < cols)
            ptrs = x + r[:, None] * sxr + c[None, :] * sxc
            v = tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)  # kept for pass 2
            amax = tl.maximum(amax, tl.max(tl.max(tl.abs(v), axis=1), axis=0))
        scale = tl.maximum(tl.math.div_rn(amax, fmax), tiny)  # as torch: correctly rounded
        inv = tl.math.div_rn(1.0, scale)
        for i in tl.static_range(BR // SUB):
            r = tr * BR + i * SUB + tl.arange(0, SUB)
            mask = (r[:, None] < rows) & (c[None, :] < cols)
            ptrs = x + r[:, None] * sxr + c[None, :] * sxc
            v = tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)  # read last
            q0 = v * inv
            out = tl.where(v == 0.0, v, tl.math.fma(tl.math.fma(-q0, scale, v), inv, q0))
            out = tl.minimum(tl.maximum(out, -fmax), fmax)
            tl.store(q + r[:, None] * sqr + c[None, :] * sqc, out.to(q.dtype.element_ty), mask=mask)
        tl.store(s, scale)

    @triton.jit
    def quantize_tiles(
        x,
        q,
        s,
        rows,
        cols,
        sxr,
        sxc,
        sqr,
        sqc,
        ssr,
        ssc,
        fmax,
        tiny,
        BR: tl.constexpr,
        BC: tl.constexpr,
        SUB: tl.constexpr,
    ):
        tr = tl.program_id(0)
        tc = tl.program_id(1)
        quantize_tile(x, q, s + tr * ssr + tc * ssc, tr, tc, rows, cols, sxr, sxc, sqr, sqc, fmax, tiny, BR, BC, SUB)

    @triton.jit
    def quantize_many_tiles(
        x,
        q,
        s,
        pieces,
        tile_piece,
        fmax,
        tiny,
        BR: tl.constexpr,
        BC: tl.constexpr,
        SUB: tl.constexpr,
        XA: tl.constexpr,
        QA: tl.constexpr,
    ):
        # One program per tile of any piece: ``tile_piece`` says whose, ``pieces`` (int64 rows of _PIECE_FIELDS)
        # where it lies, as element offsets from the base pointers ``x``, ``q``, ``s``. Every piece is contiguous
        # along columns, its offsets and row strides multiples of 16 bytes (XA, QA elements), its width a
        # multiple of 16: loads and stores are vectorised as in the one-weight kernel.
        i = tl.program_id(0)
        p = tl.load(tile_piece + i).to(tl.int64) * 10
        x_off = tl.multiple_of(tl.load(pieces + p), XA)
        q_off = tl.multiple_of(tl.load(pieces + p + 1), QA)
        s_off = tl.load(pieces + p + 2)
        rows = tl.load(pieces + p + 3)
        cols = tl.multiple_of(tl.load(pieces + p + 4), 16)
        sxr = tl.multiple_of(tl.load(pieces + p + 5), XA)
        sqr = tl.multiple_of(tl.load(pieces + p + 6), QA)
        ssr = tl.load(pieces + p + 7)
        first = tl.load(pieces + p + 8)
        tile_cols = tl.load(pieces + p + 9)
        local = i - first
        tr = local // tile_cols
        tc = local - tr * tile_cols
        quantize_tile(
            x + x_off, q + q_off, s + s_off + tr * ssr + tc, tr, tc, rows, cols, sxr, 1, sqr, 1, fmax, tiny, BR, BC, SUB
        )

    _KERNELS["built"] = {"one": quantize_tiles, "batched": quantize_many_tiles}
    return _KERNELS["built"]


def _quantize_cuda(weight, block, q, s, fmax: float, tiny: float) -> None:
    kernel = _triton_kernel()
    rows, cols = weight.shape
    br, bc = block
    grid = (s.shape[0], s.shape[1])
    kernel[grid](
        weight,
        q,
        s,
        rows,
        cols,
        weight.stride(0),
        weight.stride(1),
        q.stride(0),
        q.stride(1),
        s.stride(0),
        s.stride(1),
        fmax,
        tiny,
        BR=br,
        BC=bc,
        SUB=min(br, 128),
        num_warps=4,
    )


Piece = tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]  # (source, FP8 out, float32 scale_inv out)
# the batched kernel's rows per load and warps per program (the fastest of 4-16 warps and 32-128 rows on H100 and
# H200: docs/performance.md)
_BATCHED_SUB_ROWS, _BATCHED_WARPS = 128, 8


class BatchedFp8Quantizer:
    """Many weights quantised by one call, each as :func:`quantize_fp8_blocks` would (the same bits): built once
    over ``pieces`` (``(source, fp8 out, scale_inv out)``, 2-D, tiles of ``block`` from each source's
    ``[0, 0]``), run by calling it on the current stream (capturable in a CUDA graph). The tensors must stay
    where they are.

    On CUDA with Triton, the pieces that are contiguous along columns and 16-byte aligned (rows and widths too)
    go as one kernel launch per source dtype and FP8 dtype, one program per tile of any piece: a launch per piece
    leaves most of the GPU idle on small pieces (one query group's K rows of a fused QKV are 32 tiles) and
    between launches. The other pieces, and every piece off CUDA, go one :func:`quantize_fp8_blocks` call each.
    """

    def __init__(self, pieces: Sequence[Piece], block: tuple[int, int] = (128, 128)):
        self.block = block
        br, bc = block
        kernels = _kernels()
        groups: dict[tuple, list[Piece]] = {}
        self._apart: list[Piece] = []
        for source, out, scale_out in pieces:
            _check_outputs(source, block, out, scale_out)
            if _batchable(source, out, scale_out, block) and kernels:
                groups.setdefault((source.dtype, out.dtype, source.device), []).append((source, out, scale_out))
            else:
                self._apart.append((source, out, scale_out))
        self._launches = [_BatchedLaunch(group, block) for group in groups.values()]
        self.tiles = sum(launch.tiles for launch in self._launches)
        self.launches = len(self._launches) + len(self._apart)

    @torch.no_grad()
    def __call__(self) -> None:
        for launch in self._launches:
            launch()
        for source, out, scale_out in self._apart:
            quantize_fp8_blocks(source, self.block, out.dtype, out=out, scale_out=scale_out)


def _check_outputs(source: torch.Tensor, block: tuple[int, int], out: torch.Tensor, scale_out: torch.Tensor) -> None:
    if source.dim() != 2:
        raise ValueError(f"FP8 block quantisation needs a 2-D weight, got shape {tuple(source.shape)}")
    rows, cols = source.shape
    tiles = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(out.shape) != (rows, cols) or out.element_size() != 1 or not out.dtype.is_floating_point:
        raise ValueError(f"out must be an FP8 tensor of shape {(rows, cols)}, got {out.dtype} {tuple(out.shape)}")
    if tuple(scale_out.shape) != tiles or scale_out.dtype != torch.float32:
        raise ValueError(f"scale_out must be float32 of shape {tiles}, got {scale_out.dtype} {tuple(scale_out.shape)}")
    if not (source.device == out.device == scale_out.device):
        raise ValueError(
            f"source, out and scale_out on one device, got {source.device}, {out.device}, {scale_out.device}"
        )


def _batchable(source: torch.Tensor, out: torch.Tensor, scale_out: torch.Tensor, block: tuple[int, int]) -> bool:
    rows, cols = source.shape
    br, bc = block
    return (
        source.is_cuda
        and rows > 0
        and cols % 16 == 0
        and not (br & (br - 1) or bc & (bc - 1))
        and bc >= 16
        and source.stride(1) == 1
        and out.stride(1) == 1
        and scale_out.stride(1) == 1
        and all(t.data_ptr() % 16 == 0 for t in (source, out))
        and (source.stride(0) * source.element_size()) % 16 == 0
        and out.stride(0) % 16 == 0
    )


class _BatchedLaunch:
    """One launch of the batched kernel over pieces of one source dtype, FP8 dtype and device."""

    def __init__(self, pieces: Sequence[Piece], block: tuple[int, int]):
        source, out, scale_out = pieces[0]
        self._x, self._q, self._s = source, out, scale_out  # base pointers (kept alive)
        self._keep = list(pieces)
        br, bc = block
        rows_of, first = [], 0
        counts = []
        for x, q, s in pieces:
            rows, cols = x.shape
            tiles_r, tiles_c = -(-rows // br), -(-cols // bc)
            rows_of.append(
                [
                    (x.data_ptr() - source.data_ptr()) // x.element_size(),
                    q.data_ptr() - out.data_ptr(),
                    (s.data_ptr() - scale_out.data_ptr()) // 4,
                    rows,
                    cols,
                    x.stride(0),
                    q.stride(0),
                    s.stride(0),
                    first,
                    tiles_c,
                ]
            )
            counts.append(tiles_r * tiles_c)
            first += tiles_r * tiles_c
        device = source.device
        self.tiles = first
        self._pieces = torch.tensor(rows_of, dtype=torch.int64).view(-1).to(device)
        self._tile_piece = torch.repeat_interleave(
            torch.arange(len(pieces), dtype=torch.int32), torch.tensor(counts)
        ).to(device)
        self._config = dict(
            BR=br,
            BC=bc,
            SUB=min(br, _BATCHED_SUB_ROWS),
            XA=16 // source.element_size(),
            QA=16,
            num_warps=_BATCHED_WARPS,
        )
        self._fmax = fp8_max(out.dtype)
        self._tiny = torch.finfo(torch.float32).tiny
        self._compile()

    def _args(self) -> tuple:
        return self._x, self._q, self._s, self._pieces, self._tile_piece, self._fmax, self._tiny

    def _compile(self) -> None:
        """Compile the kernel now, without running it, so that a CUDA graph can capture the first call."""
        try:
            _kernels()["batched"].warmup(*self._args(), **self._config, grid=(self.tiles,))
        except (AttributeError, TypeError) as e:  # a Triton without warmup(): it compiles on the first call
            log.debug("Triton warmup unavailable (%s); the kernel compiles on first use", e)

    def __call__(self) -> None:
        _kernels()["batched"][(self.tiles,)](*self._args(), **self._config)


def dequantize_fp8_blocks(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``fp8 * scale_inv`` tile by tile, in ``dtype``."""
    rows, cols = weight.shape
    br, bc = block
    expected = (-(-rows // br), -(-cols // bc))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"scale_inv of shape {tuple(scale_inv.shape)} does not tile a {rows}x{cols} weight "
            f"in {br}x{bc} blocks (expected {expected})"
        )
    full = scale_inv.float().repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return (weight.float() * full).to(dtype)


class Fp8Views:
    """A sender rank's FP8 views: for each quantised weight box it holds, an FP8 buffer and its scale tiles.

    ``view_of`` answers for the FP8 layout (quantised weights and scales from the buffers, everything else from
    the wrapped ``view_of``); :meth:`quantize` refills the buffers from the current weights (call it before
    each write: ``WeightsWriter(..., refresh=fp8.quantize)`` does).

    Every box, and every piece of a box the native layout splits (Megatron's per-group QKV) where the pieces are
    whole tiles, is quantised where it lies by one :class:`BatchedFp8Quantizer` launch (other boxes are assembled
    first). On CUDA the whole quantisation is captured as one CUDA graph on the second call and replayed from then
    on: the weights must stay where they are, as for every other view a sync uses. ``cuda_graph=False`` keeps it
    eager.
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
                    raise ValueError(
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

    def view_of(self, name: str, box: Box):
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
        memory pool and are replayed in capture order, one wave after the other.
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
                graphs.append(graph)
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

        eager: dict[int, Callable[[], None]] = {}

        @torch.no_grad()
        def quantize_wave(i: int) -> None:
            if graphs is not None:
                if graphs[i] is not None:
                    graphs[i].replay()
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
