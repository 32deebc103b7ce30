"""The delta checksum's Triton kernel on CUDA equals the torch definition, bit for bit (sizes around the kernel's
block, strided inputs, every 16-bit dtype); skipped without a CUDA GPU."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (the kernel runs on CUDA; the torch path is tested on CPU)", allow_module_level=True)
pytest.importorskip("triton", reason="needs Triton (the kernel)")

from awex.transport.checksum import BLOCK, ITERS, checksum, checksum_kernel, checksum_torch  # noqa: E402


@pytest.mark.parametrize("n", [1, BLOCK - 1, BLOCK, BLOCK * ITERS + 1, 8191 * 3 + 5, (1 << 22) + 3])
def test_kernel_equals_the_definition(n):
    g = torch.Generator(device="cuda").manual_seed(n)
    words = torch.randint(-(1 << 15), 1 << 15, (n,), generator=g, dtype=torch.int16, device="cuda")
    want = checksum_torch(words.cpu())
    assert checksum_kernel(words) == want
    assert checksum(words) == want  # the dispatch takes the kernel on CUDA
    for dtype in (torch.bfloat16, torch.float16):
        assert checksum_kernel(words.view(dtype)) == want


def test_strided_and_extreme_words():
    full = torch.full((1000, 64), -1, dtype=torch.int16, device="cuda")  # 0xFFFF everywhere: the largest words
    column = full[:, 3]  # strided
    assert checksum_kernel(column) == checksum_torch(column.cpu())
    assert checksum(full) == checksum(full.cpu())
