"""``LiveTensors.fingerprint``: the one-pass fingerprint a steady sync takes every version equals the one read
through the live lookups, and changes whenever a tensor moved, was replaced, resharded or freed."""

from __future__ import annotations

import torch

from awex.convert.live import LiveTensors, fingerprint


def model() -> torch.nn.Module:
    m = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LayerNorm(6))
    m.register_buffer("scale", torch.ones(3))
    return m


def looked_up(live: LiveTensors) -> tuple:
    return tuple((t.data_ptr(), t.shape, t.stride(), t.dtype) for t in live.values())


def test_the_one_pass_fingerprint_equals_the_live_lookups_and_follows_every_change():
    m = model()
    live = LiveTensors(m)
    first = live.fingerprint()
    assert first == looked_up(live) == fingerprint(live) and len(first) == 5
    assert fingerprint(live, LiveTensors(m, parameters=False)) == first + looked_up(LiveTensors(m, parameters=False))

    changes = [
        lambda: setattr(m[0].weight, "data", torch.zeros(6, 4)),  # param.data swapped (offload and reload)
        lambda: setattr(m[0], "bias", torch.nn.Parameter(torch.zeros(6))),  # a new nn.Parameter
        lambda: setattr(m[1].weight, "data", m[1].weight.data[:3]),  # resharded in place: same address, new shape
        lambda: setattr(m[0].weight, "data", m[0].weight.data.t()),  # same memory, other strides
        lambda: setattr(m, "scale", torch.ones(3, dtype=torch.float64)),  # a buffer replaced
        lambda: m[1].bias.untyped_storage().resize_(0),  # freed in place (the usual offload trick)
    ]
    before = first
    for change in changes:
        change()
        now = live.fingerprint()
        assert now != before and now == looked_up(live)
        before = now


def test_a_parameter_replaced_by_a_plain_attribute_is_still_found():
    m = model()
    live = LiveTensors(m)
    first = live.fingerprint()
    del m[0].bias
    m[0].bias = torch.full((6,), 2.0)  # no longer a parameter: the one-pass read misses it, the lookups find it
    now = live.fingerprint()
    assert now != first and now == looked_up(live) and now[2][0] == m[0].bias.data_ptr()
