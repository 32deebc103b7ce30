"""A process group for the weight sync alone.

It has its own TCP store and is built directly (``ProcessGroupGloo`` / ``ProcessGroupNCCL`` / torch-npu's
``ProcessGroupHCCL``), so it never touches ``torch.distributed``'s default group or the engines' own groups, and a
trainer that already runs ``init_process_group`` keeps its world untouched. Rank numbers are the plan's sync-world
ranks.

NCCL errors reach the caller as exceptions, never as a killed process: PyTorch's NCCL watchdog by default takes
the whole process down when an operation fails or outlives its timeout (``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``).
A sync group is built with mode 2 (the watchdog aborts the communicator only; a value the user set is kept), its
watchdog timeout follows each sync's deadline (:meth:`SyncGroup.follow_deadline`: the deadline plus
:data:`WATCHDOG_SLACK`), and the executors abort the group themselves at the deadline, before the watchdog would.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from awex.meta.errors import AwexValueError
from awex.transport.accelerator import GROUPED, device_api
from awex.transport.base import TransferError
from awex.transport.group_auth import gather_tags, intruders
from awex.transport.net import local_address

log = logging.getLogger("awex.transport")

WATCHDOG_SLACK = 10.0  # seconds PyTorch's NCCL watchdog waits beyond a sync's deadline (ours comes first)
ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
_env_lock = threading.Lock()


# dtypes PyTorch's NCCL process group refuses ("not supported for NCCL"), sent as a dtype of the same size: point to
# point and broadcast only copy bytes, so the bytes arrive as they were (int16: delta syncs' words; FP8 tiles)
_WIRE_DTYPES = {
    torch.int16: torch.float16,
    torch.uint16: torch.float16,
    torch.bool: torch.uint8,
    torch.float8_e4m3fn: torch.uint8,
    torch.float8_e5m2: torch.uint8,
}


def on_the_wire(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a dtype NCCL sends (a view of the same bytes)."""
    wire = _WIRE_DTYPES.get(tensor.dtype)
    return tensor if wire is None else tensor.view(wire)


