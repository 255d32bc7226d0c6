// Paged-attention decode: one query token per sequence against its paged K/V cache.
//
// Semantics are those of asyncgen/_ops/reference.py::paged_attention restricted to
// batches where every query length is 1: query head h of sequence s attends to cache
// positions [ctx_start, seq_len) with ctx_start = max(0, seq_len - sliding_window) when a
// window is set (else 0). Softmax is computed in fp32 with the online (running max) form.
//
// Layouts (element strides, the innermost three cache dims contiguous):
//
//   q, out            [num_seqs, num_heads, head_dim]        any seq/head stride
//   k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim]
//   block_tables      [num_seqs, >= ceil(seq_len / block_size)] int32
//   seq_lens          [num_seqs] int32
//
// Work decomposition
// ------------------
// One thread block (4 warps) owns one (kv head, sequence[, partition]) and all query heads
// of that kv head's GQA group (up to 8; larger groups are cut into chunks of 8), so each
// K/V byte is read from HBM once per group. The context is cut into tiles of 16 tokens;
// warp w takes tiles w, w+4, w+8, ... and keeps its own running max / sum / accumulator,
// merged across warps at the end through shared memory.
//
//   tile = 16 tokens (always inside one cache block: block_size % 16 == 0)
//
//   QK step: 2 lanes per token            PV step: head_dim/8 lanes per token row
//   lane:  0 1 | 2 3 | ... | 30 31        lane:  0 .. 15 | 16 .. 31      (head_dim 128)
//   token:  0  |  1  | ... |  15          row:      0    |    1
//   each lane reads every other 16-byte   a row reads one token's 16-byte vectors;
//   vector of its token's key row and     row r takes tokens r, r+2, ..., r+14 and
//   dots it with q (fp32, from smem)      accumulates p * v for its 8 dims
//
// With more than one partition (split-K, for few sequences x heads and long contexts),
// each partition writes its normalised partial output plus (max, sum). Given a counter
// per block column (`split_counters`), the partition that finishes last combines them
// (each block takes a ticket with an atomic add after its partials are out; the one that
// draws the last ticket reads every partial and resets the counter to 0 for the next
// launch). Without counters a second kernel combines them. A sequence that fits one
// partition is finished by that partition.
//
// Rotary fused in (`cos_sin` set, one GQA chunk per kv head): q and this step's k come
// straight from the qkv projection. Every block rotates its q heads as it stages them
// (rounded to T, as the separate rotary kernel stores them; q itself is not written), and
// the block that owns a sequence's last partition rotates the new k, writes it and v into
// the token's slot, and only then (after a barrier) reads the context, which ends with
// that slot. No other block reads the slot, so the write needs no wider ordering.
//
// Napkin math (per sequence and kv head, context L, head_dim D, group G, 2-byte dtype):
// reads 4*L*D bytes of K/V, does 4*L*D*G flops -> G flop/byte. The H200 (~4.8 TB/s
// HBM3e, ~67 TFLOP/s fp32 FMA) balances at ~14 flop/byte, so decode is bandwidth-bound
// for G <= 8: the goal is many 16-byte loads in flight and few instructions per byte.
// A 7B model (32 kv heads, D=128) keeps 16 KiB of K/V per token and layer: 64 sequences
// at 4k context read 4 GiB per layer, ~1 ms at 4.3 TB/s; one sequence at 1k, 16 MiB, ~4 us
// (there launch latency and too few blocks dominate, hence split-K).
//
// Masking: cache slots outside [ctx_start, seq_len) are never loaded (their block-table
// entries may be garbage) and get probability exactly 0, so NaN left in unused slots
// cannot reach the result.
#pragma once

#include "common.cuh"

