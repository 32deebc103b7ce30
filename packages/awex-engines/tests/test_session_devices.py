"""CUDA IPC plans take each piece from the same GPU where a rank there holds it: the ranks publish their
physical devices through the MetaServer and plan with them (planning needs no GPU, so this runs on CPU)."""

import json
import threading
from pathlib import Path

import pytest

from awex.engines.sync import keys, places
from awex.engines.sync.keys import version_records
from awex.engines.sync.manifest import SyncManifest
from awex.engines.sync.options import SyncOptions
from awex.engines.sync.session import SyncSession
from awex.meta import canonical_tensors
from awex.meta.client import MetaClient
from awex.meta.layouts import MegatronParallel, VllmParallel, megatron_layout, vllm_layout
from awex.meta.server import start_embedded
from awex.meta.transport_choice import TransportError
from awex.transport.net import free_port

TINY = json.loads((Path(__file__).resolve().parents[3] / "integration" / "models" / "qwen2-tiny.json").read_text())


COLOCATED = {("trainer", 0): "h/GPU-0", ("trainer", 1): "h/GPU-1", ("vllm-0", 0): "h/GPU-1", ("vllm-1", 0): "h/GPU-0"}


def _plans(transport: str, gpus: dict = COLOCATED, reach: dict | None = None, fails: bool = False) -> dict:
    # Megatron TP=1 x DP=2 on GPUs 0 and 1; engine vllm-0 on GPU 1, vllm-1 on GPU 0 (each colocated with a replica)
    tensors = canonical_tensors(TINY)
    layouts = [
        megatron_layout(tensors, MegatronParallel(tp=1, dp=2), instance="trainer"),
        vllm_layout(tensors, VllmParallel(tp=1), instance="vllm-0"),
        vllm_layout(tensors, VllmParallel(tp=1), instance="vllm-1"),
    ]
    gathered = {}  # every rank's device record, as the ranks' device exchange read them
    gather = places._gather

    def reading(*args, **kwargs):
        records = gather(*args, **kwargs)
        gathered.update(records)
        return records

    places._gather = reading
    server = start_embedded()
    try:
        client = MetaClient(server.address, job="devices", timeout=20)
        for layout in layouts:
            client.publish_layout(layout, "current")
        options = SyncOptions(transport=transport)
        manifest = SyncManifest("v1", ("trainer",), ("vllm-0", "vllm-1"), "127.0.0.1", free_port(), options)
        plans, errors, transports, sessions = {}, [], {}, []

        def rank(instance: str, local_rank: int) -> None:
            try:
                session = SyncSession(
                    MetaClient(server.address, job="devices", timeout=20),
                    instance,
                    local_rank,
                    device_key=gpus[(instance, local_rank)],
                    device_reach=None if reach is None else reach[(instance, local_rank)],
                )
                sessions.append(session)  # alive until every rank has joined: a dropped group closes its sockets
                plans[(instance, local_rank)] = session.prepare(manifest, timeout=20)[0]
                transports[(instance, local_rank)] = session.transport
            except Exception as e:  # asserted below
                errors.append(e)

        threads = [threading.Thread(target=rank, args=key) for key in gpus]
        [t.start() for t in threads]
        [t.join(60) for t in threads]
        [s.close() for s in sessions]
        if fails:
            return {"errors": errors}
        assert not errors, errors
        published = list(gathered.values())
        client.forget(*version_records("v1"))
        # a version's device records go with the version: a gather of that name starts anew
        assert client.gather(keys.devices_gather("v1/0"), "probe", 1, 0, timeout=1) == {"probe": 0}
    finally:
        places._gather = gather
        server.stop()
    plan = plans[("trainer", 0)]
    assert len({p.digest for p in plans.values()}) == 1  # every rank planned the same
    gpu_of = {r.rank: gpus[(r.instance, r.local_rank)] for r in plan.ranks}
    assert len(set(transports.values())) == 1  # every rank chose the same transport
    return {
        "plan": plan,
        "gpu_of": gpu_of,
        "device_keys": sorted(gathered),
        "published": published,
        "transport": transports[("trainer", 0)],
    }


def test_ipc_plans_read_from_the_replica_on_the_receivers_own_gpu():
    got = _plans("ipc")
    plan, gpu_of = got["plan"], got["gpu_of"]
    assert plan.buckets and all(gpu_of[b.src] == gpu_of[b.dst] for b in plan.buckets)
    assert len(got["device_keys"]) == 4


def test_p2p_plans_publish_where_signals_go_but_no_devices():
    got = _plans("p2p")
    assert len(got["device_keys"]) == 4 and all(doc["device"] == "" for doc in got["published"])
    assert any(got["gpu_of"][b.src] != got["gpu_of"][b.dst] for b in got["plan"].buckets)