@dataclass
class SyncGroup:
    """A process group over the sync world, with the store that holds it together."""

    rank: int
    world_size: int
    backend: str
    process_group: dist.ProcessGroup
    store: dist.Store

    device: torch.device | None = None
    timeout: float = 60.0
    _subgroups: dict = field(default_factory=dict, repr=False)
    _watchdog: float = field(default=0.0, repr=False)  # the NCCL watchdog timeout set last (seconds)

    def follow_deadline(self, seconds: float) -> None:
        """NCCL: operations posted from now on get a watchdog timeout of ``seconds`` (this sync's deadline) plus
        :data:`WATCHDOG_SLACK`, so a sync with a longer deadline than the first is never cut short by the
        watchdog, and a shorter one is not left to it. Cheap when unchanged (the steady state)."""
        if self.backend not in GROUPED:
            return
        want = seconds + WATCHDOG_SLACK
        if abs(want - self._watchdog) < 0.5:
            return
        for pg in (self.process_group, *self._subgroups.values()):
            _set_watchdog_timeout(pg, want)
        self._watchdog = want

    def exchange(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> list:
        """Post all ``(tensor, peer)`` sends and receives at once; returns the works to wait on.

        On NCCL they form one group (``ncclGroupStart/End``), so transfers to and from different peers run
        concurrently and their order cannot deadlock; on gloo each is its own asynchronous operation. Several
        messages to one peer are matched in order (the k-th send with the peer's k-th receive; on gloo each
        gets its own tag).
        """
        pg = self.process_group
        if self.backend in GROUPED:  # NCCL and HCCL: one coalesced group
            pg._start_coalescing()  # the NCCL backend object (not the ProcessGroup wrapper) takes no device
            for tensor, peer in sends:
                pg.send([on_the_wire(tensor)], peer, 0)
            for tensor, peer in recvs:
                pg.recv([on_the_wire(tensor)], peer, 0)
            work = pg._end_coalescing()
            return [work] if work is not None else []
        works = []
        for op, items in (("send to", sends), ("recv from", recvs)):
            count: dict[int, int] = {}
            for tensor, peer in items:
                tag = count[peer] = count.get(peer, -1) + 1
                try:
                    works.append((pg.send if op == "send to" else pg.recv)([tensor], peer, tag))
                except RuntimeError as e:  # name the peer: "connection closed" alone does not say who died
                    raise RuntimeError(f"{op} rank {peer}: {e}") from e
        return works

    def subgroup(self, members: tuple[int, ...]) -> dist.ProcessGroup:
        """A process group over ``members`` (sorted sync-world ranks, this one among them; rank ``i`` in it is
        ``members[i]``), built once on the sync store. Every member must ask for the same subgroups in the same
        order (an NCCL one is initialised eagerly, like the sync group)."""
        pg = self._subgroups.get(members)
        if pg is not None:
            return pg
        if self.rank not in members or list(members) != sorted(set(members)):
            raise AwexValueError(f"rank {self.rank}: subgroup {members} must be sorted, distinct and include this rank")
        store = dist.PrefixStore("sub/" + ",".join(map(str, members)), self.store)
        wait = timedelta(seconds=self.timeout)
        me = members.index(self.rank)
        if self.backend in GROUPED:
            pg = _grouped_process_group(
                self.backend, store, me, len(members), self._watchdog or self.timeout + WATCHDOG_SLACK
            )
            _probe(
                pg, self.device, len(members), time.monotonic() + self.timeout, f"rank {self.rank}: subgroup {members}"
            )
        else:
            pg = dist.ProcessGroupGloo(store, me, len(members), wait)
        self._subgroups[members] = pg
        return pg

    def broadcast(self, members: tuple[int, ...], tensor: torch.Tensor, root: int):
        """Broadcast ``tensor`` from sync-world rank ``root`` to the other ``members`` (asynchronous: the work)."""
        options = dist.BroadcastOptions()
        options.rootRank = members.index(root)
        return self.subgroup(members).broadcast([on_the_wire(tensor)], options)

    def error(self) -> str | None:
        """NCCL: the communicator's error since it was built (``TIMEOUT``, ``COMM_ERROR``, ``REMOTE_ERROR``: the
        watchdog aborted it), else None. Checked after each sync: an aborted communicator ends its kernels early,
        so a sync whose waits all completed is not yet a sync that moved every byte."""
        if self.backend not in GROUPED:
            return None
        for pg in (self.process_group, *self._subgroups.values()):
            get = getattr(pg, "get_error", None)
            name = getattr(get(), "name", "SUCCESS") if get is not None else "SUCCESS"
            if name != "SUCCESS":
                return name
        return None

    def abort(self) -> None:
        """Abort the group after a failure (unblocks NCCL kernels waiting on a dead peer); best effort."""
        for pg in (self.process_group, *self._subgroups.values()):
            try:
                pg.abort()
            except Exception as e:  # noqa: BLE001 - aborting is a last resort; the caller raises the real error
                log.warning("aborting the sync group failed: %s", e)


def create_sync_group(
    rank: int,
    world_size: int,
    host: str,
    port: int,
    backend: str = "gloo",
    timeout: float = 60.0,
    prefix: str = "awex",
    device: torch.device | str | None = None,
    secret: str = "",
) -> SyncGroup:
    """Join the sync world: rank 0 hosts the TCP store at ``host:port``, every rank connects within ``timeout``.
    With ``secret`` every member proves it holds it once the group stands (``awex.transport.group_auth``): a process
    that took a rank's place fails the group on every rank (:class:`TransferError`).

    ``backend`` is ``"gloo"`` (CPU tensors), ``"nccl"`` (CUDA tensors on ``device``, default the current
    one) or ``"hccl"`` (Ascend NPU tensors, through torch-npu). An NCCL or HCCL group is initialised eagerly (one
    tiny all-reduce), so the first sync does not pay for it and a rank that has nothing to move cannot leave the
    others waiting for the communicator.
    """
    if not 0 <= rank < world_size:
        raise AwexValueError(f"rank {rank} outside [0, {world_size})")
    if backend not in ("gloo", *GROUPED):
        raise AwexValueError(f"unknown backend {backend!r}: use 'gloo', 'nccl' or 'hccl'")
    if backend == "hccl":
        device_api("npu")  # torch-npu is there, or an ImportError saying so, before the store is formed
    deadline = time.monotonic() + timeout
    wait = timedelta(seconds=timeout)
    try:
        if rank == 0:
            store = bound_store(host, port, wait, world_size=world_size, wait_for_workers=True)
        else:
            store = dist.TCPStore(host, port, world_size, is_master=False, timeout=wait)
    except (RuntimeError, TimeoutError, OSError) as e:  # torch raises DistStoreError (a RuntimeError) on timeouts
        raise TimeoutError(
            f"rank {rank}: could not join the sync store at {host}:{port} within {timeout:g} s: {e}"
        ) from e
    store = dist.PrefixStore(prefix, store)
    if backend == "gloo":
        try:
            pg = _gloo_process_group(store, rank, world_size, wait, host, port)
        except RuntimeError as e:  # a peer that exits while the group forms closes its connections
            raise TransferError(
                f"rank {rank}: the gloo sync group at {host}:{port} did not form (a peer closed its connection or "
                f"never came: it may have exited): {e}"
            ) from e
        if secret:
            _authenticate(pg, rank, world_size, secret, torch.device("cpu"), deadline, f"{host}:{port}")
    elif backend in GROUPED:
        kind = "cuda" if backend == "nccl" else "npu"
        dev = torch.device(device) if device is not None else torch.device(kind, device_api(kind).current_device())
        pg = _grouped_process_group(backend, store, rank, world_size, timeout + WATCHDOG_SLACK)
        _probe(pg, dev, world_size, deadline, f"rank {rank}: the {backend} sync group at {host}:{port}")
        if secret:
            _authenticate(pg, rank, world_size, secret, dev, deadline, f"{host}:{port}")
        log.info("rank %d/%d joined the %s sync group at %s:%d on %s", rank, world_size, backend, host, port, dev)
        return SyncGroup(rank, world_size, backend, pg, store, dev, timeout, _watchdog=timeout + WATCHDOG_SLACK)
    log.info("rank %d/%d joined the %s sync group at %s:%d", rank, world_size, backend, host, port)
    return SyncGroup(rank, world_size, backend, pg, store, torch.device("cpu"), timeout)


def bound_store(
    host: str, port: int, timeout: timedelta, world_size: int | None = None, wait_for_workers: bool = False
) -> dist.TCPStore:
    """A ``TCPStore`` hosted in this process that listens on ``host`` alone (port ``0``: a free one, read back
    from ``store.port``). Given only a host name, ``TCPStore`` listens on every interface of the machine; here the
    socket is bound first and handed over (the store owns it from then on and closes it when it goes)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(4096)  # a thousand ranks may connect at once (the kernel caps it at net.core.somaxconn)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    fd = sock.detach()
    ours = os.fstat(fd)
    try:
        return dist.TCPStore(
            host, port, world_size, True, timeout, wait_for_workers=wait_for_workers, master_listen_fd=fd
        )
    except BaseException:
        # closed here only if it is still our socket: a store that failed may have closed it already, and the
        # number may now be another thread's descriptor
        try:
            now = os.fstat(fd)
        except OSError:
            now = None
        if now is not None and (now.st_dev, now.st_ino) == (ours.st_dev, ours.st_ino):
            os.close(fd)
        raise


def _gloo_process_group(store, rank: int, world_size: int, wait: timedelta, host: str, port: int):
    """A gloo group whose device listens on this host's address on the route to the store (``host``), where
    peers on other hosts reach it; gloo's default (the address the machine's hostname resolves to) may be an
    interface they cannot reach. ``GLOO_SOCKET_IFNAME``, where set, chooses instead."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return dist.ProcessGroupGloo(store, rank, world_size, wait)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = wait
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address(host, port))]
    return dist.ProcessGroupGloo(store, rank, world_size, options)