namespace asyncgen {

constexpr int kDecodeWarps = 4;
constexpr int kDecodeThreads = kDecodeWarps * kWarpSize;
constexpr int kReduceThreads = 128;
constexpr int kTile = 16;                // tokens per warp step
constexpr int kMaxHeadsPerBlock = 8;     // query heads of one GQA group per block
constexpr int kMaxPartitions = 1024;     // bounds the reduce kernel's shared memory
constexpr int kMinPartitionSize = 128;   // tokens: 2 tiles per warp; smaller costs more than it gives

struct DecodeParams {
  void* out;                 // [num_seqs, num_heads, head_dim]
  const void* q;             // [num_seqs, num_heads, head_dim]
  void* k_cache;             // [num_blocks, block_size, num_kv_heads, head_dim]
  void* v_cache;             // [num_blocks, block_size, num_kv_heads, head_dim]
  const int* block_tables;   // [num_seqs, block_table_stride]
  const int* seq_lens;       // [num_seqs]
  float* part_max;           // [num_seqs, num_heads, max_partitions]          (split only)
  float* part_sum;           // [num_seqs, num_heads, max_partitions]          (split only)
  float* part_out;           // [num_seqs, num_heads, max_partitions, head_dim] (split only)
  int64_t out_stride_seq, out_stride_head;
  int64_t q_stride_seq, q_stride_head;
  int64_t k_stride_block, v_stride_block;
  int64_t block_table_stride;
  int num_seqs, num_heads, num_kv_heads, head_dim, block_size;
  int sliding_window;        // <= 0: no window
  int partition_size;        // tokens per partition, a multiple of kTile; 0: one pass
  int max_partitions;        // partitions launched per sequence (grid z); 1: one pass
  float scale;
  // In-kernel combine of the partitions: [num_seqs * gridDim.x] int32, all 0 before the
  // launch and after it; nullptr: the reduce kernel combines them.
  int* split_counters;
  // Fused rotary and cache write (cos_sin != nullptr; needs a single head chunk per kv head):
  const void* k_new;         // [num_seqs, num_kv_heads, head_dim] this step's key, before rotary
  const void* v_new;         // [num_seqs, num_kv_heads, head_dim]
  const int64_t* positions;  // [num_seqs] position of each query (row of cos_sin)
  const int64_t* slot_mapping;  // [num_seqs] cache slot of the new key/value; < 0: not stored
  const float* cos_sin;      // [max_position, head_dim]: cos of each rotated pair, then sin
  int64_t k_new_stride_seq, k_new_stride_head, v_new_stride_seq, v_new_stride_head;
  int64_t cos_sin_stride;
};

// Query heads handled by one block for a GQA group of `group` query heads per kv head.
__host__ __device__ inline int decode_heads_per_block(int group) {
  return group <= 1 ? 1 : group <= 2 ? 2 : group <= 4 ? 4 : kMaxHeadsPerBlock;
}

struct DecodePlan {
  int partition_size;  // 0: single pass
  int num_partitions;  // 1: single pass
};

// Picks single-pass or split-K from shapes only, so the launch configuration is fixed
// for a given (batch shape, max_seq_len) and a CUDA graph can capture it.
//   requested_partition_size: < 0 automatic, 0 single pass, > 0 that many tokens per
//   partition (rounded up to kTile).
// Partitions tile the window [base, seq_len), so a sliding window bounds their number.
inline DecodePlan plan_decode(int num_seqs, int num_heads, int num_kv_heads, int max_seq_len,
                              int sliding_window, int num_sms, int requested_partition_size) {
  const DecodePlan single{0, 1};
  int64_t context = max_seq_len;  // upper bound of seq_len - base over the batch
  if (sliding_window > 0 && sliding_window + kTile - 1 < context) {
    context = sliding_window + kTile - 1;
  }
  if (requested_partition_size == 0 || context <= kTile) return single;

  int64_t partition_size;
  if (requested_partition_size > 0) {
    partition_size = (requested_partition_size + kTile - 1) / kTile * kTile;
  } else {
    const int group = num_heads / num_kv_heads;
    const int64_t blocks = static_cast<int64_t>(num_seqs) * num_kv_heads *
                           ceil_div(group, decode_heads_per_block(group));
    // Enough blocks already to fill every SM twice: splitting only adds a reduce.
    if (blocks >= 2 * static_cast<int64_t>(num_sms) || context <= 2 * kMinPartitionSize) {
      return single;
    }
    const int64_t wanted = (4 * static_cast<int64_t>(num_sms) + blocks - 1) / blocks;
    partition_size = (context + wanted - 1) / wanted;
    partition_size = (partition_size + 63) / 64 * 64;
    if (partition_size < kMinPartitionSize) partition_size = kMinPartitionSize;
  }
  if ((context + partition_size - 1) / partition_size > kMaxPartitions) {
    partition_size = (context + kMaxPartitions - 1) / kMaxPartitions;
    partition_size = (partition_size + kTile - 1) / kTile * kTile;
  }
  const int num_partitions = static_cast<int>((context + partition_size - 1) / partition_size);
  if (num_partitions <= 1) return single;
  return DecodePlan{static_cast<int>(partition_size), num_partitions};
}

// The attended range of one sequence: [ctx_start, seq_len), processed from `base`, the
// tile-aligned position at or below ctx_start.
struct SeqWindow {
  int ctx_start;
  int base;
};

AG_DEVICE SeqWindow seq_window(int seq_len, int sliding_window) {
  const int ctx_start = sliding_window > 0 ? imax(seq_len - sliding_window, 0) : 0;
  return SeqWindow{ctx_start, ctx_start / kTile * kTile};
}

// Partitions a sequence uses; an empty sequence still has one (which writes zeros).
// The last launched partition takes any remainder, so an underestimated max_seq_len
// costs speed, not correctness.
AG_DEVICE int num_partitions_of(const DecodeParams& p, int seq_len, int base) {
  const int n = seq_len > base ? ceil_div(seq_len - base, p.partition_size) : 1;
  return imin(n, p.max_partitions);
}

// Element d of a rotate-half rotary embedding of row x (x_d its value), at the position
// whose cos | sin row is cs, rounded to T and back, as the separate rotary kernel leaves it.
template <typename T>
AG_DEVICE float rotate_half_rounded(float x_d, const T* x, int d, int half, const float* cs) {
  const int pair = d < half ? d : d - half;
  const float c = cs[pair], s = cs[half + pair];
  const float y = d < half ? x_d * c - to_float(x[d + half]) * s : x_d * c + to_float(x[pair]) * s;
  return round_to<T>(y);
}

// out = sum_i w_i o_i / sum_i w_i over the partitions of (sequence, query head), with
// w_i = l_i exp(m_i - max m) and o_i the partition's output as stored (normalised by its
// own l_i), as the reduce kernel computes it. Partials of other blocks are read past L1.
template <typename T, int HEAD_DIM>
AG_DEVICE void combine_partitions(const DecodeParams& p, int seq, int head, int num_parts) {
  const int64_t row = static_cast<int64_t>(seq) * p.num_heads + head;
  const float* part_max = p.part_max + row * p.max_partitions;
  const float* part_sum = p.part_sum + row * p.max_partitions;
  const float* part_out = p.part_out + row * p.max_partitions * HEAD_DIM;
  float m = -INFINITY;
  for (int i = 0; i < num_parts; ++i) m = fmaxf(m, __ldcg(part_max + i));
  const float m_ref = m == -INFINITY ? 0.f : m;
  T* out = static_cast<T*>(p.out) + seq * p.out_stride_seq + head * p.out_stride_head;
  for (int d = threadIdx.x; d < HEAD_DIM; d += kDecodeThreads) {
    float o = 0.f, total = 0.f;
    for (int i = 0; i < num_parts; ++i) {
      const float w = __ldcg(part_sum + i) * __expf(__ldcg(part_max + i) - m_ref);
      total += w;
      o += w * __ldcg(part_out + i * HEAD_DIM + d);
    }
    out[d] = from_float<T>(total > 0.f ? o / total : 0.f);
  }
}

// Grid: (num_kv_heads * head chunks, num_seqs, max_partitions); block: kDecodeThreads.
template <typename T, int HEAD_DIM, int HEADS>
__global__ void __launch_bounds__(kDecodeThreads)
    paged_attention_decode_kernel(const DecodeParams p) {
  using F = Float8<T>;
  constexpr int QK_LANES = kWarpSize / kTile;            // 2 lanes per token
  constexpr int QK_VECS = HEAD_DIM / 8 / QK_LANES;        // 16-byte vectors per lane
  constexpr int PV_LANES = HEAD_DIM / 8;                  // lanes covering one token row
  constexpr int PV_ROWS = kWarpSize / PV_LANES;           // token rows per warp
  constexpr int PV_TOKENS = kTile / PV_ROWS;              // tokens per lane in PV
  static_assert(HEAD_DIM % (8 * QK_LANES) == 0, "head_dim must be a multiple of 16");
  static_assert(PV_LANES <= kWarpSize && kWarpSize % PV_LANES == 0,
                "head_dim / 8 must divide the warp size");

  __shared__ __align__(16) float q_smem[HEADS][HEAD_DIM];             // q * scale
  __shared__ __align__(16) float p_smem[kDecodeWarps][kTile][HEADS];  // tile probabilities
  __shared__ __align__(16) float o_smem[kDecodeWarps][HEADS][HEAD_DIM];
  __shared__ float m_smem[kDecodeWarps][HEADS];
  __shared__ float l_smem[kDecodeWarps][HEADS];

  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int group = p.num_heads / p.num_kv_heads;
  const int head_chunks = ceil_div(group, HEADS);
  const int kv_head = blockIdx.x / head_chunks;
  const int chunk = blockIdx.x % head_chunks;
  const int seq = blockIdx.y;
  const bool partitioned = p.max_partitions > 1;
  const int part = blockIdx.z;
  const int head0 = kv_head * group + chunk * HEADS;  // first query head of this block
  const int num_heads_here = imin(HEADS, group - chunk * HEADS);

  const int seq_len = p.seq_lens[seq];
  const SeqWindow win = seq_window(seq_len, p.sliding_window);
  int begin = win.base;
  int end = seq_len;
  int num_parts = 1;
  if (partitioned) {
    num_parts = num_partitions_of(p, seq_len, win.base);
    if (part >= num_parts) return;  // uniform over the block
    begin = win.base + part * p.partition_size;
    if (part < num_parts - 1) end = begin + p.partition_size;
  }
  const int num_tiles = end > begin ? ceil_div(end - begin, kTile) : 0;

  const T* q = static_cast<const T*>(p.q) + seq * p.q_stride_seq + head0 * p.q_stride_head;
  constexpr int HALF = HEAD_DIM / 2;
  const bool rotary = p.cos_sin != nullptr;
  const float* cs = rotary ? p.cos_sin + p.positions[seq] * p.cos_sin_stride : nullptr;
  const int* block_table = p.block_tables + seq * p.block_table_stride;
  const int64_t slot_stride = static_cast<int64_t>(p.num_kv_heads) * HEAD_DIM;  // between slots of a block
  const T* k_head = static_cast<const T*>(p.k_cache) + kv_head * HEAD_DIM;
  const T* v_head = static_cast<const T*>(p.v_cache) + kv_head * HEAD_DIM;
  if (rotary) {
    // Launched as a dependent of the qkv product (see launch_decode): until that has
    // finished, read only what was written before the step (lengths, block tables,
    // positions, the cache below the new token) and bring the block's first K/V tiles
    // into L2. A prefetched line holding the new slot is refreshed in L2 by the write.
    constexpr int LINES = HEAD_DIM * static_cast<int>(sizeof(T)) / 128;  // per K (or V) row
    const int tokens = imin(num_tiles, 2 * kDecodeWarps) * kTile;
    for (int i = threadIdx.x; i < tokens * LINES; i += kDecodeThreads) {
      const int pos = begin + i / LINES;
      if (pos >= end) break;
      const int64_t block_id = block_table[pos / p.block_size];
      const int64_t in_block = (pos % p.block_size) * slot_stride + (i % LINES) * (128 / sizeof(T));
      prefetch_l2(k_head + block_id * p.k_stride_block + in_block);
      prefetch_l2(v_head + block_id * p.v_stride_block + in_block);
    }
    grid_dependency_wait();
  }
  // The product after this kernel may launch and fetch its weights. A dependent launch
  // signals only after its wait: before it, the kernel after next could be placed on the
  // SMs while the kernel ahead still runs.
  launch_dependents();
  for (int i = threadIdx.x; i < HEADS * HEAD_DIM; i += kDecodeThreads) {
    const int h = i / HEAD_DIM;
    const int d = i % HEAD_DIM;
    float x = 0.f;
    if (h < num_heads_here) {
      const T* qh = q + h * p.q_stride_head;
      x = to_float(qh[d]);
      if (rotary) x = rotate_half_rounded<T>(x, qh, d, HALF, cs);
    }
    q_smem[h][d] = x * p.scale;
  }
  if (rotary && part == num_parts - 1) {  // this block's context ends with the new token
    const int64_t slot = p.slot_mapping[seq];
    if (slot >= 0) {
      const int64_t row = (slot % p.block_size) * slot_stride + kv_head * HEAD_DIM;
      T* k_dst = static_cast<T*>(p.k_cache) + slot / p.block_size * p.k_stride_block + row;
      T* v_dst = static_cast<T*>(p.v_cache) + slot / p.block_size * p.v_stride_block + row;
      const T* k_src = static_cast<const T*>(p.k_new) + seq * p.k_new_stride_seq + kv_head * p.k_new_stride_head;
      const T* v_src = static_cast<const T*>(p.v_new) + seq * p.v_new_stride_seq + kv_head * p.v_new_stride_head;
      for (int d = threadIdx.x; d < HEAD_DIM; d += kDecodeThreads) {
        k_dst[d] = from_float<T>(rotate_half_rounded<T>(to_float(k_src[d]), k_src, d, HALF, cs));
        v_dst[d] = v_src[d];
      }
    }
  }
  __syncthreads();  // q staged; the new key and value are in the cache for the block's reads

  float m_run[HEADS];    // running max of the scores seen by this warp
  float l_run[HEADS];    // this lane's share of the running sum of exp(score - m_run)
  float acc[HEADS][8];   // sum of p * v over this lane's tokens, dims pv_col*8 .. +8
#pragma unroll
  for (int h = 0; h < HEADS; ++h) {
    m_run[h] = -INFINITY;
    l_run[h] = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[h][e] = 0.f;
  }

  const int qk_token = lane / QK_LANES;
  const int qk_part = lane % QK_LANES;
  const int pv_row = lane / PV_LANES;
  const int pv_col = lane % PV_LANES;

  // The block id of the warp's next tile is fetched one iteration ahead.
  int next_block = warp < num_tiles ? block_table[(begin + warp * kTile) / p.block_size] : 0;
  for (int tile = warp; tile < num_tiles; tile += kDecodeWarps) {
    const int tile_start = begin + tile * kTile;
    const int64_t block_id = next_block;
    if (tile + kDecodeWarps < num_tiles) {
      next_block = block_table[(tile_start + kDecodeWarps * kTile) / p.block_size];
    }
    const int64_t tile_slot = (tile_start % p.block_size) * slot_stride;
    const T* k_tile = k_head + block_id * p.k_stride_block + tile_slot;
    const T* v_tile = v_head + block_id * p.v_stride_block + tile_slot;

    // All loads of the tile first. Slots outside the window are not read; zero bits
    // decode to 0.0, so they add nothing below.
    const int qk_pos = tile_start + qk_token;
    const bool qk_valid = qk_pos >= win.ctx_start && qk_pos < end;
    uint4 k_raw[QK_VECS];
#pragma unroll
    for (int i = 0; i < QK_VECS; ++i) {
      const int d0 = (qk_part + i * QK_LANES) * 8;
      k_raw[i] = qk_valid ? load16(k_tile + qk_token * slot_stride + d0) : make_uint4(0, 0, 0, 0);
    }
    uint4 v_raw[PV_TOKENS];
#pragma unroll
    for (int j = 0; j < PV_TOKENS; ++j) {
      const int t = pv_row + j * PV_ROWS;
      const bool valid = tile_start + t >= win.ctx_start && tile_start + t < end;
      v_raw[j] = valid ? load16(v_tile + t * slot_stride + pv_col * 8) : make_uint4(0, 0, 0, 0);
    }

    // Scores: each lane of a token pair covers half of head_dim.
    float s[HEADS];
#pragma unroll
    for (int h = 0; h < HEADS; ++h) s[h] = 0.f;
#pragma unroll
    for (int i = 0; i < QK_VECS; ++i) {
      float k[8];
      F::unpack(k_raw[i], k);
      const int d0 = (qk_part + i * QK_LANES) * 8;
#pragma unroll
      for (int h = 0; h < HEADS; ++h) {
        const float4 qa = *reinterpret_cast<const float4*>(&q_smem[h][d0]);
        const float4 qb = *reinterpret_cast<const float4*>(&q_smem[h][d0 + 4]);
        s[h] += qa.x * k[0] + qa.y * k[1] + qa.z * k[2] + qa.w * k[3] +
                qb.x * k[4] + qb.y * k[5] + qb.z * k[6] + qb.w * k[7];
      }
    }

    // Online softmax over the tile; m_run is the same in every lane of the warp.
    float alpha[HEADS];
#pragma unroll
    for (int h = 0; h < HEADS; ++h) {
      s[h] += __shfl_xor_sync(kFullMask, s[h], 1);
      s[h] = qk_valid ? s[h] : -INFINITY;
      const float m_new = fmaxf(m_run[h], warp_max<QK_LANES>(s[h]));
      const float m_ref = m_new == -INFINITY ? 0.f : m_new;  // keeps exp() NaN-free
      alpha[h] = __expf(m_run[h] - m_ref);
      const float prob = __expf(s[h] - m_ref);
      m_run[h] = m_new;
      l_run[h] = l_run[h] * alpha[h] + (qk_part == 0 ? prob : 0.f);
      if (qk_part == 0) p_smem[warp][qk_token][h] = prob;
    }
    __syncwarp();

#pragma unroll
    for (int h = 0; h < HEADS; ++h) {
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[h][e] *= alpha[h];
    }
#pragma unroll
    for (int j = 0; j < PV_TOKENS; ++j) {
      float v[8];
      F::unpack(v_raw[j], v);
      const int t = pv_row + j * PV_ROWS;
#pragma unroll
      for (int h = 0; h < HEADS; ++h) {
        const float prob = p_smem[warp][t][h];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[h][e] += prob * v[e];
      }
    }
    __syncwarp();  // p_smem is rewritten by the next tile
  }

  // Merge: token rows within the warp, then warps through shared memory.
#pragma unroll
  for (int mask = PV_LANES; mask < kWarpSize; mask <<= 1) {
#pragma unroll
    for (int h = 0; h < HEADS; ++h) {
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[h][e] += __shfl_xor_sync(kFullMask, acc[h][e], mask);
    }
  }
#pragma unroll
  for (int h = 0; h < HEADS; ++h) l_run[h] = warp_sum(l_run[h]);
  if (lane == 0) {
#pragma unroll
    for (int h = 0; h < HEADS; ++h) {
      m_smem[warp][h] = m_run[h];
      l_smem[warp][h] = l_run[h];
    }
  }
  __syncthreads();

  float m_all[HEADS];
  float l_all[HEADS];
#pragma unroll
  for (int h = 0; h < HEADS; ++h) {
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) m = fmaxf(m, m_smem[w][h]);
    const float m_ref = m == -INFINITY ? 0.f : m;
    float l = 0.f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) l += l_smem[w][h] * __expf(m_smem[w][h] - m_ref);
    m_all[h] = m;
    l_all[h] = l;
    const float warp_scale = __expf(m_run[h] - m_ref);  // 0 for a warp that saw no tile
    if (pv_row == 0) {
#pragma unroll
      for (int e = 0; e < 8; ++e) o_smem[warp][h][pv_col * 8 + e] = acc[h][e] * warp_scale;
    }
  }
  __syncthreads();

  const bool write_final = num_parts == 1;
