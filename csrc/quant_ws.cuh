// 4-bit GEMM on Hopper's warpgroup tensor cores with warps in two roles (sm_90a), for
// batches of 1-64 rows of x.
//
// The warpgroup kernel (quant_wgmma.cuh) has every warp copy its share of a stage, wait
// for its own copies, reorder its piece of x, fence, and meet the others at a block-wide
// barrier before any of them may compute the stage: a stage of 64 K rows took about
// 1.5 us of a block's time at 64 rows on an H200, far more than its loads or its tensor
// work, and draining every copy at every stage cost only 8 % more (docs/BENCHMARKS.md).
// Here the roles are apart:
// - 4 producer warps (one warpgroup, its registers lowered with setmaxnreg) fill a ring of
//   STAGES slots. Lanes of the first warp ask for a slot's packed weights (8 rows of the
//   block's BN columns) and its group's zero points and scales as bulk copies
//   (cp.async.bulk) that complete on the slot's "full" barrier; each producer thread with
//   a piece of x (row r, 32 of the stage's 64 K) copies it with cp.async, and STAGES / 2
//   stages later puts it into the order of A's k-slots (as quant_wgmma.cuh does) and fences
//   it for the tensor cores; then one lane of each producer warp arrives on the same barrier.
// - WARPS consumer warps (1 or 2 warpgroups, BN = 32 WARPS columns) wait for a slot's
//   full barrier and compute the stage exactly as the warpgroup kernel does (the same
//   dequantization, wgmma m64nNk16 with A in registers and B = x in shared memory, the
//   same fp32 accumulators), and once a stage's products have completed each warp
//   arrives on the slot's "empty" barrier, which the producers wait for before refilling
//   it. No barrier spans the block inside the loop.
// A block takes a run of (column block, stage) units, as the warpgroup kernel's split and
// balanced launches deal them; where the run moves to another column block the consumers
// store (or leave partials for) the one they finished while the producers go on filling
// the ring. The result store and the split sum are the tiled kernels', among the consumer
// threads (named barrier 1).
//
// Measured on an H200 (docs/BENCHMARKS.md, benchmarks/quant_ws_probe.py) it is slower than
// the warpgroup kernel in every 7B shape at 16 and 64 rows, and the engine does not route
// to it (cuda_backend.QUANT_GEMM_WS_CONFIGS): the weights' copies cost most of the gap
// (without them q|k|v at 16 rows took 20.3 against 35.3 us; with no copies at all the
// products and barriers alone took 15.5, the warpgroup kernel 18.5), whether bulk copies
// or the producers' cp.async (AG_QWS_CPASYNC_WEIGHTS) make them.
#pragma once

#include "quant_wgmma.cuh"

// AG_QWS_PROBE (timing only, wrong results): 1 leaves out the consumers' products (they
// wait for each slot, read its weights and give it back), 2 the producers' copies (they
// only arrive), 3 only the wgmma instructions (the dequantization stays), 4 only the bulk
// copies of the weights (x is still copied): what the ring alone, the products alone, the
// tensor-core work and the weights' copies take. AG_QWS_XAHEAD sets kXAhead.
#ifndef AG_QWS_PROBE
#define AG_QWS_PROBE 0
#endif
#ifndef AG_QWS_THREAD_ARRIVALS
#define AG_QWS_THREAD_ARRIVALS 0
#endif
// AG_QWS_CPASYNC_WEIGHTS 1: the producer threads copy the weights and group constants with
// cp.async, in the commit group of the stage's x, instead of asking for bulk copies.
#ifndef AG_QWS_CPASYNC_WEIGHTS
#define AG_QWS_CPASYNC_WEIGHTS 0
#endif

