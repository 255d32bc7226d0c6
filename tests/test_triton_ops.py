"""The Triton backend against the torch references, on random inputs.

Runs on the CPU through the Triton interpreter: ``TRITON_INTERPRET=1`` is set here, before
any kernel module is imported, unless the environment already sets it (run with
``TRITON_INTERPRET=0`` on a CUDA machine to test the compiled kernels on the GPU).
Sizes are small because the interpreter executes every program in Python.

Interpreter notes that shape the tolerances: it rounds fp32 -> bf16 by truncation (the
GPU rounds to nearest even), so bf16 results may differ from the reference by an ulp.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from asyncgen._ops import get_ops  # noqa: E402
from asyncgen._ops import reference as ref  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs a CUDA device", allow_module_level=True)
DEVICE = "cpu" if INTERPRET else "cuda"

OPS = get_ops("triton")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (atol, rtol) per dtype: fp32 exact to rounding, 16-bit types to an ulp or two (bf16 to
# about four under the interpreter, whose truncating casts compound through the fused
# ops: a truncated residual sum is normalised, truncated, then scaled and truncated).
TOL = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (3e-3, 3e-3),
    torch.bfloat16: (2e-2, 3e-2) if INTERPRET else (1e-2, 1.6e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol)


def randn(*shape: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


# ----------------------------------------------------------------------------------------
# rms_norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("shape", [(7, 128), (3, 4096), (2, 3, 96)])
def test_rms_norm_matches_reference(dtype, with_residual, shape):
    gen = torch.Generator().manual_seed(1)
    x = randn(*shape, dtype=dtype, gen=gen) * 3
    weight = randn(shape[-1], dtype=dtype, gen=gen)
    residual = randn(*shape, dtype=dtype, gen=gen) if with_residual else None
    x_before = x.clone()

    normed, res = OPS.rms_norm(x, weight, 1e-6, residual)
    normed_ref, res_ref = ref.rms_norm(x, weight, 1e-6, residual)

    assert normed.dtype == normed_ref.dtype and normed.shape == normed_ref.shape
    assert_close(normed, normed_ref, dtype)
    assert_close(res, res_ref, dtype)
    assert torch.equal(x, x_before)  # inputs untouched
    if not with_residual:
        assert res is x


def test_rms_norm_in_place_outputs():
    gen = torch.Generator().manual_seed(2)
    x = randn(5, 256, dtype=torch.float16, gen=gen)
    residual = randn(5, 256, dtype=torch.float16, gen=gen)
    weight = randn(256, dtype=torch.float16, gen=gen)
    normed_ref, res_ref = ref.rms_norm(x, weight, 1e-5, residual)

    normed, res = OPS.rms_norm(x, weight, 1e-5, residual, out=x, residual_out=residual)

    assert normed is x and res is residual
    assert_close(normed, normed_ref, torch.float16)
    assert_close(res, res_ref, torch.float16)


def test_rms_norm_fp32_weight_promotes_like_reference():
    gen = torch.Generator().manual_seed(3)
    x = randn(4, 64, dtype=torch.bfloat16, gen=gen)
    weight = randn(64, dtype=torch.float32, gen=gen)
    normed, _ = OPS.rms_norm(x, weight, 1e-6)
    normed_ref, _ = ref.rms_norm(x, weight, 1e-6)
    assert normed.dtype == torch.float32
    assert_close(normed, normed_ref, torch.bfloat16)


def test_rms_norm_strided_rows():
    gen = torch.Generator().manual_seed(4)
    wide = randn(6, 300, dtype=torch.float16, gen=gen)
    x = wide[:, :200]  # row stride 300
    weight = randn(200, dtype=torch.float16, gen=gen)
    normed, _ = OPS.rms_norm(x, weight, 1e-6)
    assert_close(normed, ref.rms_norm(x, weight, 1e-6)[0], torch.float16)


# ----------------------------------------------------------------------------------------
# rotary_embedding


def _cos_sin_cache(max_position: int, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(DEVICE)  # [max_position, head_dim]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 64), (8, 2, 128), (6, 1, 80)])
def test_rotary_matches_reference(dtype, num_heads, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(5)
    num_tokens = 9
    cache = _cos_sin_cache(4096, head_dim)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen).to(DEVICE)
    q = randn(num_tokens, num_heads, head_dim, dtype=dtype, gen=gen)
    k = randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    q_ref, k_ref = q.clone(), k.clone()

    OPS.rotary_embedding(positions, q, k, cache)
    ref.rotary_embedding(positions, q_ref, k_ref, cache)

    assert_close(q, q_ref, dtype)
    assert_close(k, k_ref, dtype)


def test_rotary_on_views_of_fused_qkv():
    gen = torch.Generator().manual_seed(6)
    num_tokens, num_heads, num_kv_heads, head_dim = 5, 4, 2, 64
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=torch.float16, gen=gen)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
    k = qkv[:, q_size:q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    v_before = qkv[:, q_size + kv_size:].clone()
    positions = torch.tensor([0, 3, 17, 100, 5], device=DEVICE)
    cache = _cos_sin_cache(128, head_dim)
    q_ref, k_ref = q.clone(), k.clone()

    OPS.rotary_embedding(positions, q, k, cache)
    ref.rotary_embedding(positions, q_ref, k_ref, cache)

    assert_close(q, q_ref, torch.float16)
    assert_close(k, k_ref, torch.float16)
    assert torch.equal(qkv[:, q_size + kv_size:], v_before)  # v untouched


# ----------------------------------------------------------------------------------------
# silu_and_mul


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 2 * 96), (3, 2 * 1500), (2, 2, 2 * 64)])
def test_silu_and_mul_matches_reference(dtype, shape):
    gen = torch.Generator().manual_seed(7)
    x = randn(*shape, dtype=dtype, gen=gen) * 4
    assert_close(OPS.silu_and_mul(x), ref.silu_and_mul(x), dtype)


def test_silu_and_mul_into_out():
    gen = torch.Generator().manual_seed(8)
    x = randn(4, 2 * 80, dtype=torch.bfloat16, gen=gen)
    out = torch.empty(4, 80, dtype=torch.bfloat16, device=DEVICE)
    assert OPS.silu_and_mul(x, out=out) is out
    assert_close(out, ref.silu_and_mul(x), torch.bfloat16)


# ----------------------------------------------------------------------------------------
# store_kv_cache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(2, 64, 16), (3, 128, 8)])
def test_store_kv_cache_matches_reference(dtype, num_kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(9)
    num_blocks, num_tokens = 6, 11
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7]] = -1  # padding tokens
    slot_mapping = slots.to(DEVICE)
    key = randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    value = randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    OPS.store_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    ref.store_kv_cache(key, value, k_ref, v_ref, slot_mapping)

    assert torch.equal(k_cache.isnan(), k_ref.isnan())
    assert torch.equal(k_cache.nan_to_num(), k_ref.nan_to_num())
    assert torch.equal(v_cache.nan_to_num(), v_ref.nan_to_num())


def test_store_kv_cache_from_qkv_views_int32_slots():
    gen = torch.Generator().manual_seed(10)
    num_tokens, num_kv_heads, head_dim, block_size = 4, 2, 64, 16
    qkv = randn(num_tokens, 3 * num_kv_heads * head_dim, dtype=torch.float16, gen=gen)
    size = num_kv_heads * head_dim
    key = qkv[:, size:2 * size].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, 2 * size:].view(num_tokens, num_kv_heads, head_dim)
    slot_mapping = torch.tensor([33, -1, 0, 17], dtype=torch.int32, device=DEVICE)
    k_cache = torch.zeros(3, block_size, num_kv_heads, head_dim, dtype=torch.float16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    OPS.store_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    ref.store_kv_cache(key, value, k_ref, v_ref, slot_mapping.long())

    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


# ----------------------------------------------------------------------------------------
# paged_attention

GARBAGE_BLOCK = 1 << 30  # block-table entries no valid key maps to; reading one would fault


def make_attention_batch(
    q_lens: list[int],
    seq_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> dict:
    """A paged batch with shuffled, non-contiguous block ids. Cache slots no sequence owns
    (unused blocks, the tail of each last block) hold NaN; unused block-table entries
    hold an id far past the cache. Block 0, where the reference points those entries, is
    never handed out: it holds NaN."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    v_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    block_tables = torch.full((len(seq_lens), max(blocks_per_seq) + 2), GARBAGE_BLOCK, dtype=torch.int32)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    for b, n in enumerate(seq_lens):
        for j in range(blocks_per_seq[b]):
            block = free.pop()
            block_tables[b, j] = block
            used = min(block_size, n - j * block_size)
            k_cache[block, :used] = torch.randn(used, num_kv_heads, head_dim, generator=gen).to(dtype)
            v_cache[block, :used] = torch.randn(used, num_kv_heads, head_dim, generator=gen).to(dtype)
    query_start_loc = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(q_lens).cumsum(0)
    q = torch.randn(int(query_start_loc[-1]), num_heads, head_dim, generator=gen).to(dtype)
    return dict(
        q=q.to(DEVICE),
        k_cache=k_cache.to(DEVICE),
        v_cache=v_cache.to(DEVICE),
        block_tables=block_tables.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        query_start_loc=query_start_loc.to(DEVICE),
    )