#pragma unroll
  for (int h = 0; h < HEADS; ++h) {
    if (h >= num_heads_here) break;
    const int head = head0 + h;
    const float inv_sum = l_all[h] > 0.f ? 1.f / l_all[h] : 0.f;  // empty sequence -> 0
    const int64_t row = static_cast<int64_t>(seq) * p.num_heads + head;
    for (int d = threadIdx.x; d < HEAD_DIM; d += kDecodeThreads) {
      float o = 0.f;
#pragma unroll
      for (int w = 0; w < kDecodeWarps; ++w) o += o_smem[w][h][d];
      o *= inv_sum;
      if (write_final) {
        T* out = static_cast<T*>(p.out) + seq * p.out_stride_seq + head * p.out_stride_head;
        out[d] = from_float<T>(o);
      } else {
        p.part_out[(row * p.max_partitions + part) * HEAD_DIM + d] = o;
      }
    }
    if (!write_final && threadIdx.x == 0) {
      p.part_max[row * p.max_partitions + part] = m_all[h];
      p.part_sum[row * p.max_partitions + part] = l_all[h];
    }
  }
  if (!write_final && p.split_counters != nullptr &&
      takes_last_ticket(p.split_counters + seq * gridDim.x + blockIdx.x, num_parts)) {
    for (int h = 0; h < num_heads_here; ++h) combine_partitions<T, HEAD_DIM>(p, seq, head0 + h, num_parts);
  }
}

