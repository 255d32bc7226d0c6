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

__host__ __device__ inline int chunk_tokens_per_block(int group) { return kChunkRows / group; }

// Blocks along x for a call: enough for every sequence's query tiles.
__host__ __device__ inline int chunk_grid_x(int num_tokens, int num_seqs, int group) {
  return num_tokens / chunk_tokens_per_block(group) + num_seqs;
}

template <int HEAD_DIM>
constexpr int chunk_smem_bytes() {
  return (kChunkRows + 4 * kChunkKeys) * (HEAD_DIM + kChunkPad) * 2;
}

// One warp's running softmax state for its m16 tile of query rows: o[t][r] holds row g
// (r < 2) or g + 8 of the tile, dims 8t + 2c + r % 2 (lane = 4g + c); m is each row's
// running max (base 2, scaled), l this lane's share of the row's sum of exponentials.
template <int HEAD_DIM>
struct ChunkRowState {
  static constexpr int kDimTiles = HEAD_DIM / 8;
  float o[kDimTiles][4];
  float m_lo, m_hi, l_lo, l_hi;

  AG_DEVICE void clear() {
#pragma unroll
    for (int t = 0; t < kDimTiles; ++t)
#pragma unroll
      for (int r = 0; r < 4; ++r) o[t][r] = 0.f;
    m_lo = m_hi = -INFINITY;
    l_lo = l_hi = 0.f;
  }

  // The row sums over the four lanes of each row (call once, after the last tile).
  AG_DEVICE void reduce_sums() {
    l_lo += __shfl_xor_sync(kFullMask, l_lo, 1);
    l_lo += __shfl_xor_sync(kFullMask, l_lo, 2);
    l_hi += __shfl_xor_sync(kFullMask, l_hi, 1);
    l_hi += __shfl_xor_sync(kFullMask, l_hi, 2);
  }
};

// One warp's step of online softmax attention over a 32-key tile in shared memory:
// q_s is its 16 query rows, ks / vs the tile's K and V rows ([kChunkKeys][HEAD_DIM + pad]),
// key0 the position of the tile's first key. With `masked`, key positions past the row's
// own (pos_lo for row g, pos_hi for row g + 8) are left out. Call from all 32 lanes.
template <typename T, int HEAD_DIM>
AG_DEVICE void chunk_attend_tile(const T* q_s, const T* ks, const T* vs, int key0, bool masked, int pos_lo,
                                 int pos_hi, float scale_log2, ChunkRowState<HEAD_DIM>& acc) {
  constexpr int kRow = HEAD_DIM + kChunkPad;   // shared-memory row, elements
  constexpr int kKSteps = HEAD_DIM / 16;       // k steps of S = Q K^T
  constexpr int kDimTiles = HEAD_DIM / 8;      // n tiles of O
  constexpr int kKeyTiles = kChunkKeys / 8;    // n tiles of S
  const int lane = threadIdx.x % kWarpSize;
  const int c = lane % 4;
  const int mi = lane / 8, ri = lane % 8;      // the matrix and row this lane addresses for ldmatrix
  float s[kKeyTiles][4];
#pragma unroll
  for (int t = 0; t < kKeyTiles; ++t)
#pragma unroll
    for (int r = 0; r < 4; ++r) s[t][r] = 0.f;
#pragma unroll
  for (int kk = 0; kk < kKSteps; ++kk) {
    // Q's fragment comes from shared memory each tile: registers kept for occupancy.
    uint32_t qa[4];
    ldmatrix_x4<false>(qa, q_s + ((mi % 2) * 8 + ri) * kRow + 16 * kk + (mi / 2) * 8);
#pragma unroll
    for (int nt = 0; nt < kKeyTiles; nt += 2) {  // independent accumulators a k step
      uint32_t b[4];
      ldmatrix_x4<false>(b, ks + ((nt + mi / 2) * 8 + ri) * kRow + 16 * kk + (mi % 2) * 8);
      const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
      mma_m16n8k16<T>(s[nt], qa, b0);
      mma_m16n8k16<T>(s[nt + 1], qa, b1);
    }
  }
  // s[nt][r]: row g (r < 2) or g + 8, key key0 + 8 nt + 2c + r % 2.
  float top_lo = -INFINITY, top_hi = -INFINITY;
#pragma unroll
  for (int nt = 0; nt < kKeyTiles; ++nt)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      float v = s[nt][r] * scale_log2;
      if (masked && key0 + 8 * nt + 2 * c + r % 2 > (r < 2 ? pos_lo : pos_hi)) v = -INFINITY;
      s[nt][r] = v;
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
  const float new_lo = fmaxf(acc.m_lo, top_lo), new_hi = fmaxf(acc.m_hi, top_hi);
  // A row with nothing allowed yet keeps m = -inf: subtract 0 instead (no inf - inf).
  const float base_lo = new_lo == -INFINITY ? 0.f : new_lo;
  const float base_hi = new_hi == -INFINITY ? 0.f : new_hi;
  const float alpha_lo = exp2f(acc.m_lo - base_lo), alpha_hi = exp2f(acc.m_hi - base_hi);
  acc.m_lo = new_lo;
  acc.m_hi = new_hi;
  float sum_lo = 0.f, sum_hi = 0.f;
#pragma unroll
  for (int nt = 0; nt < kKeyTiles; ++nt)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const float e = exp2f(s[nt][r] - (r < 2 ? base_lo : base_hi));
      s[nt][r] = e;
      if (r < 2) {
        sum_lo += e;
      } else {
        sum_hi += e;
      }
    }
  acc.l_lo = acc.l_lo * alpha_lo + sum_lo;  // this lane's share of the row sum
  acc.l_hi = acc.l_hi * alpha_hi + sum_hi;
