// 4-bit GEMM on Hopper's warpgroup tensor cores with warps in two roles (sm_90a), for
// batches of 1-64 rows of x.
//
// The warpgroup kernel (quant_wgmma.cuh) has every warp copy its share of a stage, wait
// for its own copies, reorder its piece of x, fence, and meet the others at a block-wide
// barrier before any of them may compute the stage: a stage of 64 K rows took about
// 1.5 us of a block's time at 64 rows on an H200, far more than its loads or its tensor
// work, and draining every copy at every stage cost only 8 % more (docs/BENCHMARKS.md).
// Here the roles are apart:
// - 4 producer warps (one warpgroup, its registers lowered with setmaxnreg). The first
//   asks for a slot's packed weights (8 rows of the block's BN columns), its group's zero
//   points and scales, and the stage's 64 K of every x row (128 bytes a row, unswizzled)
//   as bulk copies (cp.async.bulk) that complete on the slot's "full" barrier; it waits
//   for nothing but the slot's release. The other three wait for "full", put each x row
//   into the order of A's k-slots in the swizzled places of quant_wgmma.cuh, fence it for
//   the tensor cores and arrive on the slot's "ready" barrier. So no thread that fences
//   (MEMBAR.ALL.CTA in the SASS) has a copy of its own in flight.
// - WARPS consumer warps (1 or 2 warpgroups, BN = 32 WARPS columns) wait for a slot's
//   "full" and "ready" barriers and compute the stage exactly as the warpgroup kernel does
//   (the same dequantization, wgmma m64nNk16 with A in registers and B = x in shared
//   memory, the same fp32 accumulators), and once a stage's products have completed each
//   warp arrives on the slot's "empty" barrier, which the copying warp waits for before
//   refilling it. No barrier spans the block inside the loop.
// A block takes a run of (column block, stage) units, as the warpgroup kernel's split and
// balanced launches deal them; where the run moves to another column block the consumers
// store (or leave partials for) the one they finished while the producers go on filling
// the ring. The result store and the split sum are the tiled kernels', among the consumer
// threads (named barrier 1).
//
// A first version, whose producer threads each copied x with cp.async and later reordered
// and fenced it themselves (the first warp also asking for the weights' bulk copies), was
// slower than the warpgroup kernel in every 7B shape on an H200: its ring streamed q|k|v's
// 25 MB in 29 us with no products at all (docs/BENCHMARKS.md, benchmarks/quant_ws_probe.py).
#pragma once

#include "quant_wgmma.cuh"

// AG_QWS_PROBE (timing only, wrong results): 1 leaves out the consumers' products (they
// wait for each slot, read its weights and give it back), 2 the producers' copies and
// reordering (they only arrive), 3 only the wgmma instructions (the dequantization stays):
// what the ring alone, the products alone and the tensor-core work take.
#ifndef AG_QWS_PROBE
#define AG_QWS_PROBE 0
#endif
// The ring's slots with 8 consumer warps (one block an SM; up to 11 fit at 64 rows).
#ifndef AG_QWS_STAGES8
#define AG_QWS_STAGES8 8
#endif

