"""awex.convert: Converters between each engine's native parameters (Megatron-core, vLLM, SGLang, HF) and the canonical HF form.

This distribution is a skeleton: it installs, imports and declares its dependencies; its modules arrive with
the end-to-end CPU sync work. It depends on awex-meta for the shared vocabulary (tensor specs, boxes, layouts,
plans).
"""

__version__ = "0.1.0"
