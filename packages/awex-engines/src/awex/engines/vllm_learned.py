"""A vLLM receiver's layout learned from vLLM's own weight loaders: any model vLLM loads, with or without a table.

At set-up each worker runs ``model.load_weights`` once per canonical tensor on a probe (``awex.convert.recorded``):
nothing is written, and what its loaders do (TP narrowing, fused QKV and gate/up, padded vocabularies, tied
embeddings, transposes) is recorded as the boxes this rank holds and the views of its live parameters they land
in. The canonical tensors are the model's checkpoint tensors, read from an ``meta`` HF model built from the
engine's config (``awex.convert.hf.hf_checkpoint_tensors``: what an HF or FSDP2 trainer of the same model names).

Every rank publishes what it learned on the MetaServer (``learned/<instance>/<config digest>/<rank>``) and reads
every other rank's, so that all ranks hold the same instance layout (explicit boxes per rank). A tensor whose
loader does something boxes cannot express goes through vLLM's loaders at every version, whole, on the ranks
whose loaders took it (counted in ``loader_bytes``); a tensor no rank holds, or one element landing twice, is
an error naming it before any byte moves.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import time
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from awex.convert.live import fingerprinted
from awex.convert.recorded import Landing, UnsupportedLoad, landing_view, record_loads
from awex.engines.hf import checkpoint_specs
from awex.meta import Box, TensorSpec
from awex.meta.errors import AwexValueError
from awex.meta.layout import ExplicitSharding, Layout, TensorLayout
from awex.meta.spec import Role

log = logging.getLogger("awex.engines.vllm")


class UnlearnableLayoutError(AwexValueError):
    """The engine's loaders cannot give a layout: a tensor lands nowhere, or ranks disagree on its shape."""


@dataclass(frozen=True)
class LearnedLayout:
    """The instance layout and this rank's part of it: where each held box lands (``landings``), which tensors go
    through vLLM's loaders and why (``loader``), and the parameter each canonical tensor's loader fills
    (``native``: it decides the module a loader-path tensor is reloaded with)."""

    layout: Layout
    landings: dict[str, tuple[Landing, ...]]
    loader: dict[str, str]
    native: dict[str, str]
    seconds: float


def dtype_keyword(transformers_version: str) -> str:
    """transformers' keyword for the dtype a model is built in: ``dtype`` since 4.56, ``torch_dtype`` before (this
    package's floor is 4.51, where ``dtype`` is an unknown argument of the model's constructor)."""
    major_minor = tuple(int(part) for part in re.findall(r"\d+", transformers_version)[:2])
    return "dtype" if major_minor >= (4, 56) else "torch_dtype"


def canonical_specs(hf_config, dtype: str) -> list[TensorSpec]:
    """The checkpoint tensors of the model ``hf_config`` describes (floating ones in ``dtype``), from a model built
    on the ``meta`` device by transformers (a causal LM, else an image-text-to-text model: a VLM)."""
    import transformers

    torch_dtype = getattr(torch, dtype)
    errors = []
    for auto in ("AutoModelForCausalLM", "AutoModelForImageTextToText"):
        cls = getattr(transformers, auto, None)
        if cls is None:
            continue
        try:
            with torch.device("meta"):
                model = cls.from_config(hf_config, **{dtype_keyword(transformers.__version__): torch_dtype})
        except (ValueError, KeyError, TypeError) as e:
            errors.append(f"{auto}: {e}")
            continue
        return checkpoint_specs(model, dtype)
    raise UnlearnableLayoutError(
        f"transformers cannot build {getattr(hf_config, 'model_type', '?')!r} to name its tensors: {'; '.join(errors)}"
    )


