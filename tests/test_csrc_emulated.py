"""The csrc kernels (csrc/*.cuh) run on the CPU through tests/csrc_emu, against the torch
reference. This checks the kernels' indexing, masking, split-K merge and cross-lane logic
where no GPU exists; speed and the torch glue are checked on a GPU by
tests/gpu/check_csrc_ops.py. Skipped without a C++20 compiler or the CUDA headers.
"""

from __future__ import annotations

import pytest
import torch

from asyncgen._ops import cuda_backend, reference
from csrc_emu import harness
from csrc_emu.cases import (
    ROTARY_LAYOUTS,
    make_chunk_case,
    make_decode_case,
    make_rotary_decode_case,
    make_rotary_store_case,
    make_store_case,
    relative_error,
)

TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.fixture(scope="module")
def emu(request, tmp_path_factory):
    cache = getattr(request.config, "cache", None)  # reuses the build across runs
    out_dir = cache.mkdir("csrc_emu") if cache is not None else tmp_path_factory.mktemp("csrc_emu")
    emulator = harness.build(out_dir)
    if emulator is None:
        pytest.skip("needs a C++ compiler and the CUDA headers (cuda_fp16.h)")
    return emulator


def run_decode(emu, case, *, partition_size=-1, max_seq_len=None, num_sms=132):
    out = torch.full_like(case.q, float("nan"))
    parts = emu.paged_attention_decode(
        out, case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale,
        case.max_seq_len if max_seq_len is None else max_seq_len, case.sliding_window or 0,
        partition_size, num_sms,
    )
    ref = reference.paged_attention(
        case.q, case.k_cache_ref, case.v_cache_ref, case.block_tables, case.seq_lens,
        case.query_start_loc, case.scale, case.sliding_window,
    )
    return out, ref, parts


