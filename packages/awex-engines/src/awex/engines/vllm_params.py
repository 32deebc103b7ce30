"""Where each canonical tensor lands in a running vLLM worker: in place, or through vLLM's weight loaders.

In place means the received bytes are written straight into the storage of vLLM's live parameters (views from
``awex.convert.vllm_views``): no staging copy of the shard, no full-size temporary, no loader call. That is only
correct where vLLM computes from the parameter itself. Where vLLM transformed a parameter after loading
(vLLM-CPU prepacks linear weights into a kernel's own format and MoE experts into grouped-GEMM order; quantisation
methods may repack, transpose or requantise), writing the parameter would change nothing the model computes, so
the whole module goes through vLLM's loaders inside a layerwise reload instead. The rule is decided per module
(vLLM's layerwise reload finalises a module as a unit) and fails closed: a quantisation method not known to keep
its parameters as loaded takes the loader path. A layer that derives tensors of its own from a sibling's weight
(vLLM's latent attention from ``kv_b_proj``) makes its whole block one unit (:data:`DERIVING_LAYERS`).

A parameter that should receive in place but does not match what Awex computes for it (missing, other shape,
dtype or strides) is refused when the backend starts, naming the parameter, before any byte moves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch

from awex.convert.vllm import vllm_param_name
from awex.meta.errors import AwexValueError

# Quantisation methods whose parameters are what the kernels read (no repacking after loading).
PLAIN_METHODS = frozenset({"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod", "UnquantizedFusedMoEMethod"})


def transformed_reason(module: torch.nn.Module | None) -> str | None:
    """Why ``module``'s parameters must go through vLLM's loaders (``None``: they can be written in place)."""
    if module is None:
        return None
    method = getattr(module, "quant_method", None)
    if method is not None and type(method).__name__ not in PLAIN_METHODS:
        return f"quantisation method {type(method).__name__} may repack its weights after loading"
    cpu_linear = getattr(module, "cpu_linear", None)
    if cpu_linear is not None and cpu_linear is not torch.nn.functional.linear:
        return "vLLM-CPU computes from a prepacked copy of this weight"
    kernel = getattr(method, "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if experts is not None and _prepacks_experts(experts):
        return f"{type(experts).__name__} prepacks the experts after loading"
    return None


# Layers that derive tensors of their own from a sibling's weight after loading, and the weight they read: vLLM's
# multi-head latent attention splits ``kv_b_proj`` into its decode matrices (W_UK, W_UV). Their block (the
# attention module holding both) reloads as one unit, so that vLLM re-derives them from the new weight.
DERIVING_LAYERS = {"MLAAttention": "vLLM's latent attention derives its decode matrices from kv_b_proj"}


def reload_units(model: torch.nn.Module) -> dict[str, str]:
    """Modules whose parameters must load as one unit, with why: the parent of every deriving layer's block."""
    units = {}
    modules = dict(model.named_modules())  # each module once, under the first name it is registered by
    for name, module in modules.items():
        why = DERIVING_LAYERS.get(type(module).__name__)
        if why is None:
            continue
        parts = name.split(".")
        # the attention block: the innermost ancestor under which the weight the layer derives from is registered
        for depth in range(len(parts) - 1, 0, -1):
            block = ".".join(parts[:depth])
            if f"{block}.kv_b_proj" in modules:
                units[block] = why
                break
    return units


def _prepacks_experts(experts) -> bool:
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # not the CPU build
        return False
    return isinstance(experts, CPUUnquantizedExperts) and not getattr(experts, "_use_zentorch", False)


@dataclass
class Destinations:
    """One worker's routing of its canonical tensors: ``in_place`` names go into live parameters, ``loader``
    names (with the reason, per module) through vLLM's loaders."""

    in_place: list[str] = field(default_factory=list)
    loader: list[str] = field(default_factory=list)
    loader_modules: dict[str, str] = field(default_factory=dict)  # module name -> why it cannot take bytes in place
    unit: dict[str, str] = field(default_factory=dict)  # loader name -> the module reloaded for it (as a unit)

    def summary(self) -> str:
        why = sorted(set(self.loader_modules.values()))
        return f"{len(self.in_place)} tensors in place, {len(self.loader)} through vLLM's loaders" + (
            f" ({'; '.join(why)})" if why else ""
        )


def route(
    model: torch.nn.Module,
    names: list[str],
    tie_embeddings: bool,
    expected: dict[str, tuple[int, ...]] | None = None,
    dtypes: dict[str, torch.dtype] | None = None,
    in_place: bool = True,
    native: Mapping[str, str] | None = None,
    forced: Mapping[str, str] | None = None,
) -> Destinations:
    """Route the canonical tensors ``names`` of one worker (``in_place=False``: all through the loaders).

    ``expected`` / ``dtypes``: the native parameters' shapes and dtypes Awex computes for this rank
    (``awex.convert.vllm_param_shapes`` / ``vllm_param_dtypes``); an in-place parameter that differs, or is
    not contiguous, raises ``ValueError`` naming it. ``native``: the parameter each name lands in, where a layout
    learned from vLLM's loaders says so (default: the table's names); ``forced``: names whose loaders cannot be
    replayed as views, with why (their modules take the loader path).
    """
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    out = Destinations()
    native = {name: (native or {}).get(name) or vllm_param_name(name, tie_embeddings) for name in names}
    units = reload_units(model)

    def unit_of(module_name: str) -> str:
        return next((u for u in units if module_name.startswith(u + ".")), module_name)

    for name in names:
        module_name = native[name].rpartition(".")[0]
        unit = unit_of(module_name)
        reason = (
            "staged receive (atomic updates) asked for"
            if not in_place
            else units.get(unit)
            or transformed_reason(modules.get(module_name))
            or ((forced or {}).get(name) and f"its loader {forced[name]}")
        )
        if reason is not None:
            out.loader_modules[unit] = out.loader_modules.get(unit) or reason
    problems = []
    for name in names:
        param_name = native[name]
        unit = unit_of(param_name.rpartition(".")[0])
        if unit in out.loader_modules:
            out.loader.append(name)
            out.unit[name] = unit
            continue
        param = params.get(param_name)
        if param is None:
            problems.append(f"{param_name} (for {name}): vLLM has no such parameter")
            continue
        want_shape = (expected or {}).get(param_name)
        if want_shape is not None and tuple(param.shape) != tuple(want_shape):
            problems.append(f"{param_name}: vLLM holds shape {tuple(param.shape)}, Awex computes {tuple(want_shape)}")
        elif dtypes and param_name in dtypes and param.dtype != dtypes[param_name]:
            problems.append(f"{param_name}: vLLM holds {param.dtype}, Awex computes {dtypes[param_name]}")
        elif not param.is_contiguous():
            problems.append(f"{param_name}: not contiguous (strides {param.stride()})")
        else:
            out.in_place.append(name)
    if problems:
        shown = "\n  ".join(sorted(set(problems))[:20])
        raise AwexValueError(
            f"vLLM's live parameters do not match the layout Awex computes for this rank "
            f"({len(set(problems))} problem(s)):\n  {shown}"
        )
    return out
