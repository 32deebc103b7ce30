"""The fault suite's cases (``awex_integration.faults.fault_suite``), one test each: real trainer and engine processes
over gloo and a MetaServer, faults injected, every party's claims checked against what happened. ``./noxw -s faults``
runs the same cases and prints the suite's JSON summary."""

from __future__ import annotations

import pytest
from conftest import full_only

from awex_integration.faults.etcd_cases import available, etcd_cases
from awex_integration.faults.fault_cases import cases
from awex_integration.faults.fault_suite import run_case, run_on_server
from awex_integration.faults.name_cases import name_cases
from awex_integration.faults.server_load import load_cases
from awex_integration.faults.transport_cases import rdma_cases, shm_cases

CASES = {case.name: case for case in cases() + name_cases() + shm_cases() + rdma_cases() + etcd_cases()}
NO_ETCD = available()
# etcd cases CI leaves to the full matrix: packages/awex-meta/tests/test_server_etcd.py checks the same of the servers
# (a frozen leader, applied names across a hand-over) without sync ranks
ETCD_FULL_ONLY = {
    "etcd_leader_frozen_between_syncs": "test_server_etcd's frozen leader",
    "etcd_name_reused_across_failover": "test_server_etcd's hand-over (an applied name is never written again)",
}


def _marks(name: str):
    if CASES[name].server == "etcd" and NO_ETCD:
        return pytest.mark.skip(reason=f"{NO_ETCD}: the MetaServer pair on etcd cannot run here")
    return full_only(ETCD_FULL_ONLY[name]) if name in ETCD_FULL_ONLY else ()


@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(n)) for n in CASES])
def test_fault_case(name):
    result = run_case(CASES[name], timeout=8.0)
    assert not result["hangs"], result["hangs"]
    assert not result["false_success"], result["false_success"]
    assert result["passed"], result["problems"]
    assert result["recovered"] == CASES[name].recovers
    # CPU ranks: gloo, or the transport the case asks for
    assert result["transports"] in ([], [CASES[name].transport])


LOAD = {case.name: case for case in load_cases()}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=full_only("the 5,000-participant agreement (the same code, within the caps)"))
        if LOAD[n].clients > 5000
        else n
        for n in LOAD
    ],
)
def test_metaserver_load_case(name):
    result = run_on_server(LOAD[name])
    assert result["passed"], result["problems"]
