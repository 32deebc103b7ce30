"""Who joined a sync group: every member proves, over the group itself, that it holds the plan's secret.

A sync group meets at a ``TCPStore`` (``awex.transport.group``), which has no authentication and lists its keys to
anyone who connects: a process on a rank's host that learned the store's address could take a rank's place while
the group forms, and be sent weights or send its own. Once the group stands, each rank all-gathers an HMAC of its
rank under the secret the plan's ranks share (``Setup.secret``; the engines derive it from the version channel's
key, which the channel itself never carries) and checks every other rank's: a member that cannot produce its tag
fails the group on every rank, before any byte of a version moves. Once per group, not per version.
"""

from __future__ import annotations

import hashlib
import hmac

import torch

TAG_BYTES = 32


def tag(secret: str, rank: int, world_size: int) -> bytes:
    """Rank ``rank``'s proof that it holds ``secret`` in a group of ``world_size``."""
    return hmac.new(secret.encode(), f"awex-sync-group/{rank}/{world_size}".encode(), hashlib.sha256).digest()


def intruders(gathered: list[bytes], secret: str) -> list[int]:
    """The ranks whose gathered tag is not theirs under ``secret``."""
    world = len(gathered)
    return [r for r, got in enumerate(gathered) if not hmac.compare_digest(got, tag(secret, r, world))]


def gather_tags(pg, rank: int, world_size: int, secret: str, device: torch.device, wait) -> list[bytes]:
    """All-gather every member's tag over ``pg`` on ``device``; ``wait(work)`` waits for the collective (with the
    caller's deadline)."""
    mine = torch.tensor(list(tag(secret, rank, world_size)), dtype=torch.uint8, device=device)
    out = [torch.empty(TAG_BYTES, dtype=torch.uint8, device=device) for _ in range(world_size)]
    wait(pg.allgather([out], [mine]))
    return [bytes(t.cpu().tolist()) for t in out]
