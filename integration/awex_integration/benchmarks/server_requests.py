"""What each request of a steady version costs the MetaServer, counted in instructions: a version's claim (a
create-only ``PUT`` of its manifest key) and its report of the engines it updated (one ``POST`` naming each engine's
new version), against a health check (no body, no state: aiohttp's and the event loop's share alone).

``awex-meta serve`` (journalling) runs under valgrind's callgrind, which counts the instructions its process runs:
the same count for the same code and requests whatever else the machine does (a timed measurement of a fraction of
a millisecond moves 20% between runs on a shared 2-core machine). A client in another process sends ``--warm``
requests of a kind, then the counters are zeroed, then it sends ``--requests`` more and the counts are dumped.
The kinds run one after another, each on a fresh server.

    python -m awex_integration.benchmarks.server_requests --engines 16 --out integration/results/server-requests.json

Needs ``valgrind`` and ``callgrind_control`` on the PATH (Debian's valgrind).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from awex_integration.benchmarks import results_file
from awex_integration.scenarios.spawn import free_port

KINDS = ("health", "claim", "report")

CLIENT = r"""
import subprocess, sys
from awex.meta.client import MetaClient

address, kind, engines, warm, n, pid = sys.argv[1:7]
engines, warm, n = int(engines), int(warm), int(n)
c = MetaClient(address, job="bench", timeout=300)
for i in range(engines):
    c.register(f"engine-{i}", role="inference", instance=f"engine-{i}", world_size=32)

def one(i):
    if kind == "health":
        c.health()
    elif kind == "claim":
        c.put(f"sync/v{i}/manifest", {"version": f"v{i}"}, create_only=True)
    else:
        c.report_versions(
            {f"engine-{k}": {"version": f"v{i}", "bytes": 16 << 30, "seconds": 0.01} for k in range(engines)}
        )

for i in range(warm):
    one(10**6 + i)
subprocess.run(["callgrind_control", "--zero", pid], check=True, capture_output=True)
for i in range(n):
    one(i)
subprocess.run(["callgrind_control", "--dump", pid], check=True, capture_output=True)
"""


def instructions(kind: str, engines: int, warm: int, requests: int, timeout: float) -> int:
    """The server's instructions for ``requests`` requests of ``kind`` (after ``warm`` more)."""
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        log = open(Path(tmp, "log"), "w+")
        server = subprocess.Popen(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/cg.%p", sys.executable, "-m",
             "awex.meta.cli", "serve", "--port", str(port), "--journal", f"{tmp}/journal"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + timeout
            while "serving on" not in Path(tmp, "log").read_text():
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not start: {Path(tmp, 'log').read_text()[-2000:]}")
                time.sleep(0.5)
            address = f"http://127.0.0.1:{port}"
            args = [address, kind, str(engines), str(warm), str(requests), str(server.pid)]
            subprocess.run([sys.executable, "-c", CLIENT, *args], check=True, timeout=timeout)
        finally:
            server.terminate()
            server.wait(timeout=60)
            log.close()
        dumps = list(Path(tmp).glob("cg.*.1"))  # the dump the client asked for (the one at exit is .0 or bare)
        if len(dumps) != 1:
            raise RuntimeError(f"expected one callgrind dump, found {[p.name for p in Path(tmp).iterdir()]}")
        for line in dumps[0].read_text().splitlines():
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
        raise RuntimeError(f"no instruction count in {dumps[0].name}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, default=16, help="engines a report names (16 at 1,024 ranks)")
    ap.add_argument("--requests", type=int, default=100, help="requests counted of each kind")
    ap.add_argument("--warm", type=int, default=20, help="requests of each kind before counting")
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated, of " + ", ".join(KINDS))
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--out", default=None, help="results file (JSON)")
    args = ap.parse_args(argv)
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        ap.error("needs valgrind and callgrind_control on the PATH (Debian's valgrind)")
    kinds = args.kinds.split(",")
    if not set(kinds) <= set(KINDS):
        ap.error(f"--kinds: of {', '.join(KINDS)}")
    row: dict = {"engines": args.engines, "requests": args.requests, "instructions_per_request": {}}
    for kind in kinds:
        total = instructions(kind, args.engines, args.warm, args.requests, args.timeout)
        row["instructions_per_request"][kind] = round(total / args.requests)
        print(json.dumps({kind: row["instructions_per_request"][kind]}), flush=True)
    per = row["instructions_per_request"]
    if "claim" in per and "report" in per:
        row["steady_version_instructions"] = per["claim"] + per["report"]  # the two requests of a steady version
    if args.out:
        results_file.write(args.out, __doc__.split("\n\n")[0], rows=[row])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
