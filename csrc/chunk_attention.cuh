// Paged attention for prompt chunks on tensor cores: each sequence's queries (a chunk of
// its prompt, often after a long cached prefix) against its paged K/V cache.
//
// Semantics are those of asyncgen/_ops/reference.py::paged_attention without a sliding
// window: query i of sequence s (position context + i, context = seq_len - q_len) attends
// to cache positions [0, context + i]. Softmax in fp32, online (running max), base 2.
//
// Layouts (element strides):
//
//   q, out            [num_tokens, num_heads, head_dim]        any token/head stride
//   k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim], inner three dims contiguous
//   block_tables      [num_seqs, >= ceil(seq_len / block_size)] int32, block_size a power of two
//   seq_lens          [num_seqs] int32;  query_start_loc [num_seqs + 1] int32
//
// Work decomposition
// ------------------
// A block (4 warps) owns 64 query rows of one kv head: rows are (token, query head of the
// kv head's GQA group) pairs, token-major, so a block holds 64 / group tokens of one
// sequence and reads each K/V byte once for the whole group. Block x of a sequence's
// tiles is numbered as in the Triton kernel: sequence s's tiles start at
// query_start_loc[s] / tokens_per_block + s (an upper bound on the tiles before it), so
// the grid is num_tokens / tokens_per_block + num_seqs blocks wide and surplus blocks exit.
//
//   warp w: rows 16w .. 16w + 15 (an m16 tile), for the whole head_dim
//   key tile: 32 positions, K and V each [32][head_dim] in shared memory (rows padded by
//   8 elements so that ldmatrix's 8 row addresses fall in different banks), two stages:
//   the cp.async copies of tile t + 1 are in flight while tile t is computed. Q stays in
//   shared memory and is read again each tile, which keeps a thread within 128 registers
//   and the block within ~52 KB: four blocks an SM hide each other's latencies.
//
//   S = Q K^T:  A = Q via ldmatrix, B = K rows via ldmatrix
//   P = exp2(S * scale - m) rounded to T, straight from S's accumulator layout into A
//   O += P V:   B = V via ldmatrix.trans
//
// Split-K (grid z, for few query tiles over long contexts): split z takes a contiguous
// range of the key tiles, writes its unnormalised output and (max, sum) per row, and the
// split that finishes last (a ticket per block column in `split_counters`) combines them.
//
// Napkin math, 78 new tokens over 992 cached, Llama-2-7B layer (32 heads, head_dim 128):
// K/V 1,070 x 32 x 128 x 2 x 2 B = 17.5 MB, 4 us at 4.4 TB/s; 2 x 2 x 128 padded rows x
// 1,070 x 128 x 32 = 2.2 GFLOP, ~4 us at ~550 TFLOP/s of mma.sync. Measured on an H200
// (docs/BENCHMARKS.md) the kernel takes 61 us there (Triton's 28), bound by the latency
// of each warp's instruction stream; a 512-token chunk among 63 decodes takes 208 us
// (Triton's 384), where this kernel's empty warps skip their products. The backend sends
// it batches of more than 8 sequences.
//
// Masking: key positions past a row's own are never summed; positions past the chunk's
// last query are never loaded (their block-table entries may be garbage), and the copies
// for them write zeros, so NaN in unused cache slots cannot reach the result.
#pragma once

#include "common.cuh"

