"""``quantize_on_receive="auto"`` through the public path (WeightsWriter / WeightsReader, one process, two threads,
CPU): a bf16 trainer with FP8 receivers that cannot quantise on receive (CPU ranks: no CUDA IPC) quantises its own
weights to the receivers' tiles and sends FP8; the receivers' weights and scales equal the trainer's weights quantised
by the same rule, bit for bit, after every version (the weights change between versions, and in the last one their
memory moves), over p2p (quantised wave by wave) and shared memory (all at once). Which mode the ranks pick where is
``test_version_plan.py``'s; the on-receive side runs on CUDA only (``integration/tests/test_gpu_sync.py``)."""

from __future__ import annotations

import pytest
import torch
from steady_counts import views_of
from test_delta_sync import _sync
from test_moved_memory import module_of
from test_version_signals import CONFIG

from awex.convert.fp8 import quantize_fp8_blocks
from awex.engines.reader import WeightsReader
from awex.engines.writer import WeightsWriter
from awex.meta import Fp8BlockQuant, canonical_tensors, quantize_layout
from awex.meta.client import MetaClient
from awex.meta.layouts import hf_layout
from awex.meta.quant import scale_name
from awex.meta.server import start_embedded

TENSORS = canonical_tensors(CONFIG, dtype="bfloat16")
QUANT = Fp8BlockQuant(block=(32, 32))


@pytest.fixture
def server():
    s = start_embedded()
    yield s
    s.stop()


def _expected(weights: dict[str, torch.Tensor], engine) -> dict[str, torch.Tensor]:
    """What the FP8 engine must hold: every quantised weight and its scales by ``quantize_fp8_blocks``, the rest as
    sent (as raw bytes, so that FP8 compares bit for bit)."""
    out = {}
    for t in engine.tensors:
        name = t.spec.name
        if name.endswith("_scale_inv"):
            continue
        if t.spec.dtype == QUANT.dtype:
            fp8, scale = quantize_fp8_blocks(weights[name], QUANT.block, getattr(torch, QUANT.dtype))
            out[name], out[scale_name(name)] = fp8.view(torch.uint8), scale
        else:
            out[name] = weights[name]
    return out


@pytest.mark.parametrize("transport", ["auto", "shm"])
def test_the_trainer_quantises_where_the_receivers_cannot(server, transport):
    g = torch.Generator().manual_seed(0)
    weights = {t.name: torch.randn(t.spec.shape, generator=g).to(torch.bfloat16) for t in TENSORS}
    module = module_of(weights)
    engine = quantize_layout(hf_layout(TENSORS, "inference", "hf-in"), QUANT)
    got = {t.spec.name: torch.zeros(t.spec.shape, dtype=getattr(torch, t.spec.dtype)) for t in engine.tensors}
    quantised = [t.spec.name for t in engine.tensors if t.spec.dtype == QUANT.dtype]
    assert len(quantised) == 14  # 7 linear weights a layer, 2 layers: a real share of the model
    writer = WeightsWriter(
        MetaClient(server.address, job="fp8", timeout=60),
        hf_layout(TENSORS, "trainer", "trainer"),
        0,
        views_of(module),
        transport=transport,
        quantize_on_receive="auto",
        timeout=60,
    )
    reader = WeightsReader(
        MetaClient(server.address, job="fp8", timeout=60), engine, 0, lambda name, box: got[name][box.slices()]
    )
    try:
        for k in range(3):
            if k == 2:  # offloaded and loaded back: new memory, re-bound and quantised from where it is now
                for p in module.parameters():
                    p.data = p.data.clone()
            for p in module.parameters():
                p.data.mul_(1.5).add_(0.25 * k)
            _sync(writer, reader, f"v{k}")
            live = {n: p.data for n, p in module.named_parameters()}
            for name, want in _expected(live, engine).items():
                have = got[name].view(torch.uint8) if got[name].dtype == getattr(torch, QUANT.dtype) else got[name]
                assert torch.equal(have, want), (k, name)
        assert writer.transport_in_use == ("p2p" if transport == "auto" else "shm")
        assert writer._session.send_quant is not None and set(writer._session.send_quant.names) == set(quantised)
    finally:
        writer.close()
        reader.close()


