"""Registers the ``awex`` weight-transfer backend with vLLM (the ``vllm.general_plugins`` entry point): the
worker engine (``awex.engines.vllm_backend``) and the trainer engine (``awex.engines.vllm_trainer``, which also
registers itself when imported: trainer processes load no vLLM plugins).

Registration is by module path, so vLLM imports those modules only when ``backend="awex"`` asks for them.
Nothing else of vLLM is changed.
"""

from __future__ import annotations

BACKEND = "awex"


def register() -> None:
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for factory, module, cls in (
        (WeightTransferEngineFactory, "awex.engines.vllm_backend", "AwexWeightTransferEngine"),
        (WeightTransferTrainerFactory, "awex.engines.vllm_trainer", "AwexTrainerEngine"),
    ):
        try:
            factory.register_engine(BACKEND, module, cls)
        except ValueError:
            pass  # already registered in this process