namespace asyncgen {

constexpr int kChunkWarps = 4;
constexpr int kChunkThreads = kChunkWarps * kWarpSize;
constexpr int kChunkRows = 16 * kChunkWarps;  // query rows per block
constexpr int kChunkKeys = 32;                // key positions per tile
constexpr int kChunkMinBlocks = 4;            // blocks an SM (registers <= 128, ~52 KB of shared memory each)
constexpr int kChunkPad = 8;                  // elements of padding per shared-memory row
constexpr int kChunkMaxGroup = 8;             // query heads per kv head
constexpr int kChunkMaxSplits = 16;

struct ChunkAttentionParams {
  void* out;                    // [num_tokens, num_heads, head_dim]
  const void* q;                // [num_tokens, num_heads, head_dim]
  const void* k_cache;          // [num_blocks, block_size, num_kv_heads, head_dim]
  const void* v_cache;
  const int* block_tables;      // [num_seqs, block_table_stride]
  const int* seq_lens;          // [num_seqs]
  const int* query_start_loc;   // [num_seqs + 1]
  float* part_out;              // [num_tokens, num_heads, num_splits, head_dim] (split only)
  float* part_ml;               // [num_tokens, num_heads, num_splits, 2]: max, sum (split only)
  int* split_counters;          // [gridDim.x * num_kv_heads], 0 before and after (split only)
  int64_t q_stride_token, q_stride_head;
  int64_t out_stride_token, out_stride_head;
  int64_t k_stride_block, v_stride_block;
  int64_t block_table_stride;
  int num_tokens, num_seqs, num_heads, num_kv_heads;
  int block_shift;              // block_size = 1 << block_shift
  int num_splits;               // 1: one pass
  float scale_log2;             // softmax scale * log2(e)
};

// Blocks along x for a call of a kernel with `rows` query rows a block: enough for every
// sequence's query tiles (see chunk_place).
__host__ __device__ inline int chunk_grid_x(int num_tokens, int num_seqs, int group, int rows = kChunkRows) {
  return num_tokens / (rows / group) + num_seqs;
}

template <int HEAD_DIM>
constexpr int chunk_smem_bytes() {
  return (kChunkRows + 4 * kChunkKeys) * (HEAD_DIM + kChunkPad) * 2;
}

// Where a block's work lies: its sequence, which of the sequence's query tiles (ROWS rows
// of (token, query head) pairs a block), and its split's range of KEYS-key tiles. Blocks
// are numbered as in the Triton kernel: sequence s's tiles start at
// query_start_loc[s] / tokens_per_block + s. `valid` is false for a surplus block (uniform
// over the block). Contains __syncthreads(): call from every thread.
struct ChunkPlace {
  bool valid;
  int seq, q_start, tq, q_tile;
  int rows;       // valid rows of this block
  int first_pos;  // position of the block's first token
  int kv_end;     // keys [0, kv_end) are read
  int tile_lo, tile_hi;
};

template <int WARPS, int ROWS, int KEYS>
AG_DEVICE ChunkPlace chunk_place(const ChunkAttentionParams& p, int group, int pid, int split, float* scratch) {
  ChunkPlace at{};
  at.tq = ROWS / group;
  float before = 0.f;
  for (int s = threadIdx.x; s < p.num_seqs; s += WARPS * kWarpSize) {
    before += p.query_start_loc[s] / at.tq + s <= pid ? 1.f : 0.f;
  }
  at.seq = static_cast<int>(block_sum<WARPS>(before, scratch)) - 1;
  at.q_start = p.query_start_loc[at.seq];
  const int q_len = p.query_start_loc[at.seq + 1] - at.q_start;
  at.q_tile = pid - (at.q_start / at.tq + at.seq);
  at.valid = at.q_tile * at.tq < q_len;
  if (!at.valid) return at;
  const int context = p.seq_lens[at.seq] - q_len;
  const int tile_tokens = imin(at.tq, q_len - at.q_tile * at.tq);
  at.rows = tile_tokens * group;
  at.first_pos = context + at.q_tile * at.tq;
  at.kv_end = at.first_pos + tile_tokens;
  const int key_tiles = ceil_div(at.kv_end, KEYS);
  const int per_split = ceil_div(key_tiles, p.num_splits);
  at.tile_lo = imin(split * per_split, key_tiles);
  at.tile_hi = imin(at.tile_lo + per_split, key_tiles);
  return at;
}

// Where a block's keys and values are: its kv head's column of the caches and its
// sequence's row of the block table.
template <typename T, int HEAD_DIM>
struct ChunkKV {
  const T* k;
  const T* v;
  const int* table;
  int64_t token_stride;  // elements between a block's consecutive slots