// Combines the partitions of one (sequence, query head): weights l_i * exp(m_i - m).
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(kReduceThreads)
    paged_attention_reduce_kernel(const DecodeParams p) {
  constexpr int NUM_WARPS = kReduceThreads / kWarpSize;
  __shared__ float weights[kMaxPartitions];
  __shared__ float scratch[NUM_WARPS];
  launch_dependents();  // the one-row GEMV after it may start fetching its weights

  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int seq_len = p.seq_lens[seq];
  const int num_parts = num_partitions_of(p, seq_len, seq_window(seq_len, p.sliding_window).base);
  if (num_parts <= 1) return;  // the single partition wrote `out` itself

  const int64_t row = static_cast<int64_t>(seq) * p.num_heads + head;
  const float* part_max = p.part_max + row * p.max_partitions;
  const float* part_sum = p.part_sum + row * p.max_partitions;
  const float* part_out = p.part_out + row * p.max_partitions * HEAD_DIM;

  float m = -INFINITY;
  for (int i = threadIdx.x; i < num_parts; i += kReduceThreads) m = fmaxf(m, part_max[i]);
  m = block_max<NUM_WARPS>(m, scratch);
  const float m_ref = m == -INFINITY ? 0.f : m;

  float total = 0.f;
  for (int i = threadIdx.x; i < num_parts; i += kReduceThreads) {
    const float w = part_sum[i] * __expf(part_max[i] - m_ref);
    weights[i] = w;
    total += w;
  }
  total = block_sum<NUM_WARPS>(total, scratch);  // also publishes `weights`
  const float inv_total = total > 0.f ? 1.f / total : 0.f;

  T* out = static_cast<T*>(p.out) + seq * p.out_stride_seq + head * p.out_stride_head;
  for (int d = threadIdx.x; d < HEAD_DIM; d += kReduceThreads) {
    float o = 0.f;
    for (int i = 0; i < num_parts; ++i) o += weights[i] * part_out[i * HEAD_DIM + d];
    out[d] = from_float<T>(o * inv_total);
  }
}

