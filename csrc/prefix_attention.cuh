// Paged attention for a few short prompt chunks over long cached prefixes (a prefix-cache
// hit: tens of new tokens after a thousand cached ones), on tensor cores.
//
// Semantics, layouts and parameters are those of the prompt-chunk kernel
// (chunk_attention.cuh, ChunkAttentionParams); the work is cut differently. There a block
// holds 64 query rows and keeps two 32-key tiles in flight, which at a prefix hit leaves
// each SM waiting on one tile's latency after another (61 us on an H200 for 78 tokens over
// 992, against a 4 us read of the K/V). Here:
//
//   block: 8 warps, up to 128 query rows (tokens x the kv head's GQA group, token-major) of
//   one kv head, so a chunk of up to 128 / group tokens reads each K/V byte once;
//   grid z: the keys split into contiguous ranges of 64-key tiles, one range a block, so
//   that a single chunk still puts a block on most SMs (32 kv heads x 4 splits);
//   a ring of kPrefixStages tiles in shared memory (204 KB at head_dim 128, one block an
//   SM): a block's first kPrefixStages - 1 tiles are requested at once, which at a prefix
//   hit is its whole key range, and each tile's slot is refilled one tile later;
//   warp w: rows 16w .. 16w + 15 for the whole head_dim, Q's fragments held in registers
//   (loaded once from global memory); warps without rows only copy.
//
//   S = Q K^T: B = K rows via ldmatrix; P = exp2(S * scale - m) from S's accumulators into
//   A; O += P V: B = V via ldmatrix.trans. Softmax online, fp32, base 2.
//
// The splits' partials are combined by the block that finishes last (a ticket per block
// column in `split_counters`), as in the prompt-chunk kernel.
//
// Napkin math, 72 new tokens over 992 cached, Llama-2-7B layer (32 heads, head_dim 128):
// 128 blocks, each reading about 136 KB of K/V (17.5 MB in all: 4 us at 4.4 TB/s) and
// running 5 warps x 5 tiles x 128 mma.sync.
#pragma once

#include "chunk_attention.cuh"
#include "common.cuh"

namespace asyncgen {

constexpr int kPrefixWarps = 8;
constexpr int kPrefixThreads = kPrefixWarps * kWarpSize;
constexpr int kPrefixRows = 16 * kPrefixWarps;  // query rows per block
constexpr int kPrefixKeys = 64;                 // key positions per tile
constexpr int kPrefixStages = 6;                // tiles in the ring
constexpr int kPrefixPad = 8;                   // elements of padding per shared-memory row
static_assert(kPrefixThreads == 2 * kPrefixRows, "the split combine takes two threads a row");

__host__ __device__ inline int prefix_tokens_per_block(int group) { return kPrefixRows / group; }

__host__ __device__ inline int prefix_grid_x(int num_tokens, int num_seqs, int group) {
  return num_tokens / prefix_tokens_per_block(group) + num_seqs;
}

template <int HEAD_DIM>
constexpr int prefix_smem_bytes() {
  return kPrefixStages * 2 * kPrefixKeys * (HEAD_DIM + kPrefixPad) * 2;
}

template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(kPrefixThreads, 1) prefix_attention_kernel(const ChunkAttentionParams p) {
  constexpr int kRow = HEAD_DIM + kPrefixPad;  // shared-memory row, elements
  constexpr int kPieces = HEAD_DIM / 8;        // 16-byte pieces of a row
  constexpr int kKSteps = HEAD_DIM / 16;       // k steps of S = Q K^T
  constexpr int kDimTiles = HEAD_DIM / 8;      // n tiles of O
  constexpr int kKeyTiles = kPrefixKeys / 8;   // n tiles of S
  constexpr int kStage = kPrefixKeys * kRow;   // elements of one stage's K (or V)
  AG_DYNAMIC_SMEM(smem);
  T* k_s = reinterpret_cast<T*>(smem);         // [kPrefixStages][kPrefixKeys][kRow]
  T* v_s = k_s + kPrefixStages * kStage;       // [kPrefixStages][kPrefixKeys][kRow]
  __shared__ float scratch[kPrefixWarps];

  const int group = p.num_heads / p.num_kv_heads;
  const int tq = prefix_tokens_per_block(group);
  const int pid = blockIdx.x, kv_head = blockIdx.y, split = blockIdx.z;

  // This block's sequence: the last one whose first block is at or before pid.
  float before = 0.f;
  for (int s = threadIdx.x; s < p.num_seqs; s += kPrefixThreads) {
    before += p.query_start_loc[s] / tq + s <= pid ? 1.f : 0.f;
  }
  const int seq = static_cast<int>(block_sum<kPrefixWarps>(before, scratch)) - 1;
  const int q_start = p.query_start_loc[seq];
  const int q_len = p.query_start_loc[seq + 1] - q_start;
  const int q_tile = pid - (q_start / tq + seq);
  if (q_tile * tq >= q_len) return;  // uniform over the block
  const int context = p.seq_lens[seq] - q_len;
  const int tile_tokens = imin(tq, q_len - q_tile * tq);
  const int rows = tile_tokens * group;           // valid rows of this block
  const int first_pos = context + q_tile * tq;    // position of the block's first token
  const int kv_end = first_pos + tile_tokens;     // keys [0, kv_end) are read
  const int key_tiles = ceil_div(kv_end, kPrefixKeys);
  const int per_split = ceil_div(key_tiles, p.num_splits);
  const int tile_lo = imin(split * per_split, key_tiles);
  const int tile_hi = imin(tile_lo + per_split, key_tiles);
  const int num_tiles = tile_hi - tile_lo;

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

  // Each thread copies one 16-byte piece of kLoads key rows a tile (rows j0 + u * kRowStep)
  // of K and of V. A tile starts on a cache block boundary (block_size <= kPrefixKeys, both
  // powers of two), so each of a thread's rows keeps its slot in the block from tile to tile.
  constexpr int kLoads = kPrefixKeys * kPieces / kPrefixThreads;
  constexpr int kRowStep = kPrefixThreads / kPieces;
  static_assert(kPrefixThreads % kPieces == 0 && kLoads >= 1, "a thread's pieces share one column");
  const int piece = threadIdx.x % kPieces, j0 = threadIdx.x / kPieces;
  int slot_off[kLoads];
#pragma unroll
  for (int u = 0; u < kLoads; ++u) {
    slot_off[u] = ((j0 + u * kRowStep) & ((1 << p.block_shift) - 1)) * static_cast<int>(token_stride) + piece * 8;
  }
  auto load_tile = [&](int tile, int stage) {
    int ids[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int pos = tile * kPrefixKeys + j0 + u * kRowStep;
      ids[u] = pos < kv_end ? table[pos >> p.block_shift] : 0;
    }
    T* k_dst = k_s + stage * kStage + j0 * kRow + piece * 8;
    T* v_dst = v_s + stage * kStage + j0 * kRow + piece * 8;
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const bool ok = tile * kPrefixKeys + j0 + u * kRowStep < kv_end;
      const int64_t block = ids[u];
      cp_async16(k_dst + u * kRowStep * kRow, k_cache + block * p.k_stride_block + slot_off[u], ok);
      cp_async16(v_dst + u * kRowStep * kRow, v_cache + block * p.v_stride_block + slot_off[u], ok);
    }
  };

