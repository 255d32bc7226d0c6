// 4-bit GEMM on tensor cores for batches of 1-64 rows of x, both operands tiled through
// shared memory (sm_80+).
//
// The same product as quant_gemv_4bit (gemv.cuh), for the decode batches where the tensor-core
// GEMV above runs out of steam: at 64 rows each of its warps reads its own copy of x from L2
// (8x the bytes of its weights) and holds its weights in flight in registers, 188 of them a
// thread, so an SM runs 8 warps and waits on latency (docs/BENCHMARKS.md). Here a block of
// WARPS warps owns 32 * WARPS output columns and a range of K, and walks that range in
// stages of 64 K rows through a STAGES-deep cp.async ring in shared memory that carries,
// per stage, the block's packed weights (8 packed rows), its zero points and scales for the
// stage's group, and the stage's 64 columns of every x row. All warps read the same x
// stage, so x comes from L2 once per block instead of once per warp, and nothing is in
// flight in registers.
//
// Inside a stage each warp computes exactly what the tensor-core GEMV's warp computes for
// two 32-row chunks (see "4-bit on tensor cores" in gemv.cuh for the fragment layouts): A is
// 16 weight columns by 16 of K, dequantized from the lane's 16-byte vector of 4 packed words
// (its 4 columns, K rows 8c .. 8c + 7 of the chunk) and multiplied by the group's scale in
// fp16 as dequantize-then-matmul rounds it; B is 16 of K by 8 rows of x, taken from the
// lane's 16-byte vector of x at the same K rows; D accumulates in fp32, M_TILES tiles of 8
// rows by the warp's 32 columns.
//
// Shared memory layout per stage (no bank conflicts for the warps' 16-byte reads, in which
// 8 lanes 4g + c .. share a phase: two g by four c):
//   weights  8 packed rows of BN words, each row padded by 8 words, so that the four rows c
//            of a phase start 32 bytes apart in the banks;
//   x        8 * M_TILES rows of 64 halves (128 bytes: 8 pieces of 16 bytes), piece j of row r
//            stored at j ^ 4 (r & 1), so that rows g and g + 1 of a phase use different halves
//            of the banks;
//   groups   the stage's group: BN zero points, then BN scales (fp16).
//
// splits > 1 divides K over that many blocks per column range (gridDim.y): each writes its
// fp32 partial sums to the workspace and the last to finish (takes_last_ticket) adds them in
// split order, so the result does not depend on which block finishes when.
#pragma once

#include <type_traits>

#include "gemv.cuh"