@contextmanager
def _errors_abort_communicator_only() -> Iterator[None]:
    """While an NCCL process group is built: the watchdog's error handling is "abort the communicator, keep the
    process" (mode 2), unless the user chose a mode. PyTorch reads the variable once, in the constructor."""
    with _env_lock:
        if ERROR_HANDLING in os.environ:
            yield
            return
        os.environ[ERROR_HANDLING] = "2"
        try:
            yield
        finally:
            os.environ.pop(ERROR_HANDLING, None)


def _nccl_process_group(store: dist.Store, rank: int, size: int, watchdog: float) -> dist.ProcessGroup:
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timedelta(seconds=watchdog)
    with _errors_abort_communicator_only():
        return dist.ProcessGroupNCCL(store, rank, size, options)


def _grouped_process_group(backend: str, store: dist.Store, rank: int, size: int, watchdog: float):
    """An NCCL or HCCL group (``backend``) on the sync's own store."""
    return (_hccl_process_group if backend == "hccl" else _nccl_process_group)(store, rank, size, watchdog)


def _hccl_process_group(store: dist.Store, rank: int, size: int, watchdog: float) -> dist.ProcessGroup:
    """An HCCL group on the sync's own store (torch-npu's ``ProcessGroupHCCL``, like NCCL's above)."""
    device_api("npu")  # torch-npu, or an ImportError that says so
    from torch_npu._C._distributed_c10d import ProcessGroupHCCL

    options = ProcessGroupHCCL.Options()
    options._timeout = timedelta(seconds=watchdog)
    return ProcessGroupHCCL(store, rank, size, options)


