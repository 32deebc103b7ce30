"""What a writer asks of every version, as one frozen record (:class:`SyncOptions`) whose :meth:`~SyncOptions.check`
holds every rule about the options alone and together, before any byte moves. What a transport can do is read from
its class (``carries_delta``, ``quantizes_on_receive``, ``refreshes_by_wave`` on
:class:`~awex.transport.base.Transport`), never from a list of names here; every rank checks a manifest it reads
by the same rules (:func:`combination_error`) before it plans."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable

from awex.meta.client import seconds
from awex.meta.errors import AwexValueError
from awex.transport.registry import TRANSPORTS, transport_class


@dataclass(frozen=True)
class SyncOptions:
    """A :class:`~awex.engines.writer.WeightsWriter`'s options (see it for what each does)."""

    host: str = "127.0.0.1"  # where this writer's sync group and version channel listen
    wave_bytes: int = 256 << 20  # p2p: bytes per rank per wave
    timeout: float = 300.0  # seconds per version
    transport: str = "auto"  # a name in awex.transport.registry.TRANSPORTS, or "auto"
    allow_cast: tuple[str, ...] = ()  # globs of tensors that may narrow (fp32 -> bf16)
    refresh: Callable[[], None] | None = None  # before any byte moves: recompute derived views
    refresh_by_wave: Any = None  # p2p: the same wave by wave (awex.convert.Fp8Views.by_wave)
    keep_versions: int = 2  # versions whose MetaServer records rank 0 keeps
    delta: bool = False  # only the 16-bit words that changed since the last version
    delta_budget_bytes: int | None = None  # a delta sender: what it may keep of the last version (None: all)
    quantize_on_receive: bool | str = False  # FP8 engines on the trainer's GPUs quantise the copy; "auto": see below
    verify: bool = False  # receivers compare digests of what they got with the senders' (awex.engines.sync.verify)
    # False: after each version the writer and its receivers let go of the trainer's memory (views, CUDA IPC export
    # and mappings), so a trainer that offloads its weights frees that GPU memory; each version then opens anew
    hold_trainer_memory: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.allow_cast, (list, set, frozenset)):  # the one coercion: a list of globs is a tuple
            object.__setattr__(self, "allow_cast", tuple(self.allow_cast))

    def given(self) -> dict[str, Any]:
        """These options as a writer's keyword arguments, but ``refresh`` and ``refresh_by_wave`` where unset (a
        trainer source's own, ``WeightsWriter.from_source``, then apply)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        return {k: v for k, v in out.items() if v is not None or k not in ("refresh", "refresh_by_wave")}

    def to_wire(self) -> dict[str, Any]:
        """The options every rank of a version reads from its manifest (:data:`WIRE`), as plain data."""
        out = {name: getattr(self, name) for name in WIRE}
        out["allow_cast"] = list(self.allow_cast)
        return out

    @classmethod
    def from_wire(cls, doc: Any) -> SyncOptions:
        """Options read from a manifest: exactly the :data:`WIRE` fields, each of its type (untrusted: nothing is
        coerced); the rules between them are :meth:`check`'s, which every rank applies before it plans."""
        if not isinstance(doc, dict) or set(doc) != set(WIRE):
            keys = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
            raise AwexValueError(f"options {keys}: the writer's options are {list(WIRE)}")
        typed = {"wave_bytes": int, "timeout": (int, float), "transport": str, "allow_cast": list}
        for name, kind in typed.items():
            if not isinstance(doc[name], kind) or isinstance(doc[name], bool):
                raise AwexValueError(f"options: {name}={doc[name]!r} is not a {name} value")
        for name in ("delta", "quantize_on_receive", "verify", "hold_trainer_memory"):
            if not isinstance(doc[name], bool) and not (name == "quantize_on_receive" and doc[name] == AUTO):
                raise AwexValueError(f"options: {name}={doc[name]!r}: true or false")
        if len(doc["allow_cast"]) > 1024 or any(not isinstance(p, str) or len(p) > 1024 for p in doc["allow_cast"]):
            raise AwexValueError("options: allow_cast holds glob patterns (short strings)")
        return cls(**{**doc, "timeout": float(doc["timeout"]), "allow_cast": tuple(doc["allow_cast"])})

    def check(self) -> SyncOptions:
        """These options, or ``ValueError`` saying what to pass instead: each option alone, then together."""
        if not isinstance(self.host, str) or not self.host:
            raise AwexValueError(f"host={self.host!r}: an address every rank reaches")
        if not _whole(self.wave_bytes) or self.wave_bytes <= 0:
            raise AwexValueError(f"wave_bytes={self.wave_bytes!r}: a positive byte count")
        seconds(self.timeout, "timeout", positive=True)
        if not isinstance(self.allow_cast, tuple) or any(not isinstance(p, str) or not p for p in self.allow_cast):
            raise AwexValueError(f"allow_cast={list(self.allow_cast)!r}: glob patterns (non-empty strings)")
        if not _whole(self.keep_versions) or self.keep_versions < 1:
            raise AwexValueError("keep_versions must be at least 1")
        for flag in ("delta", "verify", "hold_trainer_memory"):
            if not isinstance(getattr(self, flag), bool):
                raise AwexValueError(f"{flag}={getattr(self, flag)!r}: True or False")
        if not isinstance(self.quantize_on_receive, bool) and self.quantize_on_receive != AUTO:
            raise AwexValueError(f"quantize_on_receive={self.quantize_on_receive!r}: True, False or {AUTO!r}")
        wrong = combination_error(self.transport, self.delta, self.quantize_on_receive, self.verify)
        if wrong:
            raise AwexValueError(wrong)
        if self.refresh_by_wave is not None and self.refresh is None:
            raise AwexValueError(
                "refresh_by_wave needs refresh too: CUDA IPC receivers read whole buffers, refreshed "
                "all at once (pass refresh=fp8.quantize, refresh_by_wave=fp8.by_wave)"
            )
        if self.quantize_on_receive == AUTO and self.refresh_by_wave is not None:
            raise AwexValueError(
                f"quantize_on_receive={AUTO!r} quantises with views of its own where the receivers cannot: give the "
                "writer the bf16 layout and views, without refresh_by_wave (awex.convert.Fp8Views)"
            )
        if self.delta and not self.hold_trainer_memory:
            raise AwexValueError(
                "delta=True sends what changed since the last version, read from the trainer's memory it holds: "
                "with hold_trainer_memory=False every version would go whole; pick one of the two"
            )
        if self.delta and self.refresh_by_wave is not None:
            raise AwexValueError("delta=True with FP8 on the fly (refresh_by_wave) is not built yet")
        budget = self.delta_budget_bytes
        if budget is not None and (not self.delta or not _whole(budget) or budget < 0):
            raise AwexValueError("delta_budget_bytes: a non-negative byte count, with delta=True")
        return self


