"""``awex-meta plan --from-job``: the layouts a running job published on its MetaServer (``layouts/current/<instance>``,
the trainers' and the engines', learned ones included), so a dry run plans what that job would, for any model it
syncs, table or not."""

from __future__ import annotations

from awex.meta.client import MetaClient
from awex.meta.errors import AwexValueError
from awex.meta.layout import Layout
from awex.meta.spec import Role

PREFIX = "layouts/current/"


def job_layouts(address: str, job: str, token: str | None, timeout: float = 30.0) -> tuple[list[Layout], list[Layout]]:
    """``(sources, destinations)``: every layout job ``job`` published, by role, in instance order; an
    ``AwexValueError`` saying what is missing where the job published no trainer or no engine layout."""
    client = MetaClient(address, job=job, token=token, timeout=timeout)
    instances = sorted(k[len(PREFIX) :] for k in client.keys(PREFIX))
    if not instances:
        raise AwexValueError(f"job {job!r} on {client.address} published no layout (its ranks publish theirs at start)")
    layouts = client.fetch_layouts(instances, timeout=timeout)
    sources = [layouts[i] for i in instances if layouts[i].role == Role.TRAINER]
    destinations = [layouts[i] for i in instances if layouts[i].role == Role.INFERENCE]
    if not sources or not destinations:
        missing = "trainer" if not sources else "engine"
        raise AwexValueError(f"job {job!r} published no {missing} layout (instances: {', '.join(instances)})")
    return sources, destinations