#pragma unroll
  for (int t = 0; t < kDimTiles; ++t) {
    acc.o[t][0] *= alpha_lo;
    acc.o[t][1] *= alpha_lo;
    acc.o[t][2] *= alpha_hi;
    acc.o[t][3] *= alpha_hi;
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
      mma_m16n8k16<T>(acc.o[dt], pa, b0);
      mma_m16n8k16<T>(acc.o[dt + 1], pa, b1);
    }
  }
}

// The last block of a split combines the splits' partials of its rows: out = sum_z w_z o_z
// / sum_z w_z l_z with w_z = exp2(m_z - max m), over `count` splits (of p.num_splits in
// the partials' layout; other blocks' writes, read past L1). Row r is (token token0 + r /
// group, head head0 + r % group); THREADS / ROWS threads share a row, each a contiguous
// part of head_dim, with every split's loads of a step issued together.
template <typename T, int HEAD_DIM, int THREADS, int ROWS>
AG_DEVICE void chunk_combine_splits(const ChunkAttentionParams& p, int64_t token0, int head0, int group, int rows,
                                    int count) {
  constexpr int kPerRow = THREADS / ROWS;
  constexpr int kPart = HEAD_DIM / kPerRow;
  static_assert(THREADS % ROWS == 0 && kPart % 4 == 0, "whole float4 steps a thread");
  const int r = threadIdx.x / kPerRow, part = threadIdx.x % kPerRow;
  if (r >= rows) return;
  const int64_t token = token0 + r / group;
  const int head = head0 + r % group;
  const int64_t part0 = (token * p.num_heads + head) * p.num_splits;
  float w[kChunkMaxSplits], l_z[kChunkMaxSplits];
  float m = -INFINITY;
#pragma unroll
  for (int z = 0; z < kChunkMaxSplits; ++z) {
    if (z < count) {
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
    if (z < count) {
      w[z] = exp2f(w[z] - m_ref);
      total += w[z] * l_z[z];
    }
  }
  const float inv = total > 0.f ? 1.f / total : 0.f;
  const float* src = p.part_out + part0 * HEAD_DIM + part * kPart;
  T* dst = static_cast<T*>(p.out) + token * p.out_stride_token + head * p.out_stride_head + part * kPart;
#pragma unroll 4
  for (int d = 0; d < kPart; d += 4) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int z = 0; z < kChunkMaxSplits; ++z) {
      if (z < count) {
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

// This block's sequence for block column pid, numbered as chunk_grid_x counts them: the
// last sequence whose first block is at or before pid. Contains __syncthreads().
template <int NUM_WARPS>
AG_DEVICE int chunk_block_sequence(const ChunkAttentionParams& p, int tq, int pid, float* scratch) {
  float before = 0.f;
  for (int s = threadIdx.x; s < p.num_seqs; s += NUM_WARPS * kWarpSize) {
    before += p.query_start_loc[s] / tq + s <= pid ? 1.f : 0.f;
  }
  return static_cast<int>(block_sum<NUM_WARPS>(before, scratch)) - 1;
}

template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(kChunkThreads, kChunkMinBlocks) chunk_attention_kernel(const ChunkAttentionParams p) {
  constexpr int kRow = HEAD_DIM + kChunkPad;   // shared-memory row, elements
  constexpr int kPieces = HEAD_DIM / 8;        // 16-byte pieces of a row
  constexpr int kDimTiles = HEAD_DIM / 8;      // n tiles of O
  AG_DYNAMIC_SMEM(smem);
  T* q_s = reinterpret_cast<T*>(smem);         // [kChunkRows][kRow]
  T* k_s = q_s + kChunkRows * kRow;            // [2][kChunkKeys][kRow]
  T* v_s = k_s + 2 * kChunkKeys * kRow;        // [2][kChunkKeys][kRow]
  __shared__ float scratch[kChunkWarps];

  const int group = p.num_heads / p.num_kv_heads;
  const int tq = chunk_tokens_per_block(group);
  const int pid = blockIdx.x, kv_head = blockIdx.y, split = blockIdx.z;

  const int seq = chunk_block_sequence<kChunkWarps>(p, tq, pid, scratch);
  const int q_start = p.query_start_loc[seq];
  const int q_len = p.query_start_loc[seq + 1] - q_start;
  const int q_tile = pid - (q_start / tq + seq);
  if (q_tile * tq >= q_len) return;  // uniform over the block
  const int context = p.seq_lens[seq] - q_len;
  const int tile_tokens = imin(tq, q_len - q_tile * tq);
  const int rows = tile_tokens * group;           // valid rows of this block
  const int first_pos = context + q_tile * tq;    // position of the block's first token
  const int kv_end = first_pos + tile_tokens;     // keys [0, kv_end) are read
  const int key_tiles = ceil_div(kv_end, kChunkKeys);
  const int per_split = ceil_div(key_tiles, p.num_splits);
  const int tile_lo = imin(split * per_split, key_tiles);
  const int tile_hi = imin(tile_lo + per_split, key_tiles);

  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int g = lane / 4, c = lane % 4;
  const int row0 = 16 * warp;
  const bool warp_active = row0 < rows;
  const int pos_lo = first_pos + (row0 + g) / group;      // position of row g of the warp's tile
  const int pos_hi = first_pos + (row0 + g + 8) / group;  // and of row g + 8
  const int warp_first_pos = first_pos + row0 / group;
  const int warp_last_pos = first_pos + imin(row0 + 15, rows - 1) / group;

  const T* q = static_cast<const T*>(p.q);
  const T* k_cache = static_cast<const T*>(p.k_cache) + static_cast<int64_t>(kv_head) * HEAD_DIM;
  const T* v_cache = static_cast<const T*>(p.v_cache) + static_cast<int64_t>(kv_head) * HEAD_DIM;
  const int64_t token_stride = static_cast<int64_t>(p.num_kv_heads) * HEAD_DIM;
  const int* table = p.block_tables + static_cast<int64_t>(seq) * p.block_table_stride;

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
    slot_off[u] = ((j0 + u * kRowStep) & ((1 << p.block_shift) - 1)) * static_cast<int>(token_stride) + piece * 8;
  }
  auto fetch_ids = [&](int tile) {
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int pos = tile * kChunkKeys + j0 + u * kRowStep;
      ids[u] = pos < kv_end ? table[pos >> p.block_shift] : 0;
    }
  };
  auto load_keys = [&](int tile, int stage) {
    T* k_dst = k_s + (stage * kChunkKeys + j0) * kRow + piece * 8;
    T* v_dst = v_s + (stage * kChunkKeys + j0) * kRow + piece * 8;
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const bool ok = tile * kChunkKeys + j0 + u * kRowStep < kv_end;
      const int64_t block = ok ? ids[u] : 0;
      cp_async16(k_dst + u * kRowStep * kRow, k_cache + block * p.k_stride_block + slot_off[u], ok);
      cp_async16(v_dst + u * kRowStep * kRow, v_cache + block * p.v_stride_block + slot_off[u], ok);
    }
  };

  ChunkRowState<HEAD_DIM> acc;
  acc.clear();

  if (tile_lo < tile_hi) {
    for (int i = threadIdx.x; i < kChunkRows * kPieces; i += kChunkThreads) {
      const int r = i / kPieces, piece = i % kPieces;
      const bool ok = r < rows;
      const int64_t token = q_start + q_tile * tq + (ok ? r / group : 0);
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
        // Keys past the warp's first row position need the causal mask.
        const bool masked = (tile + 1) * kChunkKeys - 1 > warp_first_pos;
        chunk_attend_tile<T, HEAD_DIM>(q_s + row0 * kRow, k_s + stage * kChunkKeys * kRow, v_s + stage * kChunkKeys * kRow,
                                       tile * kChunkKeys, masked, pos_lo, pos_hi, p.scale_log2, acc);
      }
      __syncthreads();  // every warp is done with this stage before it is refilled
    }
  }
  acc.reduce_sums();
  float (&o)[kDimTiles][4] = acc.o;
  const float m_lo = acc.m_lo, m_hi = acc.m_hi, l_lo = acc.l_lo, l_hi = acc.l_hi;

  // o[t][r]: row g (r < 2) or g + 8 of the warp, dims 8t + 2c, 8t + 2c + 1.
  auto row_token_head = [&](int r, int64_t& token, int& head) {
    token = q_start + q_tile * tq + r / group;
    head = kv_head * group + r % group;
  };
  T* out = static_cast<T*>(p.out);
  const int splits = p.num_splits;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = row0 + g + 8 * half;
    if (r >= rows) continue;
    int64_t token;
    int head;
    row_token_head(r, token, head);
    const float l = half == 0 ? l_lo : l_hi;
    if (splits == 1) {
      const float inv = l > 0.f ? 1.f / l : 0.f;
      T* dst = out + token * p.out_stride_token + head * p.out_stride_head + 2 * c;
#pragma unroll
      for (int t = 0; t < kDimTiles; ++t) {
        *reinterpret_cast<uint32_t*>(dst + 8 * t) = pack2<T>(o[t][2 * half] * inv, o[t][2 * half + 1] * inv);
      }
    } else {
      const int64_t part = (token * p.num_heads + head) * splits + split;
      float* dst = p.part_out + part * HEAD_DIM + 2 * c;
#pragma unroll
      for (int t = 0; t < kDimTiles; ++t) {
        *reinterpret_cast<float2*>(dst + 8 * t) = make_float2(o[t][2 * half], o[t][2 * half + 1]);
      }
      if (c == 0) *reinterpret_cast<float2*>(p.part_ml + 2 * part) = make_float2(half == 0 ? m_lo : m_hi, l);
    }
  }
  if (splits == 1) return;
  if (!takes_last_ticket(p.split_counters + static_cast<int64_t>(kv_head) * gridDim.x + pid, splits)) return;
  const int64_t token0 = q_start + q_tile * tq;
  chunk_combine_splits<T, HEAD_DIM, kChunkThreads, kChunkRows>(p, token0, kv_head * group, group, rows, splits);
}

