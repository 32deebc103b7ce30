"""Errors of a weight sync as a whole (a transport's own errors live in ``awex.transport``)."""

from __future__ import annotations

from awex.engines.outcome import Outcome, Outcomes, all_applied
from awex.meta.errors import AwexValueError, MetaServerError
from awex.transport.base import TransferError


class SyncFailedError(TransferError):
    """Version ``version`` was not applied on every receiving rank. ``failed`` maps ``(instance, rank)`` to that
    rank's :class:`~awex.engines.outcome.Outcome` (``ok`` false, ``cause``, ``partial``), or to ``None`` for a rank
    that did not report within the deadline (dead or stuck). ``causes`` maps a party that is not one receiving rank
    (an engine as a whole, a trainer rank, the pause) to what went wrong there."""

    def __init__(self, version: str, failed: Outcomes, causes: dict[str, str] | None = None):
        self.version = version
        self.failed = dict(failed)
        self.causes = dict(causes or {})
        parts = [f"{who}: {cause}" for who, cause in self.causes.items()]
        for (instance, rank), outcome in sorted(self.failed.items()):
            if outcome is None:
                parts.append(f"{instance}:{rank} did not report (dead or stuck)")
            else:
                parts.append(
                    f"{instance}:{rank} failed"
                    + (" part-way" if outcome.partial else "")
                    + (f": {outcome.cause}" if outcome.cause else "")
                )
        super().__init__(
            f"version {version!r} was not applied everywhere: "
            + "; ".join(parts[:8])
            + (f" (and {len(parts) - 8} more)" if len(parts) > 8 else "")
        )


class VersionRefusedError(AwexValueError):
    """The trainer refused a version before announcing it (its name taken, or the writer fenced): a receiver
    waiting for it learns so at once instead of at its deadline; nothing moved."""


class ClaimRefusedError(MetaServerError):
    """The MetaServer refused a version's claim sent under the writer's claim lease, after its bytes began to move
    (the lease lost with a server that restarted without a journal): the version failed, and no engine counts as
    serving its name, whatever its ranks said."""


def instance_verdicts(outcomes: Outcomes) -> dict[str, str]:
    """Per instance, from its ranks' outcomes of one version: ``"applied"`` (every rank applied it),
    ``"unchanged"`` (every rank failed before changing anything: the previous version still serves), or
    ``"inconsistent"`` (some ranks changed, or may have changed, their weights and some did not finish)."""
    if all_applied(outcomes):  # every steady version
        return {instance: "applied" for instance, _ in outcomes}
    by_instance: dict[str, list[Outcome | None]] = {}
    for (instance, _), outcome in outcomes.items():
        by_instance.setdefault(instance, []).append(outcome)
    verdicts = {}
    for instance, ranks in by_instance.items():
        if all(o is not None and o.ok for o in ranks):
            verdicts[instance] = "applied"
        elif all(o is not None and not o.ok and not o.partial for o in ranks):
            verdicts[instance] = "unchanged"
        else:
            verdicts[instance] = "inconsistent"
    return verdicts
