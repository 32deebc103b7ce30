"""Closing a reader's or writer's session releases what syncing holds and refuses further syncs; the sync group
is left alone (an NCCL shutdown is collective: a closing rank must not wait for its peers)."""

import socket

import pytest
import torch

from awex.engines.session import IpcState, SyncManifest, SyncSession
from awex.transport import create_sync_group
from awex.transport.ipc import MappedShards


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_close_drops_plan_executors_and_opened_ipc_memory_once():
    session = SyncSession(None, "vllm-0", 0, device=torch.device("cpu"))  # no client: close must not need one
    group = session._group = create_sync_group(0, 1, "127.0.0.1", _port(), backend="gloo", timeout=10)
    opened = MappedShards({}, [])
    opened._aliases[((0, 1 << 20), 1)] = None  # a region another GPU could not map (nothing to unmap)
    session._ipc = IpcState(opened={("trainer", 0): (1, opened)}, executor=object(), plan=object())
    session._executor, session._plan, session._key = object(), object(), ("key",)
    state = session._ipc
    session.close()
    assert session.closed and session._group is group  # untouched: no collective teardown
    assert session._executor is None and session._plan is None and session._key is None
    assert session._ipc is not state and not session._ipc.opened and session._ipc.executor is None
    assert not opened._aliases  # second mappings of the trainer's memory released
    session.close()  # idempotent
    manifest = SyncManifest("v1", ("trainer",), ("vllm-0",), "127.0.0.1", 1)
    with pytest.raises(RuntimeError, match="closed"):
        session.transfer(manifest, opened, timeout=1.0)
