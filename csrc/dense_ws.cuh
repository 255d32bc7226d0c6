// fp16 GEMM for 1-128 rows of x on Hopper's warpgroup tensor cores, weights streamed
// through a ring of TMA copies by a producer warp (sm_90a).
//
// At a few dozen to 128 rows, a product y = x W^T of a 7B model (W [N, K] fp16) is bound by
// its weight reads, yet cuBLAS took 77 % (q|k|v) to 51 % (o_proj) of the H200's bandwidth
// at 80 rows (docs/BENCHMARKS.md): its tiles of columns do not divide among the 132 SMs
// (96 tiles of 128 for q|k|v, 172 for gate|up), and split-K adds a second kernel. Here the
// product's units of work (a block of 128 or 256 columns of W by 64 K, 16 or 32 KB of
// weights) are dealt to one block an SM in even runs (StreamMap, as the 4-bit warpgroup kernels deal them), a
// run going on from one column block into the next; the blocks sharing a column block
// leave fp32 partials that the last one to finish adds (the tiled kernels' ticket and sum).
//
// A block has 8 consumer warps (two warpgroups) and a producer warpgroup, one lane of which
// asks for each unit as two TMA copies into the ring (the weights' BN rows by 64 K and x's
// 64 or 128 rows by 64 K, both in the 128-byte swizzle, rows past x's landing as zeros) that
// complete on the slot's "full" barrier; it waits for nothing but the slot's release. The
// consumers issue wgmma.mma_async with both operands in shared memory, A = x (K-major, 64
// rows a warpgroup) and B = the weights (K-major: W's rows are B's columns), D = 64 rows
// of x by N columns in fp32 registers. With up to 64 rows each warpgroup takes half of the
// block's columns (m64n64k16 or m64n128k16); with 65-128 each takes 64 rows and all BN
// columns (m64n128k16 or m64n256k16). A slot goes back to the producer once both warpgroups' products of it have
// completed, without a block-wide barrier.
#pragma once

#include "quant_ws.cuh"

namespace asyncgen {

constexpr int kDenseWsMaxRows = 128;
constexpr int kDenseWsConsumerWarps = 8;

// X_TILES (1 or 2) tiles of 64 rows of x by column blocks of BN (128 or 256) weight rows
// (output columns; plan_stream_gemm's `warps` is BN / 32). A slot: x (X_TILES * 64 rows of
// 128 bytes, the unit's 64 K) then the weights (BN rows of 128 bytes), both 1024-byte
// aligned; as many slots as fit beside the barriers, up to 8.
template <int X_TILES, int BN>
struct DenseWsLayout {
  static constexpr int kRows = 64 * X_TILES;
  static constexpr int kXBytes = kRows * 128;
  static constexpr int kWeightBytes = BN * 128;
  static constexpr int kStageBytes = kXBytes + kWeightBytes;
  static constexpr int kStages = (200 * 1024) / kStageBytes < 8 ? (200 * 1024) / kStageBytes : 8;
  static constexpr int kN = X_TILES == 1 ? BN / 2 : BN;  // wgmma's N: a warpgroup's columns
  static constexpr int kThreads = (kDenseWsConsumerWarps + kWsProducerWarps) * kWarpSize;
  static constexpr int kBarriersOffset = kStages * kStageBytes;  // then full, empty [kStages]
  static constexpr int kSmemBytes = kBarriersOffset + 2 * kStages * 8 + 1024;
};
static_assert(DenseWsLayout<2, 256>::kStages >= 4 && DenseWsLayout<2, 256>::kSmemBytes <= 227 * 1024,
              "one block an SM");

struct DenseWsMaps {
  TmaMap x, weight;
};

// ---------------------------------------------------------------------------------------
// wgmma with A and B in shared memory: D (64 x N fp32, per warp rows 16 w .. 16 w + 15:
// d[4i + 2h + e] = D[16w + g + 8h][8i + 2c + e]) += A (64 x 16) * B (16 x N), both K-major
// in the 128-byte swizzle (wgmma_desc_k128).
#if defined(__CUDA_ARCH__) && AG_WGMMA_DEVICE
AG_DEVICE void wgmma_ss_asm(float (&d)[32], uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
      "}, %32, %33, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(desc_a), "l"(desc_b), "r"(1));
}

AG_DEVICE void wgmma_ss_asm(float (&d)[64], uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, %64, %65, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(1));
}

AG_DEVICE void wgmma_ss_asm(float (&d)[128], uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
      "}, %128, %129, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b), "r"(1));
}

#endif

