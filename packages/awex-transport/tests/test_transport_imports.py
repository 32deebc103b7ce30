"""awex.transport imports without pulling in any inference or training engine."""

import subprocess
import sys

ENGINES = ("vllm", "megatron", "sglang", "transformers", "torch_npu", "pyverbs")


def test_import_pulls_in_no_engine():
    code = (
        "import sys, awex.transport; "
        f"bad = [m for m in {ENGINES!r} if m in sys.modules]; "
        "assert not bad, f'awex.transport imported {bad}'; "
        "print(awex.transport.__version__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0.1.0"


def test_shares_the_awex_namespace_with_meta():
    import awex.meta
    import awex.transport

    assert awex.transport.__name__ == "awex.transport"
    assert awex.meta.Box((0,), (4,)).numel == 4