def test_auto_chooses_ipc_for_engines_sharing_gpus_and_plans_locally():
    got = _plans("auto")
    assert got["transport"] == "ipc"
    assert all(got["gpu_of"][b.src] == got["gpu_of"][b.dst] for b in got["plan"].buckets)


def test_auto_falls_back_to_p2p_with_relays_when_a_rank_cannot_share_memory():
    # vllm-1 on another host: point to point for everyone, planned as an explicit p2p sync is
    gpus = {**COLOCATED, ("vllm-1", 0): "other/GPU-0"}
    got = _plans("auto", gpus)
    assert got["transport"] == "p2p"
    assert got["plan"].digest == _plans("p2p", gpus)["plan"].digest


SEPARATE = {("trainer", 0): "h/GPU-0", ("trainer", 1): "h/GPU-1", ("vllm-0", 0): "h/GPU-2", ("vllm-1", 0): "h/GPU-3"}


def test_auto_uses_p2p_when_receivers_cannot_reach_the_trainers_gpus():
    # every process sees only its own GPU (CUDA_VISIBLE_DEVICES): CUDA IPC between GPUs cannot open the handles
    own_only = {key: (d,) for key, d in SEPARATE.items()}
    assert _plans("auto", SEPARATE, own_only)["transport"] == "p2p"
    everything = {key: tuple(SEPARATE.values()) for key in SEPARATE}
    assert _plans("auto", SEPARATE, everything)["transport"] == "ipc"


def test_explicit_ipc_that_cannot_reach_a_gpu_is_refused_on_every_rank_before_any_byte_moves():
    got = _plans("ipc", SEPARATE, {key: (d,) for key, d in SEPARATE.items()}, fails=True)
    assert len(got["errors"]) == 4 and all(isinstance(e, TransportError) for e in got["errors"])
    assert "vllm-0:0 cannot read trainer:" in str(got["errors"][0]) + str(got["errors"][1])


def test_auto_chooses_shared_memory_for_cpu_ranks_on_one_host():
    cpu = {key: None for key in COLOCATED}  # no GPU: CPU ranks copying into their own views
    got = _plans("auto", cpu)
    assert got["transport"] == "shm"
    assert all(doc["cpu"] and doc["in_place"] and doc["device"] == "" for doc in got["published"])
    trainers = {r.rank for r in got["plan"].ranks if r.instance == "trainer"}
    assert all(b.src in trainers for b in got["plan"].buckets)  # no relays: receivers read the senders' segments


def test_npu_ranks_publish_no_cuda_device_so_auto_chooses_point_to_point():
    """An Ascend NPU rank (torch-npu's ``npu`` device) publishes no CUDA device and is not a CPU rank: ``auto``
    then plans point to point (HCCL), never CUDA IPC or shared memory."""
    from types import SimpleNamespace

    from awex.engines.sync.places import describe, physical_device, reachable_devices
    from awex.meta import PlanOptions, plan_transfers
    from awex.meta.transport_choice import choose_transport
    from awex.transport.accelerator import p2p_backend

    npu = SimpleNamespace(type="npu", index=0)  # torch.device("npu") needs torch-npu; the places read .type only
    mine = physical_device(npu)
    assert mine is None and reachable_devices(npu, mine) == ()
    record = describe(npu, mine or "", (), True, ())
    assert record.device == "" and record.cpu is False
    tiny = canonical_tensors(TINY)
    sources = [megatron_layout(tiny, MegatronParallel(), instance="trainer")]
    dests = [vllm_layout(tiny, VllmParallel(), instance="vllm-0")]
    devices = (("trainer", 0, record.device), ("vllm-0", 0, record.device))
    ipc = plan_transfers(sources, dests, PlanOptions(relay=False))
    p2p = plan_transfers(sources, dests, PlanOptions(relay=True))
    choice = choose_transport(ipc, p2p, devices, shm_ok=False)
    assert choice.transport == "p2p", choice
    assert p2p_backend("npu:0") == "hccl"


@pytest.mark.parametrize(
    "doc",
    [
        {"device": 7, "reach": "x", "host": None, "pid": True, "cpu": 1, "shm": "yes", "in_place": 1, "signals": [1]},
        ["GPU-0"],
        None,
    ],
)
def test_a_device_record_of_the_wrong_types_claims_nothing(doc):
    """Another rank's device record is untrusted: a field of the wrong type claims nothing (no device, no shared
    memory, no in-place copy, no signals but the MetaServer's), and a whole record round-trips."""
    from awex.engines.sync.places import DeviceRecord

    assert DeviceRecord.from_wire(doc) == DeviceRecord()
    full = DeviceRecord("h/GPU-1", ("h/GPU-1", "h/GPU-2"), "h", 12, 34, False, True, True, ("board", "channel"))
    assert DeviceRecord.from_wire(json.loads(json.dumps(full.to_wire()))) == full
