"""transport="auto": CUDA IPC on one host unless fan-out makes a GPU move more than the relayed NCCL plan, NCCL
(point to point) across hosts or where a rank has no CUDA device; engines sharing a GPU always use CUDA IPC."""

from __future__ import annotations

from pathlib import Path

import pytest

from awex.meta import PlanOptions, canonical_tensors, load_config, plan_transfers
from awex.meta.layouts import MegatronParallel, VllmParallel, megatron_layout, vllm_layout
from awex.meta.transport_choice import (
    IPC_RATE_MARGIN,
    SHARED_SOURCE_FACTOR,
    TransportError,
    choose_transport,
    link_bytes_per_gpu,
    unreachable,
)

MODELS = Path(__file__).resolve().parents[3] / "integration" / "models"
TINY = canonical_tensors(load_config(MODELS / "qwen2-tiny.json"))


def _plans(trainer_tp: int, engines: list[int], gpus: dict[tuple[str, int], str]):
    """The plan without relays (with the devices) and the relayed one, and the devices as the sessions give them."""
    sources = [megatron_layout(TINY, MegatronParallel(tp=trainer_tp), instance="trainer")]
    dests = [vllm_layout(TINY, VllmParallel(tp=tp), instance=f"vllm-{i}") for i, tp in enumerate(engines)]
    devices = tuple((i, r, d) for (i, r), d in gpus.items())
    ipc = plan_transfers(sources, dests, PlanOptions(relay=False, devices=devices))
    p2p = plan_transfers(sources, dests, PlanOptions(relay=True))
    return ipc, p2p, devices


def _choose(trainer_tp: int, engines: list[int], gpus: dict[tuple[str, int], str]):
    ipc, p2p, devices = _plans(trainer_tp, engines, gpus)
    return choose_transport(ipc, p2p, devices), ipc, p2p


def _gpus(trainer: list[int], engines: list[list[int]], host=lambda g: "h") -> dict[tuple[str, int], str]:
    out = {("trainer", r): f"{host(g)}/GPU-{g}" for r, g in enumerate(trainer)}
    for i, gs in enumerate(engines):
        out.update({(f"vllm-{i}", r): f"{host(g)}/GPU-{g}" for r, g in enumerate(gs)})
    return out


@pytest.mark.parametrize(
    "trainer, engines",
    [
        ([0], [[1]]),  # 1 -> 1 on other GPUs of the host
        ([0, 1], [[2, 3]]),  # TP=2 -> TP=2
    ],
)
def test_one_host_without_egress_fan_out_uses_ipc(trainer, engines):
    choice, ipc, p2p = _choose(len(trainer), [len(e) for e in engines], _gpus(trainer, engines))
    assert choice.transport == "ipc", choice
    assert choice.busiest_ipc <= choice.busiest_p2p * 1.05


def test_a_gpu_that_several_gpus_pull_from_at_once_counts_its_egress_at_the_shared_rate():
    # TP=2 -> two TP=1 on other GPUs: each trainer GPU sends its half twice, each receiver gets it all; by bytes
    # the plans tie, but each trainer GPU is pulled from by two GPUs at once (measured 1.59x over CUDA IPC
    # against 1.26x over NCCL with relays on 4x H200)
    gpus = _gpus([0, 1], [[2], [3]])
    choice, ipc, p2p = _choose(2, [1, 1], gpus)
    assert choice.transport == "p2p", choice
    device_of = {r.rank: gpus[(r.instance, r.local_rank)] for r in ipc.ranks}
    raw = max(max(s, r) for s, r in link_bytes_per_gpu(ipc, device_of).values())
    assert raw <= choice.busiest_p2p * IPC_RATE_MARGIN < choice.busiest_ipc
    assert choice.busiest_ipc == int(link_bytes_per_gpu(ipc, device_of)["h/GPU-0"][0] * SHARED_SOURCE_FACTOR)


def test_fan_out_from_one_gpu_uses_relayed_p2p():
    gpus = _gpus([0], [[1], [2], [3]])
    choice, ipc, p2p = _choose(1, [1, 1, 1], gpus)
    assert choice.transport == "p2p", choice
    # over IPC the trainer's GPU would send the model three times; with relays once
    device_of = {r.rank: gpus[(r.instance, r.local_rank)] for r in ipc.ranks}
    assert link_bytes_per_gpu(ipc, device_of)["h/GPU-0"][0] == 3 * choice.busiest_p2p


def test_engines_sharing_gpus_use_ipc():
    choice, _, _ = _choose(2, [1, 1], _gpus([0, 1], [[0], [1]]))
    assert choice.transport == "ipc" and "share" in choice.reason


def test_several_hosts_use_p2p():
    choice, _, _ = _choose(1, [1], _gpus([0], [[1]], host=lambda g: f"node{g}"))
    assert choice.transport == "p2p" and "hosts" in choice.reason


