"""Block-quantised FP8 in layouts: which canonical tensors travel as FP8 and where their scales live.

The format is the one FP8 checkpoints use and vLLM and SGLang load (DeepSeek-V3, Qwen3-FP8): a quantised
linear weight ``X.weight`` is stored as ``float8_e4m3fn`` and comes with ``X.weight_scale_inv``, one float32 per
``block`` (128 x 128) tile of the weight, such that ``weight ~= fp8 * scale_inv`` tile by tile. The scale is a
canonical tensor of its own (shape ``ceil(rows / 128) x ceil(cols / 128)``), planned and moved like any other.

:func:`quantize_layout` turns a layout into its FP8 form: quantised weights change dtype and each gets its scale
tensor, held by exactly the ranks that hold the weight tiles it scales (the *block image* of their boxes). A
receiver's layout (vLLM built from an FP8 config) and a sender's layout (a bf16 trainer quantising on the fly,
``awex.engines.fp8``) are both made by it, so they agree by construction. A sender must hold whole tiles (it
computes each tile's scale from its own data): a box that cuts through a tile is an error, named, before any
byte moves.

Which weights are quantised follows vLLM's FP8 method: the linear weights of attention, MLPs and experts;
never embeddings, the LM head, norms or MoE routers (they keep their precision), nor anything whose name
matches ``skip`` (the config's ``modules_to_not_convert`` / ``ignored_layers``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from awex.meta.box import Box
from awex.meta.errors import AwexValueError
from awex.meta.layout import ExplicitSharding, Layout, MeshSharding, Shard, TensorLayout, expand_mesh_sharding
from awex.meta.spec import TensorSpec

FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
SCALE_SUFFIX = "_scale_inv"
# linear weights vLLM's FP8 method quantises (by canonical name); routers, norms, embeddings never
_QUANTISED_SUFFIXES = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "shared_expert.gate_proj.weight",
    "shared_expert.up_proj.weight",
    "shared_expert.down_proj.weight",
)


@dataclass(frozen=True)
class Fp8BlockQuant:
    """Block-quantised FP8: weights in ``dtype``, a float32 ``weight_scale_inv`` per ``block`` tile.

    ``skip``: module name fragments left unquantised (as ``modules_to_not_convert`` in HF configs: a weight is
    skipped when its name contains one of them followed by ``.`` or ending there). ``names``: where given, exactly
    these canonical weights travel quantised, whatever their names (a sender matching receivers' layouts:
    :func:`sender_quant`).
    """

    block: tuple[int, int] = (128, 128)
    dtype: str = "float8_e4m3fn"
    skip: tuple[str, ...] = ()
    names: frozenset[str] | None = None

    def __post_init__(self) -> None:
        block = tuple(int(b) for b in self.block)
        if len(block) != 2 or min(block) < 1:
            raise AwexValueError(f"FP8 block must be two positive sizes, got {self.block}")
        if self.dtype not in FP8_DTYPES:
            raise AwexValueError(f"FP8 dtype must be one of {FP8_DTYPES}, got {self.dtype!r}")
        object.__setattr__(self, "block", block)
        object.__setattr__(self, "skip", tuple(str(s) for s in self.skip))
        if self.names is not None:
            object.__setattr__(self, "names", frozenset(self.names))

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> Fp8BlockQuant | None:
        """The FP8 block quantisation an HF config declares (``quantization_config``), or ``None`` for none.

        Raises ``ValueError`` for an FP8 config Awex cannot serve (per-tensor or per-channel scales).
        """
        q = config.get("quantization_config")
        if not q:
            return None
        method = str(q.get("quant_method", "")).lower()
        if method != "fp8":
            raise AwexValueError(
                f"quantization_config.quant_method={method!r}: awex moves FP8 block-quantised "
                "weights ('fp8' with weight_block_size) or unquantised ones only"
            )
        block = q.get("weight_block_size")
        if not block:
            raise AwexValueError(
                "quantization_config: FP8 without weight_block_size (per-tensor scales) is not "
                "supported; use block quantisation, e.g. weight_block_size [128, 128]"
            )
        fmt = str(q.get("fmt", "e4m3")).lower()
        dtype = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}.get(fmt)
        if dtype is None:
            raise AwexValueError(f"quantization_config.fmt={fmt!r}: expected 'e4m3' or 'e5m2'")
        skip = tuple(q.get("modules_to_not_convert") or ()) + tuple(q.get("ignored_layers") or ())
        return cls(block=tuple(block), dtype=dtype, skip=skip)

    def quantises(self, name: str, shape: tuple[int, ...]) -> bool:
        """Whether canonical tensor ``name`` travels quantised."""
        if self.names is not None:
            return len(shape) == 2 and name in self.names
        if len(shape) != 2 or not name.endswith(_QUANTISED_SUFFIXES) and not _is_expert_weight(name):
            return False
        dotted = "." + name.removesuffix(".weight") + "."
        return not any(f".{s.strip('.')}." in dotted for s in self.skip)

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        return (-(-shape[0] // self.block[0]), -(-shape[1] // self.block[1]))

    def block_image(self, box: Box) -> Box:
        """The scale tiles covering a box of the weight."""
        (r0, c0), (r1, c1) = box.offsets, box.ends
        (br, bc) = self.block
        lo = (r0 // br, c0 // bc)
        hi = (-(-r1 // br), -(-c1 // bc))
        return Box(lo, (hi[0] - lo[0], hi[1] - lo[1]))

    def whole_tiles(self, box: Box, shape: tuple[int, ...]) -> bool:
        """Whether a box of a weight of ``shape`` consists of whole tiles (the last tile may be short)."""
        return all(
            o % b == 0 and (e % b == 0 or e == n) for o, e, b, n in zip(box.offsets, box.ends, self.block, shape)
        )


Quantized = tuple[str, str, str, tuple[int, int]]
"""A weight its receivers hold block-quantised and its source does not: ``(weight, FP8 dtype, scale tensor, tile
edges)`` (:attr:`awex.meta.plan.Plan.quantized`)."""


def quantized_weights(
    src: Mapping[str, TensorSpec], dst: Mapping[str, TensorSpec], problems: list[str] | None = None
) -> list[Quantized]:
    """The weights destinations hold in FP8 with their scales where the sources hold them unquantised, in the same
    shape and without scales (``name -> spec`` of each side), in ``dst``'s order; each tile edge the smallest power
    of two that gives the scales' shape. A weight whose scales do not tile it is left out, said in ``problems``."""
    out: list[Quantized] = []
    for name, d in dst.items():
        s = src.get(name)
        scale = scale_name(name)
        if s is None or d.dtype not in FP8_DTYPES or s.dtype in FP8_DTYPES or s.shape != d.shape:
            continue
        if scale not in dst or scale in src:
            continue
        try:
            block = tuple(tile_block(n, k) for n, k in zip(d.shape, dst[scale].shape))
        except ValueError as e:
            if problems is not None:
                problems.append(f"{name}: its scales {tuple(dst[scale].shape)} do not tile it: {e}")
            continue
        out.append((name, d.dtype, scale, block))
    return out


