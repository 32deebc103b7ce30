"""What a waited read of many keys costs the reading rank on the version channel (``awex.engines.sync.channel``):
its MACs checked and its values parsed, the work the first trainer rank does for every host's ready key and every
group's outcome record each version (64 of each at 1,024 ranks in nodes of 8).

One reader waits for ``N`` keys that are all there (small lists, as the hosts' ready keys; small records, as the
groups' outcomes), ``--rounds`` times; its thread's CPU a read (``time.thread_time``), against the same values
opened one by one (``VersionChannel._open``, a parse a value: how the channel read them before 2026-12-01) on the
same connection, alternated.

    python -m awex_integration.benchmarks.channel_reads --keys 16,64,256 --out integration/results/channel-reads.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from awex.engines.sync.channel import VersionChannel
from awex_integration.benchmarks import results_file


def measure(keys: int, rounds: int) -> dict:
    host = VersionChannel.host()
    names = [f"host-ready/ipc/v1/1/{8 * i}" for i in range(keys)]
    values = [[1 + i % 3] * 8 if i % 2 else {"failed": {}, "silent": []} for i in range(keys)]
    for name, value in zip(names, values):
        host.put(name, value)
    reader = VersionChannel.connect(host.address, host.secret)
    store = reader._store_of(names[0])
    together, alone = [], []
    for _ in range(rounds):
        started = time.thread_time()
        got = reader.wait(names, timeout=10)
        together.append(time.thread_time() - started)
        started = time.thread_time()
        raws = store.multi_get(names)
        one_by_one = [reader._open(n, r) for n, r in zip(names, raws)]
        alone.append(time.thread_time() - started)
        assert got == one_by_one == values
    t, a = statistics.median(together), statistics.median(alone)
    return {"keys": keys, "rounds": rounds, "together_us": round(t * 1e6, 1), "one_by_one_us": round(a * 1e6, 1)} | {
        "together_over_one_by_one": round(t / a, 3) if a else None
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", default="16,64,256", help="keys a read, comma-separated")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--out", default=None, help="results file (JSON)")
    args = ap.parse_args(argv)
    rows = [measure(int(n), args.rounds) for n in args.keys.split(",")]
    for row in rows:
        print(json.dumps(row), flush=True)
    if args.out:
        results_file.write(args.out, __doc__.split("\n\n")[0], rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
