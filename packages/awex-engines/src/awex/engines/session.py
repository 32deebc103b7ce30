"""One sync between named engine instances: the manifest both sides agree on, and the steady-state cache.

Per weight version the trainer's first rank publishes a :class:`SyncManifest` (which instances send and
receive, where the sync group meets, wave size, deadline). Every rank of every instance then fetches the
manifest and the layouts, computes the plan itself, and proves through the MetaServer that all ranks computed
the same plan before any byte moves. Plans, process groups, staging buffers and every copy's views are built
once and reused while the manifest's layouts and rendezvous do not change (steady state). CUDA views sync over
NCCL, CPU views over gloo.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Sequence

from awex.engines.board import HostBoard, host_identity
from awex.engines.channel import ChannelError, VersionChannel
from awex.meta import Layout, Plan, PlanOptions, plan_transfers
from awex.meta.client import MetaClient
from awex.meta.transport_choice import TransportError, choose_transport, unreachable
from awex.transport import LocalShards
from awex.transport.base import Setup, TransferError, TransferStats, Transport
from awex.transport.registry import TRANSPORTS, make_transport
from awex.transport.shm import SEGMENT_DIR, alive, start_time

Region = tuple[str, tuple[int, ...], tuple[int, ...]]  # (canonical tensor, offsets, sizes)

log = logging.getLogger("awex.engines")

LIVENESS_SECONDS = 1.0  # a receiver waiting for senders checks this often that those on its host still run


@dataclass(frozen=True)
class SyncManifest:
    """What one weight version's sync involves. Published by the trainer at ``sync/<version>``."""

    version: str
    sources: tuple[str, ...]
    destinations: tuple[str, ...]
    host: str
    port: int
    wave_bytes: int = 256 << 20
    timeout: float = 300.0
    # "p2p": NCCL on CUDA, gloo on CPU; "ipc": CUDA engines on one host (sharing GPUs or not), receivers pull
    # from the trainers' memory with their copy engines (fastest where no region goes to several instances);
    # "shm": ranks on one host, CPU views; senders write each version once into shared memory, receivers copy
    # out (awex.transport.shm); "auto": every rank publishes its device and all choose the same
    # (awex.meta.transport_choice)
    transport: str = "p2p"
    allow_cast: tuple[str, ...] = ()  # glob patterns of tensors that may be narrowed to the receiver's dtype
    refresh_by_wave: bool = False  # the senders derive what they send wave by wave (FP8 on the fly): for "auto"
    channel: str | None = None  # the version channel ("host:port", awex.engines.channel) and its key secret
    channel_secret: str | None = None
    seq: int = 0  # the writer's count of versions written (signals on the host board carry it)
    board: str | None = None  # the host board (awex.engines.board) and the host it is on
    board_host: str | None = None

    def to_json(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["sources"] = list(self.sources)
        d["destinations"] = list(self.destinations)
        d["allow_cast"] = list(self.allow_cast)
        for name in ("channel", "channel_secret", "board", "board_host"):
            if d[name] is None:
                del d[name]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SyncManifest:
        try:
            return cls(
                version=str(d["version"]),
                sources=tuple(d["sources"]),
                destinations=tuple(d["destinations"]),
                host=str(d["host"]),
                port=int(d["port"]),
                wave_bytes=int(d["wave_bytes"]),
                timeout=float(d["timeout"]),
                transport=str(d.get("transport", "p2p")),
                allow_cast=tuple(str(p) for p in d.get("allow_cast", ())),
                refresh_by_wave=bool(d.get("refresh_by_wave", False)),
                channel=_channel_address(d.get("channel")),
                channel_secret=_channel_secret(d),
                seq=_count(d.get("seq", 0)),
                board=_optional_str(d.get("board")),
                board_host=_optional_str(d.get("board_host")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed sync manifest: {e}") from None

    def renamed(self, version: str, seq: int) -> SyncManifest:
        """This manifest for another version of the same writer (its fields already checked, not again)."""
        other = object.__new__(SyncManifest)
        other.__dict__.update(self.__dict__, version=version, seq=seq)
        return other

    def rendezvous(self) -> tuple:
        return (self.host, self.port, self.sources, self.destinations, self.transport)


def _channel_address(value: Any) -> str | None:
    if value is None:
        return None
    host, _, port = str(value).rpartition(":")
    if not host or not 0 < int(port) < 65536:
        raise ValueError(f"channel address {value!r} is not host:port")
    return f"{host}:{int(port)}"


def _channel_secret(d: dict) -> str | None:
    secret = d.get("channel_secret")
    if d.get("channel") is None:
        return None
    if not isinstance(secret, str) or not 16 <= len(secret) <= 128 or not secret.isalnum():
        raise ValueError("a channel needs its secret (16 to 128 letters and digits)")
    return secret


def _count(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 40:
        raise ValueError(f"{value!r} is not a version count")
    return value


def _optional_str(value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or len(value) > 1024):
        raise ValueError(f"{str(value)[:80]!r} is not a short string")
    return value


def manifest_key(version: str) -> str:
    return f"sync/{version}"


def version_records(version: str) -> tuple[list[str], list[str]]:
    """The MetaServer records one weight version leaves behind: exact names and prefixes (keys and agreements),
    for ``MetaClient.forget`` once nobody needs them."""
    return (
        [manifest_key(version), f"applied/{version}"],
        [
            f"plan/{version}/",
            f"ipc-ready/{version}/",
            f"shm-ready/{version}/",
            f"validation/{version}/",
            f"devices/{version}/",
            f"received/{version}/",
            f"outcome/{version}/",
        ],
    )


def outcome_key(manifest: SyncManifest, instance: str, local_rank: int) -> str:
    """Where a receiving rank's outcome of one attempt at a version goes (the writer's count names the attempt:
    a retry of a failed version never meets the first attempt's records)."""
    return f"outcome/{manifest.version}/{manifest.seq}/{instance}:{local_rank}"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Phases(dict):
    """Seconds spent in each named phase of one sync (``phases("plan")`` as a context manager adds to it)."""

    @contextmanager
    def __call__(self, name: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self[name] = self.get(name, 0.0) + time.perf_counter() - started


@dataclass
class Places:
    """Where a sync's ranks run (:meth:`SyncSession._devices`)."""

    devices: list[tuple[str, int, str]] = field(default_factory=list)  # (instance, local rank, host/GPU-uuid)
    reach: dict[tuple[str, int], list[str]] = field(default_factory=dict)  # devices each CUDA rank reads
    hosts: set[str] = field(default_factory=set)
    processes: dict[tuple[str, int], tuple[str, int, int | None]] = field(default_factory=dict)  # host, pid, start
    shm_ok: bool = False  # every rank a CPU rank copying in place, all on one host with a writable /dev/shm


@dataclass
class SyncSession:
    """One rank's side of the sync: caches what does not change between versions.

    Layouts are fetched once per session: an engine whose layout changes (resharding, a new instance) makes a
    new writer or reader.
    """

    client: MetaClient
    instance: str
    local_rank: int
    _key: tuple | None = None
    _plan: Plan | None = None
    device: object = None  # torch.device of this rank's views: cuda -> NCCL, cpu -> gloo
    _layouts: dict[str, Layout] = field(default_factory=dict)
    _transports: dict[str, Transport] = field(default_factory=dict)  # made once per name, kept while open
    device_key: str | None = None  # physical device ("host/GPU-uuid"); from `device` when None and on CUDA
    transport: str | None = None  # what the current plan runs on (the manifest's, or auto's choice)
    device_reach: tuple[str, ...] | None = None  # devices this rank reads over CUDA IPC; found out when None
    closed: bool = False
    phases: Phases = field(default_factory=Phases)  # seconds per phase of the last transfer
    channel: VersionChannel | None = None  # the sync's version channel (per-version signals), once known
    board: HostBoard | None = None  # the sync's host board, when this rank is on the writer's host
    signals: str = "meta"  # where this plan's per-version signals go: "board", "channel" or "meta"
    touched: bool = False  # a receiver: the last transfer began moving bytes into its views
    _signals: str = "meta"  # what every rank can use, as the last device exchange found
    _parsed: tuple[dict, SyncManifest] | None = None  # the last manifest read (with version and count blanked)
    _outcomes_after: float = 0.0  # a trainer's last wait for the receivers' outcomes (seconds)
    _last_attempt: tuple[str | None, str, int] | None = None  # (channel, version, count) this rank took part in
    _processes: dict[tuple[str, int], tuple[str, int, int | None]] = field(default_factory=dict)  # of the plan's ranks

    def close(self) -> None:
        """End this rank's part in syncing (idempotent): drop the plan and every transport's state (executors,
        staging, segments, the other processes' memory opened over CUDA IPC). A receiver must close (or exit)
        before the trainer processes whose memory it opened exit: PyTorch counts those references in memory the
        trainer owns. A sync group is dropped, not shut down (shutting NCCL down is collective, and a closing
        rank must not wait for peers that are not closing)."""
        if self.closed:
            return
        self.closed = True
        self._plan = self._key = self.channel = None
        if self.board is not None and not self.board.owner:
            self.board.close()
        self.board = None
        transports, self._transports = list(self._transports.values()), {}
        for transport in transports:
            transport.close()
        import gc

        gc.collect()  # views into opened memory may sit in reference cycles (executors' closures)

    def held_bytes(self) -> int:
        """Bytes of buffers this rank keeps between syncs (staging of the point-to-point executor, the bounce
        ring of the CUDA IPC executor), read from the buffers themselves."""
        return sum(t.held_bytes for t in self._transports.values())

    def steady_for(self, manifest: SyncManifest) -> bool:
        """Whether ``manifest`` needs nothing new: the same rendezvous, wave size and casts as the plan in use."""
        return (
            self._plan is not None
            and self._key is not None
            and self._key[:3] == (manifest.rendezvous(), manifest.wave_bytes, manifest.allow_cast)
        )

    def fetch_manifest(self, version: str, timeout: float) -> SyncManifest:
        """Version ``version``'s manifest: from the host board or the version channel once one is known (checking
        the MetaServer every second, in case another writer took over), else from the MetaServer. Once this rank
        took part in an attempt at ``version`` (it succeeded or failed), only a later attempt's manifest is taken
        (the writer announces a retry with a higher count)."""
        deadline = time.monotonic() + timeout
        asked = 0.0
        while True:
            manifest = self._fetch_manifest_once(version, deadline)
            if self._new_attempt(manifest):
                return manifest
            if time.monotonic() - asked >= 0.5:  # a restarted writer announces on a board and channel of its own
                asked = time.monotonic()
                key = manifest_key(version)
                if key in self.client.keys(key):
                    other = self._parse(self.client.get(key, timeout=max(0.1, min(1.0, deadline - asked))))
                    if self._new_attempt(other):
                        return self._adopt(other)
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"no new attempt at version {version!r} within {timeout:g} s (this rank took "
                    f"part in attempt {self._last_attempt[2]} already)"
                )
            time.sleep(0.002)

    def _new_attempt(self, manifest: SyncManifest) -> bool:
        last = self._last_attempt
        return last is None or (manifest.channel, manifest.version) != last[:2] or manifest.seq > last[2]

    def note_failure(self, manifest: SyncManifest | None) -> None:
        """This rank failed ``manifest``'s attempt: forget the plan and group (:meth:`reset`), and do not take that
        attempt's manifest again."""
        self.reset()
        if manifest is not None:
            self._last_attempt = (manifest.channel, manifest.version, manifest.seq)

    def _fetch_manifest_once(self, version: str, deadline: float) -> SyncManifest:
        while True:
            left = max(0.001, deadline - time.monotonic())
            try:
                if self.board is not None:
                    return self._adopt(self._parse(self.board.manifest(version, min(1.0, left))))
                if self.channel is not None:
                    return self._adopt(self._parse(self.channel.wait([f"manifest/{version}"], min(1.0, left))[0]))
            except ChannelError as e:  # its host is gone: the MetaServer has the manifest too
                log.info("%s:%d: version channel gone (%s); asking the MetaServer", self.instance, self.local_rank, e)
                self.channel = None
                continue
            except TimeoutError:  # BoardTimeout, ChannelTimeout: a writer with another channel, or none yet?
                key = manifest_key(version)
                if key in self.client.keys(key):
                    return self._adopt(self._parse(self.client.get(key, timeout=1.0)))
                if time.monotonic() >= deadline:
                    raise
                continue
            return self._adopt(self._parse(self.client.get(manifest_key(version), timeout=left)))

    def _parse(self, doc: Any) -> SyncManifest:
        """``SyncManifest.from_json``, except that a manifest differing from the last one parsed only in its version
        and count (a steady writer's) reuses that one's checked fields."""
        if isinstance(doc, dict):
            same = dict(doc, version=None, seq=None)
            last = self._parsed
            if last is not None and "version" in doc and same == last[0]:
                try:
                    return last[1].renamed(str(doc["version"]), _count(doc.get("seq", 0)))
                except ValueError as e:
                    raise ValueError(f"malformed sync manifest: {e}") from None
            manifest = SyncManifest.from_json(doc)
            self._parsed = (same, manifest)
            return manifest
        return SyncManifest.from_json(doc)

    def _adopt(self, manifest: SyncManifest) -> SyncManifest:
        """Join the manifest's version channel and host board if this rank does not use them yet."""
        if manifest.channel and (
            self.channel is None
            or self.channel.address != manifest.channel
            or self.channel.secret != manifest.channel_secret
        ):
            try:
                self.channel = VersionChannel.connect(manifest.channel, manifest.channel_secret)
            except ChannelError as e:
                log.warning(
                    "%s:%d: %s; per-version signals go through the MetaServer", self.instance, self.local_rank, e
                )
                self.channel = None
        if (
            manifest.board
            and manifest.board_host == host_identity()
            and (self.board is None or self.board.path != manifest.board)
        ):
            try:
                self.board = HostBoard.attach(manifest.board)
            except (OSError, ValueError) as e:
                log.info("%s:%d: cannot use the host board %s (%s)", self.instance, self.local_rank, manifest.board, e)
                self.board = None
        return manifest

    def physical_device(self) -> str | None:
        """This rank's physical device as ``host/GPU-uuid`` (CUDA), or ``device_key`` when set."""
        if self.device_key is None and getattr(self.device, "type", "cpu") == "cuda":
            import torch

            uuid = getattr(torch.cuda.get_device_properties(self.device), "uuid", None)
            if uuid is not None:  # without it no device is claimed: plans just do not prefer the same GPU
                self.device_key = f"{socket.gethostname()}/GPU-{uuid}"
        return self.device_key

    def reachable_devices(self) -> tuple[str, ...]:
        """The devices (``host/GPU-uuid``) whose memory this rank can read over CUDA IPC: its own and every GPU
        visible in this process with peer access from it (``device_reach`` when set). A process that sees one GPU
        (``CUDA_VISIBLE_DEVICES``) reaches only its own."""
        if self.device_reach is not None:
            return tuple(self.device_reach)
        mine = self.physical_device()
        if not mine or getattr(self.device, "type", "cpu") != "cuda":
            return (mine,) if mine else ()
        import torch

        host = mine.split("/", 1)[0]
        out = [mine]
        for i in range(torch.cuda.device_count()):
            other = torch.device("cuda", i)
            if other.index == self.device.index or not torch.cuda.can_device_access_peer(self.device, other):
                continue
            uuid = getattr(torch.cuda.get_device_properties(other), "uuid", None)
            if uuid is not None:
                out.append(f"{host}/GPU-{uuid}")
        return tuple(out)

    def _devices(
        self, version: str, names: Sequence[str], layouts: dict[str, Layout], deadline: float, in_place: bool = True
    ) -> Places:
        """Where every rank runs, through the MetaServer: its physical device and the devices it reaches (for CUDA
        IPC plans: take from the same GPU; for ``auto``: choose the transport), its host and process (shared
        memory; noticing a sender on this host that exited). Published per version (an engine restarted elsewhere
        never leaves a stale answer); a rank that cannot copy in place publishes no device."""
        mine = (self.physical_device() or "") if in_place else ""
        pid = os.getpid()
        self.client.put(
            f"devices/{version}/{self.instance}/{self.local_rank}",
            {
                "device": mine,
                "reach": list(self.reachable_devices()) if mine else [],
                "host": host_identity(),
                "pid": pid,
                "started": start_time(pid),
                "cpu": getattr(self.device, "type", "cpu") == "cpu",
                "shm": SEGMENT_DIR.is_dir() and os.access(SEGMENT_DIR, os.W_OK),
                "in_place": bool(in_place),
                "signals": [kind for kind, have in (("board", self.board), ("channel", self.channel)) if have],
            },
        )
        places = Places()
        common = {"board", "channel"}
        cpu_in_place = True
        for name in names:
            for rank in range(layouts[name].world_size):
                doc = self.client.get(f"devices/{version}/{name}/{rank}", timeout=max(0.1, deadline - time.monotonic()))
                doc = doc if isinstance(doc, dict) else {"device": doc}
                common &= set(doc.get("signals", ()))
                host = str(doc.get("host", ""))
                places.hosts.add(host)
                pid, started = doc.get("pid"), doc.get("started")
                if isinstance(pid, int) and (started is None or isinstance(started, int)):
                    places.processes[(name, rank)] = (host, pid, started)
                cpu_in_place &= doc.get("cpu") is True and doc.get("in_place") is True and doc.get("shm") is True
                key = doc.get("device")
                if key:
                    places.devices.append((name, rank, str(key)))
                    places.reach[(name, rank)] = [str(d) for d in doc.get("reach", ())]
        places.shm_ok = cpu_in_place and len(places.hosts) == 1
        # per-version signals go where every rank can see them
        self._signals = "board" if "board" in common else "channel" if "channel" in common else "meta"
        return places

    def prepare(self, manifest: SyncManifest, timeout: float, ipc_ok: bool = True) -> tuple[Plan, int, bool]:
        """Plan (or reuse the plan), agree on it with every rank, join (or reuse) the group.

        With ``transport="auto"`` the ranks also choose, all alike, between CUDA IPC and point to point
        (:attr:`transport` says which); ``ipc_ok=False``: this rank cannot take part in CUDA IPC.
        Returns the plan, this rank's sync rank, and whether anything was (re)built.
        """
        deadline = time.monotonic() + timeout
        names = (*manifest.sources, *manifest.destinations)
        layouts = {}
        phase = self.phases
        with phase("layouts"):
            for name in names:
                layouts[name] = self._layouts.get(name) or self.client.fetch_layout(
                    name, "current", timeout=max(0.1, deadline - time.monotonic())
                )
        key = (manifest.rendezvous(), manifest.wave_bytes, manifest.allow_cast, tuple(id(layouts[n]) for n in names))
        if key == self._key and self._plan is not None:
            return self._plan, self._plan.rank(self.instance, self.local_rank).rank, False
        if manifest.transport not in (*TRANSPORTS, "auto"):
            raise ValueError(f"sync {manifest.version!r}: unknown transport {manifest.transport!r}")
        with phase("devices"):  # also finds where every rank can take per-version signals (all transports)
            places = self._devices(
                f"{manifest.version}/{manifest.seq}", names, layouts, deadline, ipc_ok and manifest.transport != "p2p"
            )
        devices, reach, hosts = tuple(places.devices), places.reach, places.hosts
        self._processes = places.processes

        def plan_for(transport: str) -> Plan:
            return plan_transfers(
                [layouts[n] for n in manifest.sources],
                [layouts[n] for n in manifest.destinations],
                PlanOptions(
                    wave_bytes=manifest.wave_bytes,
                    relay=transport == "p2p",
                    allow_cast=manifest.allow_cast,
                    devices=devices if transport == "ipc" else (),
                ),
            )

        transport = manifest.transport
        plan_started = time.perf_counter()
        if transport == "auto":
            ipc_plan, p2p_plan = plan_for("ipc"), plan_for("p2p")
            choice = choose_transport(
                ipc_plan, p2p_plan, devices, manifest.refresh_by_wave, reach, shm_ok=places.shm_ok
            )
            transport = choice.transport
            plan = p2p_plan if transport == "p2p" else ipc_plan  # shm: the same plan as ipc (no relays)
            log.info(
                "%s:%d sync %s over %s: %s", self.instance, self.local_rank, manifest.version, transport, choice.reason
            )
        else:
            plan = plan_for(transport)
            blocked = unreachable(plan, devices, reach) if transport == "ipc" else []
            if transport == "shm" and len(hosts) != 1:
                names = [h.split("/")[0] for h in sorted(hosts)]
                apart = "; separate network namespaces count as hosts" if len(set(names)) < len(names) else ""
                raise TransportError(
                    f"sync {manifest.version!r} over shared memory: its ranks run on "
                    f"{len(hosts)} hosts ({', '.join(names[:4])}{apart}); use transport='p2p' or 'rdma'"
                )
            if blocked:
                raise TransportError(
                    f"sync {manifest.version!r} over CUDA IPC: "
                    + "; ".join(blocked[:8])
                    + " (make the GPUs visible to the reading processes, or use transport='p2p')"
                )
        phase["plan"] = time.perf_counter() - plan_started
        if transport == "ipc" and not ipc_ok:
            raise ValueError("CUDA IPC needs the engine's own views (in place), not per-sync receive buffers")
        me = plan.rank(self.instance, self.local_rank)
        with phase("agreement"):
            self.client.agree(
                f"plan/{manifest.version}/{manifest.seq}",
                f"{self.instance}:{self.local_rank}",
                plan.world_size,
                f"{transport}:{plan.digest}",
                timeout=max(0.1, deadline - time.monotonic()),
            )
        if transport not in self._transports:
            self._transports[transport] = make_transport(transport)
        setup = Setup(manifest.host, manifest.port, deadline, self.device, manifest.rendezvous())
        self._transports[transport].prepare(plan, me.rank, setup, phase)
        self._layouts = layouts
        self._key, self._plan, self.transport = key, plan, transport
        self.signals = self._signals
        log.info(
            "%s:%d planned %d buckets (digest %s), sync rank %d of %d",
            self.instance,
            self.local_rank,
            len(plan.schedule(me.rank)),
            plan.digest[:12],
            me.rank,
            plan.world_size,
        )
        return plan, me.rank, True

    def transfer(
        self,
        manifest: SyncManifest,
        shards: LocalShards | Callable[[Plan], LocalShards],
        timeout: float,
        refresh: Callable[[], None] | None = None,
        refresh_by_wave: Callable[[Sequence[Sequence[Region]]], Callable[[int], None]] | None = None,
    ) -> TransferStats:
        """Move this rank's share of the version; ``refresh`` / ``refresh_by_wave`` (senders): see
        ``WeightsWriter`` (per wave only over p2p; once the transport is known, before any byte moves)."""
        started = time.monotonic()
        if self.closed:
            raise RuntimeError(f"{self.instance}:{self.local_rank}: this reader or writer is closed")
        self.phases = phase = Phases()
        self.touched = False
        plan, rank, _ = self.prepare(manifest, timeout, ipc_ok=not callable(shards))
        transport = self._transports[self.transport]
        if not transport.refreshes_by_wave:
            refresh_by_wave = None
        if refresh is not None and refresh_by_wave is None:
            with phase("refresh"):
                refresh()
        if callable(shards) and transport.in_place_only:
            raise ValueError(
                f"transport {self.transport!r} copies into the engine's own views (in place), not per-sync "
                "receive buffers"
            )
        link = _PeerLink(self, manifest, plan, rank)
        stats = transport.run(shards, link, started + timeout, phase, refresh_by_wave)
        if transport.signals_ready:
            stats.seconds = time.monotonic() - started
        return stats

    # -- outcomes: a version counts as applied only when every receiving rank said so -------------------------
    def finish(self, manifest: SyncManifest, ok: bool, cause: str | None = None, partial: bool = False) -> None:
        """A receiving rank's outcome of ``manifest``'s version (after its transfer, and any apply or validation
        step): ``ok``, or failed with ``cause`` (``partial``: its weights were changed part-way). Every trainer
        rank waits for it (:meth:`await_outcomes`); over CUDA IPC it also says this rank stopped reading the
        trainers' memory. A failure's cause always goes to the MetaServer too. Never raises on a failure report
        (the sync's own error is what the caller must see)."""
        plan = self._plan
        me = None
        try:
            me = plan.rank(self.instance, self.local_rank) if plan is not None else None
        except KeyError:
            pass
        self._last_attempt = (manifest.channel, manifest.version, manifest.seq)
        doc = {"ok": ok, "cause": (cause or "")[:2000] or None, "partial": partial}
        try:
            with self.phases("done"):
                if not ok or me is None or self.signals == "meta":
                    self.client.put(outcome_key(manifest, self.instance, self.local_rank), doc)
                if me is None:
                    return
                if self.signals == "board":
                    self.board.ring(me.rank, manifest.seq, 0 if ok else 1)
                elif self.signals == "channel":
                    self.channel.put(f"outcome/{manifest.version}/{manifest.seq}/{me.instance}/{me.local_rank}", doc)
        except Exception as e:
            if ok:
                raise
            log.warning(
                "%s:%d could not report its failure of %s: %s", self.instance, self.local_rank, manifest.version, e
            )

    def await_outcomes(self, manifest: SyncManifest, deadline: float) -> dict[tuple[str, int], dict | None]:
        """A trainer rank: every receiving rank's outcome of ``manifest``'s version, waiting until ``deadline``
        (``time.monotonic()``); ``None`` for a rank that did not report by then (dead or stuck)."""
        plan = self._plan
        receivers = [r for r in plan.ranks if r.role.value != "trainer"]
        left = lambda: max(0.0, deadline - time.monotonic())  # noqa: E731
        out: dict[tuple[str, int], dict | None] = {}
        with self.phases("done"):
            if self.signals == "board":
                slots = [r.rank for r in receivers]
                waited = time.monotonic()
                try:
                    details = self.board.wait(slots, manifest.seq, left(), expect=self._outcomes_after)
                    self._outcomes_after = time.monotonic() - waited  # about as long next time
                except TimeoutError:
                    details = self.board.signalled(slots, manifest.seq)
                for r, detail in zip(receivers, details):
                    out[(r.instance, r.local_rank)] = (
                        None if detail is None else {"ok": True} if detail == 0 else self._failure_of(manifest, r)
                    )
            elif self.signals == "channel":
                keys = [f"outcome/{manifest.version}/{manifest.seq}/{r.instance}/{r.local_rank}" for r in receivers]
                try:
                    docs = self.channel.wait(keys, max(0.001, left()))
                except TimeoutError:
                    docs = [self.channel.get(k) for k in keys]
                for r, doc in zip(receivers, docs):
                    out[(r.instance, r.local_rank)] = doc if isinstance(doc, dict) else None
            else:
                for r in receivers:
                    try:
                        doc = self.client.get(outcome_key(manifest, r.instance, r.local_rank), timeout=left())
                    except TimeoutError:
                        doc = None
                    out[(r.instance, r.local_rank)] = doc if isinstance(doc, dict) else None
        return out

    def _failure_of(self, manifest: SyncManifest, rank) -> dict:
        doc = None
        try:
            doc = self.client.get(outcome_key(manifest, rank.instance, rank.local_rank), timeout=2.0)
        except Exception as e:  # the board said it failed; the cause is a detail
            log.warning("cause of %s:%d's failure unknown: %s", rank.instance, rank.local_rank, e)
        return doc if isinstance(doc, dict) and doc.get("ok") is False else {"ok": False, "cause": None}

    def reset(self) -> None:
        """After a failed sync: forget the plan, the sync group and the executors, so the next manifest (a fresh
        rendezvous) plans and joins again. The group is dropped, not shut down (a peer may be gone); an NCCL one is
        aborted first (local: its kernels waiting on a dead peer end, its watchdog stops)."""
        self._key = self._plan = None
        transport = self._transports.get(self.transport) if self.transport else None
        if transport is not None:
            transport.abort()
        self.transport = None

    def _ring_ready(self, kind: str, manifest: SyncManifest, me, generation: int) -> None:
        """A sender: this version's bytes are ready to be read (``generation``: of its export or segment)."""
        if self.signals == "board":
            self.board.ring(me.rank, manifest.seq, generation)
            return
        ready = f"{kind}-ready/{manifest.version}/{manifest.seq}/{me.instance}/{me.local_rank}"
        if self.signals == "channel":
            self.channel.put(ready, generation)
        else:
            self.client.put(ready, generation)

    def _await_ready(
        self, kind: str, manifest: SyncManifest, plan: Plan, peers: list[int], deadline: float
    ) -> list[int]:
        """A receiver: wait until every sender in ``peers`` said this version is ready (before ``deadline``); their
        generations. Every second it checks that the senders on this host still run: one that exited fails the wait
        at once instead of at the deadline (across hosts only the deadline tells)."""

        def ready(peer: int) -> str:
            src = plan.ranks[peer]
            return f"{kind}-ready/{manifest.version}/{manifest.seq}/{src.instance}/{src.local_rank}"

        def wait(keys_or_slots, timeout: float):
            if self.signals == "board":
                return self.board.wait(keys_or_slots, manifest.seq, timeout)
            if self.signals == "channel":
                return self.channel.wait([ready(p) for p in keys_or_slots], timeout)
            return [self.client.get(ready(p), timeout=timeout) for p in keys_or_slots]

        while True:
            left = deadline - time.monotonic()
            try:
                generations = wait(peers, max(0.001, min(LIVENESS_SECONDS, left)))
                break
            except TimeoutError:
                if left <= LIVENESS_SECONDS:
                    raise
                self._check_senders_alive(plan, peers, manifest)
        for peer, generation in zip(peers, generations):
            if not isinstance(generation, int) or isinstance(generation, bool) or generation < 1:
                raise ValueError(f"{ready(peer)}: {generation!r} is not an export generation")
        return list(generations)

    def _check_senders_alive(self, plan: Plan, peers: list[int], manifest: SyncManifest) -> None:
        here = host_identity()
        for peer in peers:
            src = plan.ranks[peer]
            host, pid, started = self._processes.get((src.instance, src.local_rank), (None, 0, None))
            if host == here and started is not None and not alive(pid, started):
                raise TransferError(
                    f"{self.instance}:{self.local_rank}: sender {src.instance}:{src.local_rank} (pid {pid}, this "
                    f"host) exited before its part of version {manifest.version!r} arrived"
                )

    def applied(self) -> None:
        """A sender, once every receiver applied a version (over shared memory: each has mapped this plan's
        segment, so its name can go)."""
        transport = self._transports.get(self.transport) if self.transport else None
        if transport is not None:
            transport.applied()


@dataclass
class _PeerLink:
    """What the transport of one version says between ranks (:class:`awex.transport.base.PeerLink`): descriptors
    through the MetaServer under ``<transport>/<instance>/<local rank>/<generation>``, ready signals where every
    rank can take them (host board, version channel or MetaServer)."""

    session: SyncSession
    manifest: SyncManifest
    plan: Plan
    rank: int

    def _key(self, rank: int, generation: int) -> str:
        r = self.plan.ranks[rank]
        return f"{self.session.transport}/{r.instance}/{r.local_rank}/{generation}"

    def publish(self, generation: int, doc: dict) -> None:
        client = self.session.client
        client.put(self._key(self.rank, generation), doc)
        if generation > 1:  # every receiver of the earlier versions is done with the one before
            client.delete(self._key(self.rank, generation - 1))

    def descriptor(self, peer: int, generation: int, deadline: float) -> Any:
        return self.session.client.get(self._key(peer, generation), timeout=max(0.1, deadline - time.monotonic()))

    def ready(self, generation: int) -> None:
        self.session._ring_ready(self.session.transport, self.manifest, self.plan.ranks[self.rank], generation)

    @property
    def count(self) -> int:
        return self.manifest.seq

    def check_senders(self, peers: Sequence[int]) -> None:
        self.session._check_senders_alive(self.plan, list(peers), self.manifest)

    def moving(self) -> None:
        self.session.touched = True

    def await_ready(self, peers: Sequence[int], deadline: float) -> list[int]:
        return self.session._await_ready(self.session.transport, self.manifest, self.plan, list(peers), deadline)