// ---------------------------------------------------------------------------------------
// Short chunks over long contexts (a prefix-cache hit: tens of new tokens after a
// thousand cached). The kernel above gives such a chunk few blocks (78 rows of a head:
// two), each walking every key tile with one tile in flight, so it waits on memory
// latency tile after tile. This one keeps the 64-row blocks (so a head's K/V is read from
// L2 once per 64 rows, as there) but splits the keys three ways:
//
//   - inside a block, kShortKeyGroups groups of 4 warps take alternate key tiles, each
//     group with its own two-stage cp.async ring and its own named barrier (no barrier
//     across groups per tile); warp w of every group owns rows 16 (w % 4) .. + 15;
//   - at the end the groups' (m, l, O) meet in shared memory and group 0 merges them;
//   - across blocks (grid z), each block column's key tiles are divided over up to
//     num_splits blocks, as many as give each at least kShortMinSplitTiles tiles (so a
//     short context, like a graph's padding sequence, takes one block and writes its
//     output directly); the block that draws the last ticket combines the partials.
//
// Napkin math, 78 new tokens over 992 cached, 7B (32 heads): 64 + 14 rows a head, 34 key
// tiles; with 4 splits 256 blocks of 8 warps (two blocks an SM: 16 warps, 64 KB of K/V in
// flight an SM), each group walking 4-5 tiles. L2 -> SM traffic 2 x 17.5 MB (the 14-row
// block reads the head's K/V again), the split partials 4 x 78 x 32 x 512 B = 5 MB each way.
// Empty graph slots exit after the sequence lookup; rows past a chunk are neither loaded
// nor (for whole warps) computed.

