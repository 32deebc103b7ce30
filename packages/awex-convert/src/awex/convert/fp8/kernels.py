"""The Triton kernels of block-quantised FP8 on CUDA: one weight (one program per tile) and the tiles of many
weights in one launch, both through one tile function, so their results are the same bits."""

from __future__ import annotations

import logging

log = logging.getLogger("awex.convert.fp8")


_KERNELS: dict = {}


def triton_kernel():
    """The Triton kernel quantising one tile per program of one weight, or ``None`` where Triton is not
    installed; built on first use."""
    return kernels().get("one")


def kernels() -> dict:
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


def quantize_cuda(weight, block, q, s, fmax: float, tiny: float) -> None:
    kernel = triton_kernel()
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
