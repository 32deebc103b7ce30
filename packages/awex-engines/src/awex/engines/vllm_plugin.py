"""Registers the ``awex`` weight-transfer backend with vLLM (the ``vllm.general_plugins`` entry point).

Registration is by module path, so vLLM imports ``awex.engines.vllm_backend`` only when a
``WeightTransferConfig(backend="awex")`` asks for it. Nothing else of vLLM is changed.
"""

from __future__ import annotations

BACKEND = "awex"


def register() -> None:
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, "awex.engines.vllm_backend", "AwexWeightTransferEngine")
    except ValueError:
        pass  # already registered in this process