def test_a_rank_without_a_cuda_device_means_p2p():
    gpus = _gpus([0], [[1]])
    gpus[("vllm-0", 0)] = ""  # a CPU engine, or one that receives into per-sync buffers
    choice, _, _ = _choose(1, [1], gpus)
    assert choice.transport == "p2p" and "vllm-0:0" in choice.reason
    del gpus[("vllm-0", 0)]  # or one that published nothing
    assert _choose(1, [1], gpus)[0].transport == "p2p"


def test_senders_quantising_wave_by_wave_use_p2p_unless_engines_share_gpus():
    for gpus, expected in (([0], [[1]]), "p2p"), (([0], [[0]]), "ipc"):
        ipc, p2p, devices = _plans(1, [1], _gpus(*gpus))
        assert choose_transport(ipc, p2p, devices, refresh_by_wave=True).transport == expected
        assert choose_transport(ipc, p2p, devices).transport == "ipc"


def test_receivers_that_cannot_see_the_source_gpu_get_p2p():
    # one GPU visible per process (Ray's CUDA_VISIBLE_DEVICES): CUDA IPC across GPUs cannot open the handles
    gpus = _gpus([0], [[1]])
    ipc, p2p, devices = _plans(1, [1], gpus)
    own_only = {key: [d] for key, d in gpus.items()}
    assert unreachable(ipc, devices, own_only) == ["vllm-0:0 cannot read trainer:0 on h/GPU-0"]
    choice = choose_transport(ipc, p2p, devices, reach=own_only)
    assert choice.transport == "p2p" and "cannot read" in choice.reason
    everything = {key: ["h/GPU-0", "h/GPU-1"] for key in gpus}
    assert unreachable(ipc, devices, everything) == []
    assert choose_transport(ipc, p2p, devices, reach=everything).transport == "ipc"


def test_engines_sharing_gpus_that_cannot_reach_the_other_half_are_refused_before_any_byte_moves():
    # colocated TP=2 trainer, one TP=1 engine per GPU, each process seeing only its own GPU: the engine on GPU 0
    # needs the half of the model on GPU 1; NCCL cannot run two ranks on one GPU either
    gpus = _gpus([0, 1], [[0], [1]])
    ipc, p2p, devices = _plans(2, [1, 1], gpus)
    with pytest.raises(TransportError, match="CUDA_VISIBLE_DEVICES"):
        choose_transport(ipc, p2p, devices, reach={key: [d] for key, d in gpus.items()})


def test_cpu_ranks_on_one_host_copying_in_place_use_shared_memory():
    ipc, p2p, _ = _plans(2, [2, 1], {})
    assert choose_transport(ipc, p2p, (), shm_ok=True).transport == "shm"
    assert choose_transport(ipc, p2p, (), shm_ok=False).transport == "p2p"  # several hosts, or receive buffers
    assert choose_transport(ipc, p2p, (), refresh_by_wave=True, shm_ok=True).transport == "p2p"
    some_gpu = {("trainer", 0): "h/GPU-0"}  # a CUDA rank among CPU ranks: not a shared-memory sync
    ipc, p2p, devices = _plans(2, [2, 1], some_gpu)
    assert choose_transport(ipc, p2p, devices, shm_ok=True).transport == "p2p"


def test_quantising_on_receive_from_another_gpu_is_named_before_any_byte_moves():
    """quantize_on_receive reads the bf16 source on the receiver's own GPU: a plan whose quantised weights come
    from another GPU names each such read; colocated, or where a device is unknown, none."""
    from awex.meta import Fp8BlockQuant, quantize_layout
    from awex.meta.transport_choice import quantized_afar

    sources = [megatron_layout(TINY, MegatronParallel(tp=1), instance="trainer")]
    dests = [quantize_layout(vllm_layout(TINY, VllmParallel(tp=1), instance="vllm-0"), Fp8BlockQuant(block=(16, 16)))]
    for gpus, afar in (
        ({"trainer": "h/GPU-0", "vllm-0": "h/GPU-1"}, True),
        ({"trainer": "h/GPU-0", "vllm-0": "h/GPU-0"}, False),
    ):
        devices = tuple((i, 0, d) for i, d in gpus.items())
        plan = plan_transfers(sources, dests, PlanOptions(relay=False, devices=devices, quantize_on_receive=True))
        assert plan.quantized
        found = quantized_afar(plan, devices)
        assert bool(found) == afar, found
        if afar:
            assert len(found) == len(plan.quantized)
            assert found[0].startswith("vllm-0:0 would quantise model.") and found[0].endswith("trainer:0 on h/GPU-0")
        assert quantized_afar(plan, devices[:1]) == []  # a receiver's device unknown: nothing to say
