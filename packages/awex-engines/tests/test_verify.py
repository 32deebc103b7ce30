"""Verify mode through the public path (WeightsWriter(verify=True) / WeightsReader, gloo and shared memory, one
process, threads): a version counts only where every receiving rank's digest equals its senders'; bytes changed on
the way fail the version on both sides (without verify the same change passes: the check is what notices), and the
next version succeeds; relayed regions count as their origin's; bad options are refused before any byte moves."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from test_version_signals import CONFIG, views  # noqa: F401

from awex.engines.errors import SyncFailedError
from awex.engines.reader import WeightsReader
from awex.engines.sync.session import SyncSession
from awex.engines.sync.verify import VerifyError, expected, record, regions
from awex.engines.writer import WeightsWriter
from awex.meta import PlanOptions, canonical_tensors, plan_transfers
from awex.meta.client import MetaClient
from awex.meta.layouts import VllmParallel, hf_layout, vllm_layout
from awex.meta.server import start_embedded
from awex.meta.spec import Role

TENSORS = canonical_tensors(CONFIG, dtype="bfloat16")
WIDE = canonical_tensors(CONFIG, dtype="float32")


@pytest.fixture(scope="module")
def server():
    s = start_embedded()
    yield s
    s.stop()


def _weights(tensors, seed: int, dtype=torch.bfloat16, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return {t.name: torch.randn(t.spec.shape, generator=g).to(dtype).to(device) for t in tensors}


def _job(server, job, engines=("eng",), tp=2, transport="p2p", verify=True, trainer=TENSORS, device="cpu", **options):
    sent = _weights(trainer, 0, torch.float32 if trainer is WIDE else torch.bfloat16, device)
    writer = WeightsWriter(
        MetaClient(server.address, job=job, timeout=30),
        hf_layout(trainer, "trainer", "trainer"),
        0,
        views(sent),
        transport=transport,
        verify=verify,
        timeout=30,
        **options,
    )
    readers = []
    for name in engines:
        layout = vllm_layout(TENSORS, VllmParallel(tp=tp), instance=name)
        for rank in range(tp):
            held = {t.name: torch.zeros(t.spec.shape, dtype=torch.bfloat16, device=device) for t in TENSORS}
            readers.append(WeightsReader(MetaClient(server.address, job=job, timeout=30), layout, rank, views(held)))
    return writer, readers, sent


def _sync(writer, readers, version, engines=("eng",)):
    errors: dict[int, BaseException] = {}

    def receive(i, reader):
        try:
            reader.receive(version)
        except BaseException as e:  # asserted by the caller
            errors[i] = e

    threads = [threading.Thread(target=receive, args=(i, r)) for i, r in enumerate(readers)]
    for t in threads:
        t.start()
    try:
        writer.write(version, list(engines))
        written = None
    except SyncFailedError as e:
        written = e
    for t in threads:
        t.join(60)
    return written, errors


def _corrupt_after_transfer(reader):
    """The reader's next transfer arrives with one bit of one element it holds flipped (a transport or memory
    fault)."""

    def transfer(*args, **kwargs):
        stats = SyncSession.transfer(reader._session, *args, **kwargs)
        _, view = reader.shards.pairs(sorted(reader.shards.names())[0])[0]
        view.reshape(-1).view(torch.int16)[7] ^= 1 << 3
        del reader._session.transfer
        return stats

    reader._session.transfer = transfer


def _corrupt_as_it_lands(reader):
    """Point to point digests each wave as it lands: one bit of what the reader's next transfer puts in its views
    flips as a wave is unpacked, before that wave is digested (a transport or memory fault on the way in)."""
    digests = reader._session._transports["p2p"]._digests[1]
    original, flipped = digests.received, []

    def received(wave, stream=None):
        pieces = digests.views.get(("got", wave), [])
        if pieces and not flipped:
            words = pieces[0].view(torch.int16)
            words[(0,) * words.dim()] ^= 1 << 3
            flipped.append(wave)
            digests.received = original
        original(wave, stream)

    digests.received = received


def _close(writer, readers):
    for r in readers:
        r.close()
    writer.close()


def _equal(sent, readers):
    """Every view of every reader holds the trainer's values of its box, bit for bit."""
    return all(
        torch.equal(view, sent[name][box.slices()].to(torch.bfloat16))
        for r in readers
        for name in r.shards.names()
        for box, view in r.shards.pairs(name)
    )


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA views (batched digest kernels): no GPU here")


