"""Which attention kernel the cuda backend gives a prompt batch, decided on the CPU.

The kernels themselves are checked against the reference on the CPU emulator
(test_csrc_emulated.py) and on a GPU (tests/gpu/check_csrc_ops.py, which also runs the
routing); here only the decision for a short chunk of few sequences, a pure function.
"""

from __future__ import annotations

import torch

from asyncgen._ops import cuda_backend as cb


def counters(n, dtype=torch.int32):
    return torch.zeros(n, dtype=dtype)


def test_a_prefix_hit_in_the_narrow_graph_splits_its_keys():
    # 80 graph tokens (72 of one request + 8 padding), 8 slots, 32 heads: the kernel's grid
    # is 80 / 64 + 8 = 9 blocks wide per kv head and split, so 9 * 32 counters.
    assert cb._short_chunk_splits(80, 8, 32, 32, 80, counters(9 * 32)) == cb.CHUNK_SHORT_SPLITS
    assert cb._short_chunk_splits(80, 8, 32, 32, 80, counters(9 * 32 - 1)) == 0  # too few counters
    # GQA 4: 16 tokens a block, 80 / 16 + 8 = 13 blocks per kv head.
    assert cb._short_chunk_splits(80, 8, 32, 8, 80, counters(13 * 8)) == cb.CHUNK_SHORT_SPLITS
    assert cb._short_chunk_splits(80, 8, 32, 8, 80, counters(13 * 8 - 1)) == 0


def test_other_batches_do_not():
    many = counters(1 << 16)
    assert cb._short_chunk_splits(80, cb.CHUNK_ATTENTION_MIN_SEQS + 1, 32, 32, 80, many) == 0  # many sequences
    assert cb._short_chunk_splits(256, 8, 32, 32, cb.CHUNK_SHORT_MAX_TOKENS + 1, many) == 0  # a long chunk
    assert cb._short_chunk_splits(8, 8, 32, 32, 1, many) == 0  # decode
    assert cb._short_chunk_splits(80, 8, 32, 32, None, many) == 0  # no hint
    assert cb._short_chunk_splits(80, 8, 32, 32, 80, counters(1 << 16, torch.int64)) == 0
    assert cb._short_chunk_splits(80, 8, 32, 32, 80, many[::2]) == 0  # not contiguous
