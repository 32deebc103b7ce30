"""The faults the fault suite's ranks inject into themselves (:mod:`awex_integration.faults.fault_ranks`), one
function each: a rank that dies at a chosen point, a report lost, a byte altered or flipped on the way."""

from __future__ import annotations

import json
import os
from math import prod
from pathlib import Path

MODEL = Path(__file__).resolve().parents[2] / "models" / "qwen2-tiny.json"
EXIT_CODE = 17  # a rank killed by its script exits with this


def _die_relaying() -> None:
    """This process dies as its first wave that sends to a rank other than a trainer's is posted."""
    from awex.transport.p2p import waves

    post = waves.WaveExecutor._post

    def dying(self, wave, deadline, timeout):
        if any(self.plan.ranks[p].role.value != "trainer" for p, _, _ in wave.sends):
            os._exit(EXIT_CODE)
        return post(self, wave, deadline, timeout)

    waves.WaveExecutor._post = dying


def _lose_reports() -> None:
    """This process's version reports are lost on the way: the MetaServer never learns what they say."""
    from awex.meta.client import MetaClient, MetaServerError

    def lost(self, reports):
        raise MetaServerError("the report was lost (fault injected)")

    MetaClient.report_versions_sent = lost
    MetaClient.report_versions = lost


def _corrupt_after(reader):
    """One bit of what the reader's next transfer brings flips: as a wave lands, before it is digested, where the
    transport digests waves as they land (point to point in verify mode); else once the transfer is done."""

    def transfer(*args, **kwargs):
        from awex.engines.sync.session import SyncSession

        del reader._session.transfer
        p2p = reader._session._transports.get("p2p")
        digests = getattr(p2p, "_digests", None)
        if digests is not None:
            _flip_as_it_lands(digests[1])
            return SyncSession.transfer(reader._session, *args, **kwargs)
        stats = SyncSession.transfer(reader._session, *args, **kwargs)
        _, view = reader.shards.pairs(sorted(reader.shards.names())[0])[0]
        view.reshape(-1).view(torch.int32)[3] ^= 1 << 7
        return stats

    import torch

    return transfer


def _flip_as_it_lands(digests) -> None:
    original = digests.received

    def received(wave, stream=None):
        pieces = digests.views.get(("got", wave), [])
        if pieces:  # after the wave's unpacking, on its stream (a GPU's), before its digest
            words = pieces[0].view(torch.int16)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                words[(0,) * words.dim()] ^= 1 << 7
            digests.received = original
        original(wave, stream)

    import contextlib

    import torch

    digests.received = received


def _alter_segment_once(writer) -> None:
    """Alter the last byte of the last region of the trainer's segment as the sender says the segment is full (the
    receivers copy it after that); once."""
    from awex.transport.pull.staging import segment_layout

    transport = writer._session._transports["shm"]
    segment, plan, rank = transport.sender.segment, transport.sender.plan, transport.sender.rank
    (tensor, _, sizes), at = max(segment_layout(plan, rank)[0].items(), key=lambda kv: kv[1])
    last = at + plan.tensors[tensor].itemsize * prod(sizes) - 1
    say, done = segment.set_progress, []

    def set_progress(count, filled):
        if filled == segment.nbytes and not done:
            segment.tensor[last] ^= 1
            done.append(count)
        say(count, filled)

    segment.set_progress = set_progress


def _die_after_prepare(session):
    def transfer(manifest, shards, timeout, *args, **kwargs):
        session.prepare(manifest, timeout)
        os._exit(EXIT_CODE)

    return transfer


def _raise(error: BaseException):
    def fail(*_args, **_kwargs):
        raise error

    return fail


def _wrong_checkpoint(held, workdir: str, name: str) -> str:
    """A safetensors checkpoint that disagrees with what arrives (for strict validation)."""
    import torch
    from safetensors.torch import save_file

    from awex.meta import canonical_tensors

    path = Path(workdir) / f"wrong-{name}.safetensors"
    tensors = canonical_tensors(json.loads(MODEL.read_text()), dtype="float32")
    save_file({t.name: torch.full(t.spec.shape, -7.0) for t in tensors}, str(path))
    return str(path)
