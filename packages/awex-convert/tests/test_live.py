"""``LiveTensors.fingerprint``: the one-pass fingerprint a steady sync takes every version equals the one read
through the live lookups, and changes whenever a tensor moved, was replaced, resharded or freed; its addresses
part (checked before any byte moves) changes whenever the memory a view addresses may no longer be its own."""

from __future__ import annotations

import torch

from awex.convert.live import LiveTensors, fingerprint


def model() -> torch.nn.Module:
    m = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LayerNorm(6))
    m.register_buffer("scale", torch.ones(3))
    return m


def looked_up(live: LiveTensors) -> tuple:
    tensors = list(live.values())
    addresses = tuple(t.data_ptr() for t in tensors) + tuple(t.numel() * t.element_size() for t in tensors)
    return addresses, tuple((t.shape, t.stride(), t.dtype) for t in tensors)


def test_the_one_pass_fingerprint_equals_the_live_lookups_and_follows_every_change():
    m = model()
    live = LiveTensors(m)
    first = live.fingerprint()
    assert first == looked_up(live) == fingerprint(live) == (live.addresses(), live.forms())
    assert len(first[0]) == 10 and len(first[1]) == 5
    buffers = LiveTensors(m, parameters=False)
    assert fingerprint(live, buffers) == tuple(a + b for a, b in zip(first, looked_up(buffers)))

    changes = [  # (change, whether the addresses part changes too)
        (lambda: setattr(m[0].weight, "data", torch.zeros(6, 4)), True),  # param.data swapped (offload, reload)
        (lambda: setattr(m[0], "bias", torch.nn.Parameter(torch.zeros(6))), True),  # a new nn.Parameter
        (lambda: setattr(m[1].weight, "data", m[1].weight.data[:3]), True),  # resharded in place: same address
        (lambda: setattr(m[0].weight, "data", m[0].weight.data.view(4, 6)), False),  # same memory, other shape
        (lambda: setattr(m[0].weight, "data", m[0].weight.data.t()), False),  # same memory, other strides
        (lambda: setattr(m, "scale", torch.ones(3, dtype=torch.float64)), True),  # a buffer replaced
        (lambda: m[1].bias.untyped_storage().resize_(0), True),  # freed in place (the usual offload trick)
    ]
    before = first
    for change, moves in changes:
        change()
        now = live.fingerprint()
        assert now != before and now == looked_up(live)
        assert (now[0] != before[0]) == moves and now[0] == live.addresses() and now[1] == live.forms()
        before = now


def test_a_parameter_replaced_by_a_plain_attribute_is_still_found():
    m = model()
    live = LiveTensors(m)
    first = live.fingerprint()
    old = m[0].bias  # held: the new tensor cannot take its memory (the allocator may hand a freed block back, at
    del m[0].bias  # the same address, and the fingerprint would rightly not change)
    m[0].bias = torch.full((6,), 2.0)  # no longer a parameter: the one-pass read misses it, the lookups find it
    assert m[0].bias.data_ptr() != old.data_ptr()
    now = live.fingerprint()
    assert now != first and now == looked_up(live) and now[0][2] == m[0].bias.data_ptr()