namespace asyncgen {

constexpr int kTiledK = 64;                       // K rows per stage
constexpr int kTiledChunks = kTiledK / kMmaChunk;  // 32-row chunks per stage
constexpr int kTiledPackedRows = kTiledK / 8;
constexpr int kTiledMaxRows = kMmaMaxRows;  // the rows the 4-bit ops take
constexpr int kTiledMaxSplits = 16;
constexpr int kMaxStreamBlocksPerSm = 2;  // balanced launches: blocks an SM (plan_stream_gemm)
#ifndef AG_QGEMM_STAGES
#define AG_QGEMM_STAGES 4
#endif
constexpr int kTiledStages = AG_QGEMM_STAGES;
// Warps an SM should hold at once (bounding the registers a thread): 16 (128 registers)
// up to 32 rows; 12 (168) for 64 rows, whose 64 accumulators a thread spill at 128.
#ifndef AG_QGEMM_MIN_WARPS
#define AG_QGEMM_MIN_WARPS 0  // 0: by M_TILES, as below
#endif
template <int M_TILES>
constexpr int tiled_min_warps() {
  return AG_QGEMM_MIN_WARPS > 0 ? AG_QGEMM_MIN_WARPS : (M_TILES >= 8 ? 12 : 16);
}

struct QuantGemmParams {
  QuantGemvParams q;
  float* workspace;  // [splits, m, n] fp32 when splits > 1
  int* counters;     // [ceil(n / (32 * warps))] int32, all 0 (left all 0) when splits > 1
  int splits;        // 1 .. kTiledMaxSplits
  int warps;         // 4 or 8
  int wgmma;         // 1: the warpgroup kernel of quant_wgmma.cuh, 2: quant_ws.cuh's (sm_90a); 0: the tiled one
  int stream_blocks;  // > 0 (the warpgroup kernel): that many blocks share the stages evenly
                      // (plan_stream_gemm); splits is then the most blocks a column range has
};

// Balanced ("stream") launches: the product's T = column blocks x stages units of work,
// column block by column block, are dealt to G blocks in runs, block b taking units
// [start(b), start(b + 1)), so that every SM gets as much work when the column blocks do
// not divide evenly among them. A column block whose stages several blocks share is summed
// from their fp32 partials by the last of them to finish (as with splits), in block order.
// A block stores once per column block its run touches, and a store costs about as much as
// kStreamStoreUnits units (a 64-row store of partials and its ticket took 2.3 us against
// 0.62 us a unit on an H200, docs/BENCHMARKS.md runs 48-50): the runs are even over a line of
// column blocks x (stages + that many units), whose added units no block computes, so that
// a run which finishes a column block and goes on into the next is that much shorter. Where
// a block's share of the line would not exceed the added units (a run could then be
// empty), none are added. Host and device compute the same plan (and Python's
// cuda_backend.stream_gemm_plan).
constexpr int64_t kStreamStoreUnits = 4;
struct StreamMap {
  int64_t stages, period, line, blocks;  // period: stages + the units added after each column block
  __host__ __device__ __forceinline__ StreamMap(int64_t col_blocks, int64_t stages_, int64_t blocks_)
      : stages(stages_), blocks(blocks_) {
    const int64_t extra =
        col_blocks * (stages_ + kStreamStoreUnits) / blocks_ > kStreamStoreUnits ? kStreamStoreUnits : 0;
    period = stages_ + extra;
    line = col_blocks * period;
  }
  // The first unit of block b's run (b = G: T).
  __host__ __device__ __forceinline__ int64_t start(int64_t b) const {
    const int64_t v = b * line / blocks, s = v % period;
    return v / period * stages + (s < stages ? s : stages);
  }
  // The block whose run holds unit u: the largest b with start(b) <= u.
  __host__ __device__ __forceinline__ int64_t block_of(int64_t u) const {
    const int64_t v = u / stages * period + u % stages;
    return ((v + 1) * blocks - 1) / line;
  }
};
struct StreamPlan {
  int blocks;        // G: min(units, the blocks wanted)
  int max_segments;  // the most blocks sharing one column block's stages
};
inline StreamPlan plan_stream_gemm(int n, int k, int warps, int64_t blocks_wanted) {
  const int64_t col_blocks = ceil_div(n, 32 * warps), stages = k / kTiledK, units = col_blocks * stages;
  const int64_t g = units < blocks_wanted ? units : blocks_wanted;
  if (g <= 0) return {0, 0};
  const StreamMap map(col_blocks, stages, g);
  int64_t most = 0;
  for (int64_t cb = 0; cb < col_blocks; ++cb) {
    const int64_t segs = map.block_of(cb * stages + stages - 1) - map.block_of(cb * stages) + 1;
    most = segs > most ? segs : most;
  }
  return {static_cast<int>(g), static_cast<int>(most)};
}

template <int M_TILES, int WARPS>
struct TiledLayout {
  static constexpr int kCols = 32 * WARPS;                     // BN
  static constexpr int kWordsPerRow = kCols + 8;               // padded packed row
  static constexpr int kWeightBytes = kTiledPackedRows * kWordsPerRow * 4;
  static constexpr int kXBytes = 8 * M_TILES * kTiledK * 2;
  static constexpr int kGroupBytes = 2 * kCols * 2;
  static constexpr int kStageBytes = kWeightBytes + kXBytes + kGroupBytes;
  static constexpr int kSmemBytes = kTiledStages * kStageBytes;
};

// Whether the tiled kernel takes `p`: 1-64 rows, K a multiple of 64, groups of whole stages,
// N a multiple of 8 (a 16-byte copy holds 8 scales), 16-byte aligned scales, zeros and x
// rows, an even output stride (the results are stored as pairs), and with splits a 16-byte
// aligned workspace (the last block reads it 4 floats at a time) and m * n < 2^31.
inline bool quant_gemm_4bit_ok(const QuantGemmParams& gp) {
  const QuantGemvParams& p = gp.q;
  const auto aligned16 = [](const void* ptr, int64_t stride_elems, int elem_bytes) {
    return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && (stride_elems * elem_bytes) % 16 == 0;
  };
  const bool split_ok = gp.splits == 1 || (gp.splits > 1 && gp.splits <= kTiledMaxSplits && gp.workspace != nullptr &&
                                           reinterpret_cast<uintptr_t>(gp.workspace) % 16 == 0 &&
                                           gp.counters != nullptr && static_cast<int64_t>(p.m) * p.n <= INT32_MAX);
  if (gp.stream_blocks < 0 || (gp.stream_blocks > 0 && !gp.wgmma)) return false;
  return p.m >= 1 && p.m <= kTiledMaxRows && p.k % kTiledK == 0 && p.group_size % kTiledK == 0 &&
         p.k % p.group_size == 0 && p.n % 8 == 0 && (gp.warps == 4 || gp.warps == 8) && split_ok &&
         aligned16(p.scales, p.scales_stride, 2) && aligned16(p.zeros, p.zeros_stride, 2) &&
         aligned16(p.x, p.x_stride, 2) && aligned16(p.qweight, p.qweight_stride, 4) &&
         reinterpret_cast<uintptr_t>(p.out) % 4 == 0 && p.out_stride % 2 == 0;
}

// The low (high) halves of two registers as one register: (lo.low, hi.low) ((lo.high, hi.high)),
// one PRMT each (the shifts and masks compile to two instructions).
AG_DEVICE uint32_t pair_lo(uint32_t lo, uint32_t hi) {
#ifdef __CUDA_ARCH__
  return __byte_perm(lo, hi, 0x5410);
#else
  return (lo & 0xFFFFu) | (hi << 16);
#endif
}
AG_DEVICE uint32_t pair_hi(uint32_t lo, uint32_t hi) {
#ifdef __CUDA_ARCH__
  return __byte_perm(lo, hi, 0x7632);
#else
  return (lo >> 16) | (hi & 0xFFFF0000u);
#endif
}

// The last block of a split column range (after takes_last_ticket): the splits' fp32
// partials in split order (other blocks' writes, read past L1), plus the bias, stored to
// out, 4 columns a thread (N is a multiple of 8; m <= ROWS). A thread's pieces (up to
// kItems) are summed side by side, split by split, so that its loads of one split are in
// flight together. Summed one piece at a time, each load waited for the one before: 5 % of
// the warpgroup GEMM's stall samples at 64 rows, and a layer's products took 147.4 against
// 130.3 us at 64 rows on an H200 (docs/BENCHMARKS.md).
template <int THREADS, int BN, int ROWS>
AG_DEVICE void add_split_partials(const QuantGemmParams& gp, int col_base, int splits) {
  constexpr int kItems = (ROWS * (BN / 4) + THREADS - 1) / THREADS;
  static_assert(THREADS % (BN / 4) == 0, "a thread's items share their columns");
  const QuantGemvParams& p = gp.q;
  __half* out = static_cast<__half*>(p.out);
  const __half* bias = static_cast<const __half*>(p.bias);
  const int64_t split_stride = static_cast<int64_t>(p.m) * p.n;
  int offset[kItems];  // of the item's 4 columns in a split's partials (m * n < 2^31); -1: no item
  float4 v[kItems];
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const int i = threadIdx.x + j * THREADS;
    const int row = i / (BN / 4);
    const int col = col_base + 4 * (i % (BN / 4));
    offset[j] = row < p.m && col < p.n ? row * p.n + col : -1;
    if (offset[j] >= 0) v[j] = __ldcg(reinterpret_cast<const float4*>(gp.workspace + offset[j]));
  }
  for (int s = 1; s < splits; ++s) {
    const float* part = gp.workspace + s * split_stride;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      if (offset[j] < 0) continue;
      const float4 pv = __ldcg(reinterpret_cast<const float4*>(part + offset[j]));
      v[j].x += pv.x;
      v[j].y += pv.y;
      v[j].z += pv.z;
      v[j].w += pv.w;
    }
  }
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    if (offset[j] < 0) continue;
    // (item j's row and columns without a division by n: THREADS is a multiple of BN / 4)
    const int row = static_cast<int>(threadIdx.x) / (BN / 4) + j * (THREADS / (BN / 4));
    const int col = col_base + 4 * (static_cast<int>(threadIdx.x) % (BN / 4));
    float4 r = v[j];
    if (bias != nullptr) {
      r.x += __half2float(bias[col]);
      r.y += __half2float(bias[col + 1]);
      r.z += __half2float(bias[col + 2]);
      r.w += __half2float(bias[col + 3]);
    }
    __half2* dst = reinterpret_cast<__half2*>(out + static_cast<int64_t>(row) * p.out_stride + col);
    dst[0] = __floats2half2_rn(r.x, r.y);
    dst[1] = __floats2half2_rn(r.z, r.w);
  }
}

