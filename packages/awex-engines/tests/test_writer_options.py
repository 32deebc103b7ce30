"""WeightsWriter refuses option combinations that could not work, before it talks to anyone."""

import pytest

from awex.engines.writer import WeightsWriter


def _never(*args):
    raise AssertionError("must not be called")


def test_unknown_transport_is_refused():
    with pytest.raises(ValueError, match="unknown transport 'nvlink'"):
        WeightsWriter(None, None, 0, _never, transport="nvlink")


def test_refresh_by_wave_alone_is_refused():
    # the ipc path has no waves: without `refresh` an FP8 sender would serve stale tiles there
    with pytest.raises(ValueError, match="refresh_by_wave needs refresh too"):
        WeightsWriter(None, None, 0, _never, refresh_by_wave=lambda sent: _never)


def test_keep_versions_must_keep_one():
    with pytest.raises(ValueError, match="keep_versions must be at least 1"):
        WeightsWriter(None, None, 0, _never, keep_versions=0, refresh=lambda: None)