constexpr int kShortKeyGroups = 2;
constexpr int kShortWarps = kChunkWarps * kShortKeyGroups;
constexpr int kShortThreads = kShortWarps * kWarpSize;
constexpr int kShortGroupThreads = kChunkThreads;  // one group: 4 warps, 64 rows
constexpr int kShortStages = 2;                    // ring depth a group
constexpr int kShortMinBlocks = 2;                 // blocks an SM (registers <= 128, 85 KB of shared memory)
constexpr int kShortMinSplitTiles = 4;             // key tiles a block takes at least before the keys are split

template <int HEAD_DIM>
constexpr int short_chunk_smem_bytes() {
  return (kChunkRows + kShortKeyGroups * kShortStages * 2 * kChunkKeys) * (HEAD_DIM + kChunkPad) * 2;
}

// The number of blocks a block column of `key_tiles` tiles splits over (at most
// max_splits, each with at least kShortMinSplitTiles tiles, none empty) and the tiles each
// takes; every block of the column computes the same from the same lengths.
__host__ __device__ inline void short_chunk_splits(int key_tiles, int max_splits, int& splits, int& per_split) {
  splits = ceil_div(key_tiles, kShortMinSplitTiles);
  splits = splits < 1 ? 1 : splits > max_splits ? max_splits : splits;
  per_split = ceil_div(key_tiles, splits);
  splits = ceil_div(key_tiles, per_split);
}