  AG_DEVICE ChunkKV(const ChunkAttentionParams& p, const ChunkPlace& at, int kv_head)
      : k(static_cast<const T*>(p.k_cache) + static_cast<int64_t>(kv_head) * HEAD_DIM),
        v(static_cast<const T*>(p.v_cache) + static_cast<int64_t>(kv_head) * HEAD_DIM),
        table(p.block_tables + static_cast<int64_t>(at.seq) * p.block_table_stride),
        token_stride(static_cast<int64_t>(p.num_kv_heads) * HEAD_DIM) {}
};

// A warp's running softmax state for its rows g ("lo") and g + 8 ("hi"): the running max
// (base 2, scaled) and this lane's share of the row sum.
struct ChunkRows {
  float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.f, l_hi = 0.f;
};

// One key tile's online softmax over S in mma.sync's accumulator layout: s(nt, r) is row g
// (r < 2) or g + 8, key key0 + 8 nt + 2c + r % 2. In two phases, so that a caller can
// act between them (the warpgroup kernel rescales its output and issues the next tile's
// product there):
//
// chunk_softmax_max scales S to base 2, masks keys past each row's position when
// `masked`, and moves each row's running max to the tile's max where that is more than
// `slack` above it (0: every rise), returning the base the exponentials are taken from
// and the factors alpha by which the rows' earlier sums and outputs must be scaled: 1
// exactly where the max stayed. With slack > 0 a row's P values stay below 2^slack.
// chunk_softmax_exp replaces S by P = exp2(S - base) and adds P's row sums.
template <int KEY_TILES, typename S>
AG_DEVICE void chunk_softmax_max(S&& s, int key0, bool masked, int pos_lo, int pos_hi, float scale_log2, float slack,
                                 ChunkRows& st, float& base_lo, float& base_hi, float& alpha_lo, float& alpha_hi) {
  const int c = threadIdx.x % kWarpSize % 4;
  float top_lo = -INFINITY, top_hi = -INFINITY;
#pragma unroll
  for (int nt = 0; nt < KEY_TILES; ++nt)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      float v = s(nt, r) * scale_log2;
      if (masked && key0 + 8 * nt + 2 * c + r % 2 > (r < 2 ? pos_lo : pos_hi)) v = -INFINITY;
      s(nt, r) = v;
      if (r < 2) {
        top_lo = fmaxf(top_lo, v);
      } else {
        top_hi = fmaxf(top_hi, v);
      }
    }
  top_lo = fmaxf(top_lo, __shfl_xor_sync(kFullMask, top_lo, 1));
  top_lo = fmaxf(top_lo, __shfl_xor_sync(kFullMask, top_lo, 2));
  top_hi = fmaxf(top_hi, __shfl_xor_sync(kFullMask, top_hi, 1));
  top_hi = fmaxf(top_hi, __shfl_xor_sync(kFullMask, top_hi, 2));
  // -inf + slack stays -inf, so a row's first key always sets its max.
  const float new_lo = top_lo > st.m_lo + slack ? top_lo : st.m_lo;
  const float new_hi = top_hi > st.m_hi + slack ? top_hi : st.m_hi;
  // A row with nothing allowed yet keeps m = -inf: subtract 0 instead (no inf - inf).
  base_lo = new_lo == -INFINITY ? 0.f : new_lo;
  base_hi = new_hi == -INFINITY ? 0.f : new_hi;
  alpha_lo = new_lo == st.m_lo ? 1.f : fast_exp2(st.m_lo - base_lo);
  alpha_hi = new_hi == st.m_hi ? 1.f : fast_exp2(st.m_hi - base_hi);
  st.m_lo = new_lo;
  st.m_hi = new_hi;
}

template <int KEY_TILES, typename S>
AG_DEVICE void chunk_softmax_exp(S&& s, float base_lo, float base_hi, float alpha_lo, float alpha_hi,
                                 ChunkRows& st) {
  float sum_lo = 0.f, sum_hi = 0.f;
#pragma unroll
  for (int nt = 0; nt < KEY_TILES; ++nt)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const float e = fast_exp2(s(nt, r) - (r < 2 ? base_lo : base_hi));
      s(nt, r) = e;
      if (r < 2) {
        sum_lo += e;
      } else {
        sum_hi += e;
      }
    }
  st.l_lo = st.l_lo * alpha_lo + sum_lo;
  st.l_hi = st.l_hi * alpha_hi + sum_hi;
}

