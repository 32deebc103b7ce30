"""Every MetaServer (and version channel) key a sync uses, in one place, and what a version leaves behind.

A version's records live under its name: ``sync/<v>`` (the manifest), ``plan/<v>/<count>`` (the plan agreement),
``devices/<v>/<count>`` (where each rank runs: a gather), ``<transport>-ready/<v>/<count>/...`` (ready
signals when neither the host board nor the version channel carries them), ``outcome/<v>/<count>/...``,
``outcomes/<v>/<count>``, ``verify/<v>/<count>/...``, ``validation/<v>/...``, ``received/<v>/...``,
``applied/<v>``, and vLLM's trainer engine's ``go/<v>/...`` and ``verdict/<v>/...``. A transport's descriptors are
per rank and generation (``<transport>/<instance>/<rank>/<generation>``), replaced as they change, not per version.
"""

from __future__ import annotations

from collections.abc import Sequence

from awex.transport.registry import TRANSPORTS


def manifest(version: str) -> str:
    return f"sync/{version}"


def applied(version: str) -> str:
    return f"applied/{version}"


def go(version: str, call: int) -> str:
    """vLLM's trainer engine: the sender's word that its engines are paused (or why they are not), for the other
    trainer ranks' ``call``-th ``send_weights``."""
    return f"go/{version}/{call}"


def verdict(version: str, call: int) -> str:
    """vLLM's trainer engine: the sender's verdict of a version (applied or not, and its stall per engine) for the
    other trainer ranks' ``call``-th ``send_weights``."""
    return f"verdict/{version}/{call}"


def plan_agreement(version: str, count: int) -> str:
    return f"plan/{version}/{count}"


def devices_gather(attempt: str) -> str:
    """The gather of every rank's device record of an attempt (``<version>/<count>``): an agreement's name."""
    return f"devices/{attempt}"


def ready(transport: str, version: str, count: int, instance: str, local_rank: int) -> str:
    return f"{transport}-ready/{version}/{count}/{instance}/{local_rank}"


def host_ready(transport: str, version: str, count: int, lead: int) -> str:
    """The ready signals of a host's trainer ranks in one key, put by their lead (sync rank ``lead``;
    ``awex.engines.sync.relayed``): their generations, a list in the order of the host's trainer ranks."""
    return f"{transport}-ready/{version}/{count}/host/{lead}"


def all_ready(transport: str, version: str, count: int) -> str:
    """Every trainer rank's ready signal of one attempt in one key, put by the first trainer rank once every host's key
    (and a rank alone's own) was there (``awex.engines.sync.relayed``): a list in the order of the plan's trainer
    ranks, ``None`` for one left out (silent until the sync's timeout). On every lane of
    the version channel (:data:`CHANNEL_EVERYWHERE`): a receiving host's lead reads it on its own lane, one waited
    read instead of one a lane its senders' keys lie on."""
    return f"all-ready/{transport}/{version}/{count}"


def descriptor(transport: str, instance: str, local_rank: int, generation: int) -> str:
    return f"{transport}/{instance}/{local_rank}/{generation}"


def outcome(version: str, count: int, instance: str, local_rank: int) -> str:
    """A receiving rank's outcome of one attempt at a version (the writer's count names the attempt: a retry of a
    failed version never meets the first attempt's records)."""
    return attempt_outcome(f"{version}/{count}", instance, local_rank)


def attempt_outcome(attempt: str, instance: str, local_rank: int) -> str:
    """:func:`outcome` by the attempt's name (``<version>/<count>``)."""
    return f"{attempt_outcomes(attempt)}{instance}:{local_rank}"


def attempt_outcomes(attempt: str) -> str:
    """The prefix of every outcome of one attempt."""
    return f"outcome/{attempt}/"


def outcomes(version: str, count: int) -> str:
    """Every receiving rank's outcome of one attempt in one record, as the first trainer rank collected them, for
    the other trainer ranks (on the version channel or the MetaServer): one read each instead of one per receiver."""
    return f"outcomes/{version}/{count}"


def instance_outcomes(version: str, count: int, name: str) -> str:
    """The outcomes of a group of receiving ranks of one attempt in one record, as the group's first rank collected
    them, for the first trainer rank: one read per group instead of one per rank. ``name``: an engine instance's,
    or ``<instance>/<local rank>`` for an instance's ranks on one host (``awex.engines.sync.relayed``)."""
    return f"{outcomes(version, count)}/{name}"


def channel_outcome(version: str, count: int, instance: str, local_rank: int) -> str:
    """The same outcome on the version channel."""
    return f"outcome/{version}/{count}/{instance}/{local_rank}"


