"""PeakMemory measures the peak extra memory of this process, from the process (CPU: resident set)."""

import sys

import pytest
import torch

from awex.engines.memory import PeakMemory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="resident-set peaks are read from /proc")


def test_a_transient_allocation_shows_and_nothing_else_does():
    with PeakMemory("cpu") as big:
        t = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched
        del t
    assert big.extra_bytes is not None and big.extra_bytes >= 60 << 20, big.extra_bytes
    with PeakMemory("cpu") as small:
        t = torch.ones(1 << 20, dtype=torch.uint8)
        del t
    assert small.extra_bytes is not None and small.extra_bytes < 32 << 20, small.extra_bytes
