"""Addresses of ports are split or refused. Ports to listen on: drawn outside the kernel's ephemeral range (which
every connect and bind(0) on the host draws from meanwhile), falling back to the kernel's choice where no room is
left."""

from __future__ import annotations

import socket

import pytest

from awex.transport import net


def _range(tmp_path, monkeypatch, first: int, last: int) -> None:
    path = tmp_path / "ip_local_port_range"
    path.write_text(f"{first}\t{last}\n")
    monkeypatch.setattr(net, "EPHEMERAL_RANGE_FILE", str(path))


def test_ports_are_distinct_bindable_and_outside_the_ephemeral_range(tmp_path, monkeypatch):
    _range(tmp_path, monkeypatch, 25000, 60999)
    ports = net.free_ports(8)
    assert len(set(ports)) == 8
    assert all(net.LISTEN_PORTS[0] <= p < 25000 for p in ports), ports
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_an_ephemeral_range_covering_every_listen_port_leaves_the_choice_to_the_kernel(tmp_path, monkeypatch):
    _range(tmp_path, monkeypatch, 1024, 65535)
    ports = net.free_ports(3)
    assert len(set(ports)) == 3 and all(1024 <= p <= 65535 for p in ports)


def test_the_host_range_is_read_and_an_unreadable_one_keeps_the_default(tmp_path, monkeypatch):
    _range(tmp_path, monkeypatch, 32768, 60999)
    assert net._listen_range() == (20000, 32767)
    _range(tmp_path, monkeypatch, 10000, 22000)  # overlaps the bottom: what is above it
    assert net._listen_range() == (22001, 32767)
    monkeypatch.setattr(net, "EPHEMERAL_RANGE_FILE", str(tmp_path / "missing"))
    assert net._listen_range() == net.LISTEN_PORTS


@pytest.mark.parametrize(
    "bad", ["no-port", ":5000", "h:0", "h:70000", "h:5000,", "h:5000,x", "h:" + ",".join(["5000"] * 65)]
)
def test_an_address_of_ports_is_split_or_refused(bad):
    assert net.split_ports("127.0.0.1:5000") == ("127.0.0.1", [5000])
    assert net.split_ports("::1:5000,5001") == ("::1", [5000, 5001])  # the ports follow the last colon
    with pytest.raises(ValueError, match="not host:port"):
        net.split_ports(bad)