@pytest.mark.parametrize("transport,device", [("p2p", "cpu"), ("shm", "cpu"), pytest.param("shm", "cuda", marks=CUDA)])
def test_verified_versions_arrive_and_a_changed_bit_fails_the_version(server, transport, device):
    writer, readers, sent = _job(server, f"verify-{transport}-{device}", transport=transport, device=device)
    written, errors = _sync(writer, readers, "v1")
    assert written is None and not errors
    assert "verify" in writer.last_stats.phases
    (_corrupt_as_it_lands if transport == "p2p" else _corrupt_after_transfer)(readers[1])
    for t in sent.values():
        t.add_(1)
    written, errors = _sync(writer, readers, "v2")
    assert isinstance(written, SyncFailedError) and "hold other bytes than it sent" in str(written), written
    assert set(errors) == {1} and isinstance(errors[1], VerifyError), errors
    assert isinstance(errors[1], VerifyError)
    for t in sent.values():
        t.add_(1)
    written, errors = _sync(writer, readers, "v3")  # a failure never poisons the next version
    assert written is None and not errors and _equal(sent, readers)
    _close(writer, readers)


def _tamper_with_the_segment(writer):
    """Alter one byte of the trainer's filled shared-memory segment (the last region's last byte) just before its
    progress word says the segment is full: every receiver of that region copies the altered byte."""
    from awex.transport.pull.staging import segment_layout

    transport = writer._session._transports["shm"]
    segment, plan, rank = transport.sender.segment, transport.sender.plan, transport.sender.rank
    offsets, _ = segment_layout(plan, rank)
    (tensor, _, sizes), at = max(offsets.items(), key=lambda kv: kv[1])
    last = at + plan.tensors[tensor].itemsize * _numel(sizes) - 1
    fill, done = segment.set_progress, []

    def set_progress(count, filled):
        if filled == segment.nbytes and not done:  # (said twice at the end)
            segment.tensor[last] ^= 1
            done.append(count)
        fill(count, filled)

    segment.set_progress = set_progress


@pytest.mark.parametrize("verify", [True, False])
def test_bytes_altered_in_a_filled_segment_are_noticed(server, verify):
    writer, readers, sent = _job(server, f"tampered-{verify}", transport="shm", verify=verify)
    assert _sync(writer, readers, "v1") == (None, {})
    _tamper_with_the_segment(writer)
    for t in sent.values():
        t.add_(1)
    written, errors = _sync(writer, readers, "v2")
    if verify:
        assert isinstance(written, SyncFailedError) and errors and not _equal(sent, readers)
        assert all(isinstance(e, VerifyError) for e in errors.values())
    else:  # the segment carries no digest of its own: without verify mode the altered byte passes
        assert written is None and not errors and not _equal(sent, readers)
    _close(writer, readers)


def test_without_verify_the_same_changed_bit_passes_as_applied(server):
    writer, readers, sent = _job(server, "unverified", verify=False)
    _sync(writer, readers, "v1")
    _corrupt_after_transfer(readers[0])
    written, errors = _sync(writer, readers, "v2")
    assert written is None and not errors and not _equal(sent, readers)  # what verify mode is for


def test_relayed_regions_are_verified_against_their_origin(server):
    engines = ("a", "b", "c")
    writer, readers, sent = _job(server, "relayed", engines=engines, tp=1)
    written, errors = _sync(writer, readers, "v1", engines)
    assert written is None and not errors and _equal(sent, readers)
    assert writer._session.plan.stats.relayed_bytes > 0  # some receivers got their regions from another
    _close(writer, readers)


@pytest.mark.parametrize("transport,device", [("p2p", "cpu"), pytest.param("shm", "cuda", marks=CUDA)])
def test_a_narrowing_cast_verifies(server, transport, device):
    writer, readers, sent = _job(
        server, f"cast-{device}", trainer=WIDE, allow_cast=("*",), transport=transport, device=device
    )
    assert _sync(writer, readers, "v1") == (None, {}) and _equal(sent, readers)
    _close(writer, readers)


def test_delta_versions_verify(server):
    writer, readers, sent = _job(server, "delta-verify", delta=True)
    for step in (1, 2, 3):
        for t in sent.values():
            t.view(-1)[::97] += 0.5
        assert _sync(writer, readers, f"v{step}") == (None, {}) and _equal(sent, readers)
    _close(writer, readers)


def test_a_reader_that_requires_verify_refuses_an_unverified_version_before_any_byte(server):
    writer, readers, sent = _job(server, "requires", verify=False, tp=1)
    readers[0].verify = True
    started = time.monotonic()
    written, errors = _sync(writer, readers, "v1")
    assert isinstance(errors[0], VerifyError) and "requires verified versions" in str(errors[0])
    # the writer sees the refusal as it waits for the receiver's device record: the receiver gave the gather up (not
    # its 30 s deadline, nor the 10 s after which a waiting rank reads the attempt's outcomes)
    assert isinstance(written, SyncFailedError) and time.monotonic() - started < 6
    assert "requires verified versions" in str(written)
    assert all(not v.any() for n in readers[0].shards.names() for _, v in readers[0].shards.pairs(n))  # none moved
    _close(writer, readers)