def run_both(batch: dict, *, sliding_window=None, **hints) -> tuple[torch.Tensor, torch.Tensor]:
    scale = batch["q"].shape[-1] ** -0.5
    expected = ref.paged_attention(**batch, scale=scale, sliding_window=sliding_window)
    actual = OPS.paged_attention(**batch, scale=scale, sliding_window=sliding_window, **hints)
    assert not actual.isnan().any()
    return actual, expected


# (query lengths, sequence lengths): decode-only, prefill-only, mixed, chunked prefill
# (queries after cached context), ragged lengths with an idle sequence (0 queries).
SCENARIOS = {
    "decode": ([1, 1, 1, 1], [1, 17, 64, 150]),
    "prefill": ([20, 3, 70], [20, 3, 70]),
    "mixed": ([1, 37, 1, 5], [40, 37, 129, 5]),
    "chunked": ([16, 33], [80, 100]),
    "ragged": ([2, 0, 9, 1, 19], [2, 12, 30, 200, 64]),
}


def _attention_written_out(batch: dict, scale: float, sliding_window) -> torch.Tensor:
    """Each query row of each head on its own: softmax over the keys it may see (found
    through the block table one position at a time), times their values; fp64."""
    q, k_cache, v_cache = (batch[n].cpu() for n in ("q", "k_cache", "v_cache"))
    tables, starts, lens = batch["block_tables"].cpu(), batch["query_start_loc"].tolist(), batch["seq_lens"].tolist()
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    for s, n in enumerate(lens):
        slots = [(int(tables[s, p // block_size]), p % block_size) for p in range(n)]
        keys = torch.stack([k_cache[b, o] for b, o in slots]).double() if n else None  # [n, kvh, d]
        values = torch.stack([v_cache[b, o] for b, o in slots]).double() if n else None
        q_len = starts[s + 1] - starts[s]
        for i in range(q_len):
            pos = n - q_len + i  # the query's own position
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            for h in range(q.shape[1]):
                kv = h // group
                scores = keys[lo : pos + 1, kv] @ q[starts[s] + i, h].double() * scale
                weights = (scores - scores.max()).exp()
                out[starts[s] + i, h] = (weights / weights.sum()) @ values[lo : pos + 1, kv]
    return out


REFERENCE_SCENARIOS = {**SCENARIOS, "decode, equal lengths": ([1, 1, 1], [33, 33, 33]),
                       "decode, many": ([1] * 6, [3, 40, 17, 90, 8, 33])}  # (past the CPU engine's one-by-one)


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU engine's form")
@pytest.mark.parametrize("layout", ["qkv buffer", "separate", "bf16", "padding slot"])
def test_cpu_engine_rotary_store_kv_gives_the_references_bits(layout, monkeypatch):
    """The CPU engine's rotary + cache write (fewer ops; q and k rotated as one tensor
    where k follows q in the qkv projection's output) writes exactly what the reference
    writes, into q, k and both caches; other dtypes and padding slots take the reference."""
    gen = torch.Generator().manual_seed(11)
    tokens, heads, kv_heads, d = 5, 6, 2, 16
    dtype = torch.bfloat16 if layout == "bf16" else torch.float32
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    q = qkv[:, :heads * d].view(tokens, heads, d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(tokens, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d:].view(tokens, kv_heads, d)
    if layout == "separate":  # (Qwen3: q and k normed into their own tensors)
        q, k = q.contiguous(), k.contiguous()
    cos_sin = torch.randn(64, d, generator=gen)
    positions = torch.randperm(64, generator=gen)[:tokens]
    slots = torch.randperm(40, generator=gen)[:tokens]
    if layout == "padding slot":
        slots[2] = -1
    reference, fallbacks = ref.rotary_store_kv, []
    monkeypatch.setattr(ref, "rotary_store_kv", lambda *args: fallbacks.append(1) or reference(*args))
    results = []
    for fn in (reference, ref._rotary_store_kv_fp32):
        qq, kk, vv = (t.clone() for t in (q, k, v))
        if layout == "qkv buffer":  # keep k right after q in one buffer, as the model's views are
            buf = qkv.clone()
            qq = buf[:, :heads * d].view(tokens, heads, d)
            kk = buf[:, heads * d:(heads + kv_heads) * d].view(tokens, kv_heads, d)
        k_cache = torch.full((5, 8, kv_heads, d), float("nan"), dtype=dtype)
        v_cache = k_cache.clone()
        fn(positions, qq, kk, vv, cos_sin, k_cache, v_cache, slots)
        results.append((qq, kk, k_cache.nan_to_num(7.0), v_cache.nan_to_num(7.0)))
    for want, got in zip(*results):
        assert torch.equal(want, got)
    assert not torch.equal(results[0][0], q)  # (it did rotate)
    assert len(fallbacks) == (layout in ("bf16", "padding slot"))


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("sliding_window", [None, 24])
@pytest.mark.parametrize("scenario", sorted(REFERENCE_SCENARIOS))
def test_reference_paged_attention_matches_attention_written_out(scenario, sliding_window, group, dtype, exact):
    """The reference (the oracle of the kernel tests, ``exact``) batches decode queries
    and masks slots outside each window; the CPU engine's form (``exact=False``) reads
    each decode query's window alone. Written out row by row both must agree, and leave
    the cache (NaN slots included) as it was."""
    q_lens, seq_lens = REFERENCE_SCENARIOS[scenario]
    batch = make_attention_batch(q_lens, seq_lens, num_heads=2 * group, num_kv_heads=2, head_dim=16,
                                 block_size=8, dtype=dtype, seed=3)
    k_before, v_before = batch["k_cache"].clone(), batch["v_cache"].clone()
    scale = 16 ** -0.5
    actual = ref.paged_attention(**batch, scale=scale, sliding_window=sliding_window, exact=exact)
    expected = _attention_written_out(batch, scale, sliding_window)
    assert actual.dtype == dtype and not actual.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(actual.cpu().double(), expected, atol=tol, rtol=tol)
    assert torch.equal(batch["k_cache"].nan_to_num(7.0), k_before.nan_to_num(7.0))
    assert torch.equal(batch["v_cache"].nan_to_num(7.0), v_before.nan_to_num(7.0))


@pytest.mark.skipif(DEVICE != "cpu", reason="the bf16 prompt path is the CPU engine's")
@pytest.mark.parametrize("sliding_window", [None, 24])
@pytest.mark.parametrize("scenario", ["prefill", "mixed", "chunked"])
def test_reference_runs_bf16_prompts_in_bf16_when_not_exact(scenario, sliding_window, monkeypatch):
    """``exact=False``, the CPU engine's ops: a bf16 prompt's attention runs torch's fused
    kernel in bf16 (decode queries in fp32) and still agrees with the attention written
    out, to bf16's precision; ``exact=True``, the kernels' oracle, stays in fp32."""
    q_lens, seq_lens = SCENARIOS[scenario]
    batch = make_attention_batch(q_lens, seq_lens, num_heads=6, num_kv_heads=2, head_dim=16,
                                 block_size=8, dtype=torch.bfloat16, seed=3)
    seen = []
    fused = ref.F.scaled_dot_product_attention

    def recording(q, *args, **kwargs):
        seen.append((q.shape[2], q.dtype))  # (query rows, dtype)
        return fused(q, *args, **kwargs)

    monkeypatch.setattr(ref.F, "scaled_dot_product_attention", recording)
    scale = 16 ** -0.5
    fast = ref.paged_attention(**batch, scale=scale, sliding_window=sliding_window, exact=False)
    prompts = sum(n > 1 for n in q_lens)
    assert sorted(seen) == sorted([(1, torch.float32)] * q_lens.count(1) + [(n, torch.bfloat16) for n in q_lens
                                                                            if n > 1])
    seen.clear()
    ref.paged_attention(**batch, scale=scale, sliding_window=sliding_window)
    assert len(seen) == prompts and {dt for _, dt in seen} == {torch.float32}  # (decode: batched products)
    expected = _attention_written_out(batch, scale, sliding_window)
    assert fast.dtype == torch.bfloat16 and not fast.isnan().any()
    torch.testing.assert_close(fast.double(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_paged_attention_batches(dtype, scenario):
    q_lens, seq_lens = SCENARIOS[scenario]
    batch = make_attention_batch(q_lens, seq_lens, num_heads=8, num_kv_heads=2, head_dim=64,
                                 block_size=16, dtype=dtype, seed=11)
    actual, expected = run_both(batch, max_query_len=max(q_lens))
    assert_close(actual, expected, dtype)


def test_paged_attention_more_sequences_than_one_chunk_of_starts():
    # 150 sequences: the general kernel finds each program's sequence over three chunks
    # of 64 starts (the last one partial); idle sequences and chunks of several tokens
    # sit on both sides of the chunk boundaries.
    gen = torch.Generator().manual_seed(5)
    q_lens = [int(n) for n in torch.randint(0, 4, (150,), generator=gen)]
    q_lens[63], q_lens[64], q_lens[127], q_lens[128] = 3, 2, 0, 5
    seq_lens = [q + int(c) for q, c in zip(q_lens, torch.randint(0, 40, (150,), generator=gen))]
    seq_lens = [max(n, 1) for n in seq_lens]
    batch = make_attention_batch(q_lens, seq_lens, num_heads=4, num_kv_heads=2, head_dim=32,
                                 block_size=16, dtype=torch.float32, seed=12)
    actual, expected = run_both(batch, max_query_len=max(q_lens))
    assert_close(actual, expected, torch.float32)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_paged_attention_gqa_and_head_dims(group, head_dim):
    num_kv_heads = 2 if group < 8 else 1
    batch = make_attention_batch([1, 13, 4], [50, 13, 36], num_heads=group * num_kv_heads,
                                 num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=16,
                                 dtype=torch.float16, seed=12)
    actual, expected = run_both(batch)  # no hints: the general kernel, default tiles
    assert_close(actual, expected, torch.float16)


@pytest.mark.parametrize("head_dim", [32, 256])
def test_paged_attention_other_head_dims(head_dim):
    batch = make_attention_batch([1, 6], [33, 40], num_heads=4, num_kv_heads=2, head_dim=head_dim,
                                 block_size=8, dtype=torch.bfloat16, seed=13)
    actual, expected = run_both(batch, max_query_len=6)
    assert_close(actual, expected, torch.bfloat16)


@pytest.mark.parametrize("head_dim", [8, 40, 80, 96])
@pytest.mark.parametrize("kernel", ["decode", "decode, split", "general", "general, split"])
def test_paged_attention_head_dims_not_powers_of_two(head_dim, kernel):
    """Tiles wider than the head (Mistral-style head_dim 80, 96; 8 below tl.dot's 16):
    the columns past it are masked. Past the last kv head of a slot lie the next slot's
    values, NaN where no sequence owns it, so an unmasked load shows up in the result.
    ``out`` is a view of a wider buffer whose other columns must stay as they were."""
    decode = kernel.startswith("decode")
    q_lens, seq_lens = ([1, 1, 0, 1], [5, 70, 9, 130]) if decode else ([3, 1, 0, 17], [40, 70, 9, 17])
    batch = make_attention_batch(q_lens, seq_lens, num_heads=6, num_kv_heads=2, head_dim=head_dim,
                                 block_size=8, dtype=torch.float16, seed=head_dim)
    scale = head_dim ** -0.5
    expected = ref.paged_attention(**batch, scale=scale)
    wide = torch.full((batch["q"].shape[0], 6, head_dim + 5), 7.0, dtype=torch.float16, device=DEVICE)
    out = wide[:, :, :head_dim]
    OPS.paged_attention(**batch, scale=scale, out=out, max_query_len=1 if decode else max(q_lens),
                        num_splits=3 if kernel.endswith("split") else 1)
    assert not out.isnan().any()
    assert_close(out, expected, torch.float16)
    assert torch.equal(wide[:, :, head_dim:], torch.full_like(wide[:, :, head_dim:], 7.0))


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_paged_attention_decode_kernel(group, head_dim):
    num_kv_heads = 2 if group < 8 else 1
    batch = make_attention_batch([1, 1, 0, 1], [1, 70, 9, 130], num_heads=group * num_kv_heads,
                                 num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=16,
                                 dtype=torch.float16, seed=14)
    actual, expected = run_both(batch, max_query_len=1, num_splits=1)
    rows = [0, 1, 2]  # the idle sequence has no query row
    assert_close(actual[rows], expected[rows], torch.float16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [2, 3, 8])
def test_paged_attention_split_k(dtype, num_splits):
    # Long contexts over few sequences; splits that get no key tile must not disturb the
    # result (the 3-token context has one tile for 2..8 splits).
    batch = make_attention_batch([1, 1, 1], [300, 3, 517], num_heads=8, num_kv_heads=2, head_dim=64,
                                 block_size=16, dtype=dtype, seed=15)
    actual, expected = run_both(batch, max_query_len=1, num_splits=num_splits)
    assert_close(actual, expected, dtype)


def test_paged_attention_split_k_chosen_automatically():
    from asyncgen._ops.triton_paged_attention import _decode_config, _num_splits

    block_n = _decode_config(64, torch.float16)[0]
    # 2 sequences x 1 kv head on 132 SMs with 2048-token contexts: the launcher splits;
    # a full batch or a short context does not.
    assert _num_splits(2, 1, 2048, block_n, 132) > 1
    assert _num_splits(512, 8, 2048, block_n, 132) == 1
    assert _num_splits(2, 1, 64, block_n, 132) == 1
    batch = make_attention_batch([1, 1], [700, 1000], num_heads=4, num_kv_heads=1, head_dim=64,
                                 block_size=16, dtype=torch.float16, seed=16)
    actual, expected = run_both(batch, max_query_len=1)
    assert_close(actual, expected, torch.float16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [2, 3, 8])
def test_paged_attention_prefill_split_k(dtype, num_splits):
    # The general kernel with its context split: chunks after a long cached prefix, a
    # prompt from scratch (its early tiles see no keys in most splits), a decode row, an
    # idle sequence, and query tiles that end mid-tile.
    q_lens, seq_lens = [19, 1, 0, 40, 5], [300, 170, 12, 40, 517]
    batch = make_attention_batch(q_lens, seq_lens, num_heads=8, num_kv_heads=2, head_dim=64,
                                 block_size=16, dtype=dtype, seed=21)
    actual, expected = run_both(batch, max_query_len=max(q_lens), num_splits=num_splits)
    assert_close(actual, expected, dtype)


def test_paged_attention_prefill_split_k_chosen_automatically():
    from asyncgen._ops.triton_paged_attention import _general_config, _prefill_splits

    block_m, block_n = _general_config(128, 1, 128, torch.float16)[:2]
    # 7B shapes on 132 SMs: 78 queries over a cached context of 4096 (one sequence, or the
    # engine's narrow prompt graph of 8 slots) are split; a prompt of 2048 tokens fills the
    # GPU alone; a mixed batch of many sequences, or a context of two tiles, is not split.
    assert _prefill_splits(78, 1, 32, 32, 128, block_m, 4096, block_n, 132) == 4
    assert _prefill_splits(128, 8, 32, 32, 128, block_m, 4096, block_n, 132) == 4
    assert _prefill_splits(2048, 1, 32, 32, 128, 128, 4096, block_n, 132) == 1
    assert _prefill_splits(128, 129, 32, 32, 128, block_m, 4096, block_n, 132) == 1
    assert _prefill_splits(78, 1, 32, 32, 128, block_m, 2 * block_n, block_n, 132) == 1
    # The partials stay under their byte budget.
    assert _prefill_splits(2048, 1, 64, 1, 128, 128, 1 << 16, block_n, 132) == 1
    batch = make_attention_batch([7, 3], [700, 1000], num_heads=4, num_kv_heads=1, head_dim=64,
                                 block_size=16, dtype=torch.float16, seed=22)
    actual, expected = run_both(batch, max_query_len=7)
    assert_close(actual, expected, torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_query_len,num_splits", [(None, None), (None, 3), (1, 1), (1, 4)])
def test_paged_attention_sliding_window(dtype, max_query_len, num_splits):
    window = 24
    if max_query_len == 1:
        q_lens, seq_lens = [1, 1, 1], [10, 100, 211]
    else:
        q_lens, seq_lens = [1, 40, 7], [100, 90, 31]
    batch = make_attention_batch(q_lens, seq_lens, num_heads=4, num_kv_heads=2, head_dim=64,
                                 block_size=8, dtype=dtype, seed=17)
    expected = ref.paged_attention(**batch, scale=0.125, sliding_window=window)
    # Keys before every query's window may be gone: poison them and unmap whole blocks
    # (an engine may free blocks that fell out of the window).
    block_size = batch["k_cache"].shape[1]
    starts = batch["query_start_loc"].tolist()
    for b, n in enumerate(seq_lens):
        first_query_pos = n - (starts[b + 1] - starts[b])
        lowest_needed = max(0, first_query_pos - window + 1)
        for pos in range(lowest_needed):
            block = int(batch["block_tables"][b, pos // block_size])
            if block != GARBAGE_BLOCK:
                batch["k_cache"][block, pos % block_size] = float("nan")
                batch["v_cache"][block, pos % block_size] = float("nan")
        batch["block_tables"][b, : lowest_needed // block_size] = GARBAGE_BLOCK

    actual = OPS.paged_attention(**batch, scale=0.125, sliding_window=window, max_query_len=max_query_len,
                                 num_splits=num_splits)
    assert_close(actual, expected, dtype)


def test_paged_attention_strided_q_and_out():
    num_heads, num_kv_heads, head_dim = 4, 2, 64
    batch = make_attention_batch([3, 1], [20, 9], num_heads=num_heads, num_kv_heads=num_kv_heads,
                                 head_dim=head_dim, block_size=16, dtype=torch.float16, seed=18)
    gen = torch.Generator().manual_seed(19)
    qkv = randn(4, (num_heads + 2 * num_kv_heads) * head_dim, dtype=torch.float16, gen=gen)
    q = qkv[:, : num_heads * head_dim].view(4, num_heads, head_dim)  # token stride 512
    batch["q"] = q
    out_storage = torch.zeros(4, num_heads, 2 * head_dim, dtype=torch.float16, device=DEVICE)
    out = out_storage[:, :, :head_dim]  # head stride 128

    result = OPS.paged_attention(**batch, scale=0.125, out=out)
    expected = ref.paged_attention(**batch, scale=0.125)

    assert result is out
    assert_close(out, expected, torch.float16)
    assert not out_storage[:, :, head_dim:].any()


def test_paged_attention_long_prefill_many_query_tiles():
    # More queries than one query tile at the default config, int64 index tensors.
    batch = make_attention_batch([150, 1], [170, 20], num_heads=2, num_kv_heads=2, head_dim=32,
                                 block_size=16, dtype=torch.float32, seed=20)
    batch["query_start_loc"] = batch["query_start_loc"].long()
    batch["seq_lens"] = batch["seq_lens"].long()
    actual, expected = run_both(batch)
    assert_close(actual, expected, torch.float32)


# ----------------------------------------------------------------------------------------
# Launcher validation


def _small_batch() -> dict:
    return make_attention_batch([1, 2], [5, 2], num_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
                                dtype=torch.float16)


@pytest.mark.parametrize(
    "change,name",
    [
        (lambda b: b.update(q=b["q"].float()), "k_cache"),
        (lambda b: b.update(q=b["q"][:, :3]), "num_heads"),
        (lambda b: b.update(v_cache=b["v_cache"][:, :8]), "v_cache"),
        (lambda b: b.update(block_tables=b["block_tables"].float()), "block_tables"),
        (lambda b: b.update(seq_lens=b["seq_lens"][:1]), "block_tables"),
        (lambda b: b.update(query_start_loc=b["query_start_loc"][:2]), "query_start_loc"),
        (lambda b: b.update(q=b["q"].transpose(1, 2).contiguous().transpose(1, 2)), "q"),
        (lambda b: b.update(q=b["q"][..., :24].contiguous()), "head_dim"),
        (lambda b: b.update(**{n: torch.cat([b[n]] * 9, dim=-1) for n in ("q", "k_cache", "v_cache")}),
         "head_dim"),  # 288, past the widest tile
    ],
)
def test_paged_attention_rejects_bad_arguments(change, name):
    batch = _small_batch()
    change(batch)
    with pytest.raises(ValueError, match=name):
        OPS.paged_attention(**batch, scale=0.1)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(sliding_window=0), "sliding_window"),
        (dict(num_splits=0), "num_splits"),
        (dict(max_query_len=-1), "max_query_len"),
        (dict(out=torch.empty(3, 4, 32, dtype=torch.float32)), "out"),
    ],
)
def test_paged_attention_rejects_bad_options(kwargs, name):
    with pytest.raises(ValueError, match=name):
        OPS.paged_attention(**_small_batch(), scale=0.1, **kwargs)


def test_elementwise_launchers_reject_bad_arguments():
    x = torch.randn(4, 64, device=DEVICE)
    w = torch.randn(64, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        OPS.rms_norm(x, w[:32], 1e-6)
    with pytest.raises(ValueError, match="residual"):
        OPS.rms_norm(x, w, 1e-6, x.half())
    with pytest.raises(ValueError, match="x"):
        OPS.rms_norm(x.long(), w, 1e-6)
    with pytest.raises(ValueError, match="x"):
        OPS.silu_and_mul(x[:, :63])
    with pytest.raises(ValueError, match="x"):
        OPS.silu_and_mul(x.t())
    with pytest.raises(ValueError, match="out"):
        OPS.silu_and_mul(x, out=torch.empty(4, 64, device=DEVICE))

    q, k = torch.randn(3, 4, 64, device=DEVICE), torch.randn(3, 2, 64, device=DEVICE)
    cache = torch.randn(16, 64, device=DEVICE)
    with pytest.raises(ValueError, match="positions"):
        OPS.rotary_embedding(torch.zeros(3, device=DEVICE), q, k, cache)
    with pytest.raises(ValueError, match="k"):
        OPS.rotary_embedding(torch.zeros(3, dtype=torch.long, device=DEVICE), q, k.half(), cache)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        OPS.rotary_embedding(torch.zeros(3, dtype=torch.long, device=DEVICE), q, k, cache[:, :32])

    kv_cache = torch.zeros(2, 16, 2, 64, device=DEVICE)
    slots = torch.zeros(3, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping"):
        OPS.store_kv_cache(k, k, kv_cache, kv_cache, slots.float())
    with pytest.raises(ValueError, match="k_cache"):
        OPS.store_kv_cache(k, k, kv_cache[:, :, :1], kv_cache[:, :, :1], slots)
    with pytest.raises(ValueError, match="value"):
        OPS.store_kv_cache(k, k[:2], kv_cache, kv_cache, slots)


@pytest.mark.parametrize("scenario", ["decode", "mixed"])
def test_rotary_attention_matches_reference(scenario):
    """The layer's rotary, cache write and attention in one call, against the reference
    composition: same output, same cache contents at the step's slots."""
    q_lens, seq_lens = SCENARIOS[scenario]
    batch = make_attention_batch(q_lens, seq_lens, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                                 dtype=torch.float16, seed=5)
    gen = torch.Generator().manual_seed(9)
    tables = batch["block_tables"].cpu()
    positions, slots = [], []
    for b, (q_len, n) in enumerate(zip(q_lens, seq_lens)):
        for pos in range(n - q_len, n):
            positions.append(pos)
            slots.append(int(tables[b, pos // 16]) * 16 + pos % 16)
    num_tokens = len(positions)
    kv = torch.randn(num_tokens, 4, 64, generator=gen).to(torch.float16).to(DEVICE)
    args = dict(positions=torch.tensor(positions, device=DEVICE), cos_sin_cache=_cos_sin_cache(256, 64),
                slot_mapping=torch.tensor(slots, device=DEVICE), block_tables=batch["block_tables"],
                seq_lens=batch["seq_lens"], query_start_loc=batch["query_start_loc"], scale=0.125)
    results = []
    for fn in (ref.rotary_attention, OPS.rotary_attention):
        k_cache, v_cache = batch["k_cache"].clone(), batch["v_cache"].clone()
        q, k, v = batch["q"].clone(), kv[:, :2].clone(), kv[:, 2:].clone()
        out = fn(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, **args, max_query_len=max(q_lens),
                 max_seq_len=max(seq_lens))
        results.append((out, k_cache.view(-1, 2, 64)[args["slot_mapping"]], v_cache.view(-1, 2, 64)[args["slot_mapping"]]))
    (out_ref, k_ref, v_ref), (out, k_got, v_got) = results
    assert_close(out, out_ref, torch.float16)
    assert_close(k_got, k_ref, torch.float16)
    assert torch.equal(v_got, v_ref)


def test_get_ops_triton_bundle():
    assert OPS.name == "triton"
    for name in ("rms_norm", "rotary_embedding", "silu_and_mul", "store_kv_cache", "paged_attention",
                 "rotary_store_kv", "rotary_attention"):
        assert callable(getattr(OPS, name))


def test_dependent_launch_only_for_small_batches(monkeypatch):
    """The elementwise kernels wait for the kernel ahead (launch_pdl) only at decode batch
    sizes, and never on the CPU interpreter (where gdc_wait does not exist)."""
    from asyncgen._ops import triton_backend as tb
    from asyncgen._ops.triton_rms_norm import _rms_norm_kernel

    x = torch.zeros(3, 8)
    assert tb.dependent_launch_options(_rms_norm_kernel, x) == {"DEPENDENT": False}
    monkeypatch.setattr(tb, "launches_dependents", lambda kernel, t: True)
    monkeypatch.setattr(tb, "_triton_launches_pdl", lambda: True)
    rows = tb.DEPENDENT_MAX_ROWS
    assert tb.dependent_launch_options(_rms_norm_kernel, torch.zeros(rows, 8)) == {"DEPENDENT": True, "launch_pdl": True}
    assert tb.dependent_launch_options(_rms_norm_kernel, torch.zeros(rows + 1, 8)) == {"DEPENDENT": False}
