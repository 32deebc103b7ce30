"""awex.engines imports without pulling in any inference or training engine."""

import subprocess
import sys

ENGINES = ("vllm", "megatron", "sglang", "transformers", "torch_npu", "pyverbs", "verl", "ray")


def test_import_pulls_in_no_engine():
    code = (
        "import sys, awex.engines; "
        f"bad = [m for m in {ENGINES!r} if m in sys.modules]; "
        "assert not bad, f'awex.engines imported {bad}'; "
        "print(awex.engines.__version__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0.1.0"


def test_shares_the_awex_namespace_with_meta():
    import awex.engines
    import awex.meta

    assert awex.engines.__name__ == "awex.engines"
    assert awex.meta.Box((0,), (4,)).numel == 4