#if !defined(__CUDA_ARCH__) && defined(AG_EMU_SMEM_AT)
// The CPU emulation: this warp's A fragments (rows 16 w + g (+ 8), K 2c (+ 1, + 8, + 9) of
// the warpgroup's 64 rows) read through A's descriptor, then the register-A emulation.
template <int N>
AG_DEVICE void emulated_wgmma_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b) {
  const int lane = threadIdx.x % kWarpSize, w = (threadIdx.x / kWarpSize) % 4;
  const int g = lane / 4, c = lane % 4;
  const uint32_t start = static_cast<uint32_t>(desc_a & 0x3FFF) << 4;
  const uint32_t stride = static_cast<uint32_t>((desc_a >> 32) & 0x3FFF) << 4;
  const auto pair = [&](int row, int k) {  // A[row][k], A[row][k + 1]
    const uint32_t logical = start + (row / 8) * stride + (row % 8) * 128 + 2 * k;
    const uint32_t physical = logical ^ (((logical >> 7) & 7) << 4);
    uint32_t v;
    std::memcpy(&v, AG_EMU_SMEM_AT(physical), 4);
    return v;
  };
  const int r0 = 16 * w + g;
  const uint32_t a[4] = {pair(r0, 2 * c), pair(r0 + 8, 2 * c), pair(r0, 2 * c + 8), pair(r0 + 8, 2 * c + 8)};
  emulated_wgmma<N>(d, a, desc_b);
}
#endif

template <int N>
AG_DEVICE void wgmma_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b) {
#if defined(__CUDA_ARCH__) && AG_WGMMA_DEVICE
  wgmma_ss_asm(d, desc_a, desc_b);
#elif defined(__CUDA_ARCH__)
  __trap();  // launched only where AG_WGMMA says the target has wgmma
#elif defined(AG_EMU_SMEM_AT)
  emulated_wgmma_ss<N>(d, desc_a, desc_b);
#endif
}

