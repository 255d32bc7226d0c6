// Matrix-vector products for decode at small batch (M <= 8 rows of activations): one
// pass over the weights, which is the whole cost at this size.
//
// dense_gemv        y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n])     W [N, K] fp16/bf16
// quant_gemv_4bit   y[m, n] = sum_k x[m, k] * (code[k, n] - z[g, n]) * s[g, n] (+ bias[n])
//                   g = k / group_size; codes packed along K, 8 to an int32 word:
//                   qweight [K / 8, N], field i (bits 4i..4i+3) of word j = row 8j + i;
//                   scales and zeros [G, N] fp16 (zeros unpacked, as floats).
//
// dense_gemv: a warp per output feature; each lane reads 16-byte vectors of the weight
// row (8 elements) strided by the warp, several in flight at once, multiplies them with
// the same 8 elements of each x row in fp32, and the warp reduces at the end. For a
// 4096 x 4096 fp16 weight that is 4096 warps streaming 8 KiB each: enough work to keep
// every SM's loads in flight, where a cuBLAS GEMM sized for M = 1 may launch only a few
// dozen CTAs (measured on an H200: 28 us for o_proj against a 7.8 us bandwidth floor).
// With warps_per_row = 2, 4 or 8 that many warps of a block share each row, taking its
// 2 KiB chunks in turn, and add their sums through shared memory. One warp a row gets
// to 64-91 % of the H200's read bandwidth at the 7B shapes, four 76-98 % (see
// docs/BENCHMARKS.md): a warp waits for each batch of its loads before it issues the
// next, so more warps a row keep more bytes in flight, and the launch's last wave is a
// smaller share of it.
//
// Each chunk's loads (the weights, and x for up to 2 rows) are issued together before
// its products: loaded vector by vector, x cost an L1 round trip per vector, and at one
// row the products took 3-13 % longer (down_proj 24.8 against 21.7 us; docs/BENCHMARKS.md).
//
// gated (gate|up of an MLP, weight rows gate | up): a block holds gate row j and up row
// N / 2 + j together, and writes silu(gate) * up, rounded as the separate ops round it,
// so the SiLU-and-multiply kernel between gate|up and down_proj goes.
//
// quant_gemv_4bit: a block covers 4 * AG_QGEMV_COL_THREADS output columns, its other
// threads split K. A column thread loads 16 bytes of one packed row: 4 words, i.e. 8 rows
// of K for each of 4 adjacent columns; 8 such threads read one 128-byte line. Each K lane
// walks its own contiguous range of packed rows (so it reloads a group's scale and zero
// only when the group changes), with the next batch of rows loading while it computes
// the current one. Dequantization works on half2 pairs: OR-ing 0x6400 into the fp16 bit
// pattern of a 4-bit code c gives 1024 + c exactly, and (word >> 4j) & 0x000F000F holds
// codes j and j + 4 of a word in the two halves, so one subtraction of (1024 + z) gives
// c - z exactly for two weights. The products with x of a word's 8 codes are added in a
// half2 (4 fused multiply-adds), then scaled by the group's scale into an fp32
// accumulator: sum_k x_k (c_k - z) s = s * sum_k x_k (c_k - z). K lanes in a warp are
// reduced with shuffles, across warps in shared memory.
//
// Napkin math for Llama-2-7B at M = 1, 4-bit group 128: 3.3 GB of codes + 0.1 GB of
// scales and zeros a token, ~0.8 ms at 4.3 TB/s; the ALU side is ~3 instructions per
// weight (~0.6 ms of the CUDA cores), so the two overlap to roughly the memory time.
#pragma once

#include <cstring>

#include "common.cuh"