def learn_vllm_layout(
    model: torch.nn.Module,
    hf_config,
    dtype: str,
    client,
    instance: str,
    local_rank: int,
    world_size: int,
    device: torch.device | str,
    timeout: float,
    tolerate_loader_errors: bool = False,
    vllm_config=None,
) -> LearnedLayout:
    """Learn this rank's part by probing vLLM's loaders, share it with the instance's other ranks through the
    MetaServer (``client``), and assemble the instance layout. ``tolerate_loader_errors``: a loader that fails on
    a probe sends its tensor through the loader path instead of raising (for modules vLLM repacked after loading,
    whose parameters no longer have the checkpoint's shape)."""
    started = time.monotonic()
    from vllm.config import set_current_vllm_config

    # vLLM may have decorated transformers' model classes in this process (its compile wrapper asks for the config)
    with set_current_vllm_config(vllm_config) if vllm_config is not None else contextlib.nullcontext():
        specs = canonical_specs(hf_config, dtype)
    params = dict(model.named_parameters())
    owner: dict[str, str] = {}  # canonical name -> the parameter whose loader vLLM called for it
    current: list[str] = []
    unstamp = _stamp_loaders(params, lambda pname: owner.setdefault(current[0], pname) if current else None)

    def load(name: str, probe: torch.Tensor) -> None:
        current[:] = [name]
        try:
            model.load_weights([(name, probe)])
        except UnsupportedLoad:
            raise
        except Exception as e:
            if not tolerate_loader_errors:
                raise
            raise UnsupportedLoad(f"failed on a probe ({type(e).__name__}: {e})") from e

    try:
        rec = record_loads(load, specs, params, device)
    finally:
        unstamp()
    native = {name: landings[0].param for name, landings in rec.landings.items()}
    loader = {}
    for name, why in rec.unsupported.items():
        if name not in owner:
            raise UnlearnableLayoutError(
                f"{instance}:{local_rank}: vLLM's loader for {name} {why}, and no parameter's loader was called "
                "for it, so it cannot go through vLLM's loaders either"
            )
        native[name], loader[name] = owner[name], why
    dtypes = {n: str(ls[0].dtype).removeprefix("torch.") for n, ls in rec.landings.items()}
    for name, landings in rec.landings.items():
        if len({x.dtype for x in landings}) > 1:
            raise UnlearnableLayoutError(f"{name}: lands in parameters of several dtypes on rank {local_rank}")
    mine = {
        name: {
            "shape": list(spec.shape),
            "dtype": dtypes.get(name, spec.dtype),
            "boxes": [b.to_list() for b in _boxes(rec.landings.get(name), spec, name in loader)],
        }
        for spec in specs
        for name in [spec.name]
        if name in rec.landings or name in loader
    }
    digest = hashlib.sha256(json.dumps(hf_config.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:16]
    key = f"learned/{instance}/{digest}"
    client.put(f"{key}/{local_rank}", {"world_size": world_size, "dtype": dtype, "tensors": mine})
    parts = {local_rank: mine}
    deadline = time.monotonic() + timeout
    for rank in range(world_size):
        if rank not in parts:
            doc = client.get(f"{key}/{rank}", timeout=max(0.1, deadline - time.monotonic()))
            if doc.get("world_size") != world_size or doc.get("dtype") != dtype:
                raise UnlearnableLayoutError(
                    f"{key}/{rank}: learned for another engine ({doc.get('world_size')} ranks, {doc.get('dtype')})"
                )
            parts[rank] = doc["tensors"]
    layout = assemble(instance, world_size, specs, parts)
    seconds = time.monotonic() - started
    log.info(
        "%s:%d learned its layout from vLLM's loaders in %.2f s: %d tensors in place, %d through the loaders",
        instance,
        local_rank,
        seconds,
        len(rec.landings),
        len(loader),
    )
    return LearnedLayout(layout, dict(rec.landings), loader, native, seconds)


def _boxes(landings, spec: TensorSpec, whole: bool) -> list[Box]:
    return [Box.full(tuple(spec.shape))] if whole else sorted({x.box for x in landings}, key=lambda b: b.offsets)


def assemble(instance: str, world_size: int, specs: list[TensorSpec], parts: Mapping[int, Mapping]) -> Layout:
    """The instance layout from every rank's learned part; a tensor some element of which no rank holds, or that
    ranks describe with other shapes or dtypes, raises naming it."""
    tensors = []
    for spec in specs:
        held = {rank: part[spec.name] for rank, part in parts.items() if spec.name in part}
        if not held:
            continue  # no loader took it anywhere (a checkpoint tensor the engine does not use)
        kinds = {(tuple(d["shape"]), d["dtype"]) for d in held.values()}
        if len(kinds) != 1:
            raise UnlearnableLayoutError(f"{instance}: ranks describe {spec.name} differently: {sorted(kinds)}")
        shape, dtype = next(iter(kinds))
        boxes = {rank: tuple(Box(tuple(o), tuple(s)) for o, s in d["boxes"]) for rank, d in held.items()}
        missing = uncovered(Box.full(shape), [b for bs in boxes.values() for b in bs])
        if missing:
            raise UnlearnableLayoutError(
                f"{instance}: elements {missing[0]} of {spec.name} {shape} land on no rank (vLLM's loaders skip them)"
            )
        tensors.append(TensorLayout(TensorSpec(spec.name, shape, dtype), ExplicitSharding(tuple(boxes.items()))))
    return Layout(instance, Role.INFERENCE, world_size, (), tuple(tensors))


def uncovered(full: Box, boxes: list[Box]) -> list[Box]:
    """The parts of ``full`` no box covers (empty: covered)."""
    left = [full]
    for b in boxes:
        nxt = []
        for piece in left:
            nxt.extend(_minus(piece, b))
        left = nxt
        if not left:
            break
    return left


def _minus(a: Box, b: Box) -> list[Box]:
    cut = a.intersect(b)
    if cut is None:
        return [a]
    out, offs, sizes = [], list(a.offsets), list(a.sizes)

    def piece(d: int, start: int, size: int) -> Box:
        return Box(tuple(offs[:d] + [start] + offs[d + 1 :]), tuple(sizes[:d] + [size] + sizes[d + 1 :]))

    for d in range(a.ndim):  # below and above the cut along d, within what is left of a; then narrow a to it
        lo, hi, end = cut.offsets[d], cut.offsets[d] + cut.sizes[d], offs[d] + sizes[d]
        if lo > offs[d]:
            out.append(piece(d, offs[d], lo - offs[d]))
        if hi < end:
            out.append(piece(d, hi, end - hi))
        offs[d], sizes[d] = lo, hi - lo
    return out


def _stamp_loaders(params: Mapping[str, torch.Tensor], called: Callable[[str], object]) -> Callable[[], None]:
    """Wrap every parameter's ``weight_loader`` so that a call says which parameter it loads; returns the undo."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    saved = []
    for pname, p in params.items():
        inner = getattr(p, "weight_loader", None)  # none: vLLM's models fall back to default_weight_loader

        def stamped(*args, _inner=inner or default_weight_loader, _name=pname, **kwargs):
            called(_name)
            return _inner(*args, **kwargs)

        saved.append((p, inner))
        p.weight_loader = stamped

    def undo() -> None:
        for p, inner in saved:
            if inner is None:
                del p.weight_loader
            else:
                p.weight_loader = inner

    return undo


def learned_views(params: Mapping[str, torch.Tensor], learned: LearnedLayout) -> Callable[[str, Box], torch.Tensor]:
    """``view_of(name, box)`` over the live parameters (``params``: looked up at each call) for the in-place
    tensors of ``learned``."""
    where = {(name, x.box): x for name, landings in learned.landings.items() for x in landings}

    def view_of(name: str, box: Box) -> torch.Tensor:
        landing = where.get((name, box))
        if landing is None:
            raise KeyError(f"{name} {box}: not a box this rank's loaders fill")
        param = params[landing.param]
        if not Box.full(tuple(param.shape)).contains(landing.param_box) or param.dtype != landing.dtype:
            raise AwexValueError(
                f"{landing.param} changed since its layout was learned (now {tuple(param.shape)} {param.dtype})"
            )
        return landing_view(param, landing)

    return fingerprinted(view_of, params)  # a steady version re-derives its views only where a parameter moved
