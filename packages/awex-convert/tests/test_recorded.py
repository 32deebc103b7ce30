"""Learning where loaders put each canonical tensor: probes through loaders shaped like vLLM's (TP narrow into a
fused QKV, a padded vocabulary, a transposed copy, a merged reshape, chunked gate/up), each recorded landing
replayed as a view and checked element for element against what the real loader writes with real data; loaders
that compute on the weight are reported unsupported; ambiguous recordings are errors naming the tensors."""

from __future__ import annotations

import pytest
import torch

from awex.convert.recorded import AmbiguousLoadError, landing_view, record_loads
from awex.convert.strided import region_box
from awex.meta import Box, TensorSpec

TP, RANK = 2, 1
H, HEADS, KV, HD, VOCAB, PAD, INTER = 8, 4, 2, 2, 10, 16, 6


def _params() -> dict[str, torch.Tensor]:
    q, kv = HEADS // TP * HD, KV // TP * HD
    return {
        "qkv": torch.zeros(q + 2 * kv, H),
        "embed": torch.zeros(PAD // TP, H),
        "down_t": torch.zeros(INTER // TP, H),  # stored transposed
        "gate_up": torch.zeros(2 * INTER // TP, H),
        "experts": torch.zeros(3, H, 4),  # (experts, hidden, 4): loaded as (4, H) each, transposed
        "norm": torch.zeros(H),
    }


def _loader(params):
    q, kv = HEADS // TP * HD, KV // TP * HD

    def load(name: str, w: torch.Tensor) -> None:
        if name in ("q", "k", "v"):
            rows = q if name == "q" else kv
            start = {"q": 0, "k": q, "v": q + kv}[name]
            params["qkv"].narrow(0, start, rows).copy_(w.narrow(0, RANK * rows, rows))
        elif name == "embed":
            shard = PAD // TP
            part = w[RANK * shard : min((RANK + 1) * shard, VOCAB)]
            params["embed"][: part.shape[0]].copy_(part)
        elif name == "down":  # (H, INTER), row-parallel: columns split, stored transposed
            params["down_t"].copy_(w.narrow(1, RANK * (INTER // TP), INTER // TP).t())
        elif name == "gate_up":  # checkpoint holds [gate; up] fused: chunk, take this rank's rows of each
            gate, up = w.chunk(2, dim=0)
            per = INTER // TP
            params["gate_up"][:per] = gate[RANK * per : (RANK + 1) * per]
            params["gate_up"][per:].copy_(up[RANK * per : (RANK + 1) * per])
        elif name.startswith("expert."):
            e = int(name.split(".")[1])
            params["experts"][e].copy_(w.reshape(4, H).transpose(0, 1))
        elif name == "norm":
            params["norm"].copy_(w)
        elif name == "scaled":
            params["norm"].copy_(w * 2)

    return load


SPECS = [
    TensorSpec("q", (HEADS * HD, H), "float32"),
    TensorSpec("k", (KV * HD, H), "float32"),
    TensorSpec("v", (KV * HD, H), "float32"),
    TensorSpec("embed", (VOCAB, H), "float32"),
    TensorSpec("down", (H, INTER), "float32"),
    TensorSpec("gate_up", (2 * INTER, H), "float32"),
    *[TensorSpec(f"expert.{e}", (2, 2, H), "float32") for e in range(3)],
    TensorSpec("norm", (H,), "float32"),
]


def test_every_recorded_landing_is_where_the_real_loader_writes_each_element():
    params = _params()
    rec = record_loads(_loader(params), SPECS, params)
    assert not rec.unsupported and all(float(p.abs().sum()) == 0 for p in params.values())  # nothing written
    assert set(rec.landings) == {s.name for s in SPECS}
    real = {k: torch.zeros_like(v) for k, v in _params().items()}
    load = _loader(real)
    for spec in SPECS:
        data = torch.randn(spec.shape)
        load(spec.name, data)
        for landing in rec.landings[spec.name]:
            assert torch.equal(landing_view(real[landing.param], landing), data[landing.box.slices()]), spec.name
    assert rec.landings["q"][0].box == Box((4, 0), (4, H))
    assert rec.landings["embed"][0].box == Box((8, 0), (2, H))  # the real rows of this rank's padded block
    assert [x.box for x in rec.landings["gate_up"]] == [Box((3, 0), (3, H)), Box((9, 0), (3, H))]


def test_a_loader_that_computes_on_the_weight_is_reported_and_others_still_learned():
    params = _params()
    rec = record_loads(_loader(params), [*SPECS[:1], TensorSpec("scaled", (H,), "float32")], params)
    assert "scaled" in rec.unsupported and "computes" in rec.unsupported["scaled"]
    assert "q" in rec.landings


def test_two_tensors_landing_in_one_place_is_an_error_naming_both():
    params = _params()
    load = _loader(params)

    def clash(name, w):
        load("norm", w) if name in ("norm", "norm2") else load(name, w)

    with pytest.raises(AmbiguousLoadError, match="norm.*norm2|norm2.*norm"):
        record_loads(clash, [TensorSpec("norm", (H,), "float32"), TensorSpec("norm2", (H,), "float32")], params)


def test_a_tensor_landing_twice_on_one_rank_is_an_error():
    params = {"a": torch.zeros(4), "b": torch.zeros(4)}

    def twice(name, w):
        params["a"].copy_(w)
        params["b"].copy_(w)

    with pytest.raises(AmbiguousLoadError, match="x: its elements .* land twice"):
        record_loads(twice, [TensorSpec("x", (4,), "float32")], params)


def test_a_loader_that_fails_for_another_reason_is_raised_naming_the_tensor():
    def bad(name, w):
        raise AssertionError("shape mismatch")

    with pytest.raises(ValueError, match=r"loader for w \(3,\) failed on a probe: shape mismatch"):
        record_loads(bad, [TensorSpec("w", (3,), "float32")], {"p": torch.zeros(3)})


@pytest.mark.parametrize(
    "view,box",
    [
        (lambda t: t[1:3, 2:5], Box((1, 2), (2, 3))),
        (lambda t: t[1:3].t(), Box((1, 0), (2, 6))),
        (lambda t: t.reshape(2, 2, 6)[1], Box((2, 0), (2, 6))),
        (lambda t: t[2].unsqueeze(0), Box((2, 0), (1, 6))),
        (lambda t: t.view(24), Box((0, 0), (4, 6))),
    ],
)
def test_region_box_finds_the_box_a_view_covers(view, box):
    base = torch.empty(4, 6)
    v = view(base)
    found = region_box((4, 6), v.storage_offset(), tuple(v.shape), v.stride())
    assert found is not None and found.box == box


@pytest.mark.parametrize(
    "offset,sizes,strides",
    [
        (0, (4, 3), (6, 2)),  # every other column
        (2, (8,), (1,)),  # a run that wraps into the next row part-way
        (0, (2, 6), (0, 1)),  # one row twice
        (0, (3, 6), (12, 1)),  # every other row, then out of bounds
    ],
)
def test_region_box_refuses_steps_partial_merges_and_repeats(offset, sizes, strides):
    assert region_box((4, 6), offset, sizes, strides) is None


def test_a_loader_that_copies_the_data_out_of_place_is_unsupported():
    params = {"p": torch.zeros(4, 6)}
    rec = record_loads(
        lambda name, w: params["p"].copy_(w.t().reshape(4, 6)), [TensorSpec("w", (4, 6), "float32")], params
    )
    assert "copies the data" in rec.unsupported["w"]