template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(kShortThreads, kShortMinBlocks) short_chunk_attention_kernel(const ChunkAttentionParams p) {
  constexpr int kRow = HEAD_DIM + kChunkPad;
  constexpr int kPieces = HEAD_DIM / 8;
  constexpr int kDimTiles = HEAD_DIM / 8;
  constexpr int kStage = 2 * kChunkKeys * kRow;  // one stage of a group's ring: K rows, then V rows
  AG_DYNAMIC_SMEM(smem);
  T* q_s = reinterpret_cast<T*>(smem);           // [kChunkRows][kRow]
  T* ring = q_s + kChunkRows * kRow;             // [kShortKeyGroups][kShortStages][2][kChunkKeys][kRow]
  __shared__ float scratch[kShortWarps];

  const int group = p.num_heads / p.num_kv_heads;
  const int tq = chunk_tokens_per_block(group);
  const int pid = blockIdx.x, kv_head = blockIdx.y, split = blockIdx.z;
  const int seq = chunk_block_sequence<kShortWarps>(p, tq, pid, scratch);
  const int q_start = p.query_start_loc[seq];
  const int q_len = p.query_start_loc[seq + 1] - q_start;
  const int q_tile = pid - (q_start / tq + seq);
  if (q_tile * tq >= q_len) return;  // uniform over the block: an empty slot or a surplus block
  const int context = p.seq_lens[seq] - q_len;
  const int tile_tokens = imin(tq, q_len - q_tile * tq);
  const int rows = tile_tokens * group;
  const int first_pos = context + q_tile * tq;
  const int kv_end = first_pos + tile_tokens;
  const int key_tiles = ceil_div(kv_end, kChunkKeys);
  int splits, per_split;
  short_chunk_splits(key_tiles, p.num_splits, splits, per_split);
  if (split >= splits) return;  // uniform: this column needs fewer splits
  const int tile_lo = split * per_split;
  const int tile_hi = imin(tile_lo + per_split, key_tiles);

  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int key_group = warp / kChunkWarps;
  const int gtid = threadIdx.x % kShortGroupThreads;  // thread within the key group
  const int g = lane / 4, c = lane % 4;
  const int row0 = 16 * (warp % kChunkWarps);
  const bool warp_active = row0 < rows;
  const int pos_lo = first_pos + (row0 + g) / group;
  const int pos_hi = first_pos + (row0 + g + 8) / group;
  const int warp_first_pos = first_pos + row0 / group;
  const int warp_last_pos = first_pos + imin(row0 + 15, rows - 1) / group;
  // The group's tiles: tile_lo + key_group, then every kShortKeyGroups-th.
  const int num_mine = imax(0, ceil_div(tile_hi - tile_lo - key_group, kShortKeyGroups));
  auto tile_of = [&](int i) { return tile_lo + key_group + kShortKeyGroups * i; };

  const T* q = static_cast<const T*>(p.q);
  const T* k_cache = static_cast<const T*>(p.k_cache) + static_cast<int64_t>(kv_head) * HEAD_DIM;
  const T* v_cache = static_cast<const T*>(p.v_cache) + static_cast<int64_t>(kv_head) * HEAD_DIM;
  const int64_t token_stride = static_cast<int64_t>(p.num_kv_heads) * HEAD_DIM;
  const int* table = p.block_tables + static_cast<int64_t>(seq) * p.block_table_stride;

  // The group's 128 threads copy a tile as the kernel above does (block ids a tile ahead).
  constexpr int kLoads = kChunkKeys * kPieces / kShortGroupThreads;
  constexpr int kRowStep = kShortGroupThreads / kPieces;
  static_assert(kShortGroupThreads % kPieces == 0 && kLoads >= 1, "a thread's pieces share one column");
  const int piece = gtid % kPieces, j0 = gtid / kPieces;
  int ids[kLoads], slot_off[kLoads];
#pragma unroll
  for (int u = 0; u < kLoads; ++u) {
    slot_off[u] = ((j0 + u * kRowStep) & ((1 << p.block_shift) - 1)) * static_cast<int>(token_stride) + piece * 8;
  }
  auto fetch_ids = [&](int tile) {
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int pos = tile * kChunkKeys + j0 + u * kRowStep;
      ids[u] = pos < kv_end ? table[pos >> p.block_shift] : 0;
    }
  };
  T* my_ring = ring + key_group * kShortStages * kStage;
  auto load_keys = [&](int tile, int stage) {
    T* k_dst = my_ring + stage * kStage + j0 * kRow + piece * 8;
    T* v_dst = k_dst + kChunkKeys * kRow;
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const bool ok = tile * kChunkKeys + j0 + u * kRowStep < kv_end;
      const int64_t block = ok ? ids[u] : 0;
      cp_async16(k_dst + u * kRowStep * kRow, k_cache + block * p.k_stride_block + slot_off[u], ok);
      cp_async16(v_dst + u * kRowStep * kRow, v_cache + block * p.v_stride_block + slot_off[u], ok);
    }
  };

  // Prologue: Q (all threads) with each group's first tiles; commit group j holds tile j.
  for (int i = threadIdx.x; i < kChunkRows * kPieces; i += kShortThreads) {
    const int r = i / kPieces, pc = i % kPieces;
    const bool ok = r < rows;
    const int64_t token = q_start + q_tile * tq + (ok ? r / group : 0);
    const int head = kv_head * group + (ok ? r % group : 0);
    cp_async16(q_s + r * kRow + pc * 8, q + token * p.q_stride_token + head * p.q_stride_head + pc * 8, ok);
  }