namespace asyncgen {

constexpr int kGemvMaxRows = 8;
constexpr int kGemvThreads = 256;

struct DenseGemvParams {
  void* out;           // [M, N] ([M, N / 2] gated)
  const void* x;       // [M, K]
  const void* weight;  // [N, K]
  const void* bias;    // [N] or null
  int64_t out_stride, x_stride, weight_stride;
  int m, n, k;
  int warps_per_row;  // 1, 2, 4 or 8 (0: 1)
  bool gated;         // out[m, j] = silu(y[m, j]) * y[m, N / 2 + j]; at most 4 warps a row
};

struct QuantGemvParams {
  void* out;              // [M, N] fp16
  const void* x;          // [M, K] fp16
  const int32_t* qweight;  // [K / 8, N]
  const void* scales;     // [G, N] fp16
  const void* zeros;      // [G, N] fp16
  const void* bias;       // [N] fp16 or null
  int64_t out_stride, x_stride, qweight_stride, scales_stride, zeros_stride;
  int m, n, k, group_size;
  // Gate | up of an MLP (columns gate | up, N / 2 each): out [M, N / 2] = silu(y[:, j]) *
  // y[:, N / 2 + j], rounded as the separate ops round it. One row, the one-row kernel only.
  int gated;
};

// ---------------------------------------------------------------------------------------
// dense

constexpr int kDenseUnroll = 4;

template <typename T, int ROWS, int SPLIT, bool GATED>
__global__ void __launch_bounds__(kGemvThreads) dense_gemv_kernel(const DenseGemvParams p) {
  constexpr int kWarps = kGemvThreads / kWarpSize;
  constexpr int kBlockRows = kWarps / SPLIT;  // weight rows of a block
  static_assert(!GATED || kBlockRows % 2 == 0, "a gated block holds gate and up rows in pairs");
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int part = warp % SPLIT;   // which of the row's SPLIT warps this is
  const int local = warp / SPLIT;  // which of the block's rows
  int row;                         // weight row (output feature of the product)
  bool active;
  if constexpr (GATED) {
    // Block b holds gate rows j and up rows N / 2 + j for its kBlockRows / 2 values of j.
    constexpr int kPairs = kBlockRows / 2;
    const int j = blockIdx.x * kPairs + local % kPairs;
    active = j < p.n / 2;
    row = local < kPairs ? j : p.n / 2 + j;
  } else {
    row = blockIdx.x * kBlockRows + local;
    active = row < p.n;
  }
  if (SPLIT == 1 && !GATED && !active) return;  // a whole warp leaves together (no barrier below)
  const T* w = static_cast<const T*>(p.weight) + static_cast<int64_t>(active ? row : 0) * p.weight_stride;
  const int num_vecs = active ? p.k / 8 : 0;
  // Part j takes chunks j, j + SPLIT, ... of kWarpSize * kDenseUnroll vectors.
  const int first = lane + part * kWarpSize * kDenseUnroll;
  constexpr int kStride = SPLIT * kWarpSize * kDenseUnroll;
  float acc[ROWS];
#pragma unroll
  for (int m = 0; m < ROWS; ++m) acc[m] = 0.f;

  uint4 raw[kDenseUnroll];
  auto load_weights = [&](int base) {
#pragma unroll
    for (int u = 0; u < kDenseUnroll; ++u) {
      const int v = base + u * kWarpSize;
      raw[u] = v < num_vecs ? load16(w + 8 * v) : make_uint4(0, 0, 0, 0);
    }
  };
  // The first weights are requested before x is waited for: launched as a dependent (see
  // launch_dense_gemv), this overlaps the kernel ahead, which computes x.
  load_weights(first);
  grid_dependency_wait();
  launch_dependents();  // the kernel after this one may start and wait for its output
  const T* x = static_cast<const T*>(p.x);
  for (int base = first; base < num_vecs; base += kStride) {
    if (base != first) load_weights(base);
    // All of the chunk's x loads are issued before its first product (up to 2 rows; from
    // 4 on their registers would not fit): one L1/L2 round trip a chunk, not one a vector.
    // Past the row's end they are predicated off and give zeros, as the weights do.
    constexpr bool kPrefetchX = ROWS <= 2;
    uint4 xr[kDenseUnroll][kPrefetchX ? ROWS : 1];
    if constexpr (kPrefetchX) {
#pragma unroll
      for (int u = 0; u < kDenseUnroll; ++u) {
        const int v = base + u * kWarpSize;
#pragma unroll
        for (int m = 0; m < ROWS; ++m) {
          xr[u][m] = v < num_vecs && m < p.m ? load16(x + m * p.x_stride + 8 * v) : make_uint4(0, 0, 0, 0);
        }
      }
#ifdef __CUDA_ARCH__
      asm volatile("" ::: "memory");  // keeps the compiler from sinking those loads into the products
#endif
    }
#pragma unroll
    for (int u = 0; u < kDenseUnroll; ++u) {
      const int v = base + u * kWarpSize;
      float wf[8];
      Float8<T>::unpack(raw[u], wf);
#pragma unroll
      for (int m = 0; m < ROWS; ++m) {
        if (kPrefetchX || m < p.m) {
          float xf[8];
          if constexpr (kPrefetchX) {
            Float8<T>::unpack(xr[u][m], xf);
          } else {
            Float8<T>::unpack(v < num_vecs ? load16(x + m * p.x_stride + 8 * v) : make_uint4(0, 0, 0, 0), xf);
          }
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[m] = fmaf(xf[i], wf[i], acc[m]);
        }
      }
    }
  }
#pragma unroll
  for (int m = 0; m < ROWS; ++m) acc[m] = warp_sum(acc[m]);
  if constexpr (SPLIT > 1) {  // the row's warps add their sums in part order
    __shared__ float partial[kWarps][ROWS];
    if (lane == 0) {
#pragma unroll
      for (int m = 0; m < ROWS; ++m) partial[warp][m] = acc[m];
    }
    __syncthreads();
    if (part == 0) {
#pragma unroll
      for (int m = 0; m < ROWS; ++m) {
        for (int j = 1; j < SPLIT; ++j) acc[m] += partial[warp + j][m];
      }
    }
  }
  // The first lane of each row's first warp holds the row's sums.
  const bool writes = part == 0 && lane == 0 && active;
  const float b = writes && p.bias != nullptr ? to_float(static_cast<const T*>(p.bias)[row]) : 0.f;
  T* out = static_cast<T*>(p.out);
  if constexpr (!GATED) {
    if (writes) {
#pragma unroll
      for (int m = 0; m < ROWS; ++m) {
        if (m < p.m) out[m * p.out_stride + row] = from_float<T>(acc[m] + b);
      }
    }
  } else {
    // Each row's y (rounded to T as the product's output is) goes to shared memory; then
    // a thread per (j, m) writes silu(gate) * up.
    __shared__ float result[kBlockRows][ROWS];
    if (writes) {
#pragma unroll
      for (int m = 0; m < ROWS; ++m) result[local][m] = round_to<T>(acc[m] + b);
    }
    __syncthreads();
    constexpr int kPairs = kBlockRows / 2;
    static_assert(kPairs * ROWS <= kGemvThreads);
    const int pair = threadIdx.x / ROWS, m = threadIdx.x % ROWS;
    const int j = blockIdx.x * kPairs + pair;
    if (pair < kPairs && m < p.m && j < p.n / 2) {
      out[m * p.out_stride + j] = from_float<T>(silu_times<T>(result[pair][m], result[kPairs + pair][m]));
    }
  }
}

// dependent (sm_90+): launched so that it may start while the kernel ahead of it runs;
// it requests its first weights, then waits for x.
template <typename T, int SPLIT, bool GATED>
void (*dense_gemv_kernel_for(int m))(const DenseGemvParams) {
  if (m <= 1) return dense_gemv_kernel<T, 1, SPLIT, GATED>;
  if (m <= 2) return dense_gemv_kernel<T, 2, SPLIT, GATED>;
  if (m <= 4) return dense_gemv_kernel<T, 4, SPLIT, GATED>;
  if (m <= kGemvMaxRows) return dense_gemv_kernel<T, 8, SPLIT, GATED>;
  return nullptr;
}

template <typename T, bool GATED>
void (*dense_gemv_kernel_for_split(int split, int m))(const DenseGemvParams) {
  switch (split) {
    case 1: return dense_gemv_kernel_for<T, 1, GATED>(m);
    case 2: return dense_gemv_kernel_for<T, 2, GATED>(m);
    case 4: return dense_gemv_kernel_for<T, 4, GATED>(m);
    case 8:
      if constexpr (GATED) {
        return nullptr;  // one row a block: no room for a gate row and its up row
      } else {
        return dense_gemv_kernel_for<T, 8, false>(m);
      }
    default: return nullptr;
  }
}

// Returns false where no kernel takes the launch: more than kGemvMaxRows rows, a
// warps_per_row other than 0/1/2/4/8, or gated with 8 warps a row or an odd N.
template <typename T>
bool launch_dense_gemv(const DenseGemvParams& p, cudaStream_t stream, bool dependent = false) {
  const int split = p.warps_per_row <= 1 ? 1 : p.warps_per_row;
  if (p.gated && p.n % 2 != 0) return false;
  void (*kernel)(const DenseGemvParams) =
      p.gated ? dense_gemv_kernel_for_split<T, true>(split, p.m) : dense_gemv_kernel_for_split<T, false>(split, p.m);
  if (kernel == nullptr) return false;
  const int rows_per_block = kGemvThreads / kWarpSize / split;
  const int blocks = p.gated ? ceil_div(p.n / 2, rows_per_block / 2) : ceil_div(p.n, rows_per_block);
  const dim3 grid(blocks), block(kGemvThreads);
  if (dependent) {
    AG_LAUNCH_KERNEL_DEPENDENT(kernel, grid, block, 0, stream, p);
  } else {
    AG_LAUNCH_KERNEL(kernel, grid, block, 0, stream, p);
  }
  return true;
}

// ---------------------------------------------------------------------------------------
// 4-bit

// The block's shape: COL_THREADS column threads (4 columns each) by 256 / COL_THREADS K
// lanes; UNROLL packed rows per load batch. Timed on an H200 (benchmarks/gemv_variants.py,
// which compiles variants with AG_QGEMV_COL_THREADS / AG_QGEMV_UNROLL set to force one):
// 8 column threads were faster for wide layers (N >= 8192, q|k|v and gate|up of a 7B
// model: 256+ blocks), 4 for narrow ones (o, down: more K lanes and blocks), 4 rows a
// batch in both.
#ifndef AG_QGEMV_LOAD  // how the packed weights are read: 0 plain, 1 read-only path, 2 streaming
#define AG_QGEMV_LOAD 2
#endif
constexpr int kQuantWarps = kGemvThreads / kWarpSize;
constexpr int kQuantWideN = 8192;  // from this many columns on, the wide block shape

// fma on half2: the hardware instruction on the GPU; elsewhere (the CPU emulation) the
// same product and sum in fp32, rounded once.
AG_DEVICE __half2 hfma2(__half2 a, __half2 b, __half2 c) {
#ifdef __CUDA_ARCH__
  return __hfma2(a, b, c);
#else
  const float2 fa = __half22float2(a), fb = __half22float2(b), fc = __half22float2(c);
  return __floats2half2_rn(fa.x * fb.x + fc.x, fa.y * fb.y + fc.y);
#endif
}

AG_DEVICE __half2 bits_to_half2(uint32_t bits) {
  __half2 h;
  static_assert(sizeof(h) == sizeof(bits));
  memcpy(&h, &bits, sizeof(bits));
  return h;
}

AG_DEVICE uint32_t half2_to_bits(__half2 h) {
  uint32_t bits;
  memcpy(&bits, &h, sizeof(bits));
  return bits;
}

AG_DEVICE uint4 load_weights16(const int32_t* ptr) {
#if defined(__CUDA_ARCH__) && AG_QGEMV_LOAD == 1
  return __ldg(reinterpret_cast<const uint4*>(ptr));
#elif defined(__CUDA_ARCH__) && AG_QGEMV_LOAD == 2
  return __ldcs(reinterpret_cast<const uint4*>(ptr));
#else
  return load16(ptr);
#endif
}

// Loads packed rows base .. base + UNROLL - 1 (those below row_end) of 4 columns.
template <int UNROLL>
AG_DEVICE void load_rows(uint4 (&words)[UNROLL], const QuantGemvParams& p, int base, int row_end, int col0) {
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const int r = base + u;
    words[u] = r < row_end ? load_weights16(p.qweight + static_cast<int64_t>(r) * p.qweight_stride + col0)
                           : make_uint4(0, 0, 0, 0);
  }
}

