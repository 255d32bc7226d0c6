// 4-bit GEMV at one row with the weights stored a column at a time.
//
// y[n] = sum_k x[k] * (code[n, k] - z[n, g]) * s[n, g] (+ bias[n]),  g = k / group_size
//
// Layout ("columns"): qcol [N, K / 8] int32, the K codes of output n contiguous. Word j of
// column n holds k = 8j .. 8j + 7 with the codes placed so that the 0x6400 trick of
// dot_word (gemv.cuh) yields them in x's natural pairs: fields (0, 4) hold k (0, 1),
// fields (1, 5) k (2, 3), fields (2, 6) k (4, 5), fields (3, 7) k (6, 7). zs [N, G] holds
// (z, s) as a half2 per column and group.
//
// Why a second layout: in the checkpoint's layout ([K / 8, N], packed along K) a 128-byte
// line holds 32 columns' codes for 8 values of k, so a block must own at least 32 columns
// and all of K (64 KiB at K = 4096) unless it splits K across blocks; a 7B q|k|v then
// gives 384 blocks, about 3 an SM, 12 warps. Here a column is 2 KiB (K = 4096), so a
// block of 8 warps owns 8-16 columns and the product launches thousands of short warps,
// as the dense GEMV does, with each lane's loads all issued at once.
//
// gated (gate|up of an MLP, columns gate | up, N / 2 each): a block's two column sets are
// gate columns j .. j + COLS - 1 and the up columns N / 2 further on, and it writes
// silu(gate) * up [N / 2], each product rounded as its output is.
//
// The block: SPLIT warps share a column set's K (lane l of warp part p takes 16-byte
// vectors p * 32 + l + i * 32 * SPLIT, i < STEPS), and kWarps / SPLIT column sets of COLS
// columns each. A lane keeps its x vectors in registers for all its columns. Each lane
// issues all COLS * STEPS weight loads and their group constants before it waits for x
// (programmatic dependent launch), then multiplies; the COLS sums of a warp are reduced
// with a transposing butterfly (COLS - 1 + log2(32 / COLS) shuffles in all), and the SPLIT
// parts of a column in shared memory.
#pragma once

#include <cstdlib>
#include <string>

#include "gemv.cuh"

