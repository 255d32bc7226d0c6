// 4-bit GEMM on Hopper's warpgroup tensor cores with warps in two roles (sm_90a), for
// batches of 1-64 rows of x.
//
// The warpgroup kernel (quant_wgmma.cuh) has every warp copy its share of a stage, wait
// for its own copies, reorder its piece of x, fence, and meet the others at a block-wide
// barrier before any of them may compute the stage: a stage of 64 K rows took about
// 1.5 us of a block's time at 64 rows on an H200, far more than its loads or its tensor
// work, and draining every copy at every stage cost only 8 % more (docs/BENCHMARKS.md).
// Here the roles are apart:
// - 4 producer warps (one warpgroup, its registers lowered with setmaxnreg). A lane of the
//   first asks for a slot's bytes as 4-5 TMA copies through tensor maps (WsMaps): the
//   stage's 64 K of x for every row (in the 128-byte swizzle; rows past x's land as zeros),
//   its packed weights (8 rows of the block's BN columns, in boxes of 128 + 8), its group's
//   zero points and its scales, all completing on the slot's "full" barrier; it waits for
//   nothing but the slot's release. The other three wait for "full", put each x row into
//   the order of A's k-slots in place, fence it for the tensor cores and arrive on the
//   slot's "ready" barrier; no thread that fences (MEMBAR.ALL.CTA in the SASS) has a copy
//   in flight.
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
// Two earlier versions were slower than the warpgroup kernel in every 7B shape on an H200
// (docs/BENCHMARKS.md, benchmarks/quant_ws_probe.py): one whose producers asked for each
// packed row of weights as its own bulk copy (10 a stage) and copied x with cp.async, and
// one that also asked for each row of x as a bulk copy (26 a stage at 16 rows, 74 at 64):
// the more copies a stage, the slower the ring, whatever their bytes. With 4-5 copies a
// stage the ring ran twice as fast, yet a slot was refilled about 4 us after its release:
// the copying lane computed each unit's place with 64-bit divisions, and the ring ran at
// that one lane's pace (the AG_QWS_TIMELINE stamps, docs/BENCHMARKS.md run 47). Since it
// advances the place a unit at a time the consumers are the limit, and the kernel is the
// fastest 4-bit GEMM of most 7B products at 32-64 rows on an H200; the engine times it
// beside the others unless ASYNCGEN_QUANT_WS=0.
#pragma once

#include "quant_wgmma.cuh"

// AG_QWS_PROBE (timing only, wrong results), a sum of: 1 leaves out the consumers'
// products (they wait for each slot, read its weights and give it back), 2 the producers'
// copies and reordering (they only arrive), 4 only the wgmma instructions (the
// dequantization stays): what the ring alone, the products alone, the tensor-core work and
// (3) the barriers, launch and store alone take.
#ifndef AG_QWS_PROBE
#define AG_QWS_PROBE 0
#endif
// The ring's slots with 8 consumer warps (one block an SM; up to 11 fit at 64 rows).
#ifndef AG_QWS_STAGES8
#define AG_QWS_STAGES8 8
#endif
// AG_QWS_TIMELINE (timing only): every block writes its start and end (%globaltimer) and
// SM, and the first and last blocks of a launch the clock (clock64) at each wait and
// arrival of their first kTlUnits units, into qws_timeline (benchmarks/quant_ws_probe.py
// --timeline reads it).
#ifndef AG_QWS_TIMELINE
#define AG_QWS_TIMELINE 0
#endif

