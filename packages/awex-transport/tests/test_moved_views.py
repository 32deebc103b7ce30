"""Views re-pointed at tensors that moved (``awex.transport.moved_views``, through ``rebound``): exactly the views
deriving them again gives, without asking ``view_of``; derived again wherever addresses and forms alone cannot
tell (a form changed, a buffer's parts moved apart, a view in no tensor, memory freed in place)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from awex.meta import Box, canonical_tensors
from awex.meta.layouts import hf_layout
from awex.transport.moved_views import recipe
from awex.transport.rebind import rebound
from awex.transport.shards import LocalShards, ShardMismatchError

CONFIG = json.loads((Path(__file__).resolve().parents[3] / "integration" / "models" / "qwen2-tiny.json").read_text())
TENSORS = canonical_tensors(CONFIG, dtype="float32")
LAYOUT = hf_layout(TENSORS, "trainer", "other")
FUSED = ("mlp.gate_proj.weight", "mlp.up_proj.weight")  # held as one tensor, gate's rows first


class Model:
    """Tensors a trainer holds, laid out unlike the canonical ones: gate and up fused, ``down_proj`` stored
    transposed, the embedding handed out as two row pieces; ``view_of`` derives every view by that fixed rule and
    counts its calls. ``sources()`` names the tensors, in the order of ``forms()``."""

    def __init__(self, flat: bool = False):
        self.t: dict[str, torch.Tensor] = {}
        for i, spec in enumerate(TENSORS):
            name, shape = spec.name, spec.spec.shape
            if name.endswith(FUSED[1]):
                continue
            if name.endswith(FUSED[0]):
                shape = (2 * shape[0], shape[1])
            elif name.endswith("down_proj.weight"):
                shape = shape[::-1]
            self.t[name] = torch.arange(float(i), float(i) + torch.Size(shape).numel()).reshape(shape)
        self.buffer = None
        if flat:  # every tensor a part of one buffer (a trainer's contiguous parameter buffer), named too
            self.buffer = torch.cat([t.reshape(-1) for t in self.t.values()])
            self._into(self.buffer)
        self.calls = 0

    def _into(self, buffer: torch.Tensor) -> None:
        at = 0
        for name, t in self.t.items():
            self.t[name] = buffer[at : at + t.numel()].view(t.shape)
            at += t.numel()

    def tensors(self) -> list[torch.Tensor]:
        return [self.buffer, *self.t.values()] if self.buffer is not None else list(self.t.values())

    def view_of(self):
        def view_of(name: str, box: Box):
            self.calls += 1
            if name.endswith(FUSED[1]):
                fused = self.t[name.replace(FUSED[1], FUSED[0])]
                return fused[fused.shape[0] // 2 :][box.slices()]
            if name.endswith("down_proj.weight"):
                return self.t[name].t()[box.slices()]
            if name == "model.embed_tokens.weight":  # two pieces
                half = box.sizes[0] // 2
                top, rest = Box(box.offsets, (half, box.sizes[1])), Box((half, 0), (box.sizes[0] - half, box.sizes[1]))
                return [(top, self.t[name][:half]), (rest, self.t[name][half:])]
            return self.t[name][box.slices()]

        view_of.fingerprint = lambda: (self.addresses(), self.forms())
        view_of.addresses = self.addresses
        view_of.forms = self.forms
        view_of.sources = self.tensors
        return view_of

    def addresses(self) -> tuple:
        return tuple(t.data_ptr() for t in self.tensors()) + tuple(t.nbytes for t in self.tensors())

    def forms(self) -> tuple:
        return tuple((t.shape, t.stride(), t.dtype) for t in self.tensors())

    def move(self) -> None:
        """Offloaded and loaded back: every tensor (or the buffer) in new memory, values kept."""
        if self.buffer is not None:
            self.buffer = self.buffer.clone()
            self._into(self.buffer)
        else:
            self.t = {n: t.clone() for n, t in self.t.items()}


def _bound(model: Model):
    view_of = model.view_of()
    held, _ = rebound(LAYOUT, 0, view_of, LocalShards.from_layout(LAYOUT, 0, view_of), quick=True)
    return view_of, held


def _same_as_derived(model: Model, shards: LocalShards) -> None:
    calls = model.calls
    derived = LocalShards.from_layout(LAYOUT, 0, model.view_of())
    model.calls = calls
    assert shards.moved(derived) == []  # every view at the address, shape, strides, dtype deriving it gives
    assert [b for n in derived.names() for b, _ in derived.pairs(n)] == [b for n in derived.names() for b, _ in
                                                                         shards.pairs(n)]  # fmt: skip
    for name in derived.names():
        for (_, mine), (_, theirs) in zip(shards.pairs(name), derived.pairs(name)):
            assert torch.equal(mine, theirs)


@pytest.mark.parametrize("flat", [False, True], ids=["tensors", "one-buffer"])
def test_views_of_tensors_that_moved_are_re_pointed_not_derived_again(flat):
    model = Model(flat)
    view_of, held = _bound(model)
    for _ in range(3):
        model.move()
        model.calls = 0
        now, moved = rebound(LAYOUT, 0, view_of, held, quick=True)
        assert model.calls == 0 and now is not held  # not one view asked for
        assert moved == sorted(t.name for t in TENSORS)
        _same_as_derived(model, now)
        held = now


def test_a_tensor_whose_form_changed_is_derived_again():
    """down_proj kept transposed but now contiguous the other way (same bytes' count, new strides): derived."""
    model = Model()
    view_of, held = _bound(model)
    name = next(n for n in model.t if n.endswith("down_proj.weight"))
    model.move()
    model.t[name] = model.t[name].t().contiguous().t()  # the same shape, the strides swapped
    model.calls = 0
    now, moved = rebound(LAYOUT, 0, view_of, held, quick=True)
    assert model.calls > 0 and moved
    _same_as_derived(model, now)


def test_a_buffer_whose_parts_moved_apart_is_derived_again():
    """Views derived from the parts of one buffer: the buffer stays and one part is given new memory of its own.
    Each view lies in the buffer and in that part: which one its memory is now cannot be told from addresses, so
    it is derived again (re-pointing it at the part's new memory would send from where the views no longer are)."""
    model = Model(flat=True)
    view_of, held = _bound(model)
    name = next(iter(model.t))
    model.t[name] = model.t[name].clone()  # out of the buffer; every other part, and the buffer, stay
    model.calls = 0
    now, moved = rebound(LAYOUT, 0, view_of, held, quick=True)
    assert model.calls > 0 and moved == [name]
    _same_as_derived(model, now)


def test_a_view_in_no_tensor_is_never_re_pointed():
    """A view the converter made (a buffer of its own, in none of the tensors): no recipe, derived again."""
    model = Model()
    made = torch.zeros(TENSORS[2].spec.shape)
    derive = model.view_of()

    def view_of(name, box):
        return made[box.slices()] if name == TENSORS[2].name else derive(name, box)

    for part in ("fingerprint", "addresses", "forms", "sources"):
        setattr(view_of, part, getattr(derive, part))
    held, _ = rebound(LAYOUT, 0, view_of, LocalShards.from_layout(LAYOUT, 0, view_of), quick=True)
    assert recipe(held, held.sources_at, held.fingerprint[1]) is None
    model.move()
    now, moved = rebound(LAYOUT, 0, view_of, held, quick=True)
    assert TENSORS[2].name not in moved and now.pairs(TENSORS[2].name)[0][1].data_ptr() == made.data_ptr()


def test_memory_freed_in_place_is_refused_naming_the_tensor():
    """The offload trick (``untyped_storage().resize_(0)``) after a move: the full check runs and names it."""
    model = Model()
    view_of, held = _bound(model)
    model.move()
    name = next(n for n in model.t if n.endswith("input_layernorm.weight"))
    model.t[name].untyped_storage().resize_(0)
    with pytest.raises(ShardMismatchError, match=rf"{name} .*memory is not there"):
        rebound(LAYOUT, 0, view_of, held, quick=True)
