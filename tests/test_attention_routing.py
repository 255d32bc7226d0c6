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
    by the backend for a device that has the warpgroup kernel and 132 SMs."""
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
    monkeypatch.setattr(cuda_backend, "_multiprocessor_count", lambda device: 132)
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


def attend(step, **kwargs):
    cuda_backend.paged_attention(*step, 0.1, max_query_len=step[0].shape[0], max_seq_len=4096, **kwargs)


def test_a_prompt_that_fills_the_gpu_takes_the_warpgroup_kernel_in_one_pass(calls):
    attend(prompt_step(1152))  # 9 query blocks x 32 kv heads
    assert calls == [("csrc", 1, 1, False)]


def test_a_short_chunk_stays_with_triton_while_the_split_route_is_off(calls, monkeypatch):
    monkeypatch.setattr(cuda_backend, "CHUNK_WGMMA_MAX_SPLITS", 1)
    attend(prompt_step(80), split_counters=torch.zeros(8 * 32, dtype=torch.int32))
    assert calls == [("triton",)]


@pytest.mark.parametrize("tokens, kv_heads, splits", [(80, 32, 4), (80, 8, 5), (40, 4, 8)])
def test_a_short_chunk_splits_its_context_on_the_warpgroup_kernel_where_allowed(calls, monkeypatch, tokens,
                                                                                 kv_heads, splits):
    # 132 SMs over (query blocks x kv heads) blocks, at most CHUNK_WGMMA_MAX_SPLITS ways.
    monkeypatch.setattr(cuda_backend, "CHUNK_WGMMA_MAX_SPLITS", 8)
    attend(prompt_step(tokens, kv_heads=kv_heads), split_counters=torch.zeros(1024, dtype=torch.int32))
    assert calls == [("csrc", splits, 1, True)]


@pytest.mark.parametrize("counters", [None, torch.zeros(8 * 32 - 1, dtype=torch.int32),
                                      torch.zeros(8 * 32, dtype=torch.int64)], ids=["none", "short", "int64"])
def test_a_short_chunk_without_usable_counters_stays_with_triton(calls, monkeypatch, counters):
    # The 80-token graph with 8 slots numbers 8 query blocks a kv head: 256 counters.
    monkeypatch.setattr(cuda_backend, "CHUNK_WGMMA_MAX_SPLITS", 8)
    attend(prompt_step(80), split_counters=counters)
    assert calls == [("triton",)]


@pytest.mark.parametrize("raw, value", [("", 1), ("4", 4), (" 16 ", 16)])
def test_the_split_route_switch_reads_the_environment(monkeypatch, raw, value):
    monkeypatch.setenv("ASYNCGEN_CHUNK_WGMMA_SPLITS", raw)
    assert cuda_backend._max_splits_from_env("ASYNCGEN_CHUNK_WGMMA_SPLITS", 1) == value


@pytest.mark.parametrize("raw", ["0", "17", "four"])
def test_a_bad_split_route_switch_is_named(monkeypatch, raw):
    monkeypatch.setenv("ASYNCGEN_CHUNK_WGMMA_SPLITS", raw)
    with pytest.raises(ValueError, match="ASYNCGEN_CHUNK_WGMMA_SPLITS"):
        cuda_backend._max_splits_from_env("ASYNCGEN_CHUNK_WGMMA_SPLITS", 1)
