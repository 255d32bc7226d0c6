"""The torch reference's paged attention (the CPU backend, and the oracle of the kernel
tests) against attention written out one sequence and one head at a time."""

from __future__ import annotations

import math

import pytest
import torch

from asyncgen._ops import reference as ref


def _paged_batch(q_lens, seq_lens, *, num_heads, num_kv_heads, head_dim, block_size, dtype, seed):
    """Shuffled block ids; every slot no sequence owns, and block 0 (where the reference
    points unused table entries), hold NaN; unused table entries hold a huge id."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    tables = torch.full((len(seq_lens), max(per_seq) + 1), 1 << 30, dtype=torch.int32)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # never block 0
    for b, n in enumerate(seq_lens):
        for j in range(per_seq[b]):
            blk = tables[b, j] = free.pop()
            used = min(block_size, n - j * block_size)
            k_cache[blk, :used] = torch.randn(used, num_kv_heads, head_dim, generator=gen).to(dtype)
            v_cache[blk, :used] = torch.randn(used, num_kv_heads, head_dim, generator=gen).to(dtype)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    q = torch.randn(int(qsl[-1]), num_heads, head_dim, generator=gen).to(dtype)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables,
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32), query_start_loc=qsl)


def _written_out(batch, scale, sliding_window):
    """Each query row of each head: softmax over the keys it may see, times their values."""
    q, k_cache, v_cache = batch["q"].double(), batch["k_cache"], batch["v_cache"]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.zeros_like(q)
    starts, lens = batch["query_start_loc"].tolist(), batch["seq_lens"].tolist()
    for s, n in enumerate(lens):
        slots = [(int(batch["block_tables"][s, p // block_size]), p % block_size) for p in range(n)]
        keys = torch.stack([k_cache[b, o] for b, o in slots]).double()  # [n, kvh, d]
        values = torch.stack([v_cache[b, o] for b, o in slots]).double()
        q_len = starts[s + 1] - starts[s]
        for i in range(q_len):
            pos = n - q_len + i  # the query's own position
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            for h in range(q.shape[1]):
                kv = h // group
                scores = [float(q[starts[s] + i, h] @ keys[p, kv]) * scale for p in range(lo, pos + 1)]
                top = max(scores)
                weights = [math.exp(x - top) for x in scores]
                total = sum(weights)
                out[starts[s] + i, h] = sum(w / total * values[p, kv] for w, p in zip(weights, range(lo, pos + 1)))
    return out


CASES = {
    # (query lengths, sequence lengths)
    "decode, equal lengths": ([1, 1, 1], [33, 33, 33]),
    "decode, ragged": ([1, 1, 1, 1], [1, 17, 64, 150]),
    "mixed": ([1, 7, 1, 3], [40, 7, 129, 20]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("sliding_window", [None, 24])
@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_paged_attention_matches_written_out(case, sliding_window, group, dtype):
    q_lens, seq_lens = CASES[case]
    batch = _paged_batch(q_lens, seq_lens, num_heads=2 * group, num_kv_heads=2, head_dim=16,
                         block_size=8, dtype=dtype, seed=3)
    k_before, v_before = batch["k_cache"].clone(), batch["v_cache"].clone()
    scale = 16 ** -0.5
    actual = ref.paged_attention(**batch, scale=scale, sliding_window=sliding_window)
    expected = _written_out(batch, scale, sliding_window)
    assert actual.dtype == dtype and not actual.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(actual.double(), expected, atol=tol, rtol=tol)
    # The cache, NaN slots included, is left as it was.
    assert torch.equal(batch["k_cache"].nan_to_num(7.0), k_before.nan_to_num(7.0))
    assert torch.equal(batch["v_cache"].nan_to_num(7.0), v_before.nan_to_num(7.0))
