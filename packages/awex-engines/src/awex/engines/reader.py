"""The inference side: :class:`WeightsReader` receives one weight version for one rank of an instance.

The reader receives the rank's boxes into ``LocalShards``: views of the engine's own parameters (in place) or
staging tensors that an engine-specific ``apply`` then loads (vLLM's loader path). Every receiving rank
reports its outcome to the trainers; they count a version as applied, and report it for the instance, only when
every rank succeeded (``WeightsWriter``).
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Callable, Sequence

import torch

from awex.engines.sync import keys
from awex.engines.sync.background import Background
from awex.engines.sync.session import SyncSession
from awex.engines.sync.verify import VerifyError
from awex.meta import Box, Layout
from awex.meta.client import MetaClient, seconds
from awex.meta.errors import AwexValueError
from awex.transport import LocalShards
from awex.transport.base import TransferStats
from awex.transport.rebind import confirm_bound, rebound

log = logging.getLogger("awex.engines")
APPLIED_NAMES_KEPT = 65536  # version names a reader remembers having applied (a few MB at most)


class WeightsReader:
    """One inference rank's reader.

    A writer with ``verify=True`` has every receiving rank compare a digest of what it got with its senders' before
    the version counts (``awex.engines.sync.verify``; a mismatch fails the version on this rank, before ``validate``
    and ``apply``). ``verify=True`` here requires it: a version whose writer does not verify is refused before any
    byte moves.
    """

    def __init__(
        self,
        client: MetaClient,
        layout: Layout,
        local_rank: int,
        view_of: Callable[[str, Box], torch.Tensor | Sequence[tuple[Box, torch.Tensor]]],
        *,
        timeout: float = 300.0,
        publish: bool = True,
        verify: bool = False,
        device: torch.device | None = None,
    ):
        if not isinstance(verify, bool):
            raise AwexValueError(f"verify={verify!r}: True or False")
        self.client = client
        self.layout = layout
        self.local_rank = local_rank
        self.timeout = seconds(timeout, "WeightsReader(timeout)", positive=True)  # -1, NaN, "60": refused here
        self.verify = verify  # require verified versions
        self.version: str | None = None
        # names this rank applied, with the writer (sources, epoch) whose bytes it holds under each: a name is never
        # taken again from another writer (a replacement whose predecessor's report was lost), only retried
        self._applied: dict[str, tuple] = {}
        self.last_validation = None
        self._view_of = view_of  # asked again before each receive: weights the engine re-allocated are re-bound
        # device: the GPU whose copies fill views in pinned host memory (a version staged on the host)
        self._shards = LocalShards.from_layout(layout, local_rank, view_of, device)
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
        before_apply: Callable[[], None] | None = None,
    ) -> TransferStats:
        """Receive ``version`` (waiting for the trainer's manifest), then ``apply`` it; raises on any failure.

        ``validate``: an HF safetensors checkpoint to compare every received tensor with, before applying;
        the report is published at ``validation/<version>/<instance>:<rank>``; with ``strict`` a mismatch
        raises :class:`~awex.engines.validation.ValidationError` and nothing is applied.
        ``in_place``: whether some views are the engine's own weights (a failure once bytes moved then leaves them
        partially updated); by default, when there is no ``apply`` step. ``before_apply``: runs once the whole
        version arrived (verified and validated where asked), before ``apply``; what it raises fails the version
        with the engine's weights untouched (a staged version dropped: ``awex.engines.staged_version``).

        The outcome (applied, or failed with its cause) goes to the trainers, which count the version as applied
        only when every receiving rank succeeded, and report each instance's version (see ``WeightsWriter``). An
        instance's first receiving rank then collects its instance's outcomes for the trainers: its ``receive``
        returns once every rank of its instance reported, or after at most a second (the trainers then read the
        others one by one): an instance's ranks receive concurrently, as engines run them. A
        rank that fails publishes a ``sync_failed`` event naming itself and the cause; one left partially updated
        also reports that its instance serves no consistent version. After a failure the next ``receive`` (a
        retry, or the next version) plans and joins again.
        """
        started = time.monotonic()
        applying = landed = False  # the apply step began (it changes the engine's weights); the version landed
        # weights the engine re-allocated since the last version: new views (the transports rebuild from them), checked
        # while the trainer announces (off the critical path: the engine's weights do not move inside this call); views
        # that no longer fit fail this rank once the manifest is known (reported, before any byte moves)
        try:
            self._shards, _ = rebound(self.layout, self.local_rank, self._view_of, self._shards, quick=True)
            unfit = None
        except Exception as e:  # raised once the manifest is known
            unfit = e
        bound = time.monotonic()

        def land() -> None:  # the version arrived (verified where asked): validation, then the engine's load step
            nonlocal applying, landed
            if validate:
                self._validate(version, validate, strict)
            if before_apply is not None:
                before_apply()
            if apply is not None:
                applying = True
                apply(self._shards)
            landed = True

        try:
            received = self._session.receive(
                version,
                self._shards,
                started,
                self.timeout,
                bound=bound,
                admit=partial(self._admit, version, unfit),
                beside=partial(confirm_bound, self.layout, self.local_rank, self._view_of, self._shards),
                land=land,
            )
        except BaseException as e:
            if not landed:  # what reporting the outcome raises goes to the caller as it is
                in_place = in_place if in_place is not None else apply is None
                self._failed(version, self._session.attempt, e, in_place, applying)
            raise
        self.version = version
        self._applied[version] = (received.manifest.sources, received.manifest.epoch)
        if len(self._applied) > APPLIED_NAMES_KEPT:
            del self._applied[next(iter(self._applied))]  # the oldest
        self._background.log_line(received.line, now=received.stats.planned)  # a steady version's once it returned
        return received.stats

    def _admit(self, version: str, unfit: Exception | None, manifest) -> None:
        """Raise where this rank must not take ``manifest``'s version (before any byte moves)."""
        if self.layout.instance not in manifest.destinations:
            raise AwexValueError(f"{self.layout.instance} is not a destination of sync {version!r}")
        if self.verify and not manifest.options.verify:
            raise VerifyError(
                f"{self.layout.instance}:{self.local_rank} requires verified versions (verify=True), and the "
                f"writer of {version!r} does not verify: pass verify=True to the writer"
            )
        if unfit is not None:
            raise unfit
        held = self._applied.get(version)
        if held is not None and held != (manifest.sources, manifest.epoch):
            raise AwexValueError(
                f"{self.layout.instance}:{self.local_rank} applied version {version!r} already, from "
                f"{'/'.join(held[0])} at epoch {held[1]}; writer epoch {manifest.epoch} may not write that name "
                "again (its bytes may differ): version names are written once, name the version anew"
            )

    def _validate(self, version: str, checkpoint: str, strict: bool) -> None:
        """Compare every received tensor with an HF checkpoint; publish the report; raise where ``strict`` and any
        differs."""
        from awex.engines.validation import load_checkpoint, validate_shards

        report = validate_shards(self._shards, load_checkpoint(checkpoint), strict=False)
        self.last_validation = report
        self.client.put(keys.validation(version, self.layout.instance, self.local_rank), report.to_json())
        if strict and report.tensors_mismatched:
            from awex.engines.validation import ValidationError

            raise ValidationError(
                f"{report.tensors_mismatched} of {report.tensors_checked} received tensors "
                f"differ from {checkpoint}: {report.to_json()['mismatched'][:10]}"
            )

    def _failed(self, version: str, manifest, error: BaseException, in_place: bool, applying: bool) -> None:
        """Report this rank's failure (to the trainers, as an event, and, when its weights were changed part-way,
        as its instance serving no consistent version) and get ready for the next attempt."""
        # In place, a failure once bytes moved (transfer part-way, strict validation, an interrupt) leaves some
        # weights of the new version, as does one inside the apply step; before that the previous version is intact.
        partial = (in_place and self._session.touched) or applying
        where = f"{self.layout.instance}:{self.local_rank}"
        cause = f"{type(error).__name__}: {error}"
        if partial:
            self.version = None
            if hasattr(error, "add_note"):  # Python >= 3.11
                error.add_note(
                    f"{where} received in place and its weights are now partially updated: it serves no "
                    "consistent version until the next successful sync"
                )
            log.error(
                "%s failed to receive %s (%s); weights partially updated in place, no consistent version",
                where,
                version,
                cause,
            )
        else:
            log.error("%s failed to receive %s (%s); still serving %s", where, version, cause, self.version)
        if manifest is not None:  # reported, that attempt's manifest not taken again, and plan and group dropped
            self._session.finish(manifest, ok=False, cause=cause, partial=partial)  # not waiting for the others
            self._session.reset()
        # no manifest read: no attempt began, and the plan and group still match the writer's (a steady writer
        # keeps its own; dropping them here would leave the two waiting for each other until the deadline)
        self._background.flush()  # earlier reports first
        try:
            if partial:
                self.client.report_version(self.layout.instance, None)
            detail = f"rank {where}: " + ("partially updated in place, no consistent version: " if partial else "")
            self.client.publish_event("sync_failed", where, version=version, data=(detail + cause)[:2000])
        except Exception as e:  # the sync's own error is what the caller must see
            log.warning("%s could not report its failure of %s: %s", where, version, e)
