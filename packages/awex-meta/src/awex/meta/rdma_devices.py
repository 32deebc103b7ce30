"""This host's RDMA devices and ports, and which one is nearest a GPU (for choosing a transport and a NIC).

Listed through pyverbs (rdma-core's Python binding; Debian's ``python3-pyverbs`` matches the system's
rdma-core) where it can be imported, else from ``/sys/class/infiniband``, which is what libibverbs reads too.
Nearness is PCIe distance: the NIC whose PCI path shares the longest prefix with the GPU's (the same switch
beats the same root complex beats another socket). No torch here: the transport choice runs without it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

SYSFS = Path("/sys/class/infiniband")
PCI_DEVICES = Path("/sys/bus/pci/devices")


@dataclass(frozen=True)
class RdmaPort:
    device: str  # e.g. "mlx5_0"
    port: int  # 1-based
    active: bool
    link_layer: str  # "InfiniBand" or "Ethernet" (RoCE)
    pci_path: str  # the device's PCI path, "/sys/devices/pci0000:00/.../0000:17:00.0", or ""


def _pci_path(device: str, sysfs: Path) -> str:
    try:
        return os.path.realpath(sysfs / device / "device")
    except OSError:
        return ""


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def ports_from_sysfs(sysfs: Path = SYSFS) -> list[RdmaPort]:
    """The RDMA ports as sysfs lists them (``state`` "4: ACTIVE" is active)."""
    out = []
    try:
        devices = sorted(os.listdir(sysfs))
    except OSError:
        return out
    for device in devices:
        try:
            ports = sorted(int(p) for p in os.listdir(sysfs / device / "ports") if p.isdigit())
        except OSError:
            continue
        for port in ports:
            base = sysfs / device / "ports" / str(port)
            out.append(
                RdmaPort(
                    device,
                    port,
                    _read(base / "state").endswith("ACTIVE"),
                    _read(base / "link_layer") or "InfiniBand",
                    _pci_path(device, sysfs),
                )
            )
    return out


def ports_from_pyverbs() -> list[RdmaPort] | None:
    """The RDMA ports as rdma-core lists them through pyverbs; ``None`` where pyverbs cannot be imported."""
    try:
        import pyverbs.device as verbs
        from pyverbs.enums import IBV_LINK_LAYER_ETHERNET, IBV_PORT_ACTIVE
        from pyverbs.pyverbs_error import PyverbsError
    except ImportError:
        return None
    try:
        devices = verbs.get_device_list()
    except PyverbsError:  # rdma-core found no device (no NIC, or no provider for it)
        return []
    out = []
    for dev in devices:
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        with verbs.Context(name=name) as ctx:
            for port in range(1, ctx.query_device().phys_port_cnt + 1):
                attr = ctx.query_port(port)
                out.append(
                    RdmaPort(
                        name,
                        port,
                        attr.state == IBV_PORT_ACTIVE,
                        "Ethernet" if attr.link_layer == IBV_LINK_LAYER_ETHERNET else "InfiniBand",
                        _pci_path(name, SYSFS),
                    )
                )
    return out


def rdma_ports() -> list[RdmaPort]:
    """This host's RDMA ports (pyverbs where it imports, else sysfs)."""
    listed = ports_from_pyverbs()
    return ports_from_sysfs() if listed is None else listed


def active_ports() -> list[RdmaPort]:
    return [p for p in rdma_ports() if p.active]


def pci_distance(a: str, b: str) -> int:
    """How far apart two PCI paths are: components of the longer one below their common prefix."""
    pa, pb = [x for x in a.split("/") if x], [x for x in b.split("/") if x]
    common = 0
    for x, y in zip(pa, pb):
        if x != y:
            break
        common += 1
    return max(len(pa), len(pb)) - common


def nearest_port(gpu_pci_path: str, ports: list[RdmaPort]) -> RdmaPort | None:
    """The active port nearest a GPU (its PCI path, e.g. ``os.path.realpath('/sys/bus/pci/devices/<bus id>')``);
    ties go to the first listed."""
    candidates = [p for p in ports if p.active]
    if not candidates:
        return None
    return min(candidates, key=lambda p: pci_distance(gpu_pci_path, p.pci_path) if p.pci_path else 1 << 30)


def gpu_pci_path(bus_id: str) -> str:
    """A GPU's PCI path from its bus id (``torch.cuda.get_device_properties(i).pci_bus_id`` style, any case)."""
    bus = bus_id.lower()
    if bus.count(":") == 2 and len(bus.split(":")[0]) == 8:  # "00000000:17:00.0" -> "0000:17:00.0"
        bus = bus[4:]
    return os.path.realpath(PCI_DEVICES / bus)
