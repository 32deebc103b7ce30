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


def test_many_layouts_are_read_in_one_request_then_each_table_once(server, monkeypatch):
    c = MetaClient(server.address, job="many", timeout=5)
    for layout in _layouts("vllm-0", "vllm-1", "vllm-2"):
        c.publish_layout(layout)
    reader = MetaClient(server.address, job="many", timeout=5)
    asked: list[str] = []
    request = MetaClient._request
    monkeypatch.setattr(
        MetaClient,
        "_request",
        lambda self, m, path, *a, **kw: (asked.append(path), request(self, m, path, *a, **kw))[1],
    )
    got = reader.fetch_layouts(["vllm-2", "vllm-0", "vllm-1"])
    assert list(got) == ["vllm-2", "vllm-0", "vllm-1"] and got["vllm-0"] == _layouts("vllm-0")[0]
    assert len(asked) == 2  # the references in one request, the one table in another


def test_values_too_many_bytes_for_one_answer_are_not_sent():
    from awex.meta.server.config import ServerConfig
    from awex.meta.server.embedded import EmbeddedMetaServer

    with EmbeddedMetaServer("127.0.0.1", 0, ServerConfig(max_payload_bytes=1024)).start() as small:
        c = MetaClient(small.address, job="big", timeout=5)
        for i in range(8):
            c.put(f"p/{i}", {"pad": "x" * 150, "i": i})
        assert c.values("p/") is None  # 8 x ~170 bytes: more than a request may carry
        assert c.values("p/1") == {"p/1": {"pad": "x" * 150, "i": 1}}
        assert c.values("q/") == {}


def test_layouts_not_sent_at_once_or_not_published_yet_are_read_one_by_one(server, monkeypatch):
    import threading

    c = MetaClient(server.address, job="late", timeout=5)
    names = [f"vllm-{i}" for i in range(3)]
    for layout in _layouts(*names[:-1]):
        c.publish_layout(layout)
    late = threading.Timer(0.3, lambda: c.publish_layout(_layouts(names[-1])[0]))
    late.start()  # the last engine publishes after the read began: waited for
    got = MetaClient(server.address, job="late", timeout=5).fetch_layouts(names)
    late.join()
    assert [g.instance for g in got.values()] == names and got[names[-1]] == _layouts(names[-1])[0]
    monkeypatch.setattr(MetaClient, "values", lambda self, prefix: None)  # too many bytes for one answer
    assert MetaClient(server.address, job="late", timeout=5).fetch_layouts(names) == got