AUTO = "auto"
"""``quantize_on_receive="auto"``: FP8 receivers quantise what they read where every one of them reads its source
on its own GPU over CUDA IPC (colocated engines: one pass over memory), and the trainer ranks quantise their bf16
weights wave by wave everywhere else (``awex.engines.sync.fp8_sender``): the ranks decide alike when they plan
(``awex.engines.sync.version_plan``). Needs the trainer's bf16 layout and views (no FP8 views of the user's own)."""

WIRE = (
    "wave_bytes",
    "timeout",
    "transport",
    "allow_cast",
    "delta",
    "quantize_on_receive",
    "verify",
    "hold_trainer_memory",
)
"""What a manifest carries of a writer's options: the rest are the writer's own (its address is the manifest's
``host``; ``refresh``, ``keep_versions`` and the delta budget stay with the senders)."""


def combination_error(transport: str, delta: bool, quantize_on_receive: bool | str, verify: bool = False) -> str | None:
    """What is wrong with a transport and the options that depend on it (writers and manifests alike), or None.
    ``auto`` chooses among every transport, so options that only some carry name one of those instead.
    ``quantize_on_receive="auto"`` goes with every transport and with verify mode (then the trainer quantises)."""
    if quantize_on_receive == AUTO:
        if delta:
            return f"delta=True with quantize_on_receive={AUTO!r} is not built yet: pick one of the two"
        quantize_on_receive = False  # what it asks of a transport: nothing (the trainer quantises where needed)
    if verify and quantize_on_receive:
        return (
            "verify=True with quantize_on_receive=True: the receivers quantise what they read, so they hold other "
            "bytes than the trainer; quantise on the sender (awex.convert.Fp8Views) to verify FP8 engines"
        )
    if transport not in (*TRANSPORTS, "auto"):
        return (
            f"unknown transport {transport!r}: use 'auto', 'p2p' (NCCL/gloo), 'ipc' (CUDA engines "
            "on one host), 'shm' (CPU engines on one host) or 'rdma' (Mooncake's transfer engine)"
        )
    cls = transport_class(transport) if transport != "auto" else None
    if delta and not (cls is not None and cls.carries_delta):
        return (
            f"delta=True runs over transport={_names('carries_delta')}, not {transport!r}: pass one of them "
            f"(delta syncs over {_names('carries_delta', False)} are not built yet)"
        )
    if delta and quantize_on_receive:
        return "delta=True with quantize_on_receive=True is not built yet: pick one of the two"
    if quantize_on_receive and not (cls is not None and cls.quantizes_on_receive):
        return (
            f"quantize_on_receive=True runs over transport={_names('quantizes_on_receive')} (receivers on the "
            f"trainer's GPUs), not {transport!r}; elsewhere quantise on the sender (awex.convert.Fp8Views)"
        )
    return None


def _names(capability: str, has: bool = True) -> str:
    """The transports whose class has (or lacks) ``capability``, quoted, in registry order: ``'p2p' or 'ipc'``."""
    names = [f"{n!r}" for n in TRANSPORTS if bool(getattr(transport_class(n), capability)) == has]
    return " or ".join(names) if has else ", ".join(names)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