template <int ROWS, int COL_THREADS, int UNROLL>
__global__ void __launch_bounds__(kGemvThreads) quant_gemv_4bit_kernel(const QuantGemvParams p) {
  static_assert(COL_THREADS >= 1 && COL_THREADS <= kWarpSize && kWarpSize % COL_THREADS == 0);
  constexpr int kQuantColThreads = COL_THREADS;
  constexpr int kQuantCols = 4 * COL_THREADS;                 // columns per block
  constexpr int kQuantKLanes = kGemvThreads / COL_THREADS;    // K lanes per block
  constexpr int kQuantUnroll = UNROLL;
  __shared__ float partial[kQuantWarps][ROWS][kQuantCols];
  const int col_thread = threadIdx.x % kQuantColThreads;
  const int k_lane = threadIdx.x / kQuantColThreads;
  const int col0 = blockIdx.x * kQuantCols + 4 * col_thread;  // this thread's 4 columns
  const bool active = col0 < p.n;                             // n % 4 == 0 (checked by the glue)
  const int num_rows = p.k / 8;                                // packed rows
  const int rows_per_lane = ceil_div(num_rows, kQuantKLanes);
  const int row_begin = k_lane * rows_per_lane;
  const int row_end = active ? imin(row_begin + rows_per_lane, num_rows) : row_begin;
  const __half* x = static_cast<const __half*>(p.x);
  const __half* scales = static_cast<const __half*>(p.scales);
  const __half* zeros = static_cast<const __half*>(p.zeros);

  float acc[ROWS][4];
#pragma unroll
  for (int m = 0; m < ROWS; ++m)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[m][c] = 0.f;

  const __half2 magic = bits_to_half2(0x64006400u);  // (1024, 1024)
  const int rows_per_group = p.group_size / 8;
  int group = -1;
  int group_end = row_begin;  // first packed row past the loaded group
  float s[4];     // per column: the group's scale
  __half2 z2[4];  // per column: (1024 + z, 1024 + z)
  // Two batches of rows in registers: the next one is loading while this one computes.
  uint4 words[kQuantUnroll], next[kQuantUnroll];
  load_rows(words, p, row_begin, row_end, col0);
  for (int base = row_begin; base < row_end; base += kQuantUnroll) {
    if (base + kQuantUnroll < row_end) load_rows(next, p, base + kQuantUnroll, row_end, col0);
#pragma unroll
    for (int u = 0; u < kQuantUnroll; ++u) {
      const int r = base + u;
      if (r >= row_end) break;
      if (r >= group_end) {  // entering a new group (always at the first row)
        const int g = group < 0 ? r / rows_per_group : group + 1;
        group = g;
        group_end = (g + 1) * rows_per_group;
        const __half* sp = scales + static_cast<int64_t>(g) * p.scales_stride + col0;
        const __half* zp = zeros + static_cast<int64_t>(g) * p.zeros_stride + col0;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          s[c] = __half2float(sp[c]);
          z2[c] = __hadd2(__half2half2(zp[c]), magic);
        }
      }
      // x pairs (k + j, k + j + 4), j = 0..3, of each row: the layout of the codes below.
      __half2 xp[ROWS][4];
#pragma unroll
      for (int m = 0; m < ROWS; ++m) {
        if (m < p.m) {
          const uint4 raw = load16(x + m * p.x_stride + 8 * r);
          const __half* h = reinterpret_cast<const __half*>(&raw);
#pragma unroll
          for (int j = 0; j < 4; ++j) xp[m][j] = __halves2half2(h[j], h[j + 4]);
        } else {
#pragma unroll
          for (int j = 0; j < 4; ++j) xp[m][j] = __float2half2_rn(0.f);
        }
      }
      const uint32_t wv[4] = {words[u].x, words[u].y, words[u].z, words[u].w};
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        __half2 d[4];  // code - z, exact
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          d[j] = __hsub2(bits_to_half2(((wv[c] >> (4 * j)) & 0x000F000Fu) | 0x64006400u), z2[c]);
        }
#pragma unroll
        for (int m = 0; m < ROWS; ++m) {
          __half2 sum = __float2half2_rn(0.f);
#pragma unroll
          for (int j = 0; j < 4; ++j) sum = hfma2(d[j], xp[m][j], sum);
          const float2 f = __half22float2(sum);
          acc[m][c] = fmaf(s[c], f.x + f.y, acc[m][c]);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kQuantUnroll; ++u) words[u] = next[u];
  }

  // Reduce over the K lanes of a warp (lanes that differ in the bits above the column
  // thread's), then over the warps.
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
#pragma unroll
  for (int m = 0; m < ROWS; ++m)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const float v = warp_sum<kQuantColThreads>(acc[m][c]);
      if (lane < kQuantColThreads) partial[warp][m][4 * lane + c] = v;
    }
  __syncthreads();
  __half* out = static_cast<__half*>(p.out);
  const __half* bias = static_cast<const __half*>(p.bias);
  for (int i = threadIdx.x; i < ROWS * kQuantCols; i += kGemvThreads) {
    const int m = i / kQuantCols;
    const int col = i % kQuantCols;
    const int n = blockIdx.x * kQuantCols + col;
    if (m >= p.m || n >= p.n) continue;
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < kQuantWarps; ++w) v += partial[w][m][col];
    if (bias != nullptr) v += __half2float(bias[n]);
    out[m * p.out_stride + n] = __float2half_rn(v);
  }
}

template <int COL_THREADS, int UNROLL>
bool launch_quant_gemv_4bit_shaped(const QuantGemvParams& p, cudaStream_t stream) {
  void (*kernel)(const QuantGemvParams) = nullptr;
  if (p.m <= 1) {
    kernel = quant_gemv_4bit_kernel<1, COL_THREADS, UNROLL>;
  } else if (p.m <= 2) {
    kernel = quant_gemv_4bit_kernel<2, COL_THREADS, UNROLL>;
  } else if (p.m <= 4) {
    kernel = quant_gemv_4bit_kernel<4, COL_THREADS, UNROLL>;
  } else if (p.m <= kGemvMaxRows) {
    kernel = quant_gemv_4bit_kernel<8, COL_THREADS, UNROLL>;
  } else {
    return false;
  }
  AG_LAUNCH_KERNEL(kernel, dim3(ceil_div(p.n, 4 * COL_THREADS)), dim3(kGemvThreads), 0, stream, p);
  return true;
}

