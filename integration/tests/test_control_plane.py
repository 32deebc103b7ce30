"""The control plane at scale, small: 128 ranks of a Kimi-K2-shaped sync (64 Megatron trainer ranks, 2 vLLM engines
of 32) through the public writer and reader against a standalone MetaServer, over a transport that moves no byte
(``awex_integration.benchmarks.control_plane``; the 256-1,024-rank rows are in integration/control-plane-results.json).
Every rank must finish every version (the run fails otherwise); the steady versions must not plan again."""

from __future__ import annotations

import json
import shutil

import pytest

from awex_integration.benchmarks.control_plane import run

REQUESTS_PER_RANK = 10.0  # MetaServer requests per rank over the first sync and two steady versions (budget)
CHANNEL_OPS_PER_VERSION = 80  # version-channel operations of every rank in a steady version (budget; 58 measured)


def test_128_ranks_sync_three_versions_through_the_real_control_path():
    row = run(128, processes=2, versions=3, timeout=120.0)
    assert (row["ranks"], row["trainer_ranks"], row["inference_ranks"]) == (128, 64, 64)
    assert row["versions"] == 3
    phases = row["first_sync_phases"]
    assert phases["devices"] > 0 and phases["agreement"] > 0  # the first sync met every rank
    assert row["steady_control_seconds_per_version"] < row["first_sync_control_seconds"]
    assert row["server_peak_rss_bytes"] > 0 and row["first_sync_server_cpu_seconds"] > 0
    assert row["signals"] == {"channel": 128}  # every rank joined the version channel (as on a cluster)
    # host relays (awex.engines.sync.relay), nodes of 8: the manifest heard by 7 ranks of each of the 8 engine nodes
    # and of the 7 trainer nodes other than the first trainer rank's (whose ranks read its host board), the trainers'
    # record of every outcome by 7 ranks of each of the 8 trainer nodes, every trainer rank's ready signal by 7
    # receivers of each engine node (each of them read the channel before); and the other way, 7 receivers of each
    # engine node tell their node's lead their outcome (an engine's ranks on one node: one record, not 8 keys)
    heard = {"manifest": 8 * 7 + 7 * 7, "outcomes": 8 * 7, "ready": 8 * 7, "outcome_to_lead": 8 * 7}
    assert row["heard_from_relays"] == heard
    # what the version channel's host serves a steady version, counted: 58 operations at these 128 ranks (among
    # them 15 nodes' manifest reads and the writer's put; 8 trainer nodes' ready keys, the first trainer rank's read
    # of them and its key of them all, 8 engine nodes' reads of that; 8 engine nodes' outcome records, the first
    # trainer rank's read of them, its record and 7 trainer nodes' reads), 382 with no host relay. The budget leaves
    # room for ranks that read for themselves after a relay's slice (one each) and fails on any kind of relay lost
    # (each is 50 or more operations at this size)
    assert row["steady_channel_ops_per_version"] <= CHANNEL_OPS_PER_VERSION, row["steady_channel_ops_per_version"]
    assert all(v > 0 for v in row["steady_cpu_seconds_per_version"].values())
    # the version channel's host (the event loops of the stores the first trainer rank hosts: two lanes for 64
    # trainer ranks, awex.engines.sync.channel.lanes_for) serves every rank's per-version signals: its CPU is read,
    # both lanes busy (keys spread by name, the manifest and the trainers' record on each), and the busiest lane
    # counted in the serial figure
    assert row["steady_channel_lanes"] == 2
    lane, host = (
        row["steady_channel_busiest_lane_cpu_seconds_per_version"],
        row["steady_channel_host_cpu_seconds_per_version"],
    )
    assert 0 < lane < host
    serial = row["steady_serial_cpu_seconds_per_version"]
    assert serial >= row["steady_server_cpu_seconds_per_version"] + lane
    # what the server is asked, counted (not timed): the first sync (registration, layouts, the device gather, the
    # plan agreement, the manifest) and two steady versions, per rank: 6.7 measured on 2 cores. Ranks that poll while
    # they wait (the device gather re-posted every 0.2 s: 51 a rank) or read per engine go over it; the budget leaves
    # room for the 10-s fallback reads of a slow first sync
    assert row["server_requests_per_rank"] <= REQUESTS_PER_RANK, row["server_requests_per_rank"]