# (num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_len, window)
SHAPES = [
    (3, 4, 4, 128, 16, 150, None),    # MHA
    (3, 8, 2, 128, 16, 203, None),    # GQA 4
    (2, 16, 2, 64, 16, 170, None),    # GQA 8
    (2, 6, 1, 128, 32, 97, None),     # GQA 6: heads padded to 8, block_size 32
    (2, 24, 2, 64, 16, 120, None),    # GQA 12: two head chunks per kv head
    (2, 2, 1, 256, 16, 70, None),     # head_dim 256
    (3, 8, 2, 64, 16, 230, 37),       # sliding window
    (2, 4, 4, 128, 16, 100, 200),     # window wider than the context
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("partition_size", [0, 48], ids=["single", "split"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(str(v) for v in s))
def test_decode_matches_reference(emu, shape, partition_size, dtype):
    num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_len, window = shape
    case = make_decode_case(
        num_seqs=num_seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, max_len=max_len, dtype=dtype, sliding_window=window, seed=len(SHAPES),
    )
    out, ref, parts = run_decode(emu, case, partition_size=partition_size)
    assert (parts > 1) == (partition_size > 0)
    assert relative_error(out, ref) < TOLERANCE[dtype]


def test_decode_automatic_split_matches_reference(emu):
    # Few sequences and heads with long contexts: the automatic plan splits.
    case = make_decode_case(num_seqs=2, num_heads=4, num_kv_heads=1, head_dim=64, max_len=1100,
                            dtype=torch.float16, seed=3)
    out, ref, parts = run_decode(emu, case, partition_size=-1, num_sms=8)
    assert parts > 1
    assert relative_error(out, ref) < TOLERANCE[torch.float16]


def test_decode_empty_sequence_gives_zeros(emu):
    # seq_len 0 (a padded entry of a captured decode batch) must not produce NaN.
    for partition_size in (0, 32):
        case = make_decode_case(num_seqs=3, num_heads=4, num_kv_heads=2, head_dim=64, max_len=90,
                                dtype=torch.bfloat16, empty_seq=True)
        out, ref, _ = run_decode(emu, case, partition_size=partition_size)
        assert torch.equal(out[-1].float(), torch.zeros_like(out[-1].float()))
        assert relative_error(out[:-1], ref[:-1]) < TOLERANCE[torch.bfloat16]


def test_decode_underestimated_max_seq_len_stays_correct(emu):
    # The last launched partition takes the remainder: slower, never wrong.
    case = make_decode_case(num_seqs=2, num_heads=4, num_kv_heads=2, head_dim=64, max_len=300,
                            dtype=torch.float16, seed=5)
    out, ref, parts = run_decode(emu, case, partition_size=32, max_seq_len=100)
    assert parts == 4
    assert relative_error(out, ref) < TOLERANCE[torch.float16]


@pytest.mark.parametrize("reverse_blocks", [False, True], ids=["in_order", "reversed"])
@pytest.mark.parametrize("partition_size", [0, 48], ids=["single", "split"])
def test_decode_split_combined_in_kernel(emu, partition_size, reverse_blocks):
    # The partition that draws the last ticket combines them, whichever one finishes last,
    # and leaves the counters at 0 for the next launch (run twice on the same counters).
    case = make_decode_case(num_seqs=3, num_heads=8, num_kv_heads=2, head_dim=64, max_len=210,
                            dtype=torch.float16, seed=11)
    counters = torch.zeros(3 * 2 + 5, dtype=torch.int32)
    ref = reference.paged_attention(case.q, case.k_cache_ref, case.v_cache_ref, case.block_tables,
                                    case.seq_lens, case.query_start_loc, case.scale)
    for _ in range(2):
        out = torch.full_like(case.q, float("nan"))
        parts = emu.paged_attention_decode(out, case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                           case.scale, case.max_seq_len, 0, partition_size,
                                           split_counters=counters, reverse_blocks=reverse_blocks)
        assert (parts > 1) == (partition_size > 0)
        assert relative_error(out, ref) < TOLERANCE[torch.float16]
        assert not counters.any()


# (num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_len, window)
ROTARY_SHAPES = [
    (3, 4, 4, 128, 16, 150, None),    # MHA
    (3, 8, 2, 64, 16, 203, None),     # GQA 4
    (2, 16, 2, 64, 32, 170, None),    # GQA 8, block_size 32
    (2, 6, 2, 128, 16, 97, None),     # GQA 3: heads padded to 4
    (3, 8, 2, 64, 16, 230, 37),       # sliding window
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("partition_size, counters, reverse", [(0, False, False), (48, False, False),
                                                              (48, True, False), (32, True, True)],
                         ids=["single", "split", "split_combined", "split_combined_reversed"])
@pytest.mark.parametrize("shape", ROTARY_SHAPES, ids=lambda s: "x".join(str(v) for v in s))
def test_decode_with_fused_rotary_matches_reference(emu, shape, partition_size, counters, reverse, dtype):
    """rotary_paged_attention_decode against the reference rotary, cache write and
    attention in turn: the new token's slot holds NaN until the kernel writes it, so an
    attention that read the context before the write would show it. One sequence is
    empty (a padded graph row: slot -1, nothing stored, zeros out)."""
    num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_len, window = shape
    case = make_decode_case(
        num_seqs=num_seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, max_len=max_len, dtype=dtype, sliding_window=window, empty_seq=True, seed=7,
    )
    rc = make_rotary_decode_case(case, seed=num_heads)
    q_before = case.q.clone()
    split_counters = torch.zeros(num_seqs * num_kv_heads, dtype=torch.int32) if counters else None
    out = torch.full_like(case.q, float("nan"))
    parts = emu.paged_attention_decode(
        out, case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale,
        case.max_seq_len, window or 0, partition_size, rotary=(rc.k, rc.v, rc.positions, rc.cos_sin, rc.slot_mapping),
        split_counters=split_counters, reverse_blocks=reverse,
    )
    assert (parts > 1) == (partition_size > 0)
    ref = reference.paged_attention(rc.q_ref, rc.k_cache_ref, rc.v_cache_ref, case.block_tables, case.seq_lens,
                                    case.query_start_loc, case.scale, window)
    assert relative_error(out[:-1], ref[:-1]) < TOLERANCE[dtype]
    assert torch.equal(out[-1].float(), torch.zeros_like(out[-1].float()))
    assert torch.equal(case.q, q_before)  # q is read, not rotated in place
    written = rc.slot_mapping[rc.slot_mapping >= 0]
    flat = lambda c: c.view(-1, num_kv_heads, head_dim)[written].float()  # noqa: E731
    ulp = {torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    k_ref = flat(rc.k_cache_ref)
    assert (flat(case.k_cache) - k_ref).abs().max().item() <= ulp * k_ref.abs().max().item()
    assert torch.equal(flat(case.v_cache), flat(rc.v_cache_ref))
    if split_counters is not None:
        assert not split_counters.any()


def test_decode_fused_rotary_refuses_groups_past_8(emu):
    case = make_decode_case(num_seqs=2, num_heads=24, num_kv_heads=2, head_dim=64, max_len=60,
                            dtype=torch.float16, seed=2)
    rc = make_rotary_decode_case(case)
    with pytest.raises(AssertionError, match="group"):
        emu.paged_attention_decode(torch.empty_like(case.q), case.q, case.k_cache, case.v_cache, case.block_tables,
                                   case.seq_lens, case.scale, case.max_seq_len,
                                   rotary=(rc.k, rc.v, rc.positions, rc.cos_sin, rc.slot_mapping))


def test_plan_depends_on_shapes_only(emu):
    # (num_seqs, num_heads, num_kv_heads, max_seq_len, window, num_sms, requested)
    assert emu.plan(1, 32, 32, 4096, 0, 132, 0) == (0, 1)          # forced single pass
    assert emu.plan(64, 32, 32, 4096, 0, 132, -1) == (0, 1)        # batch fills the GPU
    assert emu.plan(1, 32, 32, 250, 0, 132, -1) == (0, 1)          # short context
    size, count = emu.plan(1, 32, 32, 4096, 0, 132, -1)            # batch 1, long context
    assert count > 1 and size % 64 == 0 and size >= 128 and size * count >= 4096
    size, count = emu.plan(1, 32, 8, 1 << 20, 0, 132, -1)          # huge context
    assert count <= 1024 and size * count >= 1 << 20
    size, count = emu.plan(1, 8, 8, 100_000, 512, 132, 64)         # a window bounds the work
    assert (size, count) == (64, 9)


@pytest.mark.parametrize(
    "dtype, head_dim, slot_dtype",
    [
        (torch.float16, 128, torch.int64),
        (torch.bfloat16, 64, torch.int32),
        (torch.float32, 64, torch.int64),
        (torch.float16, 12, torch.int64),  # 24-byte rows: the element-wise path
    ],
)
def test_store_kv_cache_matches_reference(emu, dtype, head_dim, slot_dtype):
    case = make_store_case(num_tokens=37, num_kv_heads=3, head_dim=head_dim, dtype=dtype,
                           slot_dtype=slot_dtype, seed=head_dim)
    k_ref, v_ref = case.k_cache.clone(), case.v_cache.clone()
    reference.store_kv_cache(case.key, case.value, k_ref, v_ref, case.slot_mapping.long())
    vectorized = emu.store_kv_cache(case.key, case.value, case.k_cache, case.v_cache, case.slot_mapping)
    assert vectorized == (head_dim * case.key.element_size() % 16 == 0)
    assert torch.equal(case.k_cache, k_ref)
    assert torch.equal(case.v_cache, v_ref)


# (dtype, num_heads, num_kv_heads, head_dim, num_tokens, slot_dtype, pos_dtype, layout); the
# layouts are those of make_rotary_store_case. The vectorized kernel takes the packed ones
# whose half rows are whole 16-byte vectors, the element-wise kernel the rest.
ROTARY_STORE_CASES = [
    (torch.float16, 4, 4, 128, 1, torch.int64, torch.int64, "packed"),       # MHA, a decode token
    (torch.float16, 8, 2, 128, 80, torch.int32, torch.int64, "packed"),      # GQA 4, a prefix-hit chunk
    (torch.bfloat16, 8, 2, 64, 17, torch.int64, torch.int32, "packed"),
    (torch.bfloat16, 4, 4, 128, 80, torch.int32, torch.int32, "packed"),
    (torch.float32, 6, 2, 64, 3, torch.int64, torch.int32, "packed"),        # 4 floats a vector
    (torch.float32, 4, 4, 128, 17, torch.int32, torch.int64, "packed"),
    (torch.float16, 32, 8, 128, 3, torch.int32, torch.int32, "packed"),      # many rows a token
    (torch.float16, 8, 2, 64, 17, torch.int64, torch.int64, "offset"),       # unaligned base pointers
    (torch.bfloat16, 4, 2, 128, 3, torch.int32, torch.int64, "offset"),
    (torch.float32, 4, 2, 64, 5, torch.int64, torch.int32, "odd_stride"),    # odd head stride
    (torch.float16, 4, 4, 64, 17, torch.int64, torch.int64, "cos_sin_stride"),  # cos/sin rows 66 floats apart
    (torch.float16, 4, 2, 24, 5, torch.int64, torch.int64, "packed"),        # half rows of 12: not whole vectors
]


@pytest.mark.parametrize(
    "dtype, num_heads, num_kv_heads, head_dim, num_tokens, slot_dtype, pos_dtype, layout",
    ROTARY_STORE_CASES,
    ids=lambda v: str(v).removeprefix("torch.") if not isinstance(v, int) else str(v),
)
def test_rotary_store_kv_matches_reference(emu, dtype, num_heads, num_kv_heads, head_dim, num_tokens, slot_dtype,
                                           pos_dtype, layout):
    """Rotary in place on q and k, then the cache write of the rotated k and of v, as the
    two reference ops do it in turn, with padding tokens (slot -1: rotated, not stored).
    The launcher takes the vectorized kernel exactly where cuda_backend expects it to."""
    from asyncgen._ops import cuda_backend

    case = make_rotary_store_case(num_tokens=num_tokens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                  head_dim=head_dim, dtype=dtype, layout=layout, slot_dtype=slot_dtype,
                                  pos_dtype=pos_dtype, seed=num_tokens * head_dim + num_heads)
    v_before = case.v.clone()
    vectorized = emu.rotary_store_kv(case.q, case.k, case.v, case.positions, case.cos_sin, case.k_cache,
                                     case.v_cache, case.slot_mapping)
    whole_vectors = (head_dim // 2) * case.q.element_size() % 16 == 0
    assert vectorized == (layout == "packed" and whole_vectors)
    assert vectorized == cuda_backend._rotary_store_vectorized(case.q, case.k, case.v, case.cos_sin, case.k_cache,
                                                               case.v_cache)
    ulp = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-6}[dtype]
    for got, want in ((case.q, case.q_ref), (case.k, case.k_ref), (case.k_buffer, case.k_buffer_ref)):
        assert (got.float() - want.float()).abs().max().item() <= ulp * want.float().abs().max().item()
    assert torch.equal(case.v, v_before)
    assert torch.equal(case.v_buffer, case.v_buffer_ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
def test_rotary_store_kv_vectorized_equals_elementwise(emu, dtype):
    """The two kernels round the same fp32 products once: the same values laid out for
    the vectorized kernel and in each layout the element-wise one takes give bit for bit
    the same q, k and caches."""
    results = {}
    for layout in ROTARY_LAYOUTS:
        case = make_rotary_store_case(num_tokens=17, num_heads=8, num_kv_heads=2, head_dim=64, dtype=dtype,
                                      layout=layout, seed=5)
        vectorized = emu.rotary_store_kv(case.q, case.k, case.v, case.positions, case.cos_sin, case.k_cache,
                                         case.v_cache, case.slot_mapping)
        assert vectorized == (layout == "packed")
        results[layout] = (case.q, case.k, case.k_buffer, case.v_buffer)
    for layout, tensors in results.items():
        for got, want in zip(tensors, results["packed"]):
            assert torch.equal(got, want), layout


# --- GEMV (csrc/gemv.cuh) ---------------------------------------------------------------


@pytest.mark.parametrize("warps_per_row", [0, 2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(
    "m, n, k, bias",
    [
        # chunks of 128 vectors (1024 weights) go to a row's warps in turn
        (1, 45, 264, False),   # a partial last block of rows; one chunk: a row's other warps add nothing
        (3, 16, 1040, True),   # 130 vectors: the second warp gets 2
        (8, 9, 64, True),      # fewer vectors than a warp has lanes
        (2, 7, 2112, False),   # 264 vectors: 2 + 1 chunks at 2 warps a row, 1 + 1 + a part at 4
        (1, 5, 4392, True),    # 549 vectors: every warp of 4 a full chunk, the first a second, partial one
        (1, 3, 9216, False),   # 1152 vectors: 9 chunks, the first of 8 warps takes two
    ],
)
def test_dense_gemv_matches_reference(emu, m, n, k, bias, dtype, warps_per_row):
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    weight = torch.randn(n, k + 8, generator=g).to(dtype)[:, :k]  # a row stride longer than K
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    padded = torch.full((m, n + 3), float("nan"), dtype=dtype)
    out = padded[:, :n]
    emu.dense_gemv(out, x, weight, b, warps_per_row)
    assert torch.isnan(padded[:, n:]).all()  # nothing written past the last feature
    ref = torch.nn.functional.linear(x.float(), weight.float(), None if b is None else b.float())
    assert relative_error(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("warps_per_row", [0, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(
    "m, n, k, bias",
    [
        (1, 46, 264, True),    # 23 outputs: a partial last block of gate/up pairs
        (2, 20, 2112, False),  # several chunks a row
        (3, 14, 1040, True),   # 3 rows: x loaded vector by vector
    ],
)
def test_dense_gemv_gated_gives_silu_and_mul(emu, m, n, k, bias, dtype, warps_per_row):
    g = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    weight = (torch.randn(n, k, generator=g) * 2 / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    padded = torch.full((m, n // 2 + 3), float("nan"), dtype=dtype)
    out = padded[:, : n // 2]
    emu.dense_gemv(out, x, weight, b, warps_per_row, gated=True)
    assert torch.isnan(padded[:, n // 2:]).all()  # nothing written past the last output
    y = torch.nn.functional.linear(x.float(), weight.float(), None if b is None else b.float()).to(dtype)
    ref = reference.silu_and_mul(y)  # in the dtype, as the unfused ops round
    assert relative_error(out, ref.float()) < TOLERANCE[dtype]
    # A gate row paired with the wrong up row would be far off: pair j with j + 1 instead.
    wrong = reference.silu_and_mul(torch.cat([y[:, : n // 2], y[:, n // 2:].roll(1, dims=1)], dim=1))
    assert relative_error(out, wrong.float()) > 0.1


def test_dense_gemv_gated_refuses_8_warps_a_row(emu):
    x = torch.randn(1, 64).half()
    weight = torch.randn(16, 64).half()
    with pytest.raises(AssertionError, match="no kernel"):
        emu.dense_gemv(torch.empty(1, 8, dtype=torch.float16), x, weight, None, 8, gated=True)


@pytest.mark.parametrize("tensor_cores", [False, True], ids=["cuda_cores", "mma"])
@pytest.mark.parametrize(
    "m, n, k, group_size",
    [
        (1, 72, 2048, 32),   # 8 packed rows per K lane, a group change every 4; a partial block of columns
        (3, 32, 800, 32),    # 100 packed rows: the last K lanes get fewer rows, or none
        (8, 40, 1024, 128),  # the most rows the kernel takes
        (2, 36, 256, 256),   # one group (per-channel scales)
        (1, 8196, 128, 64),  # a wide layer: the other block shape, a partial last block
        (5, 64, 4096, 64),   # mma: 16 chunks a warp, groups of 2 chunks, the next group's constants ahead
        (4, 52, 1088, 544),  # mma: 34 chunks over 8 warps (one idle), a group boundary inside a warp's range
        (2, 36, 264, 264),   # K not a multiple of 32: the CUDA-core kernel even where tensor cores exist
    ],
)
def test_quant_gemv_4bit_matches_reference(emu, m, n, k, group_size, tensor_cores):
    from asyncgen._ops import quant_reference as qref

    g = torch.Generator().manual_seed(m + n + k)
    groups = k // group_size
    codes = torch.randint(0, 16, (k, n), generator=g)
    qweight = qref.pack_rows(codes, 4)  # [K / 8, N]
    scales = (torch.rand(groups, n, generator=g) * 0.02 + 0.005).half()
    zeros = torch.randint(0, 16, (groups, n), generator=g).half()
    x = torch.randn(m, k, generator=g).half()
    bias = torch.randn(n, generator=g).half()
    out = torch.full((m, n), float("nan"), dtype=torch.float16)
    used_mma = emu.quant_gemv_4bit(out, x, qweight, scales, zeros, group_size, bias, tensor_cores=tensor_cores)
    assert used_mma == (tensor_cores and k % 32 == 0 and group_size % 32 == 0)
    ref = qref.quant_matmul(x, qweight, scales, zeros, 4, group_size, bias=bias)
    exact = x.float() @ qref.dequantize(qweight, scales, zeros, 4, group_size).float() + bias.float()
    assert relative_error(out, exact) < 2e-3
    assert relative_error(ref, exact) < 2e-3


@pytest.mark.parametrize(
    "n, k, group_size, bias, kernel",
    [
        (72, 2048, 32, True, "stream"),     # a lane per group; a partial block of columns
        (40, 11008, 128, False, "stream"),  # 22 rows a lane: groups change inside lanes; the last lanes short or empty
        (8196, 128, 64, True, "stream"),    # the wide block shape, 4 columns in the last block
        (36, 256, 256, False, "stream"),    # one group (per-channel scales)
        (24, 6144, 48, True, "stream"),     # groups of 6 packed rows, 12 rows a lane: a change at its third pair
        (20, 16384, 128, False, "stream"),  # x too long for the 256-thread ring: the 128-thread block
        (20, 20480, 128, False, "cores"),   # x alone past the shared-memory budget: the CUDA-core kernel
        (36, 264, 264, False, "cores"),     # K % 16 != 0: the CUDA-core kernel
        (36, 256, 8, False, "cores"),       # groups of one packed row: the CUDA-core kernel
    ],
)
def test_quant_gemv_4bit_one_row(emu, n, k, group_size, bias, kernel):
    """One row without tensor cores takes the streaming kernel where its conditions hold."""
    x, qweight, scales, zeros, b, exact = _quant_case(1, n, k, group_size, n + k + group_size)
    b = b if bias else None
    out = torch.full((1, n), float("nan"), dtype=torch.float16)
    emu.quant_gemv_4bit(out, x, qweight, scales, zeros, group_size, b, tensor_cores=False)
    assert emu.last_quant_kernel == kernel
    if b is not None:
        exact += b.float()
    assert relative_error(out, exact) < 2e-3


@pytest.mark.parametrize(
    "n, k, group_size, bias",
    [
        (8208, 256, 128, True),   # wide: 16 column threads; 4104 outputs, a partial last block of 32
        (200, 1024, 64, False),   # narrow: 8 column threads in 512; 100 outputs in blocks of 16
        (40, 12288, 128, True),   # the 256-thread block for long K
    ],
)
def test_quant_gemv_4bit_gated_gives_silu_and_mul(emu, n, k, group_size, bias):
    """The one-row kernel's gated form: gate | up columns in, silu(gate) * up out, rounded as
    the product and the separate op round them."""
    x, qweight, scales, zeros, b, _ = _quant_case(1, n, k, group_size, n * 3 + k)
    b = b if bias else None
    padded = torch.full((1, n // 2 + 5), float("nan"), dtype=torch.float16)
    out = padded[:, : n // 2]
    emu.quant_gemv_4bit(out, x, qweight, scales, zeros, group_size, b, tensor_cores=False, gated=True)
    assert emu.last_quant_kernel == "stream"
    assert torch.isnan(padded[:, n // 2:]).all()  # nothing written past the last output
    y = torch.full((1, n), float("nan"), dtype=torch.float16)
    emu.quant_gemv_4bit(y, x, qweight, scales, zeros, group_size, b, tensor_cores=False)
    ref = reference.silu_and_mul(y)  # the ungated kernel's output, then the op
    assert relative_error(out, ref.float()) < TOLERANCE[torch.float16]
    wrong = reference.silu_and_mul(torch.cat([y[:, : n // 2], y[:, n // 2:].roll(1, dims=1)], dim=1))
    assert relative_error(out, wrong.float()) > 0.1


def test_quant_gemv_4bit_gated_refuses_what_the_one_row_kernel_does_not_take(emu):
    from asyncgen._ops import quant_reference as qref

    k, n = 264, 64  # K % 16 != 0: no one-row kernel, and the gated form has no other
    qweight = qref.pack_rows(torch.randint(0, 16, (k, n)), 4)
    scales, zeros = torch.full((1, n), 0.01).half(), torch.full((1, n), 8.0).half()
    with pytest.raises(AssertionError, match="too many rows"):
        emu.quant_gemv_4bit(torch.empty(1, n // 2).half(), torch.randn(1, k).half(), qweight, scales, zeros, k,
                            tensor_cores=False, gated=True)
    k = 16384  # the one-row kernel's 128-thread block takes it ungated; the gated block (256) does not fit
    qweight = qref.pack_rows(torch.randint(0, 16, (k, n)), 4)
    scales, zeros = torch.full((1, n), 0.01).half(), torch.full((1, n), 8.0).half()
    emu.quant_gemv_4bit(torch.empty(1, n).half(), torch.randn(1, k).half(), qweight, scales, zeros, k,
                        tensor_cores=False)
    assert emu.last_quant_kernel == "stream"
    with pytest.raises(AssertionError, match="too many rows"):
        emu.quant_gemv_4bit(torch.empty(1, n // 2).half(), torch.randn(1, k).half(), qweight, scales, zeros, k,
                            tensor_cores=False, gated=True)


@pytest.mark.parametrize(
    "m, n, k, group_size",
    [
        (9, 40, 512, 64),    # 2 tiles of x rows, the second with one row
        (32, 36, 384, 128),  # 4 full tiles; a partial block of columns
        (61, 64, 256, 32),   # 8 tiles, the last partial; a group every chunk
    ],
)
def test_quant_gemv_4bit_tensor_cores_take_up_to_64_rows(emu, m, n, k, group_size):
    from asyncgen._ops import quant_reference as qref

    g = torch.Generator().manual_seed(m * n + k)
    groups = k // group_size
    qweight = qref.pack_rows(torch.randint(0, 16, (k, n), generator=g), 4)
    scales = (torch.rand(groups, n, generator=g) * 0.02 + 0.005).half()
    zeros = torch.randint(0, 16, (groups, n), generator=g).half()
    x = torch.randn(m, k, generator=g).half()
    out = torch.full((m, n), float("nan"), dtype=torch.float16)
    assert emu.quant_gemv_4bit(out, x, qweight, scales, zeros, group_size)
    exact = x.float() @ qref.dequantize(qweight, scales, zeros, 4, group_size).float()
    assert relative_error(out, exact) < 2e-3
    with pytest.raises(AssertionError, match="too many rows"):  # the CUDA-core kernel stops at 8
        emu.quant_gemv_4bit(out, x, qweight, scales, zeros, group_size, tensor_cores=False)


def _quant_case(m, n, k, group_size, seed):
    from asyncgen._ops import quant_reference as qref

    g = torch.Generator().manual_seed(seed)
    groups = k // group_size
    qweight = qref.pack_rows(torch.randint(0, 16, (k, n), generator=g), 4)
    scales = (torch.rand(groups, n, generator=g) * 0.02 + 0.005).half()
    zeros = torch.randint(0, 16, (groups, n), generator=g).half()
    x = torch.randn(m, k, generator=g).half()
    bias = torch.randn(n, generator=g).half()
    exact = x.float() @ qref.dequantize(qweight, scales, zeros, 4, group_size).float()
    return x, qweight, scales, zeros, bias, exact


@pytest.mark.parametrize(
    "m, n, k, group_size, warps, splits",
    [
        (64, 256, 256, 64, 4, 1),    # 8 full tiles of x rows, 2 column blocks, a group every stage
        (61, 136, 512, 128, 4, 3),   # the last tile partial, a block of 8 columns, 8 stages over 3 splits
        (16, 264, 384, 384, 8, 2),   # one group (per-channel), 8 warps, a partial column block
        (5, 64, 640, 64, 4, 1),      # one tile, 10 stages through the 4-deep ring
        (33, 96, 128, 128, 8, 4),    # 2 stages over 4 splits: two splits without stages
        (20, 128, 640, 64, 4, 16),   # 10 stages over 16 splits (the most)
    ],
)
@pytest.mark.parametrize("wgmma", [0, 1, 2], ids=["mma", "wgmma", "ws"])
def test_quant_gemm_4bit_tiled_matches_reference(emu, m, n, k, group_size, warps, splits, wgmma):
    x, qweight, scales, zeros, bias, exact = _quant_case(m, n, k, group_size, m * n + k + splits)
    runs = []
    for reverse in (False, True):  # the split that finishes last combines: either order
        out = torch.full((m, n), float("nan"), dtype=torch.float16)
        workspace = torch.full((splits, m, n), float("nan")) if splits > 1 else None
        counters = torch.zeros(64, dtype=torch.int32)
        emu.lib.ag_set_reverse_blocks(int(reverse))
        try:
            assert emu.quant_gemm_4bit(out, x, qweight, scales, zeros, group_size, bias, warps, splits,
                                       workspace, counters, wgmma)
        finally:
            emu.lib.ag_set_reverse_blocks(0)
        assert relative_error(out, exact + bias.float()) < 2e-3
        assert int(counters.abs().sum()) == 0  # left ready for the next launch
        runs.append(out)
    assert torch.equal(runs[0], runs[1])  # the splits are added in the same order


@pytest.mark.parametrize(
    "m, n, k, group_size, warps, blocks",
    [
        (64, 512, 256, 64, 4, 3),    # 4 column blocks x 4 stages over 3 blocks: runs cross column blocks
        (37, 520, 384, 128, 8, 5),   # 3 column blocks (the last partial) x 6 stages over 5 blocks
        (8, 256, 256, 256, 4, 7),    # 2 column blocks x 4 stages over 7 blocks: up to 4 share one
        (64, 256, 512, 64, 8, 1),    # one block takes everything: no partials
        (16, 384, 256, 64, 4, 100),  # more blocks wanted than units: one unit a block
        (24, 768, 1024, 128, 4, 5),  # 6 column blocks x 16 stages: runs that finish a column block are shorter
    ],
)
@pytest.mark.parametrize("wgmma", [1, 2], ids=["wgmma", "ws"])
def test_quant_gemm_4bit_balanced_matches_reference(emu, m, n, k, group_size, warps, blocks, wgmma):
    """A balanced launch (the warpgroup kernels): blocks take even runs of column blocks x
    stages, a run may end inside one column block and go on in the next, and the blocks
    sharing a column block leave partials that the last to finish adds in block order; the
    Python plan (which sizes the workspace) is the C++ one. With producer warps (ws) the
    ring runs on across the column blocks of a run."""
    x, qweight, scales, zeros, bias, exact = _quant_case(m, n, k, group_size, m + n + k + blocks)
    plan = emu.plan_stream_gemm(n, k, warps, blocks)
    assert plan == cuda_backend.stream_gemm_plan(n, k, warps, blocks)
    launched, pieces = plan
    assert launched == min(blocks, -(-n // (32 * warps)) * (k // 64))
    runs = []
    for reverse in (False, True):
        out = torch.full((m, n), float("nan"), dtype=torch.float16)
        workspace = torch.full((pieces, m, n), float("nan")) if pieces > 1 else None
        counters = torch.zeros(64, dtype=torch.int32)
        emu.lib.ag_set_reverse_blocks(int(reverse))
        try:
            assert emu.quant_gemm_4bit(out, x, qweight, scales, zeros, group_size, bias, warps, pieces, workspace,
                                       counters, wgmma=wgmma, stream_blocks=launched)
        finally:
            emu.lib.ag_set_reverse_blocks(0)
        assert relative_error(out, exact + bias.float()) < 2e-3
        assert int(counters.abs().sum()) == 0
        runs.append(out)
    assert torch.equal(runs[0], runs[1])


def test_quant_gemm_4bit_balanced_is_the_warpgroup_kernels_only(emu):
    x, qweight, scales, zeros, _, _ = _quant_case(8, 128, 256, 64, 5)
    out = torch.empty(8, 128, dtype=torch.float16)
    assert not emu.quant_gemm_4bit(out, x, qweight, scales, zeros, 64, stream_blocks=2)


@pytest.mark.parametrize("wgmma", [0, 1, 2], ids=["mma", "wgmma", "ws"])
def test_quant_gemm_4bit_tiled_without_bias_and_strided_x(emu, wgmma):
    m, n, k = 24, 128, 256
    x, qweight, scales, zeros, _, exact = _quant_case(m, n, k, 64, 7)
    wide = torch.zeros(m, k + 64, dtype=torch.float16)
    wide[:, :k] = x
    out = torch.full((m, n + 8), float("nan"), dtype=torch.float16)
    assert emu.quant_gemm_4bit(out[:, :n], wide[:, :k], qweight, scales, zeros, 64, wgmma=wgmma)
    assert relative_error(out[:, :n], exact) < 2e-3
    assert torch.isnan(out[:, n:]).all()  # nothing written past the output's columns


@pytest.mark.parametrize(
    "m, n, k, group_size, splits, why",
    [
        (65, 64, 256, 64, 1, "more than 64 rows"),
        (4, 64, 288, 96, 1, "K not a multiple of 64"),
        (4, 64, 256, 32, 1, "groups shorter than a stage"),
        (4, 60, 256, 64, 1, "N not a multiple of 8"),
        (4, 64, 256, 64, 2, "splits without a workspace"),
    ],
)
@pytest.mark.parametrize("wgmma", [0, 1, 2], ids=["mma", "wgmma", "ws"])
def test_quant_gemm_4bit_tiled_refuses(emu, m, n, k, group_size, splits, why, wgmma):
    x, qweight, scales, zeros, _, _ = _quant_case(m, n, k, group_size, 3)
    out = torch.empty(m, n, dtype=torch.float16)
    assert not emu.quant_gemm_4bit(out, x, qweight, scales, zeros, group_size, splits=splits, wgmma=wgmma), why


def test_quant_gemm_4bit_tiled_refuses_a_misaligned_workspace(emu):
    m, n, k = 8, 64, 256
    x, qweight, scales, zeros, _, exact = _quant_case(m, n, k, 64, 4)
    out = torch.empty(m, n, dtype=torch.float16)
    counters = torch.zeros(8, dtype=torch.int32)
    workspace = torch.zeros(2 * m * n + 4)
    assert not emu.quant_gemm_4bit(out, x, qweight, scales, zeros, 64, splits=2, workspace=workspace[1:],
                                   counters=counters)  # 4 bytes past a 16-byte boundary
    assert emu.quant_gemm_4bit(out, x, qweight, scales, zeros, 64, splits=2, workspace=workspace[4:],
                               counters=counters)
    assert relative_error(out, exact) < 2e-3


# Prompt-chunk attention (chunk_attention.cuh): (seqs as (new, cached) tokens, num_heads,
# num_kv_heads, head_dim, block_size).
CHUNK_SHAPES = [
    ([(78, 130), (50, 0), (0, 0), (0, 0)], 2, 2, 128, 16),  # a cached-prefix hit padded as a prompt graph
    ([(70, 0), (5, 61), (1, 40)], 2, 2, 64, 16),          # from scratch, a short chunk, one token
    ([(40, 33), (17, 0)], 8, 2, 64, 32),                   # GQA 4: 16 tokens a block
    ([(23, 9)], 6, 1, 64, 16),                             # GQA 6: 10 tokens, 60 of 64 rows a block
]


def run_chunk(emu, case, num_splits=1, reverse_blocks=False, kernel=0):
    out = torch.full_like(case.q, float("nan"))
    counters = torch.zeros(4096, dtype=torch.int32) if num_splits > 1 else None
    assert emu.chunk_attention(out, case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                               case.query_start_loc, case.scale, num_splits, counters, reverse_blocks, kernel)
    if counters is not None:
        assert int(counters.abs().sum()) == 0, "the last split must reset its counter"
    ref = reference.paged_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                    case.query_start_loc, case.scale)
    return out, ref


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", CHUNK_SHAPES, ids=lambda s: f"{len(s[0])}seqs-{s[1]}x{s[2]}x{s[3]}-b{s[4]}")
def test_chunk_attention_matches_reference(emu, shape, dtype):
    seqs, num_heads, num_kv_heads, head_dim, block_size = shape
    case = make_chunk_case(seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           block_size=block_size, dtype=dtype, seed=len(seqs))
    out, ref = run_chunk(emu, case)
    assert not out.isnan().any()
    assert relative_error(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("num_splits, reverse_blocks", [(2, False), (3, True), (16, False)])
def test_chunk_attention_split_combined_by_the_last_block(emu, num_splits, reverse_blocks):
    # 16 splits of 3 key tiles: most splits get no keys and must not disturb the sum.
    seqs, num_heads, num_kv_heads, head_dim, block_size = CHUNK_SHAPES[0]
    case = make_chunk_case(seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           block_size=block_size, dtype=torch.float16, seed=3)
    out, ref = run_chunk(emu, case, num_splits, reverse_blocks)
    assert relative_error(out, ref) < TOLERANCE[torch.float16]


def test_chunk_attention_refuses_unsupported_shapes(emu):
    case = make_chunk_case([(4, 4)], num_heads=2, num_kv_heads=2, head_dim=64, dtype=torch.float16)
    out = torch.empty_like(case.q)
    args = (case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.query_start_loc, case.scale)
    assert not emu.chunk_attention(out, case.q, *args, num_splits=17, split_counters=torch.zeros(64, dtype=torch.int32))
    wide = make_chunk_case([(4, 4)], num_heads=16, num_kv_heads=1, head_dim=64, dtype=torch.float16)
    assert not emu.chunk_attention(torch.empty_like(wide.q), wide.q, wide.k_cache, wide.v_cache, wide.block_tables,
                                   wide.seq_lens, wide.query_start_loc, wide.scale)


# The warpgroup kernel (chunk_attention_wgmma.cuh, head_dim 128): 128 rows a block, 64-key
# tiles through a ring of 4, S and P V as emulated wgmma read through the descriptors
# (keys K-major, values N-major, both swizzled).
WGMMA_CHUNK_SHAPES = [
    ([(78, 130), (50, 0), (0, 0), (0, 0)], 2, 2, 16),  # a prefix hit padded as a prompt graph; 6 key tiles
    ([(130, 0), (3, 200)], 1, 1, 32),                   # two query tiles, the second 2 rows; 4 tiles of a short chunk
    ([(40, 33), (17, 0)], 8, 2, 16),                    # GQA 4: 32 tokens a block
    ([(23, 9)], 6, 1, 16),                              # GQA 6: 21 tokens, 126 of 128 rows a block
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", WGMMA_CHUNK_SHAPES, ids=lambda s: f"{len(s[0])}seqs-{s[1]}x{s[2]}-b{s[3]}")
def test_chunk_attention_wgmma_matches_reference(emu, shape, dtype):
    seqs, num_heads, num_kv_heads, block_size = shape
    case = make_chunk_case(seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=128,
                           block_size=block_size, dtype=dtype, seed=len(seqs) + 7)
    out, ref = run_chunk(emu, case, kernel=1)
    assert not out.isnan().any()
    assert relative_error(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_chunk_attention_wgmma_rescales_when_a_late_key_tile_dominates(emu, num_splits, dtype):
    # The kernel moves a row's running max only when a tile's max exceeds it by more than
    # 8 (base 2): keys from position 200 on are scaled so that their scores jump far past
    # the first tiles' (the output rescaled at tile 3, inside the split's range or at its
    # start), and keys 64-127 are scaled down, so that tile 1 leaves the max alone.
    case = make_chunk_case([(70, 250)], num_heads=2, num_kv_heads=2, head_dim=128, block_size=16, dtype=dtype,
                           seed=11)
    view = case.k_cache.view(-1, 2, 128)
    for pos in range(320):
        slot = int(case.block_tables[0, pos // 16]) * 16 + pos % 16
        if pos >= 200:
            view[slot] *= 12
        elif 64 <= pos < 128:
            view[slot] *= 0.1
    out, ref = run_chunk(emu, case, num_splits, kernel=1)
    assert not out.isnan().any()
    assert relative_error(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("num_splits, reverse_blocks", [(2, False), (3, True), (8, False)])
def test_chunk_attention_wgmma_split_combined_by_the_last_block(emu, num_splits, reverse_blocks):
    # 8 splits of a 6-tile context: two splits get no keys and must not disturb the sum.
    seqs, num_heads, num_kv_heads, block_size = WGMMA_CHUNK_SHAPES[0]
    case = make_chunk_case(seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=128,
                           block_size=block_size, dtype=torch.float16, seed=5)
    out, ref = run_chunk(emu, case, num_splits, reverse_blocks, kernel=1)
    assert relative_error(out, ref) < TOLERANCE[torch.float16]


def test_chunk_attention_wgmma_refuses_other_head_dims(emu):
    case = make_chunk_case([(4, 4)], num_heads=2, num_kv_heads=2, head_dim=64, dtype=torch.float16)
    assert not emu.chunk_attention(torch.empty_like(case.q), case.q, case.k_cache, case.v_cache, case.block_tables,
                                   case.seq_lens, case.query_start_loc, case.scale, kernel=1)