  // The first tiles' copies go out before anything else, Q's loads after them.
#pragma unroll
  for (int s = 0; s < kPrefixStages - 1; ++s) {
    if (s < num_tiles) load_tile(tile_lo + s, s);
    cp_async_commit();
  }

  // Q's A fragments: qa[kk] = rows g, g + 8 of the warp x dims 16 kk + 2c (+1), + 8.
  uint32_t qa[kKSteps][4];
  {
    const int r_lo = row0 + g, r_hi = row0 + g + 8;
    const bool ok_lo = warp_active && r_lo < rows, ok_hi = warp_active && r_hi < rows;
    const int64_t tok_lo = q_start + q_tile * tq + (ok_lo ? r_lo / group : 0);
    const int64_t tok_hi = q_start + q_tile * tq + (ok_hi ? r_hi / group : 0);
    const T* q_lo = q + tok_lo * p.q_stride_token + (kv_head * group + (ok_lo ? r_lo % group : 0)) * p.q_stride_head;
    const T* q_hi = q + tok_hi * p.q_stride_token + (kv_head * group + (ok_hi ? r_hi % group : 0)) * p.q_stride_head;
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      const int d = 16 * kk + 2 * c;
      qa[kk][0] = ok_lo ? *reinterpret_cast<const uint32_t*>(q_lo + d) : 0u;
      qa[kk][1] = ok_hi ? *reinterpret_cast<const uint32_t*>(q_hi + d) : 0u;
      qa[kk][2] = ok_lo ? *reinterpret_cast<const uint32_t*>(q_lo + d + 8) : 0u;
      qa[kk][3] = ok_hi ? *reinterpret_cast<const uint32_t*>(q_hi + d + 8) : 0u;
    }
  }

  float o[kDimTiles][4];
#pragma unroll
  for (int t = 0; t < kDimTiles; ++t)
