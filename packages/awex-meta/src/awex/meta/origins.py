"""Where each region of a plan comes from: the trainer rank that first sent it (its *origin*). A relay forwards
transfers it received itself (:data:`awex.meta.plan.RELAY_LAG` waves before), so a region that reaches a
receiver through relays counts as the trainer's that sent it first. Verify mode digests by origin on both sides
(``awex.engines.sync.verify``, the point-to-point transport's digests as waves land)."""

from __future__ import annotations

from awex.meta.errors import AwexValueError
from awex.meta.plan import Bucket, Plan, Transfer
from awex.meta.spec import Role


def transfer_origins(plan: Plan) -> list[tuple[Bucket, Transfer, int]]:
    """Every ``(bucket, transfer, origin sync rank)`` of ``plan``, buckets in wave order (pure: alike on every
    rank); raises :class:`AwexValueError` for a relay that forwards a region before it received it."""
    trainer = [r.role == Role.TRAINER for r in plan.ranks]
    relayed = {(b.src, t) for b in plan.buckets if not trainer[b.src] for t in b.transfers}
    origin: dict[tuple[int, Transfer], int] = {}
    out: list[tuple[Bucket, Transfer, int]] = []
    for b in sorted(plan.buckets, key=lambda b: b.wave):
        for t in b.transfers:
            if trainer[b.src]:
                o = b.src
            else:
                o = origin.get((b.src, t), -1)
                if o < 0:
                    raise AwexValueError(
                        f"plan {plan.digest[:12]}: sync rank {b.src} relays {plan.tensors[t.tensor].name} "
                        f"{t.region} in wave {b.wave} before receiving it"
                    )
            if (b.dst, t) in relayed:
                origin[(b.dst, t)] = o
            out.append((b, t, o))
    return out