// Both phases, the max following every rise: S replaced by P, the factors returned.
template <int KEY_TILES, typename S>
AG_DEVICE void chunk_softmax_tile(S&& s, int key0, bool masked, int pos_lo, int pos_hi, float scale_log2,
                                  ChunkRows& st, float& alpha_lo, float& alpha_hi) {
  float base_lo, base_hi;
  chunk_softmax_max<KEY_TILES>(s, key0, masked, pos_lo, pos_hi, scale_log2, 0.f, st, base_lo, base_hi, alpha_lo,
                               alpha_hi);
  chunk_softmax_exp<KEY_TILES>(s, base_lo, base_hi, alpha_lo, alpha_hi, st);
}

// The block's output once its key tiles are done: o(t, r) is the warp's row g (r < 2) or
// g + 8, dims 8t + 2c + r % 2, for the warp's rows row0 .. row0 + 15 of the block. One
// pass writes the normalised rows; with splits each block writes its partials and the
// last of a tile's splits to finish (a ticket in split_counters) combines them, two threads
// a row. Call from every thread of the block (THREADS == 2 * ROWS).
template <typename T, int HEAD_DIM, int THREADS, int ROWS, typename O>
AG_DEVICE void chunk_finish(const ChunkAttentionParams& p, const ChunkPlace& at, int kv_head, int split, int pid,
                            int row0, O&& o, ChunkRows st) {
  static_assert(THREADS == 2 * ROWS, "two threads a row in the combine");
  constexpr int kDimTiles = HEAD_DIM / 8;
  const int group = p.num_heads / p.num_kv_heads;
  const int lane = threadIdx.x % kWarpSize, g = lane / 4, c = lane % 4;
  st.l_lo += __shfl_xor_sync(kFullMask, st.l_lo, 1);
  st.l_lo += __shfl_xor_sync(kFullMask, st.l_lo, 2);
  st.l_hi += __shfl_xor_sync(kFullMask, st.l_hi, 1);
  st.l_hi += __shfl_xor_sync(kFullMask, st.l_hi, 2);

  auto row_token_head = [&](int r, int64_t& token, int& head) {
    token = at.q_start + at.q_tile * at.tq + r / group;
    head = kv_head * group + r % group;
  };
  T* out = static_cast<T*>(p.out);
  const int splits = p.num_splits;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = row0 + g + 8 * half;
    if (r >= at.rows) continue;
    int64_t token;
    int head;
    row_token_head(r, token, head);
    const float l = half == 0 ? st.l_lo : st.l_hi;
    if (splits == 1) {
      const float inv = l > 0.f ? 1.f / l : 0.f;
      T* dst = out + token * p.out_stride_token + head * p.out_stride_head + 2 * c;
#pragma unroll
      for (int t = 0; t < kDimTiles; ++t) {
        *reinterpret_cast<uint32_t*>(dst + 8 * t) = pack2<T>(o(t, 2 * half) * inv, o(t, 2 * half + 1) * inv);
      }
    } else {
      const int64_t part = (token * p.num_heads + head) * splits + split;
      float* dst = p.part_out + part * HEAD_DIM + 2 * c;
#pragma unroll
      for (int t = 0; t < kDimTiles; ++t) {
        *reinterpret_cast<float2*>(dst + 8 * t) = make_float2(o(t, 2 * half), o(t, 2 * half + 1));
      }
      if (c == 0) *reinterpret_cast<float2*>(p.part_ml + 2 * part) = make_float2(half == 0 ? st.m_lo : st.m_hi, l);
    }
  }
  if (splits == 1) return;
  if (!takes_last_ticket(p.split_counters + static_cast<int64_t>(kv_head) * gridDim.x + pid, splits)) return;
  // out = sum_z w_z o_z / sum_z w_z l_z with w_z = exp2(m_z - max m), over the splits'
  // partials (other blocks' writes, read past L1). Thread t takes half t % 2 of row t / 2,
  // with every split's loads of a step issued together.
  constexpr int kHalfDim = HEAD_DIM / 2;
  const int r = threadIdx.x / 2, part_half = threadIdx.x % 2;
  if (r >= at.rows) return;
  int64_t token;
  int head;
  row_token_head(r, token, head);
  const int64_t part0 = (token * p.num_heads + head) * splits;
  float w[kChunkMaxSplits], l_z[kChunkMaxSplits];
  float m = -INFINITY;
