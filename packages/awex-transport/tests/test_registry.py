"""Every transport is reachable by its name and implements the one interface (rdma's module imports without
Mooncake: test_rdma checks that)."""

import pytest

from awex.transport.base import Transport
from awex.transport.registry import TRANSPORTS, make_transport, transport_class


@pytest.mark.parametrize("name", sorted(TRANSPORTS))
def test_each_name_gives_a_transport_of_that_name(name):
    cls = transport_class(name)
    assert issubclass(cls, Transport) and cls.name == name
    assert not cls.__abstractmethods__


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown transport 'nvlink'.*ipc, p2p, rdma, shm"):
        make_transport("nvlink")


@pytest.fixture
def restored():
    held = dict(TRANSPORTS)
    yield
    TRANSPORTS.clear()
    TRANSPORTS.update(held)


def test_a_transport_of_ones_own_is_registered_by_class_or_by_module_path(restored):
    from awex.meta.errors import AwexValueError
    from awex.transport import register
    from awex.transport.pull.shm import ShmTransport

    class Mine(ShmTransport):
        name = "mine"

    register("mine", Mine)
    assert transport_class("mine") is Mine and isinstance(make_transport("mine"), Mine)
    register("mine", Mine)  # the same again: nothing to say
    register("shm-too", "awex.transport.pull.shm:ShmTransport")
    assert transport_class("shm-too") is ShmTransport
    for bad, match in (
        (("auto", Mine), "not 'auto'"),
        (("Mine", Mine), "1-32 of a-z"),
        (("x", "awex.transport.pull.shm"), "is not 'module:class'"),
        (("x", object), "not a Transport subclass"),
        (("mine", ShmTransport), "registered already"),
    ):
        with pytest.raises(AwexValueError, match=match):
            register(*bad)
    register("mine", ShmTransport, replace=True)
    assert transport_class("mine") is ShmTransport
    register("not-one", "awex.transport.registry:register")  # refused when first made, naming it
    with pytest.raises(AwexValueError, match="'not-one': awex.transport.registry:register is not a Transport"):
        transport_class("not-one")