// ---------------------------------------------------------------------------------------
// 4-bit, one row of x: the streaming kernel
//
// Decode of a single stream multiplies one row. Nsight Compute on an H200 found the
// CUDA-core kernel above issuing about 35 instructions per packed word (12.2 M warp
// instructions for gate|up's 11.3 M words) with 69 registers a thread, which limits an SM
// to 3 of its blocks: half the issue slots busy, and the DRAM 44 % busy. This kernel:
//
// - stages x once per block in shared memory, already in the order the codes come out of
//   a word (packed row r as the half2 pairs (x[8r + j], x[8r + j + 4]), j = 0..3), so a
//   row's x is one 16-byte shared load for 4 columns, with no permutes in the loop; rows
//   sit at slot r + r / 8, so K lanes a multiple of 8 rows apart use different banks;
// - takes a word's 8 codes minus the zero point as 4 half2 with 1 shift, 4 LOP3 (the masks
//   kept in registers: with two immediates the compiler splits each into an AND and an
//   OR) and 4 half2 operations (the 0x6400 trick of dequant_word below, fields j and j + 4
//   in one register), then 4 HFMA2 with x. Two packed rows accumulate in one half2 (8
//   products a half) before it is converted and scaled into the fp32 total: within a
//   group sum_k x_k (c_k - z) s = s * sum_k x_k (c_k - z), and lane ranges start on even
//   rows, so a pair never straddles a group (group_size % 16 == 0);
// - keeps DEPTH pairs of packed rows of its 4 columns in flight per thread with cp.async
//   into a ring in shared memory, which holds no registers while the bytes travel; the
//   first DEPTH pairs are requested before x is staged, and a group's successor's scales
//   and zeros are loaded when the group starts;
// - uses small blocks that each own 4 * COL_THREADS columns and all of K.
//
// At one row on an H200 (per call, weights cycled past L2; gemv_variants.py --rows 1) this
// took q|k|v from 13.1 to 11.1 us, o_proj 6.8 -> 6.0, gate|up 23.1 -> 18.4 and down_proj
// 14.2 -> 11.2 (the best of the CUDA-core and tensor-core kernels before it), 46.7 against
// 57.2 us a layer. A plain read of the same bytes takes 36.6 us (8.5 + 4.5 + 15.1 + 8.5):
// at these sizes (9-48 MB) launch, ramp-up and drain are a large part of any kernel.
// Neither deeper rings (8-16 pairs) nor a layout with each block's columns contiguous in
// memory did better (docs/BENCHMARKS.md).
#ifndef AG_QGEMV1  // 0 keeps one-row calls on the CUDA-core kernel above
#define AG_QGEMV1 1
#endif

constexpr int kQgemv1MaxSmem = 48 * 1024;  // the ring and x stay within the default limit
// The block for K too long for the default shapes: 128 threads, 2 pairs deep (the least
// shared memory; quant_gemv1_ok takes what it fits).
constexpr int kQgemv1LongKThreads = 128, kQgemv1LongKDepth = 2;

struct QuantGroup {  // one group's dequantization constants for a thread's 4 columns (both kernels below)
  __half2 low[4];   // (1024 + z, 1024 + z): subtracted from codes read as 1024 + code
  __half2 high[4];  // -(64 + z) for each half: added to codes read as (1024 + 16 code) / 16
  __half2 scale2[4];
  float scale[4];
};

AG_DEVICE QuantGroup make_group(uint2 zeros, uint2 scales) {
  QuantGroup grp;
  const __half* z = reinterpret_cast<const __half*>(&zeros);
  const __half* s = reinterpret_cast<const __half*>(&scales);
  const __half2 magic = bits_to_half2(0x64006400u);       // (1024, 1024)
  const __half2 sixty_four = bits_to_half2(0x54005400u);  // (64, 64)
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const __half2 z2 = __half2half2(z[j]);
    grp.low[j] = __hadd2(z2, magic);
    grp.high[j] = __hneg2(__hadd2(z2, sixty_four));
    grp.scale2[j] = __half2half2(s[j]);
    grp.scale[j] = __half2float(s[j]);
  }
  return grp;
}

// (a & b) | c in one LOP3. With two immediates the compiler emits an AND and an OR; with
// the masks in registers (asm operands) it is one instruction.
AG_DEVICE uint32_t and_or(uint32_t a, uint32_t b, uint32_t c) {
#ifdef __CUDA_ARCH__
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
#else
  return (a & b) | c;
#endif
}

// acc + the 8 products of one word's codes (minus z) with x pairs xv (see above); m_lo, m_hi
// and magic hold 0x000F000F, 0x00F000F0 and 0x64006400 (registers, for and_or).
AG_DEVICE __half2 dot_word(uint32_t word, const uint4& xv, __half2 low, __half2 high, __half2 acc, uint32_t m_lo,
                           uint32_t m_hi, uint32_t magic) {
  const __half2 sixteenth = bits_to_half2(0x2C002C00u);  // (1/16, 1/16)
  const uint32_t shifted = word >> 8;
  const __half2 d0 = __hsub2(bits_to_half2(and_or(word, m_lo, magic)), low);
  const __half2 d1 = hfma2(bits_to_half2(and_or(word, m_hi, magic)), sixteenth, high);
  const __half2 d2 = __hsub2(bits_to_half2(and_or(shifted, m_lo, magic)), low);
  const __half2 d3 = hfma2(bits_to_half2(and_or(shifted, m_hi, magic)), sixteenth, high);
  acc = hfma2(d0, bits_to_half2(xv.x), acc);
  acc = hfma2(d1, bits_to_half2(xv.y), acc);
  acc = hfma2(d2, bits_to_half2(xv.z), acc);
  return hfma2(d3, bits_to_half2(xv.w), acc);
}

AG_DEVICE uint2 load8(const void* ptr) { return *reinterpret_cast<const uint2*>(ptr); }

// The staged x: packed row r at slot r + r / 8, so that K lanes a multiple of 8 rows apart
// read different banks.
AG_DEVICE int x_slot(int r) { return r + (r >> 3); }
__host__ __device__ __forceinline__ int quant_gemv1_x_slots(int k) { return k / 8 + k / 64 + 1; }

// Dynamic shared memory of a launch: the ring, then x.
__host__ __device__ __forceinline__ int quant_gemv1_smem(int k, int threads, int depth) {
  return depth * 2 * threads * 16 + 16 * quant_gemv1_x_slots(k);
}

// Whether the streaming kernel takes `p`.
inline bool quant_gemv1_ok(const QuantGemvParams& p) {
  const auto aligned8 = [](const void* ptr, int64_t stride) {
    return reinterpret_cast<uintptr_t>(ptr) % 8 == 0 && stride % 4 == 0;
  };
  return AG_QGEMV1 && p.m == 1 && p.k % 16 == 0 && p.group_size % 16 == 0 && p.k % p.group_size == 0 &&
         quant_gemv1_smem(p.k, kQgemv1LongKThreads, kQgemv1LongKDepth) <= kQgemv1MaxSmem &&
         aligned8(p.scales, p.scales_stride) &&
         aligned8(p.zeros, p.zeros_stride);
}