// dependent (sm_90+): the fused rotary kernel may start while the kernel ahead of it (the
// qkv product) still runs; it waits for it before reading q and the new key and value.
template <typename T, int HEAD_DIM, int HEADS>
void launch_decode(const DecodeParams& p, cudaStream_t stream, bool dependent) {
  const int group = p.num_heads / p.num_kv_heads;
  const dim3 block(kDecodeThreads);
  const dim3 grid(p.num_kv_heads * ceil_div(group, HEADS), p.num_seqs, p.max_partitions);
  auto kernel = paged_attention_decode_kernel<T, HEAD_DIM, HEADS>;
  if (dependent && p.cos_sin != nullptr) {
    AG_LAUNCH_KERNEL_DEPENDENT(kernel, grid, block, 0, stream, p);
  } else {
    AG_LAUNCH_KERNEL(kernel, grid, block, 0, stream, p);
  }
  if (p.max_partitions > 1 && p.split_counters == nullptr) {
    auto reduce = paged_attention_reduce_kernel<T, HEAD_DIM>;
    AG_LAUNCH_KERNEL(reduce, dim3(p.num_heads, p.num_seqs), dim3(kReduceThreads), 0, stream, p);
  }
}

template <typename T, int HEAD_DIM>
void launch_decode_for_head_dim(const DecodeParams& p, cudaStream_t stream, bool dependent) {
  switch (decode_heads_per_block(p.num_heads / p.num_kv_heads)) {
    case 1: launch_decode<T, HEAD_DIM, 1>(p, stream, dependent); break;
    case 2: launch_decode<T, HEAD_DIM, 2>(p, stream, dependent); break;
    case 4: launch_decode<T, HEAD_DIM, 4>(p, stream, dependent); break;
    default: launch_decode<T, HEAD_DIM, kMaxHeadsPerBlock>(p, stream, dependent); break;
  }
}