// 8 halves e0..e7 (one 16-byte piece of x) as the pairs (e0, e4), (e1, e5), (e2, e6),
// (e3, e7): the order in which dequant_word gives a packed word's codes (both tiled kernels).
AG_DEVICE uint4 pair_halves(const uint4& e) {
  return make_uint4(pair_lo(e.x, e.z), pair_hi(e.x, e.z), pair_lo(e.y, e.w), pair_hi(e.y, e.w));
}

// A 32-K chunk of an x row, its four 16-byte pieces e[0..3] as copied, stored in the order
// of A's k-slots (quant_ws.cuh): out piece j holds as its register q the pair
// (x[8q + j], x[8q + j + 4]) of the chunk, i.e. halves j and j + 4 of in-piece q; at(j) is
// where out piece j goes. quant_wgmma.cuh writes the same steps inline: through this
// helper its kernels' SASS comes out different (register numbering), and they are the
// routed, measured ones.
template <typename At>
AG_DEVICE void store_in_k_slots(const uint4* e, At at) {
  uint4 r[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) r[q] = pair_halves(e[q]);
  *at(0) = make_uint4(r[0].x, r[1].x, r[2].x, r[3].x);
  *at(1) = make_uint4(r[0].y, r[1].y, r[2].y, r[3].y);
  *at(2) = make_uint4(r[0].z, r[1].z, r[2].z, r[3].z);
  *at(3) = make_uint4(r[0].w, r[1].w, r[2].w, r[3].w);
}

