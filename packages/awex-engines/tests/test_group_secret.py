"""A p2p version's sync group is formed with a secret derived from the version channel's key (which the channel never
carries), so every member proves it is one of the plan's ranks (``awex.transport.group_auth``)."""

from __future__ import annotations

import pytest
import torch
from test_fencing import _reader
from test_version_signals import TENSORS, sync, tensors, views

import awex.transport.group as group
from awex.engines.sync.manifest import group_secret
from awex.engines.writer import WeightsWriter
from awex.meta.client import MetaClient
from awex.meta.layouts import hf_layout
from awex.meta.server import start_embedded


@pytest.fixture
def server():
    with start_embedded() as s:
        yield s


def test_a_p2p_group_is_formed_with_the_plans_secret(server, monkeypatch):
    secrets: list[str] = []
    create = group.create_sync_group

    def recorded(*args, **kwargs):
        secrets.append(kwargs.get("secret", ""))
        return create(*args, **kwargs)

    monkeypatch.setattr("awex.transport.p2p.transport.create_sync_group", recorded)
    sent, got = tensors(1.0), tensors(-1.0)
    client = MetaClient(server.address, job="signals", timeout=30)
    writer = WeightsWriter(client, hf_layout(TENSORS, "trainer", "hf-out"), 0, views(sent), transport="p2p", timeout=30)
    reader = _reader(server, got, timeout=30)
    sync(writer, reader, "v1")
    assert all(torch.equal(got[n], sent[n]) for n in sent)
    channel_secret = writer._announcer._channel.secret
    assert secrets == [group_secret(channel_secret)] * 2  # both ranks, the same proof
    assert secrets[0] and channel_secret not in secrets[0]
    writer.close()
    reader.close()


def test_no_channel_no_proof():
    assert group_secret(None) == group_secret("") == ""
    assert group_secret("a" * 16) != group_secret("b" * 16)
