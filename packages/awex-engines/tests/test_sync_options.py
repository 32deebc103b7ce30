"""A writer's options are one frozen record (SyncOptions) checked by one set of rules reading what each transport
class can do; WeightsWriter refuses options that could not work, before it talks to anyone."""

import dataclasses
import math

import pytest

from awex.engines.sync.manifest import Attempt, SyncManifest
from awex.engines.sync.options import SyncOptions, combination_error
from awex.engines.writer import WeightsWriter
from awex.transport.p2p import P2pTransport


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


def _tiny_source(held, refresh=None):
    import json
    from pathlib import Path

    import torch

    from awex.engines import TrainerSource
    from awex.meta import canonical_tensors
    from awex.meta.layouts import MegatronParallel, megatron_layout

    config = json.loads((Path(__file__).resolve().parents[3] / "integration/models/qwen2-tiny.json").read_text())
    layout = megatron_layout(canonical_tensors(config, dtype="float32"), MegatronParallel(tp=2), instance="trainer")

    def view_of(name, box):
        return held.setdefault((name, box.offsets), torch.zeros(box.sizes))

    return TrainerSource(layout, 1, view_of, refresh=refresh)  # rank 1: no MetaServer needed to make its writer


def _tiny_writer(**options):
    return WeightsWriter.from_source(None, _tiny_source({}), **options)


def test_a_writer_from_a_trainer_source_takes_its_layout_rank_views_and_refresh():
    held, refreshed = {}, []
    source = _tiny_source(held, refresh=lambda: refreshed.append(1))
    layout = source.layout
    writer = WeightsWriter.from_source(None, source, transport="p2p", timeout=5.0)
    assert writer.layout is layout and writer.local_rank == 1 and writer.refresh is source.refresh
    assert held and all(key[0] in layout.rank_boxes(1) for key in held)  # its views were taken (and checked)
    other = WeightsWriter.from_source(None, source, refresh=None)  # an explicit option wins
    assert other.refresh is None


def test_ipc_needs_cuda_views_as_its_class_says():
    with pytest.raises(ValueError, match="transport='ipc' needs CUDA views"):
        _tiny_writer(transport="ipc")


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"timeout": math.nan}, "timeout=nan"),
        ({"timeout": math.inf}, "timeout=inf"),
        ({"timeout": 0}, "timeout=0"),
        ({"timeout": True}, "timeout=True"),
        ({"wave_bytes": 0}, "wave_bytes=0"),
        ({"wave_bytes": 1.5}, "wave_bytes=1.5"),
        ({"allow_cast": "*.weight"}, "allow_cast"),  # a string is not a list of patterns
        ({"allow_cast": ("",)}, "allow_cast"),
        ({"keep_versions": 0}, "keep_versions must be at least 1"),
        ({"delta": "yes", "transport": "p2p"}, "delta='yes'"),
        ({"host": ""}, "host"),
        ({"delta": True, "transport": "shm"}, "delta=True runs over transport='p2p' or 'ipc', not 'shm'"),
        ({"delta": True}, "not 'auto'"),  # auto may choose a transport without delta
        ({"quantize_on_receive": True, "transport": "p2p"}, "quantize_on_receive=True runs over transport='ipc'"),
        ({"delta": True, "transport": "ipc", "quantize_on_receive": True}, "pick one of the two"),
        ({"quantize_on_receive": "yes"}, "quantize_on_receive='yes': True, False or 'auto'"),
        ({"quantize_on_receive": "auto", "delta": True, "transport": "p2p"}, "'auto' is not built yet"),
        ({"quantize_on_receive": "auto", "refresh": print, "refresh_by_wave": object()}, "views of its own"),
        ({"delta_budget_bytes": 1 << 20, "transport": "p2p"}, "delta_budget_bytes"),
        ({"delta_budget_bytes": -1, "delta": True, "transport": "p2p"}, "delta_budget_bytes"),
        ({"refresh_by_wave": object()}, "refresh_by_wave needs refresh too"),
        ({"refresh": print, "refresh_by_wave": object(), "delta": True, "transport": "p2p"}, "not built yet"),
        ({"hold_trainer_memory": "no"}, "hold_trainer_memory='no': True or False"),
        ({"hold_trainer_memory": False, "delta": True, "transport": "p2p"}, "every version would go whole"),
    ],
)
def test_every_rule_is_checked_in_one_place(bad, match):
    with pytest.raises(ValueError, match=match):
        SyncOptions(**bad).check()


@pytest.mark.parametrize("transport", ["auto", "ipc", "p2p", "shm", "rdma"])
def test_fp8_auto_goes_with_every_transport_and_verify_mode_and_crosses_the_wire(transport):
    options = SyncOptions(quantize_on_receive="auto", transport=transport, verify=True).check()
    assert SyncOptions.from_wire(options.to_wire()) == options
    wire = {**options.to_wire(), "quantize_on_receive": "sometimes"}
    with pytest.raises(ValueError, match="quantize_on_receive='sometimes': true or false"):
        SyncOptions.from_wire(wire)


