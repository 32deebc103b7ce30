"""One-sided reads over registered memory, on Mooncake's transfer engine: RDMA where the host has RDMA NICs, TCP
where it has none (the same code, end to end).

Each sender packs a version's bytes once into a buffer laid out by the plan (:mod:`awex.transport.pull.staging`),
registered with the transfer engine once per plan; its descriptor (engine address, buffer address and size, plan
digest) goes out through the MetaServer. Per version the sender fills the buffer and says ready; each receiver
reads exactly the byte ranges it needs from every sender at once (one batch per sender, adjacent ranges merged)
into a registered buffer of its own, then copies them into its views in place, and reports its outcome; the
sender changes nothing until every receiver did. Receivers read rather than senders write: reading fits the
ready-then-pull protocol every one-host transport uses (one signal per version); a write would need a second one
(the receiver's consent) per version. Which is faster on a real RDMA fabric has not been measured.

A descriptor is checked against the receiver's own plan (digest, sync rank, size) before any byte moves; every
read is waited for until the sync's deadline. A sender killed mid-version fails its receivers' reads at once
(connection refused or reset); a frozen one, at the deadline.

Memory: CPU views use a host buffer. GPU views (GPUDirect RDMA, a CUDA buffer registered with the NICs) need
Mooncake's CUDA build and RDMA NICs: :func:`staging_buffer` is the one place that differs, and it is not
verified here (no RDMA NIC on the machines this was built on).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import threading
import time
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch

from awex.meta import Plan
from awex.meta.errors import AwexError, AwexValueError
from awex.transport.base import PeerLink, Setup, TransferError, TransferStats, TransferTimeout, timed
from awex.transport.net import local_address
from awex.transport.pull.base import PullTransport
from awex.transport.pull.staging import ALIGN, RegionKey, empty_copies, fill_copies, segment_layout
from awex.transport.shards import LocalShards

log = logging.getLogger("awex.transport")

PROTOCOL_ENV = "AWEX_RDMA_PROTOCOL"  # "rdma" or "tcp"; default: rdma where the host has an active RDMA port
HOSTNAME_ENV = "AWEX_RDMA_HOSTNAME"  # the address peers reach this process's transfer engine at


class RdmaUnavailable(AwexError, RuntimeError):
    """Mooncake's transfer engine cannot be used in this process (not installed, or it failed to start)."""


class _Engine:
    """This process's Mooncake transfer engine (one per process, shared by every sync), its address, and what it
    has registered."""

    _lock = threading.Lock()
    _instance: _Engine | None = None

    def __init__(self, hostname: str, protocol: str):
        os.environ.setdefault("GLOG_minloglevel", "1")  # Mooncake's per-connection INFO lines: only warnings
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise RdmaUnavailable(
                "transport 'rdma' needs Mooncake's transfer engine: pip install 'awex-transport[rdma]' "
                "(CUDA hosts) or 'awex-transport[rdma-cpu]' (hosts without CUDA), and Debian's libibverbs1 "
                f"({e})"
            ) from e
        self.engine = TransferEngine()
        rc = self.engine.initialize(hostname, "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            raise RdmaUnavailable(f"Mooncake's transfer engine failed to start on {hostname} over {protocol} ({rc})")
        self.hostname, self.protocol = hostname, protocol
        self.address = f"{hostname}:{self.engine.get_rpc_port()}"
        log.info("Mooncake transfer engine at %s over %s", self.address, protocol)

    @classmethod
    def get(cls, hostname: str, protocol: str) -> _Engine:
        with cls._lock:
            engine = cls._instance
            if engine is None:
                engine = cls._instance = _Engine(hostname, protocol)
            elif (engine.hostname, engine.protocol) != (hostname, protocol):
                log.warning(
                    "Mooncake's transfer engine runs at %s over %s already; not starting another at %s over %s",
                    engine.address,
                    engine.protocol,
                    hostname,
                    protocol,
                )
            return engine

    def register(self, buffer: torch.Tensor) -> None:
        if buffer.numel() and self.engine.register_memory(buffer.data_ptr(), buffer.numel()) != 0:
            raise TransferError(f"could not register {buffer.numel()} bytes with the transfer engine")

    def unregister(self, buffer: torch.Tensor) -> None:
        if buffer.numel():
            self.engine.unregister_memory(buffer.data_ptr())


def local_hostname(peer_host: str, peer_port: int) -> str:
    """The address other hosts reach this process at: ``AWEX_RDMA_HOSTNAME``, else this host's address on the route
    to ``peer_host`` (the sync's rendezvous host)."""
    return os.environ.get(HOSTNAME_ENV) or local_address(peer_host, peer_port)


def default_protocol() -> str:
    """``AWEX_RDMA_PROTOCOL``, else ``rdma`` where this host has an active RDMA port, else ``tcp``."""
    given = os.environ.get(PROTOCOL_ENV)
    if given:
        if given not in ("rdma", "tcp"):
            raise AwexValueError(f"{PROTOCOL_ENV}={given!r}: use 'rdma' or 'tcp'")
        return given
    from awex.meta.rdma_devices import active_ports

    return "rdma" if active_ports() else "tcp"


def staging_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """The registered buffer of a rank: host memory for CPU views; for CUDA views, device memory that the NICs
    read and write directly (GPUDirect RDMA; needs Mooncake's CUDA build and RDMA NICs, unverified here)."""
    return torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)[:nbytes]


