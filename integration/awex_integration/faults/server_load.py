"""The MetaServer under load, as the fault suite's ``metaserver_*`` cases: one standalone ``awex-meta serve`` and
thousands of clients at once, each speaking the MetaClient's protocol (long-polls in slices; a 503 ``busy`` or
``overloaded`` answer honoured by waiting the time it names and asking again). Asyncio clients in one process, so
the server's limits are what is tested, not how many threads this machine runs.

Cases (:func:`load_cases`): 5,000 long-polls on one key released by one write, which must get through while they
wait (parked as MetaClient parks them, in 30 s slices; the put comes once the server says all are parked, from a
writer with request slots of its own, as another process has); a 5,000-participant agreement; a 16,384-participant
(2**14) agreement, beyond the server's per-address caps, so busy answers and retries carry it; the device exchange
of 1,024 ranks (a gather of each rank's record, as ``awex.engines.sync.places`` contributes it). Each must complete
within its deadline, every client with the right answer.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import dataclass
from typing import Any

from awex.meta.agreement_calls import POLL_SLICE
from awex.meta.server.site import descriptor_limit

SLICE = 2.0  # seconds one long-poll of an agreement or gather may wait before the client asks again (MetaClient: 30 s)
PUT_WITHIN = 2.0  # seconds the writer's put may take while 5,000 clients wait on its key
PARK_WITHIN = 120.0  # seconds the 5,000 long-polls may take to be parked before the put
DEADLINE = 240.0  # seconds a case may take
MAX_OPEN = 8192  # requests this process has in flight at once (one address: below the server's per-address cap)
RAMP = 2.0  # seconds over which the clients start (a burst of 16,384 connects in one instant overflows any
# listen queue: the kernel then drops handshakes and clients retry them 1, 3, 7... s later, which measures TCP)


@dataclass(frozen=True)
class LoadCase:
    name: str
    what: str
    kind: str  # "long_polls", "agreement" or "gather"
    clients: int
    recovers: bool = True


def load_cases() -> list[LoadCase]:
    return [
        LoadCase(
            "metaserver_5000_long_polls",
            "5,000 clients long-poll one key at once; a writer's put gets through within 2 s while they wait, and "
            "every client gets the value",
            "long_polls",
            5000,
        ),
        LoadCase(
            "metaserver_5000_participant_agreement",
            "5,000 participants agree on one value at once; every one is told the agreement completed, all equal",
            "agreement",
            5000,
        ),
        LoadCase(
            "metaserver_16384_participant_agreement",
            "2**14 participants from one address (beyond the per-address caps: busy answers, retried) agree; every "
            "one is told it completed",
            "agreement",
            1 << 14,
        ),
        LoadCase(
            "metaserver_1024_rank_device_exchange",
            "1,024 ranks exchange where they run (one gather of a device record each): every rank gets all 1,024 "
            "records, as given",
            "gather",
            1024,
        ),
    ]


class _Client:
    """The MetaClient's protocol over one aiohttp session: slices, and 503 busy/overloaded honoured."""

    def __init__(self, session, base: str, slots: asyncio.Semaphore):
        self.session, self.base, self.slots = session, base, slots
        self.busy = 0  # 503 answers honoured
        self.dropped = 0  # connections reset while the server was full (retried, as MetaClient does)

    async def call(
        self, method: str, path: str, body: Any = None, wait: float = 0.0, raw: bool = False
    ) -> tuple[int, Any]:
        """The answer's status and JSON (``raw``: its bytes, unparsed; a busy answer is still honoured)."""
        import aiohttp

        while True:
            query = f"?wait={wait:.3f}" if wait else ""
            try:
                async with self.slots, self.session.request(method, self.base + path + query, json=body) as r:
                    data = await r.read()
                    status = r.status
                    doc = data if raw and status != 503 else json.loads(data or b"null")
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError):
                self.dropped += 1
                await asyncio.sleep(0.05 + random.random() * 0.2)
                continue
            if status == 503 and isinstance(doc, dict) and doc.get("error") in ("busy", "overloaded"):
                self.busy += 1
                await asyncio.sleep(min(float(doc.get("retry_after", 1.0)), 5.0))
                continue
            return status, doc


async def _parked(client: _Client, n: int) -> int:
    """Long-polls the server holds parked once ``n`` are, or when :data:`PARK_WITHIN` has passed (its status)."""
    root = client.base.split("/v1/")[0]
    deadline = time.monotonic() + PARK_WITHIN
    while True:
        async with client.session.get(f"{root}/v1/status") as r:
            parked = int((await r.json())["waiting"])
        if parked >= n or time.monotonic() > deadline:
            return parked
        await asyncio.sleep(0.1)


