"""Which kernel the cuda backend's paged_attention picks for a prompt step, checked on
the CPU: the csrc op and Triton's kernel are replaced by recorders (their arithmetic is
tested on the CPU emulator and on an H200 by tests/gpu/check_csrc_ops.py)."""

from __future__ import annotations

import types

import pytest
import torch

from asyncgen._ops import cuda_backend, triton_backend


@pytest.fixture
def calls(monkeypatch):
    """The chunk_attention calls (num_splits, kernel, counters given) and Triton's, made
    by the backend for a device that has the warpgroup kernel."""
    record = []

    def chunk_attention(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, counters, scale,
                        num_splits, kernel=0):
        record.append(("csrc", num_splits, kernel, counters is not None))

    def triton_attention(q, *args, **kwargs):
        record.append(("triton",))
        return torch.empty_like(q)

    monkeypatch.setattr(torch.ops, "asyncgen_C", types.SimpleNamespace(chunk_attention=chunk_attention),
                        raising=False)
    monkeypatch.setattr(triton_backend, "ops", lambda: types.SimpleNamespace(paged_attention=triton_attention))
    monkeypatch.setattr(cuda_backend, "has_wgmma", lambda device: True)
    monkeypatch.setattr(cuda_backend, "_chunk_supported", lambda *args: True)
    monkeypatch.setattr(cuda_backend, "_check_same_cuda_device", lambda **tensors: None)
    return record


def prompt_step(num_tokens, seqs=8, heads=32, kv_heads=32):
    """Tensors of a prompt step in a graph with `seqs` sequence slots, one of them
    holding every token."""
    q = torch.zeros(num_tokens, heads, 128, dtype=torch.float16)
    cache = torch.zeros(4, 16, kv_heads, 128, dtype=torch.float16)
    tables = torch.zeros(seqs, 4, dtype=torch.int32)
    seq_lens = torch.zeros(seqs, dtype=torch.int32)
    starts = torch.full((seqs + 1,), num_tokens, dtype=torch.int32)
    starts[0] = 0
    return q, cache, cache.clone(), tables, seq_lens, starts


def attend(step):
    cuda_backend.paged_attention(*step, 0.1, max_query_len=step[0].shape[0], max_seq_len=4096)


@pytest.mark.parametrize("tokens, kv_heads", [(1152, 32), (256, 8)])
def test_a_prompt_that_fills_the_gpu_takes_the_warpgroup_kernel_in_one_pass(calls, tokens, kv_heads):
    # 9 query blocks x 32 kv heads; 8 blocks of 32 tokens x 8 kv heads, the least it takes.
    attend(prompt_step(tokens, kv_heads=kv_heads))
    assert calls == [("csrc", 1, 1, False)]


@pytest.mark.parametrize("tokens, kv_heads", [(80, 32), (224, 8), (112, 4)])
def test_a_chunk_with_too_few_query_blocks_stays_with_triton(calls, tokens, kv_heads):
    # Under 64 (query blocks x kv heads): a prefix-cache hit's 80 tokens at 32 kv heads
    # are 32 blocks; a block holds 32 tokens at 4 query heads a kv head, 16 at 8.
    attend(prompt_step(tokens, kv_heads=kv_heads))
    assert calls == [("triton",)]


def test_a_step_of_many_sequences_takes_the_mma_sync_kernel(calls):
    attend(prompt_step(80, seqs=9))
    assert calls == [("csrc", 1, 0, False)]


def test_a_sliding_window_stays_with_triton(calls):
    step = prompt_step(1152)
    cuda_backend.paged_attention(*step, 0.1, 256, max_query_len=1152, max_seq_len=4096)
    assert calls == [("triton",)]
