"""A transport of one's own, registered by name (``awex.transport.register``), carries versions through the public
writer and reader: the writer's options accept its name, the manifest names it, every receiver makes it, and the
bytes arrive; ``auto`` never picks it. Here a subclass of the shared-memory transport, counting its runs."""

from __future__ import annotations

import pytest
from test_version_signals import TENSORS, sync, tensors, views

from awex.engines import WeightsReader, WeightsWriter
from awex.meta.client import MetaClient
from awex.meta.layouts import hf_layout
from awex.meta.server import start_embedded
from awex.transport import TRANSPORTS, register
from awex.transport.pull.shm import ShmTransport


class Counted(ShmTransport):
    name = "counted"
    runs = 0

    def run(self, *args, **kwargs):
        type(self).runs += 1
        return super().run(*args, **kwargs)


@pytest.fixture
def server():
    held = dict(TRANSPORTS)
    s = start_embedded()
    yield s
    s.stop()
    TRANSPORTS.clear()
    TRANSPORTS.update(held)


def test_a_registered_transport_carries_versions_through_the_public_path(server):
    register("counted", Counted)
    sent, got = tensors(3.0), tensors(-1.0)
    client = MetaClient(server.address, job="registered", timeout=60)
    writer = WeightsWriter(client, hf_layout(TENSORS, "trainer", "out"), 0, views(sent), transport="counted")
    reader = WeightsReader(client, hf_layout(TENSORS, "inference", "hf-in"), 0, views(got))
    try:
        for version, fill in (("v1", 3.0), ("v2", 4.0)):
            for t in sent.values():
                t.fill_(fill)
            sync(writer, reader, version)
            assert all(got[n].eq(fill).all() for n in got) and writer.transport_in_use == "counted"
        assert Counted.runs == 4  # two versions, each run by the writer's rank and the reader's
    finally:
        writer.close()
        reader.close()