async def _long_polls(client: _Client, n: int) -> dict[str, Any]:
    got: list[Any] = []

    async def poll() -> None:
        await asyncio.sleep(random.random() * RAMP)
        while True:  # MetaClient's slice: every client is parked when the put comes, none re-asking
            status, doc = await client.call("GET", "/kv/go", wait=POLL_SLICE)
            if status == 200:
                got.append(doc)
                return

    tasks = [asyncio.create_task(poll()) for _ in range(n)]
    # the writer is another process: it has request slots of its own (in the pollers' it waited for a slice to end)
    writer = _Client(client.session, client.base, asyncio.Semaphore(1))
    parked = await _parked(writer, n)
    if parked < n:  # the put is timed against every client parked, not against the server reading their requests
        return {"problems": [f"{parked} of {n} clients parked within {PARK_WITHIN:g} s"], "parked": parked}
    started = time.monotonic()
    status, _ = await writer.call("PUT", "/kv/go", {"step": 1})
    put_seconds = time.monotonic() - started
    await asyncio.gather(*tasks)
    problems = [] if status == 200 else [f"the writer's put answered {status}"]
    if put_seconds > PUT_WITHIN:
        problems.append(f"the writer's put took {put_seconds:.2f} s while the clients waited")
    wrong = sum(doc != {"step": 1} for doc in got)
    if len(got) != n or wrong:
        problems.append(f"{len(got)} of {n} clients got the value, {wrong} a wrong one")
    return {"problems": problems, "put_seconds": round(put_seconds, 3), "released_seconds": time.monotonic() - started}


async def _agreement(client: _Client, n: int) -> dict[str, Any]:
    answers: list[dict] = []

    async def agree(i: int) -> None:
        body = {"participant": f"rank-{i}", "expected": n, "value": "plan-digest"}
        await asyncio.sleep(random.random() * RAMP)  # ranks arrive over a moment, not in one instant
        while True:
            status, doc = await client.call("POST", "/agree/plan", body, wait=SLICE)
            if status != 200 or doc["complete"]:
                answers.append({"status": status, **(doc if isinstance(doc, dict) else {})})
                return

    started = time.monotonic()
    await asyncio.gather(*(agree(i) for i in range(n)))
    bad = [
        a for a in answers if a["status"] != 200 or a.get("distinct") != 1 or a["distinct_values"] != ["plan-digest"]
    ]
    problems = [f"{len(bad)} of {n} participants were not told all agreed, e.g. {bad[:2]}"] if bad else []
    return {"problems": problems, "agreement_seconds": round(time.monotonic() - started, 3)}


def _device_record(i: int) -> dict:
    """A rank's device record as ``awex.engines.sync.places.describe`` makes it (about 300 bytes)."""
    gpu = f"node-{i // 8:04d}/GPU-{i % 8}-5f3c2b1a-0d4e-4f6a-9b8c-{i:012d}"
    return {
        "device": gpu,
        "reach": [gpu.replace(f"GPU-{i % 8}", f"GPU-{k}") for k in range(2)],
        "host": f"node-{i // 8:04d}",
        "pid": 10_000 + i,
        "started": 123_456 + i,
        "cpu": False,
        "in_place": True,
        "shm": True,
        "signals": ["board", "channel"],
    }


async def _gather(client: _Client, n: int) -> dict[str, Any]:
    """Every rank's answer is checked: parsed and compared with the records given where it differs from the first
    correct one byte for byte (the server encodes the answer once; each real rank parses only its own)."""
    answers: dict[int, tuple[int, bytes]] = {}
    want = {f"rank-{i}": _device_record(i) for i in range(n)}
    good: set[bytes] = set()
    last = [0.0]

    def correct(data: bytes) -> bool:
        if data in good:
            return True
        doc = json.loads(data)
        if doc.get("complete") and doc.get("values") == want:
            good.add(data)
            return True
        return False

    async def give(i: int) -> None:
        body = {"participant": f"rank-{i}", "expected": n, "value": _device_record(i), "gather": True}
        await asyncio.sleep(random.random() * RAMP)
        while True:
            status, data = await client.call("POST", "/agree/devices/v-1/1", body, wait=SLICE, raw=True)
            if status != 200 or data in good or json.loads(data).get("complete"):
                answers[i] = (status, data)
                break
        last[0] = time.monotonic()

    started = time.monotonic()
    await asyncio.gather(*(give(i) for i in range(n)))
    bad = [i for i, (status, data) in answers.items() if status != 200 or not correct(data)]
    problems = [f"{len(bad)} of {n} ranks did not get every record as given, e.g. rank {bad[:3]}"] if bad else []
    return {"problems": problems, "gather_seconds": round(last[0] - started, 3)}


async def _run(case: LoadCase, address: str) -> dict[str, Any]:
    import aiohttp

    budget = (descriptor_limit() or MAX_OPEN) - 256  # sockets this process may hold; beyond, requests queue here
    slots = asyncio.Semaphore(max(64, min(case.clients, budget, MAX_OPEN)))
    timeout = aiohttp.ClientTimeout(total=max(SLICE, POLL_SLICE) + 30)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        client = _Client(session, f"{address}/v1/jobs/load-{os.getpid()}", slots)
        run = {"long_polls": _long_polls, "agreement": _agreement, "gather": _gather}[case.kind]
        out = await asyncio.wait_for(run(client, case.clients), DEADLINE)
        out.update(busy_answers=client.busy, connections_dropped=client.dropped)
        return out


def run_load_case(case: LoadCase, address: str) -> dict[str, Any]:
    """Run ``case`` against the server at ``address``: a result shaped as the fault suite's (``passed``,
    ``problems``...) with what it measured."""
    started = time.monotonic()
    try:
        measured = asyncio.run(_run(case, address))
        problems = measured.pop("problems")
    except asyncio.TimeoutError:
        measured, problems = {}, [f"did not complete within {DEADLINE:g} s"]
    return {
        "case": case.name,
        "what": case.what,
        "passed": not problems,
        "problems": problems,
        "hangs": [],
        "transports": [],
        "false_success": [],
        "recovered": not problems,
        "should_recover": case.recovers,
        "seconds": round(time.monotonic() - started, 1),
        "measured": measured,
    }
