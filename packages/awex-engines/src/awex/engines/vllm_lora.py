"""LoRA adapters a vLLM engine serves, received in place: the adapters' own tensors in the engine, no files.

    llm = LLM(model=..., enable_lora=True, max_lora_rank=8, weight_transfer_config=WeightTransferConfig("awex"))
    llm.llm_engine.add_lora(LoRARequest("math", 1, "/path/to/initial/adapter"))     # served once, from PEFT's save
    llm.init_weight_transfer_engine({"init_info": {..., "lora": {"math": 1}}})       # served name -> lora_int_id

vLLM keeps each registered adapter in its LoRA manager (``model.lora_manager``): per wrapped module, A ``[r, in]``
and B ``[out, r]`` with the adapter's scale folded into B, and for fused modules (``qkv_proj``, ``gate_up_proj``)
one pair per part. A version lands in those tensors (:class:`AdapterTensors`: each lookup goes through the manager,
so an adapter removed and added again is found where it is now), and then in the GPU slots that serve the adapter
through vLLM's own ``set_lora`` (:func:`refresh_slots`: it cuts each part for tensor parallelism as when the adapter
was activated). Every worker receives each adapter whole (replicated over the engine's ranks). Awex pins each adapter
(``pin_adapter``) so vLLM never evicts it and loads it again from the stale files it was first served from.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from awex.engines.lora import check_adapters, lora_name
from awex.meta import Layout, TensorSpec
from awex.meta.errors import AwexValueError
from awex.meta.layout import Mesh, MeshSharding, TensorLayout
from awex.meta.spec import Role


def lora_manager(model: torch.nn.Module):
    """The engine's LoRA model manager (vLLM sets ``model.lora_manager`` when LoRA is enabled)."""
    manager = getattr(model, "lora_manager", None)
    if manager is None:
        raise AwexValueError(
            "awex backend: lora= needs an engine serving LoRA adapters (enable_lora=True / vllm serve --enable-lora)"
        )
    return manager


class AdapterTensors(Mapping[str, torch.Tensor]):
    """``{canonical name: tensor}`` over the registered adapters' weights in the engine's LoRA manager, each looked
    up at each access (``awex.engines.lora.lora_name`` names them as the trainer does)."""

    def __init__(self, manager, adapters: Mapping[str, int]):
        self._manager = manager
        self._where: dict[str, tuple[int, str, str, int | None]] = {}  # name -> (id, module, part, packed index)
        packed = getattr(manager, "packed_modules", {}) or {}
        for served, lora_id in adapters.items():
            model = _registered(manager, served, lora_id)
            for module, weights in sorted(model.loras.items()):
                if isinstance(weights.lora_a, list):
                    parts = packed.get(module)
                    if parts is None or len(parts) != len(weights.lora_a):
                        raise AwexValueError(f"awex backend: lora {served!r}: {module} has no parts Awex can name")
                    for i, part in enumerate(parts):
                        if weights.lora_a[i] is not None:
                            self._add(served, lora_id, part, module, i)
                else:
                    self._add(served, lora_id, module, module, None)

    def _add(self, served: str, lora_id: int, target: str, module: str, index: int | None) -> None:
        for part in ("A", "B"):
            self._where[lora_name(served, target, part)] = (lora_id, module, part, index)

    def __getitem__(self, name: str) -> torch.Tensor:
        lora_id, module, part, index = self._where[name]
        model = self._manager.get_adapter(lora_id)
        if model is None:
            raise KeyError(f"{name}: adapter id {lora_id} is no longer registered in the engine")
        weights = model.get_lora(module)
        attr = "lora_a" if part == "A" else "lora_b"
        held = getattr(weights, attr)
        t = held if index is None else held[index]
        if t.is_inference():  # loaded by vLLM while generating: writable only in inference mode, so copied once
            with torch.inference_mode(False):
                t = t.clone()
            if index is None:
                setattr(weights, attr, t)
            else:
                held[index] = t
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def ids(self) -> set[int]:
        return {lora_id for lora_id, _, _, _ in self._where.values()}


def _registered(manager, served: str, lora_id: int):
    model = manager.get_adapter(lora_id)
    if model is None:
        raise AwexValueError(
            f"awex backend: lora {served!r}: no adapter with id {lora_id} is loaded in this engine; serve it first "
            f"(llm.llm_engine.add_lora(LoRARequest({served!r}, {lora_id}, path)), or vllm serve --lora-modules), "
            "from the trainer's initial adapter saved with PEFT's save_pretrained"
        )
    return model


