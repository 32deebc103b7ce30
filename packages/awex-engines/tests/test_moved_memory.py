"""Trainer memory that moves between versions (offloaded and reloaded, ``param.data`` replaced, a new
``nn.Parameter``): the writer's views are asked again before every write, and what moved is re-bound, so every
version arrives bit-exact, never the old storage's bytes (which the old views would keep alive and send). Memory
that moved to another kind of device is refused naming the tensor before any byte moves, and the next version,
once it is back, goes through. WeightsWriter / WeightsReader over gloo and shared memory, one process, two
threads; an HF-named module tree without transformers."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch
from test_version_signals import CONFIG, views

from awex.convert.hf import hf_views
from awex.engines.errors import SyncFailedError, VersionRefusedError
from awex.engines.reader import WeightsReader
from awex.engines.writer import WeightsWriter
from awex.meta import canonical_tensors
from awex.meta.client import MetaClient
from awex.meta.layouts import hf_layout
from awex.meta.server import start_embedded
from awex.transport.shards import ShardMismatchError

TENSORS = canonical_tensors(CONFIG, dtype="float32")


def module_of(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    root = torch.nn.Module()
    for name, t in tensors.items():
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
    return root


def move(model: torch.nn.Module, how: str, step: int) -> None:
    """A training step that also moves the weights, as colocated RL stacks do between versions."""
    for name, p in list(model.named_parameters()):
        new = p.data.clone() + step  # offloaded, changed, loaded back into new memory
        if how == "data":
            p.data = new
        elif how == "parameter":
            path, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(path), leaf, torch.nn.Parameter(new, requires_grad=False))
        else:  # "in place": the memory stays (nothing to re-bind)
            p.data.copy_(new)


@pytest.fixture
def server():
    s = start_embedded()
    yield s
    s.stop()


def _pair(server, job: str, transport: str, delta: bool = False):
    g = torch.Generator().manual_seed(0)
    model = module_of({t.name: torch.randn(t.spec.shape, generator=g) for t in TENSORS})
    got = {t.name: torch.zeros(t.spec.shape) for t in TENSORS}
    client = MetaClient(server.address, job=job, timeout=30)
    writer = WeightsWriter(
        client, hf_layout(TENSORS, "trainer", "trainer"), 0, hf_views(model), transport=transport, delta=delta
    )
    reader = WeightsReader(
        MetaClient(server.address, job=job, timeout=30), hf_layout(TENSORS, "inference", "hf-in"), 0, views(got)
    )
    return model, writer, reader, got


def _sync(writer, reader, version):
    errors: list = []
    t = threading.Thread(target=lambda: _receive(reader, version, errors))
    t.start()
    try:
        writer.write(version, ["hf-in"])
    finally:
        t.join(60)
    assert not errors, errors


def _receive(reader, version, errors):
    try:
        reader.receive(version)
    except Exception as e:  # asserted by the caller
        errors.append(e)


def _failed_version(writer, reader, version: str, raises, match: str | None = None) -> list:
    """Write ``version`` while ``reader`` receives it: the write must raise ``raises`` (matching ``match``); returns
    what the receiver raised."""
    errors: list = []
    t = threading.Thread(target=lambda: _receive(reader, version, errors))
    t.start()
    try:
        with pytest.raises(raises, match=match):
            writer.write(version, ["hf-in"])
    finally:
        t.join(60)
    return errors


def _exact(model, got) -> list[str]:
    return [n for n, p in model.named_parameters() if not torch.equal(p.data, got[n])]


@pytest.mark.parametrize(
    ("transport", "delta", "how"),
    [
        ("p2p", False, "data"),
        ("p2p", False, "parameter"),
        ("p2p", False, "in place"),
        ("p2p", True, "data"),
        ("shm", False, "data"),
        ("shm", False, "parameter"),
    ],
)
def test_every_version_arrives_exact_when_trainer_memory_moves(server, transport, delta, how, caplog):
    model, writer, reader, got = _pair(server, f"moved-{transport}-{delta}-{how.replace(' ', '-')}", transport, delta)
    caplog.set_level("INFO", logger="awex.transport")
    try:
        for step in range(1, 5):
            move(model, how, step)
            held = writer.shards
            caplog.clear()
            _sync(writer, reader, f"v{step}")
            assert _exact(model, got) == [], f"v{step}: stale tensors arrived"
            if step > 1:  # moved memory is re-bound; memory that stayed keeps its views (and transports theirs)
                assert (writer.shards is held) is (how == "in place")
                # the views the last version derived, re-pointed at the tensors' new memory (none asked again)
                repointed = [r for r in caplog.records if r.getMessage().startswith("trainer:0") and "re-pointed" in
                             r.getMessage()]  # fmt: skip
                assert len(repointed) == (how != "in place")
    finally:
        writer.close()
        reader.close()


CHANGED = "changed shape, strides or dtype in place"  # what the moved-memory check says of such a tensor
SQUARE = "model.layers.0.self_attn.o_proj.weight"  # (128, 128): transposed in place, it keeps address and size


def _transpose_in_place(model: torch.nn.Module, name: str) -> None:
    p = model.get_parameter(name)
    p.data = p.data.t()  # the same memory read as its transpose: only strides tell


@pytest.mark.parametrize("transport", ["p2p", "shm"])
def test_a_trainer_tensor_changed_in_place_at_its_address_fails_the_version_and_the_next_is_exact(server, transport):
    """A steady version checks the trainer's addresses before any byte moves and the rest (shape, strides, dtype)
    while the bytes move: a tensor transposed in place at the same address fails that version (its bytes went as
    the old views lay them out), and the next one takes new views and arrives exact."""
    model, writer, reader, got = _pair(server, f"in-place-form-{transport}", transport)
    try:
        _sync(writer, reader, "v1")
        _transpose_in_place(model, SQUARE)
        _failed_version(writer, reader, "v2", ShardMismatchError, rf"{re.escape(SQUARE)} {CHANGED}")
        _sync(writer, reader, "v3")
        assert _exact(model, got) == []
    finally:
        writer.close()
        reader.close()


@pytest.mark.parametrize("transport", ["p2p", "shm"])
def test_an_engine_tensor_changed_in_place_at_its_address_fails_the_version_and_the_next_is_exact(server, transport):
    sent, engine, writer, reader = _engine_pair(server, f"engine-in-place-form-{transport}", transport)
    try:
        _sync(writer, reader, "v1")
        _transpose_in_place(engine, SQUARE)
        errors = _failed_version(writer, reader, "v2", SyncFailedError, CHANGED)
        assert len(errors) == 1 and isinstance(errors[0], ShardMismatchError), errors
        assert SQUARE in str(errors[0])
        for x in sent.values():
            x.add_(1.0)
        _sync(writer, reader, "v3")
        assert [n for n, p in engine.named_parameters() if not torch.equal(p.data, sent[n])] == []
    finally:
        writer.close()
        reader.close()


def test_a_parameter_that_is_gone_is_refused_naming_it_then_the_next_version_goes(server):
    """A parameter set to ``None`` (released, not loaded back) after the views were re-pointed once: refused before
    any byte moves, naming it (not a ``KeyError`` from looking for its memory); back, the next version is exact."""
    model, writer, reader, got = _pair(server, "moved-gone", "p2p")
    try:
        _sync(writer, reader, "v1")
        move(model, "data", 1)
        _sync(writer, reader, "v2")  # re-pointed
        name, p = next(iter(model.named_parameters()))
        path, _, leaf = name.rpartition(".")
        kept = p.data
        setattr(model.get_submodule(path), leaf, None)
        with pytest.raises(ShardMismatchError, match=rf"{re.escape(name)} .*no native tensor"):
            writer.write("v3", ["hf-in"])
        setattr(model.get_submodule(path), leaf, torch.nn.Parameter(kept + 1, requires_grad=False))
        _sync(writer, reader, "v4")
        assert _exact(model, got) == []
    finally:
        writer.close()
        reader.close()


def test_memory_on_another_kind_of_device_is_refused_then_the_next_version_goes(server):
    model, writer, reader, got = _pair(server, "moved-device", "p2p")
    try:
        _sync(writer, reader, "v1")
        name, p = next(iter(model.named_parameters()))
        path, _, leaf = name.rpartition(".")
        kept = p.data  # offloaded to another kind of device and not loaded back:
        setattr(model.get_submodule(path), leaf, torch.nn.Parameter(torch.empty_like(kept, device="meta")))
        with pytest.raises(ShardMismatchError, match=rf"meta \({name}\.\.\.\).*loaded back"):
            writer.write("v2", ["hf-in"])
        setattr(model.get_submodule(path), leaf, torch.nn.Parameter(kept + 1))  # back, with a step's change
        _sync(writer, reader, "v3")
        assert _exact(model, got) == []
    finally:
        writer.close()
        reader.close()


@pytest.mark.parametrize("transport", ["p2p", "shm"])
def test_a_parameter_freed_in_place_is_refused_naming_it_never_a_crash(server, transport):
    """The usual offload trick (``untyped_storage().resize_(0)``) not undone before a write: refused at construction
    and at every write, naming the tensor, before any byte moves (reading it crashed the process); once the
    parameter is back the next version goes, exact."""
    model, writer, reader, got = _pair(server, f"freed-{transport}", transport)
    name, p = next(iter(model.named_parameters()))
    try:
        _sync(writer, reader, "v1")
        before = {n: t.clone() for n, t in got.items()}
        nbytes = p.untyped_storage().nbytes()
        p.untyped_storage().resize_(0)  # offloaded: the parameter keeps its shape, its memory is gone
        with pytest.raises(ShardMismatchError, match=rf"{re.escape(name)} .*memory is not there.*loaded back"):
            WeightsWriter(
                MetaClient(server.address, job=f"freed-{transport}-new", timeout=30),
                hf_layout(TENSORS, "trainer", "other"),
                0,
                hf_views(model),
                transport=transport,
            )
        for _ in range(2):  # at every write, the same refusal
            with pytest.raises(ShardMismatchError, match=rf"{re.escape(name)} .*holds 0 bytes"):
                writer.write("v2", ["hf-in"])
        assert all(torch.equal(got[n], before[n]) for n in got)  # nothing moved
        # the check ran while the name's claim travelled: the claim was taken back, the name is free again
        assert MetaClient(server.address, job=f"freed-{transport}").try_get("sync/v2") is None
        p.untyped_storage().resize_(nbytes)  # loaded back (new memory), with a step's change
        p.data.copy_(before[name] + 1)
        _sync(writer, reader, "v2")
        assert _exact(model, got) == []
    finally:
        writer.close()
        reader.close()


def test_receivers_waiting_for_a_version_the_writer_refused_itself_learn_it_at_once_and_its_retry_goes(server):
    """A steady version the writer refuses because one of its own parameters is offloaded: the receiver already
    waiting for it raises ``VersionRefusedError`` at once (not at its 30 s deadline); the notice is taken back, so a
    retry under the same name once the parameter is back, its receiver started after the refusal, goes."""
    model, writer, reader, got = _pair(server, "refused-own", "p2p")
    name, p = next(iter(model.named_parameters()))
    try:
        _sync(writer, reader, "v1")
        _sync(writer, reader, "v2")  # steady
        nbytes = p.untyped_storage().nbytes()
        before = p.detach().clone()
        p.untyped_storage().resize_(0)
        errors: list = []
        waiting = threading.Thread(target=lambda: _receive(reader, "v3", errors))
        waiting.start()
        started = time.monotonic()
        with pytest.raises(ShardMismatchError, match="holds 0 bytes"):
            writer.write("v3", ["hf-in"])
        waiting.join(30)
        assert len(errors) == 1 and isinstance(errors[0], VersionRefusedError) and "holds 0 bytes" in str(errors[0])
        assert time.monotonic() - started < 5.0
        p.untyped_storage().resize_(nbytes)  # loaded back
        p.data.copy_(before + 1)
        _sync(writer, reader, "v3")  # the same name: its receiver, started after the refusal, waits for the manifest
        assert _exact(model, got) == []
    finally:
        writer.close()
        reader.close()


def _engine_pair(server, job: str, transport: str):
    """A trainer whose memory stays, and an engine (HF-named module) that re-allocates its weights."""
    g = torch.Generator().manual_seed(1)
    sent = {t.name: torch.randn(t.spec.shape, generator=g) for t in TENSORS}
    engine = module_of({t.name: torch.zeros(t.spec.shape) for t in TENSORS})
    writer = WeightsWriter(
        MetaClient(server.address, job=job, timeout=30),
        hf_layout(TENSORS, "trainer", "trainer"),
        0,
        views(sent),
        transport=transport,
        timeout=30,
    )
    reader = WeightsReader(
        MetaClient(server.address, job=job, timeout=30),
        hf_layout(TENSORS, "inference", "hf-in"),
        0,
        hf_views(engine),
        timeout=30,
    )
    return sent, engine, writer, reader


@pytest.mark.parametrize("transport", ["p2p", "shm"])
def test_an_engine_that_reallocates_its_weights_receives_into_the_new_memory(server, transport):
    sent, engine, writer, reader = _engine_pair(server, f"engine-moved-{transport}", transport)
    try:
        for step in range(1, 4):
            for t in sent.values():
                t.add_(1.0)
            move(engine, "parameter" if step % 2 else "data", 0)  # re-allocated (values kept) before the version
            _sync(writer, reader, f"v{step}")
            assert [n for n, p in engine.named_parameters() if not torch.equal(p.data, sent[n])] == []
    finally:
        writer.close()
        reader.close()


def test_an_engine_whose_weights_left_its_device_fails_the_version_naming_them(server):
    from awex.engines.errors import SyncFailedError
    from awex.transport.base import TransferError

    sent, engine, writer, reader = _engine_pair(server, "engine-meta", "p2p")
    try:
        _sync(writer, reader, "v1")
        name, p = next(iter(engine.named_parameters()))
        path, _, leaf = name.rpartition(".")
        kept = p.data
        setattr(engine.get_submodule(path), leaf, torch.nn.Parameter(torch.empty_like(kept, device="meta")))
        # the engine rank left the sync before it began
        errors = _failed_version(writer, reader, "v2", (SyncFailedError, TransferError))
        assert len(errors) == 1 and isinstance(errors[0], ShardMismatchError), errors
        assert re.search(rf"meta \({re.escape(name)}\.\.\.\).*loaded back", str(errors[0])), errors
        setattr(engine.get_submodule(path), leaf, torch.nn.Parameter(kept))  # back: the next version goes
        for x in sent.values():
            x.add_(1.0)
        _sync(writer, reader, "v3")
        assert [n for n, p in engine.named_parameters() if not torch.equal(p.data, sent[n])] == []
    finally:
        writer.close()
        reader.close()


def test_views_are_asked_again_only_when_their_tensors_fingerprint_changed():
    """rebound() skips deriving a fingerprinted view_of's views while none of its tensors moved, and re-binds
    what moved once one did (param.data replaced, a new nn.Parameter, an in-place resize)."""
    from awex.transport import LocalShards
    from awex.transport.rebind import rebound

    model = module_of({t.name: torch.zeros(t.spec.shape) for t in TENSORS})
    layout = hf_layout(TENSORS, "trainer", "hf-out")
    derive = hf_views(model)
    calls = []

    def view_of(name, box):
        calls.append(name)
        return derive(name, box)

    view_of.fingerprint = derive.fingerprint
    held, moved = rebound(layout, 0, view_of, LocalShards.from_layout(layout, 0, view_of))
    calls.clear()
    for _ in range(3):
        same, moved = rebound(layout, 0, view_of, held)
        assert same is held and moved == [] and calls == []  # nothing derived: nothing moved
    name = TENSORS[3].name
    owner, leaf = model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
    getattr(owner, leaf).data = getattr(owner, leaf).data.clone()  # offloaded and loaded back, say
    now, moved = rebound(layout, 0, view_of, held)
    assert moved == [name] and calls and now.pairs(name)[0][1].data_ptr() == getattr(owner, leaf).data_ptr()
    calls.clear()
    assert rebound(layout, 0, view_of, now) == (now, []) and calls == []
    setattr(owner, leaf, torch.nn.Parameter(torch.zeros(getattr(owner, leaf).shape), requires_grad=False))
    assert rebound(layout, 0, view_of, now)[1] == [name]
