"""Writer fences: each writer identity of a job (a trainer instance's announcing rank) has an epoch, taken anew by
every writer that starts (``POST /v1/jobs/{job}/fences/{identity}``). A write that carries ``X-Awex-Fence:
<epoch>:<identity>`` is refused (409 ``fenced``) when a newer writer of that identity took a higher epoch since, so
a frozen writer that resumes after its replacement took over changes nothing (it can neither delete the live
writer's records, nor report versions, nor announce). A write carrying a higher epoch than the server knows (the
server restarted without a journal and lost it) raises the server's to it: the newest writer's next write fences the
old one again. With a journal (``awex.meta.server.journal``) epochs survive a restart.
"""

from __future__ import annotations

import re

from aiohttp import web

from awex.meta.protocol import FENCE_HEADER
from awex.meta.server.errors import BadRequest, error
from awex.meta.server.journal import JournalError
from awex.meta.server.state import JobState

_IDENTITY = re.compile(r"^[A-Za-z0-9_.:@-]{1,128}\Z")
MAX_EPOCH = 1 << 53


def identity_of(name: str) -> str:
    if not _IDENTITY.match(name):
        raise BadRequest(f"bad writer identity {name[:140]!r} (1 to 128 letters, digits, _ . : @ -)")
    return name


def take(job: JobState, identity: str) -> int:
    """A new epoch for ``identity``: every write of an older one is refused from now on."""
    epoch = job.fences.get(identity_of(identity), 0) + 1
    job.note("fence", id=identity, epoch=epoch)
    job.fences[identity] = epoch
    return epoch


def refusal(job: JobState | None, header: str) -> web.Response | None:
    """The answer to a write fenced out by ``header`` (``<epoch>:<identity>``), or ``None`` to let it through."""
    epoch_text, _, identity = header.partition(":")
    if not epoch_text.isdigit() or not 0 < int(epoch_text) < MAX_EPOCH or not _IDENTITY.match(identity):
        return error(400, "bad_request", f"bad {FENCE_HEADER} (<epoch>:<identity>)")
    epoch = int(epoch_text)
    current = job.fences.get(identity, 0) if job is not None else 0
    if epoch < current:
        return error(
            409,
            "fenced",
            f"writer {identity!r} of epoch {epoch} was replaced by a newer one (epoch {current}): "
            "its writes are refused; stop this writer",
        )
    if job is not None and epoch > current:  # without a journal, a server that restarted forgot it
        try:
            job.note("fence", id=identity, epoch=epoch)
        except JournalError as e:  # not raised: nothing changed, and the writer is told why
            return error(503, "journal", str(e))
        job.fences[identity] = epoch
    return None