template <int COL_THREADS, int THREADS, int DEPTH, bool GATED>
__global__ void __launch_bounds__(THREADS) quant_gemv1_4bit_kernel(const QuantGemvParams p) {
  static_assert(COL_THREADS >= 1 && COL_THREADS <= kWarpSize && kWarpSize % COL_THREADS == 0);
  static_assert(!GATED || COL_THREADS % 2 == 0, "a gated block's column threads pair gate and up");
  static_assert(THREADS % kWarpSize == 0 && DEPTH >= 1);
  constexpr int kCols = 4 * COL_THREADS;
  constexpr int kLanes = THREADS / COL_THREADS;  // K lanes
  constexpr int kWarps = THREADS / kWarpSize;
  // Dynamic shared memory: the weight ring [DEPTH][2][THREADS] (each thread's pairs of
  // packed rows in flight), then x [x slots].
  AG_DYNAMIC_SMEM(staged);
  uint4* ring = reinterpret_cast<uint4*>(staged);
  uint4* xs = ring + DEPTH * 2 * THREADS;
  __shared__ float partial[kWarps][kCols];

  const int tid = threadIdx.x;
  const int col_thread = tid % COL_THREADS;
  const int k_lane = tid / COL_THREADS;
  // Gated, the block's first COL_THREADS / 2 column threads take gate columns and the rest
  // the up columns N / 2 further on (n % 8 == 0 then), so that partial[.][i] and
  // partial[.][kCols / 2 + i] below are one output's gate and up.
  constexpr int kHalfCols = GATED ? COL_THREADS / 2 : COL_THREADS;
  const int within = blockIdx.x * 4 * kHalfCols + 4 * (col_thread % kHalfCols);
  const int col0 = (GATED && col_thread >= kHalfCols ? p.n / 2 : 0) + within;
  const bool active = within < (GATED ? p.n / 2 : p.n);  // n % 4 == 0 (checked by the glue)
  const int rows = p.k / 8;        // packed rows, even
  const int per_lane = 2 * ceil_div(ceil_div(rows, kLanes), 2);
  const int begin = imin(k_lane * per_lane, rows);
  const int end = active ? imin(begin + per_lane, rows) : begin;
  const int pairs = (end - begin) / 2;
  const int32_t* wp = p.qweight + static_cast<int64_t>(begin) * p.qweight_stride + (active ? col0 : 0);

  // Pair i (rows begin + 2i, + 1) goes to stage i % DEPTH; one commit group per pair, empty
  // past the end, so that "at most DEPTH - 1 groups pending" means pair i has landed.
  auto request = [&](int stage, int i) {
    const bool live = i < pairs;
    const int32_t* src = live ? wp + static_cast<int64_t>(2 * i) * p.qweight_stride : p.qweight;
    cp_async16(ring + (2 * stage) * THREADS + tid, src, live);
    cp_async16(ring + (2 * stage + 1) * THREADS + tid, live ? src + p.qweight_stride : src, live);
    cp_async_commit();
  };
#pragma unroll
  for (int u = 0; u < DEPTH; ++u) request(u, u);

  const int rows_per_group = p.group_size / 8;
  int group = begin / rows_per_group;
  int group_end = (group + 1) * rows_per_group;  // first packed row past the group
  const __half* scales = static_cast<const __half*>(p.scales) + col0;
  const __half* zeros = static_cast<const __half*>(p.zeros) + col0;
  uint2 z_next = make_uint2(0, 0), s_next = make_uint2(0, 0);
  QuantGroup grp{};
  if (pairs > 0) {
    grp = make_group(load8(zeros + static_cast<int64_t>(group) * p.zeros_stride),
                     load8(scales + static_cast<int64_t>(group) * p.scales_stride));
    if (group_end < end) {
      z_next = load8(zeros + static_cast<int64_t>(group + 1) * p.zeros_stride);
      s_next = load8(scales + static_cast<int64_t>(group + 1) * p.scales_stride);
    }
  }

  // The LOP3 masks, kept in registers: read from shared memory, the compiler cannot fold
  // them back into immediates. They share the barrier that publishes x.
  __shared__ uint32_t masks[3];
  if (tid == 0) {
    masks[0] = 0x000F000Fu;
    masks[1] = 0x00F000F0u;
    masks[2] = 0x64006400u;
  }
  // Everything above reads only the weights and their constants, so a dependent launch
  // (see launch_quant_gemv1) runs it while the kernel ahead is still computing x.
  grid_dependency_wait();
  // The kernel after this one may start and wait for its output. Gated, its successor is
  // the down product, which would take SMs that this kernel's later blocks need: it is
  // let in only once this block's weights are read (below).
  if constexpr (!GATED) launch_dependents();
  const __half* x = static_cast<const __half*>(p.x);
  for (int r = tid; r < rows; r += THREADS) {
    const uint4 raw = load16(x + 8 * r);
    const __half* h = reinterpret_cast<const __half*>(&raw);
    __half2 pr[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) pr[j] = __halves2half2(h[j], h[j + 4]);
    xs[x_slot(r)] = make_uint4(half2_to_bits(pr[0]), half2_to_bits(pr[1]), half2_to_bits(pr[2]), half2_to_bits(pr[3]));
  }
  __syncthreads();

  const uint32_t m_lo = masks[0], m_hi = masks[1], magic = masks[2];

  float total[4] = {0.f, 0.f, 0.f, 0.f};
  for (int base = 0; base < pairs; base += DEPTH) {
#pragma unroll
    for (int u = 0; u < DEPTH; ++u) {
      const int i = base + u;
      if (i < pairs) {
        const int r = begin + 2 * i;
        if (r >= group_end) {  // a new group: its constants were loaded when the last one began
          grp = make_group(z_next, s_next);
          ++group;
          group_end += rows_per_group;
          if (group_end < end) {
            z_next = load8(zeros + static_cast<int64_t>(group + 1) * p.zeros_stride);
            s_next = load8(scales + static_cast<int64_t>(group + 1) * p.scales_stride);
          }
        }
        cp_async_wait<DEPTH - 1>();
        const uint4 wa4 = ring[(2 * u) * THREADS + tid], wb4 = ring[(2 * u + 1) * THREADS + tid];
        const uint4 xa = xs[x_slot(r)], xb = xs[x_slot(r + 1)];
        const uint32_t wa[4] = {wa4.x, wa4.y, wa4.z, wa4.w};
        const uint32_t wb[4] = {wb4.x, wb4.y, wb4.z, wb4.w};
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          __half2 sum = dot_word(wa[c], xa, grp.low[c], grp.high[c], __float2half2_rn(0.f), m_lo, m_hi, magic);
          sum = dot_word(wb[c], xb, grp.low[c], grp.high[c], sum, m_lo, m_hi, magic);
          const float2 f = __half22float2(sum);
          total[c] = fmaf(grp.scale[c], f.x + f.y, total[c]);
        }
        request(u, i + DEPTH);  // the stage's words are in registers and used: refill it
      }
    }
  }
  cp_async_wait<0>();
  if constexpr (GATED) launch_dependents();

  // Sum over the K lanes: those of a warp (lanes that differ above the column thread's
  // bits) with shuffles, then the warps in shared memory.
  const int warp = tid / kWarpSize;
  const int lane = tid % kWarpSize;
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const float v = warp_sum<COL_THREADS>(total[c]);
    if (lane < COL_THREADS) partial[warp][4 * lane + c] = v;
  }
  __syncthreads();
  const __half* bias = static_cast<const __half*>(p.bias);
  if constexpr (!GATED) {
    if (tid < kCols) {
      const int n = blockIdx.x * kCols + tid;
      if (n < p.n) {
        float v = 0.f;
#pragma unroll
        for (int k = 0; k < kWarps; ++k) v += partial[k][tid];
        if (bias != nullptr) v += __half2float(bias[n]);
        static_cast<__half*>(p.out)[n] = __float2half_rn(v);
      }
    }
  } else {
    constexpr int kOut = kCols / 2;
    const int j = blockIdx.x * kOut + tid;
    if (tid < kOut && j < p.n / 2) {
      float gate = 0.f, up = 0.f;
#pragma unroll
      for (int k = 0; k < kWarps; ++k) {
        gate += partial[k][tid];
        up += partial[k][kOut + tid];
      }
      if (bias != nullptr) {
        gate += __half2float(bias[j]);
        up += __half2float(bias[p.n / 2 + j]);
      }
      // Each product rounded as its output is.
      static_cast<__half*>(p.out)[j] = __float2half_rn(silu_times<__half>(round_to<__half>(gate), round_to<__half>(up)));
    }
  }
}

