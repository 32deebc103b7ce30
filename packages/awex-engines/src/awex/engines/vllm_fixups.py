"""Where vLLM's reload path needs a nudge. Every workaround for vLLM lives here, each with a test
(``integration/tests``) that fails when upstream behaviour changes.

Tied LM head (vLLM 0.32, layerwise reload): with ``tie_word_embeddings`` the LM head shares its weight with
``embed_tokens`` but is its own layer. A reload loads the embedding (new values land in the shared storage)
and leaves the head "not loaded", so the head keeps what its quant method derived from the old weight at
load time (on CPU: a prepacked GEMM copy) and the logits use stale weights: the limitation vLLM's docs give
as "tied params only reflect processing from one parent". After a reload we re-run the head's
``process_weights_after_loading`` when its weight shares storage with the embedding (a no-op for methods that
derive nothing, as on GPU).
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("awex.engines.vllm")


def refresh_tied_lm_head(model: torch.nn.Module) -> bool:
    """Rebuild the tied LM head's derived state after a reload; returns whether it was tied and refreshed."""
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    head_w = getattr(head, "weight", None)
    embed_w = getattr(embed, "weight", None)
    if not isinstance(head_w, torch.Tensor) or not isinstance(embed_w, torch.Tensor) or head is embed:
        return False
    if head_w.numel() == 0 or head_w.data_ptr() != embed_w.data_ptr():
        return False
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)
        log.debug("refreshed the tied LM head after a reload")
    return True
