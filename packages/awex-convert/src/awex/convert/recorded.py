"""Where an engine's own weight loaders put each canonical tensor, learned by running them once on probes.

A probe is a tensor with no data that knows, for each of its elements, which element of its canonical tensor it
is (it carries a view of a ``meta`` tensor of the canonical shape). The engine's loader receives it in place of
the checkpoint tensor and does what it always does: narrows it to its rank's shard, transposes, chunks, splits
fused parts, and ``copy_``-s the result into a view of a live parameter. That ``copy_`` (or a slice assignment)
moves nothing: it is recorded as a :class:`Landing`, the box of the canonical tensor and the strided region of
the parameter it would fill. Anything else a loader does to the data (arithmetic, a permutation by an index
tensor, a quantising cast, a copy into memory that is no parameter) raises inside the loader and the tensor is
reported :attr:`Recording.unsupported`: it goes through the engine's loader path at every version, alone.

:func:`record_loads` checks what it learned before anyone relies on it: a tensor that lands twice on one rank, or
two canonical elements that land in one place, is an error naming both, never a plan.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_map

from awex.convert.strided import region_box
from awex.meta import Box, TensorSpec
from awex.meta.errors import AwexValueError


class UnsupportedLoad(Exception):
    """A loader did something to a probe that no box of a parameter can express."""


class AmbiguousLoadError(AwexValueError):
    """What the loaders did cannot be a layout: one element lands twice, or two land in one place."""


@dataclass(frozen=True)
class Landing:
    """Box ``box`` of a canonical tensor lands in parameter ``param``: the view
    ``param.as_strided(box.sizes, strides, param.storage_offset() + offset)`` (``param_box``: the same region
    in the parameter's own coordinates)."""

    param: str
    box: Box
    offset: int
    strides: tuple[int, ...]
    param_box: Box
    dtype: torch.dtype


@dataclass
class Recording:
    """One rank's recording: per canonical tensor its landings, or why its loader cannot be replayed as views.
    A tensor in neither had nothing copied on this rank (another pipeline stage's, another rank's experts)."""

    landings: dict[str, tuple[Landing, ...]] = field(default_factory=dict)
    unsupported: dict[str, str] = field(default_factory=dict)


_VIEWS = {
    torch.Tensor.narrow,
    torch.narrow,
    torch.Tensor.view,
    torch.Tensor.view_as,
    torch.Tensor.reshape,
    torch.reshape,
    torch.Tensor.__getitem__,
    torch.Tensor.unsqueeze,
    torch.Tensor.squeeze,
    torch.Tensor.transpose,
    torch.transpose,
    torch.Tensor.swapaxes,
    torch.Tensor.t,
    torch.t,
    torch.Tensor.permute,
    torch.permute,
    torch.Tensor.movedim,
    torch.Tensor.flatten,
    torch.Tensor.unflatten,
    torch.Tensor.chunk,
    torch.chunk,
    torch.Tensor.split,
    torch.split,
    torch.Tensor.tensor_split,
    torch.Tensor.unbind,
    torch.Tensor.select,
    torch.Tensor.T.__get__,
    torch.Tensor.mT.__get__,
}
_SAME = {torch.Tensor.contiguous, torch.Tensor.detach, torch.Tensor.clone}  # the same elements in the same order
_CASTS = {torch.Tensor.to: None, torch.Tensor.float: torch.float32, torch.Tensor.bfloat16: torch.bfloat16}
_CASTS[torch.Tensor.half] = torch.float16


class _Probe(torch.Tensor):
    """No data; ``_index`` is a view of a meta tensor of the canonical shape (its offset and strides say which
    canonical elements this probe's elements are)."""

    _index: torch.Tensor
    _sink: _Sink

    @staticmethod
    def __new__(cls, index: torch.Tensor, dtype: torch.dtype, device: torch.device, sink: _Sink):
        t = torch.Tensor._make_wrapper_subclass(
            cls, index.shape, strides=index.stride(), dtype=dtype, device=device, requires_grad=False
        )
        t._index, t._sink = index, sink
        return t

    def _like(self, index: torch.Tensor, dtype: torch.dtype | None = None) -> _Probe:
        return _Probe(index, dtype or self.dtype, self.device, self._sink)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and len(args) >= 2 and isinstance(args[1], _Probe):
            if isinstance(args[0], _Probe):
                raise UnsupportedLoad("copies one probe into another")
            args[1]._sink.land(args[0], args[1])
            return args[0]
        if func is torch.Tensor.__setitem__ and len(args) == 3 and isinstance(args[2], _Probe):
            with torch._C.DisableTorchFunctionSubclass():
                dest = args[0][args[1]]
            args[2]._sink.land(dest, args[2])
            return None
        probe = args[0] if args and isinstance(args[0], _Probe) else None
        if probe is not None and func is torch.Tensor.view and any(isinstance(a, torch.dtype) for a in args[1:]):
            raise UnsupportedLoad("reinterprets the weight's bytes as another dtype")
        if probe is not None and func in _VIEWS:
            with torch._C.DisableTorchFunctionSubclass():
                out = func(probe._index, *args[1:], **kwargs)
            return tree_map(lambda t: probe._wrap(t, func), out)
        if probe is not None and func in _SAME:
            return probe._like(probe._index)
        if probe is not None and func in _CASTS:
            return probe._like(probe._index, _cast_dtype(func, args[1:], kwargs, probe.dtype))
        with torch._C.DisableTorchFunctionSubclass():  # metadata reads; ops on data reach __torch_dispatch__
            return func(*args, **kwargs)

    def _wrap(self, t, func):
        if not isinstance(t, torch.Tensor):
            return t
        if not torch._C._is_alias_of(t, self._sink.base):
            raise UnsupportedLoad(f"{getattr(func, '__name__', func)} copies the data (no view of it)")
        return self._like(t)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise UnsupportedLoad(f"the loader computes on the weight ({func})")


def _cast_dtype(func, args, kwargs, current: torch.dtype) -> torch.dtype:
    fixed = _CASTS[func]
    if fixed is not None:
        return fixed
    for a in (*args, kwargs.get("dtype")):
        if isinstance(a, torch.dtype):
            return a
        if isinstance(a, torch.Tensor):
            return a.dtype
    return current  # .to(device): the same elements


class _Sink:
    """Collects one canonical tensor's landings; knows every parameter's storage."""

    def __init__(self, params: Mapping[str, torch.Tensor]):
        self.by_storage: dict[tuple[str, int], list[tuple[str, torch.Tensor]]] = {}
        for name, p in params.items():  # several parameters may share one storage (a flat buffer, a tied weight)
            self.by_storage.setdefault((p.device.type, p.untyped_storage().data_ptr()), []).append((name, p))
        self.base = torch.empty(0, device="meta")
        self.spec: TensorSpec | None = None
        self.landings: list[Landing] = []

    def begin(self, spec: TensorSpec) -> torch.Tensor:
        self.spec, self.landings = spec, []
        self.base = torch.empty(spec.shape, device="meta")
        return self.base

    def land(self, dest: torch.Tensor, src: _Probe) -> None:
        if tuple(dest.shape) != tuple(src.shape):
            raise UnsupportedLoad(f"copies a {tuple(src.shape)} piece into a {tuple(dest.shape)} region (broadcast)")
        start = dest.storage_offset()
        found = [
            (n, p)
            for n, p in self.by_storage.get((dest.device.type, dest.untyped_storage().data_ptr()), ())
            if p.storage_offset() <= start < p.storage_offset() + max(1, p.numel())
        ]
        if not found:
            raise UnsupportedLoad("copies into memory that is no parameter of the model")
        pname, param = found[0]
        rel = dest.storage_offset() - param.storage_offset()
        boxed = region_box(
            tuple(self.spec.shape), src._index.storage_offset(), tuple(src.shape), src._index.stride(), dest.stride()
        )
        if boxed is None:
            raise UnsupportedLoad("lands a part of the weight that is no box of it (steps, repeats)")
        if not param.is_contiguous():
            raise UnsupportedLoad(f"lands in {pname}, which is not contiguous")
        in_param = region_box(tuple(param.shape), rel, tuple(dest.shape), dest.stride())
        if in_param is None:
            raise UnsupportedLoad(f"lands in a region of {pname} that is no box of it")
        self.landings.append(Landing(pname, boxed.box, rel, boxed.strides, in_param.box, param.dtype))


def record_loads(
    load: Callable[[str, torch.Tensor], object],
    specs: Iterable[TensorSpec],
    params: Mapping[str, torch.Tensor],
    device: torch.device | str = "cpu",
) -> Recording:
    """Run ``load(name, probe)`` (the engine's loader for one checkpoint tensor) for every spec and record where
    each lands in ``params`` (the live parameters, by name). Nothing is written to any parameter.

    Raises :class:`AmbiguousLoadError` naming the tensors where one canonical element lands twice on this rank
    or two land in one place; a loader error other than an unsupported operation is raised naming the tensor."""
    sink = _Sink(params)
    out = Recording()
    device = torch.device(device)
    for spec in specs:
        index = sink.begin(spec)
        probe = _Probe(index, getattr(torch, spec.dtype), device, sink)
        try:
            load(spec.name, probe)
        except UnsupportedLoad as e:
            out.unsupported[spec.name] = str(e)
            continue
        except Exception as e:
            raise AwexValueError(
                f"the engine's loader for {spec.name} {tuple(spec.shape)} failed on a probe: {e}"
            ) from e
        if sink.landings:
            out.landings[spec.name] = tuple(sink.landings)
    _check(out)
    return out


def _check(rec: Recording) -> None:
    by_param: dict[str, list[tuple[str, Landing]]] = {}
    for name, landings in rec.landings.items():
        for i, a in enumerate(landings):
            for b in landings[:i]:
                if a.box.intersect(b.box) is not None:
                    raise AmbiguousLoadError(f"{name}: its elements {a.box.intersect(b.box)} land twice on this rank")
            by_param.setdefault(a.param, []).append((name, a))
    for param, items in by_param.items():
        items.sort(key=lambda x: x[1].param_box.offsets)
        for i, (name, a) in enumerate(items):
            for other, b in items[:i]:
                both = a.param_box.intersect(b.param_box)
                if both is not None:
                    raise AmbiguousLoadError(f"{param}: {other} {b.box} and {name} {a.box} land in one place ({both})")


def landing_view(param: torch.Tensor, landing: Landing) -> torch.Tensor:
    """The view of ``param`` (the parameter as it is now) that box ``landing.box`` lands in."""
    return param.as_strided(landing.box.sizes, landing.strides, param.storage_offset() + landing.offset)