template <int COL_THREADS, int THREADS, int DEPTH, bool GATED = false>
void launch_quant_gemv1_shaped(const QuantGemvParams& p, cudaStream_t stream, bool dependent) {
  void (*kernel)(const QuantGemvParams) = quant_gemv1_4bit_kernel<COL_THREADS, THREADS, DEPTH, GATED>;
  const dim3 grid(GATED ? ceil_div(p.n / 2, 2 * COL_THREADS) : ceil_div(p.n, 4 * COL_THREADS)), block(THREADS);
  const int smem = quant_gemv1_smem(p.k, THREADS, DEPTH);
  if (dependent) {
    AG_LAUNCH_KERNEL_DEPENDENT(kernel, grid, block, smem, stream, p);
  } else {
    AG_LAUNCH_KERNEL(kernel, grid, block, smem, stream, p);
  }
}

// The block shapes, timed on an H200 at the 7B shapes (benchmarks/gemv_variants.py, which
// compiles variants with AG_QGEMV1_COLS / _THREADS / _DEPTH set to force one): wide layers
// (N >= 8192) 8 column threads in 128 threads, 4 pairs deep; narrow ones 4 in 256, 2 deep.
// Where K is too long for the ring and x to fit the default 48 KiB, the long-K block.
// `dependent` (sm_90+): launched so that it may start while the kernel ahead of it runs
// (programmatic dependent launch); it requests its first weights, then waits for x.
//
// Gated, a block takes the columns and threads of two: the same count for gate and for up,
// each half's column threads reading whole 128-byte lines of a packed row as the plain
// kernel's do (with the plain shapes' threads halved between gate and up, each half read
// half lines, and a one-row decode step took 5 % longer on an H200).
inline bool quant_gemv1_gated_ok(const QuantGemvParams& p) {
  return quant_gemv1_ok(p) && p.n % 8 == 0 &&
         quant_gemv1_smem(p.k, 2 * kQgemv1LongKThreads, kQgemv1LongKDepth) <= kQgemv1MaxSmem;
}

inline void launch_quant_gemv1_gated(const QuantGemvParams& p, cudaStream_t stream, bool dependent) {
  const bool wide = p.n >= kQuantWideN;
  if (quant_gemv1_smem(p.k, wide ? 256 : 512, wide ? 4 : 2) <= kQgemv1MaxSmem) {
    wide ? launch_quant_gemv1_shaped<16, 256, 4, true>(p, stream, dependent)
         : launch_quant_gemv1_shaped<8, 512, 2, true>(p, stream, dependent);
  } else {
    constexpr int T = 2 * kQgemv1LongKThreads, D = kQgemv1LongKDepth;
    wide ? launch_quant_gemv1_shaped<16, T, D, true>(p, stream, dependent)
         : launch_quant_gemv1_shaped<8, T, D, true>(p, stream, dependent);
  }
}

inline void launch_quant_gemv1(const QuantGemvParams& p, cudaStream_t stream, bool dependent) {
#if defined(AG_QGEMV1_COLS) && defined(AG_QGEMV1_THREADS) && defined(AG_QGEMV1_DEPTH)
  launch_quant_gemv1_shaped<AG_QGEMV1_COLS, AG_QGEMV1_THREADS, AG_QGEMV1_DEPTH>(p, stream, dependent);
#else
  const bool wide = p.n >= kQuantWideN;
  if (quant_gemv1_smem(p.k, wide ? 128 : 256, wide ? 4 : 2) <= kQgemv1MaxSmem) {
    wide ? launch_quant_gemv1_shaped<8, 128, 4>(p, stream, dependent)
         : launch_quant_gemv1_shaped<4, 256, 2>(p, stream, dependent);
  } else {
    constexpr int T = kQgemv1LongKThreads, D = kQgemv1LongKDepth;
    wide ? launch_quant_gemv1_shaped<8, T, D>(p, stream, dependent)
         : launch_quant_gemv1_shaped<4, T, D>(p, stream, dependent);
  }
#endif
}

// ---------------------------------------------------------------------------------------
// 4-bit on tensor cores (sm_80+), up to 64 rows
//
// The same product, with the multiply-adds done by mma.sync m16n8k16 (see mma_m16n8k16
// in common.cuh for the fragment layouts): A is 16 weight columns by 16 of K, B is 16 of K
// by 8 rows of x (M_TILES such tiles for up to 8 * M_TILES rows), D accumulates in fp32.
// The CUDA cores are left with the dequantization: per packed word, one shift, four masks
// and four half2 operations give its 8 codes minus the zero point, exactly, already paired
// the way A wants them.
//
// A block owns 32 columns; its warps split K into contiguous ranges of 32-row chunks. In a
// chunk, lane 4g + c loads one 16-byte vector: packed row 4 * chunk + c (K rows
// 32 chunk + 8c .. + 7) of columns 4g .. 4g + 3, so a warp reads four whole 128-byte lines.
// Which K index sits where inside an mma is free, as long as A and B agree: lane 4g + c
// feeds K rows 32 chunk + 8c + {0, 4, 1, 5} to the first k-step and {2, 6, 3, 7} to the
// second, which are the pairs the half2 dequantization yields (codes j and j + 4 of a word
// share a register), and it loads the same 8 elements of x rows g, g + 8, ... as B. Output
// columns map to A rows as 4g + 2t -> row g and 4g + 2t + 1 -> row g + 8 of tile t = 0, 1,
// so each lane's D entries are the columns whose weights it loaded.
//
// Scales: with one tile of x rows, each tile accumulates a group in fp32 and is added to
// the total times its column's scale when the group ends; with more, the dequantized
// weights are multiplied by the scale in fp16 (as the dequantize-then-matmul reference
// rounds them) and accumulate directly, which saves the second set of accumulators. The
// scales and zeros of a warp's groups are staged in shared memory first (loaded while the
// first weights are in flight), so a new group costs two shared loads. Each lane keeps DEPTH
// chunks of weights in flight, refilling a chunk's registers with the chunk DEPTH ahead
// as soon as they are used; x (in L2: the previous kernel wrote it) runs DEPTH chunks
// ahead with one tile of rows, one chunk ahead with more.
#ifndef AG_QGEMV_MMA  // 0 keeps every call on the CUDA-core kernel above
#define AG_QGEMV_MMA 1
#endif
// Warps per block (splitting K): 16 for layers narrower than 8192 columns at up to 32
// rows (fewer blocks than two per SM of an H200 otherwise), else 8, as timed on an H200 by
// benchmarks/gemv_variants.py, which compiles variants with AG_QGEMV_MMA_WARPS (and
// AG_QGEMV_MMA_DEPTH, chunks in flight per lane) set to force one.
#ifndef AG_QGEMV_MMA_DEPTH
#define AG_QGEMV_MMA_DEPTH 4
#endif
constexpr int kMmaMaxWarps = 16;
constexpr int kMmaCols = 32;        // output columns per block
constexpr int kMmaChunk = 32;       // K rows per chunk: 4 packed rows
constexpr int kMmaMaxRows = 64;     // rows of x the tensor-core kernel takes
constexpr int kMmaMaxSmem = 48 * 1024;  // the staged scales and zeros must fit the default limit