def test_bf16_receivers_are_not_quantised_for(server):
    weights = {t.name: torch.full(t.spec.shape, 0.5, dtype=torch.bfloat16) for t in TENSORS}
    got = {t.name: torch.zeros(t.spec.shape, dtype=torch.bfloat16) for t in TENSORS}
    writer = WeightsWriter(
        MetaClient(server.address, job="bf16", timeout=60),
        hf_layout(TENSORS, "trainer", "trainer"),
        0,
        views_of(module_of(weights)),
        quantize_on_receive="auto",
        timeout=60,
    )
    reader = WeightsReader(
        MetaClient(server.address, job="bf16", timeout=60),
        hf_layout(TENSORS, "inference", "hf-in"),
        0,
        lambda name, box: got[name][box.slices()],
    )
    try:
        _sync(writer, reader, "v0")
        assert all(torch.equal(got[n], weights[n]) for n in weights)
        assert writer._session.send_quant is None and writer._fp8._made is None  # no FP8 buffers made
    finally:
        writer.close()
        reader.close()


def test_fp8_modes_changed_between_versions_take_effect_and_a_refused_one_changes_nothing(server):
    """``quantize_on_receive`` changed between versions: False with FP8 receivers of bf16 weights is refused before
    any byte moves (the receivers keep the last version, exactly); "auto" again then syncs whole, and "auto" after
    verify mode was switched on still has the trainer quantise (the receivers compare its FP8 bytes)."""
    g = torch.Generator().manual_seed(1)
    weights = {t.name: torch.randn(t.spec.shape, generator=g).to(torch.bfloat16) for t in TENSORS}
    module = module_of(weights)
    engine = quantize_layout(hf_layout(TENSORS, "inference", "hf-in"), QUANT)
    got = {t.spec.name: torch.zeros(t.spec.shape, dtype=getattr(torch, t.spec.dtype)) for t in engine.tensors}
    writer = WeightsWriter(
        MetaClient(server.address, job="modes", timeout=60),
        hf_layout(TENSORS, "trainer", "trainer"),
        0,
        views_of(module),
        quantize_on_receive="auto",
        timeout=20,
    )
    reader = WeightsReader(
        MetaClient(server.address, job="modes", timeout=60), engine, 0, lambda name, box: got[name][box.slices()]
    )

    def held() -> dict[str, torch.Tensor]:
        return {n: t.view(torch.uint8).clone() if t.dtype == getattr(torch, QUANT.dtype) else t.clone()
                for n, t in got.items()}  # fmt: skip

    def exact() -> bool:
        live = {n: p.data for n, p in module.named_parameters()}
        return all(torch.equal(held()[n], want) for n, want in _expected(live, engine).items())

    try:
        _sync(writer, reader, "v1")
        assert exact() and writer.quantizing
        before = held()
        for p in module.parameters():
            p.data.add_(1.0)
        writer.quantize_on_receive = False
        with pytest.raises(Exception, match="block-quantised"):  # bf16 -> FP8 without anyone quantising
            _sync(writer, reader, "v2")
        assert all(torch.equal(held()[n], before[n]) for n in before)  # no byte moved
        writer.quantize_on_receive = "auto"
        _sync(writer, reader, "v3")
        assert exact()
        writer.verify = True
        for p in module.parameters():
            p.data.mul_(0.5)
        _sync(writer, reader, "v4")
        assert exact() and writer.quantizing and "verify" in writer.last_stats.phases
    finally:
        writer.close()
        reader.close()


def test_a_tensor_sent_unquantised_that_changed_form_in_place_fails_the_check_beside_the_transfer():
    """The trainer's FP8 views send the tensors the receivers hold unquantised (embeddings, norms) from its own
    weights: a check of their addresses before the bytes move, of their forms beside it (``Fp8Sender.confirm``); one
    that changed form at the same address fails the version, and the next one takes its views again (here: refused,
    since a transposed embedding no longer fits the layout)."""
    from awex.engines.sync.fp8_sender import Fp8Sender
    from awex.transport.shards import ShardMismatchError

    weights = {t.name: torch.zeros(t.spec.shape, dtype=torch.bfloat16) for t in TENSORS}
    module = module_of(weights)
    sender = Fp8Sender(hf_layout(TENSORS, "trainer", "trainer"), 0, views_of(module))
    first, _, _ = sender.views(QUANT, None)
    again, _, _ = sender.views(QUANT, None)
    assert again is first and first.unconfirmed  # addresses alone before the bytes move
    sender.confirm()  # nothing changed: confirmed
    sender.views(QUANT, None)
    embed = module.get_submodule("model.embed_tokens")
    embed.weight.data = embed.weight.data.t()  # the same address, another form
    with pytest.raises(ShardMismatchError):
        sender.confirm()
    with pytest.raises(ShardMismatchError):  # the next version derives its views again: they no longer fit
        sender.views(QUANT, None)
