"""The inference side: :class:`WeightsReader` receives one weight version for one rank of an instance.

The reader receives the rank's boxes into ``LocalShards``: views of the engine's own parameters (in place) or
staging tensors that an engine-specific ``apply`` then loads (vLLM's loader path). A transport failure raises
before anything is applied, so the engine keeps serving the previous version; the reader reports the version
it serves to the MetaServer (``None`` after a failed sync).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

import torch

from awex.meta import Box, Layout
from awex.meta.client import MetaClient
from awex.transport import LocalShards
from awex.transport.p2p import TransferError, TransferStats

from awex.engines.background import Background
from awex.engines.session import SyncSession

log = logging.getLogger("awex.engines")


class WeightsReader:
    """One inference rank's reader."""

    def __init__(
        self,
        client: MetaClient,
        layout: Layout,
        local_rank: int,
        view_of: Callable[[str, Box], torch.Tensor | Sequence[tuple[Box, torch.Tensor]]],
        *,
        timeout: float = 300.0,
        publish: bool = True,
    ):
        self.client = client
        self.layout = layout
        self.local_rank = local_rank
        self.timeout = timeout
        self.version: str | None = None
        self.last_validation = None
        self._shards = LocalShards.from_layout(layout, local_rank, view_of)
        self._session = SyncSession(client, layout.instance, local_rank, device=self._shards.device)
        self._background = Background(f"{layout.instance}-{local_rank}")  # version reports
        if publish and local_rank == 0:
            client.register(layout.instance, role="inference", instance=layout.instance, world_size=layout.world_size)
            client.publish_layout(layout, "current")

    def close(self) -> None:
        """Release what syncing holds: plan, staging and the trainers' memory opened over CUDA IPC (idempotent;
        the engine keeps its weights; no further syncs). Close readers of CUDA IPC syncs before the trainer
        processes exit: PyTorch counts a reader's references to a trainer's memory in memory the trainer owns,
        and a reader that releases them after the trainer is gone aborts at exit."""
        self._background.flush()
        self._session.close()

    def __enter__(self) -> "WeightsReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def shards(self) -> LocalShards:
        return self._shards

    @property
    def last_phases(self) -> dict[str, float]:
        """Seconds of each phase of this rank's last receive (plan, agreement, group, open, transfer, ...)."""
        return dict(self._session.phases)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until the requests a receive leaves for afterwards (the version report) were sent."""
        return self._background.flush(timeout)

    def held_bytes(self) -> int:
        """Bytes of sync buffers (staging) this reader keeps between versions."""
        return self._session.held_bytes()

    def receive(
        self,
        version: str,
        apply: Callable[[LocalShards], None] | None = None,
        validate: str | None = None,
        strict: bool = False,
        in_place: bool | None = None,
    ) -> TransferStats:
        """Receive ``version`` (waiting for the trainer's manifest), then ``apply`` it; raises on any failure.

        ``validate``: an HF safetensors checkpoint to compare every received tensor with, before applying;
        the report is published at ``validation/<version>/<instance>:<rank>``; with ``strict`` a mismatch
        raises :class:`~awex.engines.validation.ValidationError` and nothing is applied.
        ``in_place``: whether some views are the engine's own weights (a failed transfer then leaves them
        partially updated); by default, when there is no ``apply`` step.
        """
        started = time.monotonic()
        try:
            manifest = self._session.fetch_manifest(version, self.timeout)
            if self.layout.instance not in manifest.destinations:
                raise ValueError(f"{self.layout.instance} is not a destination of sync {version!r}")
            fetched = time.monotonic()
            stats = self._session.transfer(manifest, self._shards, self.timeout - (time.monotonic() - started))
            self._session.phases.update(manifest=fetched - started, transferred=time.monotonic() - started)
            if validate:
                from awex.engines.validation import load_checkpoint, validate_shards

                report = validate_shards(self._shards, load_checkpoint(validate), strict=False)
                self.last_validation = report
                self.client.put(f"validation/{version}/{self.layout.instance}:{self.local_rank}", report.to_json())
                if strict and report.tensors_mismatched:
                    from awex.engines.validation import ValidationError

                    raise ValidationError(f"{report.tensors_mismatched} of {report.tensors_checked} received tensors "
                                          f"differ from {validate}: {report.to_json()['mismatched'][:10]}")
            if apply is not None:
                apply(self._shards)
        except BaseException as e:
            # In place (no apply step), a transfer that failed part-way has overwritten some weights: the engine no
            # longer holds any one version. Errors before the transfer (planning, shard checks, agreement) leave
            # the previous version intact.
            partial = (apply is None if in_place is None else in_place) and isinstance(e, TransferError)
            if partial:
                self.version = None
                if hasattr(e, "add_note"):  # Python >= 3.11
                    e.add_note(f"{self.layout.instance}:{self.local_rank} received in place and its weights are now "
                               "partially updated: it serves no consistent version until the next successful sync")
                log.error("%s:%d failed to receive %s (%s); weights partially updated in place, no consistent version",
                          self.layout.instance, self.local_rank, version, e)
            else:
                log.error("%s:%d failed to receive %s (%s); still serving %s", self.layout.instance, self.local_rank,
                          version, e, self.version)
            if self.local_rank == 0:
                self._background.flush()  # earlier reports first
                self._report(self.version)
                try:
                    detail = ("partially updated in place, no consistent version: " if partial else "") + str(e)
                    self.client.publish_event("sync_failed", self.layout.instance, version=version, data=detail[:2000])
                except Exception:  # the sync's own error is what the caller must see
                    pass
            raise
        self.version = version
        if self.local_rank == 0:
            self._background.submit(f"report of version {version}", self._report, version)
        self._session.phases["total"] = time.monotonic() - started
        log.info("%s:%d received %s: %d bytes in %.3f s", self.layout.instance, self.local_rank, version,
                 stats.bytes_received, stats.seconds)
        return stats

    def _report(self, version: str | None) -> None:
        """Tell the MetaServer which version this instance serves."""
        try:
            self.client.report_version(self.layout.instance, version)
        except Exception:  # reporting must not mask the sync's own outcome
            log.warning("could not report version %s of %s to the MetaServer", version, self.layout.instance)