// The codes minus z of one packed word (times the scale with SCALED), as half2 pairs of
// codes (0, 4), (1, 5), (2, 6), (3, 7). LOP3: each mask-and-OR as one instruction, the
// constants held in registers (and_or), instead of an AND and an OR.
template <bool SCALED, bool LOP3 = false>
AG_DEVICE void dequant_word(uint32_t (&d)[4], uint32_t word, const QuantGroup& grp, int j) {
  const __half2 sixteenth = bits_to_half2(0x2C002C00u);  // (1/16, 1/16)
  const uint32_t shifted = word >> 8;
  const auto field = [](uint32_t w, uint32_t mask) {
    return LOP3 ? and_or(w, mask, 0x64006400u) : (w & mask) | 0x64006400u;
  };
  __half2 h[4];
  h[0] = __hsub2(bits_to_half2(field(word, 0x000F000Fu)), grp.low[j]);
  h[1] = hfma2(bits_to_half2(field(word, 0x00F000F0u)), sixteenth, grp.high[j]);
  h[2] = __hsub2(bits_to_half2(field(shifted, 0x000F000Fu)), grp.low[j]);
  h[3] = hfma2(bits_to_half2(field(shifted, 0x00F000F0u)), sixteenth, grp.high[j]);
#pragma unroll
  for (int i = 0; i < 4; ++i) d[i] = half2_to_bits(SCALED ? __hmul2(h[i], grp.scale2[j]) : h[i]);
}

// One chunk: 4 packed words (a lane's 4 columns) against 8 elements of each of its x rows.
template <int M_TILES, bool SCALED>
AG_DEVICE void mma_chunk(float (&acc)[M_TILES][2][4], const uint4& w, const uint4 (&x)[M_TILES],
                         const QuantGroup& grp) {
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
  uint32_t d[4][4];
#pragma unroll
  for (int j = 0; j < 4; ++j) dequant_word<SCALED>(d[j], words[j], grp, j);
#pragma unroll
  for (int step = 0; step < 2; ++step) {
    uint32_t a[2][4];
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      a[t][0] = d[2 * t][2 * step];
      a[t][1] = d[2 * t + 1][2 * step];
      a[t][2] = d[2 * t][2 * step + 1];
      a[t][3] = d[2 * t + 1][2 * step + 1];
    }
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
      // B for k-step 0: elements (0, 4), (1, 5) of the row; k-step 1: (2, 6), (3, 7).
      const uint32_t lo = step == 0 ? x[mt].x : x[mt].y;
      const uint32_t hi = step == 0 ? x[mt].z : x[mt].w;
      const uint32_t b[2] = {(lo & 0xFFFFu) | (hi << 16), (lo >> 16) | (hi & 0xFFFF0000u)};
#pragma unroll
      for (int t = 0; t < 2; ++t) mma_m16n8k16<__half>(acc[mt][t], a[t], b);
    }
  }
}

// Bytes of dynamic shared memory the kernel uses: the staged scales and zeros, and later
// the warps' partial sums in the same place.
inline int quant_gemv_mma_smem(const QuantGemvParams& p, int warps) {
  const int consts = p.group_size > 0 ? (p.k / p.group_size) * 2 * kMmaCols * static_cast<int>(sizeof(__half)) : 0;
  const int sums = warps * 8 * kMmaCols * static_cast<int>(sizeof(float));
  return consts > sums ? consts : sums;
}

template <int M_TILES, int WARPS, int DEPTH>
__global__ void __launch_bounds__(WARPS * kWarpSize) quant_gemv_4bit_mma_kernel(const QuantGemvParams p) {
  constexpr bool kScaled = M_TILES > 1;
  constexpr int kXDepth = M_TILES == 1 ? DEPTH : 1;
  // Dynamic shared memory: per group, the block's 32 zeros then its 32 scales (fp16); at
  // the end, the warps' sums [WARPS][8][32] (fp32).
  AG_DYNAMIC_SMEM(staged);
  __half* group_consts = reinterpret_cast<__half*>(staged);
  float (*partial)[8][kMmaCols] = reinterpret_cast<float (*)[8][kMmaCols]>(staged);
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int g = lane / 4, c = lane % 4;
  const int col0 = blockIdx.x * kMmaCols + 4 * g;  // this lane's 4 columns
  const bool active = col0 < p.n;                   // n % 4 == 0 (checked by the glue)
  const __half* x = static_cast<const __half*>(p.x) + 8 * c;
  const int32_t* qweight = p.qweight + static_cast<int64_t>(c) * p.qweight_stride + col0;
  const int chunks = p.k / kMmaChunk;
  const int per_warp = ceil_div(chunks, WARPS);
  const int begin = imin(warp * per_warp, chunks);
  const int end = imin(begin + per_warp, chunks);  // warp-uniform: every lane of a warp runs the same chunks
  const int chunks_per_group = p.group_size / kMmaChunk;

  uint4 w[DEPTH];
  uint4 xs[kXDepth][M_TILES];
  auto load_weights = [&](int u, int chunk) {
    w[u] = chunk < end && active ? load_weights16(qweight + static_cast<int64_t>(4 * chunk) * p.qweight_stride)
                                 : make_uint4(0, 0, 0, 0);
  };
  auto load_x = [&](int u, int chunk) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
      const int m = 8 * mt + g;
      xs[u][mt] = chunk < end && m < p.m ? load16(x + static_cast<int64_t>(m) * p.x_stride + kMmaChunk * chunk)
                                         : make_uint4(0, 0, 0, 0);
    }
  };
#pragma unroll
  for (int u = 0; u < DEPTH; ++u) load_weights(u, begin + u);
#pragma unroll
  for (int u = 0; u < kXDepth; ++u) load_x(u, begin + u);

  // Stage the scales and zeros of this warp's groups, 4 columns (8 bytes) a load, with
  // several loads in flight per lane. Neighbouring warps may both write a group they
  // share, with the same values.
  const int groups = p.k / p.group_size;
  if (begin < end) {
    const int first_group = begin / chunks_per_group;
    const int entries = ((end - 1) / chunks_per_group - first_group + 1) * 16;
    constexpr int kStageLoads = 8;
    for (int base = lane; base < entries; base += kStageLoads * kWarpSize) {
      uint2 v[kStageLoads];
#pragma unroll
      for (int j = 0; j < kStageLoads; ++j) {
        const int i = base + j * kWarpSize;
        const int grp = first_group + i / 16, part = i % 16;
        const int col = blockIdx.x * kMmaCols + 4 * (part % 8);
        const __half* src = part < 8 ? static_cast<const __half*>(p.zeros) + static_cast<int64_t>(grp) * p.zeros_stride
                                     : static_cast<const __half*>(p.scales) + static_cast<int64_t>(grp) * p.scales_stride;
        v[j] = i < entries && col < p.n ? *reinterpret_cast<const uint2*>(src + col) : make_uint2(0, 0);
      }
#pragma unroll
      for (int j = 0; j < kStageLoads; ++j) {
        const int i = base + j * kWarpSize;
        const int grp = first_group + i / 16, part = i % 16;
        if (i < entries) *reinterpret_cast<uint2*>(group_consts + (2 * grp + part / 8) * kMmaCols + 4 * (part % 8)) = v[j];
      }
    }
  }
  __syncwarp();
  auto group_at = [&](int grp) {
    return make_group(*reinterpret_cast<const uint2*>(group_consts + 2 * grp * kMmaCols + 4 * g),
                      *reinterpret_cast<const uint2*>(group_consts + (2 * grp + 1) * kMmaCols + 4 * g));
  };

  float acc[M_TILES][2][4], total[2][4];