inline bool decode_supports_head_dim(int head_dim) {
  return head_dim == 64 || head_dim == 128 || head_dim == 256;
}

// Whether the fused rotary and cache write can run for a GQA group of `group` query heads
// per kv head: the block that writes a kv head's new slot must be the only one reading it.
inline bool decode_rotary_supported(int group) { return group <= kMaxHeadsPerBlock; }

// Launches the decode kernel(s) for element type T (__half or __nv_bfloat16). The caller
// has validated shapes, filled partition_size / max_partitions from plan_decode() and
// allocated part_* when max_partitions > 1 (and split_counters when it wants the
// partitions combined in the kernel). Returns false for an unsupported head_dim, or
// rotary asked for with a group decode_rotary_supported() refuses. dependent: see
// launch_decode (the fused rotary kernel only).
template <typename T>
bool launch_paged_attention_decode(const DecodeParams& p, cudaStream_t stream, bool dependent = false) {
  if (p.cos_sin != nullptr && !decode_rotary_supported(p.num_heads / p.num_kv_heads)) return false;
  switch (p.head_dim) {
    case 64: launch_decode_for_head_dim<T, 64>(p, stream, dependent); return true;
    case 128: launch_decode_for_head_dim<T, 128>(p, stream, dependent); return true;
    case 256: launch_decode_for_head_dim<T, 256>(p, stream, dependent); return true;
    default: return false;
  }
}

}  // namespace asyncgen
