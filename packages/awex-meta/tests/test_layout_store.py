"""Layouts by content (``awex.meta.layout_store``): engines alike publish one tensor table; a rank reads each distinct
table once, however many engines share it; a table that does not match its digest, or a malformed reference, is
refused; a full layout under the reference's key (an older publisher) still reads."""

from __future__ import annotations

import pytest

from awex.meta import canonical_tensors
from awex.meta.client import MetaClient
from awex.meta.errors import MetaServerError
from awex.meta.layout_store import table_of
from awex.meta.layouts import hf_layout
from awex.meta.serialize import layout_to_wire
from awex.meta.server import start_embedded

CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 256,
}


@pytest.fixture(scope="module")
def server():
    with start_embedded() as s:
        yield s


def _layouts(*names: str):
    specs = canonical_tensors(CONFIG)
    return [hf_layout(specs, "inference", name) for name in names]


def test_engines_alike_share_one_table_read_once(server, monkeypatch):
    c = MetaClient(server.address, job="alike", timeout=5)
    for layout in _layouts("vllm-0", "vllm-1", "vllm-2"):
        c.publish_layout(layout)
    assert [k for k in c.keys("tables/")] == [f"tables/{table_of(_layouts('x')[0])[0]}"]
    reader = MetaClient(server.address, job="alike", timeout=5)
    asked: list[str] = []
    get = MetaClient.get
    monkeypatch.setattr(
        MetaClient, "get", lambda self, key, timeout=None: (asked.append(key), get(self, key, timeout))[1]
    )
    got = [reader.fetch_layout(f"vllm-{i}") for i in range(3)]
    assert [g.instance for g in got] == ["vllm-0", "vllm-1", "vllm-2"]
    assert got[1].tensors == got[0].tensors and got[1] == _layouts("vllm-1")[0]
    assert sum(k.startswith("tables/") for k in asked) == 1  # the table once, three references


def test_a_table_that_does_not_match_its_digest_is_refused(server):
    c = MetaClient(server.address, job="forged", timeout=5)
    layout = _layouts("vllm-0")[0]
    c.publish_layout(layout)
    digest, table = table_of(layout)
    c.put(f"tables/{digest}", dict(table, world_size=table["world_size"] + 1))  # altered under its digest
    with pytest.raises(MetaServerError, match="does not match its digest"):
        MetaClient(server.address, job="forged", timeout=5).fetch_layout("vllm-0")


@pytest.mark.parametrize(
    "ref",
    [
        {"kind": "layout-ref", "instance": "other", "table": "0" * 64},
        {"kind": "layout-ref", "instance": "vllm-0", "table": "../../x"},
        {"kind": "layout-ref", "instance": "vllm-0"},
    ],
)
def test_a_malformed_reference_is_refused(server, ref):
    c = MetaClient(server.address, job="refs", timeout=5)
    c.put("layouts/current/vllm-0", ref)
    with pytest.raises(MetaServerError, match="malformed"):
        MetaClient(server.address, job="refs", timeout=5).fetch_layout("vllm-0")


def test_a_full_layout_from_an_older_publisher_still_reads(server):
    c = MetaClient(server.address, job="older", timeout=5)
    layout = _layouts("vllm-0")[0]
    c.put("layouts/current/vllm-0", layout_to_wire(layout))
    assert c.fetch_layout("vllm-0") == layout