namespace asyncgen {

constexpr int kWsProducerWarps = 4;

template <int M_TILES, int WARPS>
struct WsLayout {
  using Stage = WgmmaLayout<M_TILES, WARPS>;  // a slot: x (1024-byte aligned), weights, groups
  static constexpr int kStages = WARPS == 8 ? AG_QWS_STAGES8 : 6;
  static constexpr int kThreads = (WARPS + kWsProducerWarps) * kWarpSize;
  static constexpr int kBarriersOffset = kStages * Stage::kStageBytes;  // then full, ready, empty [kStages]
  static constexpr int kSmemBytes = kBarriersOffset + 3 * kStages * 8 + 1024;  // + alignment of the ring
};
static_assert(WsLayout<8, 8>::kSmemBytes <= 227 * 1024 && 2 * WsLayout<8, 4>::kSmemBytes <= 227 * 1024,
              "one block of 8 consumer warps, or two of 4, an SM");

// Registers a thread after the roles split (setmaxnreg; the block's total stays within
// the 64 K registers of an SM at 1 block of 8 consumer warps or 2 of 4).
template <int WARPS>
constexpr int kWsConsumerRegisters = WARPS == 8 ? 224 : 200;
constexpr int kWsProducerRegisters = 56;

template <int N>
AG_DEVICE void setmaxnreg_inc() {
#if defined(__CUDA_ARCH__) && AG_WGMMA_DEVICE
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}
template <int N>
AG_DEVICE void setmaxnreg_dec() {
#if defined(__CUDA_ARCH__) && AG_WGMMA_DEVICE
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}

// Makes the barriers' initialisation visible to the bulk copies' completions.
AG_DEVICE void mbarrier_init_fence() {
#if defined(__CUDA_ARCH__) && AG_WGMMA_DEVICE
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

template <int M_TILES, int WARPS>
__global__ void __launch_bounds__((WARPS + kWsProducerWarps) * kWarpSize, WARPS == 8 ? 1 : 2)
    quant_gemm_4bit_ws_kernel(const QuantGemmParams gp) {
  using W = WsLayout<M_TILES, WARPS>;
  using L = typename W::Stage;
  constexpr int S = W::kStages;
  constexpr int kConsumers = WARPS * kWarpSize;
  constexpr int kProducers = kWsProducerWarps * kWarpSize;
  constexpr int kRows = L::kRows;
  constexpr int BN = L::kCols;
  static_assert(kTiledPackedRows + 2 <= kWarpSize, "a lane a bulk copy");
  const QuantGemvParams& p = gp.q;

  AG_DYNAMIC_SMEM(smem_raw);
  unsigned char* smem = smem_raw + (1024 - smem_address(smem_raw) % 1024) % 1024;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + W::kBarriersOffset);
  uint64_t* ready = full + S;
  uint64_t* empty = ready + S;
  auto x_at = [&](int slot) { return smem + slot * L::kStageBytes; };
  auto weights_at = [&](int slot) { return reinterpret_cast<uint32_t*>(smem + slot * L::kStageBytes + L::kXBytes); };
  auto groups_at = [&](int slot) {
    return reinterpret_cast<__half*>(smem + slot * L::kStageBytes + L::kXBytes + L::kWeightBytes);
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      mbarrier_init(full + s, 1);                         // the copying warp's, with the copies' bytes
      mbarrier_init(ready + s, kWsProducerWarps - 1);     // a lane of every reordering warp
      mbarrier_init(empty + s, WARPS);                    // a lane of every consumer warp
    }
    mbarrier_init_fence();
  }
  __syncthreads();

  // The block's units u = column block * stages + stage, u_begin .. u_end - 1.
  const int stages = p.k / kTiledK;
  const int64_t col_blocks = ceil_div(p.n, BN), units = col_blocks * stages;
  int64_t u_begin, u_end;
  if (gp.stream_blocks > 0) {
    u_begin = stream_start(blockIdx.x, units, gp.stream_blocks);
    u_end = stream_start(blockIdx.x + 1, units, gp.stream_blocks);
  } else {
    const int64_t first = static_cast<int64_t>(blockIdx.x) * stages;
    u_begin = first + static_cast<int64_t>(stages) * blockIdx.y / gp.splits;
    u_end = first + static_cast<int64_t>(stages) * (blockIdx.y + 1) / gp.splits;
  }
  const int count = static_cast<int>(u_end - u_begin);