namespace asyncgen {

constexpr int kWsProducerWarps = 4;

template <int M_TILES, int WARPS>
struct WsLayout {
  using Stage = WgmmaLayout<M_TILES, WARPS>;  // a slot: x (1024-byte aligned), weights, groups
  static constexpr int kStages = WARPS == 8 ? 8 : 6;
  // Stages whose x a producer thread has in flight: a stage's copies have this many of the
  // consumers' stage times to land, and are ready S - kXAhead - 1 stages before they are used.
#ifdef AG_QWS_XAHEAD
  static constexpr int kXAhead = AG_QWS_XAHEAD < kStages - 2 ? AG_QWS_XAHEAD : kStages - 2;
#else
  static constexpr int kXAhead = kStages / 2;
#endif
  static constexpr int kThreads = (WARPS + kWsProducerWarps) * kWarpSize;
  static constexpr int kBarriersOffset = kStages * Stage::kStageBytes;  // then full[kStages], empty[kStages]
  static constexpr int kSmemBytes = kBarriersOffset + 2 * kStages * 8 + 1024;  // + alignment of the ring
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
  constexpr int kXAhead = W::kXAhead;
  constexpr int kConsumers = WARPS * kWarpSize;
  constexpr int kProducers = kWsProducerWarps * kWarpSize;
  constexpr int kRows = L::kRows;
  constexpr int BN = L::kCols;
  static_assert(2 * kRows <= kProducers, "one x piece a producer thread at most");
  static_assert(kTiledPackedRows + 2 <= kWarpSize, "a lane a bulk copy");
  static_assert(S >= kXAhead + 2, "the producers finish a stage's x before they wait for its slot's reuse");
  const QuantGemvParams& p = gp.q;