template <int X_TILES, int BN>
__global__ void __launch_bounds__(DenseWsLayout<X_TILES, BN>::kThreads, 1)
    dense_gemm_ws_kernel(const QuantGemmParams gp, const __grid_constant__ DenseWsMaps maps) {
  using L = DenseWsLayout<X_TILES, BN>;
  constexpr int S = L::kStages;
  constexpr int NW = L::kN;
  constexpr int kConsumers = kDenseWsConsumerWarps * kWarpSize;
  const QuantGemvParams& p = gp.q;

  AG_DYNAMIC_SMEM(smem_raw);
  unsigned char* smem = smem_raw + (1024 - smem_address(smem_raw) % 1024) % 1024;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L::kBarriersOffset);
  uint64_t* empty = full + S;
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      mbarrier_init(full + s, 1);                       // the copying lane's, with the copies' bytes
      mbarrier_init(empty + s, kDenseWsConsumerWarps);  // a lane of every consumer warp
    }
    mbarrier_init_fence();
  }
  __syncthreads();

  // The block's units u = column block * stages + stage, u_begin .. u_end - 1.
  const int stages = p.k / kTiledK;
  const int64_t col_blocks = ceil_div(p.n, BN);
  const StreamMap map(col_blocks, stages, gp.stream_blocks > 0 ? gp.stream_blocks : 1);
  int64_t u_begin, u_end;
  if (gp.stream_blocks > 0) {
    u_begin = map.start(blockIdx.x);
    u_end = map.start(blockIdx.x + 1);
  } else {
    const int64_t first = static_cast<int64_t>(blockIdx.x) * stages;
    u_begin = first + static_cast<int64_t>(stages) * blockIdx.y / gp.splits;
    u_end = first + static_cast<int64_t>(stages) * (blockIdx.y + 1) / gp.splits;
  }
  const int count = static_cast<int>(u_end - u_begin);

  if (threadIdx.x >= kConsumers) {
    // ---- the producer warpgroup: one lane asks for every unit's two copies ----
    setmaxnreg_dec<kWsProducerRegisters>();
    if (threadIdx.x != kConsumers) return;
    tma_prefetch_map(&maps.weight);
    tma_prefetch_map(&maps.x);
    int cb = static_cast<int>(u_begin / stages), s = static_cast<int>(u_begin % stages);  // the next weights'
    int x_s = s;                                                                        // the next x's stage
    auto issue_weights = [&](int j) {
      const int slot = j % S;
      mbarrier_expect_tx(full + slot, L::kStageBytes);  // x's bytes too, announced before any copy
      tma_load_2d(smem + slot * L::kStageBytes + L::kXBytes, &maps.weight, s * kTiledK, cb * BN, full + slot);
      if (++s == stages) s = 0, ++cb;
    };
    auto issue_x = [&](int j) {
      const int slot = j % S;
      tma_load_2d(smem + slot * L::kStageBytes, &maps.x, x_s * kTiledK, 0, full + slot);
      mbarrier_arrive(full + slot);
      if (++x_s == stages) x_s = 0;
    };
    // The first slots' weights need no wait: nothing ahead writes them.
    for (int j = 0; j < count && j < S; ++j) issue_weights(j);
    grid_dependency_wait();
    launch_dependents();
    for (int j = 0; j < count; ++j) {
      if (j >= S) {
        mbarrier_wait(empty + j % S, (j / S - 1) & 1);
        issue_weights(j);
      }
      issue_x(j);
    }
    return;
  }

  // ---- consumers: warpgroup wg takes x rows x_row0 .. + 63 by block columns col0 .. + NW - 1 ----
  setmaxnreg_inc<kWsConsumerRegisters<8>>();
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int wg = warp / 4, wq = warp % 4, g = lane / 4, c = lane % 4;
  const int x_row0 = X_TILES == 1 ? 0 : 64 * wg;
  const int col0 = X_TILES == 1 ? NW * wg : 0;
  float acc[NW / 2];  // [4 i + 2 h + e]: x row x_row0 + 16 wq + g + 8 h, block column col0 + 8 i + 2 c + e
  const auto fence_acc = [&] {
#pragma unroll
    for (int r = 0; r < NW / 2; ++r) fence_register(acc[r]);
  };
  const uint32_t base = smem_address(smem);

  // Column block cb's result, or its partials, once its last stage of this block's run is done.
  const auto store = [&](int cb) {
    grid_dependency_wait();  // (returned long ago in the producer, whose x this used)
    int piece, pieces;
    if (gp.stream_blocks > 0) {
      const int64_t first = map.block_of(static_cast<int64_t>(cb) * stages);
      const int64_t last = map.block_of(static_cast<int64_t>(cb) * stages + stages - 1);
      piece = static_cast<int>(blockIdx.x - first);
      pieces = static_cast<int>(last - first + 1);
    } else {
      piece = static_cast<int>(blockIdx.y);
      pieces = gp.splits;
    }
    const bool whole = pieces == 1;
    __half* out = static_cast<__half*>(p.out);
    const __half* bias = static_cast<const __half*>(p.bias);
    float* part = gp.workspace + static_cast<int64_t>(piece) * p.m * p.n;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = x_row0 + 16 * wq + g + 8 * h;
      if (row >= p.m) continue;
#pragma unroll
      for (int i = 0; i < NW / 8; ++i) {
        const int col = cb * BN + col0 + 8 * i + 2 * c;  // col + 1 < n where col < n (n % 8 == 0)
        if (col >= p.n) continue;
        float v0 = acc[4 * i + 2 * h], v1 = acc[4 * i + 2 * h + 1];
        if (!whole) {
          *reinterpret_cast<float2*>(part + static_cast<int64_t>(row) * p.n + col) = make_float2(v0, v1);
          continue;
        }
        if (bias != nullptr) {
          v0 += __half2float(bias[col]);
          v1 += __half2float(bias[col + 1]);
        }
        *reinterpret_cast<__half2*>(out + static_cast<int64_t>(row) * p.out_stride + col) = __floats2half2_rn(v0, v1);
      }
    }
    if (whole) return;
    if (!takes_last_ticket<kConsumers>(gp.counters + cb, pieces)) return;
    add_split_partials<kConsumers, BN, L::kRows>(gp, cb * BN, pieces);
  };
  // A split with no stages (more splits than stages) still leaves its (zero) partials and
  // takes its ticket.
  if (count == 0) {
#pragma unroll
    for (int r = 0; r < NW / 2; ++r) acc[r] = 0.f;
    store(static_cast<int>(blockIdx.x));
  }

  // One column block's stages of the run at a time. A slot goes back to the producer once
  // the products of the stage after it are issued and its own have completed, or at the end
  // of the run.
  for (int j = 0; j < count;) {
    const int64_t u0 = u_begin + j;
    const int cb = static_cast<int>(u0 / stages);
    const int run = imin(count - j, stages - static_cast<int>(u0 % stages));
    const int j_first = j;
#pragma unroll
    for (int r = 0; r < NW / 2; ++r) acc[r] = 0.f;
    for (const int j_end = j + run; j < j_end; ++j) {
      const int slot = j % S;
      mbarrier_wait(full + slot, (j / S) & 1);
      const uint32_t x_slot = base + slot * L::kStageBytes + x_row0 * 128;
      const uint32_t w_slot = base + slot * L::kStageBytes + L::kXBytes + col0 * 128;
      wgmma_fence();
      fence_acc();
#pragma unroll
      for (int step = 0; step < kTiledK / 16; ++step)
        wgmma_ss<NW>(acc, wgmma_desc_k128(x_slot + 32 * step), wgmma_desc_k128(w_slot + 32 * step));
      wgmma_commit();
      fence_acc();
      if (j > j_first) {  // the stage before, of this run: its products have completed once
        wgmma_wait<1>();  // at most this stage's are in flight
        if (lane == 0) mbarrier_arrive(empty + (j - 1) % S);
      }
    }
    wgmma_wait<0>();
    fence_acc();
    if (lane == 0) mbarrier_arrive(empty + (j - 1) % S);
    store(cb);
  }
}

