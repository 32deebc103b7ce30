"""A MetaClient's agreements (``POST /v1/jobs/{job}/agree/{name}``): every participant contributes a value and waits
until all did, in long-poll slices; a plan agreement proves the ranks computed the same plan, a gather hands every
participant everyone's value; a participant that failed first gives the agreement up for all
(``awex.meta.server.agreements``)."""

from __future__ import annotations

import time
from typing import Any

from awex.meta.durations import seconds
from awex.meta.errors import AgreementAbortedError, AgreementError, MetaServerError, MetaTimeoutError

POLL_SLICE = 30.0  # longest single long-poll; the server caps it too


class Agreements:
    """The agreement calls of :class:`awex.meta.client.MetaClient` (which provides ``_request``, ``_job_path``,
    ``_by`` and ``timeout``)."""

    timeout: float

    def agree(self, name: str, participant: str, expected: int, value: Any, timeout: float | None = None) -> Any:
        """Contribute ``value`` and wait until ``expected`` participants did; raise unless all values are equal.

        Ranks use it to prove they computed the same plan (``value`` = plan digest) before any byte moves.
        """
        body = {"participant": participant, "expected": expected, "value": value}
        doc = self._until_complete("agreement", name, body, timeout)
        values = doc["distinct_values"]
        distinct = doc.get("distinct", len(values))
        if distinct != 1 or len(values) != 1:
            raise AgreementError(
                f"participants of {name!r} disagree: {distinct} distinct values, among them {values[:4]}"
            )
        return values[0]

    def gather(self, name: str, participant: str, expected: int, value: Any, timeout: float | None = None) -> dict:
        """Contribute ``value`` and wait until ``expected`` participants did; every participant's value by name.

        One request per participant where each would otherwise read every other's record (the device exchange of
        a sync's ranks). Raises ``MetaTimeoutError`` when they did not all arrive within ``timeout``."""
        body = {"participant": participant, "expected": expected, "value": value, "gather": True}
        values = self._until_complete("gather", name, body, timeout).get("values")
        if not isinstance(values, dict) or len(values) != expected:
            raise MetaServerError(f"gather {name!r}: a complete answer without its {expected} values")
        return values

    def abort_agreement(self, name: str, participant: str, cause: str) -> bool:
        """Give agreement (or gather) ``name`` up as ``participant``, which cannot contribute: every participant
        raises :class:`AgreementAbortedError` with ``cause`` at once. False where it was complete already."""
        body = {"participant": participant, "abort": cause[:2000]}
        return bool(self._request("POST", self._job_path("agree", name), body, deadline=self._by())[1]["aborted"])

    def _until_complete(self, what: str, name: str, body: dict, timeout: float | None) -> dict:
        """Post ``body`` to agreement ``name`` in long-poll slices until its answer is complete (``what``: how the
        timeout's error names it)."""
        timeout = self.timeout if timeout is None else seconds(timeout)
        deadline = time.monotonic() + timeout
        while True:
            wait = max(0.0, min(deadline - time.monotonic(), POLL_SLICE))
            doc = self._request(
                "POST", self._job_path("agree", name), body, deadline=deadline, query={"wait": f"{wait:.3f}"}
            )[1]
            if doc["complete"]:
                return doc
            if "aborted" in doc:
                by, cause = str(doc.get("by", ""))[:256], str(doc["aborted"])[:2000]
                raise AgreementAbortedError(f"{what} {name!r} was given up by {by}: {cause}", by, cause)
            if time.monotonic() >= deadline:
                raise MetaTimeoutError(
                    f"{what} {name!r}: {doc['arrived']} of {body['expected']} participants arrived within {timeout:g} s"
                )
