"""Closing a reader's or writer's session releases what syncing holds and refuses further syncs; the sync group
is left alone (an NCCL shutdown is collective: a closing rank must not wait for its peers)."""

import socket

import pytest
import torch

from awex.engines.sync.manifest import SyncManifest
from awex.engines.sync.session import SyncSession
from awex.transport import create_sync_group
from awex.transport.ipc import IpcTransport, MappedShards
from awex.transport.p2p import P2pTransport


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_close_drops_plan_transports_and_opened_ipc_memory_once():
    session = SyncSession(None, "vllm-0", 0, device=torch.device("cpu"))  # no client: close must not need one
    p2p = P2pTransport()
    group = p2p.group = create_sync_group(0, 1, "127.0.0.1", _port(), backend="gloo", timeout=10)
    aborted = []
    group.abort = lambda: aborted.append(True)  # closing must not abort (or shut down) the group
    opened = MappedShards({}, [])
    opened._aliases[((0, 1 << 20), 1)] = None  # a region another GPU could not map (nothing to unmap)
    ipc = IpcTransport()
    ipc.opened, ipc.executor = {("trainer", 0): (1, opened, {})}, object()
    session._transports = {"p2p": p2p, "ipc": ipc}
    session._plan, session._key = object(), ("key",)
    session.close()
    assert session.closed and not aborted and p2p.group is None
    assert session._plan is None and session._key is None and not session._transports
    assert not ipc.opened and ipc.executor is None
    assert not opened._aliases  # second mappings of the trainer's memory released
    session.close()  # idempotent
    manifest = SyncManifest("v1", ("trainer",), ("vllm-0",), "127.0.0.1", 1)
    with pytest.raises(RuntimeError, match="closed"):
        session.transfer(manifest, opened, timeout=1.0)
