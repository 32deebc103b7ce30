"""The Megatron-on-CPU harness patches are still needed; this fails when upstream changes, so they get removed."""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed in this environment")

import torch  # noqa: E402


def test_patch_1_megatron_still_asks_cuda_for_its_device():
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine needs no CPU patches")
    from megatron.core.models.common.embeddings import rotary_pos_embedding

    assert "torch.cuda.current_device()" in inspect.getsource(rotary_pos_embedding), (
        "Megatron's rotary embedding no longer calls torch.cuda.current_device(): drop patch 1 in "
        "awex_integration/engines/megatron_cpu_patches.py"
    )


def test_patch_2_megatron_rng_seeding_still_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine needs no CPU patches")
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    with pytest.raises((AssertionError, RuntimeError)):
        model_parallel_cuda_manual_seed(123)