def test_a_process_cpu_is_read_finer_than_the_clock_tick():
    # a steady version costs the server a few milliseconds: /proc's stat counts 10-ms ticks, its threads' schedstat
    # nanoseconds; a 4-ms burn in a process of one thread (nothing else of this test run counted) must read as
    # 2-8 ms, not 0 or 10
    import subprocess
    import sys

    from awex_integration.benchmarks.control_plane import _proc_cpu

    burn = (
        "import sys, time\n"
        "print('ready', flush=True); sys.stdin.readline()\n"
        "started = time.thread_time()\n"
        "while time.thread_time() - started < 0.004: pass\n"
        "print('done', flush=True); sys.stdin.readline()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        before = _proc_cpu(child.pid)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "done"
        burned = _proc_cpu(child.pid) - before
    finally:
        child.kill()
        child.wait(10)
    assert 0.002 < burned < 0.008, burned


def test_the_version_channel_store_costs_its_server_cpu_per_operation():
    # the version channel's host is torch's TCP store: its event loop's CPU per operation is what a version's
    # signals cost it (integration/results/tcpstore-ops-*.jsonl); the benchmark must find that loop and read it
    from awex_integration.benchmarks.tcpstore_ops import measure

    row = measure(8, rounds=2, calls=100)
    assert row["server_threads"] == ["pt_tcpstore_uv"]  # the thread control_plane.CHANNEL_THREAD reads
    assert 0 < row["us_per_op"] < 10_000 and row["us_per_delete"] > 0
    assert set(row["us_per_call_one_client"]) == {"set", "check", "multi_get", "wait", "delete_key"}
    assert row["us_per_call_one_client"]["multi_get"] > 0  # a waited read, answered: the server read its request


def test_a_read_of_many_keys_is_timed_both_ways_on_the_same_values():
    # the reading rank's CPU for a waited read of many keys (integration/results/channel-reads-*.json): read
    # together (the channel's way) and value by value, each returning the values that were put
    from awex_integration.benchmarks.channel_reads import measure

    row = measure(8, rounds=3)
    assert row["keys"] == 8 and row["together_us"] > 0 and row["one_by_one_us"] > 0


def test_profiling_a_rank_is_refused_where_cprofile_records_every_thread(monkeypatch, capsys):
    """A rank is one thread of a worker process; from Python 3.12 cProfile records every thread of a process, so a
    rank's profile would hold its neighbours' work: ``--profile`` is refused there before anything starts."""
    import types

    from awex_integration.benchmarks import control_plane

    monkeypatch.setattr(control_plane, "sys", types.SimpleNamespace(version_info=(3, 12, 4)))
    with pytest.raises(SystemExit) as e:
        control_plane.main(["--ranks", "128", "--profile", "trainer:0"])
    assert e.value.code == 2 and "--profile needs Python 3.11: on 3.12 cProfile records every thread" in (
        capsys.readouterr().err
    )


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind (Debian's) is not installed here")
def test_the_servers_instructions_for_a_claim_are_counted_under_callgrind(tmp_path):
    # the MetaServer's part of a steady version, counted (integration/results/server-requests-callgrind-*.json): a
    # claim costs the server more than aiohttp's own part of a request (over 100,000 instructions on every machine
    # seen) and the count is written as the results file's row
    from awex_integration.benchmarks import server_requests

    out = tmp_path / "server-requests.json"
    assert server_requests.main(["--kinds", "claim", "--requests", "3", "--warm", "1", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["engines"] == 16 and row["requests"] == 3
    assert 100_000 < row["instructions_per_request"]["claim"] < 50_000_000
