"""The delta encoding's choice (positions + values, a bitmap + values, or the whole bucket) and its checksums, as
pure functions; the executor end to end is tested through the public path (awex-engines' test_delta_sync.py)."""

from __future__ import annotations

import pytest
import torch

from awex.transport.checksum import checksum, checksum_torch
from awex.transport.delta import BITMAP, DENSE, SPARSE, encoding


def test_the_smallest_encoding_wins_and_dense_when_nothing_is_smaller():
    words = 800  # 1600 bytes whole
    assert encoding(words, 0) == (SPARSE, 0)
    assert encoding(words, 10) == (SPARSE, 60)  # 6 bytes per changed word
    assert encoding(words, 50) == (BITMAP, 100 + 100)  # a bit per word, 2 bytes per changed word
    assert encoding(words, 700) == (BITMAP, 100 + 1400)
    assert encoding(words, 750) == (DENSE, 1600)  # 1600 bytes either way: whole
    assert encoding(words, 800) == (DENSE, 1600)


def test_checksums_see_changed_and_moved_words():
    g = torch.Generator().manual_seed(0)
    words = torch.randint(-(1 << 15), 1 << 15, (4096,), generator=g, dtype=torch.int32).to(torch.int16)
    base = checksum(words)
    assert checksum(words.clone()) == base
    changed = words.clone()
    changed[17] += 1
    assert checksum(changed) != base
    swapped = words.clone()
    swapped[[3, 900]] = words[[900, 3]]  # same words, other places: the plain sum alone would not see it
    assert swapped[3] != words[3] and checksum(swapped)[0] == base[0] and checksum(swapped) != base


@pytest.mark.parametrize("chunk", [1, 7, 8191, 10_000])
def test_checksum_in_chunks_equals_the_whole_sum(chunk):
    g = torch.Generator().manual_seed(3)
    words = torch.randint(-(1 << 15), 1 << 15, (20_011,), generator=g, dtype=torch.int16)
    assert checksum_torch(words, chunk=chunk) == checksum_torch(words, chunk=1 << 30)
    w = words.to(torch.int64) & 0xFFFF  # the definition, summed at once
    assert checksum(words, chunk=chunk) == (int(w.sum()), int((w * (torch.arange(w.numel()) % 8191 + 1)).sum()))


def test_checksum_reads_any_16_bit_dtype_as_its_bits_and_refuses_others():
    bits = torch.tensor([1, -1, 300, -32768], dtype=torch.int16)
    assert checksum(bits.view(torch.bfloat16)) == checksum(bits) == checksum(bits.view(torch.float16))
    with pytest.raises(ValueError, match="16-bit"):
        checksum(torch.zeros(3, dtype=torch.int32))
