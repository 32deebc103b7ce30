import json
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import layouts, tensor_specs

from awex.meta import RankDescriptor, Role, SchemaError, TensorSpec, dumps_json, from_wire, loads_json, to_wire
from awex.meta.serialize import dumps_msgpack, loads_msgpack


@given(
    st.integers(1, 5).flatmap(tensor_specs).flatmap(lambda s: layouts(s, Role.INFERENCE, "vllm-0", full_coverage=False))
)
def test_layout_round_trips_exactly_through_json_and_msgpack(layout):
    data = dumps_json(layout)
    back = loads_json(data)
    assert back == layout
    assert dumps_json(back) == data  # canonical encoding
    for name in layout.names:
        assert back.holdings(name) == layout.holdings(name)
    assert loads_msgpack(dumps_msgpack(layout)) == layout


def test_other_documents_round_trip():
    for obj in (TensorSpec("a.b", (3, 4), "bfloat16"), RankDescriptor(3, "vllm-1", Role.INFERENCE, 1, "h", "cuda:1")):
        assert from_wire(json.loads(json.dumps(to_wire(obj)))) == obj


def test_layout_wire_size_grows_with_tensors_not_ranks(tmp_path):
    from conftest import MODELS

    from awex.meta import canonical_tensors, load_config
    from awex.meta.layouts import MegatronParallel, megatron_layout

    tensors = canonical_tensors(load_config(MODELS / "qwen3-8b.json"))
    small = dumps_json(megatron_layout(tensors, MegatronParallel(tp=2, dp=1)))
    large = dumps_json(megatron_layout(tensors, MegatronParallel(tp=8, pp=4, dp=32)))  # 1024 ranks
    assert len(large) < 1.2 * len(small)
    assert len(large) < 100 * len(tensors)  # a short record per tensor


@pytest.mark.parametrize(
    "doc, message",
    [
        ("not json", "not valid JSON"),
        ("[]", "expected a metadata document"),
        ('{"schema": 99, "kind": "layout"}', "schema version 99"),
        ('{"schema": 1, "kind": "plan"}', "unknown document kind"),
        (
            '{"schema": 1, "kind": "layout", "instance": "x", "role": "boss", "world_size": 1, "meshes": [], '
            '"shardings": [], "tensors": []}',
            "role",
        ),
        (
            '{"schema": 1, "kind": "layout", "instance": "x", "role": "trainer", "world_size": 1, '
            '"meshes": [{"name": "m", "dims": [["tp", 1]]}], "shardings": [{"mesh": "m", "place": []}], '
            '"tensors": [["w", [4], "float32", 3]]}',
            "out of range",
        ),
        (
            '{"schema": 1, "kind": "layout", "instance": "x", "role": "trainer", "world_size": 1, '
            '"meshes": [{"name": "m", "dims": [["tp", 1]]}], '
            '"shardings": [{"mesh": "m", "place": [["tp", {"exec": 1}]]}], '
            '"tensors": [["w", [4], "float32", 0]]}',
            "unknown placement",
        ),
        (
            '{"schema": 1, "kind": "layout", "instance": "x", "role": "trainer", "world_size": 2, '
            '"meshes": [{"name": "m", "dims": [["tp", 1]]}], "shardings": [], "tensors": []}',
            "has 1 ranks",
        ),
        ('{"schema": 1, "kind": "tensor", "tensor": ["w", [true], "float32"]}', "integers"),
    ],
)
def test_malformed_documents_raise_schema_error(doc, message):
    with pytest.raises(SchemaError, match=message):
        loads_json(doc)


def test_pickle_payloads_are_rejected_not_executed():
    class Boom:
        def __reduce__(self):
            return (exec, ("raise SystemExit('executed!')",))

    payload = pickle.dumps(Boom())
    with pytest.raises(SchemaError):
        loads_json(payload)
    with pytest.raises(SchemaError):
        loads_msgpack(payload)


def test_layouts_alike_but_for_their_instance_are_decoded_once_and_nothing_else_is_taken_for_them():
    from conftest import MODELS

    from awex.meta import canonical_tensors, load_config
    from awex.meta.layouts import VllmParallel, vllm_layout
    from awex.meta.serialize import KNOWN_LAYOUTS, layout_from_wire

    tensors = canonical_tensors(load_config(MODELS / "qwen2-tiny.json"))
    a = vllm_layout(tensors, VllmParallel(tp=2), instance="vllm-0")
    known: dict = {}
    first = layout_from_wire(to_wire(a), known)
    twin = to_wire(a.renamed("vllm-7"))
    got = layout_from_wire(twin, known)
    assert got == a.renamed("vllm-7") and got.instance == "vllm-7"
    assert got.tensors is first.tensors  # the table decoded once, shared
    # a document that differs anywhere but the name is decoded on its own
    wider = to_wire(vllm_layout(tensors, VllmParallel(tp=4), instance="vllm-8"))
    assert layout_from_wire(wider, known) == vllm_layout(tensors, VllmParallel(tp=4), instance="vllm-8")
    changed = json.loads(json.dumps(twin))
    changed["tensors"][0][1][0] += 1  # one tensor's shape
    assert layout_from_wire(changed, known).tensors[0].spec.shape == tuple(changed["tensors"][0][1])
    # a twin whose name is not a name is refused, as without the cache
    for bad in (5, "", None):
        with pytest.raises(SchemaError):
            layout_from_wire({**twin, "instance": bad}, known)
    # the most recent ones are kept (documents that differ in a field the decoder does not read)
    for i in range(KNOWN_LAYOUTS + 3):
        layout_from_wire({**twin, "note": i}, known)
    assert len(known) == KNOWN_LAYOUTS
