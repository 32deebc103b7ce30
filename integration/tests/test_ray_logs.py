"""Awex's INFO lines are written from inside a Ray actor: Ray's worker processes set no logging up, so importing
``awex.engines`` gives the ``awex`` logger its own handler there (``awex.engines.logs``), on the actor's standard
error, which Ray keeps in the worker's log file and forwards to the driver (``log_to_driver``, Ray's default). A driver
script in a process of its own: a Ray cluster of one CPU in a directory of the test's, one actor. The test reads the
actor's log file, not the driver's output: Ray forwards asynchronously, and on a loaded machine (CI, with the rest of
the suite's engines alive) a forwarded line was seen to arrive after the driver had waited a minute for it. The
driver runs without ``AWEX_LOGGING_LEVEL``, whatever the test session has: the default is what is tested."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="Ray is not installed in this environment")

DRIVER = """
import logging
import os
import sys
import ray
ray.init(num_cpus=1, include_dashboard=False, _temp_dir=sys.argv[1])

@ray.remote
class Actor:
    def sync(self):
        import awex.engines  # sets the awex logger up where nothing did
        logging.getLogger("awex.engines").info("a version's line from inside the actor")
        logging.getLogger("awex.engines").debug("a debug line")
        return [type(h).__name__ for h in logging.getLogger("awex").handlers], os.getpid()

handlers, pid = ray.get(Actor.remote().sync.remote())
print("handlers", handlers, flush=True)
print("actor pid", pid, flush=True)
ray.shutdown()
"""


def test_awex_info_lines_are_written_by_an_actor_for_ray_to_forward():
    where = tempfile.mkdtemp(prefix="awexray", dir="/tmp")  # short: Ray's socket paths live under it
    env = {k: v for k, v in os.environ.items() if k != "AWEX_LOGGING_LEVEL"}  # the default is what is tested
    try:
        run = subprocess.run(
            [sys.executable, "-c", DRIVER, where], capture_output=True, text=True, timeout=180, cwd=where, env=env
        )
        out = run.stdout + run.stderr
        assert run.returncode == 0, out[-4000:]
        assert "handlers ['StreamHandler']" in run.stdout, out[-4000:]
        pid = run.stdout.split("actor pid ", 1)[1].split()[0]
        logs = list(Path(where).glob(f"session_latest/logs/worker-*-{pid}.err"))
        assert len(logs) == 1, sorted(p.name for p in Path(where).glob("session_latest/logs/*"))[:40]
        text = logs[0].read_text()
        lines = [
            line for line in text.splitlines() if "awex.engines INFO a version's line from inside the actor" in line
        ]
        assert len(lines) == 1, text[-4000:]  # once: the actor's own handler, not twice through another
        assert "a debug line" not in text  # INFO by default (AWEX_LOGGING_LEVEL)
    finally:
        shutil.rmtree(where, ignore_errors=True)
