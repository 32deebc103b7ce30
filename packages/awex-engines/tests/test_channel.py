"""The version channel: values put by one connection are awaited by another; waits end at their deadline;
a channel whose host is gone fails fast; keys of one secret are invisible under another."""

import time

import pytest

from awex.engines.sync.channel import ChannelError, ChannelTimeout, VersionChannel


def test_put_wait_and_secrets_separate_keys():
    host = VersionChannel.host()
    other = VersionChannel.connect(host.address, host.secret)
    other.put("manifest/v1", {"version": "v1"})
    assert host.wait(["manifest/v1"], timeout=5) == [{"version": "v1"}]
    stranger = VersionChannel.connect(host.address, "0" * 32)  # the right address, the wrong secret
    with pytest.raises(ChannelTimeout, match="manifest/v1 did not arrive"):
        stranger.wait(["manifest/v1"], timeout=0.2)
    host.delete(["manifest/v1"])
    with pytest.raises(ChannelTimeout):
        other.wait(["manifest/v1"], timeout=0.2)


def test_a_gone_host_fails_fast():
    host = VersionChannel.host()
    client = VersionChannel.connect(host.address, host.secret)
    host.close()
    del host
    started = time.monotonic()
    with pytest.raises((ChannelError, ChannelTimeout)):
        client.wait(["manifest/v2"], timeout=5)
    assert time.monotonic() - started < 5.5
