"""What a :class:`~awex.engines.writer.WeightsWriter` is asked to do, checked when it is made (before any byte
moves): the transport exists, and the options asked together are built together. Every rank checks a manifest it
reads by the same rules (:func:`combination_error`) before it plans."""

from __future__ import annotations

from typing import Any

from awex.transport.registry import TRANSPORTS


def check_options(
    transport: str,
    refresh: Any,
    refresh_by_wave: Any,
    keep_versions: int,
    delta: bool,
    delta_budget_bytes: int | None,
    quantize_on_receive: bool,
) -> None:
    """Raise ``ValueError`` saying what to pass instead for options that do not go together."""
    wrong = combination_error(transport, delta, quantize_on_receive)
    if wrong:
        raise ValueError(wrong)
    if refresh_by_wave is not None and refresh is None:
        raise ValueError(
            "refresh_by_wave needs refresh too: CUDA IPC receivers read whole buffers, refreshed "
            "all at once (pass refresh=fp8.quantize, refresh_by_wave=fp8.by_wave)"
        )
    if keep_versions < 1:
        raise ValueError("keep_versions must be at least 1")
    if delta and refresh_by_wave is not None:
        raise ValueError("delta=True with FP8 on the fly (refresh_by_wave) is not built yet")
    if delta_budget_bytes is not None and (not delta or delta_budget_bytes < 0):
        raise ValueError("delta_budget_bytes: a non-negative byte count, with delta=True")


def combination_error(transport: str, delta: bool, quantize_on_receive: bool) -> str | None:
    """What is wrong with a transport and the options that depend on it (writers and manifests alike), or None."""
    if transport not in (*TRANSPORTS, "auto"):
        return (
            f"unknown transport {transport!r}: use 'auto', 'p2p' (NCCL/gloo), 'ipc' (CUDA engines "
            "on one host), 'shm' (CPU engines on one host) or 'rdma' (Mooncake's transfer engine)"
        )
    if delta and transport not in ("p2p", "ipc"):
        return (
            f"delta=True runs over transport='p2p' (NCCL/gloo) or 'ipc' (CUDA IPC), not {transport!r}: "
            "pass one of them (rdma and shared-memory delta syncs are not built yet)"
        )
    if delta and quantize_on_receive:
        return "delta=True with quantize_on_receive=True is not built yet: pick one of the two"
    if quantize_on_receive and transport != "ipc":
        return (
            f"quantize_on_receive=True runs over transport='ipc' (receivers on the trainer's GPUs), not "
            f"{transport!r}; elsewhere quantise on the sender (awex.convert.Fp8Views)"
        )
    return None