#pragma unroll
  for (int t = 0; t < 2; ++t)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      total[t][r] = 0.f;
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt) acc[mt][t][r] = 0.f;
    }
  // With one tile: the group's sum times each column's scale, into the total.
  auto flush = [&](const QuantGroup& grp) {
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        total[t][r] = fmaf(grp.scale[2 * t + r / 2], acc[0][t][r], total[t][r]);
        acc[0][t][r] = 0.f;
      }
  };
  int group = begin / chunks_per_group;
  int group_end = (group + 1) * chunks_per_group;  // first chunk past this group
  QuantGroup grp = group_at(imin(group, groups - 1));
  for (int base = begin; base < end; base += DEPTH) {
#pragma unroll
    for (int u = 0; u < DEPTH; ++u) {
      const int chunk = base + u;
      if (chunk < end) {
        if (chunk >= group_end) {
          if (!kScaled) flush(grp);
          ++group;
          group_end += chunks_per_group;
          grp = group_at(group);
        }
        mma_chunk<M_TILES, kScaled>(acc, w[u], xs[u % kXDepth], grp);
        load_weights(u, chunk + DEPTH);
        load_x(u % kXDepth, chunk + kXDepth);
      }
    }
  }
  if (!kScaled) flush(grp);

  // D entry r of tile t: column 4g + 2t + r / 2, x row 8 mt + 2c + r % 2. The warps' sums
  // meet in shared memory, 8 rows at a time.
  __half* out = static_cast<__half*>(p.out);
  const __half* bias = static_cast<const __half*>(p.bias);
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt) {
    if (8 * mt >= p.m) break;
    __syncthreads();  // every warp is done with the staged constants, or the previous rows' sums
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        partial[warp][2 * c + r % 2][4 * g + 2 * t + r / 2] = kScaled ? acc[mt][t][r] : total[t][r];
      }
    __syncthreads();
    for (int i = threadIdx.x; i < 8 * kMmaCols; i += WARPS * kWarpSize) {
      const int m = 8 * mt + i / kMmaCols;
      const int col = i % kMmaCols;
      const int n = blockIdx.x * kMmaCols + col;
      if (m >= p.m || n >= p.n) continue;
      float v = 0.f;
#pragma unroll
      for (int k = 0; k < WARPS; ++k) v += partial[k][i / kMmaCols][col];
      if (bias != nullptr) v += __half2float(bias[n]);
      out[m * p.out_stride + n] = __float2half_rn(v);
    }
  }
}

// Whether the tensor-core kernel takes `p`: at most 64 rows, whole chunks and groups of
// them, 8-byte aligned scales and zeros (4 columns a load), and the staged scales and
// zeros within the default shared-memory limit.
inline bool quant_gemv_4bit_mma_ok(const QuantGemvParams& p) {
  const auto aligned8 = [](const void* ptr, int64_t stride) {
    return reinterpret_cast<uintptr_t>(ptr) % 8 == 0 && stride % 4 == 0;
  };
  return p.m >= 1 && p.m <= kMmaMaxRows && p.k % kMmaChunk == 0 && p.group_size % kMmaChunk == 0 &&
         p.k % p.group_size == 0 && aligned8(p.scales, p.scales_stride) && aligned8(p.zeros, p.zeros_stride) &&
         quant_gemv_mma_smem(p, kMmaMaxWarps) <= kMmaMaxSmem;
}

template <int M_TILES, int WARPS, int DEPTH>
void launch_quant_gemv_4bit_mma(const QuantGemvParams& p, cudaStream_t stream) {
  void (*kernel)(const QuantGemvParams) = quant_gemv_4bit_mma_kernel<M_TILES, WARPS, DEPTH>;
  AG_LAUNCH_KERNEL(kernel, dim3(ceil_div(p.n, kMmaCols)), dim3(WARPS * kWarpSize), quant_gemv_mma_smem(p, WARPS),
                   stream, p);
}

// tensor_cores: the device has mma.sync for fp16 (sm_80+). dependent: the one-row kernel
// may be launched as a dependent of the kernel ahead (sm_90+; see launch_quant_gemv1).
// Gated (p.gated) only the one-row kernel runs: false where quant_gemv1_gated_ok is not.
inline bool launch_quant_gemv_4bit(const QuantGemvParams& p, cudaStream_t stream, bool tensor_cores,
                                   bool dependent = false) {
  if (p.gated) {
    if (!quant_gemv1_gated_ok(p)) return false;
    launch_quant_gemv1_gated(p, stream, dependent);
    return true;
  }
  if (AG_QGEMV_MMA && tensor_cores && quant_gemv_4bit_mma_ok(p)) {
#ifdef AG_QGEMV_MMA_WARPS
    constexpr int kNarrowWarps = AG_QGEMV_MMA_WARPS, kWideWarps = AG_QGEMV_MMA_WARPS;
#else
    constexpr int kNarrowWarps = 16, kWideWarps = 8;
#endif
    constexpr int D = AG_QGEMV_MMA_DEPTH;
    const bool narrow = p.n < kQuantWideN;
    if (p.m <= 8) {
      narrow ? launch_quant_gemv_4bit_mma<1, kNarrowWarps, D>(p, stream) : launch_quant_gemv_4bit_mma<1, kWideWarps, D>(p, stream);
    } else if (p.m <= 16) {
      narrow ? launch_quant_gemv_4bit_mma<2, kNarrowWarps, D>(p, stream) : launch_quant_gemv_4bit_mma<2, kWideWarps, D>(p, stream);
    } else if (p.m <= 32) {
      narrow ? launch_quant_gemv_4bit_mma<4, kNarrowWarps, D>(p, stream) : launch_quant_gemv_4bit_mma<4, kWideWarps, D>(p, stream);
    } else {
      launch_quant_gemv_4bit_mma<8, kWideWarps, D>(p, stream);
    }
    return true;
  }
  if (p.m > kGemvMaxRows) return false;
  if (quant_gemv1_ok(p)) {
    launch_quant_gemv1(p, stream, dependent);
    return true;
  }
#if defined(AG_QGEMV_COL_THREADS) && defined(AG_QGEMV_UNROLL)
  return launch_quant_gemv_4bit_shaped<AG_QGEMV_COL_THREADS, AG_QGEMV_UNROLL>(p, stream);
#else
  return p.n >= kQuantWideN ? launch_quant_gemv_4bit_shaped<8, 4>(p, stream)
                            : launch_quant_gemv_4bit_shaped<4, 4>(p, stream);
#endif
}

}  // namespace asyncgen
