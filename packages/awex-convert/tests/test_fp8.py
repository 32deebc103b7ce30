"""Block FP8 quantisation: against a tile-by-tile reference, error bounds, boxes of whole tiles, sender views."""

import pytest
import torch

from awex.convert import BatchedFp8Quantizer, Fp8Views, dequantize_fp8_blocks, quantize_fp8_blocks
from awex.meta import (
    Box,
    Fp8BlockQuant,
    Layout,
    Mesh,
    MeshSharding,
    Role,
    Shard,
    TensorLayout,
    TensorSpec,
    quantize_layout,
)

E4M3 = torch.float8_e4m3fn


def reference_quantize(w, block):
    """Tile by tile, written the obvious way."""
    rows, cols = w.shape
    br, bc = block
    q = torch.empty(w.shape, dtype=E4M3)
    s = torch.empty((-(-rows // br), -(-cols // bc)))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            tile = w[i * br : (i + 1) * br, j * bc : (j + 1) * bc].float()
            scale = max(tile.abs().max().item() / 448.0, torch.finfo(torch.float32).tiny)
            s[i, j] = scale
            q[i * br : (i + 1) * br, j * bc : (j + 1) * bc] = (tile / torch.tensor(scale)).clamp(-448, 448).to(E4M3)
    return q, s


@pytest.mark.parametrize(
    "shape,block", [((256, 384), (128, 128)), ((200, 130), (128, 128)), ((64, 96), (32, 32)), ((7, 5), (4, 4))]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_tile_by_tile_reference(shape, block, dtype):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(shape, generator=g) * torch.logspace(-3, 1, shape[1])).to(dtype)
    q, s = quantize_fp8_blocks(w, block)
    rq, rs = reference_quantize(w, block)
    assert torch.equal(s, rs)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    # e4m3 keeps 3 mantissa bits: each element within half a step of its tile's grid, subnormals aside
    back = dequantize_fp8_blocks(q, s, block)
    full_scale = s.repeat_interleave(block[0], 0)[: shape[0]].repeat_interleave(block[1], 1)[:, : shape[1]]
    err = (back - w.float()).abs()
    assert torch.all(err <= w.float().abs() * 2.0**-4 + full_scale * 2.0**-9 + 1e-30)


def test_zero_tile_and_in_place_outputs():
    w = torch.zeros(128, 256)
    w[:, 128:] = torch.randn(128, 128)
    q = torch.empty(128, 256, dtype=E4M3)
    s = torch.empty(1, 2)
    quantize_fp8_blocks(w, out=q, scale_out=s)
    assert s[0, 0] > 0 and torch.all(q[:, :128].float() == 0)
    assert torch.equal(dequantize_fp8_blocks(q, s)[:, :128], w[:, :128])
    with pytest.raises(ValueError, match="scale_out must be float32 of shape"):
        quantize_fp8_blocks(w, out=q, scale_out=torch.empty(2, 2))


def test_box_of_whole_tiles_quantises_like_the_whole_tensor():
    w = torch.randn(384, 300)
    q, s = quantize_fp8_blocks(w)
    part_q, part_s = quantize_fp8_blocks(w[128:384, 256:300])  # whole tiles (the last column of tiles is short)
    assert torch.equal(part_q.view(torch.uint8), q[128:384, 256:300].view(torch.uint8))
    assert torch.equal(part_s, s[1:3, 2:3])


def test_sender_views_quantise_current_weights_before_each_write():
    # one weight of 256 x 256 split over 2 ranks (rows), a norm that stays as it is
    mesh = Mesh("m", (("tp", 2),))
    layout = Layout(
        "trainer",
        Role.TRAINER,
        2,
        (mesh,),
        (
            TensorLayout(
                TensorSpec("model.layers.0.mlp.down_proj.weight", (256, 256), "bfloat16"),
                MeshSharding("m", (("tp", Shard(0)),)),
            ),
            TensorLayout(TensorSpec("model.norm.weight", (256,), "bfloat16"), MeshSharding("m")),
        ),
    )
    quant = Fp8BlockQuant()
    fp8_layout = quantize_layout(layout, quant)
    full = torch.randn(256, 256).to(torch.bfloat16)
    norm = torch.randn(256).to(torch.bfloat16)
    params = {"model.layers.0.mlp.down_proj.weight": full[128:], "model.norm.weight": norm}

    def view_of(name, box):  # rank 1's memory; the down_proj box comes in two pieces (as fused params do)
        if name == "model.norm.weight":
            return params[name][box.slices()]
        half = Box((128, 0), (128, 128)), Box((128, 128), (128, 128))
        return [(b, params[name][b.relative_to(box).slices()]) for b in half]

    views = Fp8Views(fp8_layout, 1, view_of, quant)
    name = "model.layers.0.mlp.down_proj.weight"
    (wbox,) = fp8_layout.rank_boxes(1)[name]
    (sbox,) = fp8_layout.rank_boxes(1)[name + "_scale_inv"]
    assert views.view_of("model.norm.weight", Box((0,), (256,))) is not None
    for step in range(2):
        params[name].add_(torch.randn(128, 256).to(torch.bfloat16))
        views.quantize()
        want_q, want_s = quantize_fp8_blocks(params[name])
        assert views.view_of(name, wbox).dtype == E4M3
        assert torch.equal(views.view_of(name, wbox).view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(views.view_of(name + "_scale_inv", sbox), want_s)
    assert views.quantized_bytes == 128 * 256 + 4 * 2


def _down_projs(count: int, shape: tuple[int, int]) -> tuple[list[str], Layout]:
    """``count`` bf16 down_proj weights of ``shape``, whole on one rank, and their layout."""
    names = [f"model.layers.{i}.mlp.down_proj.weight" for i in range(count)]
    specs = (TensorLayout(TensorSpec(n, shape, "bfloat16"), MeshSharding("m")) for n in names)
    return names, Layout("trainer", Role.TRAINER, 1, (Mesh("m", (("tp", 1),)),), tuple(specs))


def test_quantising_wave_by_wave_does_each_box_in_the_first_wave_that_sends_it():
    # one rank holding three weights; wave 0 sends a piece of `a` and the scales of `c`, wave 1 the rest of `a`
    # and `c`; `b` is sent by no wave (another replica sends it) and is never quantised
    names, layout = _down_projs(3, (256, 128))
    quant = Fp8BlockQuant()
    fp8_layout = quantize_layout(layout, quant)
    params = {n: torch.randn(256, 128).to(torch.bfloat16) for n in names}
    views = Fp8Views(fp8_layout, 0, lambda name, box: params[name][box.slices()], quant)
    a, b, c = names
    whole = Box((0, 0), (256, 128))
    for n in names:  # mark the buffers: quantised ones change
        views.view_of(n, whole).view(torch.uint8).fill_(0xFF)
    sent = [
        [(a, (0, 0), (128, 128)), (c + "_scale_inv", (0, 0), (2, 1))],
        [(a, (128, 0), (128, 128)), (c, (0, 0), (256, 128))],
    ]
    quantize_wave = views.by_wave(sent)
    quantize_wave(0)
    for n in (a, c):
        want_q, want_s = quantize_fp8_blocks(params[n])
        assert torch.equal(views.view_of(n, whole).view(torch.uint8), want_q.view(torch.uint8)), n
        assert torch.equal(views.view_of(n + "_scale_inv", Box((0, 0), (2, 1))), want_s), n
    assert bool((views.view_of(b, whole).view(torch.uint8) == 0xFF).all())  # not sent: left alone
    params[a].add_(1)  # changed after wave 0: wave 1 does not quantise `a` again (a sync reads one version)
    before = views.view_of(a, whole).clone()
    quantize_wave(1)
    assert torch.equal(views.view_of(a, whole).view(torch.uint8), before.view(torch.uint8))
    assert bool((views.view_of(b, whole).view(torch.uint8) == 0xFF).all())


@pytest.mark.parametrize("by_wave", [False, True])
def test_weights_that_move_are_quantised_where_they_are_now(by_wave):
    """A trainer that offloads and reloads (new memory each time): the FP8 buffers must hold the weights' current
    values, not those of memory left behind. Before, the quantisers kept the first views they were built from and
    re-quantised freed memory every version after a move (a false success)."""
    from awex.convert.live import fingerprinted

    names, layout = _down_projs(2, (256, 128))
    quant = Fp8BlockQuant()
    params = {n: torch.randn(256, 128).to(torch.bfloat16) for n in names}
    views = Fp8Views(
        quantize_layout(layout, quant), 0, fingerprinted(lambda name, box: params[name][box.slices()], params), quant
    )
    assert callable(getattr(views.view_of, "fingerprint", None))  # the writer re-derives views only when it moved
    # and, a steady version, checks only the addresses before any byte moves (the forms beside the transfer)
    assert views.view_of.fingerprint() == (views.view_of.addresses(), views.view_of.forms())
    whole = Box((0, 0), (256, 128))
    quantize_wave = views.by_wave([[(n, (0, 0), (256, 128)) for n in names]])
    for version in range(3):
        if version:
            for n in names:  # offloaded and loaded back: new memory, new values
                params[n] = torch.randn(256, 128).to(torch.bfloat16)
        quantize_wave(0) if by_wave else views.quantize()
        for n in names:
            want_q, _ = quantize_fp8_blocks(params[n])
            assert torch.equal(views.view_of(n, whole).view(torch.uint8), want_q.view(torch.uint8)), (version, n)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (per-wave CUDA graphs)")
def test_per_wave_cuda_graphs_quantise_every_version_after_memory_is_reused():
    """The graphs ``by_wave`` captures read their quantiser's launch tables at every replay: those must live as long
    as the graphs. Before, they were freed once capture returned; the next allocations (the trainer's own, between
    versions) took their memory, and the second version's replay hit an illegal memory access (FP8 1 -> 1 over
    NCCL on 2x H200)."""
    names, layout = _down_projs(4, (512, 256))
    quant = Fp8BlockQuant()
    params = {n: torch.randn(512, 256, device="cuda").to(torch.bfloat16) for n in names}
    views = Fp8Views(quantize_layout(layout, quant), 0, lambda name, box: params[name][box.slices()], quant)
    whole = Box((0, 0), (512, 256))
    sent = [[(n, (0, 0), (512, 256))] for n in names[:2]] + [[(n, (0, 0), (512, 256)) for n in names[2:]]]
    quantize_wave = views.by_wave(sent)
    for version in range(3):
        # allocations of every size the quantiser's tables had, filled with garbage, as a trainer's next step makes
        litter = [torch.full((k,), -1, dtype=dtype, device="cuda") for k in range(1, 64) for dtype in (torch.int64,
                  torch.int32)]  # fmt: skip
        for n in names:
            params[n].normal_()
        for i in range(len(sent)):
            quantize_wave(i)
        torch.cuda.synchronize()
        for n in names:
            want_q, want_s = quantize_fp8_blocks(params[n])
            assert torch.equal(views.view_of(n, whole).view(torch.uint8), want_q.view(torch.uint8)), (version, n)
            assert torch.equal(views.view_of(n + "_scale_inv", Box((0, 0), (4, 2))), want_s), (version, n)
        del litter


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the one-pass Triton quantiser)")
@pytest.mark.parametrize("shape,block", [((1024, 768), (128, 128)), ((300, 200), (128, 128)), ((96, 64), (32, 32))])
def test_cuda_quantiser_is_bit_identical_to_the_portable_one(shape, block):
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(shape, generator=g) * torch.logspace(-4, 2, shape[1])).to(torch.bfloat16)
    w[: block[0], : block[1]] = 0  # a zero tile
    q, s = quantize_fp8_blocks(w, block)  # CPU: the portable path
    for source in (w.cuda(), w.cuda().t().contiguous().t()):  # contiguous and column-major views
        cq, cs = quantize_fp8_blocks(source, block)
        assert torch.equal(cs.cpu(), s)
        assert torch.equal(cq.cpu().view(torch.uint8), q.view(torch.uint8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the one-pass Triton quantiser)")
def test_cuda_quantiser_stays_bit_identical_near_fp8_rounding_boundaries_and_on_signed_zeros():
    """The kernel divides by an FMA-corrected reciprocal and falls back to exact division where a unit in the last
    place could change the FP8 value: weights built to land on and next to FP8 midpoints, signed zeros, subnormal
    bf16 values and a wide range of magnitudes quantise exactly as the portable (torch division) path does."""
    g = torch.Generator().manual_seed(11)
    rows, cols = 2048, 2048
    w = torch.randn(rows, cols, generator=g) * torch.logspace(-6, 3, cols)
    # per tile, values whose quotient by the tile's scale sits at an FP8 midpoint (and its bf16 neighbours)
    grid = torch.tensor([1.0 + k / 16 for k in range(16)])  # e4m3 midpoints in [1, 2): odd multiples of 1/16
    for tr in range(0, rows, 256):
        for tc in range(0, cols, 256):
            tile = w[tr : tr + 128, tc : tc + 128]
            amax = float(tile.abs().max())
            scale = amax / 448.0
            mids = grid[torch.randint(0, 16, (64,), generator=g)] * 2.0 ** torch.randint(-6, 8, (64,), generator=g)
            tile[1, :64] = (mids * scale).clamp(max=amax)
    w = w.to(torch.bfloat16)
    w[5, :300] = -0.0
    w[6, :300] = 0.0
    w[7, :50] = torch.tensor(1e-40).to(torch.bfloat16)  # subnormal in bf16
    q, s = quantize_fp8_blocks(w, (128, 128))  # CPU: torch division
    cq, cs = quantize_fp8_blocks(w.cuda(), (128, 128))
    assert torch.equal(cs.cpu(), s)
    assert torch.equal(cq.cpu().view(torch.uint8), q.view(torch.uint8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the one-pass Triton quantiser)")
def test_cuda_quantiser_is_bit_identical_over_every_finite_bf16_value():
    """Every finite bf16 bit pattern, shuffled into 128x128 tiles several ways (so each meets several scales), and
    narrowed to a few magnitudes per tile: the kernel's quotients round to the same FP8 bits as torch's division."""
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    every = every[torch.isfinite(every)]
    g = torch.Generator().manual_seed(5)
    for trial in range(4):
        w = every[torch.randperm(every.numel(), generator=g)]
        w = w[: (w.numel() // 16384) * 16384].view(-1, 128)
        if trial % 2:  # tiles of small magnitudes only: scales far below the largest bf16
            w = torch.where(w.float().abs() < 2.0 ** (4 - 20 * trial), w, torch.zeros_like(w))
        q, s = quantize_fp8_blocks(w, (128, 128))
        cq, cs = quantize_fp8_blocks(w.cuda(), (128, 128))
        assert torch.equal(cs.cpu(), s)
        assert torch.equal(cq.cpu().view(torch.uint8), q.view(torch.uint8)), trial


def _pieces_of_a_fused_qkv(device, groups=4, q_rows=512, kv_rows=128, cols=384, dtype=torch.bfloat16):
    """Megatron-like interleaved QKV source (per group: q rows, k rows, v rows) and vLLM-like FP8 destinations
    (q, k, v each one tensor), cut into per-group pieces as a receiver quantising on the copy sees them."""
    g = torch.Generator().manual_seed(7)
    per = q_rows + 2 * kv_rows
    fused = (torch.randn(groups * per, cols, generator=g) * torch.logspace(-3, 1, cols)).to(dtype).to(device)
    outs = {
        part: (
            torch.zeros(groups * rows, cols, dtype=E4M3, device=device),
            torch.zeros(groups * rows // 128, -(-cols // 128), device=device),
        )
        for part, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows))
    }
    pieces = []
    for grp in range(groups):
        at = grp * per
        for part, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
            out, scale = outs[part]
            pieces.append(
                (
                    fused[at : at + rows],
                    out[grp * rows : (grp + 1) * rows],
                    scale[grp * rows // 128 : (grp + 1) * rows // 128],
                )
            )
            at += rows
    return fused, outs, pieces


def test_batched_quantiser_off_cuda_quantises_each_piece_like_the_single_weight_function():
    _, outs, pieces = _pieces_of_a_fused_qkv("cpu")
    quantizer = BatchedFp8Quantizer(pieces)
    assert quantizer.launches == len(pieces) and quantizer.tiles == 0  # no CUDA: one call per piece
    quantizer()
    for source, out, scale in pieces:
        q, s = quantize_fp8_blocks(source)
        assert torch.equal(out.view(torch.uint8), q.view(torch.uint8)) and torch.equal(scale, s)


def test_batched_quantiser_refuses_mismatched_outputs_before_quantising_anything():
    w = torch.randn(256, 256, dtype=torch.bfloat16)
    q = torch.zeros(256, 256, dtype=E4M3)
    with pytest.raises(ValueError, match="scale_out must be float32 of shape"):
        BatchedFp8Quantizer([(w, q, torch.zeros(2, 2)), (w, q, torch.zeros(1, 2))])
    with pytest.raises(ValueError, match="out must be an FP8 tensor"):
        BatchedFp8Quantizer([(w, torch.zeros(256, 256, dtype=torch.bfloat16), torch.zeros(2, 2))])
    with pytest.raises(ValueError, match="2-D weight"):
        BatchedFp8Quantizer([(w.view(-1), q, torch.zeros(2, 2))])
    assert int(q.view(torch.uint8).sum()) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the batched Triton quantiser)")
def test_cuda_batched_quantiser_is_bit_identical_to_one_call_per_piece_in_one_launch_per_dtype():
    """Per-group pieces of an interleaved QKV (row slices of one source into slices of q/k/v FP8 tensors and
    their scales), plus fp32 sources, a short last tile row and column, and a column-major source: one launch
    per source dtype for the pieces it can take, the column-major one apart; every tile and scale the same bits
    as quantize_fp8_blocks gives each piece alone (the portable path on CPU)."""
    _, outs, pieces = _pieces_of_a_fused_qkv("cuda")
    g = torch.Generator().manual_seed(9)
    ragged = (torch.randn(300, 272, generator=g) * 3).to(torch.bfloat16).cuda()  # short last tiles (272 = 17 x 16)
    wide = torch.randn(256, 640, generator=g).cuda()  # fp32 source: its own launch
    column_major = torch.randn(256, 256, generator=g).to(torch.bfloat16).cuda().t().contiguous().t()
    extra = []
    for w in (ragged, wide, column_major):
        extra.append(
            (
                w,
                torch.zeros(w.shape, dtype=E4M3, device="cuda"),
                torch.zeros(-(-w.shape[0] // 128), -(-w.shape[1] // 128), device="cuda"),
            )
        )
    quantizer = BatchedFp8Quantizer(pieces + extra)
    assert quantizer.launches == 3  # bf16 pieces, fp32 piece, column-major piece apart
    assert quantizer.tiles == sum(s.numel() for _, _, s in pieces + extra[:2])
    quantizer()
    torch.cuda.synchronize()
    for source, out, scale in pieces + extra:
        q, s = quantize_fp8_blocks(source.cpu())
        assert torch.equal(scale.cpu(), s)
        assert torch.equal(out.cpu().view(torch.uint8), q.view(torch.uint8))
    # captured in a CUDA graph, replayed after the sources changed in place: the new values
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        quantizer()
    for source, _, _ in pieces + extra:
        source.mul_(-2)
    graph.replay()
    torch.cuda.synchronize()
    for source, out, scale in pieces + extra:
        q, s = quantize_fp8_blocks(source.cpu())
        assert torch.equal(scale.cpu(), s)
        assert torch.equal(out.cpu().view(torch.uint8), q.view(torch.uint8))
