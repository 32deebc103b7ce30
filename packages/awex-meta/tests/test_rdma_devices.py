"""RDMA ports listed from sysfs (and through pyverbs where it imports), and the port nearest a GPU by PCIe
distance."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from awex.meta.rdma_devices import RdmaPort, gpu_pci_path, nearest_port, pci_distance, ports_from_sysfs, rdma_ports

ROOT = Path(__file__).resolve().parents[1] / "src"


def _fake_nic(sysfs: Path, pci: Path, name: str, ports: dict[int, tuple[str, str]]) -> None:
    pci.mkdir(parents=True, exist_ok=True)
    (sysfs / name).mkdir(parents=True)
    os.symlink(pci, sysfs / name / "device")
    for port, (state, link) in ports.items():
        d = sysfs / name / "ports" / str(port)
        d.mkdir(parents=True)
        (d / "state").write_text(state + "\n")
        (d / "link_layer").write_text(link + "\n")


def test_ports_from_sysfs_and_the_nearest_to_a_gpu(tmp_path):
    sysfs, pci = tmp_path / "infiniband", tmp_path / "devices" / "pci0000:00"
    switch_a, switch_b = pci / "0000:00:01.0" / "0000:01:00.0", pci / "0000:00:02.0" / "0000:02:00.0"
    _fake_nic(sysfs, switch_a / "0000:03:00.0", "mlx5_0", {1: ("4: ACTIVE", "InfiniBand")})
    _fake_nic(sysfs, switch_b / "0000:04:00.0", "mlx5_1", {1: ("4: ACTIVE", "Ethernet"), 2: ("1: DOWN", "Ethernet")})
    ports = ports_from_sysfs(sysfs)
    assert [(p.device, p.port, p.active, p.link_layer) for p in ports] == [
        ("mlx5_0", 1, True, "InfiniBand"),
        ("mlx5_1", 1, True, "Ethernet"),
        ("mlx5_1", 2, False, "Ethernet"),
    ]
    gpu_b = str(switch_b / "0000:05:00.0")  # behind the second switch: mlx5_1 is nearer
    assert nearest_port(gpu_b, ports).device == "mlx5_1"
    assert nearest_port(str(switch_a / "0000:06:00.0"), ports).device == "mlx5_0"
    assert nearest_port(gpu_b, [p for p in ports if p.device == "mlx5_1" and not p.active]) is None
    assert pci_distance(gpu_b, ports[1].pci_path) < pci_distance(gpu_b, ports[0].pci_path)
    assert ports_from_sysfs(tmp_path / "absent") == []


def test_gpu_pci_path_accepts_the_bus_id_forms_drivers_print():
    assert gpu_pci_path("00000000:17:00.0") == gpu_pci_path("0000:17:00.0")


def test_this_host_lists_what_sysfs_lists():
    assert [(p.device, p.port) for p in rdma_ports()] == [(p.device, p.port) for p in ports_from_sysfs()]
    assert all(isinstance(p, RdmaPort) for p in rdma_ports())


SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.mark.skipif(
    shutil.which(SYSTEM_PYTHON) is None
    or subprocess.run([SYSTEM_PYTHON, "-c", "import pyverbs.device"], capture_output=True).returncode != 0,
    reason="no pyverbs for the system Python (Debian's python3-pyverbs)",
)
def test_pyverbs_lists_the_same_ports_as_sysfs():
    """Debian's pyverbs is built for the system Python: run the listing there (awex.meta needs no torch)."""
    code = (
        "import json; from awex.meta.rdma_devices import ports_from_pyverbs, ports_from_sysfs\n"
        "v = ports_from_pyverbs(); s = ports_from_sysfs()\n"
        "print(json.dumps([None if v is None else [[p.device, p.port, p.active] for p in v],"
        " [[p.device, p.port, p.active] for p in s]]))"
    )
    out = subprocess.run(
        [SYSTEM_PYTHON, "-c", code], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    assert out.returncode == 0, out.stderr[-2000:]
    listed, sysfs = json.loads(out.stdout)
    assert listed is not None and listed == sysfs