// A thread's place in a tiled kernel's block: its lane (g, c), the block's first column, the
// lane's 4 columns within the block (wc .. wc + 3), and the block's stages: split blockIdx.y
// of gp.splits, as even as whole stages allow.
struct TiledPlace {
  int g, c, col_base, wc, s_begin, count;
  // Column block `col_block`, stages s_begin .. s_begin + count - 1.
  template <int BN>
  static AG_DEVICE TiledPlace at(int col_block, int s_begin, int count) {
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
    return {lane / 4, lane % 4, col_block * BN, warp * 32 + 4 * (lane / 4), s_begin, count};
  }
  // A split launch's block: column block blockIdx.x, split blockIdx.y of gp.splits.
  template <int BN>
  static AG_DEVICE TiledPlace of(const QuantGemmParams& gp) {
    const int stages = gp.q.k / kTiledK, split = blockIdx.y;
    const int s_begin = static_cast<int>(static_cast<int64_t>(stages) * split / gp.splits);
    const int s_end = static_cast<int>(static_cast<int64_t>(stages) * (split + 1) / gp.splits);
    return at<BN>(static_cast<int>(blockIdx.x), s_begin, s_end - s_begin);
  }
};

// A thread's copies of packed weights and group constants into the ring, one stage after
// another from `s_begin` (both tiled kernels): per stage kLoads 16-byte pieces of the
// block's packed rows and perhaps one piece of the group's zero points or scales. Its pieces
// sit at the same place in every stage, so the source pointers are set up once and advanced
// by one stage per copy (the group's by one group every stages_per_group copies), and the
// destinations are offsets within a slot: computed per copy with the stage index, the
// 64-bit address arithmetic and a division by stages_per_group took 135 instructions a
// stage a thread for 6 copies (sm_90 SASS, gate|up at 64 rows), a third of the stage's.
template <int THREADS, int BN, int WORDS_PER_ROW>
struct TiledWeightCopies {
  static constexpr int kLoads = kTiledPackedRows * (BN / 4) / THREADS;  // packed rows r, r + 8 / kLoads, ..
  static_assert(kTiledPackedRows * (BN / 4) == kLoads * THREADS, "whole weight pieces a thread");
  const int32_t* w_src;
  int64_t w_stage, w_next;
  int w_dst;
  bool w_ok, g_load, g_ok;
  const __half* g_src;
  int64_t g_stride;
  int g_left, stages_per_group, g_dst;