def test_options_are_frozen_and_a_list_of_casts_is_kept_as_a_tuple():
    options = SyncOptions(allow_cast=["*.weight"], delta=True, transport="ipc").check()
    assert options.allow_cast == ("*.weight",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.timeout = 1.0


class DeltaOnly(P2pTransport):
    """A transport that carries delta and nothing else the defaults lack (the rules read the class)."""

    name = "delta-only"


def test_the_rules_read_what_each_transport_class_can_do(monkeypatch):
    from awex.transport import registry

    assert combination_error("delta-only", True, False).startswith("unknown transport")
    monkeypatch.setitem(registry.TRANSPORTS, "delta-only", f"{__name__}:DeltaOnly")
    assert combination_error("delta-only", True, False) is None
    assert "transport='p2p' or 'ipc' or 'delta-only'" in combination_error("shm", True, False)
    monkeypatch.setattr(DeltaOnly, "carries_delta", False)
    assert "not 'delta-only'" in combination_error("delta-only", True, False)


def test_a_writers_option_attributes_read_and_replace_its_checked_record():
    writer = _tiny_writer(transport="p2p", timeout=5.0)
    assert writer.options.timeout == writer.timeout == 5.0
    writer.timeout = 7.5
    assert writer.options.timeout == 7.5 and writer.options.transport == "p2p"
    before = writer.options
    with pytest.raises(ValueError, match="timeout=nan"):
        writer.timeout = math.nan
    with pytest.raises(ValueError, match="delta=True runs over"):
        writer.transport = "shm"
        writer.delta = True
    assert writer.options.delta is False and writer.timeout == 7.5
    assert before.transport == "p2p"  # a record once made never changes


def test_a_renamed_manifest_is_the_one_its_constructor_makes_and_stays_frozen():
    options = SyncOptions(transport="ipc", verify=True)
    secret = "s" * 32
    first = SyncManifest("v1", ("t",), ("e",), "127.0.0.1", 1, options, channel="h:1", channel_secret=secret, seq=3)
    again = first.renamed("v2", 4)
    made = dataclasses.replace(first, version="v2", seq=4)
    assert again == made and hash(again) == hash(made)
    assert (again.version, again.seq, again.options, again.channel_secret) == ("v2", 4, options, secret)
    assert (first.version, first.seq) == ("v1", 3) and type(again) is SyncManifest
    assert SyncManifest.from_json(again.to_json()) == again
    with pytest.raises(dataclasses.FrozenInstanceError):
        again.version = "v3"


def test_an_attempt_follows_another_of_a_later_count_version_or_writer():
    first = SyncManifest("v1", ("t",), ("e",), "127.0.0.1", 1, channel="h:1", seq=3).attempt
    assert first == Attempt("h:1", "v1", 3) and first.name == "v1/3"
    assert first.follows(None)
    assert not first.follows(first) and not Attempt("h:1", "v1", 2).follows(first)
    assert Attempt("h:1", "v1", 4).follows(first)
    assert Attempt("h:2", "v1", 1).follows(first)  # a restarted writer counts afresh on a channel of its own
    assert Attempt("h:1", "v2", 1).follows(first)


def test_every_option_is_a_writer_keyword_and_attribute():
    import inspect

    names = [f.name for f in dataclasses.fields(SyncOptions)]
    keywords = list(inspect.signature(WeightsWriter.__init__).parameters)[5:]  # after self, client, layout, rank, views
    assert keywords == [*names, "claim_lease"]  # the claim lease is the writer's, not a version's
    writer = _tiny_writer(**{"transport": "p2p", "wave_bytes": 1 << 20, "keep_versions": 3, "allow_cast": ("*",)})
    assert {n: getattr(writer, n) for n in names} == dataclasses.asdict(writer.options)


@pytest.mark.parametrize("bad", [-1, math.nan, math.inf, 0, "60", True])
def test_a_reader_timeout_that_is_not_a_finite_positive_number_is_refused_at_construction(bad):
    from test_version_signals import TENSORS, tensors, views

    from awex.engines.reader import WeightsReader
    from awex.meta.layouts import hf_layout

    with pytest.raises(ValueError, match=r"WeightsReader\(timeout\)"):
        WeightsReader(None, hf_layout(TENSORS, "inference", "x"), 0, views(tensors(0.0)), timeout=bad)


def test_the_writers_defaults_are_the_options_record_s():
    """One set of defaults: every option ``WeightsWriter`` takes defaults to ``SyncOptions``' (``AwexTrainerInitInfo``'s
    too: integration/tests/test_vllm_pause.py), so a default changes in one place."""
    import inspect
    from dataclasses import fields

    from awex.engines.sync.options import SyncOptions
    from awex.engines.writer import WeightsWriter

    params = inspect.signature(WeightsWriter.__init__).parameters
    shared = [f.name for f in fields(SyncOptions)]
    assert set(shared) <= set(params)
    assert {n: params[n].default for n in shared} == {n: getattr(SyncOptions, n) for n in shared}


def test_letting_go_of_the_trainers_memory_crosses_the_wire_and_is_refused_as_anything_but_a_bool():
    """Receivers learn from the manifest that the writer holds no trainer memory between versions (they let go of
    theirs before they report); a manifest saying it other than as a bool is refused."""
    options = SyncOptions(hold_trainer_memory=False, transport="ipc").check()
    assert SyncOptions.from_wire(options.to_wire()) == options and not options.to_wire()["hold_trainer_memory"]
    with pytest.raises(ValueError, match="hold_trainer_memory=0: true or false"):
        SyncOptions.from_wire({**options.to_wire(), "hold_trainer_memory": 0})
