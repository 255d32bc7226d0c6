"""Paged attention for mixed batches (prefill chunks and decode tokens) over a block table.

Layout::

    q                [T, num_heads, head_dim]          tokens of all sequences, packed
    k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables     [B, max_blocks_per_seq]           physical block of each logical block
    seq_lens         [B]                               cached tokens, this step's included
    query_start_loc  [B + 1]                           query tokens of sequence b are
                                                       q[query_start_loc[b]:query_start_loc[b+1]]
    out              [T, num_heads, head_dim]

head_dim is contiguous everywhere; every other dimension is addressed by stride. The
tiles span head_dim rounded up to a power of two (at least 16); the columns past a head
(head_dim 80, 96, ...) are masked, loaded as zeros and never stored. Query
token ``i`` of a sequence with ``q_len`` queries and ``seq_len`` cached tokens sits at
position ``seq_len - q_len + i`` and attends to positions ``0 ..= that`` (the last
``sliding_window`` of them with a window). Cache position ``n`` of sequence ``b`` lives in
``k_cache[block_tables[b, n // block_size], n % block_size]``.

GQA: the ``group = num_heads / num_kv_heads`` query heads that share one kv head are
processed by one program, so each K/V tile is loaded once per group. A program's query
tile is ``BLOCK_M = BLOCK_Q * GROUP_PAD`` rows, row ``r`` being query token
``r // GROUP_PAD`` and head ``r % GROUP_PAD`` of the group::

    rows:  t0h0 t0h1 t0h2 t0h3 | t1h0 t1h1 ... | ...      (group 4, GROUP_PAD 4)

Three kernels:

- ``_paged_attention_kernel`` (any batch): grid ``(T // BLOCK_Q + B, num_kv_heads, num_splits)``.
  Sequence ``b`` owns the program ids from ``query_start_loc[b] // BLOCK_Q + b`` on, which
  leaves room for its ``ceil(q_len / BLOCK_Q)`` query tiles whatever the lengths; a
  program finds its sequence by counting the starts below its id (vector loads of 64
  starts, no host sync) and exits when its tile is past the sequence's queries. Key
  tiles entirely below every query row's position skip the causal mask. When too few
  query tiles would fill the GPU (a short chunk after a long cached prefix), the context
  is split as in decode: a third grid axis of ``num_splits`` and partials per token.
- ``_paged_decode_kernel`` (every sequence has at most one query, ``max_query_len=1``):
  grid ``(B, num_kv_heads, num_splits)``; the query tile is the head group padded to 16
  rows (masked), so ``tl.dot`` keeps shapes >= 16. With ``num_splits > 1`` (flash-decoding)
  split ``s`` takes key tiles ``s, s + num_splits, ...`` and writes a partial
  ``(max, sum, unnormalised acc)`` that ``_reduce_splits_kernel`` combines (per
  sequence here, per token after the general kernel). The
  interleaved split is correct for any context length, so the split count may come from
  a hint without risk.

Softmax is online, in fp32, in base 2 (``scale * log2(e)`` folded into the scores).
Scores and V rows outside ``[lowest allowed position, seq_len)`` are never loaded (masked
to 0), so uninitialised cache slots, even NaN, never reach a result.

Napkin math, 7B (32 heads, head_dim 128, bf16):
    decode, per sequence and cached token: K + V = 2 * kv_heads * 128 * 2 B
        = 4 KiB (8 kv heads) or 16 KiB (32 kv heads); FLOPs 4 * 32 * 128 = 16 KFLOP,
        i.e. 4 FLOP/B (GQA 8) or 1 FLOP/B (MHA): memory-bound (H200 ridge ~230 FLOP/B).
        64 sequences x 2048 tokens, 8 kv heads: 512 MiB -> ~125 us at 4.3 TB/s;
        32 kv heads: 2 GiB -> ~500 us.
    prefill, a chunk of L new tokens over no context: ~2 * 32 * 128 * L^2 FLOPs (causal
        half of 4 * H * D * L^2) -> L = 4096: 137 GFLOP, compute-bound (~0.2 ms at
        700 TFLOP/s); K/V reads stay small (L * 4..16 KiB) thanks to the group sharing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_backend import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_devices,
    check_out,
    check_tensor,
    is_interpreted,
    next_power_of_2,
    num_sms,
)

__all__ = ["paged_attention"]

_LOG2E = 1.4426950408889634

# Split-K (flash-decoding) policy: split while fewer than _SPLIT_TARGET_WAVES programs per
# SM would run, keep at least _MIN_TILES_PER_SPLIT key tiles per split, at most
# _MAX_SPLITS splits (see _num_splits).
_SPLIT_TARGET_WAVES = 2
_MIN_TILES_PER_SPLIT = 4
_MAX_SPLITS = 64
_MAX_PARTIAL_BYTES = 64 << 20
# The general kernel splits the context of batches of at most this many sequences, in
# this many parts (see _prefill_splits). The model runner's narrow prompt graphs have
# that many sequence slots (model_runner._NARROW_PROMPT_SLOTS).
_PREFILL_SPLIT_MAX_SEQS = 8
_PREFILL_SPLITS = 4
# Integer arguments that change from step to step (the sequence count, the block-table
# width of an eager step) are not specialized (``do_not_specialize``): Triton would
# otherwise compile a variant per value class (1, a multiple of 16, other) the first time
# one occurs, stalling that step for the compile (about a second for the general kernel)
# while serving.
_SEQ_CHUNK = 64  # sequences whose starts the general kernel loads at a time


@triton.jit
def _attend_tiles(
    q,  # [BLOCK_M, HEAD_DIM]
    acc,  # [BLOCK_M, HEAD_DIM] fp32
    m_i,  # [BLOCK_M] fp32, running max (base 2)
    l_i,  # [BLOCK_M] fp32, running sum
    k_base,  # k_cache offset to this kv head
    v_base,
    block_table_row,  # this sequence's block table
    tile_lo,  # key tiles tile_lo, tile_lo + tile_step, ... below tile_hi
    tile_hi,
    tile_step,
    kv_lo,  # loadable positions are [kv_lo, kv_hi)
    kv_hi,
    q_pos,  # [BLOCK_M] position of each query row
    window,
    qk_scale,
    stride_kb,
    stride_ks,
    stride_vb,
    stride_vs,
    offs_d,
    d_mask,  # [HEAD_DIM_PAD]: offs_d < the real head_dim
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    MASK: tl.constexpr,
    PAD_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online softmax over key tiles ``tile_lo, tile_lo + tile_step, ... < tile_hi`` (tile
    ``i`` holds positions ``[i * BLOCK_N, (i + 1) * BLOCK_N)``). Without MASK every key of
    those tiles must be loadable and allowed for every row. With PAD_D the tiles are
    wider than the head (a head_dim that is not a power of two): the columns past it load
    as zeros, which add nothing to q·k and give zero output columns."""
    for tile in range(tile_lo, tile_hi, tile_step):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        if MASK:
            load_mask = (offs_n >= kv_lo) & (offs_n < kv_hi)
            block_ids = tl.load(block_table_row + offs_n // BLOCK_SIZE, mask=load_mask, other=0).to(tl.int64)
        else:
            block_ids = tl.load(block_table_row + offs_n // BLOCK_SIZE).to(tl.int64)
        slots = offs_n % BLOCK_SIZE
        k_ptrs = k_base + (block_ids * stride_kb + slots * stride_ks)[None, :] + offs_d[:, None]  # [D, N]
        v_ptrs = v_base + (block_ids * stride_vb + slots * stride_vs)[:, None] + offs_d[None, :]  # [N, D]
        if MASK and PAD_D:
            k = tl.load(k_ptrs, mask=load_mask[None, :] & d_mask[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=load_mask[:, None] & d_mask[None, :], other=0.0)
        elif MASK:
            k = tl.load(k_ptrs, mask=load_mask[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=load_mask[:, None], other=0.0)
        elif PAD_D:
            k = tl.load(k_ptrs, mask=d_mask[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=d_mask[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [M, N]
        if MASK:
            allowed = load_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])
            if HAS_WINDOW:
                allowed = allowed & (offs_n[None, :] > q_pos[:, None] - window)
            s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row with nothing allowed yet keeps m = -inf: subtract 0 instead (no inf - inf).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _paged_attention_kernel(
    q_ptr,  # [T, num_heads, HEAD_DIM]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    v_cache_ptr,
    out_ptr,  # [T, num_heads, HEAD_DIM] (NUM_SPLITS == 1)
    part_max_ptr,  # [T, num_heads, NUM_SPLITS] (NUM_SPLITS > 1)
    part_sum_ptr,  # [T, num_heads, NUM_SPLITS]
    part_acc_ptr,  # [T, num_heads, NUM_SPLITS, HEAD_DIM]
    block_tables_ptr,  # [B, max_blocks_per_seq]
    seq_lens_ptr,  # [B]
    query_start_loc_ptr,  # [B + 1]
    num_seqs,
    num_heads,
    qk_scale,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SEQ_CHUNK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Highest ids first: a sequence's later query tiles attend to more keys, so the
    # longest programs start first and the short ones fill the tail.
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # Which sequence owns this program: the last one whose first program id is <= pid,
    # counted over the sequences SEQ_CHUNK at a time (one compiled kernel for any count).
    seq = pid * 0 - 1
    for chunk in range(0, num_seqs, SEQ_CHUNK):
        offs_b = chunk + tl.arange(0, SEQ_CHUNK)
        starts = tl.load(query_start_loc_ptr + offs_b, mask=offs_b < num_seqs, other=0).to(tl.int32)
        first_pids = tl.where(offs_b < num_seqs, starts // BLOCK_Q + offs_b, 2147483647)
        seq += tl.sum((first_pids <= pid).to(tl.int32), axis=0)

    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - q_start
    q_tile = pid - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    q_idx = q_tile * BLOCK_Q + offs_m // GROUP_PAD  # query index within the sequence
    head_in_group = offs_m % GROUP_PAD
    row_mask = (q_idx < q_len) & (head_in_group < GROUP)
    head = kv_head * GROUP + head_in_group
    q_pos = context_len + q_idx
    token = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + (token * stride_qt + head * stride_qh)[:, None] + offs_d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    first_pos = context_len + q_tile * BLOCK_Q
    kv_hi = tl.minimum(first_pos + BLOCK_Q, seq_len)  # one past the tile's last query
    if HAS_WINDOW:
        # Every tile masked, from the one holding the window's first key.
        kv_lo = tl.maximum(first_pos - window + 1, 0)
        full_tiles = kv_lo // BLOCK_N
        first_tile = full_tiles
    else:
        # Tiles [0, full_tiles) hold only keys <= every row's position: no mask needed.
        kv_lo = first_pos * 0
        full_tiles = (first_pos + 1) // BLOCK_N
        first_tile = kv_lo

    k_base = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_cache_ptr + kv_head.to(tl.int64) * stride_vh
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # Split s takes the key tiles congruent to first_tile + s modulo NUM_SPLITS, as in
    # the decode kernel; in the masked range its first one is the next such tile.
    masked_first = full_tiles + (split - (full_tiles - first_tile) % NUM_SPLITS + NUM_SPLITS) % NUM_SPLITS
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    acc, m_i, l_i = _attend_tiles(
        q, acc, m_i, l_i, k_base, v_base, block_table_row, first_tile + split, full_tiles, NUM_SPLITS, kv_lo, kv_hi,
        q_pos, window, qk_scale, stride_kb, stride_ks, stride_vb, stride_vs, offs_d, d_mask,
        BLOCK_N, BLOCK_SIZE, False, HEAD_DIM_PAD != HEAD_DIM, HAS_WINDOW, UPCAST, DOT_PRECISION,
    )
    acc, m_i, l_i = _attend_tiles(
        q, acc, m_i, l_i, k_base, v_base, block_table_row, masked_first, tl.cdiv(kv_hi, BLOCK_N), NUM_SPLITS, kv_lo,
        kv_hi, q_pos, window, qk_scale, stride_kb, stride_ks, stride_vb, stride_vs, offs_d, d_mask,
        BLOCK_N, BLOCK_SIZE, True, HEAD_DIM_PAD != HEAD_DIM, HAS_WINDOW, UPCAST, DOT_PRECISION,
    )

    if NUM_SPLITS == 1:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        res = acc / l_safe[:, None]
        tl.store(
            out_ptr + (token * stride_ot + head * stride_oh)[:, None] + offs_d[None, :],
            res.to(out_ptr.dtype.element_ty),
            mask=row_mask[:, None] & d_mask[None, :],
        )
    else:
        part = (token * num_heads + head) * NUM_SPLITS + split  # [BLOCK_M]
        tl.store(part_max_ptr + part, m_i, mask=row_mask)
        tl.store(part_sum_ptr + part, l_i, mask=row_mask)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_mask[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=["stride_bt"])
def _paged_decode_kernel(
    q_ptr,  # [T, num_heads, HEAD_DIM]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    v_cache_ptr,
    out_ptr,  # [T, num_heads, HEAD_DIM] (NUM_SPLITS == 1)
    part_max_ptr,  # [B, num_heads, NUM_SPLITS] (NUM_SPLITS > 1)
    part_sum_ptr,  # [B, num_heads, NUM_SPLITS]
    part_acc_ptr,  # [B, num_heads, NUM_SPLITS, HEAD_DIM]
    block_tables_ptr,  # [B, max_blocks_per_seq]
    seq_lens_ptr,  # [B]
    query_start_loc_ptr,  # [B + 1]
    num_heads,
    qk_scale,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - q_start
    if q_len <= 0:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    head_mask = offs_h < GROUP
    head = kv_head * GROUP + offs_h
    token = q_start.to(tl.int64)
    q = tl.load(
        q_ptr + token * stride_qt + (head * stride_qh)[:, None] + offs_d[None, :],
        mask=head_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = tl.zeros([BLOCK_H], tl.int32) + (seq_len - 1)

    if HAS_WINDOW:
        kv_lo = tl.maximum(seq_len - window, 0)
        first_tile = kv_lo // BLOCK_N
        num_full = first_tile  # every tile masked
    else:
        kv_lo = seq_len * 0
        first_tile = seq_len * 0
        num_full = seq_len // BLOCK_N
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    # Split s takes tiles first_tile + s, first_tile + s + NUM_SPLITS, ...; in the masked
    # range [num_full, num_tiles) its first tile is the next one congruent to s.
    masked_first = num_full + (split - (num_full - first_tile) % NUM_SPLITS + NUM_SPLITS) % NUM_SPLITS

    k_base = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_cache_ptr + kv_head.to(tl.int64) * stride_vh
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM_PAD], tl.float32)
    acc, m_i, l_i = _attend_tiles(
        q, acc, m_i, l_i, k_base, v_base, block_table_row, first_tile + split, num_full, NUM_SPLITS, kv_lo,
        seq_len, q_pos, window, qk_scale, stride_kb, stride_ks, stride_vb, stride_vs, offs_d, d_mask,
        BLOCK_N, BLOCK_SIZE, False, HEAD_DIM_PAD != HEAD_DIM, HAS_WINDOW, UPCAST, DOT_PRECISION,
    )
    acc, m_i, l_i = _attend_tiles(
        q, acc, m_i, l_i, k_base, v_base, block_table_row, masked_first, num_tiles, NUM_SPLITS, kv_lo,
        seq_len, q_pos, window, qk_scale, stride_kb, stride_ks, stride_vb, stride_vs, offs_d, d_mask,
        BLOCK_N, BLOCK_SIZE, True, HEAD_DIM_PAD != HEAD_DIM, HAS_WINDOW, UPCAST, DOT_PRECISION,
    )

    if NUM_SPLITS == 1:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        res = acc / l_safe[:, None]
        tl.store(
            out_ptr + token * stride_ot + (head * stride_oh)[:, None] + offs_d[None, :],
            res.to(out_ptr.dtype.element_ty),
            mask=head_mask[:, None] & d_mask[None, :],
        )
    else:
        part = (seq.to(tl.int64) * num_heads + head) * NUM_SPLITS + split  # [BLOCK_H]
        tl.store(part_max_ptr + part, m_i, mask=head_mask)
        tl.store(part_sum_ptr + part, l_i, mask=head_mask)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=head_mask[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=["num_seqs"])
def _reduce_splits_kernel(
    out_ptr,  # [T, num_heads, HEAD_DIM]
    part_max_ptr,  # [B, num_heads, NUM_SPLITS]
    part_sum_ptr,  # [B, num_heads, NUM_SPLITS]
    part_acc_ptr,  # [B, num_heads, NUM_SPLITS, HEAD_DIM]
    query_start_loc_ptr,  # [B + 1]
    num_seqs,
    num_heads,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PER_TOKEN: tl.constexpr,
):
    # Row r of the partials is sequence r's one query token (decode kernel), or token r
    # (general kernel, PER_TOKEN).
    row = tl.program_id(0)
    head = tl.program_id(1)
    if PER_TOKEN:
        if row >= tl.load(query_start_loc_ptr + num_seqs):
            return
        token = row.to(tl.int64)
    else:
        q_start = tl.load(query_start_loc_ptr + row).to(tl.int32)
        q_len = tl.load(query_start_loc_ptr + row + 1).to(tl.int32) - q_start
        if q_len <= 0:
            return
        token = q_start.to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    split_mask = offs_s < NUM_SPLITS
    part = (row.to(tl.int64) * num_heads + head) * NUM_SPLITS + offs_s
    m = tl.load(part_max_ptr + part, mask=split_mask, other=float("-inf"))
    l = tl.load(part_sum_ptr + part, mask=split_mask, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=split_mask[:, None] & d_mask[None, :],
                  other=0.0)
    m_max = tl.max(m, axis=0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_safe)  # splits that saw no key have m = -inf -> weight 0
    total = tl.sum(w * l, axis=0)
    total = tl.where(total == 0.0, 1.0, total)
    res = tl.sum(acc * w[:, None], axis=0) / total
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty), mask=d_mask)


# The interpreter multiplies bf16 wrongly (it stores bf16 as raw 16-bit integers), so there
# every tile is upcast to fp32 before tl.dot.
_INTERPRETED = is_interpreted(_paged_attention_kernel)


# ----------------------------------------------------------------------------------------
# Launch configuration: a function of shapes and hints only (never of tensor values).


def _decode_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the decode kernel: key tiles of ~8K elements
    (16 KiB of K and 16 KiB of V in 16-bit dtypes), three tiles in flight per program."""
    block_n = max(16, min(128, 8192 // head_dim))
    if dtype == torch.float32:
        block_n = max(16, block_n // 2)
    return block_n, 4, 3


def _general_config(
    head_dim: int, group_pad: int, max_query_len: int | None, dtype: torch.dtype
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the general kernel. Query tiles of 128
    rows when queries may be long; 64, then 32 for shorter ones: less padding per
    sequence, and a short chunk over a long cached context (a prefix-cache hit) is
    spread over more programs. Smaller tiles for head_dim 256 and fp32 to stay within
    registers and shared memory."""
    if dtype == torch.float32:
        block_m, block_n = 64, 32
    elif head_dim > 128:
        block_m, block_n = 64, 32
    elif max_query_len is None or max_query_len >= 512:
        block_m, block_n = 128, 64
    else:
        block_m, block_n = (64 if max_query_len >= 256 else 32), 64
    block_m = max(block_m, group_pad)
    num_warps = 8 if block_m >= 128 or head_dim > 128 else 4
    return block_m, block_n, num_warps, 2


def _num_splits(num_seqs: int, num_kv_heads: int, max_context: int, block_n: int, sms: int) -> int:
    """Decode context splits: enough for about ``_SPLIT_TARGET_WAVES`` programs per SM (a
    decode program keeps ~2 K/V tiles in flight; two per SM cover HBM latency), with at
    least ``_MIN_TILES_PER_SPLIT`` key tiles each. A power of two (few compiled variants);
    1 when the batch alone is enough or the context is short."""
    programs = num_seqs * num_kv_heads
    target = _SPLIT_TARGET_WAVES * sms
    if programs == 0 or programs >= target:
        return 1
    max_by_length = triton.cdiv(max_context, block_n) // _MIN_TILES_PER_SPLIT
    if max_by_length < 2:
        return 1
    wanted = next_power_of_2(triton.cdiv(target, programs))
    by_length = 1 << (max_by_length.bit_length() - 1)
    return min(wanted, by_length, _MAX_SPLITS)


def _prefill_splits(
    num_tokens: int, num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, block_q: int,
    max_context: int, block_n: int, sms: int,
) -> int:
    """Context splits of the general kernel: ``_PREFILL_SPLITS`` or 1.

    A short chunk over a long cached context (a prefix-cache hit: tens of queries after a
    thousand cached tokens) has few query tiles, so few programs, each walking the whole
    context; splitting the context spreads it over the SMs as in decode. Only batches of
    at most ``_PREFILL_SPLIT_MAX_SEQS`` sequences split (a mixed batch of many decodes has
    programs enough), only when the query tiles alone (counted as if one sequence held
    every token) leave SMs idle and the context holds ``_MIN_TILES_PER_SPLIT`` key tiles
    per split, and only while the fp32 partials stay under ``_MAX_PARTIAL_BYTES``. One
    split count keeps the compiled variants to two, both compiled when the engine
    captures its prompt graphs rather than while it serves."""
    splits = _PREFILL_SPLITS
    if num_seqs > _PREFILL_SPLIT_MAX_SEQS:
        return 1
    if triton.cdiv(num_tokens, block_q) * num_kv_heads >= _SPLIT_TARGET_WAVES * sms:
        return 1
    if triton.cdiv(max_context, block_n) < splits * _MIN_TILES_PER_SPLIT:
        return 1
    if num_tokens * num_heads * splits * (head_dim + 2) * 4 > _MAX_PARTIAL_BYTES:
        return 1
    return splits


def _check_hint(name: str, value: int | None, minimum: int) -> None:
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be None or an int >= {minimum}, got {value!r}")


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's queries over its cached keys and values; see the
    reference. The step's keys and values must already be in the cache. Returns ``out``
    (allocated when not given) of q's shape and dtype.

    Keyword-only hints: they choose the kernel and its tiling and, when truthful, never
    change the result; they are not checked against the tensors (that would need a sync):

    - ``max_query_len``: an upper bound on any sequence's query count this step. ``1``
      (a decode-only batch) selects the decode kernel; ``None``
      runs the general kernel, correct for every batch. Passing 1 when some sequence has
      more queries is an error the kernel cannot see: that sequence's rows come out wrong.
    - ``max_seq_len``: the longest ``seq_lens`` entry (or a bound on it), used only to
      size split-K; ``None`` falls back to ``block_tables.shape[1] * block_size``. Any
      value gives correct results; a fixed one keeps the launch capturable.
    - ``num_splits``: force the number of context splits (split-K, either kernel);
      ``None`` picks it from the shapes, these hints and the device's SM count.

    The launch configuration depends only on shapes, dtypes and these hints, so a call
    with fixed hints can be captured in a CUDA graph.
    """
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("k_cache", k_cache, ndim=4, dtypes=(q.dtype,))
    check_tensor("v_cache", v_cache, ndim=4, dtypes=(q.dtype,))
    check_tensor("block_tables", block_tables, ndim=2, dtypes=INDEX_DTYPES)
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=INDEX_DTYPES)
    check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=INDEX_DTYPES)
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    if cache_head_dim != head_dim:
        raise ValueError(f"k_cache has head_dim {cache_head_dim} but q has {head_dim}")
    if head_dim < 1 or head_dim > 256:
        raise ValueError(f"q has head_dim {head_dim}; supported: 1 to 256")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"q's num_heads ({num_heads}) must be a multiple of k_cache's num_kv_heads ({num_kv_heads})")
    num_seqs = seq_lens.shape[0]
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must have {num_seqs} rows (one per sequence), got {tuple(block_tables.shape)}")
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(f"query_start_loc must have shape ({num_seqs + 1},), got {tuple(query_start_loc.shape)}")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise ValueError(f"scale must be a float, got {scale!r}")
    if sliding_window is not None and (
        not isinstance(sliding_window, int) or isinstance(sliding_window, bool) or sliding_window < 1
    ):
        raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
    _check_hint("max_query_len", max_query_len, 0)
    _check_hint("max_seq_len", max_seq_len, 0)
    _check_hint("num_splits", num_splits, 1)
    check_out("out", out, tuple(q.shape), q.dtype)
    device = check_devices(
        _paged_attention_kernel, q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
        seq_lens=seq_lens, query_start_loc=query_start_loc, out=out,
    )

    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    head_pad = max(16, next_power_of_2(head_dim))  # the tiles' width (tl.dot takes at least 16)
    upcast = _INTERPRETED or q.dtype == torch.float32
    dot_precision = "ieee" if upcast else "tf32"
    qk_scale = float(scale) * _LOG2E
    window = sliding_window if sliding_window is not None else 0
    stride_q, stride_out = q.stride(), out.stride()
    cache_strides = (*k_cache.stride()[:3], *v_cache.stride()[:3])

    # The longest context any query attends to (a bound), for sizing split-K.
    max_context = max_seq_len if max_seq_len is not None else block_tables.shape[1] * block_size

    if max_query_len == 1:
        block_n, num_warps, num_stages = _decode_config(head_pad, q.dtype)
        if num_splits is None:
            if sliding_window is not None:
                max_context = min(max_context, sliding_window + block_n)
            num_splits = _num_splits(num_seqs, num_kv_heads, max_context, block_n, num_sms(device))
        part_max, part_sum, part_acc = _partials(out, num_seqs, num_splits)
        _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
            q, k_cache, v_cache, out, part_max, part_sum, part_acc,
            block_tables, seq_lens, query_start_loc,
            num_heads, qk_scale, window,
            stride_q[0], stride_q[1], stride_out[0], stride_out[1],
            *cache_strides, block_tables.stride(0),
            GROUP=group,
            BLOCK_H=max(16, next_power_of_2(group)),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_pad,
            BLOCK_N=block_n,
            BLOCK_SIZE=block_size,
            NUM_SPLITS=num_splits,
            HAS_WINDOW=sliding_window is not None,
            UPCAST=upcast,
            DOT_PRECISION=dot_precision,
            num_warps=num_warps,
            num_stages=num_stages,
        )
        if num_splits > 1:
            _reduce_splits(out, part_max, part_sum, part_acc, query_start_loc, num_seqs, False)
        return out

    group_pad = next_power_of_2(group)
    block_m, block_n, num_warps, num_stages = _general_config(head_pad, group_pad, max_query_len, q.dtype)
    block_q = block_m // group_pad
    if num_splits is None:
        if sliding_window is not None:
            max_context = min(max_context, sliding_window + block_m + block_n)
        num_splits = _prefill_splits(num_tokens, num_seqs, num_heads, num_kv_heads, head_dim, block_q, max_context,
                                     block_n, num_sms(device))
    part_max, part_sum, part_acc = _partials(out, num_tokens, num_splits)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, part_max, part_sum, part_acc, block_tables, seq_lens, query_start_loc,
        num_seqs, num_heads, qk_scale, window,
        stride_q[0], stride_q[1], stride_out[0], stride_out[1],
        *cache_strides, block_tables.stride(0),
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        SEQ_CHUNK=_SEQ_CHUNK,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_pad,
        BLOCK_N=block_n,
        BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits,
        HAS_WINDOW=sliding_window is not None,
        UPCAST=upcast,
        DOT_PRECISION=dot_precision,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if num_splits > 1:
        _reduce_splits(out, part_max, part_sum, part_acc, query_start_loc, num_seqs, True)
    return out


def _partials(out: torch.Tensor, rows: int, num_splits: int) -> tuple[torch.Tensor, ...]:
    """Split-K partials (max, sum, unnormalised acc) in fp32 for ``rows`` rows of ``out``'s
    heads; with one split the kernels write ``out`` directly and ``out`` fills the unused
    arguments."""
    if num_splits == 1:
        return out, out, out
    _, num_heads, head_dim = out.shape
    part_max = torch.empty((rows, num_heads, num_splits), dtype=torch.float32, device=out.device)
    part_acc = torch.empty((rows, num_heads, num_splits, head_dim), dtype=torch.float32, device=out.device)
    return part_max, torch.empty_like(part_max), part_acc


def _reduce_splits(out, part_max, part_sum, part_acc, query_start_loc, num_seqs: int, per_token: bool) -> None:
    """Combines split-K partials ``[rows, num_heads, num_splits(, head_dim)]`` into ``out``:
    one row per sequence (decode) or per token (``per_token``)."""
    rows, num_heads, num_splits = part_max.shape
    head_dim = out.shape[2]
    _reduce_splits_kernel[(rows, num_heads)](
        out, part_max, part_sum, part_acc, query_start_loc,
        num_seqs, num_heads, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, next_power_of_2(head_dim)),
        NUM_SPLITS=num_splits,
        BLOCK_S=next_power_of_2(num_splits),
        PER_TOKEN=per_token,
        num_warps=4 if head_dim * num_splits >= 4096 else 2,
    )
