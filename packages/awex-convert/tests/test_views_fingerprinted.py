"""Every converter's ``view_of`` carries a fingerprint of the tensors its views come from, and names them
(``sources()``): without one a writer or reader derives every view again before every version (SGLang's views had
none until 2026-12-01, FSDP2's too: the FSDP2 case is in awex-engines' test_fsdp_views). The fingerprint changes when
a tensor moves and only then; ``sources()`` are the tensors ``forms()`` describes, in its order."""

from __future__ import annotations

import pytest
import torch

from awex.convert import MegatronNames, megatron_param_shapes, megatron_views, vllm_param_shapes, vllm_views
from awex.convert.hf import hf_views
from awex.convert.sglang import sglang_param_shapes, sglang_views
from awex.meta.layouts import MegatronParallel, SglangParallel, VllmParallel
from awex.meta.models import model_dims

CONFIG = dict(
    architectures=["Qwen3ForCausalLM"], hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    vocab_size=1000, intermediate_size=96, num_hidden_layers=2,
)  # fmt: skip
DIMS = model_dims(CONFIG, "float32")


class _Named:
    """Named parameters as a trainer's module names them, without the module tree (``LiveTensors`` reads such an
    object's tensors once; a parameter whose ``.data`` is replaced is seen moved)."""

    def __init__(self, params: dict[str, torch.Tensor]):
        self.params = {n: torch.nn.Parameter(t, requires_grad=False) for n, t in params.items()}

    def named_parameters(self):
        return iter(self.params.items())

    def named_buffers(self):
        return iter(())


def _megatron():
    where = MegatronNames(0, 0, MegatronParallel(tp=2))
    model = _Named({n: torch.zeros(s) for n, s in megatron_param_shapes(DIMS, where)[0].items()})
    return megatron_views(model, DIMS, where), model


def _hf():
    from awex.meta import canonical_tensors

    model = _Named({t.name: torch.zeros(t.spec.shape) for t in canonical_tensors(CONFIG, dtype="float32")})
    return hf_views(model), model


def _vllm():
    parallel = VllmParallel(tp=2)
    params = {n: torch.nn.Parameter(torch.zeros(s), requires_grad=False)
              for n, s in vllm_param_shapes(DIMS, parallel, 1).items()}  # fmt: skip
    return vllm_views(params, DIMS, parallel, tp_rank=1), params


def _sglang():
    parallel = SglangParallel(tp=2)
    params = {n: torch.nn.Parameter(torch.zeros(s), requires_grad=False)
              for n, s in sglang_param_shapes(DIMS, parallel, 1).items()}  # fmt: skip
    return sglang_views(params, DIMS, parallel, 1), params


def _parameters(held) -> list[torch.nn.Parameter]:
    return list(held.params.values()) if isinstance(held, _Named) else list(held.values())


@pytest.mark.parametrize("make", [_megatron, _hf, _vllm, _sglang], ids=["megatron", "hf", "vllm", "sglang"])
def test_every_converters_views_carry_a_fingerprint_and_name_their_sources(make):
    view_of, held = make()
    for part in ("fingerprint", "addresses", "forms", "sources"):
        assert callable(getattr(view_of, part, None)), f"view_of has no {part}()"
    before = view_of.fingerprint()
    assert view_of.fingerprint() == before  # nothing moved: the same
    sources = view_of.sources()
    assert len(sources) == len(view_of.forms())
    assert [(t.shape, t.stride(), t.dtype) for t in sources] == list(view_of.forms())
    p = _parameters(held)[-1]
    p.data = p.data.clone()  # one tensor moved
    assert view_of.fingerprint() != before
    assert any(t.data_ptr() == p.data.data_ptr() for t in view_of.sources())
