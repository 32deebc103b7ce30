"""The delta encoding's choice (positions + values, a bitmap + values, or the whole bucket) and its checksums, as
pure functions; the executor end to end is tested through the public path (awex-engines' test_delta_sync.py)."""

from __future__ import annotations

import torch

from awex.transport.delta import BITMAP, DENSE, SPARSE, checksum, encoding


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