  AG_DEVICE TiledWeightCopies(const QuantGemvParams& p, int col_base, int s_begin) {
    const int w_row = threadIdx.x / (BN / 4), w_col = col_base + 4 * (threadIdx.x % (BN / 4));
    w_ok = w_col < p.n;
    w_stage = w_ok ? static_cast<int64_t>(kTiledPackedRows) * p.qweight_stride : 0;
    w_next = w_ok ? static_cast<int64_t>(kTiledPackedRows / kLoads) * p.qweight_stride : 0;
    w_src = p.qweight + (w_ok ? static_cast<int64_t>(w_row) * p.qweight_stride + w_col : 0) + s_begin * w_stage;
    w_dst = w_row * WORDS_PER_ROW + 4 * (threadIdx.x % (BN / 4));
    const __half* zeros = static_cast<const __half*>(p.zeros);
    const __half* scales = static_cast<const __half*>(p.scales);
    g_load = threadIdx.x < BN / 4;
    const int g_part = threadIdx.x / (BN / 8), g_col = col_base + 8 * (threadIdx.x % (BN / 8));
    g_ok = g_load && g_col < p.n;
    g_stride = g_ok ? (g_part == 0 ? p.zeros_stride : p.scales_stride) : 0;
    stages_per_group = p.group_size / kTiledK;
    g_src = (g_ok ? (g_part == 0 ? zeros : scales) + g_col : zeros) + (s_begin / stages_per_group) * g_stride;
    g_left = stages_per_group - s_begin % stages_per_group;  // stages until the next group
    g_dst = g_part * BN + 8 * (threadIdx.x % (BN / 8));
  }

  // The next stage's weights and group constants (which no kernel ahead writes) into a
  // slot's weights (packed rows of WORDS_PER_ROW words) and groups (BN zero points, BN scales).
  AG_DEVICE void copy(uint32_t* weights, __half* groups) {
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      cp_async16(weights + w_dst + j * (kTiledPackedRows / kLoads) * WORDS_PER_ROW, w_src + j * w_next, w_ok);
    }
    w_src += w_stage;
    if (g_load) cp_async16(groups + g_dst, g_src, g_ok);
    if (--g_left == 0) {
      g_left = stages_per_group;
      g_src += g_stride;
    }
  }
};

