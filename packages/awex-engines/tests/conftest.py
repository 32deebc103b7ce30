"""Fixtures shared by awex-engines' tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def made():
    """What a test opens (relays, sockets, channels): closed after it, whatever it asserted."""
    opened: list = []
    yield opened
    for thing in opened:
        thing.close()