#pragma unroll
  for (int z = 0; z < kChunkMaxSplits; ++z) {
    if (z < splits) {
      const float2 ml = __ldcg(reinterpret_cast<const float2*>(p.part_ml) + part0 + z);
      w[z] = ml.x;
      l_z[z] = ml.y;
      m = fmaxf(m, ml.x);
    }
  }
  const float m_ref = m == -INFINITY ? 0.f : m;
  float total = 0.f;
#pragma unroll
  for (int z = 0; z < kChunkMaxSplits; ++z) {
    if (z < splits) {
      w[z] = exp2f(w[z] - m_ref);
      total += w[z] * l_z[z];
    }
  }
  const float inv = total > 0.f ? 1.f / total : 0.f;
  const float* src = p.part_out + part0 * HEAD_DIM + part_half * kHalfDim;
  T* dst = out + token * p.out_stride_token + head * p.out_stride_head + part_half * kHalfDim;
#pragma unroll 4
  for (int d = 0; d < kHalfDim; d += 4) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int z = 0; z < kChunkMaxSplits; ++z) {
      if (z < splits) {
        const float4 v = __ldcg(reinterpret_cast<const float4*>(src + z * HEAD_DIM + d));
        acc.x += w[z] * v.x;
        acc.y += w[z] * v.y;
        acc.z += w[z] * v.z;
        acc.w += w[z] * v.w;
      }
    }
    *reinterpret_cast<uint32_t*>(dst + d) = pack2<T>(acc.x * inv, acc.y * inv);
    *reinterpret_cast<uint32_t*>(dst + d + 2) = pack2<T>(acc.z * inv, acc.w * inv);
  }
}

template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(kChunkThreads, kChunkMinBlocks) chunk_attention_kernel(const ChunkAttentionParams p) {
  constexpr int kRow = HEAD_DIM + kChunkPad;   // shared-memory row, elements
  constexpr int kPieces = HEAD_DIM / 8;        // 16-byte pieces of a row
  constexpr int kKSteps = HEAD_DIM / 16;       // k steps of S = Q K^T
  constexpr int kDimTiles = HEAD_DIM / 8;      // n tiles of O
  constexpr int kKeyTiles = kChunkKeys / 8;    // n tiles of S
  AG_DYNAMIC_SMEM(smem);
  T* q_s = reinterpret_cast<T*>(smem);         // [kChunkRows][kRow]
  T* k_s = q_s + kChunkRows * kRow;            // [2][kChunkKeys][kRow]
  T* v_s = k_s + 2 * kChunkKeys * kRow;        // [2][kChunkKeys][kRow]
  __shared__ float scratch[kChunkWarps];

  const int group = p.num_heads / p.num_kv_heads;
  const int pid = blockIdx.x, kv_head = blockIdx.y, split = blockIdx.z;
  const ChunkPlace at = chunk_place<kChunkWarps, kChunkRows, kChunkKeys>(p, group, pid, split, scratch);
  if (!at.valid) return;  // uniform over the block
  const int rows = at.rows, first_pos = at.first_pos, kv_end = at.kv_end;
  const int tile_lo = at.tile_lo, tile_hi = at.tile_hi;

  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int g = lane / 4;
  const int row0 = 16 * warp;
  const bool warp_active = row0 < rows;
  const int pos_lo = first_pos + (row0 + g) / group;      // position of row g of the warp's tile
  const int pos_hi = first_pos + (row0 + g + 8) / group;  // and of row g + 8
  const int warp_first_pos = first_pos + row0 / group;
  const int warp_last_pos = first_pos + imin(row0 + 15, rows - 1) / group;

  const T* q = static_cast<const T*>(p.q);
  const ChunkKV<T, HEAD_DIM> kv(p, at, kv_head);

  // Each thread copies one 16-byte piece of kLoads key rows a tile (rows j0 + u * kRowStep).
  // Their block ids are read a tile ahead of the copies, so the table lookups (L2
  // round trips) overlap the tile being computed instead of delaying each copy.
  constexpr int kLoads = kChunkKeys * kPieces / kChunkThreads;
  constexpr int kRowStep = kChunkThreads / kPieces;
  static_assert(kChunkThreads % kPieces == 0 && kLoads >= 1, "a thread's pieces share one column");
  const int piece = threadIdx.x % kPieces, j0 = threadIdx.x / kPieces;
  // A tile starts on a cache block boundary (block_size <= kChunkKeys, both powers of two),
  // so each of a thread's rows keeps its slot in the block from tile to tile.
  int ids[kLoads], slot_off[kLoads];
#pragma unroll
  for (int u = 0; u < kLoads; ++u) {
    slot_off[u] = ((j0 + u * kRowStep) & ((1 << p.block_shift) - 1)) * static_cast<int>(kv.token_stride) + piece * 8;
  }
  auto fetch_ids = [&](int tile) {
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int pos = tile * kChunkKeys + j0 + u * kRowStep;
      ids[u] = pos < kv_end ? kv.table[pos >> p.block_shift] : 0;
    }
  };
  auto load_keys = [&](int tile, int stage) {
    T* k_dst = k_s + (stage * kChunkKeys + j0) * kRow + piece * 8;
    T* v_dst = v_s + (stage * kChunkKeys + j0) * kRow + piece * 8;
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const bool ok = tile * kChunkKeys + j0 + u * kRowStep < kv_end;
      const int64_t block = ok ? ids[u] : 0;
      cp_async16(k_dst + u * kRowStep * kRow, kv.k + block * p.k_stride_block + slot_off[u], ok);
      cp_async16(v_dst + u * kRowStep * kRow, kv.v + block * p.v_stride_block + slot_off[u], ok);
    }
  };

  float o[kDimTiles][4];
