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


def test_a_writer_from_a_trainer_source_takes_its_layout_rank_views_and_refresh():
    import json
    from pathlib import Path

    import torch

    from awex.engines import TrainerSource
    from awex.meta import canonical_tensors
    from awex.meta.layouts import MegatronParallel, megatron_layout

    config = json.loads((Path(__file__).resolve().parents[3] / "integration/models/qwen2-tiny.json").read_text())
    layout = megatron_layout(canonical_tensors(config, dtype="float32"), MegatronParallel(tp=2), instance="trainer")
    held = {}

    def view_of(name, box):
        return held.setdefault((name, box.offsets), torch.zeros(box.sizes))

    refreshed = []
    source = TrainerSource(layout, 1, view_of, refresh=lambda: refreshed.append(1))
    writer = WeightsWriter.from_source(None, source, transport="p2p", timeout=5.0)
    assert writer.layout is layout and writer.local_rank == 1 and writer.refresh is source.refresh
    assert held and all(key[0] in layout.rank_boxes(1) for key in held)  # its views were taken (and checked)
    other = WeightsWriter.from_source(None, source, refresh=None)  # an explicit option wins
    assert other.refresh is None
