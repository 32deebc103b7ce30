"""Awex's errors are one hierarchy (``awex.meta.errors``): a bad value given to any entry point raises
``AwexValueError`` (also a ``ValueError``), before anything else happens, and ``except AwexError`` catches what Awex
raises on purpose: bad input, MetaServer errors, failed transfers and versions. (``tools/house.py errors`` holds the
source to it statically: no bare ``ValueError``, every exception class on an Awex base.)"""

from __future__ import annotations

import pytest
import torch
from test_version_signals import TENSORS, views

from awex.engines import AwexError, AwexValueError, SyncFailedError, WeightsReader, WeightsWriter
from awex.engines.sglang import AwexSglangInfo
from awex.engines.staging import check_staging
from awex.engines.sync.verify import VerifyError
from awex.engines.validation import ValidationError
from awex.meta import PlanError, SchemaError, UnknownModelError
from awex.meta.client import MetaClient
from awex.meta.errors import MetaServerError, MetaTimeoutError
from awex.meta.layouts import hf_layout
from awex.meta.server import start_embedded
from awex.transport import LocalShards
from awex.transport.base import TransferError
from awex.transport.shards import ShardMismatchError


def test_every_named_error_is_an_awex_error():
    for cls in (
        SyncFailedError,
        VerifyError,
        ValidationError,
        PlanError,
        SchemaError,
        UnknownModelError,
        MetaServerError,
        MetaTimeoutError,
        TransferError,
        ShardMismatchError,
    ):
        assert issubclass(cls, AwexError), cls
    assert issubclass(AwexValueError, ValueError) and issubclass(MetaTimeoutError, TimeoutError)
    assert not issubclass(ValidationError, AssertionError)  # a failed check of received bytes is no assertion


@pytest.fixture(scope="module")
def meta():
    s = start_embedded()
    yield s
    s.stop()


def test_bad_values_at_the_entry_points_raise_awex_value_errors(meta):
    client = MetaClient(meta.address, job="errors", timeout=5)
    params = {t.name: torch.zeros(t.spec.shape) for t in TENSORS}
    layout = hf_layout(TENSORS, "trainer", "trainer")
    bad = [
        lambda: WeightsWriter(client, layout, 0, views(params), wave_bytes=0),
        lambda: WeightsWriter(client, layout, 0, views(params), transport="pigeon"),
        lambda: WeightsReader(client, hf_layout(TENSORS, "inference", "eng"), 0, views(params), timeout=-1),
        lambda: AwexSglangInfo("127.0.0.1:1", receive="lazy"),
        lambda: check_staging("gpu", None, "staged"),
        lambda: LocalShards.from_layout(layout, 0, lambda name, box: torch.zeros(1)),
        lambda: MetaClient(meta.address, job="errors", timeout=float("nan")),
    ]
    for make in bad:
        with pytest.raises(AwexValueError):
            make()
    try:
        WeightsWriter(client, layout, 0, views(params), wave_bytes=-5)
    except AwexError as e:  # one except for all of Awex
        assert "wave_bytes" in str(e)
    else:
        raise AssertionError("a negative wave size was accepted")
