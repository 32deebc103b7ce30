"""Engine layout descriptions as short strings, e.g. ``megatron:tp=4,pp=8,ep=8,dp=4`` or
``vllm:tp=8,ep=8,instances=16``, as the planner CLI takes them."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Sequence

from awex.meta.errors import AwexValueError
from awex.meta.layout import Layout
from awex.meta.layouts.hf import hf_layout
from awex.meta.layouts.megatron import MegatronParallel, megatron_layout
from awex.meta.layouts.sglang import SglangParallel, sglang_layout
from awex.meta.layouts.vllm import VllmParallel, vllm_layout
from awex.meta.models import CanonicalTensor
from awex.meta.spec import Role

ENGINES = {
    "megatron": "trainer: tp, pp, dp, cp, ep, etp, vpp, vocab_pad (default 128)",
    "vllm": "inference: tp, pp, dp, ep (1 or dp*tp: expert parallel), instances, vocab_pad (default 64)",
    "sglang": "inference: tp, pp, ep, attn_dp, moe_dp, dp_lm_head (0/1), instances, vocab_pad (default 64)",
    "hf": "trainer or inference, one rank per instance: instances",
}


@dataclass(frozen=True)
class EngineSpec:
    """A parsed engine description: engine name, integer options and the number of instances."""

    engine: str
    options: dict[str, int] = field(default_factory=dict)
    instances: int = 1


def parse_engine_spec(text: str) -> EngineSpec:
    """Parse ``engine[:key=value,...]``; raises ``ValueError`` with the accepted keys on bad input."""
    engine, _, rest = text.strip().partition(":")
    engine = engine.strip().lower()
    if engine not in ENGINES:
        raise AwexValueError(f"unknown engine {engine!r} in {text!r}; known: {', '.join(ENGINES)}")
    options: dict[str, int] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise AwexValueError(f"{text!r}: expected key=value, got {item!r}")
        if key.strip() in options or (key.strip() == "instances" and "instances" in options):
            raise AwexValueError(f"{text!r}: {key.strip()} given twice")
        try:
            options[key.strip()] = int(value)
        except ValueError:
            raise AwexValueError(f"{text!r}: {key.strip()} must be an integer, got {value!r}") from None
    instances = options.pop("instances", 1)
    if instances < 1:
        raise AwexValueError(f"{text!r}: instances must be positive")
    allowed = {
        "megatron": {f.name for f in fields(MegatronParallel)},
        "vllm": {"tp", "pp", "dp", "ep", "vocab_pad"},
        "sglang": {"tp", "pp", "ep", "attn_dp", "moe_dp", "dp_lm_head", "vocab_pad"},
        "hf": set(),
    }[engine]
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise AwexValueError(f"{text!r}: unknown option(s) {unknown} for {engine} ({ENGINES[engine]})")
    if engine == "megatron" and instances != 1:
        raise AwexValueError(f"{text!r}: a Megatron job is one instance; use dp= for replicas")
    return EngineSpec(engine, options, instances)


def layouts_for(
    spec: EngineSpec,
    tensors: Sequence[CanonicalTensor],
    role: Role | str,
    prefix: str | None = None,
    architecture: str = "",
) -> list[Layout]:
    """The layouts of every instance an engine description stands for (``architecture``: the model's, as its HF
    config names it; SGLang's layout depends on it)."""
    role = Role(role)
    prefix = prefix or spec.engine
    parallel_experts = {k: v for k, v in spec.options.items() if k in ("ep", "etp", "moe_dp") and v > 1}
    if parallel_experts and not any(t.expert is not None for t in tensors):
        given = ", ".join(f"{k}={v}" for k, v in parallel_experts.items())
        raise AwexValueError(f"{spec.engine}: {given} splits experts, and this model has none (a dense model)")
    if spec.engine == "megatron":
        if role != Role.TRAINER:
            raise AwexValueError("megatron is a trainer engine")
        return [megatron_layout(tensors, MegatronParallel(**spec.options), instance=prefix)]
    if spec.engine == "vllm":
        if role != Role.INFERENCE:
            raise AwexValueError("vllm is an inference engine")
        opts = dict(spec.options)
        tp, dp = opts.get("tp", 1), opts.get("dp", 1)
        ep = opts.pop("ep", 1)
        if ep not in (1, tp * dp):
            raise AwexValueError(f"vllm: ep={ep} must be 1 or dp*tp={tp * dp} (vLLM's expert parallelism spans dp*tp)")
        par = VllmParallel(ep=ep > 1, **opts)
        first = vllm_layout(tensors, par, instance=_name(prefix, 0, spec.instances))
        return [first] + [_renamed(first, _name(prefix, i, spec.instances)) for i in range(1, spec.instances)]
    if spec.engine == "sglang":
        if role != Role.INFERENCE:
            raise AwexValueError("sglang is an inference engine")
        opts = dict(spec.options)
        par = SglangParallel(dp_lm_head=bool(opts.pop("dp_lm_head", 0)), **opts)
        first = sglang_layout(tensors, par, architecture, instance=_name(prefix, 0, spec.instances))
        return [first] + [_renamed(first, _name(prefix, i, spec.instances)) for i in range(1, spec.instances)]
    first = hf_layout(tensors, role, instance=_name(prefix, 0, spec.instances))
    return [first] + [_renamed(first, _name(prefix, i, spec.instances)) for i in range(1, spec.instances)]


def _name(prefix: str, i: int, n: int) -> str:
    return prefix if n == 1 else f"{prefix}-{i:0{len(str(n - 1))}d}"


def _renamed(layout: Layout, instance: str) -> Layout:
    return layout.renamed(instance)