def sender_quant(sources: Sequence[Layout], destinations: Sequence[Layout]) -> Fp8BlockQuant | None:
    """What bf16 senders quantise so that they send what their FP8 receivers hold (:func:`quantized_weights`):
    exactly those weights, in their one dtype; ``None`` where there are none. The tile block is the largest edge each
    dimension shows (a weight of one tile row shows the smallest edge that covers it); a planner given the senders'
    quantised layouts checks that every scale tensor then has the receivers' shape. Receivers in two FP8 dtypes
    cannot be served by one sender's tiles: ``AwexValueError``."""
    src = {t.spec.name: t.spec for x in sources for t in x.tensors}
    quantized = [q for x in destinations for q in quantized_weights(src, {t.spec.name: t.spec for t in x.tensors})]
    if not quantized:
        return None
    dtypes = sorted({dtype for _, dtype, _, _ in quantized})
    if len(dtypes) > 1:
        raise AwexValueError(
            f"the FP8 receivers hold their weights as {dtypes}: a sender quantises to one dtype; sync them in "
            "separate versions or quantise on receive"
        )
    block = (max(q[3][0] for q in quantized), max(q[3][1] for q in quantized))
    return Fp8BlockQuant(block=block, dtype=dtypes[0], names=frozenset(q[0] for q in quantized))


def _is_expert_weight(name: str) -> bool:
    return ".mlp.experts." in name and name.endswith(("gate_proj.weight", "up_proj.weight", "down_proj.weight"))


def scale_name(weight: str) -> str:
    """``X.weight`` -> ``X.weight_scale_inv``."""
    return weight + SCALE_SUFFIX