#pragma unroll
  for (int i = 0; i < kShortStages - 1; ++i) {
    if (i < num_mine) {
      fetch_ids(tile_of(i));
      load_keys(tile_of(i), i);
    }
    cp_async_commit();
  }
  if (kShortStages - 1 < num_mine) fetch_ids(tile_of(kShortStages - 1));
  cp_async_wait<kShortStages - 2>();
  __syncthreads();  // Q and every group's first tile are visible to the block

  ChunkRowState<HEAD_DIM> acc;
  acc.clear();
  for (int i = 0; i < num_mine; ++i) {
    if (i > 0) {
      cp_async_wait<kShortStages - 2>();       // tile i has landed (this thread's copies)
      // ... and everyone's in the group; tile i - 1 is done with. Immediate ids (1, 2, ..)
      // keep the kernel's barrier count at what it uses.
      static_assert(kShortKeyGroups == 2, "one barrier id a key group");
      if (key_group == 0) {
        AG_NAMED_BARRIER(1, kShortGroupThreads);
      } else {
        AG_NAMED_BARRIER(2, kShortGroupThreads);
      }
    }
    // Refill the stage tile i - 1 used; an empty commit keeps the group count per tile.
    if (i + kShortStages - 1 < num_mine) {
      load_keys(tile_of(i + kShortStages - 1), (i + kShortStages - 1) % kShortStages);
      if (i + kShortStages < num_mine) fetch_ids(tile_of(i + kShortStages));
    }
    cp_async_commit();
    const int tile = tile_of(i);
    if (warp_active && tile * kChunkKeys <= warp_last_pos) {
      const T* ks = my_ring + (i % kShortStages) * kStage;
      const bool masked = (tile + 1) * kChunkKeys - 1 > warp_first_pos;
      chunk_attend_tile<T, HEAD_DIM>(q_s + row0 * kRow, ks, ks + kChunkKeys * kRow, tile * kChunkKeys, masked, pos_lo,
                                     pos_hi, p.scale_log2, acc);
    }
  }
  cp_async_wait<0>();

  // Merge the key groups in shared memory (over the rings): groups 1.. store their state
  // thread by thread ([value][group thread], conflict-free), group 0 folds them in.
  constexpr int kValues = kDimTiles * 4 + 4;
  static_assert((kShortKeyGroups - 1) * kValues * kShortGroupThreads * 4 <= kShortKeyGroups * kShortStages * kStage * 2,
                "the merge fits in the rings");
  float* merge = reinterpret_cast<float*>(ring);
  __syncthreads();  // every group is done with its ring
  if (key_group > 0) {
    float* dst = merge + (key_group - 1) * kValues * kShortGroupThreads + gtid;
#pragma unroll
    for (int t = 0; t < kDimTiles; ++t)
#pragma unroll
      for (int r = 0; r < 4; ++r) dst[(4 * t + r) * kShortGroupThreads] = acc.o[t][r];
    dst[(kValues - 4) * kShortGroupThreads] = acc.m_lo;
    dst[(kValues - 3) * kShortGroupThreads] = acc.m_hi;
    dst[(kValues - 2) * kShortGroupThreads] = acc.l_lo;
    dst[(kValues - 1) * kShortGroupThreads] = acc.l_hi;
  }
  __syncthreads();
  T* out = static_cast<T*>(p.out);
  if (key_group == 0) {
#pragma unroll
    for (int k = 1; k < kShortKeyGroups; ++k) {
      const float* src = merge + (k - 1) * kValues * kShortGroupThreads + gtid;
      const float m_lo = src[(kValues - 4) * kShortGroupThreads], m_hi = src[(kValues - 3) * kShortGroupThreads];
      const float new_lo = fmaxf(acc.m_lo, m_lo), new_hi = fmaxf(acc.m_hi, m_hi);
      const float base_lo = new_lo == -INFINITY ? 0.f : new_lo;
      const float base_hi = new_hi == -INFINITY ? 0.f : new_hi;
      const float a_lo = exp2f(acc.m_lo - base_lo), b_lo = exp2f(m_lo - base_lo);
      const float a_hi = exp2f(acc.m_hi - base_hi), b_hi = exp2f(m_hi - base_hi);
#pragma unroll
      for (int t = 0; t < kDimTiles; ++t) {
        acc.o[t][0] = a_lo * acc.o[t][0] + b_lo * src[(4 * t + 0) * kShortGroupThreads];
        acc.o[t][1] = a_lo * acc.o[t][1] + b_lo * src[(4 * t + 1) * kShortGroupThreads];
        acc.o[t][2] = a_hi * acc.o[t][2] + b_hi * src[(4 * t + 2) * kShortGroupThreads];
        acc.o[t][3] = a_hi * acc.o[t][3] + b_hi * src[(4 * t + 3) * kShortGroupThreads];
      }
      acc.l_lo = a_lo * acc.l_lo + b_lo * src[(kValues - 2) * kShortGroupThreads];
      acc.l_hi = a_hi * acc.l_hi + b_hi * src[(kValues - 1) * kShortGroupThreads];
      acc.m_lo = new_lo;
      acc.m_hi = new_hi;
    }
    acc.reduce_sums();
    // The output, or this split's unnormalised partial and (max, sum) per row.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = row0 + g + 8 * half;
      if (r >= rows) continue;
      const int64_t token = q_start + q_tile * tq + r / group;
      const int head = kv_head * group + r % group;
      const float l = half == 0 ? acc.l_lo : acc.l_hi;
      if (splits == 1) {
        const float inv = l > 0.f ? 1.f / l : 0.f;
        T* dst = out + token * p.out_stride_token + head * p.out_stride_head + 2 * c;
#pragma unroll
        for (int t = 0; t < kDimTiles; ++t) {
          *reinterpret_cast<uint32_t*>(dst + 8 * t) =
              pack2<T>(acc.o[t][2 * half] * inv, acc.o[t][2 * half + 1] * inv);
        }
      } else {
        const int64_t part = (token * p.num_heads + head) * p.num_splits + split;
        float* dst = p.part_out + part * HEAD_DIM + 2 * c;
#pragma unroll
        for (int t = 0; t < kDimTiles; ++t) {
          *reinterpret_cast<float2*>(dst + 8 * t) = make_float2(acc.o[t][2 * half], acc.o[t][2 * half + 1]);
        }
        if (c == 0) {
          *reinterpret_cast<float2*>(p.part_ml + 2 * part) = make_float2(half == 0 ? acc.m_lo : acc.m_hi, l);
        }
      }
    }
  }
  if (splits == 1) return;
  if (!takes_last_ticket(p.split_counters + static_cast<int64_t>(kv_head) * gridDim.x + pid, splits)) return;
  chunk_combine_splits<T, HEAD_DIM, kShortThreads, kChunkRows>(p, q_start + q_tile * tq, kv_head * group, group, rows,
                                                               splits);
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
#if defined(__CUDACC__)
  static bool configured[64] = {};  // per device: more than 48 KiB of dynamic shared memory
  int device = 0;
  cudaGetDevice(&device);
  if (device < 0 || device >= 64 || !configured[device]) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (device >= 0 && device < 64) configured[device] = true;
  }