  if (threadIdx.x >= kConsumers) {
    // ---- producers ----
    setmaxnreg_dec<kWsProducerRegisters>();
    const int pt = threadIdx.x - kConsumers;
    if (pt < kWarpSize) {
      // The copying warp: a slot's weights, group constants and x rows, all bulk copies
      // that complete on its "full" barrier. It waits for nothing but the slot's release.
      const int lane = pt;
      const __half* x = static_cast<const __half*>(p.x);
      auto issue_weights = [&](int j) {
        if (AG_QWS_PROBE == 2) return;
        const int64_t u = u_begin + j;
        const int cb = static_cast<int>(u / stages), s = static_cast<int>(u % stages);
        const int slot = j % S;
        const int cols = imin(BN, p.n - cb * BN);  // a multiple of 8
        const uint32_t w_bytes = 4 * cols, g_bytes = 2 * cols;
        // Every byte of the slot (x's too) is announced before any copy is asked for.
        if (lane == 0) mbarrier_expect_tx(full + slot, kTiledPackedRows * w_bytes + 2 * g_bytes + 128 * p.m);
        __syncwarp();
        if (lane < kTiledPackedRows) {
          const int32_t* src =
              p.qweight + static_cast<int64_t>(s * kTiledPackedRows + lane) * p.qweight_stride + cb * BN;
          bulk_copy_g2s(weights_at(slot) + lane * L::kWordsPerRow, src, w_bytes, full + slot);
        } else if (lane < kTiledPackedRows + 2) {
          const bool zero_points = lane == kTiledPackedRows;
          const int64_t group = static_cast<int64_t>(s) * kTiledK / p.group_size;
          const __half* src = static_cast<const __half*>(zero_points ? p.zeros : p.scales) +
                              group * (zero_points ? p.zeros_stride : p.scales_stride) + cb * BN;
          bulk_copy_g2s(groups_at(slot) + (zero_points ? 0 : BN), src, g_bytes, full + slot);
        }
      };
      // Row r of the stage's 64 K of x lands unswizzled in the 128 bytes that row r
      // takes in the slot; the reordering warps put it in place.
      auto issue_x = [&](int j) {
        const int s = static_cast<int>((u_begin + j) % stages);
        const int slot = j % S;
        if (AG_QWS_PROBE != 2) {
          for (int r = lane; r < p.m; r += kWarpSize)
            bulk_copy_g2s(x_at(slot) + 128 * r, x + static_cast<int64_t>(r) * p.x_stride + s * kTiledK, 128,
                          full + slot);
        }
        __syncwarp();
        if (lane == 0) mbarrier_arrive(full + slot);
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
    // The reordering warps: thread t < rows of x puts row t of each stage's x into the
    // order of A's k-slots, in the swizzled places of quant_wgmma.cuh, and fences it for
    // the tensor cores. They copy nothing, so their fences wait for no copies in flight.
    const int t = pt - kWarpSize;
    constexpr int kReorderers = kProducers - kWarpSize;
    static_assert(kRows <= kReorderers, "a row of x a reordering thread");
    grid_dependency_wait();
    launch_dependents();
    // Rows past x's are never copied: zero in every slot, once.
    for (int i = t; i < S * (kRows - p.m); i += kReorderers) {
      unsigned char* row = x_at(i / (kRows - p.m)) + 128 * (p.m + i % (kRows - p.m));
#pragma unroll
      for (int q = 0; q < 8; ++q) *reinterpret_cast<uint4*>(row + 16 * q) = make_uint4(0, 0, 0, 0);
    }
    for (int j = 0; j < count; ++j) {
      const int slot = j % S;
      mbarrier_wait(full + slot, (j / S) & 1);
      if (t < p.m && AG_QWS_PROBE != 2) {
        unsigned char* row = x_at(slot) + 128 * t;
        uint4 e[8];
#pragma unroll
        for (int q = 0; q < 8; ++q) e[q] = *reinterpret_cast<const uint4*>(row + 16 * q);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          uint4 r[4];
#pragma unroll
          for (int q = 0; q < 4; ++q) r[q] = pair_halves(e[4 * h + q]);
          auto at = [&](int q) { return reinterpret_cast<uint4*>(row + 16 * ((4 * h + q) ^ (t & 7))); };
          *at(0) = make_uint4(r[0].x, r[1].x, r[2].x, r[3].x);
          *at(1) = make_uint4(r[0].y, r[1].y, r[2].y, r[3].y);
          *at(2) = make_uint4(r[0].z, r[1].z, r[2].z, r[3].z);
          *at(3) = make_uint4(r[0].w, r[1].w, r[2].w, r[3].w);
        }
      }
      fence_proxy_async();
      __syncwarp();
      if (t % kWarpSize == 0) mbarrier_arrive(ready + slot);
    }
    return;
  }

  // ---- consumers ----
  setmaxnreg_inc<kWsConsumerRegisters<WARPS>>();
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int c = lane % 4, wc = warp * 32 + 4 * (lane / 4);
  float acc[2][4 * M_TILES];  // as in quant_wgmma.cuh
  const auto clear = [&] {
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
      for (int r = 0; r < 4 * M_TILES; ++r) acc[t][r] = 0.f;
  };
  const uint32_t x_base = smem_address(smem);
  // Column block cb's result, or its partials, once its last stage of this block's run is done.
  const auto store = [&](int cb) {
    grid_dependency_wait();  // (returned long ago in the producers, whose x this used)
    int piece, pieces;
    if (gp.stream_blocks > 0) {
      const int64_t first = stream_block_of(static_cast<int64_t>(cb) * stages, units, gp.stream_blocks);
      const int64_t last = stream_block_of(static_cast<int64_t>(cb) * stages + stages - 1, units, gp.stream_blocks);
      piece = static_cast<int>(blockIdx.x - first);
      pieces = static_cast<int>(last - first + 1);
    } else {
      piece = static_cast<int>(blockIdx.y);
      pieces = gp.splits;
    }
    store_tiled_result<M_TILES, kConsumers, BN, true>(gp, cb * BN, wc, c, piece, pieces, cb,
                                                      [&](int mt, int t, int r) { return acc[t][4 * mt + r]; });
  };
  // A split with no stages (more splits than stages) still leaves its (zero) partials and
  // takes its ticket.
  if (count == 0) {
    clear();
    store(static_cast<int>(blockIdx.x));
  }

  // One column block's stages of the run at a time (a loop of its own, so that no path
  // into the stage loop's back edge clears accumulators that wgmma may still be writing,
  // which would make ptxas wait for every product there).
  for (int j = 0; j < count;) {
    const int64_t u0 = u_begin + j;
    const int cb = static_cast<int>(u0 / stages);
    const int run = imin(count - j, stages - static_cast<int>(u0 % stages));
    clear();
    for (const int j_end = j + run; j < j_end; ++j) {
      const int slot = j % S;
      mbarrier_wait(full + slot, (j / S) & 1);  // (the weights' bytes; x is ready after the next)
      mbarrier_wait(ready + slot, (j / S) & 1);
      const uint32_t* w = weights_at(slot);
      const __half* gs = groups_at(slot);
      const QuantGroup grp = make_group(*reinterpret_cast<const uint2*>(gs + wc),
                                        *reinterpret_cast<const uint2*>(gs + BN + wc));
      const uint32_t x_slot = x_base + slot * L::kStageBytes;
#pragma unroll
      for (int ch = 0; ch < kTiledChunks; ++ch) {
        const uint4 wv = *reinterpret_cast<const uint4*>(w + (4 * ch + c) * L::kWordsPerRow + wc);
        if constexpr (AG_QWS_PROBE == 1) {
          acc[0][0] += static_cast<float>((wv.x ^ wv.y ^ wv.z ^ wv.w) & 0xFFu) + grp.scale[0];
          if (ch == 1 && j > 0 && lane == 0) mbarrier_arrive(empty + (j - 1) % S);
          continue;
        }
        const uint32_t words[4] = {wv.x, wv.y, wv.z, wv.w};
        // At most the previous chunk's products stay in flight: at chunk 1 those of the
        // stage before have completed, and its slot goes back to the producers.
        wgmma_wait<1>();
        if (ch == 1 && j > 0 && lane == 0) mbarrier_arrive(empty + (j - 1) % S);
        uint32_t d[4][4];
#pragma unroll
        for (int q = 0; q < 4; ++q) dequant_word<true, true>(d[q], words[q], grp, q);
        wgmma_fence();
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
          for (int r = 0; r < 4 * M_TILES; ++r) fence_register(acc[t][r]);
#pragma unroll
        for (int step = 0; step < 2; ++step) {
          const uint64_t desc = wgmma_desc_k128(x_slot + 32 * (2 * ch + step));
#pragma unroll
          for (int t = 0; t < 2; ++t) {
            const uint32_t a[4] = {d[2 * t][2 * step], d[2 * t + 1][2 * step], d[2 * t][2 * step + 1],
                                   d[2 * t + 1][2 * step + 1]};
            if constexpr (AG_QWS_PROBE == 3) {
              acc[t][0] += static_cast<float>((a[0] ^ a[1] ^ a[2] ^ a[3] ^ static_cast<uint32_t>(desc)) & 0xFFu);
            } else {
              wgmma_rs<8 * M_TILES>(acc[t], a, desc);
            }
          }
        }
        wgmma_commit();
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
          for (int r = 0; r < 4 * M_TILES; ++r) fence_register(acc[t][r]);
      }
    }
    wgmma_wait<0>();
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
      for (int r = 0; r < 4 * M_TILES; ++r) fence_register(acc[t][r]);
    store(cb);
  }
}

// The tiled GEMM's product by the kernel with warp roles: takes what quant_gemm_4bit_ok
// takes, in builds that have the warpgroup kernel (kWgmmaBuilt; the caller checks the
// device is sm_90). gp.warps is its consumer warps. Returns false otherwise.
inline bool launch_quant_gemm_4bit_ws(const QuantGemmParams& p, cudaStream_t stream, bool dependent = false) {
  if (!kWgmmaBuilt || !quant_gemm_4bit_ok(p)) return false;
  dispatch_tiled_shape(p, [&](auto m_tiles, auto warps) {
    constexpr int M_TILES = decltype(m_tiles)::value, WARPS = decltype(warps)::value;
    using W = WsLayout<M_TILES, WARPS>;
    void (*kernel)(const QuantGemmParams) = quant_gemm_4bit_ws_kernel<M_TILES, WARPS>;
    allow_dynamic_smem<quant_gemm_4bit_ws_kernel<M_TILES, WARPS>>(W::kSmemBytes);
    const dim3 grid = p.stream_blocks > 0 ? dim3(p.stream_blocks) : dim3(ceil_div(p.q.n, 32 * WARPS), p.splits);
    const dim3 block(W::kThreads);
    if (dependent) {
      AG_LAUNCH_KERNEL_DEPENDENT(kernel, grid, block, W::kSmemBytes, stream, p);
    } else {
      AG_LAUNCH_KERNEL(kernel, grid, block, W::kSmemBytes, stream, p);
    }
  });
  return true;
}

// The tiled GEMM's product by the kernel p.wgmma names: 0 the mma.sync kernel
// (quant_gemm.cuh), 1 the warpgroup kernel (quant_wgmma.cuh), 2 the one with warp roles
// (above); the caller checks the device for the last two. Returns false where that kernel
// does not take `p`.
inline bool launch_tiled_quant_gemm(const QuantGemmParams& p, cudaStream_t stream, bool dependent = false) {
  switch (p.wgmma) {
    case 0:
      return launch_quant_gemm_4bit(p, stream, dependent);
    case 1:
      return launch_quant_gemm_4bit_wgmma(p, stream, dependent);
    case 2:
      return launch_quant_gemm_4bit_ws(p, stream, dependent);
    default:
      return false;
  }
}

}  // namespace asyncgen
