"""A module's parameters and buffers where they are now: each lookup goes through the module that owns the tensor,
so views made after an offload and reload, a ``param.data`` swap, a resharding or a replaced ``nn.Parameter``
alias the current memory (a view made earlier keeps the old memory alive and would send stale bytes)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from itertools import chain

import torch


class LiveTensors(Mapping[str, torch.Tensor]):
    """``{name: tensor}`` over ``module``'s parameters (as ``named_parameters`` names them; their ``.data``, or
    the ``nn.Parameter`` itself with ``data=False``) and, with ``buffers=True``, its buffers (parameters win a
    name both have). The names are fixed when made; the tensors are looked up at each access. An object that is
    not an ``nn.Module`` but names its tensors alike (``named_parameters``, ``named_buffers``) is read once."""

    def __init__(self, module: torch.nn.Module, *, parameters: bool = True, buffers: bool = True, data: bool = True):
        named = (list(module.named_buffers()) if buffers else []) + (
            list(module.named_parameters()) if parameters else []
        )
        self._owners: dict[str, tuple[object, str]] = {}
        for name, t in named:
            path, _, leaf = name.rpartition(".")
            if isinstance(module, torch.nn.Module):
                self._owners[name] = (module.get_submodule(path), leaf)
            else:  # no owners to look through: the tensor as it is now
                self._owners[name] = (_Held(t), "tensor")
        self._data = data
        # where each tensor is held now (its owner's _parameters or _buffers, or __dict__): fingerprint() reads them
        # in one pass without a Python call per tensor; a tensor found elsewhere since takes the full lookups
        self._slots = [_slot(owner, leaf) for owner, leaf in self._owners.values()]
        self._leaves = [leaf for _, leaf in self._owners.values()]

    def __getitem__(self, name: str) -> torch.Tensor:
        owner, leaf = self._owners[name]
        t = getattr(owner, leaf, None)
        if not isinstance(t, torch.Tensor):
            raise KeyError(f"{name} is no longer a tensor of its module")
        return t.data if self._data and isinstance(t, torch.nn.Parameter) else t

    def fingerprint(self) -> tuple:
        """:func:`fingerprint` of these tensors, read in one pass (a steady sync asks it every version: no Python
        call per tensor)."""
        try:
            now = map(dict.get, self._slots, self._leaves)
            return tuple([(t.data_ptr(), t.shape, t.stride(), t.dtype) for t in now])
        except AttributeError:  # a tensor no longer where it was held (replaced by another kind of attribute)
            return _fingerprint(self)

    def __contains__(self, name: object) -> bool:
        return name in self._owners

    def __iter__(self) -> Iterator[str]:
        return iter(self._owners)

    def __len__(self) -> int:
        return len(self._owners)


def _slot(owner: object, leaf: str) -> dict:
    """The dictionary that holds ``owner``'s attribute ``leaf`` now (a module's parameters win over its buffers)."""
    for where in ("_parameters", "_buffers"):
        held = getattr(owner, where, None)
        if isinstance(held, dict) and leaf in held:
            return held
    return owner.__dict__


class _Held:
    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


def fingerprint(*tensors: Mapping[str, torch.Tensor]) -> tuple:
    """Where every tensor of ``tensors`` is now (address, shape, strides, dtype), in order: equal to an earlier
    fingerprint exactly when none of them moved, was replaced or resharded. The address also tells the device
    (host and GPU memory never share an address under CUDA's unified addressing; a meta tensor's is 0; a storage
    freed in place has none). Views derived from the tensors by a fixed rule (``view_of``) are then the views they
    were; cheaper than deriving the views again (taking each tensor's device object too cost a third more)."""
    parts = [m.fingerprint() if isinstance(m, LiveTensors) else _fingerprint(m) for m in tensors]
    return parts[0] if len(parts) == 1 else tuple(chain.from_iterable(parts))


def _fingerprint(tensors: Mapping[str, torch.Tensor]) -> tuple:
    return tuple([(t.data_ptr(), t.shape, t.stride(), t.dtype) for t in tensors.values()])


def fingerprinted(view_of: Callable, *tensors: Mapping[str, torch.Tensor]) -> Callable:
    """``view_of`` with a ``fingerprint()`` over the mappings its views are taken from (read by
    ``awex.transport.shards.rebound``, which then asks for the views again only when it changed)."""
    view_of.fingerprint = lambda: fingerprint(*tensors)
    return view_of