#endif
  const int group = p.num_heads / p.num_kv_heads;
  const dim3 grid(chunk_grid_x(p.num_tokens, p.num_seqs, group), p.num_kv_heads, p.num_splits);
  AG_LAUNCH_KERNEL(kernel, grid, dim3(kChunkThreads), smem, stream, p);
}

template <typename T, int HEAD_DIM>
void launch_short_chunk_attention_for(const ChunkAttentionParams& p, cudaStream_t stream) {
  void (*kernel)(const ChunkAttentionParams) = short_chunk_attention_kernel<T, HEAD_DIM>;
  constexpr int smem = short_chunk_smem_bytes<HEAD_DIM>();
#if defined(__CUDACC__)
  static bool configured[64] = {};
  int device = 0;
  cudaGetDevice(&device);
  if (device < 0 || device >= 64 || !configured[device]) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (device >= 0 && device < 64) configured[device] = true;
  }
#endif
  const int group = p.num_heads / p.num_kv_heads;
  const dim3 grid(chunk_grid_x(p.num_tokens, p.num_seqs, group), p.num_kv_heads, p.num_splits);
  AG_LAUNCH_KERNEL(kernel, grid, dim3(kShortThreads), smem, stream, p);
}

// Returns false when no kernel takes the shapes. `short_chunks` picks the kernel whose
// blocks also split the keys (short_chunk_attention_kernel); num_splits is then the most
// blocks a block column's keys are split over.
template <typename T>
bool launch_chunk_attention(const ChunkAttentionParams& p, int head_dim, cudaStream_t stream, bool short_chunks = false) {
  const int group = p.num_kv_heads > 0 ? p.num_heads / p.num_kv_heads : 0;
  if (!chunk_attention_supported(head_dim, group, p.num_splits)) return false;
  if (p.num_tokens == 0 || p.num_seqs == 0) return true;
  if (short_chunks) {
    if (head_dim == 64) {
      launch_short_chunk_attention_for<T, 64>(p, stream);
    } else {
      launch_short_chunk_attention_for<T, 128>(p, stream);
    }
  } else if (head_dim == 64) {
    launch_chunk_attention_for<T, 64>(p, stream);
  } else {
    launch_chunk_attention_for<T, 128>(p, stream);
  }
  return true;
}

}  // namespace asyncgen