def test_options_refused_before_any_byte():
    from awex.engines.sync.options import SyncOptions

    with pytest.raises(ValueError, match="quantize_on_receive"):
        SyncOptions(transport="ipc", quantize_on_receive=True, verify=True).check()
    with pytest.raises(ValueError, match="verify=1"):
        SyncOptions(verify=1).check()
    with pytest.raises(ValueError, match="True or False"):
        WeightsReader(None, hf_layout(TENSORS, "inference", "x"), 0, views(_weights(TENSORS, 0)), verify="yes")


def _relay_plan():
    trainer = hf_layout(TENSORS, "trainer", "trainer")
    engines = [vllm_layout(TENSORS, VllmParallel(tp=2), instance=f"e{i}") for i in range(4)]
    return plan_transfers([trainer], engines, PlanOptions(wave_bytes=4096, relay=True))


def test_every_received_region_has_one_origin_that_sends_it_for_that_receiver():
    plan = _relay_plan()
    assert plan.stats.relayed_bytes > 0
    trainers = [r.rank for r in plan.ranks if r.role == Role.TRAINER]
    per = {r.rank: regions(plan, r.rank) for r in plan.ranks}
    for r in plan.ranks:
        if r.role == Role.TRAINER:
            continue
        got = per[r.rank].receives
        assert set(got) <= set(trainers)  # relays never count as origins
        for origin, keys_ in got.items():
            assert sorted(per[origin].sends[r.rank]) == sorted(keys_)
        received = sum(t.nbytes for b in plan.buckets if b.dst == r.rank for t in b.transfers)
        tensors = plan.tensors
        assert received == sum(tensors[k[0]].itemsize * _numel(k[2]) for ks in got.values() for k in ks)


def _numel(sizes):
    n = 1
    for s in sizes:
        n *= s
    return n


def test_a_record_for_another_plan_or_without_this_rank_is_refused():
    plan = _relay_plan()
    doc = record(plan, {5: (1, 2)})
    assert expected(doc, plan, 0, 5) == (1, 2)
    for bad, why in [
        ({**doc, "plan": "0" * 64}, "for plan"),
        ({**doc, "digests": {"6": doc["digests"]["5"]}}, "no digest for sync rank 5"),
        ({**doc, "digests": {"5": "zz"}}, "no digest"),
        ({**doc, "extra": 1}, "malformed"),
        ([doc], "malformed"),
    ]:
        with pytest.raises(VerifyError, match=why):
            expected(bad, plan, 0, 5)


@CUDA
def test_cuda_views_that_moved_are_digested_where_they_are_now(server):
    """The trainer's weights re-allocated between versions (offloaded and reloaded): its digests are taken of where
    they are now (the batched layout is rebuilt), not of the memory it laid out first (still alive here)."""
    writer, readers, sent = _job(server, "moved-cuda", transport="shm", device="cuda")
    assert _sync(writer, readers, "v1") == (None, {})
    for name in list(sent):
        sent[name] = (sent[name] + 1).clone()
    assert _sync(writer, readers, "v2") == (None, {}) and _equal(sent, readers)
    _close(writer, readers)


def test_digests_a_transport_took_as_it_copied_decide_and_a_wrong_one_fails(server):
    """What the receiving transport digested as it copied (``Transport.received_digests``: CUDA IPC) is compared in
    place of the receiver's own digest: equal to the origin's, the version passes; one word off, it fails; digests
    naming other origins than the plan's are not used (the receiver digests its views itself)."""
    from types import SimpleNamespace

    from awex.engines.sync.verify import Verifier, digests
    from awex.transport import LocalShards

    trainer = hf_layout(TENSORS, "trainer", "trainer")
    engine = vllm_layout(TENSORS, VllmParallel(tp=2), instance="eng")
    plan = plan_transfers([trainer], [engine], PlanOptions(relay=False))
    weights = _weights(TENSORS, 3)
    sent = LocalShards.from_layout(trainer, 0, views(weights))
    rank = next(r.rank for r in plan.ranks if r.instance == "eng" and r.local_rank == 1)
    held = LocalShards.from_layout(engine, 1, views({n: w.clone() for n, w in weights.items()}))
    client = MetaClient(server.address, job="taken", timeout=10)
    manifest = SimpleNamespace(version="v1", seq=1)
    Verifier(client).publish(plan, 0, manifest, sent)
    receives = regions(plan, rank).receives
    right = digests(plan, held, receives)
    check = Verifier(client).check
    check(plan, rank, manifest, held, time.monotonic() + 5, taken=right)
    wrong = {o: ((a + 1) % (1 << 32), b) for o, (a, b) in right.items()}
    with pytest.raises(VerifyError, match="hold other bytes than it sent"):
        check(plan, rank, manifest, held, time.monotonic() + 5, taken=wrong)
    check(plan, rank, manifest, held, time.monotonic() + 5, taken={99: (0, 0)})  # not the plan's origins: its own
    client.close()
