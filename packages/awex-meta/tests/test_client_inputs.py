"""Bad input to the MetaServer client and server is refused with a clear error before any request waits: deadlines
that are not finite non-negative numbers (NaN never passes, infinity overflows the clock), job and key names with
a trailing newline (a regex's ``$`` accepts one)."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request

import pytest

from awex.meta.client import MetaClient
from awex.meta.server import start_embedded


@pytest.fixture(scope="module")
def server():
    s = start_embedded()
    yield s
    s.stop()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, True, "5"])
def test_deadlines_that_are_not_finite_non_negative_seconds_are_refused(server, bad):
    with pytest.raises(ValueError, match="timeout="):
        MetaClient(server.address, job="t", timeout=bad)
    c = MetaClient(server.address, job="t", timeout=5)
    for call in (
        lambda: c.get("k", timeout=bad),
        lambda: c.events(0, timeout=bad),
        lambda: c.wait_event("x", timeout=bad),
        lambda: c.agree("a", "p", 1, 1, timeout=bad),
        lambda: c.status(timeout=bad),
    ):
        with pytest.raises(ValueError, match="a finite number of seconds"):
            call()
    with pytest.raises(ValueError, match="above 0"):
        MetaClient(server.address, job="t", timeout=0)


def test_an_address_with_a_password_is_refused_without_echoing_it():
    with pytest.raises(ValueError, match="no user or password") as refused:
        MetaClient("http://trainer:s3cret-token@127.0.0.1:8765", job="t")
    assert "s3cret" not in str(refused.value)


@pytest.mark.parametrize("job", ["job\n", "", "a b", "x" * 129, "ü"])
def test_bad_job_names_are_refused_by_the_client_and_the_server(server, job):
    with pytest.raises(ValueError, match="job name"):
        MetaClient(server.address, job=job)
    path = "/v1/jobs/" + urllib.request.quote(job, safe="") + "/kv/k"
    req = urllib.request.Request(server.address + path, data=json.dumps(1).encode(), method="PUT")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=5)
    assert e.value.code in (400, 404)


def test_a_key_with_a_trailing_newline_is_refused(server):
    req = urllib.request.Request(server.address + "/v1/jobs/t/kv/k%0A", data=b"1", method="PUT")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=5)
    assert e.value.code in (400, 404)  # the route's pattern stops at the newline, or the name check refuses it
