"""Awex's INFO lines are seen from inside a Ray actor: Ray's worker processes set no logging up, so importing
``awex.engines`` gives the ``awex`` logger its own handler there (``awex.engines.logs``), and Ray forwards the actor's
standard error to the driver, prefixed with the actor (``log_to_driver``, Ray's default). A driver script in a process
of its own: a Ray cluster of one CPU, one actor. Ray forwards the actor's lines asynchronously (a log monitor tails
the actor's file and publishes them), so the driver waits, with a deadline, until the line has passed through its
standard error before it shuts Ray down: ending at once could end before the line arrived."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("ray", reason="Ray is not installed in this environment")

DRIVER = """
import logging
import sys
import threading
import ray

class Tee:  # Ray's driver prints forwarded lines to sys.stderr as it finds it at each call
    def __init__(self, stream):
        self.stream, self.seen = stream, threading.Event()
    def write(self, text):
        if "a version's line from inside the actor" in text:
            self.seen.set()
        return self.stream.write(text)
    def __getattr__(self, name):
        return getattr(self.stream, name)

sys.stderr = tee = Tee(sys.stderr)
ray.init(num_cpus=1, include_dashboard=False)

@ray.remote
class Actor:
    def sync(self):
        import awex.engines  # sets the awex logger up where nothing did
        logging.getLogger("awex.engines").info("a version's line from inside the actor")
        logging.getLogger("awex.engines").debug("a debug line")
        return [type(h).__name__ for h in logging.getLogger("awex").handlers]

print("handlers", ray.get(Actor.remote().sync.remote()), flush=True)
print("forwarded", tee.seen.wait(timeout=60), flush=True)
ray.shutdown()
"""


def test_awex_info_lines_reach_the_ray_driver_from_an_actor(tmp_path):
    run = subprocess.run([sys.executable, "-c", DRIVER], capture_output=True, text=True, timeout=180, cwd=tmp_path)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert "handlers ['StreamHandler']" in run.stdout, out[-4000:]
    assert "forwarded True" in run.stdout, out[-4000:]  # within 60 s of the actor's return
    lines = [line for line in out.splitlines() if "awex.engines INFO a version's line from inside the actor" in line]
    assert len(lines) == 1 and "(Actor pid=" in lines[0], out[-4000:]  # forwarded by Ray, once, named by the actor
    assert "a debug line" not in out  # INFO by default (AWEX_LOGGING_LEVEL)