namespace asyncgen {

struct QuantGemvColumnsParams {
  __half* out;            // [N]
  const __half* x;        // [K]
  const int32_t* qcol;    // [N, K / 8]
  const uint32_t* zs;     // [N, G] half2 (z, s)
  const __half* bias;     // [N] or null
  int n, k, group_size;
  int gated;
  int late_signal;  // let the kernel after this one launch only once the products are done
};

template <int SPLIT, int COLS, int STEPS, int THREADS, bool GATED, int MIN_BLOCKS = 1>
__global__ void __launch_bounds__(THREADS, MIN_BLOCKS) quant_gemv_columns_kernel(const QuantGemvColumnsParams p) {
  constexpr int kWarps = THREADS / kWarpSize;
  static_assert(kWarps % SPLIT == 0 && kWarpSize % COLS == 0);
  constexpr int kSets = kWarps / SPLIT;
  static_assert(!GATED || kSets == 2, "a gated block is one gate and one up column set");
  constexpr int kBlockCols = kSets * COLS;
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int part = warp % SPLIT;
  const int set = warp / SPLIT;
  // Gated: set 0 holds gate columns, set 1 the up columns N / 2 further on; columns past
  // N / 2 in set 0 (and so past N in set 1) are not read.
  const int half_n = p.n / 2;
  const int col0 = GATED ? set * half_n + blockIdx.x * COLS : blockIdx.x * kBlockCols + set * COLS;
  const int col_end = GATED ? (set + 1) * half_n : p.n;
  const int vecs = p.k / 32;  // 16-byte vectors a column
  const int words = p.k / 8;
  const int groups = p.k / p.group_size;

  uint4 w[COLS][STEPS];
  uint32_t zs[COLS][STEPS];
#pragma unroll
  for (int c = 0; c < COLS; ++c) {
    const int n = col0 + c;
#pragma unroll
    for (int i = 0; i < STEPS; ++i) {
      const int v = part * kWarpSize + lane + i * kWarpSize * SPLIT;
      const bool live = n < col_end && v < vecs;
      w[c][i] = live ? load16(p.qcol + static_cast<int64_t>(n) * words + 4 * v) : make_uint4(0, 0, 0, 0);
      zs[c][i] = live ? p.zs[static_cast<int64_t>(n) * groups + (32 * v) / p.group_size] : 0u;
    }
  }
  grid_dependency_wait();
  if (!p.late_signal) launch_dependents();
  uint4 xv[STEPS][4];
#pragma unroll
  for (int i = 0; i < STEPS; ++i) {
    const int v = part * kWarpSize + lane + i * kWarpSize * SPLIT;
#pragma unroll
    for (int j = 0; j < 4; ++j) xv[i][j] = v < vecs ? load16(p.x + 32 * v + 8 * j) : make_uint4(0, 0, 0, 0);
  }

  __shared__ uint32_t masks[3];
  if (threadIdx.x == 0) {
    masks[0] = 0x000F000Fu;
    masks[1] = 0x00F000F0u;
    masks[2] = 0x64006400u;
  }
  __syncthreads();
  const uint32_t m_lo = masks[0], m_hi = masks[1], magic = masks[2];
  const __half2 sixty_four = bits_to_half2(0x54005400u);

  float sum[COLS];
#pragma unroll
  for (int c = 0; c < COLS; ++c) {
    float t = 0.f;
#pragma unroll
    for (int i = 0; i < STEPS; ++i) {
      const __half2 zs2 = bits_to_half2(zs[c][i]);
      const __half2 z2 = __low2half2(zs2);
      const __half2 low = __hadd2(z2, bits_to_half2(magic));
      const __half2 high = __hneg2(__hadd2(z2, sixty_four));
      __half2 a = dot_word(w[c][i].x, xv[i][0], low, high, __float2half2_rn(0.f), m_lo, m_hi, magic);
      a = dot_word(w[c][i].y, xv[i][1], low, high, a, m_lo, m_hi, magic);
      __half2 b = dot_word(w[c][i].z, xv[i][2], low, high, __float2half2_rn(0.f), m_lo, m_hi, magic);
      b = dot_word(w[c][i].w, xv[i][3], low, high, b, m_lo, m_hi, magic);
      const float2 fa = __half22float2(a), fb = __half22float2(b);
      t = fmaf(__high2float(zs2), (fa.x + fa.y) + (fb.x + fb.y), t);
    }
    sum[c] = t;
  }
  if (p.late_signal) launch_dependents();

  // Transposing butterfly: at offset 16 a lane keeps half of its sums (the upper half if
  // its bit 4 is set) and adds its partner's copy of them; and so on until one sum is left,
  // then plain butterflies. Lane l then holds column col_of(l)'s warp sum.
  int width = COLS;
  int col = 0;
#pragma unroll
  for (int off = kWarpSize / 2; off >= 1; off >>= 1) {
    if (width > 1) {
      const int half = width / 2;
      const bool upper = (lane & off) != 0;
#pragma unroll
      for (int j = 0; j < half; ++j) {
        const float send = upper ? sum[j] : sum[j + half];
        const float keep = upper ? sum[j + half] : sum[j];
        sum[j] = keep + __shfl_xor_sync(kFullMask, send, off);
      }
      if (upper) col += half;
      width = half;
    } else {
      sum[0] += __shfl_xor_sync(kFullMask, sum[0], off);
    }
  }
  __shared__ float partial[kWarps][COLS];
  if ((lane & (kWarpSize / COLS - 1)) == 0) partial[warp][col] = sum[0];
  __syncthreads();
  if constexpr (!GATED) {
    if (threadIdx.x < kBlockCols) {
      const int s = threadIdx.x / COLS, c = threadIdx.x % COLS;
      const int n = blockIdx.x * kBlockCols + threadIdx.x;
      if (n < p.n) {
        float v = 0.f;
#pragma unroll
        for (int q = 0; q < SPLIT; ++q) v += partial[s * SPLIT + q][c];
        if (p.bias != nullptr) v += __half2float(p.bias[n]);
        p.out[n] = __float2half_rn(v);
      }
    }
  } else {
    const int c = threadIdx.x;
    const int j = blockIdx.x * COLS + c;
    if (c < COLS && j < half_n) {
      float gate = 0.f, up = 0.f;
#pragma unroll
      for (int q = 0; q < SPLIT; ++q) {
        gate += partial[q][c];
        up += partial[SPLIT + q][c];
      }
      if (p.bias != nullptr) {
        gate += __half2float(p.bias[j]);
        up += __half2float(p.bias[half_n + j]);
      }
      p.out[j] = __float2half_rn(silu_times<__half>(round_to<__half>(gate), round_to<__half>(up)));
    }
  }
}

template <int SPLIT, int COLS, int STEPS, int THREADS, bool GATED = false>
void launch_quant_gemv_columns_shaped(const QuantGemvColumnsParams& p, cudaStream_t stream, bool dependent,
                                      bool half_occupancy = false) {
  void (*kernel)(const QuantGemvColumnsParams) = quant_gemv_columns_kernel<SPLIT, COLS, STEPS, THREADS, GATED>;
  if (STEPS == 1 && half_occupancy) {
    kernel = quant_gemv_columns_kernel<SPLIT, COLS, STEPS, THREADS, GATED, 1024 / THREADS>;
  }
  constexpr int kBlockCols = THREADS / kWarpSize / SPLIT * COLS;
  const dim3 grid(GATED ? ceil_div(p.n / 2, COLS) : ceil_div(p.n, kBlockCols)), block(THREADS);
  if (dependent) {
    AG_LAUNCH_KERNEL_DEPENDENT(kernel, grid, block, 0, stream, p);
  } else {
    AG_LAUNCH_KERNEL(kernel, grid, block, 0, stream, p);
  }
}

// The most K the launcher takes: 4 K parts of 32 lanes, 4 steps of 32 values a lane.
constexpr int kColumnsMaxK = 4 * kWarpSize * 4 * 32;

// Whether launch_quant_gemv_columns takes p: K a multiple of 32 up to kColumnsMaxK, the
// group size a multiple of 32 dividing K (a lane's 32 values share one group), and gated
// an even N.
inline bool quant_gemv_columns_ok(const QuantGemvColumnsParams& p) {
  return p.k > 0 && p.k % 32 == 0 && p.k <= kColumnsMaxK && p.group_size > 0 && p.group_size % 32 == 0 &&
         p.k % p.group_size == 0 && p.n > 0 && (!p.gated || p.n % 2 == 0);
}

template <int STEPS>
void launch_quant_gemv_columns_steps(const QuantGemvColumnsParams& p, cudaStream_t stream, bool dependent) {
  static const bool half = [] {
    const char* v = std::getenv("ASYNCGEN_COLUMNS_OCCUPANCY");
    return v != nullptr && std::string(v) == "half";
  }();
  if (p.gated) {
    launch_quant_gemv_columns_shaped<4, 8, STEPS, 256, true>(p, stream, dependent, half);
  } else if (STEPS == 1 && p.n >= 16384) {
    launch_quant_gemv_columns_shaped<4, 8, STEPS, 128>(p, stream, dependent, half);
  } else if (STEPS == 1 && p.n >= 8192) {
    launch_quant_gemv_columns_shaped<4, 8, STEPS, 256>(p, stream, dependent, half);
  } else {
    launch_quant_gemv_columns_shaped<4, 4, STEPS, 256>(p, stream, dependent, half);
  }
}

// The block shapes, timed on an H200 at the 7B shapes (benchmarks/gemv_columns.py): 4 K
// parts; 8 columns a warp for wide layers at K <= 4096 (q|k|v in blocks of 256 threads,
// gate|up of 128), else 4. Returns false where quant_gemv_columns_ok does not hold.
inline bool launch_quant_gemv_columns(const QuantGemvColumnsParams& p, cudaStream_t stream, bool dependent) {
  if (!quant_gemv_columns_ok(p)) return false;
  switch (ceil_div(p.k / 32, 4 * kWarpSize)) {
    case 1: launch_quant_gemv_columns_steps<1>(p, stream, dependent); break;
    case 2: launch_quant_gemv_columns_steps<2>(p, stream, dependent); break;
    case 3: launch_quant_gemv_columns_steps<3>(p, stream, dependent); break;
    default: launch_quant_gemv_columns_steps<4>(p, stream, dependent); break;
  }
  return true;
}

}  // namespace asyncgen
