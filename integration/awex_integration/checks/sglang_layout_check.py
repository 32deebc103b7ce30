"""Checks Awex's SGLang layout against SGLang's own model classes and weight loaders, on CPU, without a server.

For every case (a small model and an SGLang parallel configuration) and every rank of the engine:

1. **Parameters**: SGLang's model class is built on the meta device with that rank's parallel state; its
   ``named_parameters()`` (names, shapes, dtypes) must equal :func:`awex.convert.sglang.sglang_param_shapes` /
   ``sglang_param_dtypes``, and the binding must read the case's parallel sizes and the rank back from SGLang's
   published state (:func:`awex.engines.sglang.sglang_runtime_parallel`).
2. **Where each element goes**: the same class is built on CPU twice with zeroed parameters. SGLang's own
   ``load_weights`` loads random canonical (HF) tensors into the first; Awex writes the boxes the layout gives the
   rank through :func:`~awex.convert.sglang.sglang_views` into the second. Every parameter must be equal, element
   for element (so the views put each value where SGLang's loader does, and cover everything it writes).

3. **A sync through the binding** (``--sync``, cases of :data:`SYNC_CASES`): an HF transformers trainer (random
   weights) writes two versions through a ``WeightsWriter`` over gloo, and each rank's SGLang model (built by
   SGLang's class, zeroed) receives them through :func:`awex.engines.sglang.receive_weights`, the function SGLang
   calls as its custom weight loader. After each version every parameter must equal what SGLang's own
   ``load_weights`` makes of the trainer's weights. (SGLang's forward pass needs its kernels: greedy output is not
   compared here; the CUDA server test does.)

Runs in an environment with the ``sglang`` package installed without its dependencies (no server, no GPU; the
``sglang_layout`` nox session builds it). Two modules are replaced, for this check only, by modules whose every
function raises :class:`KernelCalled`, so building a model and loading weights provably call neither (if one did,
the check fails saying which): SGLang's kernel module ``sgl_kernel`` (CUDA/CPU-AMX kernels), and ``torchvision``,
which SGLang's multimodal config helpers import at import time (its PyPI wheels are CUDA builds whose operators do
not load against torch's CPU build; no text model uses it). Parallel groups are stand-ins carrying each group's
rank and size, as SGLang's own tests do (``sglang.test.parallel_groups``); no process group is formed.

    python -m awex_integration.checks.sglang_layout_check [--case NAME ...] [--list]

Prints one line per case and rank; exits non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import os
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")  # SGLang's CPU code paths (no CUDA probing at import)


class KernelCalled(RuntimeError):
    """A function of a replaced SGLang kernel module was called."""


class _Stub:
    """Any name in a replaced kernel module: its attributes are stubs, calling it raises."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str) -> _Stub:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Stub(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise KernelCalled(f"{self._name} was called: this check replaces {self._name.split('.')[0]}")


class _StubModule(types.ModuleType):
    def __getattr__(self, attr: str) -> _Stub:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Stub(f"{self.__name__}.{attr}")