  AG_DYNAMIC_SMEM(smem_raw);
  unsigned char* smem = smem_raw + (1024 - smem_address(smem_raw) % 1024) % 1024;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + W::kBarriersOffset);
  uint64_t* empty = full + S;
  auto x_at = [&](int slot) { return smem + slot * L::kStageBytes; };
  auto weights_at = [&](int slot) { return reinterpret_cast<uint32_t*>(smem + slot * L::kStageBytes + L::kXBytes); };
  auto groups_at = [&](int slot) {
    return reinterpret_cast<__half*>(smem + slot * L::kStageBytes + L::kXBytes + L::kWeightBytes);
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      // A lane of every producer warp (or every producer thread), and the bulk copies' announcement.
      mbarrier_init(full + s, (AG_QWS_THREAD_ARRIVALS ? kProducers : kWsProducerWarps) + !AG_QWS_CPASYNC_WEIGHTS);
      mbarrier_init(empty + s, WARPS);          // a lane of every consumer warp
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
    const bool issuer = pt < kWarpSize;  // the first producer warp asks for the bulk copies
    auto issue_weights = [&](int j) {
      const int64_t u = u_begin + j;
      const int cb = static_cast<int>(u / stages), s = static_cast<int>(u % stages);
      const int slot = j % S;
      const int cols = imin(BN, p.n - cb * BN);  // a multiple of 8
      const uint32_t w_bytes = 4 * cols, g_bytes = 2 * cols;
      if (AG_QWS_CPASYNC_WEIGHTS) {
        const int64_t group = static_cast<int64_t>(s) * kTiledK / p.group_size;
        for (int i = pt; i < kTiledPackedRows * (BN / 4); i += kProducers) {
          const int r = i / (BN / 4), col = 4 * (i % (BN / 4));
          const bool ok = col < cols;
          const int32_t* src = p.qweight + static_cast<int64_t>(s * kTiledPackedRows + r) * p.qweight_stride + cb * BN;
          cp_async16(weights_at(slot) + r * L::kWordsPerRow + col, ok ? src + col : p.qweight, ok);
        }
        for (int i = pt; i < 2 * (BN / 8); i += kProducers) {
          const bool zero_points = i < BN / 8;
          const int col = 8 * (i % (BN / 8));
          const bool ok = col < cols;
          const __half* src = static_cast<const __half*>(zero_points ? p.zeros : p.scales) +
                              group * (zero_points ? p.zeros_stride : p.scales_stride) + cb * BN;
          cp_async16(groups_at(slot) + (zero_points ? 0 : BN) + col, ok ? src + col : src - cb * BN, ok);
        }
        return;
      }
      if (AG_QWS_PROBE == 2 || AG_QWS_PROBE == 4) {
        if (pt == 0) mbarrier_arrive(full + slot);
        return;
      }
      if (pt == 0) mbarrier_arrive_expect_tx(full + slot, kTiledPackedRows * w_bytes + 2 * g_bytes);
      if (pt < kTiledPackedRows) {
        const int32_t* src = p.qweight + static_cast<int64_t>(s * kTiledPackedRows + pt) * p.qweight_stride + cb * BN;
        bulk_copy_g2s(weights_at(slot) + pt * L::kWordsPerRow, src, w_bytes, full + slot);
      } else if (pt < kTiledPackedRows + 2) {
        const bool zero_points = pt == kTiledPackedRows;
        const int64_t group = static_cast<int64_t>(s) * kTiledK / p.group_size;
        const __half* src = static_cast<const __half*>(zero_points ? p.zeros : p.scales) +
                            group * (zero_points ? p.zeros_stride : p.scales_stride) + cb * BN;
        bulk_copy_g2s(groups_at(slot) + (zero_points ? 0 : BN), src, g_bytes, full + slot);
      }
    };
    // Thread pt < 2 kRows copies the 32-K chunk pt % 2 of x row pt / 2 (rows past x's are
    // zero-filled), in the swizzled places of quant_wgmma.cuh.
    const __half* x = static_cast<const __half*>(p.x);
    const bool x_task = pt < 2 * kRows;
    const int x_row = pt / 2, x_half = pt % 2;
    const bool x_ok = x_task && x_row < p.m;
    const __half* x_src = x_ok ? x + static_cast<int64_t>(x_row) * p.x_stride + 32 * x_half : x;
    int x_dst[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) x_dst[q] = x_row * 128 + 16 * ((4 * x_half + q) ^ (x_row & 7));
    auto issue_x = [&](int j) {
      if (!x_task || AG_QWS_PROBE == 2) return;
      const int s = static_cast<int>((u_begin + j) % stages);
      unsigned char* xs = x_at(j % S);
#pragma unroll
      for (int q = 0; q < 4; ++q) cp_async16(xs + x_dst[q], x_ok ? x_src + s * kTiledK + 8 * q : x, x_ok);
    };
    auto finish_x = [&](int j) {
      const int slot = j % S;
      if (x_task && AG_QWS_PROBE != 2) {
        unsigned char* xs = x_at(slot);
        uint4 e[4], r[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) e[q] = *reinterpret_cast<const uint4*>(xs + x_dst[q]);
#pragma unroll
        for (int q = 0; q < 4; ++q) r[q] = pair_halves(e[q]);
        *reinterpret_cast<uint4*>(xs + x_dst[0]) = make_uint4(r[0].x, r[1].x, r[2].x, r[3].x);
        *reinterpret_cast<uint4*>(xs + x_dst[1]) = make_uint4(r[0].y, r[1].y, r[2].y, r[3].y);
        *reinterpret_cast<uint4*>(xs + x_dst[2]) = make_uint4(r[0].z, r[1].z, r[2].z, r[3].z);
        *reinterpret_cast<uint4*>(xs + x_dst[3]) = make_uint4(r[0].w, r[1].w, r[2].w, r[3].w);
        fence_proxy_async();
      }
      // One arrival a warp, once every lane's x is in place, rather than one a thread on
      // the same barrier word (AG_QWS_THREAD_ARRIVALS, for timing).
#if AG_QWS_THREAD_ARRIVALS
      mbarrier_arrive(full + slot);
#else
      __syncwarp();
      if (pt % kWarpSize == 0) mbarrier_arrive(full + slot);
#endif
    };

    // The first slots' weights need no wait: nothing ahead writes them.
    if (issuer || AG_QWS_CPASYNC_WEIGHTS) {
      for (int j = 0; j < count && j < S; ++j) issue_weights(j);
    }
    grid_dependency_wait();
    launch_dependents();
    // Iteration j finishes stage j - kXAhead's x (its copies were the commit group of
    // iteration j - kXAhead) and fills slot j % S once the consumers are done with it.
    for (int j = 0; j < count + kXAhead; ++j) {
      if (j >= kXAhead) {
        cp_async_wait<kXAhead - 1>();
        finish_x(j - kXAhead);
      }
      if (j < count) {
        if (j >= S) {
          mbarrier_wait(empty + j % S, (j / S - 1) & 1);
          if (issuer || AG_QWS_CPASYNC_WEIGHTS) issue_weights(j);
        }
        issue_x(j);
      }
      cp_async_commit();
    }
    cp_async_wait<0>();
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
      mbarrier_wait(full + slot, (j / S) & 1);
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
