"""The library path on Ascend NPUs: WeightsWriter / WeightsReader through the MetaServer, point to point over HCCL
(torch-npu's ``ProcessGroupHCCL``, double-buffered waves on NPU streams), several versions, every received tensor
checked bit for bit; ``auto`` must choose point to point (there is no CUDA IPC on NPUs).

Never run so far: it needs torch-npu with Ascend's CANN toolkit and at least two NPUs; none of our machines has an
NPU. The same cases run on CUDA GPUs over NCCL (``test_gpu_sync.py``), through the same device-generic executor.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch_npu", reason="needs torch-npu with Ascend's CANN toolkit (no NPU machine here)")
if not torch.npu.is_available():
    pytest.skip("needs Ascend NPUs (torch-npu is installed, no NPU is visible)", allow_module_level=True)

from awex_integration.benchmarks.gpu_sync_workers import run_sync_case  # noqa: E402


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(("p2p", 1, [0], [(1, [1])]), id="hccl-1-to-1"),
        pytest.param(("p2p", 2, [0, 1], [(2, [2, 3])]), id="hccl-tp2-to-tp2"),
        pytest.param(("p2p", 1, [0], [(1, [1]), (1, [2]), (1, [3])]), id="hccl-1-to-3-relay"),
        pytest.param(("auto", 1, [0], [(1, [1])]), id="auto-1-to-1-picks-hccl"),
        pytest.param(("p2p", 2, [0, 1], [(2, [2, 3])], False, "qwen3-30b-a3b"), id="moe-hccl-tp2-to-tp2"),
    ],
)
def test_writer_and_readers_on_npus(case):
    transport, train_tp, train_devices, engines, *_ = case
    need = 1 + max([*train_devices, *[d for _, ds in engines for d in ds]])
    if torch.npu.device_count() < need:
        pytest.skip(f"needs {need} NPUs, this machine has {torch.npu.device_count()}")
    out = run_sync_case(case, device_type="npu")
    failures = {k: v for k, (s, v) in out.items() if s != "ok"}
    assert not failures, failures
    assert all(v["transport"] == "p2p" for k, (_, v) in out.items() if k[0] == "trainer"), out
    for key, (_, value) in out.items():
        if key[0] != "trainer":
            assert value["checked"] > 0 and value["bad"] == [], (key, value)