@dataclass(frozen=True)
class BufferInfo:
    """A sender's registered buffer as published: checked against the receiver's own plan before use."""

    address: str  # the sender's transfer engine, "host:port"
    base: int  # the buffer's address in the sender's process
    nbytes: int
    digest: str
    rank: int

    def to_wire(self) -> dict[str, Any]:
        return {
            "address": self.address,
            "base": self.base,
            "nbytes": self.nbytes,
            "digest": self.digest,
            "rank": self.rank,
        }

    @classmethod
    def from_wire(cls, doc: Any, plan: Plan, peer: int) -> BufferInfo:
        if not isinstance(doc, Mapping) or set(doc) != {"address", "base", "nbytes", "digest", "rank"}:
            raise AwexValueError(f"malformed RDMA buffer record: {str(doc)[:200]}")
        address, base, nbytes, digest, rank = (doc[k] for k in ("address", "base", "nbytes", "digest", "rank"))
        if not isinstance(address, str) or not isinstance(digest, str):
            raise AwexValueError("malformed RDMA buffer record: address and digest must be strings")
        for value in (base, nbytes, rank):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise AwexValueError("malformed RDMA buffer record: base, nbytes and rank must be integers >= 0")
        host, sep, port = address.rpartition(":")
        try:
            ipaddress.ip_address(host.strip("[]"))
            ok = sep and 0 < int(port) < 65536
        except ValueError:
            ok = False
        if not ok:
            raise AwexValueError(f"malformed RDMA buffer record: {address!r} is not an IP address and port")
        if digest != plan.digest or rank != peer:
            raise AwexValueError(
                f"the RDMA buffer of sync rank {rank} was laid out for plan {digest[:12]}, not for this rank's plan "
                f"{plan.digest[:12]} and sync rank {peer}"
            )
        expected = segment_layout(plan, peer)[1]
        if nbytes != expected:
            raise AwexValueError(
                f"the RDMA buffer of sync rank {peer} holds {nbytes} bytes; the plan puts {expected} there"
            )
        return cls(address, base, nbytes, digest, rank)


class RdmaSender:
    """A sender's registered buffer and the copies that fill it, built once per plan."""

    def __init__(self, plan: Plan, rank: int, shards: LocalShards, engine: _Engine):
        self.plan, self.rank, self.engine = plan, rank, engine
        self.buffer = staging_buffer(segment_layout(plan, rank)[1], shards.device)
        engine.register(self.buffer)
        self.copies = fill_copies(plan, rank, shards, self.buffer)
        self.bytes_sent = sum(s.bucket.nbytes for s in plan.schedule(rank) if s.op == "send")

    def info(self) -> BufferInfo:
        return BufferInfo(self.engine.address, self.buffer.data_ptr(), self.buffer.numel(), self.plan.digest, self.rank)

    def wire(self) -> dict[str, Any]:
        return self.info().to_wire()

    def fill(self) -> TransferStats:
        started = time.monotonic()
        for copy in self.copies:
            copy()
        if self.buffer.device.type == "cuda":
            torch.cuda.current_stream(self.buffer.device).synchronize()
        return TransferStats(bytes_sent=self.bytes_sent, buckets=len(self.copies), seconds=time.monotonic() - started)

    def close(self) -> None:
        self.copies = []
        self.engine.unregister(self.buffer)