// Whether dense_gemm_ws_kernel takes `gp` with the weight `weight` [n, k] fp16 (rows
// weight_stride elements apart): 1-128 rows, K a multiple of 64, N a multiple of 8, 16-byte
// aligned x and weight rows (the tensor maps' strides), an even output stride (the results
// are stored as pairs), and with splits (or a balanced launch whose blocks share a column
// block) a 16-byte aligned workspace and m * n < 2^31. gp.warps (4 or 8) sets the column
// blocks' width, 32 gp.warps (as plan_stream_gemm counts them), not the warps.
inline bool dense_gemm_ws_ok(const QuantGemmParams& gp, const void* weight, int64_t weight_stride) {
  const QuantGemvParams& p = gp.q;
  const auto aligned16 = [](const void* ptr, int64_t stride_elems) {
    return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && (stride_elems * 2) % 16 == 0;
  };
  const bool split_ok = gp.splits == 1 || (gp.splits > 1 && gp.splits <= kTiledMaxSplits && gp.workspace != nullptr &&
                                           reinterpret_cast<uintptr_t>(gp.workspace) % 16 == 0 &&
                                           gp.counters != nullptr && static_cast<int64_t>(p.m) * p.n <= INT32_MAX);
  return (gp.warps == 4 || gp.warps == 8) && gp.stream_blocks >= 0 && p.m >= 1 && p.m <= kDenseWsMaxRows && p.k > 0 && p.k % kTiledK == 0 &&
         p.n > 0 && p.n % 8 == 0 && split_ok && aligned16(p.x, p.x_stride) && aligned16(weight, weight_stride) &&
         reinterpret_cast<uintptr_t>(p.out) % 4 == 0 && p.out_stride % 2 == 0;
}

// out = x weight^T (+ bias) by dense_gemm_ws_kernel, in builds that have the warpgroup
// kernels (kWgmmaBuilt; the caller checks the device is sm_90). With gp.stream_blocks > 0
// a balanced launch of that many blocks (gp.splits: the most that share a column block,
// plan_stream_gemm(n, k, gp.warps, ...)); else column blocks x gp.splits.
// Returns false where the kernel does not take the arguments (dense_gemm_ws_ok).
inline bool launch_dense_gemm_ws(const QuantGemmParams& gp, const void* weight, int64_t weight_stride,
                                 cudaStream_t stream, bool dependent = false) {
  if (!kWgmmaBuilt || !dense_gemm_ws_ok(gp, weight, weight_stride)) return false;
  const QuantGemvParams& q = gp.q;
  const auto launch = [&](auto x_tiles, auto bn) {
    constexpr int X_TILES = decltype(x_tiles)::value, BN = decltype(bn)::value;
    using L = DenseWsLayout<X_TILES, BN>;
    DenseWsMaps maps;
    if (!make_tma_map_2d(&maps.x, q.x, 2, q.k, q.m, 2 * static_cast<uint64_t>(q.x_stride), kTiledK, L::kRows, true) ||
        !make_tma_map_2d(&maps.weight, weight, 2, q.k, q.n, 2 * static_cast<uint64_t>(weight_stride), kTiledK, BN,
                         true))
      return false;
    void (*kernel)(const QuantGemmParams, const DenseWsMaps) = dense_gemm_ws_kernel<X_TILES, BN>;
    allow_dynamic_smem<dense_gemm_ws_kernel<X_TILES, BN>>(L::kSmemBytes);
    const dim3 grid = gp.stream_blocks > 0 ? dim3(gp.stream_blocks) : dim3(ceil_div(q.n, BN), gp.splits);
    const dim3 block(L::kThreads);
    if (dependent) {
      AG_LAUNCH_KERNEL_DEPENDENT(kernel, grid, block, L::kSmemBytes, stream, gp, maps);
    } else {
      AG_LAUNCH_KERNEL(kernel, grid, block, L::kSmemBytes, stream, gp, maps);
    }
    return true;
  };
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  using Narrow = std::integral_constant<int, 128>;
  using Wide = std::integral_constant<int, 256>;
  if (gp.warps == 4) return q.m <= 64 ? launch(One{}, Narrow{}) : launch(Two{}, Narrow{});
  return q.m <= 64 ? launch(One{}, Wide{}) : launch(Two{}, Wide{});
}

}  // namespace asyncgen
