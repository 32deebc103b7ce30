"""A module's parameters and buffers where they are now: each lookup goes through the module that owns the tensor,
so views made after an offload and reload, a ``param.data`` swap, a resharding or a replaced ``nn.Parameter``
alias the current memory (a view made earlier keeps the old memory alive and would send stale bytes)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from itertools import chain, repeat
from operator import attrgetter

import torch


class LiveTensors(Mapping[str, torch.Tensor]):
    """``{name: tensor}`` over ``module``'s parameters (as ``named_parameters`` names them; their ``.data``, or
    the ``nn.Parameter`` itself with ``data=False``) and, with ``buffers=True``, its buffers (parameters win a
    name both have). The names are fixed when made; the tensors are looked up at each access. An object that is
    not an ``nn.Module`` but names its tensors alike (``named_parameters``, ``named_buffers``) is read once. With
    ``local=True`` a DTensor stands for its local shard (FSDP2: what a rank's views are taken from)."""

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        parameters: bool = True,
        buffers: bool = True,
        data: bool = True,
        local: bool = False,
    ):
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
        self._data, self._local = data, local
        # where each tensor is held now (its owner's _parameters or _buffers, or __dict__): fingerprint() reads them
        # in one pass without a Python call per tensor; a tensor found elsewhere since takes the full lookups
        self._slots = [_slot(owner, leaf) for owner, leaf in self._owners.values()]
        self._leaves = [leaf for _, leaf in self._owners.values()]

    def __getitem__(self, name: str) -> torch.Tensor:
        owner, leaf = self._owners[name]
        t = getattr(owner, leaf, None)
        if not isinstance(t, torch.Tensor):
            raise KeyError(f"{name} is no longer a tensor of its module")
        if self._local:
            t = _shard(t)
        return t.data if self._data and isinstance(t, torch.nn.Parameter) else t

    def _now(self) -> list:
        """The tensors where they are held now, in one pass (a DTensor's local shard with ``local``)."""
        now = list(map(dict.get, self._slots, self._leaves))
        return list(map(getattr, now, repeat("_local_tensor"), now)) if self._local else now  # no call per tensor

    def fingerprint(self) -> tuple:
        """:func:`fingerprint` of these tensors, read in one pass (a steady sync asks it every version: no Python
        call per tensor)."""
        return self.addresses(), self.forms()

    def addresses(self) -> tuple:
        """:func:`addresses` of these tensors, read in one pass."""
        try:
            now = self._now()
            return (*map(_data_ptr, now), *map(_nbytes, now))
        except (AttributeError, TypeError, RuntimeError):  # a tensor no longer where it was held (replaced by
            return _addresses(self)  # another attribute), or a tensor without storage (a DTensor not seen as one)

    def tensors(self) -> list[torch.Tensor]:
        """These tensors as they are now (as ``self[name]`` gives each; detached with ``local``, as views of a
        DTensor's shard are), in the order of :meth:`forms`."""
        now = [self[name] for name in self._owners]
        return [t.detach() for t in now] if self._local else now

    def forms(self) -> tuple:
        """:func:`forms` of these tensors, read in one pass."""
        try:
            return tuple([(t.shape, t.stride(), t.dtype) for t in self._now()])
        except (AttributeError, TypeError, RuntimeError):
            return _forms(self)

    def __contains__(self, name: object) -> bool:
        return name in self._owners

    def __iter__(self) -> Iterator[str]:
        return iter(self._owners)

    def __len__(self) -> int:
        return len(self._owners)


def _shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its ``_local_tensor``, where ``to_local()`` would be an autograd call), else ``t``."""
    local = getattr(t, "_local_tensor", None)
    if local is None and callable(getattr(t, "to_local", None)):
        local = t.to_local()
    return local if isinstance(local, torch.Tensor) else t


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
    """Where every tensor of ``tensors`` is now: ``(addresses(*tensors), forms(*tensors))``, equal to an earlier
    fingerprint exactly when none of them moved, was replaced or resharded. Views derived from the tensors by a fixed
    rule (``view_of``) are then the views they were; cheaper than deriving the views again (taking each tensor's
    device object too cost a third more)."""
    return addresses(*tensors), forms(*tensors)


def addresses(*tensors: Mapping[str, torch.Tensor]) -> tuple:
    """Every tensor's address, then every tensor's size in bytes, in order: the part of :func:`fingerprint` that
    tells whether the memory the views address is still theirs (a tensor moved, freed in place, replaced, or
    re-allocated smaller changes it). The address also tells the device (host and GPU memory never share an address
    under CUDA's unified addressing; a meta tensor's is 0; a storage freed in place has none). About a fifth of the
    whole fingerprint's cost: what a steady sync checks before any byte moves (``awex.transport.rebind.rebound``)."""
    return tuple(chain.from_iterable(m.addresses() if isinstance(m, LiveTensors) else _addresses(m) for m in tensors))


def forms(*tensors: Mapping[str, torch.Tensor]) -> tuple:
    """Every tensor's ``(shape, strides, dtype)``, in order: the rest of :func:`fingerprint` (a tensor changed in
    place at the same address: transposed, viewed as another shape or dtype), checked while the bytes move."""
    return tuple(chain.from_iterable(m.forms() if isinstance(m, LiveTensors) else _forms(m) for m in tensors))


_data_ptr = torch.Tensor.data_ptr  # the unbound method: no Python call per tensor
_nbytes = attrgetter("nbytes")


def _addresses(tensors: Mapping[str, torch.Tensor]) -> tuple:
    now = list(tensors.values())
    return (*[t.data_ptr() for t in now], *[t.nbytes for t in now])


def _forms(tensors: Mapping[str, torch.Tensor]) -> tuple:
    return tuple([(t.shape, t.stride(), t.dtype) for t in tensors.values()])


def sources(*tensors: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """Every tensor of ``tensors`` as it is now, in the order of :func:`forms`."""
    return list(chain.from_iterable(m.tensors() if isinstance(m, LiveTensors) else m.values() for m in tensors))


def fingerprinted(view_of: Callable, *tensors: Mapping[str, torch.Tensor]) -> Callable:
    """``view_of`` with a ``fingerprint()`` over the mappings its views are taken from (read by
    ``awex.transport.rebind.rebound``, which then asks for the views again only when it changed), and ``sources()``,
    those tensors (views are re-pointed at them where only their addresses changed:
    ``awex.transport.moved_views``). Its views must be derived from those tensors by a fixed rule."""
    if len(tensors) == 1 and isinstance(tensors[0], LiveTensors):  # the usual case: its methods, no call between
        view_of.fingerprint, view_of.addresses, view_of.forms, view_of.sources = (
            tensors[0].fingerprint,
            tensors[0].addresses,
            tensors[0].forms,
            tensors[0].tensors,
        )
    else:
        view_of.fingerprint = lambda: fingerprint(*tensors)
        view_of.addresses = lambda: addresses(*tensors)
        view_of.forms = lambda: forms(*tensors)
        view_of.sources = lambda: sources(*tensors)
    return view_of