def quantize_layout(layout: Layout, quant: Fp8BlockQuant, *, sender: bool | None = None) -> Layout:
    """The FP8 form of ``layout``: quantised weights in ``quant.dtype`` plus their scale tensors.

    ``sender`` (default: the layout's role is trainer) requires every held box of a quantised weight to be
    whole tiles; ``ValueError`` names the first that is not. Tensors already in FP8 (a trainer training in FP8)
    are left as they are and must come with their scale tensors.
    """
    sender = layout.role.value == "trainer" if sender is None else sender
    out: list[TensorLayout] = []
    problems: list[str] = []
    names = set(layout.names)
    for t in layout.tensors:
        spec = t.spec
        if not quant.quantises(spec.name, spec.shape) or spec.name.endswith(SCALE_SUFFIX):
            out.append(t)
            continue
        if spec.dtype in FP8_DTYPES:
            if scale_name(spec.name) not in names:
                problems.append(f"{spec.name} is already {spec.dtype} but the layout has no {scale_name(spec.name)}")
            out.append(t)
            continue
        holdings = layout.holdings(spec.name)
        if sender:
            for box, ranks in holdings:
                if not quant.whole_tiles(box, spec.shape):
                    problems.append(
                        f"{spec.name}: rank {ranks[0]} holds {box} of {spec.shape}, which cuts through "
                        f"{quant.block[0]}x{quant.block[1]} FP8 tiles; a sender must hold whole tiles "
                        "to compute their scales"
                    )
                    break
        out.append(TensorLayout(TensorSpec(spec.name, spec.shape, quant.dtype), t.sharding))
        scale = TensorSpec(scale_name(spec.name), quant.scale_shape(spec.shape), "float32")
        out.append(TensorLayout(scale, _scale_sharding(layout, t, holdings, quant, scale.shape)))
    if problems:
        shown = "; ".join(problems[:5]) + (f"; ... ({len(problems) - 5} more)" if len(problems) > 5 else "")
        raise AwexValueError(f"{layout.instance}: cannot lay out FP8 block quantisation: {shown}")
    return Layout(layout.instance, layout.role, layout.world_size, layout.meshes, tuple(out))


def _scale_sharding(layout: Layout, t: TensorLayout, holdings, quant: Fp8BlockQuant, shape: tuple[int, ...]):
    """The weight's mesh sharding with blocks in tiles when that places the scales right, else explicit boxes."""
    image: dict[Box, set[int]] = {}
    for box, ranks in holdings:
        image.setdefault(quant.block_image(box), set()).update(ranks)
    want = tuple(sorted(((b, tuple(sorted(r))) for b, r in image.items()), key=lambda kv: (kv[0].offsets, kv[0].sizes)))
    s = t.sharding
    if isinstance(s, MeshSharding):
        placements = []
        for dim_name, p in s.placements:
            if isinstance(p, Shard) and p.block is not None:
                if p.block % quant.block[p.dim]:
                    break
                p = Shard(p.dim, p.parts, p.block // quant.block[p.dim])
            placements.append((dim_name, p))
        else:
            candidate = MeshSharding(s.mesh, tuple(placements))
            if expand_mesh_sharding(layout.mesh(s.mesh), candidate, shape) == want:
                return candidate
    by_rank: dict[int, list[Box]] = {}
    for box, ranks in want:
        for r in ranks:
            by_rank.setdefault(r, []).append(box)
    # a rank whose boxes share a tile holds that tile once
    return ExplicitSharding(tuple((r, tuple(_distinct_cover(bs))) for r, bs in sorted(by_rank.items())))


def _distinct_cover(boxes: list[Box]) -> list[Box]:
    """Boxes without overlaps between them (tiles shared by two boxes of one rank are kept once)."""
    out: list[Box] = []
    for b in boxes:
        pieces = [b]
        for kept in out:
            pieces = [q for p in pieces for q in _subtract(p, kept)]
        out.extend(pieces)
    return out


def _subtract(a: Box, b: Box) -> list[Box]:
    """``a`` minus ``b`` as disjoint boxes (2-D)."""
    inter = a.intersect(b)
    if inter is None:
        return [a]
    out = []
    offsets, ends = list(a.offsets), list(a.ends)
    for d in range(a.ndim):
        if offsets[d] < inter.offsets[d]:
            lo, hi = list(offsets), list(ends)
            hi[d] = inter.offsets[d]
            out.append(Box(tuple(lo), tuple(h - lo_ for h, lo_ in zip(hi, lo))))
            offsets[d] = inter.offsets[d]
        if ends[d] > inter.ends[d]:
            lo, hi = list(offsets), list(ends)
            lo[d] = inter.ends[d]
            out.append(Box(tuple(lo), tuple(h - lo_ for h, lo_ in zip(hi, lo))))
            ends[d] = inter.ends[d]
    return [b for b in out if not b.is_empty()]


def tile_block(size: int, tiles: int) -> int:
    """The tile edge (a power of two) that cuts ``size`` elements into ``tiles`` tiles: the smallest such edge
    (every edge of at least ``size`` makes one tile alike). ``ValueError`` where none does."""
    edge = 1
    while -(-size // edge) > tiles:
        edge *= 2
    if tiles < 1 or -(-size // edge) != tiles:
        raise AwexValueError(f"{tiles} tiles cannot cover {size} elements with a power-of-two tile edge")
    return edge