class _KernelModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of ``roots`` (and their submodules) give :class:`_StubModule`s."""

    def __init__(self, roots: tuple[str, ...]):
        self.roots = set(roots)

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = "0"  # a version older than any, for libraries that probe it (transformers)
        return module

    def exec_module(self, module):
        pass


REPLACED_MODULES = ("sgl_kernel", "torchvision")
sys.meta_path.insert(0, _KernelModules(REPLACED_MODULES))

import torch  # noqa: E402

from awex.convert.sglang import sglang_param_dtypes, sglang_param_shapes, sglang_views  # noqa: E402
from awex.engines.sglang import sglang_runtime_parallel  # noqa: E402
from awex.meta.layouts.sglang import SglangParallel, sglang_engine_layout  # noqa: E402
from awex.meta.models import model_dims  # noqa: E402

_SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=1000)
MODELS: dict[str, dict[str, Any]] = {
    "qwen3": dict(
        _SMALL, model_type="qwen3", architectures=["Qwen3ForCausalLM"], intermediate_size=96, num_hidden_layers=3
    ),
    "qwen2-tied": dict(
        _SMALL,
        model_type="qwen2",
        architectures=["Qwen2ForCausalLM"],
        intermediate_size=96,
        num_hidden_layers=2,
        tie_word_embeddings=True,
    ),
    "llama": dict(
        _SMALL,
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        intermediate_size=96,
        num_hidden_layers=2,
        tie_word_embeddings=False,
    ),
    "qwen3-moe": dict(
        _SMALL,
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        tie_word_embeddings=False,
    ),
    "qwen2-moe": dict(
        _SMALL,
        model_type="qwen2_moe",
        architectures=["Qwen2MoeForCausalLM"],
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        tie_word_embeddings=False,
    ),
}


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    parallel: SglangParallel
    server_args: dict[str, Any] = field(default_factory=dict)


def _case(model: str, **p: Any) -> Case:
    parallel = SglangParallel(**p)
    args: dict[str, Any] = {"tp_size": parallel.tp, "pp_size": parallel.pp, "ep_size": parallel.ep}
    if parallel.attn_dp > 1:
        args.update(enable_dp_attention=True, dp_size=parallel.attn_dp, attn_dp_size=parallel.attn_dp)
    if parallel.moe_dp > 1:
        args["moe_dp_size"] = parallel.moe_dp
    if parallel.dp_lm_head:
        args["enable_dp_lm_head"] = True
    label = ",".join(f"{k}={v}" for k, v in p.items())
    return Case(f"{model}:{label}", model, parallel, args)


CASES = [
    _case("qwen3", tp=1),
    _case("qwen3", tp=2),
    _case("qwen3", tp=4),  # more ranks than KV heads: replicated
    _case("qwen3", tp=2, pp=2),  # 3 layers: the extra one on the last stage
    _case("qwen2-tied", tp=2),
    _case("qwen2-tied", tp=1, pp=2),  # tied: the last stage's lm_head holds the embedding
    _case("llama", tp=2),
    _case("qwen3-moe", tp=2),
    _case("qwen3-moe", tp=4, ep=2),
    _case("qwen3-moe", tp=4, ep=4),
    _case("qwen3-moe", tp=4, ep=4, attn_dp=2),
    _case("qwen3-moe", tp=4, ep=2, attn_dp=2, dp_lm_head=True),
    _case("qwen2-moe", tp=2, ep=2),
    _case("qwen3", tp=4, attn_dp=2),  # dense MLPs stay TP over the whole group under DP attention
    _case("qwen3", tp=4, attn_dp=2, dp_lm_head=True),
    _case("qwen2-moe", tp=4, ep=2, attn_dp=2, dp_lm_head=True),
]


def _groups() -> dict[str, Any]:
    """Stand-ins for SGLang's process groups, carrying each group's rank and size (nothing is communicated)."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    out = {}
    for g in ("tp", "pp", "attn_tp", "attn_cp", "moe_ep", "moe_dp", "moe_tp"):
        rank, size = getattr(parallel, f"{g}_rank"), getattr(parallel, f"{g}_size")
        out[f"{g}_group"] = types.SimpleNamespace(
            rank_in_group=rank,
            world_size=size,
            is_first_rank=rank == 0,
            is_last_rank=rank == size - 1,
            ranks=list(range(size)),
            cpu_group=None,
            device_group=None,
        )
    return out


