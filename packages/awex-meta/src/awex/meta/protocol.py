"""What the MetaServer and its clients agree on beyond JSON bodies: header names and the digest of a claimed name (no
aiohttp needed here)."""

import hashlib

EPOCH_HEADER = "X-Awex-Epoch"  # a random name of the server process, on every answer: changes on restart
FENCE_HEADER = "X-Awex-Fence"  # a writer's "<epoch>:<identity>": refused once a newer writer of it took over
LEASE_MAX_SECONDS = 60.0  # the longest claim lease a server grants: what a writer's replacement may have to wait
REQUEST_ID_HEADER = "X-Awex-Request-Id"  # a write's id: a retry with the same id is answered, not applied again


def claim_digest(key: str) -> str:
    """16 hex digits naming a claimed key: a claim lease's grant lists every name claimed in its job by these
    (``awex.meta.server.leases``; two names sharing one only make a writer claim by a round trip)."""
    return hashlib.blake2b(key.encode(), digest_size=8).hexdigest()
