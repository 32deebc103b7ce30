"""LoRA adapters as a trainer source: a version moves only the adapters' tensors (megabytes), never the base model.

    source = TrainerSource.lora(peft_model, "math")           # the model's one adapter, served as "math"
    source = TrainerSource.lora(peft_model, {"default": "math", "code": "code"})   # PEFT name -> served name

Each adapter tensor's canonical name is :func:`lora_name`: the served adapter's name, then the module the adapter
wraps as vLLM names it (PEFT's ``base_model.model.`` prefix dropped), then ``lora_A.weight`` ``[r, in]`` or
``lora_B.weight`` ``[out, r]``. vLLM holds each adapter's B with its scale folded in (``lora_alpha / r``, or
``lora_alpha / sqrt(r)`` for rsLoRA), so the trainer sends B times its scale: a buffer of that product, recomputed
before each write (``refresh``; where the scale is 1, the parameter itself). The receiver then holds exactly the bytes
sent. FSDP2-sharded adapters send each rank's local shards (nothing gathered).

PEFT's LoRA layers (``peft.tuners.lora.LoraLayer``: ``lora_A``, ``lora_B``, ``scaling``) are read where they are;
PEFT is imported when a source is made (extra ``lora``). Refused before any byte moves: an adapter the model lacks,
DoRA (``use_dora``), LoRA on embeddings, trained LoRA biases (vLLM serves none of them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from awex.meta import Box, Layout, TensorSpec
from awex.meta.errors import AwexValueError
from awex.meta.layout import TensorLayout

PEFT_PREFIX = "base_model.model."  # what PEFT's wrapper adds to every module path


def lora_name(adapter: str, module: str, part: str) -> str:
    """The canonical name of one adapter tensor: ``<adapter>/<module>.lora_<A|B>.weight``."""
    return f"{adapter}/{module}.lora_{part}.weight"


@dataclass(frozen=True)
class AdapterTensor:
    """One tensor of a PEFT adapter: where it is held (``owner.lora_A[peft]``), what it is called, its scale."""

    name: str
    owner: torch.nn.Module
    part: str  # "A" or "B"
    peft: str  # the adapter's name in the PEFT model
    scale: float  # folded into B as sent (1 for A)

    def param(self) -> torch.Tensor:
        """The parameter where it is now (looked up each time: it may be replaced between versions)."""
        held = self.owner.lora_A if self.part == "A" else self.owner.lora_B
        return held[self.peft].weight


def adapters_of(model: torch.nn.Module, adapters: str | Sequence[str] | Mapping[str, str]) -> dict[str, str]:
    """``{PEFT adapter name: served name}``: one name is the model's only adapter served under it; a list, those
    adapters under their own names."""
    known = list(getattr(model, "peft_config", {}) or {})
    if isinstance(adapters, str):
        if len(known) != 1:
            raise AwexValueError(
                f"LoRA source: the model holds {len(known)} adapters {known}; name which to send as {adapters!r}: "
                f"{{peft_name: served_name}}"
            )
        return {known[0]: adapters}
    mapping = dict(adapters) if isinstance(adapters, Mapping) else {a: a for a in adapters}
    missing = [a for a in mapping if known and a not in known]
    if missing or not mapping:
        raise AwexValueError(
            f"LoRA source: no adapter {missing or '(none named)'} in the model (its adapters: {known})"
        )
    return mapping


def adapter_tensors(model: torch.nn.Module, adapters: Mapping[str, str]) -> list[AdapterTensor]:
    """Every LoRA tensor of ``adapters`` (``{PEFT name: served name}``) in ``model``, sorted by canonical name."""
    from peft.tuners.lora import LoraLayer

    found: list[AdapterTensor] = []
    problems: list[str] = []
    for path, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        _check_embedding(path, module, adapters, problems)
        lora_a = module.lora_A
        target = path.removeprefix(PEFT_PREFIX)
        for peft, served in adapters.items():
            if peft not in lora_a:
                continue
            if getattr(module, "use_dora", {}).get(peft):
                problems.append(f"{target}: DoRA (use_dora) is not served by vLLM")
            if getattr(module, "lora_bias", {}).get(peft):
                problems.append(f"{target}: a trained LoRA bias (lora_bias) is not served by vLLM")
            scale = float(module.scaling[peft])
            found.append(AdapterTensor(lora_name(served, target, "A"), module, "A", peft, 1.0))
            found.append(AdapterTensor(lora_name(served, target, "B"), module, "B", peft, scale))
    if problems:
        raise AwexValueError("LoRA source: cannot send these adapters:\n  " + "\n  ".join(sorted(set(problems))))
    if not found:
        raise AwexValueError(f"LoRA source: the model holds no LoRA layers of {sorted(adapters)}")
    return sorted(found, key=lambda t: t.name)


def _check_embedding(path: str, module: torch.nn.Module, adapters: Mapping[str, str], problems: list[str]) -> None:
    emb = getattr(module, "lora_embedding_A", None)
    if isinstance(emb, (dict, torch.nn.ParameterDict)) and any(a in emb for a in adapters):
        problems.append(f"{path.removeprefix(PEFT_PREFIX) or 'model'}: LoRA on embeddings is not supported")


def check_adapters(adapters: Mapping[str, int]) -> dict[str, int]:
    """``{served name: lora_int_id}`` as given, checked (before anything is read from the engine)."""
    if not isinstance(adapters, Mapping) or not adapters:
        raise AwexValueError(f"awex: lora={adapters!r}; give {{served_name: lora_int_id}}, e.g. {{'math': 1}}")
    out = {}
    for name, lora_id in adapters.items():
        if (
            not isinstance(name, str)
            or not name
            or "/" in name
            or isinstance(lora_id, bool)
            or not isinstance(lora_id, int)
        ):
            raise AwexValueError(f"awex: lora entry {name!r}: {lora_id!r}; a name without '/' and an int id")
        if lora_id < 1:
            raise AwexValueError(f"awex: lora {name!r}: id {lora_id} (vLLM's lora_int_id is >= 1)")
        out[name] = lora_id
    if len(set(out.values())) != len(out):
        raise AwexValueError(f"awex: lora={adapters!r} names one adapter id twice")
    return out


class AdapterViews(Mapping[str, torch.Tensor]):
    """``{canonical name: tensor as sent}``: A as the parameter is now (a DTensor's local shard), B times its scale
    in a buffer this object keeps (recomputed by :meth:`refresh`), or B itself where the scale is 1."""

    def __init__(self, tensors: Sequence[AdapterTensor]):
        self._tensors = {t.name: t for t in tensors}
        self._scaled: dict[str, torch.Tensor] = {}
        self.refresh()

    def _local(self, t: AdapterTensor) -> torch.Tensor:
        p = t.param()
        return (p.to_local() if hasattr(p, "to_local") else p).detach()

    def refresh(self) -> None:
        """B times its scale, from B as it is now (called before each write: the trainer's step changed B)."""
        with torch.no_grad():
            for name, t in self._tensors.items():
                if t.scale == 1.0:
                    continue
                local = self._local(t)
                buf = self._scaled.get(name)
                if buf is None or buf.shape != local.shape or buf.dtype != local.dtype or buf.device != local.device:
                    buf = self._scaled[name] = torch.empty_like(local, memory_format=torch.contiguous_format)
                torch.mul(local, t.scale, out=buf)

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._tensors[name]
        return self._scaled[name] if t.scale != 1.0 else self._local(t)

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def lora_source_parts(
    model: torch.nn.Module, adapters: str | Sequence[str] | Mapping[str, str], instance: str
) -> tuple[Layout, int, Callable[[str, Box], torch.Tensor], Callable[[], None]]:
    """The layout, local rank, ``view_of`` and ``refresh`` of :meth:`TrainerSource.lora
    <awex.engines.source.TrainerSource.lora>`."""
    from awex.convert.live import fingerprinted
    from awex.engines.fsdp import dtensor_layout, dtensor_sharding, mesh_dims, mesh_local_rank

    tensors = adapter_tensors(model, adapters_of(model, adapters))
    params = {t.name: t.param() for t in tensors}
    dims, shape = mesh_dims(params)
    problems: list[str] = []
    layouts = []
    for t in tensors:
        p = params[t.name]
        dtype = str(p.dtype).removeprefix("torch.")
        spec = TensorSpec(t.name, tuple(p.shape), dtype)
        layouts.append(TensorLayout(spec, dtensor_sharding(t.name, p, dims, problems)))
    layout = dtensor_layout(instance, layouts, dims, shape, problems)
    views = AdapterViews(tensors)

    def view_of(name: str, box: Box) -> torch.Tensor:
        held = views[name]  # a DTensor's local shard is the rank's whole box; a plain tensor is cut to the box
        return held if tuple(held.shape) == tuple(box.sizes) else held[box.slices()]

    return layout, mesh_local_rank(params), fingerprinted(view_of, views), views.refresh


__all__ = [
    "AdapterTensor",
    "AdapterViews",
    "adapter_tensors",
    "adapters_of",
    "check_adapters",
    "lora_name",
    "lora_source_parts",
]