#pragma unroll
    for (int r = 0; r < 4; ++r) o[t][r] = 0.f;
  float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.f, l_hi = 0.f;
  const int mi = lane / 8, ri = lane % 8;  // the matrix and row this lane addresses for ldmatrix

  for (int i = 0; i < num_tiles; ++i) {
    cp_async_wait<kPrefixStages - 2>();  // tile i's copies (this thread's) have landed
    __syncthreads();                     // everyone's have; tile i - 1's slot is free
    if (i + kPrefixStages - 1 < num_tiles) load_tile(tile_lo + i + kPrefixStages - 1, (i + kPrefixStages - 1) % kPrefixStages);
    cp_async_commit();
    const int tile = tile_lo + i;
    if (!warp_active || tile * kPrefixKeys > warp_last_pos) continue;
    const T* ks = k_s + (i % kPrefixStages) * kStage;
    const T* vs = v_s + (i % kPrefixStages) * kStage;
    float s[kKeyTiles][4];
#pragma unroll
    for (int t = 0; t < kKeyTiles; ++t)
#pragma unroll
      for (int r = 0; r < 4; ++r) s[t][r] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
#pragma unroll
      for (int nt = 0; nt < kKeyTiles; nt += 2) {  // independent accumulators a k step
        uint32_t b[4];
        ldmatrix_x4<false>(b, ks + ((nt + mi / 2) * 8 + ri) * kRow + 16 * kk + (mi % 2) * 8);
        const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
        mma_m16n8k16<T>(s[nt], qa[kk], b0);
        mma_m16n8k16<T>(s[nt + 1], qa[kk], b1);
      }
    }
    // s[nt][r]: row g (r < 2) or g + 8, key tile * 64 + 8 nt + 2c + r % 2.
    const bool masked = (tile + 1) * kPrefixKeys - 1 > warp_first_pos;
    float top_lo = -INFINITY, top_hi = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < kKeyTiles; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        float v = s[nt][r] * p.scale_log2;
        if (masked && tile * kPrefixKeys + 8 * nt + 2 * c + r % 2 > (r < 2 ? pos_lo : pos_hi)) v = -INFINITY;
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
    const float new_lo = fmaxf(m_lo, top_lo), new_hi = fmaxf(m_hi, top_hi);
    // A row with nothing allowed yet keeps m = -inf: subtract 0 instead (no inf - inf).
    const float base_lo = new_lo == -INFINITY ? 0.f : new_lo;
    const float base_hi = new_hi == -INFINITY ? 0.f : new_hi;
    const float alpha_lo = exp2f(m_lo - base_lo), alpha_hi = exp2f(m_hi - base_hi);
    m_lo = new_lo;
    m_hi = new_hi;
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
    l_lo = l_lo * alpha_lo + sum_lo;  // this lane's share of the row sum
    l_hi = l_hi * alpha_hi + sum_hi;
#pragma unroll
    for (int t = 0; t < kDimTiles; ++t) {
      o[t][0] *= alpha_lo;
      o[t][1] *= alpha_lo;
      o[t][2] *= alpha_hi;
      o[t][3] *= alpha_hi;
    }
#pragma unroll
    for (int j = 0; j < kPrefixKeys / 16; ++j) {
      // P's accumulator tiles 2j, 2j + 1 are the A fragment of keys 16j .. 16j + 15.
      const uint32_t pa[4] = {pack2<T>(s[2 * j][0], s[2 * j][1]), pack2<T>(s[2 * j][2], s[2 * j][3]),
                              pack2<T>(s[2 * j + 1][0], s[2 * j + 1][1]), pack2<T>(s[2 * j + 1][2], s[2 * j + 1][3])};
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
  cp_async_wait<0>();  // no copy outlives the block (the empty trailing groups included)
  l_lo += __shfl_xor_sync(kFullMask, l_lo, 1);
  l_lo += __shfl_xor_sync(kFullMask, l_lo, 2);
  l_hi += __shfl_xor_sync(kFullMask, l_hi, 1);
  l_hi += __shfl_xor_sync(kFullMask, l_hi, 2);

  ChunkRows rows_of{q_start + q_tile * tq, kv_head * group, group, rows};
  write_chunk_output<T, HEAD_DIM, kPrefixThreads>(p, rows_of, split, row0, g, c, o, m_lo, m_hi, l_lo, l_hi,
                                                  kv_head * gridDim.x + pid);
}

template <typename T, int HEAD_DIM>
void launch_prefix_attention_for(const ChunkAttentionParams& p, cudaStream_t stream) {
  void (*kernel)(const ChunkAttentionParams) = prefix_attention_kernel<T, HEAD_DIM>;
  constexpr int smem = prefix_smem_bytes<HEAD_DIM>();
  allow_dynamic_smem<prefix_attention_kernel<T, HEAD_DIM>>(smem);
  const int group = p.num_heads / p.num_kv_heads;
  const dim3 grid(prefix_grid_x(p.num_tokens, p.num_seqs, group), p.num_kv_heads, p.num_splits);
  AG_LAUNCH_KERNEL(kernel, grid, dim3(kPrefixThreads), smem, stream, p);
}

// Returns false when no kernel takes the shapes.
template <typename T>
bool launch_prefix_attention(const ChunkAttentionParams& p, int head_dim, cudaStream_t stream) {
  const int group = p.num_kv_heads > 0 ? p.num_heads / p.num_kv_heads : 0;
  if (!chunk_attention_supported(head_dim, group, p.num_splits)) return false;  // the same shapes
  if (p.num_tokens == 0 || p.num_seqs == 0) return true;
  if (head_dim == 64) {
    launch_prefix_attention_for<T, 64>(p, stream);
  } else {
    launch_prefix_attention_for<T, 128>(p, stream);
  }
  return true;
}

}  // namespace asyncgen
