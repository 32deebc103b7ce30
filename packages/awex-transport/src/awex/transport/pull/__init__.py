"""Transports whose receivers pull a version from what its senders expose: :mod:`~awex.transport.pull.base`
(:class:`PullTransport`, the shared protocol), :mod:`~awex.transport.pull.shm` (host shared memory),
:mod:`~awex.transport.pull.rdma` (one-sided reads through Mooncake's transfer engine), and below them the staging
layout of a sender's exposed buffer (:mod:`~awex.transport.pull.staging`) and named ``/dev/shm`` segments that no
killed creator leaves behind (:mod:`~awex.transport.pull.segments`)."""