def build(case: Case, rank: int, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """SGLang's model class for ``case`` as rank ``rank`` builds it, on ``device``."""
    from sglang.srt.layers.dp_attention import initialize_dp_attention_flags
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs
    from transformers import AutoConfig

    spec = dict(MODELS[case.model])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    config.torch_dtype = dtype
    reset_context()
    server_args = ServerArgs(model_path="dummy", **case.server_args)
    publish(server_args, role="test", ranks=SpawnRanks(world_rank=rank))
    get_parallel().override_permanently(**_groups())
    initialize_dp_attention_flags(server_args)  # as SGLang's worker does before building the model
    cls, _ = ModelRegistry.resolve_model_cls(config.architectures)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(config)
    finally:
        torch.set_default_dtype(previous)
    return model


def check(case: Case, dtype: str = "bfloat16", views: Callable[..., Any] = sglang_views) -> list[str]:
    """The mismatches of one case over all its ranks (empty: it passed); ``views``: the views under test."""
    tdtype = getattr(torch, dtype)
    hf_config = MODELS[case.model]
    dims = model_dims(hf_config, dtype)
    layout = sglang_engine_layout(hf_config, dtype, case.parallel, instance="sglang")
    g = torch.Generator().manual_seed(0)
    full = {
        t.spec.name: (torch.rand(t.spec.shape, generator=g) + 0.5).to(getattr(torch, t.spec.dtype))
        for t in layout.tensors
    }
    problems: list[str] = []
    for rank in range(case.parallel.world_size):
        where = f"{case.name} rank {rank}"
        meta = {n: (tuple(p.shape), p.dtype) for n, p in build(case, rank, "meta", tdtype).named_parameters()}
        seen = sglang_runtime_parallel()  # what the binding reads from SGLang's published state, as a worker would
        if seen != (case.parallel, rank):
            problems.append(f"{where}: the binding reads {seen} from SGLang's parallel state")
        shapes = sglang_param_shapes(dims, case.parallel, rank)
        dtypes = sglang_param_dtypes(shapes, dtype)
        want = {n: (s, dtypes[n]) for n, s in shapes.items()}
        if meta != want:
            for n in sorted(set(meta) | set(want)):
                if meta.get(n) != want.get(n):
                    problems.append(f"{where}: {n}: SGLang {meta.get(n)}, Awex {want.get(n)}")
            continue
        loaded = build(case, rank, "cpu", tdtype)
        received = build(case, rank, "cpu", tdtype)
        for model in (loaded, received):
            for p in model.parameters():
                p.data.zero_()
        loaded.load_weights(list(full.items()))
        view_of = views(dict(received.named_parameters()), dims, case.parallel, rank)
        for name, boxes in layout.rank_boxes(rank).items():
            for box in boxes:
                view = view_of(name, box)
                if tuple(view.shape) != tuple(box.sizes):
                    problems.append(f"{where}: {name} {box}: view of shape {tuple(view.shape)}")
                    continue
                view.copy_(full[name][box.slices()])
        before = len(problems)
        theirs = dict(loaded.named_parameters())
        for name, ours in received.named_parameters():
            if not torch.equal(ours, theirs[name]):
                bad = int((ours != theirs[name]).sum())
                problems.append(f"{where}: {name}: {bad} of {ours.numel()} elements differ from SGLang's loader")
        verdict = "equal" if len(problems) == before else f"{len(problems) - before} parameter(s) differ"
        print(
            f"{where}: {len(meta)} parameters, {len(layout.rank_boxes(rank))} canonical tensors: {verdict}", flush=True
        )
    return problems


SYNC_CASES = ["qwen3:tp=2", "qwen3-moe:tp=4,ep=4,attn_dp=2"]


def sync_check(case: Case, dtype: str = "bfloat16", versions: int = 2) -> list[str]:
    """Sync an HF trainer into every rank of ``case``'s SGLang engine through ``receive_weights``; the mismatches."""
    import threading

    from transformers import AutoConfig, AutoModelForCausalLM

    from awex.engines.sglang import AwexSglangInfo, SglangUpdateRequest, close_receivers, receive_weights
    from awex.engines.source import TrainerSource
    from awex.engines.writer import WeightsWriter
    from awex.meta import Box
    from awex.meta.client import MetaClient
    from awex.meta.server.embedded import start_embedded

    tdtype = getattr(torch, dtype)
    spec = dict(MODELS[case.model])
    torch.manual_seed(0)
    trainer = AutoModelForCausalLM.from_config(AutoConfig.for_model(spec.pop("model_type"), **spec)).to(tdtype)
    ranks = range(case.parallel.world_size)
    engines = {r: build(case, r, "cpu", tdtype) for r in ranks}
    for model in engines.values():
        for p in model.parameters():
            p.data.zero_()
    server = start_embedded()
    problems: list[str] = []
    try:
        info = AwexSglangInfo(server.address, instance="sglang", timeout=120.0)
        writer = WeightsWriter.from_source(
            MetaClient(server.address, timeout=120.0), TrainerSource.hf(trainer, dtype=dtype), timeout=120.0
        )
        for step in range(versions):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(torch.randn_like(p) * 0.01)
            version = f"step-{step}"
            named = SglangUpdateRequest(version, info).to_named_tensors()
            errors: dict[int, BaseException] = {}

            def engine_rank(rank: int) -> None:
                try:
                    receive_weights(engines[rank], named, runtime=lambda: (case.parallel, rank))
                except BaseException as e:  # reported below
                    errors[rank] = e

            threads = [threading.Thread(target=engine_rank, args=(r,)) for r in ranks]
            for t in threads:
                t.start()
            writer.write(version, ["sglang"])
            for t in threads:
                t.join(150)
            problems += [f"{case.name} {version} rank {r}: {type(e).__name__}: {e}" for r, e in errors.items()]
            # the trainer's canonical tensors (transformers may fuse experts in its own modules)
            source = TrainerSource.hf(trainer, dtype=dtype)
            state = [
                (t.spec.name, source.view_of(t.spec.name, Box.full(t.spec.shape)).detach().clone())
                for t in source.layout.tensors
            ]
            for rank, model in engines.items():
                reference = build(case, rank, "cpu", tdtype)
                for p in reference.parameters():
                    p.data.zero_()
                reference.load_weights(state)
                ref = dict(reference.named_parameters())
                bad = [n for n, t in model.named_parameters() if not torch.equal(t, ref[n])]
                if bad:
                    problems.append(f"{case.name} {version} rank {rank}: {len(bad)} parameters differ: {bad[:4]}")
                else:
                    print(f"sync {case.name} {version} rank {rank}: every parameter equals SGLang's load", flush=True)
        writer.close()
    finally:
        close_receivers()
        server.stop()
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", help="case name (repeatable; default: all)")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("--self-test", action="store_true", help="also check that views with K and V swapped are caught")
    ap.add_argument("--sync", action="store_true", help="also sync an HF trainer into SGLang's models (SYNC_CASES)")
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(c.name for c in CASES))
        return 0
    chosen = [c for c in CASES if not args.case or c.name in args.case]
    if args.case and len(chosen) != len(args.case):
        ap.error(f"unknown case(s): {sorted(set(args.case) - {c.name for c in chosen})}")
    import sglang

    print(f"sglang {sglang.__version__}, torch {torch.__version__}", flush=True)
    problems = []
    for case in chosen:
        problems += check(case)
    if args.sync:
        for name in SYNC_CASES:
            problems += sync_check(next(c for c in CASES if c.name == name))
    for p in problems:
        print("MISMATCH", p)
    print(f"{len(chosen)} case(s){' and syncs' if args.sync else ''}, {len(problems)} mismatch(es)")
    if args.self_test:
        caught = check(CASES[1], views=_k_v_swapped)
        print(f"self-test: views with K and V swapped: {len(caught)} mismatch(es) found (must be > 0)")
        if not caught:
            return 1
    return 1 if problems else 0


def _k_v_swapped(params, dims, parallel, rank):
    """Views that put K where V goes and V where K goes (the self-test's deliberate bug)."""
    right = sglang_views(params, dims, parallel, rank)

    def view_of(name, box):
        swapped = name.replace(".k_proj.", ".x_proj.").replace(".v_proj.", ".k_proj.").replace(".x_proj.", ".v_proj.")
        return right(swapped, box)

    return view_of


if __name__ == "__main__":
    sys.exit(main())
