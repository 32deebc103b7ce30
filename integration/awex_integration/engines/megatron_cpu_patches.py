"""The two patches Megatron-core 0.19 needs to run on a CPU-only machine (test harness only, never library code).

1. Megatron hard-codes ``torch.cuda.current_device()`` as a device (rotary embeddings, attention, TP layers):
   on a CPU build of torch that asserts. We point it at the CPU.
2. ``model_parallel_cuda_manual_seed`` needs CUDA RNG state; dropout-free forward passes still fork the
   "model-parallel-rng" tracker. We install a tracker whose fork is a no-op (fine with dropout 0).

``tests/test_megatron_cpu_patches.py`` fails when upstream stops needing them, so they get removed then.
"""

from __future__ import annotations

import contextlib

import torch

_applied = False


def apply() -> None:
    global _applied
    if _applied:
        return
    torch.cuda.current_device = lambda: torch.device("cpu")  # patch 1
    from megatron.core.tensor_parallel import random as mrand

    mrand.initialize_rng_tracker(force_reset=True)  # patch 2
    mrand.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    _applied = True
