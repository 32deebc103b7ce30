"""The delta encoding's choice (positions + values, a bitmap + values, or the whole bucket) and its checksums, as
pure functions; the executor end to end is tested through the public path (awex-engines' test_delta_sync.py)."""

from __future__ import annotations

import pytest
import torch

from awex.transport.base import TransferError
from awex.transport.checksum import checksum, checksum_torch
from awex.transport.delta import BITMAP, DENSE, SPARSE, encode, encoding, pack_bits, positions


def test_the_smallest_encoding_wins_and_dense_when_nothing_is_smaller():
    words = 800  # 1600 bytes whole
    assert encoding(words, 0) == (SPARSE, 0)
    assert encoding(words, 10) == (SPARSE, 60)  # 6 bytes per changed word
    assert encoding(words, 50) == (BITMAP, 100 + 100)  # a bit per word, 2 bytes per changed word
    assert encoding(words, 700) == (BITMAP, 100 + 1400)
    assert encoding(words, 750) == (DENSE, 1600)  # 1600 bytes either way: whole
    assert encoding(words, 800) == (DENSE, 1600)


def reference_checksum(words: list[int]) -> tuple[int, int]:
    """The definition in plain Python integers (an oracle independent of torch's int64 arithmetic)."""
    from awex.transport.checksum import MASK, MIX_A, MIX_B, POS, SEED

    def mix(x: int, muls: tuple[int, int]) -> int:
        x ^= x >> 16
        x = (x * muls[0]) & MASK
        x ^= x >> 15
        x = (x * muls[1]) & MASK
        return x ^ (x >> 16)

    a = b = 0
    for i, w in enumerate(words):
        p, w = ((i + SEED) * POS) & MASK, w & 0xFFFF
        a, b = a + mix(p ^ w, MIX_A), b + mix(p ^ (w << 16), MIX_B)
    return a, b


def _words(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(1 << 15), 1 << 15, (n,), generator=g, dtype=torch.int32).to(torch.int16)


def test_checksum_equals_its_definition():
    words = _words(5000, 1)
    assert checksum(words) == reference_checksum(words.tolist())
    assert checksum(torch.full((3,), -1, dtype=torch.int16)) == reference_checksum([0xFFFF] * 3)


def test_checksums_see_changed_and_moved_words():
    words = _words(4096, 0)
    base = checksum(words)
    assert checksum(words.clone()) == base
    changed = words.clone()
    changed[17] += 1
    assert checksum(changed) != base
    swapped = words.clone()
    swapped[[3, 900]] = words[[900, 3]]  # same words, other places
    assert swapped[3] != words[3] and checksum(swapped) != base