namespace asyncgen {

constexpr int kWsProducerWarps = 4;

constexpr bool kQwsNoProducts = (AG_QWS_PROBE & 1) != 0;
constexpr bool kQwsNoCopies = (AG_QWS_PROBE & 2) != 0;
constexpr bool kQwsNoWgmma = (AG_QWS_PROBE & 4) != 0;

// The events a traced block stamps (AG_QWS_TIMELINE), by unit.
enum TlEvent {
  kTlEmptyWait = 0, kTlIssued = 1, kTlXIssued = 2,     // the copying lane: before and after a slot's release, after x
  kTlLanded = 3, kTlReady = 4,                         // a reordering lane: "full" passed, "ready" arrived
  kTlC0Start = 5, kTlC0Full = 6, kTlC0Ready = 7,       // consumer warp 0: before the waits, after "full", "ready"
  kTlC0Chunk0 = 8, kTlC0Chunk1 = 9, kTlC0End = 10,     // after each chunk's wgmma wait (1: the slot before released), end
  kTlC1Start = 11, kTlC1Full = 12, kTlC1Ready = 13,    // the last consumer warp: the same
  kTlC1Chunk1 = 14, kTlC1End = 15,
};
#if AG_QWS_TIMELINE
// Words of qws_timeline: per block b (blockIdx.x + gridDim.x * blockIdx.y, up to
// kTlBlocks) its start and end in ns, SM and unit count; then per traced block (0: the
// first, 1: the last) its clock and %globaltimer at the start and at the end, then per unit
// j < kTlUnits kTlUnitWords clocks (the TlEvent indices), then per result store the clock
// at its start, past the wait for the kernel ahead, with the partials written, with the
// ticket taken and at its end, and its pieces (ticket words 0 where it has none).
constexpr int kTlBlocks = 1024, kTlUnits = 64, kTlUnitWords = 16, kTlStores = 8, kTlStoreWords = 6;
constexpr int kTlTraceWords = 4 + kTlUnits * kTlUnitWords + kTlStoreWords * kTlStores;
constexpr int kTlWords = 4 * kTlBlocks + 2 * kTlTraceWords;
__device__ unsigned long long qws_timeline[kTlWords];

AG_DEVICE unsigned long long tl_clock() {
#if defined(__CUDA_ARCH__)
  return clock64();
#else
  return 0;
#endif
}
AG_DEVICE unsigned long long tl_globaltimer() {
  unsigned long long t = 0;
#if defined(__CUDA_ARCH__)
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
#endif
  return t;
}
AG_DEVICE unsigned tl_smid() {
  unsigned id = 0;
#if defined(__CUDA_ARCH__)
  asm volatile("mov.u32 %0, %%smid;\n" : "=r"(id));
#endif
  return id;
}

// Copies qws_timeline to `dst` (kTlWords words) and clears it. False on a CUDA error.
inline bool read_qws_timeline(unsigned long long* dst) {
  void* at = nullptr;
  return cudaMemcpyFromSymbol(dst, qws_timeline, sizeof(qws_timeline)) == cudaSuccess &&
         cudaGetSymbolAddress(&at, qws_timeline) == cudaSuccess &&
         cudaMemset(at, 0, sizeof(qws_timeline)) == cudaSuccess;
}
#endif

// A slot: x (1024-byte aligned: kRows rows of 128 bytes, the stage's 64 K, in the 128-byte
// swizzle), the packed weights (BN / 128 boxes of 8 rows of 136 words, as the tensor map
// lands them), the group's zero points then scales (BN halves each).
template <int M_TILES, int WARPS>
struct WsLayout {
  using Wgmma = WgmmaLayout<M_TILES, WARPS>;  // the same rows, columns, x and group constants a slot
  static constexpr int kRows = Wgmma::kRows;
  static constexpr int kCols = Wgmma::kCols;  // BN
  static constexpr int kXBytes = Wgmma::kXBytes;
  // The weights come in boxes of 128 columns and 8 more (the next block's, or zeros past
  // N), so that a box's rows lie 136 words apart: the four rows a phase of a warp's loads
  // reads start 32 bytes apart in the banks (rows 128 words apart would share them).
  static constexpr int kBoxCols = 128, kWordsPerRow = kBoxCols + 8;
  static constexpr int kBoxes = kCols / kBoxCols;
  static constexpr int kBoxWords = kTiledPackedRows * kWordsPerRow;
  static constexpr int kWeightBytes = kBoxes * kBoxWords * 4;
  static constexpr int kGroupBytes = Wgmma::kGroupBytes;
  static constexpr int kSlotBytes = kXBytes + kWeightBytes + kGroupBytes;  // as the copies announce them
  static constexpr int kStageBytes = (kSlotBytes + 1023) / 1024 * 1024;
  static constexpr int kStages = WARPS == 8 ? AG_QWS_STAGES8 : 6;
  static constexpr int kThreads = (WARPS + kWsProducerWarps) * kWarpSize;
  static constexpr int kBarriersOffset = kStages * kStageBytes;  // then full, ready, empty [kStages]
  static constexpr int kSmemBytes = kBarriersOffset + 3 * kStages * 8 + 1024;  // + alignment of the ring
};
static_assert(WsLayout<8, 8>::kSmemBytes <= 227 * 1024 && 2 * WsLayout<8, 4>::kSmemBytes <= 227 * 1024,
              "one block of 8 consumer warps, or two of 4, an SM");

// The tensor maps of a launch: x [m, K] in boxes of 64 K by the kernel's rows (rows past m
// land as zeros), swizzled; the packed weights [K / 8, N] in boxes of 8 rows by 136 words;
// zero points and scales [G, N] in boxes of one row by BN.
struct WsMaps {
  TmaMap x, qweight, zeros, scales;
};

// Fills `map` for a row-major matrix of `rows` x `cols` elements of `elem_bytes` (2 or 4),
// rows `row_bytes` apart, in boxes of box_rows x box_cols. False where the driver refuses it.
inline bool make_tma_map_2d(TmaMap* map, const void* base, int elem_bytes, uint64_t cols, uint64_t rows,
                            uint64_t row_bytes, uint32_t box_cols, uint32_t box_rows, bool swizzle128) {
#if defined(__CUDACC__)
  using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                              const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                              CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  static const Encode encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    const bool ok = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                                     &found) == cudaSuccess &&
                    found == cudaDriverEntryPointSuccess;
    return ok ? reinterpret_cast<Encode>(fn) : nullptr;
  }();
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {row_bytes};
  const cuuint32_t box[2] = {box_cols, box_rows};
  const cuuint32_t element_strides[2] = {1, 1};
  return encode(map, elem_bytes == 4 ? CU_TENSOR_MAP_DATA_TYPE_INT32 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2,
                const_cast<void*>(base), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                swizzle128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
#else
  *map = TmaMap{base, cols, rows, row_bytes, box_cols, box_rows, static_cast<uint32_t>(elem_bytes), swizzle128};
  return true;
#endif
}

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
    quant_gemm_4bit_ws_kernel(const QuantGemmParams gp, const __grid_constant__ WsMaps maps) {
  using W = WsLayout<M_TILES, WARPS>;
  constexpr int S = W::kStages;
  constexpr int kConsumers = WARPS * kWarpSize;
  constexpr int kProducers = kWsProducerWarps * kWarpSize;
  constexpr int kRows = W::kRows;
  constexpr int BN = W::kCols;
  const QuantGemvParams& p = gp.q;

  AG_DYNAMIC_SMEM(smem_raw);
  unsigned char* smem = smem_raw + (1024 - smem_address(smem_raw) % 1024) % 1024;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + W::kBarriersOffset);
  uint64_t* ready = full + S;
  uint64_t* empty = ready + S;
  auto x_at = [&](int slot) { return smem + slot * W::kStageBytes; };
  auto weights_at = [&](int slot) { return reinterpret_cast<uint32_t*>(smem + slot * W::kStageBytes + W::kXBytes); };
  auto groups_at = [&](int slot) {
    return reinterpret_cast<__half*>(smem + slot * W::kStageBytes + W::kXBytes + W::kWeightBytes);
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
  const int64_t col_blocks = ceil_div(p.n, BN);
  int64_t u_begin, u_end;
  const StreamMap map(col_blocks, stages, gp.stream_blocks > 0 ? gp.stream_blocks : 1);
  if (gp.stream_blocks > 0) {
    u_begin = map.start(blockIdx.x);
    u_end = map.start(blockIdx.x + 1);
  } else {
    const int64_t first = static_cast<int64_t>(blockIdx.x) * stages;
    u_begin = first + static_cast<int64_t>(stages) * blockIdx.y / gp.splits;
    u_end = first + static_cast<int64_t>(stages) * (blockIdx.y + 1) / gp.splits;
  }
  const int count = static_cast<int>(u_end - u_begin);
#if AG_QWS_TIMELINE
  const unsigned block_linear = blockIdx.x + gridDim.x * blockIdx.y, blocks = gridDim.x * gridDim.y;
  unsigned long long* trace =
      block_linear == 0 ? qws_timeline + 4 * kTlBlocks
                        : (block_linear == blocks - 1 ? qws_timeline + 4 * kTlBlocks + kTlTraceWords : nullptr);
  if (threadIdx.x == 0) {
    if (block_linear < kTlBlocks) {
      qws_timeline[4 * block_linear] = tl_globaltimer();
      qws_timeline[4 * block_linear + 2] = tl_smid();
      qws_timeline[4 * block_linear + 3] = static_cast<unsigned long long>(count);
    }
    if (trace != nullptr) trace[0] = tl_clock(), trace[1] = tl_globaltimer();
  }
#endif
  // The clock at event `event` of unit j, where this block is traced (AG_QWS_TIMELINE).
  const auto stamp = [&](bool on, int j, int event) {
#if AG_QWS_TIMELINE
    if (on && trace != nullptr && j < kTlUnits) trace[4 + j * kTlUnitWords + event] = tl_clock();
#else
    (void)on, (void)j, (void)event;
#endif
  };

  if (threadIdx.x >= kConsumers) {
    // ---- producers ----
    setmaxnreg_dec<kWsProducerRegisters>();
    const int pt = threadIdx.x - kConsumers;
    if (pt < kWarpSize) {
      // The copying warp (its first lane): a slot's x, weights and group constants, 4-5
      // tensor-map copies that complete on its "full" barrier. It waits for nothing but the
      // slot's release. Where a unit lies (column block, stage, group) it advances a unit
      // at a time: a 64-bit division a unit, on this one lane, took longer than the
      // consumers' products of the unit (docs/BENCHMARKS.md, run 47).
      struct Cursor {
        int cb, s, group, left;  // column block, stage, group, stages left in the group
      };
      const int stages_per_group = p.group_size / kTiledK;
      Cursor w;  // the next unit whose weights are asked for
      w.cb = static_cast<int>(u_begin / stages);
      w.s = static_cast<int>(u_begin % stages);
      w.group = w.s / stages_per_group;
      w.left = stages_per_group - w.s % stages_per_group;
      int x_s = w.s;  // the stage of the next unit whose x is asked for
      if (pt == 0) {
        tma_prefetch_map(&maps.qweight);
        tma_prefetch_map(&maps.zeros);
        tma_prefetch_map(&maps.scales);
        tma_prefetch_map(&maps.x);
      }
      auto issue_weights = [&](int j) {
        const int slot = j % S;
        if (!kQwsNoCopies && pt == 0) {
          // Every byte of the slot (x's too) is announced before any copy is asked for.
          mbarrier_expect_tx(full + slot, W::kSlotBytes);
#pragma unroll
          for (int b = 0; b < W::kBoxes; ++b)
            tma_load_2d(weights_at(slot) + b * W::kBoxWords, &maps.qweight, w.cb * BN + b * W::kBoxCols,
                        w.s * kTiledPackedRows, full + slot);
          tma_load_2d(groups_at(slot), &maps.zeros, w.cb * BN, w.group, full + slot);
          tma_load_2d(groups_at(slot) + BN, &maps.scales, w.cb * BN, w.group, full + slot);
        }
        if (++w.s == stages) {
          w.s = 0, ++w.cb, w.group = 0, w.left = stages_per_group;
        } else if (--w.left == 0) {
          ++w.group, w.left = stages_per_group;
        }
      };
      auto issue_x = [&](int j) {
        const int slot = j % S;
        if (pt == 0) {
          if (!kQwsNoCopies) tma_load_2d(x_at(slot), &maps.x, x_s * kTiledK, 0, full + slot);
          mbarrier_arrive(full + slot);
          stamp(true, j, kTlXIssued);
        }
        if (++x_s == stages) x_s = 0;
      };
      // The first slots' weights need no wait: nothing ahead writes them.
      for (int j = 0; j < count && j < S; ++j) issue_weights(j);
      grid_dependency_wait();
      launch_dependents();
      for (int j = 0; j < count; ++j) {
        stamp(pt == 0, j, kTlEmptyWait);
        if (j >= S) mbarrier_wait(empty + j % S, (j / S - 1) & 1);
        stamp(pt == 0, j, kTlIssued);
        if (j >= S) issue_weights(j);
        issue_x(j);
      }
      return;
    }
    // The reordering warps: thread t < m puts row t of each stage's x (landed in the
    // 128-byte swizzle) into the order of A's k-slots, in the same places, and fences it
    // for the tensor cores; rows past m landed as zeros. They copy nothing, so their fences
    // wait for no copies in flight.
    const int t = pt - kWarpSize;
    static_assert(kRows <= kProducers - kWarpSize, "a row of x a reordering thread");
    grid_dependency_wait();
    launch_dependents();
    for (int j = 0; j < count; ++j) {
      const int slot = j % S;
      mbarrier_wait(full + slot, (j / S) & 1);
      stamp(t == 0, j, kTlLanded);
      if (t < p.m && !kQwsNoCopies) {
        unsigned char* row = x_at(slot) + 128 * t;
        auto at = [&](int q) { return reinterpret_cast<uint4*>(row + 16 * (q ^ (t & 7))); };
        uint4 e[8];
#pragma unroll
        for (int q = 0; q < 8; ++q) e[q] = *at(q);
#pragma unroll
        for (int h = 0; h < 2; ++h) store_in_k_slots(e + 4 * h, [&](int q) { return at(4 * h + q); });
      }
      fence_proxy_async();
      __syncwarp();
      if (t % kWarpSize == 0) mbarrier_arrive(ready + slot);
      stamp(t == 0, j, kTlReady);
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
  const bool c0 = threadIdx.x == 0, c1 = threadIdx.x == (WARPS - 1) * kWarpSize;  // the traced consumer lanes
#if AG_QWS_TIMELINE
  int stores = 0;
#endif
  // Column block cb's result, or its partials, once its last stage of this block's run is done.
  const auto store = [&](int cb) {
#if AG_QWS_TIMELINE
    unsigned long long* st = c0 && trace != nullptr && stores < kTlStores
                                 ? trace + 4 + kTlUnits * kTlUnitWords + kTlStoreWords * stores
                                 : nullptr;
    if (st != nullptr) st[0] = tl_clock();
#endif
    grid_dependency_wait();  // (returned long ago in the producers, whose x this used)
#if AG_QWS_TIMELINE
    if (st != nullptr) st[1] = tl_clock();
#endif
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
#if AG_QWS_TIMELINE
    const auto mark = [&](int k) {
      if (st != nullptr) st[2 + k] = tl_clock();
    };
#else
    const NoMark mark;
#endif
    store_tiled_result<M_TILES, kConsumers, BN, true>(
        gp, cb * BN, wc, c, piece, pieces, cb, [&](int mt, int t, int r) { return acc[t][4 * mt + r]; }, mark);
#if AG_QWS_TIMELINE
    if (st != nullptr) st[4] = tl_clock(), st[5] = static_cast<unsigned long long>(pieces);
    ++stores;
#endif
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
      stamp(c0, j, kTlC0Start);
      stamp(c1, j, kTlC1Start);
      mbarrier_wait(full + slot, (j / S) & 1);  // (the weights' bytes; x is ready after the next)
      stamp(c0, j, kTlC0Full);
      stamp(c1, j, kTlC1Full);
      mbarrier_wait(ready + slot, (j / S) & 1);
      stamp(c0, j, kTlC0Ready);
      stamp(c1, j, kTlC1Ready);
      const uint32_t* w = weights_at(slot);
      const __half* gs = groups_at(slot);
      const QuantGroup grp = make_group(*reinterpret_cast<const uint2*>(gs + wc),
                                        *reinterpret_cast<const uint2*>(gs + BN + wc));
      const uint32_t x_slot = x_base + slot * W::kStageBytes;
#pragma unroll
      for (int ch = 0; ch < kTiledChunks; ++ch) {
        const uint4 wv = *reinterpret_cast<const uint4*>(w + (wc / W::kBoxCols) * W::kBoxWords +
                                                         (4 * ch + c) * W::kWordsPerRow + wc % W::kBoxCols);
        if constexpr (kQwsNoProducts) {
          acc[0][0] += static_cast<float>((wv.x ^ wv.y ^ wv.z ^ wv.w) & 0xFFu) + grp.scale[0];
          if (ch == 1 && j > 0 && lane == 0) mbarrier_arrive(empty + (j - 1) % S);
          stamp(c0, j, ch == 0 ? kTlC0Chunk0 : kTlC0Chunk1);
          if (ch == 1) stamp(c1, j, kTlC1Chunk1);
          continue;
        }
        const uint32_t words[4] = {wv.x, wv.y, wv.z, wv.w};
        // At most the previous chunk's products stay in flight: at chunk 1 those of the
        // stage before have completed, and its slot goes back to the producers.
        wgmma_wait<1>();
        if (ch == 1 && j > 0 && lane == 0) mbarrier_arrive(empty + (j - 1) % S);
        stamp(c0, j, ch == 0 ? kTlC0Chunk0 : kTlC0Chunk1);
        if (ch == 1) stamp(c1, j, kTlC1Chunk1);
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
            if constexpr (kQwsNoWgmma) {
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
      stamp(c0, j, kTlC0End);
      stamp(c1, j, kTlC1End);
    }
    wgmma_wait<0>();
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
      for (int r = 0; r < 4 * M_TILES; ++r) fence_register(acc[t][r]);
    store(cb);
  }
#if AG_QWS_TIMELINE
  if (threadIdx.x == 0) {
    if (block_linear < kTlBlocks) qws_timeline[4 * block_linear + 1] = tl_globaltimer();
    if (trace != nullptr) trace[2] = tl_clock(), trace[3] = tl_globaltimer();
  }
#endif
}

// The tiled GEMM's product by the kernel with warp roles: takes what quant_gemm_4bit_ok
// takes, in builds that have the warpgroup kernel (kWgmmaBuilt; the caller checks the
// device is sm_90). gp.warps is its consumer warps. Returns false otherwise.
inline bool launch_quant_gemm_4bit_ws(const QuantGemmParams& p, cudaStream_t stream, bool dependent = false) {
  if (!kWgmmaBuilt || !quant_gemm_4bit_ok(p)) return false;
  bool mapped = true;
  dispatch_tiled_shape(p, [&](auto m_tiles, auto warps) {
    constexpr int M_TILES = decltype(m_tiles)::value, WARPS = decltype(warps)::value;
    using W = WsLayout<M_TILES, WARPS>;
    const QuantGemvParams& q = p.q;
    WsMaps maps;
    const uint64_t groups = q.k / q.group_size;
    mapped = make_tma_map_2d(&maps.x, q.x, 2, q.k, q.m, 2 * static_cast<uint64_t>(q.x_stride), kTiledK, W::kRows,
                             true) &&
             make_tma_map_2d(&maps.qweight, q.qweight, 4, q.n, q.k / 8, 4 * static_cast<uint64_t>(q.qweight_stride),
                             W::kWordsPerRow, kTiledPackedRows, false) &&
             make_tma_map_2d(&maps.zeros, q.zeros, 2, q.n, groups, 2 * static_cast<uint64_t>(q.zeros_stride),
                             W::kCols, 1, false) &&
             make_tma_map_2d(&maps.scales, q.scales, 2, q.n, groups, 2 * static_cast<uint64_t>(q.scales_stride),
                             W::kCols, 1, false);
    if (!mapped) return;
    void (*kernel)(const QuantGemmParams, const WsMaps) = quant_gemm_4bit_ws_kernel<M_TILES, WARPS>;
    allow_dynamic_smem<quant_gemm_4bit_ws_kernel<M_TILES, WARPS>>(W::kSmemBytes);
    const dim3 grid = p.stream_blocks > 0 ? dim3(p.stream_blocks) : dim3(ceil_div(p.q.n, 32 * WARPS), p.splits);
    const dim3 block(W::kThreads);
    if (dependent) {
      AG_LAUNCH_KERNEL_DEPENDENT(kernel, grid, block, W::kSmemBytes, stream, p, maps);
    } else {
      AG_LAUNCH_KERNEL(kernel, grid, block, W::kSmemBytes, stream, p, maps);
    }
  });
  return mapped;
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
