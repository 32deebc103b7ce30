"""What one version is planned from and how: the key a rank's plan is kept under between versions
(:class:`PlanKey`), and the plan and transport for a manifest, the layouts and where every rank runs
(:func:`plan_version`: pure, the same on every rank)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, NamedTuple

from awex.engines.sync import places
from awex.engines.sync.manifest import SyncManifest
from awex.engines.sync.options import AUTO
from awex.meta import Fp8BlockQuant, Layout, Plan, PlanOptions, Topology, plan_transfers, quantize_layout, sender_quant
from awex.meta.transport_choice import TransportError, choose_transport, quantized_afar, unreachable


@dataclass(frozen=True)
class PlanKey:
    """What a rank's plan was made from: a manifest with the same key (and the same layouts) reuses it."""

    rendezvous: tuple
    wave_bytes: int
    allow_cast: tuple[str, ...]
    delta: bool
    quantize_on_receive: bool | str
    layouts: tuple[int, ...] = ()  # identities of the layout objects planned from

    @classmethod
    def of(cls, manifest: SyncManifest, layouts: tuple[int, ...] = ()) -> PlanKey:
        return cls(
            manifest.rendezvous(),
            manifest.options.wave_bytes,
            tuple(manifest.options.allow_cast),
            manifest.options.delta,
            manifest.options.quantize_on_receive,
            layouts,
        )

    def same_options(self, manifest: SyncManifest) -> bool:
        """``manifest`` asks for what this plan was made for (whatever layouts it is used with)."""
        return PlanKey.of(manifest, self.layouts) == self


class Planned(NamedTuple):
    """A version's plan, its transport, why ``auto`` chose it (or ``None``), and what the trainer ranks quantise
    (``quantize_on_receive="auto"`` where receivers cannot: their tiles, the plan's sources then FP8; else ``None``)."""

    plan: Plan
    transport: str
    reason: str | None
    send_quant: Fp8BlockQuant | None = None


def plan_version(manifest: SyncManifest, layouts: Mapping[str, Layout], where: places.Places) -> Planned:
    """The plan of ``manifest``'s version and the transport it runs on (with ``transport="auto"``, the choice and
    why; else the manifest's, checked: shared memory needs one host, CUDA IPC every device reachable).
    ``TransportError`` says what to use instead. With ``quantize_on_receive="auto"`` the FP8 receivers quantise
    on receive where the plan runs over CUDA IPC, every one of them reads its sources on its own GPU and verify mode
    is off; else the trainers quantise to the receivers' tiles (:func:`awex.meta.sender_quant`) and send FP8."""
    devices, reach, hosts = tuple(where.devices), where.reach, where.hosts
    host_of = tuple((name, rank, host) for (name, rank), (host, _, _) in sorted(where.processes.items()))
    across_hosts = len({h for _, _, h in host_of}) > 1
    options = manifest.options
    auto = options.quantize_on_receive == AUTO
    sources = [layouts[n] for n in manifest.sources]

    def plan_for(transport: str, on_receive: bool, quant: Fp8BlockQuant | None = None) -> Plan:
        nodes = transport == "p2p" and across_hosts  # what a host needs enters it once and is forwarded there
        return plan_transfers(
            [quantize_layout(x, quant) for x in sources] if quant is not None else sources,
            [layouts[n] for n in manifest.destinations],
            PlanOptions(
                wave_bytes=options.wave_bytes,
                relay=transport == "p2p" and not options.delta,  # a delta bucket is checked by its receiver
                allow_cast=options.allow_cast,
                devices=devices if transport == "ipc" else (),
                topology=Topology() if nodes else None,
                hosts=host_of if nodes else (),
                quantize_on_receive=on_receive,
            ),
        )

    quant = None
    if auto:  # what the receivers would quantise; the trainers' tiles where they cannot
        quant = sender_quant(sources, [layouts[n] for n in manifest.destinations])
        receivable = quant is not None and not options.verify
        known = {(i, r): d for i, r, d in devices}
        names = (*manifest.sources, *manifest.destinations)
        cuda = all(known.get((n, r)) for n in names for r in range(layouts[n].world_size))  # each on a known GPU
        if receivable and cuda and options.transport in ("auto", "ipc"):
            on_gpu = plan_for("ipc", True)
            if not quantized_afar(on_gpu, devices) and not unreachable(on_gpu, devices, reach):
                return Planned(on_gpu, "ipc", "FP8 quantised on receive: every receiver reads on its own GPU")
    transport = options.transport
    if transport == "auto":
        ipc_plan, p2p_plan = plan_for("ipc", options.quantize_on_receive is True, quant), plan_for("p2p", False, quant)
        by_wave = manifest.refresh_by_wave or quant is not None
        choice = choose_transport(ipc_plan, p2p_plan, devices, by_wave, reach, shm_ok=where.shm_ok)
        transport = choice.transport
        plan = p2p_plan if transport == "p2p" else ipc_plan  # shm: the same plan as ipc (no relays)
        return Planned(plan, transport, choice.reason, quant)
    plan = plan_for(transport, options.quantize_on_receive is True, quant)
    afar = quantized_afar(plan, devices) if transport == "ipc" and options.quantize_on_receive is True else []
    if afar:
        raise TransportError(
            f"sync {manifest.version!r} with quantize_on_receive=True: "
            + "; ".join(afar[:4])
            + f"{f' (and {len(afar) - 4} more)' if len(afar) > 4 else ''}; quantising on receive reads the source on "
            "the receiver's own GPU: for engines on other GPUs let the trainer quantise (quantize_on_receive='auto', "
            "or awex.convert.Fp8Views with quantize_on_receive=False)"
        )
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
    return Planned(plan, transport, None, quant)


def fp8_quantizer():
    """The FP8 block quantiser for receivers that quantise on the copy (awex.convert's: on CUDA one Triton kernel
    launch over every tile of every piece, bit-identical to its portable path)."""
    from awex.convert.fp8 import BatchedFp8Quantizer

    return BatchedFp8Quantizer