def lora_layout(tensors: AdapterTensors, instance: str, world_size: int) -> Layout:
    """Every adapter tensor held whole by each of the engine's ``world_size`` ranks."""
    mesh = Mesh("lora", (("world", world_size),))
    layouts = []
    for name in sorted(tensors):
        t = tensors[name]
        spec = TensorSpec(name, tuple(t.shape), str(t.dtype).removeprefix("torch."))
        layouts.append(TensorLayout(spec, MeshSharding("lora")))
    return Layout(instance, Role.INFERENCE, world_size, (mesh,), tuple(layouts))


def pin(manager, ids: set[int]) -> None:
    """Keep the adapters registered and in their GPU slots: vLLM would otherwise evict one when others are asked
    for, and load it again from the files it was first served from, i.e. the adapter's first weights. Each pinned
    adapter holds one of the engine's ``max_loras`` slots for good: more than that is refused, saying so."""
    slots = getattr(manager, "lora_slots", None)
    if isinstance(slots, int) and len(ids) > slots:
        raise AwexValueError(
            f"awex backend: lora= names {len(ids)} adapters, and each keeps one of the engine's {slots} GPU slots "
            f"(max_loras={slots}): start the engine with max_loras >= {len(ids)}"
        )
    for lora_id in sorted(ids):
        manager.pin_adapter(lora_id)


def keep(manager, ids: set[int]) -> None:
    """Keep the adapters ``ids`` served when vLLM drops every adapter: it does so at the end of every weight update
    (``finish_weight_update`` resets the LoRA state), and a request would then load the adapter again from the files
    it was first served from, i.e. its first weights. Each is added back, as it is at that moment (the version just
    received), and pinned again. Set once per manager (``remove_all_adapters`` wrapped on the instance); a later call
    adds to the ids kept."""
    wrapped = getattr(manager.remove_all_adapters, "awex_kept", None)
    if wrapped is not None:
        wrapped.update(ids)
        return
    original = manager.remove_all_adapters
    kept = set(ids)

    def remove_all_adapters() -> None:
        held = {lora_id: manager.get_adapter(lora_id) for lora_id in sorted(kept)}
        original()
        for lora_id, model in held.items():
            if model is not None:
                manager.add_adapter(model)
                manager.pin_adapter(lora_id)

    remove_all_adapters.awex_kept = kept
    manager.remove_all_adapters = remove_all_adapters


def refresh_slots(manager, ids: set[int]) -> int:
    """Copy the adapters ``ids`` into the GPU slots that serve them, through vLLM's own ``set_lora`` (as activating
    the adapter does); returns how many slots were refreshed."""
    refreshed = 0
    for index, lora_id in enumerate(manager.lora_index_to_id):
        if lora_id not in ids:
            continue
        model = manager.get_adapter(lora_id)
        for module_name, module in manager.modules.items():
            weights = model.get_lora(module_name)
            if weights is not None:
                module.set_lora(index, weights.lora_a, weights.lora_b)
        refreshed += 1
    if refreshed and torch.cuda.is_available():
        torch.cuda.synchronize()  # set_lora copies from pinned host memory without blocking: done before resuming
    return refreshed


def lora_receiver(model: torch.nn.Module, adapters: Mapping[str, int], instance: str, world_size: int):
    """``(layout, view_of, after_apply)`` of a worker receiving the adapters ``{served name: lora_int_id}``: the
    adapters pinned, their tensors' layout, views into them (fingerprinted: an adapter added again is found), and
    what copies a version into the adapters' GPU slots once it is whole."""
    from awex.convert.live import fingerprinted

    manager = lora_manager(model)
    tensors = AdapterTensors(manager, check_adapters(adapters))
    ids = tensors.ids()
    pin(manager, ids)
    keep(manager, ids)

    def view_of(name: str, box) -> torch.Tensor:
        return tensors[name][box.slices()]

    layout = lora_layout(tensors, instance, world_size)
    return layout, fingerprinted(view_of, tensors), lambda: refresh_slots(manager, ids)


__all__ = [
    "AdapterTensors",
    "lora_layout",
    "lora_manager",
    "keep",
    "lora_receiver",
    "pin",
    "refresh_slots",
]