def channel_manifest(version: str) -> str:
    return f"manifest/{version}"


def channel_record(version: str, count: int) -> str:
    """:func:`outcomes` on the version channel (the trainers' record of every outcome of one attempt)."""
    return f"record/{version}/{count}"


CHANNEL_EVERYWHERE = ("manifest/", "record/", "all-ready/")
"""Keys the version channel keeps on each of its lanes (many ranks read them: each reads its own lane's copy)."""
CHANNEL_FIRST_LANE = ("outcomes/",)
"""Keys the version channel keeps on its first lane: the groups' outcome records, which the first trainer rank (whose
own lane it is) reads all at once."""


def channel_signals(
    version: str,
    count: int,
    senders: Sequence[tuple[str, int]],
    receivers: Sequence[tuple[str, int]],
    kinds: Sequence[str],
    leads: Sequence[int] = (),
    records: Sequence[str] = (),
    everyone: bool = False,
) -> list[str]:
    """Every key one attempt of ``version`` leaves on the version channel when its per-version signals go there
    (``awex.engines.sync.signals.ChannelSignals``; its manifest is apart): the trainers' record of every outcome,
    each sender's ready signal over the transports named ``kinds`` (those whose senders signal ready), the outcome
    of each of ``receivers`` (``(instance, local rank)``: those that put one of their own) and each record of a
    group of receivers' outcomes named in ``records`` (:func:`instance_outcomes`); with ``leads``, each of those
    sync ranks' host key of ready signals (:func:`host_ready`; then ``senders`` are those that put a key of their
    own); with ``everyone``, the first trainer rank's key of them all (:func:`all_ready`). What the writer drops once
    the version is old: a round trip each, so none that was not written."""
    out = [channel_record(version, count)]
    out += [ready(kind, version, count, instance, rank) for instance, rank in senders for kind in kinds]
    out += [host_ready(kind, version, count, lead) for lead in leads for kind in kinds]
    out += [all_ready(kind, version, count) for kind in kinds] if everyone else []
    out += [channel_outcome(version, count, instance, rank) for instance, rank in receivers]
    out += [instance_outcomes(version, count, name) for name in records]
    return out


def verify(version: str, count: int, instance: str, local_rank: int) -> str:
    """A trainer rank's digests of what it sent in one attempt (verify mode, ``awex.engines.sync.verify``)."""
    return f"verify/{version}/{count}/{instance}:{local_rank}"


def validation(version: str, instance: str, local_rank: int) -> str:
    return f"validation/{version}/{instance}:{local_rank}"


def received(version: str, instance: str, local_rank: int) -> str:
    return f"received/{version}/{instance}:{local_rank}"


def staging(instance: str, local_rank: int) -> str:
    """A vLLM worker asked to receive staged: whether it stages and where
    (``{"staged": bool, "where": "device" | "host", "bytes", "budget", "reason"}``, ``awex.engines.staging``),
    or falls back to receiving in place because its staging budget cannot hold its shard."""
    return f"staging/{instance}:{local_rank}"


def staged(version: str, instance: str = "", local_rank: int = 0) -> str:
    """A receiving rank's word that it holds the whole of ``version`` in staging, not yet applied (vLLM's engines
    receiving while they generate); without an instance, the prefix of the version's words."""
    return f"staged/{version}/" + (f"{instance}:{local_rank}" if instance else "")


def version_records(version: str) -> tuple[list[str], list[str]]:
    """The MetaServer records one weight version leaves behind: exact names and prefixes (keys and agreements),
    for ``MetaClient.forget`` once nobody needs them."""
    return (
        [manifest(version), applied(version)],
        [
            f"plan/{version}/",
            *(f"{name}-ready/{version}/" for name in sorted(TRANSPORTS)),
            f"validation/{version}/",
            f"devices/{version}/",
            f"received/{version}/",
            staged(version),
            f"outcome/{version}/",
            f"outcomes/{version}/",
            f"verify/{version}/",
            f"go/{version}/",
            f"verdict/{version}/",
        ],
    )


def withdrawn_records(version: str) -> tuple[list[str], list[str]]:
    """The records of a failed attempt that its writer drops at once: those a retry (same version name, next count)
    would meet (the manifest, reports keyed by version alone). The attempt's own records (keyed by its count: device
    records, the plan agreement, ready signals, outcomes) stay until the next successful write drops them
    (:func:`version_records`): ranks still in the failed attempt read them, and fail with their own error (the
    planner's, say) instead of waiting for records that vanished."""
    return [manifest(version), applied(version)], [f"validation/{version}/", f"received/{version}/", staged(version)]