def _structured_changes(words: torch.Tensor):
    """Changes that linear position-weighted sums (sum of w * (i % 8191 + 1)) miss by construction."""
    n = words.numel()
    w = words.clone()
    w[100:103] += torch.tensor([1, -2, 1], dtype=torch.int16)  # a second difference: both linear sums unchanged
    yield "+1/-2/+1 on three neighbours", w
    for gap in (8191, 1, 65536, n // 2):
        w = words.clone()
        j = 5 + gap
        if w[5] != w[j]:
            w[[5, j]] = words[[j, 5]]
            yield f"two words {gap} apart swapped", w
    w = words.clone()
    w[0:n:8191] += 1  # a constant added at one position of each weight period, and taken away next to it
    w[1:n:8191] -= 1
    yield "+1/-1 pairs repeated every 8191 words", w
    w = words.clone()
    w[10], w[10 + 8191] = w[10] + 1, w[10 + 8191] - 1  # the same weight twice: plain and weighted sums unchanged
    yield "+1 and -1 at positions 8191 apart", w


def test_checksum_has_no_structured_blind_spots():
    words = _words(3 * 65536 + 17, 5)
    base = checksum(words)
    for what, changed in _structured_changes(words):
        assert not torch.equal(changed, words), what
        assert checksum(changed) != base, f"{what}: unnoticed"


def test_random_corruptions_are_seen():
    words = _words(20_000, 9)
    base = checksum(words)
    g = torch.Generator().manual_seed(11)
    for k in range(200):
        changed = words.clone()
        count = int(torch.randint(1, 6, (1,), generator=g))
        where = torch.randint(0, words.numel(), (count,), generator=g)
        changed[where] ^= torch.randint(1, 1 << 15, (count,), generator=g, dtype=torch.int32).to(torch.int16)
        if not torch.equal(changed, words):
            assert checksum(changed) != base, f"corruption {k} at {where.tolist()} unnoticed"


@pytest.mark.parametrize("chunk", [1, 7, 8191, 10_000])
def test_checksum_in_chunks_equals_the_whole_sum(chunk):
    words = _words(20_011, 3)
    assert checksum_torch(words, chunk=chunk) == checksum_torch(words, chunk=1 << 30)
    assert checksum(words, chunk=chunk) == reference_checksum(words.tolist())


def test_checksum_reads_any_16_bit_dtype_as_its_bits_and_refuses_others():
    bits = torch.tensor([1, -1, 300, -32768], dtype=torch.int16)
    assert checksum(bits.view(torch.bfloat16)) == checksum(bits) == checksum(bits.view(torch.float16))
    with pytest.raises(ValueError, match="16-bit"):
        checksum(torch.zeros(3, dtype=torch.int32))


@pytest.mark.parametrize("fraction", [0.001, 0.05, 0.3, 0.9])
def test_encode_then_positions_rebuild_the_words(fraction):
    """Few changes go as positions, more as a bitmap, most whole; what is sent, applied to the receiver's words,
    gives the sender's."""
    g = torch.Generator().manual_seed(int(fraction * 1000))
    kept = torch.randint(-(1 << 15), 1 << 15, (8192 * 3,), generator=g, dtype=torch.int32).to(torch.int16)
    words = kept.clone()
    mask = torch.rand(words.shape, generator=g) < fraction
    words[mask] = torch.randint(-(1 << 15), 1 << 15, (int(mask.sum()),), generator=g, dtype=torch.int32).to(torch.int16)
    mode, index, values = encode(words, kept)
    assert mode == encoding(words.numel(), int((words != kept).sum()))[0]
    if mode == DENSE:
        assert index is None and values is None and fraction == 0.9
        return
    assert mode == (SPARSE if fraction < 0.01 else BITMAP)
    where = positions(mode, index, values.numel(), words.numel(), "bucket")
    receiver = kept.clone()
    receiver[where] = values
    assert torch.equal(receiver, words) and checksum(receiver) == checksum(words)


def test_positions_out_of_range_or_miscounted_are_refused():
    with pytest.raises(TransferError, match="out of range"):
        positions(SPARSE, torch.tensor([3, 99], dtype=torch.int32), 2, 16, "bucket 4")
    with pytest.raises(TransferError, match="3 bits set, 2 said"):
        positions(BITMAP, torch.tensor([0b1011, 0], dtype=torch.uint8), 2, 16, "bucket 4")


@pytest.mark.parametrize("density", [0.0, 0.03, 0.5, 1.0])
def test_packed_bits_are_a_bit_per_flag_low_bit_first(density):
    g = torch.Generator().manual_seed(int(density * 100))
    flags = torch.rand(8 * 4099, generator=g) < density
    bits = pack_bits(flags)
    assert bits.dtype == torch.uint8 and bits.numel() == flags.numel() // 8
    expected = (flags.view(-1, 8).to(torch.int64) << torch.arange(8)).sum(1)
    assert torch.equal(bits.to(torch.int64), expected)
    unpacked = ((bits.unsqueeze(1).to(torch.int64) >> torch.arange(8)) & 1).view(-1).bool()
    assert torch.equal(unpacked, flags)