#pragma unroll
  for (int t = 0; t < kDimTiles; ++t)
#pragma unroll
    for (int r = 0; r < 4; ++r) o[t][r] = 0.f;
  ChunkRows st;
  const int mi = lane / 8, ri = lane % 8;  // the matrix and row this lane addresses for ldmatrix

  if (tile_lo < tile_hi) {
    for (int i = threadIdx.x; i < kChunkRows * kPieces; i += kChunkThreads) {
      const int r = i / kPieces, piece = i % kPieces;
      const bool ok = r < rows;
      const int64_t token = at.q_start + at.q_tile * at.tq + (ok ? r / group : 0);
      const int head = kv_head * group + (ok ? r % group : 0);
      cp_async16(q_s + r * kRow + piece * 8, q + token * p.q_stride_token + head * p.q_stride_head + piece * 8, ok);
    }
    fetch_ids(tile_lo);
    load_keys(tile_lo, 0);
    cp_async_commit();
    if (tile_lo + 1 < tile_hi) fetch_ids(tile_lo + 1);
    for (int tile = tile_lo; tile < tile_hi; ++tile) {
      const int stage = (tile - tile_lo) & 1;
      if (tile + 1 < tile_hi) {
        load_keys(tile + 1, stage ^ 1);
        cp_async_commit();
        if (tile + 2 < tile_hi) fetch_ids(tile + 2);  // used by the next iteration's copies
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();
      if (warp_active && tile * kChunkKeys <= warp_last_pos) {
        const T* ks = k_s + stage * kChunkKeys * kRow;
        const T* vs = v_s + stage * kChunkKeys * kRow;
        float s[kKeyTiles][4];
#pragma unroll
        for (int t = 0; t < kKeyTiles; ++t)
#pragma unroll
          for (int r = 0; r < 4; ++r) s[t][r] = 0.f;
#pragma unroll
        for (int kk = 0; kk < kKSteps; ++kk) {
          // Q's fragment comes from shared memory each tile: registers kept for occupancy.
          uint32_t qa[4];
          ldmatrix_x4<false>(qa, q_s + (row0 + (mi % 2) * 8 + ri) * kRow + 16 * kk + (mi / 2) * 8);
#pragma unroll
          for (int nt = 0; nt < kKeyTiles; nt += 2) {  // independent accumulators a k step
            uint32_t b[4];
            ldmatrix_x4<false>(b, ks + ((nt + mi / 2) * 8 + ri) * kRow + 16 * kk + (mi % 2) * 8);
            const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
            mma_m16n8k16<T>(s[nt], qa, b0);
            mma_m16n8k16<T>(s[nt + 1], qa, b1);
          }
        }
        float alpha_lo, alpha_hi;
        chunk_softmax_tile<kKeyTiles>([&](int nt, int r) -> float& { return s[nt][r]; }, tile * kChunkKeys,
                                      (tile + 1) * kChunkKeys - 1 > warp_first_pos, pos_lo, pos_hi, p.scale_log2, st,
                                      alpha_lo, alpha_hi);
#pragma unroll
        for (int t = 0; t < kDimTiles; ++t) {
          o[t][0] *= alpha_lo;
          o[t][1] *= alpha_lo;
          o[t][2] *= alpha_hi;
          o[t][3] *= alpha_hi;
        }
#pragma unroll
        for (int j = 0; j < kChunkKeys / 16; ++j) {
          // P's accumulator tiles 2j, 2j + 1 are the A fragment of keys 16j .. 16j + 15.
          const uint32_t pa[4] = {pack2<T>(s[2 * j][0], s[2 * j][1]), pack2<T>(s[2 * j][2], s[2 * j][3]),
                                  pack2<T>(s[2 * j + 1][0], s[2 * j + 1][1]),
                                  pack2<T>(s[2 * j + 1][2], s[2 * j + 1][3])};
#pragma unroll
          for (int dt = 0; dt < kDimTiles; dt += 2) {
            uint32_t b[4];
            ldmatrix_x4<true>(b, vs + (16 * j + (mi % 2) * 8 + ri) * kRow + 8 * (dt + mi / 2));
            const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
            mma_m16n8k16<T>(o[dt], pa, b0);
            mma_m16n8k16<T>(o[dt + 1], pa, b1);
          }
        }
      }
      __syncthreads();  // every warp is done with this stage before it is refilled
    }
  }
  chunk_finish<T, HEAD_DIM, kChunkThreads, kChunkRows>(p, at, kv_head, split, pid, row0,
                                                       [&](int t, int r) -> float& { return o[t][r]; }, st);
}

