"""awex.convert imports without pulling in any inference or training engine."""

import subprocess
import sys

ENGINES = ("vllm", "megatron", "sglang", "transformers", "torch_npu", "pyverbs")


def test_import_pulls_in_no_engine():
    code = (
        "import sys, awex.convert; "
        f"bad = [m for m in {ENGINES!r} if m in sys.modules]; "
        "assert not bad, f'awex.convert imported {bad}'; "
        "print(awex.convert.__version__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0.1.0"


def test_shares_the_awex_namespace_with_meta():
    import awex.convert
    import awex.meta

    assert awex.convert.__name__ == "awex.convert"
    assert awex.meta.Box((0,), (4,)).numel == 4