def _set_watchdog_timeout(pg, seconds: float) -> None:
    setter = getattr(pg, "_set_default_timeout", None) or getattr(pg, "set_timeout", None)
    if setter is None:
        log.warning("this PyTorch cannot change an NCCL group's timeout; its watchdog keeps the first one")
        return
    setter(timedelta(seconds=seconds))


def _probe(pg, device: torch.device, size: int, deadline: float, what: str) -> None:
    """One tiny all-reduce: the communicator is built now (not in the first sync) and every member is there.
    Waited for with a deadline (an event polled, never a blocking synchronize); on timeout the group is aborted."""
    from awex.transport.deadline import wait_event

    api = device_api(device)
    probe = torch.ones(1, device=device)
    with api.device(device):
        work = pg.allreduce([probe])
        work.wait()  # the current stream waits for it; the host does not
        done = api.Event()
        done.record()

    def timed_out() -> TimeoutError:
        try:
            pg.abort()
        except Exception as e:  # noqa: BLE001 - the timeout is the error to report
            log.warning("aborting the %s group failed: %s", device.type, e)
        return TimeoutError(
            f"{what}: the first all-reduce did not finish before the deadline (a member is gone or never came)"
        )

    wait_event(done, deadline, timed_out)
    get_error = getattr(pg, "get_error", None)
    error = getattr(get_error(), "name", "SUCCESS") if get_error is not None else "SUCCESS"
    if error != "SUCCESS":
        raise RuntimeError(f"{what}: the first all-reduce failed ({error})")
    if probe.item() != size:
        raise RuntimeError(f"{what}: the first all-reduce gave {probe.item()}, expected {size}")


def _authenticate(pg, rank: int, world_size: int, secret: str, device: torch.device, deadline: float, where: str):
    """Every member's tag checked (``awex.transport.group_auth``); the group aborted and :class:`TransferError` raised
    where one is not its rank's."""
    from awex.transport.deadline import wait_event

    def wait(work) -> None:
        if device.type == "cpu":
            work.wait()
            return
        api = device_api(device)
        with api.device(device):
            work.wait()
            done = api.Event()
            done.record()
        wait_event(
            done, deadline, lambda: TimeoutError(f"rank {rank}: the sync group at {where} did not prove its members")
        )

    try:
        bad = intruders(gather_tags(pg, rank, world_size, secret, device, wait), secret)
    except RuntimeError as e:  # a member that cannot take part closes its connections
        bad, cause = [-1], e
    else:
        cause = None
    if bad:
        if device.type != "cpu":
            try:
                pg.abort()
            except Exception as e:  # noqa: BLE001 - the refusal is the error to report
                log.warning("aborting the sync group failed: %s", e)
        named = "a member" if bad == [-1] else f"rank(s) {bad}"
        raise TransferError(
            f"rank {rank}: {named} of the sync group at {where} did not prove the plan's secret (a process that is "
            f"not one of the plan's ranks joined it?); refused before any byte moved" + (f": {cause}" if cause else "")
        )