// Both tiled kernels' results: acc(mt, t, r) is D entry r of the lane's tile t and row tile
// mt, i.e. column col_base + wc + 2t + r / 2 and x row 8 mt + 2c + r % 2; entries r and
// r + 2 are two neighbouring columns of one row, stored as a pair. The block computed
// `piece` of the `pieces` that share the column block's stages: with more than one, each
// writes its fp32 partials and the last to take a ticket of counter `counter` adds them.
// NAMED: only the block's first THREADS threads call this (they meet at named barrier 1).
// With pieces, mark(0) is called once the partials are written and mark(1) once the ticket
// is taken (quant_ws.cuh's timeline).
struct NoMark {
  AG_DEVICE void operator()(int) const {}
};
template <int M_TILES, int THREADS, int BN, bool NAMED = false, typename Acc, typename Mark = NoMark>
AG_DEVICE void store_tiled_result(const QuantGemmParams& gp, int col_base, int wc, int c, int piece, int pieces,
                                  int counter, Acc acc, Mark mark = Mark{}) {
  const QuantGemvParams& p = gp.q;
  __half* out = static_cast<__half*>(p.out);
  const __half* bias = static_cast<const __half*>(p.bias);
  const bool whole = pieces == 1;  // else the fp32 partials of this piece
  float* part = gp.workspace + static_cast<int64_t>(piece) * p.m * p.n;
  // A lane holds columns col .. col + 3 of its rows (col a multiple of 4, N of 8: all four
  // exist where col does): partials go as one 16-byte store a row, so that the 8 lanes of a
  // row fill a 128-byte line (pairs of 8 bytes wrote half of each of twice as many sectors:
  // 2.7 us of a block's 64-row store on an H200, docs/BENCHMARKS.md run 48).
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int row = 8 * mt + 2 * c + rr;
      const int col = col_base + wc;
      if (row >= p.m || col >= p.n) continue;
      if (!whole) {
        *reinterpret_cast<float4*>(part + static_cast<int64_t>(row) * p.n + col) =
            make_float4(acc(mt, 0, rr), acc(mt, 0, rr + 2), acc(mt, 1, rr), acc(mt, 1, rr + 2));
        continue;
      }
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        float v0 = acc(mt, t, rr), v1 = acc(mt, t, rr + 2);
        if (bias != nullptr) {
          v0 += __half2float(bias[col + 2 * t]);
          v1 += __half2float(bias[col + 2 * t + 1]);
        }
        *reinterpret_cast<__half2*>(out + static_cast<int64_t>(row) * p.out_stride + col + 2 * t) =
            __floats2half2_rn(v0, v1);
      }
    }
  if (whole) return;
  mark(0);
  const bool last = takes_last_ticket<NAMED ? THREADS : 0>(gp.counters + counter, pieces);
  mark(1);
  if (!last) return;
  add_split_partials<THREADS, BN, 8 * M_TILES>(gp, col_base, pieces);
}

// Calls launch(std::integral_constant<int, M_TILES>, std::integral_constant<int, WARPS>) for
// p's rows (8 M_TILES the fewest that cover them) and warps (both tiled kernels' dispatch).
template <typename Launch>
void dispatch_tiled_shape(const QuantGemmParams& p, Launch&& launch) {
  const auto by_rows = [&](auto warps) {
    if (p.q.m <= 8) {
      launch(std::integral_constant<int, 1>{}, warps);
    } else if (p.q.m <= 16) {
      launch(std::integral_constant<int, 2>{}, warps);
    } else if (p.q.m <= 32) {
      launch(std::integral_constant<int, 4>{}, warps);
    } else {
      launch(std::integral_constant<int, 8>{}, warps);
    }
  };
  if (p.warps == 4) {
    by_rows(std::integral_constant<int, 4>{});
  } else {
    by_rows(std::integral_constant<int, 8>{});
  }
}

// Launches `kernel` (a tiled kernel with `smem` bytes of dynamic shared memory) over p's
// column blocks and splits; `dependent` as a dependent launch (sm_90+).
template <int WARPS>
void launch_tiled_kernel(void (*kernel)(const QuantGemmParams), int smem, const QuantGemmParams& p,
                         cudaStream_t stream, bool dependent) {
  const dim3 grid = p.stream_blocks > 0 ? dim3(p.stream_blocks) : dim3(ceil_div(p.q.n, 32 * WARPS), p.splits);
  const dim3 block(WARPS * kWarpSize);
  if (dependent) {
    AG_LAUNCH_KERNEL_DEPENDENT(kernel, grid, block, smem, stream, p);
  } else {
    AG_LAUNCH_KERNEL(kernel, grid, block, smem, stream, p);
  }
}