// Whether the kernel takes these shapes (the glue checks the rest: dtypes, layouts,
// alignment, the split counters).
inline bool chunk_attention_supported(int head_dim, int group, int num_splits) {
  return (head_dim == 64 || head_dim == 128) && group >= 1 && group <= kChunkMaxGroup && num_splits >= 1 &&
         num_splits <= kChunkMaxSplits;
}

template <typename T, int HEAD_DIM>
void launch_chunk_attention_for(const ChunkAttentionParams& p, cudaStream_t stream) {
  void (*kernel)(const ChunkAttentionParams) = chunk_attention_kernel<T, HEAD_DIM>;
  constexpr int smem = chunk_smem_bytes<HEAD_DIM>();
  allow_dynamic_smem<chunk_attention_kernel<T, HEAD_DIM>>(smem);
  const int group = p.num_heads / p.num_kv_heads;
  const dim3 grid(chunk_grid_x(p.num_tokens, p.num_seqs, group), p.num_kv_heads, p.num_splits);
  AG_LAUNCH_KERNEL(kernel, grid, dim3(kChunkThreads), smem, stream, p);
}

// Returns false when no kernel takes the shapes.
template <typename T>
bool launch_chunk_attention(const ChunkAttentionParams& p, int head_dim, cudaStream_t stream) {
  const int group = p.num_kv_heads > 0 ? p.num_heads / p.num_kv_heads : 0;
  if (!chunk_attention_supported(head_dim, group, p.num_splits)) return false;
  if (p.num_tokens == 0 || p.num_seqs == 0) return true;
  if (head_dim == 64) {
    launch_chunk_attention_for<T, 64>(p, stream);
  } else {
    launch_chunk_attention_for<T, 128>(p, stream);
  }
  return true;
}

}  // namespace asyncgen
