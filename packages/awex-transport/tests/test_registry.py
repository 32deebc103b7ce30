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