template <int M_TILES, int WARPS>
__global__ void __launch_bounds__(WARPS * kWarpSize, tiled_min_warps<M_TILES>() / WARPS) quant_gemm_4bit_tiled_kernel(const QuantGemmParams gp) {
  using L = TiledLayout<M_TILES, WARPS>;
  constexpr int kThreads = WARPS * kWarpSize;
  constexpr int kRows = 8 * M_TILES;
  constexpr int BN = L::kCols;
  const QuantGemvParams& p = gp.q;
  AG_DYNAMIC_SMEM(smem);
  const TiledPlace at = TiledPlace::of<BN>(gp);
  const int g = at.g, c = at.c, col_base = at.col_base, wc = at.wc, s_begin = at.s_begin, count = at.count;

  const __half* x = static_cast<const __half*>(p.x);
  auto weights_at = [&](int slot) { return reinterpret_cast<uint32_t*>(smem + slot * L::kStageBytes); };
  auto x_at = [&](int slot) { return reinterpret_cast<__half*>(smem + slot * L::kStageBytes + L::kWeightBytes); };
  auto groups_at = [&](int slot) {
    return reinterpret_cast<__half*>(smem + slot * L::kStageBytes + L::kWeightBytes + L::kXBytes);
  };

  // The copies into the ring: the weights' and groups' (TiledWeightCopies), and per stage
  // kXLoads 16-byte pieces of x, its source pointer likewise advanced by one stage a copy.
  TiledWeightCopies<kThreads, BN, L::kWordsPerRow> weight_copies(p, col_base, s_begin);
  constexpr int kXRowsPerPass = kThreads / 8;
  constexpr int kXLoads = (kRows + kXRowsPerPass - 1) / kXRowsPerPass;
  constexpr bool kXWhole = kXLoads * kXRowsPerPass == kRows;  // every thread copies kXLoads rows
  const int x_row = threadIdx.x / 8, x_piece = threadIdx.x % 8;
  const int64_t x_pass = static_cast<int64_t>(kXRowsPerPass) * p.x_stride;
  const __half* x_src = x + static_cast<int64_t>(x_row) * p.x_stride + 8 * x_piece + s_begin * kTiledK;
  const int x_dst = x_row * kTiledK + 8 * (x_piece ^ ((x_row & 1) << 2));  // rows x_row + 4 W j: same parity
  uint32_t x_ok = 0;  // bit j: row x_row + j * kXRowsPerPass is a row of x
#pragma unroll
  for (int j = 0; j < kXLoads; ++j) x_ok |= static_cast<uint32_t>(x_row + j * kXRowsPerPass < p.m) << j;

  auto load_weights = [&](int slot) { weight_copies.copy(weights_at(slot), groups_at(slot)); };
  // The next stage's x into `slot` (rows past x's are zero-filled from x's first row).
  auto load_x = [&](int slot) {
    __half* xs = x_at(slot);
#pragma unroll
    for (int j = 0; j < kXLoads; ++j) {
      if (kXWhole || x_row + j * kXRowsPerPass < kRows) {
        const bool ok = (x_ok >> j) & 1;
        cp_async16(xs + x_dst + j * kXRowsPerPass * kTiledK, ok ? x_src + j * x_pass : x, ok);
      }
    }
    x_src += kTiledK;
  };

  // Prologue: the weights of the first STAGES - 1 stages are requested before the wait for
  // the kernel ahead (a dependent launch), x after it. Each load is its own commit group:
  // stage i's x is group STAGES - 1 + i, so after the first STAGES - 1 + i + 1 groups have
  // landed (cp_async_wait<STAGES - 2> once 2 (STAGES - 1) + i are committed) stage i is in.
#pragma unroll
  for (int i = 0; i < kTiledStages - 1; ++i) {
    if (i < count) load_weights(i);
    cp_async_commit();
  }
  grid_dependency_wait();
  launch_dependents();
#pragma unroll
  for (int i = 0; i < kTiledStages - 1; ++i) {
    if (i < count) load_x(i);
    cp_async_commit();
  }

  float acc[M_TILES][2][4];
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[mt][t][r] = 0.f;

  for (int i = 0; i < count; ++i) {
    cp_async_wait<kTiledStages - 2>();
    // Each thread puts the x pieces it copied for stage i into the order B wants (its own
    // copies are visible to it after the wait; the barrier then shows them to every warp):
    // 8 halves e0..e7 become (e0, e4), (e1, e5), (e2, e6), (e3, e7), the two registers of
    // k-step 0 then those of k-step 1, once per block rather than in every warp.
    {
      __half* xs = x_at(i % kTiledStages);
#pragma unroll
      for (int j = 0; j < kXLoads; ++j) {
        if (kXWhole || x_row + j * kXRowsPerPass < kRows) {
          uint4* v = reinterpret_cast<uint4*>(xs + x_dst + j * kXRowsPerPass * kTiledK);
          const uint4 e = *v;
          *v = pair_halves(e);
        }
      }
    }
    __syncthreads();  // stage i is in for every thread, and every warp is done with slot (i - 1) % STAGES
    const int next = i + kTiledStages - 1;
    if (next < count) {
      load_weights(next % kTiledStages);
      load_x(next % kTiledStages);
    }
    cp_async_commit();

    const int slot = i % kTiledStages;
    const uint32_t* w = weights_at(slot);
    const __half* xs = x_at(slot);
    const __half* gs = groups_at(slot);
    const QuantGroup grp = make_group(*reinterpret_cast<const uint2*>(gs + wc),
                                      *reinterpret_cast<const uint2*>(gs + BN + wc));
#pragma unroll
    for (int ch = 0; ch < kTiledChunks; ++ch) {
      const uint4 wv = *reinterpret_cast<const uint4*>(w + (4 * ch + c) * L::kWordsPerRow + wc);
      const uint32_t words[4] = {wv.x, wv.y, wv.z, wv.w};
      uint32_t d[4][4];
#pragma unroll
      for (int j = 0; j < 4; ++j) dequant_word<true, true>(d[j], words[j], grp, j);
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt) {
        const int r = 8 * mt + g;
        const int piece = (4 * ch + c) ^ ((r & 1) << 2);
        const uint4 xv = *reinterpret_cast<const uint4*>(xs + r * kTiledK + 8 * piece);
#pragma unroll
        for (int step = 0; step < 2; ++step) {
          // B for k-step 0: elements (0, 4), (1, 5) of the lane's 8; k-step 1: (2, 6), (3, 7),
          // already paired in shared memory.
          const uint32_t b[2] = {step == 0 ? xv.x : xv.z, step == 0 ? xv.y : xv.w};
#pragma unroll
          for (int t = 0; t < 2; ++t) {
            const uint32_t a[4] = {d[2 * t][2 * step], d[2 * t + 1][2 * step], d[2 * t][2 * step + 1],
                                   d[2 * t + 1][2 * step + 1]};
            mma_m16n8k16<__half>(acc[mt][t], a, b);
          }
        }
      }
    }
  }
  cp_async_wait<0>();

  store_tiled_result<M_TILES, kThreads, BN>(gp, col_base, wc, c, blockIdx.y, gp.splits, blockIdx.x,
                                           [&](int mt, int t, int r) { return acc[mt][t][r]; });
}

// Returns false where the kernel does not take `p` (quant_gemm_4bit_ok). `dependent`
// (sm_90+): launched so that it may start while the kernel ahead of it runs; it requests
// its first weights, then waits for x.
inline bool launch_quant_gemm_4bit(const QuantGemmParams& p, cudaStream_t stream, bool dependent = false) {
  if (!quant_gemm_4bit_ok(p)) return false;
  dispatch_tiled_shape(p, [&](auto m_tiles, auto warps) {
    constexpr int M_TILES = decltype(m_tiles)::value, WARPS = decltype(warps)::value;
    constexpr int smem = TiledLayout<M_TILES, WARPS>::kSmemBytes;
    if (smem > 48 * 1024) allow_dynamic_smem<quant_gemm_4bit_tiled_kernel<M_TILES, WARPS>>(smem);
    launch_tiled_kernel<WARPS>(quant_gemm_4bit_tiled_kernel<M_TILES, WARPS>, smem, p, stream, dependent);
  });
  return true;
}

}  // namespace asyncgen