def read_ranges(
    plan: Plan, rank: int
) -> tuple[dict[int, list[tuple[int, int, int]]], dict[int, dict[RegionKey, int]], int]:
    """A receiver's reads: per sender, ``(local offset, remote offset, nbytes)`` with adjacent ranges merged; where
    each region lands in the receiver's buffer (per sender); the buffer's size. Pure function of the plan."""
    remote = {}
    reads: dict[int, list[tuple[int, int, int]]] = {}
    local: dict[int, dict[RegionKey, int]] = {}
    pos = 0
    for step in plan.schedule(rank):
        if step.op != "recv":
            continue
        if step.peer not in remote:
            remote[step.peer] = segment_layout(plan, step.peer)[0]
        here = local.setdefault(step.peer, {})
        for t in step.bucket.transfers:
            key = (t.tensor, t.offsets, t.sizes)
            if key in here:
                continue
            there = remote[step.peer][key]
            ranges = reads.setdefault(step.peer, [])
            last = ranges[-1] if ranges else None
            if last is not None and last[0] + last[2] == pos and last[1] + last[2] == there:
                ranges[-1] = (last[0], last[1], last[2] + t.nbytes)  # adjacent on both sides: one read
            else:
                pos = -(-pos // ALIGN) * ALIGN
                ranges.append((pos, there, t.nbytes))
            here[key] = pos
            pos += t.nbytes
    return reads, local, pos


class RdmaReceiver:
    """A receiver's registered buffer, its reads from every sender and the copies into its views, built once per
    plan (and again when a sender's buffer changed)."""

    def __init__(self, plan: Plan, rank: int, shards: LocalShards, engine: _Engine, senders: Mapping[int, BufferInfo]):
        self.plan, self.rank, self.engine = plan, rank, engine
        reads, local, nbytes = read_ranges(plan, rank)
        missing = sorted(set(reads) - set(senders))
        if missing:
            raise AwexValueError(f"sync rank {rank}: no RDMA buffer of sync rank(s) {missing}")
        self.buffer = staging_buffer(nbytes, shards.device)
        engine.register(self.buffer)
        base = self.buffer.data_ptr()
        self.reads = [
            (
                peer,
                senders[peer].address,
                [base + lo for lo, _, _ in ranges],
                [senders[peer].base + ro for _, ro, _ in ranges],
                [n for _, _, n in ranges],
            )
            for peer, ranges in sorted(reads.items())
        ]
        self.copies = empty_copies(plan, rank, shards, {peer: (self.buffer, offs) for peer, offs in local.items()})
        self.bytes_received = sum(s.bucket.nbytes for s in plan.schedule(rank) if s.op == "recv")
        self._inflight: list[threading.Thread] = []

    def run(self, deadline: float) -> TransferStats:
        """Read from every sender at once (one blocking batch per sender, each on its own thread: the engine's
        per-batch status only tells when its first range arrived), then copy into the views."""
        started = time.monotonic()
        if any(t.is_alive() for t in self._inflight):
            raise TransferError(f"sync rank {self.rank}: reads of an earlier version are still in flight")
        results: dict[int, int] = {}
        engine = self.engine.engine

        def read(peer: int, address: str, local: list[int], remote: list[int], lengths: list[int], buffer) -> None:
            results[peer] = engine.batch_transfer_sync_read(address, local, remote, lengths)

        self._inflight = [
            threading.Thread(target=read, args=(*r, self.buffer), name=f"awex-rdma-read-{r[0]}", daemon=True)
            for r in self.reads
        ]
        for thread in self._inflight:
            thread.start()
        for thread in self._inflight:
            thread.join(max(0.0, deadline - time.monotonic()))
        late = sorted(peer for (peer, *_), t in zip(self.reads, self._inflight) if t.is_alive())
        if late:
            raise TransferTimeout(f"sync rank {self.rank}: reads from sync rank(s) {late} not done before the deadline")
        for peer, address, *_ in self.reads:
            if results.get(peer) != 0:
                raise TransferError(
                    f"sync rank {self.rank}: reading from sync rank {peer} at {address} failed (peer gone, refused "
                    f"or timed out in the transfer engine: {results.get(peer)})"
                )
        for copy in self.copies:
            copy()
        return TransferStats(
            bytes_received=self.bytes_received, buckets=len(self.reads), seconds=time.monotonic() - started
        )

    def close(self) -> None:
        """Release the buffer's registration, unless a read into it is still in flight (a frozen sender, past the
        deadline): then the registration stays until the process ends (the reading thread holds the buffer)."""
        self.copies = []
        if any(t.is_alive() for t in self._inflight):
            log.warning("sync rank %d: a read is still in flight; its buffer stays registered", self.rank)
            return
        self.engine.unregister(self.buffer)


class RdmaTransport(PullTransport):
    """Senders publish their registered buffers once per plan and say ready per version; receivers read."""

    name = "rdma"

    def __init__(self) -> None:
        super().__init__()
        self._engine: _Engine | None = None

    def prepare(self, plan: Plan, rank: int, setup: Setup, phases: MutableMapping[str, float]) -> None:
        if self._engine is None:
            with timed(phases, "engine"):
                self._engine = _Engine.get(local_hostname(setup.host, setup.port), default_protocol())
        super().prepare(plan, rank, setup, phases)

    def _new_sender(self, plan: Plan, rank: int, shards: LocalShards) -> RdmaSender:
        return RdmaSender(plan, rank, shards, self._engine)

    def _send(self, link: PeerLink, deadline: float, phases: MutableMapping[str, float]) -> TransferStats:
        with timed(phases, "pack"):
            stats = self.sender.fill()
        with timed(phases, "ready"):
            link.ready(self.generation)
        return stats

    def _descriptor(self, wire: Any, plan: Plan, sender: int) -> BufferInfo:
        return BufferInfo.from_wire(wire, plan, sender)

    def _new_receiver(
        self, plan: Plan, rank: int, shards: LocalShards, descriptors: Mapping[int, BufferInfo]
    ) -> RdmaReceiver:
        return RdmaReceiver(plan, rank, shards, self._engine, descriptors)

    def _receive(self, link: PeerLink, deadline: float) -> TransferStats:
        return self.receiver.run(deadline)

    @property
    def held_bytes(self) -> int:
        side = self.sender or self.receiver
        return side.buffer.numel() if side is not None else 0
