"""The library path on GPUs: WeightsWriter / WeightsReader through the MetaServer, NCCL across GPUs and CUDA IPC
for colocated engines, several versions, every received tensor checked. Skipped where there is no GPU (CI);
run on a GPU machine with ``pytest integration/tests/test_gpu_sync.py``."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA GPUs (the CPU CI cannot run the NCCL and CUDA IPC paths)", allow_module_level=True)

from awex_integration.benchmarks.gpu_sync_workers import run_sync_case  # noqa: E402


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(("ipc", 1, [0], [(1, [0])]), id="colocated-1gpu-ipc"),
        pytest.param(("ipc", 2, [0, 1], [(1, [0]), (1, [1])]), id="colocated-tp2-to-tp1-per-gpu-ipc"),
        pytest.param(("p2p", 1, [0], [(1, [1])]), id="nccl-1-to-1"),
        pytest.param(("p2p", 2, [0, 1], [(2, [2, 3])]), id="nccl-tp2-to-tp2"),
        pytest.param(("p2p", 1, [0], [(1, [1]), (1, [2]), (1, [3])]), id="nccl-1-to-3-relay"),
        # the default: one host, no fan-out -> CUDA IPC between GPUs; fan-out from one GPU -> relayed NCCL
        pytest.param(("auto", 1, [0], [(1, [1])]), id="auto-1-to-1-picks-ipc"),
        pytest.param(("auto", 1, [0], [(1, [1]), (1, [2]), (1, [3])]), id="auto-1-to-3-picks-nccl"),
        # FP8 receivers: the trainer quantises its bf16 weights, FP8 tiles + scales travel and land in place
        pytest.param(("ipc", 1, [0], [(1, [0])], True, "qwen3-8b"), id="fp8-colocated-1gpu-ipc"),
        # FP8 on the copy: the trainer publishes bf16, the receiver quantises from its memory into tiles + scales
        pytest.param(("ipc", 1, [0], [(1, [0])], True, "qwen3-8b", True), id="fp8-on-receive-colocated-1gpu-ipc"),
        # (each engine rank on the GPU of the trainer rank holding its halves: a receiver quantises only what lies on
        # its own GPU, so TP=2 -> a TP=1 engine per GPU is refused before any byte moves)
        pytest.param(("ipc", 2, [0, 1], [(2, [0, 1])], True, "qwen3-8b", True), id="fp8-on-receive-tp2-to-tp2-ipc"),
        pytest.param(("p2p", 1, [0], [(1, [1])], True, "qwen3-8b"), id="fp8-nccl-1-to-1"),
        # quantize_on_receive="auto": on receive where the engine shares the trainer's GPU, by the trainer elsewhere
        pytest.param(("ipc", 1, [0], [(1, [0])], True, "qwen3-8b", "auto"), id="fp8-auto-colocated-1gpu-ipc"),
        pytest.param(("ipc", 1, [0], [(1, [1])], True, "qwen3-8b", "auto"), id="fp8-auto-ipc-1-to-1"),
        pytest.param(("auto", 1, [0], [(1, [1])], True, "qwen3-8b", "auto"), id="fp8-auto-auto-1-to-1-picks-nccl"),
        pytest.param(("ipc", 2, [0, 1], [(1, [0]), (1, [1])], True, "qwen3-30b-a3b"), id="fp8-moe-colocated-tp2-ipc"),
        pytest.param(("p2p", 2, [0, 1], [(2, [2, 3])], True, "qwen3-30b-a3b"), id="fp8-moe-nccl-tp2-to-tp2"),
        pytest.param(("p2p", 2, [0, 1], [(2, [2, 3])], False, "qwen3-30b-a3b"), id="moe-nccl-tp2-to-tp2"),
        # delta syncs: each version changes 1% of the values; the engine changes one tensor behind the writer's back
        pytest.param(("p2p", 1, [0], [(1, [1])], False, "qwen3-8b", False, True), id="delta-nccl-1-to-1"),
        pytest.param(("ipc", 1, [0], [(1, [0])], False, "qwen3-8b", False, True), id="delta-colocated-1gpu-ipc"),
        pytest.param(("ipc", 2, [0, 1], [(1, [0]), (1, [1])], False, "qwen3-8b", False, True), id="delta-tp2-ipc"),
        pytest.param(("ipc", 1, [0], [(1, [1])], False, "qwen3-8b", False, True), id="delta-ipc-1-to-1"),
        # the trainer offloads its weights to the host and loads them back before every version: re-bound each time
        pytest.param(("ipc", 1, [0], [(1, [0])], False, "qwen3-8b", False, False, True), id="moved-colocated-1gpu-ipc"),
        pytest.param(("p2p", 1, [0], [(1, [1])], False, "qwen3-8b", False, False, True), id="moved-nccl-1-to-1"),
        pytest.param(("ipc", 1, [0], [(1, [0])], False, "qwen3-8b", False, True, True), id="moved-delta-1gpu-ipc"),
    ],
)
def test_writer_and_readers_on_gpus(case):
    transport, train_tp, train_gpus, engines, *_ = case
    need = 1 + max([*train_gpus, *[g for _, gs in engines for g in gs]])
    if torch.cuda.device_count() < need:
        pytest.skip(f"needs {need} GPUs, this machine has {torch.cuda.device_count()}")
    out = run_sync_case(case)
    failures = {k: v for k, (s, v) in out.items() if s != "ok"}
    assert not failures, failures
    fp8_auto = len(case) > 6 and case[6] == "auto"
    if fp8_auto:  # the receivers quantise only where each reads on its own GPU
        apart = any(set(gs) - set(train_gpus) for _, gs in engines)
        assert all(v["quantizing"] == apart for k, (_, v) in out.items() if k[0] == "trainer"), out
    if transport == "auto":
        picked = "p2p" if (len(engines) > 1 and train_tp == 1) or fp8_auto else "ipc"
        assert all(v["transport"] == picked for k, (_, v) in out.items() if k[0] == "trainer"), out
    for key, (_, value) in out.items():
        if key[0] != "trainer":
            assert value["checked"] > 0 and value["bad"] == [], (key, value)
    moved_memory = len(case) > 8 and case[8]
    if moved_memory and transport == "ipc" and not (len(case) > 7 and case[7]):  # plain copies over CUDA IPC
        for key, (_, value) in out.items():  # every moved version's copies re-pointed, not paired anew
            if key[0] != "trainer":
                assert all("rebase" in s["phases"] for s in value["stats"][1:]), (key, value["stats"])
    if len(case) > 7 and case[7] and moved_memory:  # delta after the trainer's memory moved: whole again, exact
        for key, (_, value) in out.items():
            sizes = [s.get("bytes_sent", s.get("bytes_received")) for s in value["stats"]]
            assert all(m >= value["stats"][0]["bytes_dense"] for m in sizes), (key, value)
    elif len(case) > 7 and case[7]:  # delta: whole first, then about 1% of the words, the stale buckets whole again
        for key, (_, value) in out.items():
            first, *later = value["stats"]
            assert first["bytes_dense"] and all(s["bytes_dense"] == first["bytes_dense"] for s in later), (key, value)
            moved = [s.get("bytes_sent", s.get("bytes_received")) for s in value["stats"]]
            assert moved[0] >= first["bytes_dense"], (key, value)
            assert all(m < first["bytes_dense"] / 5 for m in moved[1:2] + moved[3:]), (key, value)
            if key[0] != "trainer":
                resent = [s["buckets_resent"] for s in value["stats"]]
                assert resent[1] == 0 and resent[3] == 0, (key, value)
                assert (resent[2] >= 1) == (key[1] == 0), (key, value)  # rank 0 changed a tensor before v3


@pytest.mark.parametrize("let_go", [True, False], ids=["let-go", "held"])
def test_a_trainer_that_offloads_after_each_version_gets_its_gpu_memory_back_where_the_writer_holds_none(let_go):
    """Colocated over CUDA IPC (Qwen3-8B shape, 2 layers, 3.2 GB), the trainer offloads its weights to the host after
    each version and loads them back before the next. With ``hold_trainer_memory=False`` the engine closes its mapping
    of the trainer's export before it reports and the writer drops its views and export, so each offload gives the
    GPU its memory back (at least 95% of the weights' bytes); held (the default) the mapping and views keep it
    (under 5%). Every version arrives exact either way."""
    out = run_sync_case(("ipc", 1, [0], [(1, [0])], False, "qwen3-8b", False, False, "trainer", 2, 4, let_go))
    failures = {k: v for k, (s, v) in out.items() if s != "ok"}
    assert not failures, failures
    engine, trainer = out[("vllm-0", 0)][1], out[("trainer", 0)][1]
    assert engine["checked"] > 0 and engine["bad"] == [], engine
    freed, nbytes = trainer["freed"], trainer["model_bytes"]
    assert len(freed) == 3, freed
    if let_go:
        assert all(f >= 0.95 * nbytes for f in freed), (freed, nbytes)
    else:
        assert all(f < 0.05 * nbytes for f in freed), (freed, nbytes)


@pytest.mark.parametrize("name", ["receiver_rank_dies_after_transfer", "receiver_raises_in_apply", "two_hundred_syncs"])
def test_fault_cases_over_cuda_ipc(name):
    """Fault-suite cases with every rank's weights on GPU 0 (colocated, CUDA IPC): a receiver process that dies
    after its copy fails the trainer's write within its deadline, the instance reports no consistent version, the
    restarted rank and the retry succeed; 200 versions keep CUDA memory, host memory, threads and descriptors flat."""
    from awex_integration.faults.fault_cases import cases
    from awex_integration.faults.fault_suite import run_case

    case = next(c for c in cases() if c.name == name)
    result = run_case(case, timeout=20.0, device="cuda", transport="auto")
    assert result["passed"] and not result["hangs"] and not result["false_success"], result
    assert result["transports"] == ["ipc"], result["transports"]  # colocated on one GPU: CUDA IPC, as auto picks


@pytest.mark.parametrize(
    "name",
    [
        "nccl_receiver_dies_after_agreement",
        "nccl_trainer_dies_after_agreement",
        "nccl_watchdog_follows_deadline",
        "nccl_corrupted_in_flight_verified",
        "nccl_two_hundred_syncs",
    ],
)
def test_fault_cases_over_nccl(name):
    """Fault-suite cases over NCCL, the trainer rank on GPU 0 and the engine rank on GPU 1: a peer that dies after
    joining the group fails the survivor's call within its deadline (the group aborted, the process alive: PyTorch's
    watchdog must not take it down), the restarted peer and the retry succeed; a sync whose deadline is longer than
    the first's (the watchdog's initial timeout) is not cut short; 200 versions keep every resource flat."""
    from awex_integration.faults.fault_cases import nccl_cases
    from awex_integration.faults.fault_suite import run_case

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    case = next(c for c in nccl_cases() if c.name == name)
    result = run_case(case, timeout=15.0, device="cuda-per-rank", transport="p2p")
    assert result["passed"] and not result["hangs"] and not result["false_success"], result
    assert result["transports"] == ["p2p"], result["transports"]
