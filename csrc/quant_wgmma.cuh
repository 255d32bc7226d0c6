// 4-bit GEMM on Hopper's warpgroup tensor cores (wgmma, sm_90a) for batches of 1-64 rows of x.
//
// The tiled kernel (quant_gemm.cuh) issues mma.sync: each warp multiplies its 32 weight
// columns by every row of x with 64 m16n8k16 products a stage, each reading its own x
// fragment from shared memory, and waits for each before its registers are reused. Here
// a warpgroup (4 warps, 128 columns) issues wgmma.mma_async m64nNk16, N = the rows of x
// rounded up to 8: A is the dequantized weight in registers (each warp's 16 rows of A are
// the tiled kernel's A fragments, so the dequantization is the same), B is the stage's x
// read by the tensor cores straight from shared memory, D stays in registers (the same
// fp32 accumulators as the tiled kernel's, in the same order). The products run
// asynchronously: a chunk's four wgmma are in flight while the warp dequantizes the next
// chunk into a second set of A registers.
//
// A's k-slots are not K in order: a lane's A register for k-slots (2c, 2c+1) of k-step s
// holds the codes (i, i + 4) of its packed word for K rows 8c + (0..7), i = 2s (and 2s + 1
// for slots 2c + 8, 2c + 9), as dequant_word produces them. B must hold x in the same
// order, so each thread that copied a 32-row chunk of an x row rewrites it in place:
// position 16s + 8h + 2c + e of the chunk gets x[8c + 2s + h + 4e]. x rows are 128 bytes
// (a stage's 64 K rows), stored in the 128-byte swizzle wgmma reads (16-byte piece j of
// row r at piece j ^ (r % 8), 1024-byte aligned groups of 8 rows).
//
// The ring: STAGES slots of (x, packed weights, group constants) as in the tiled kernel,
// filled STAGES - 2 stages ahead: a slot is refilled only once every warp has passed the
// barrier of the stage after its last use, by when the wgmma reading it have completed.
// Split K and the last block's reduction are the tiled kernel's.
#pragma once

#include "quant_gemm.cuh"

// Compiled where the target has wgmma (sm_90a: nvcc defines __CUDA_ARCH_FEAT_SM90_ALL) and
// in the CPU emulation; setup.py defines AG_WGMMA for the host when it builds for sm_90a.
#if (defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)) || !defined(__CUDA_ARCH__)
#define AG_WGMMA_DEVICE 1
#else
#define AG_WGMMA_DEVICE 0
#endif

namespace asyncgen {

#ifndef AG_QWGMMA_STAGES
#define AG_QWGMMA_STAGES 5
#endif
constexpr int kWgmmaStages = AG_QWGMMA_STAGES;
static_assert(kWgmmaStages >= 3, "the ring refills STAGES - 2 stages ahead");

// ---------------------------------------------------------------------------------------
// wgmma helpers. D (64 x N fp32, per warp rows 16 w .. 16 w + 15 as mma.sync's D per 8
// columns: d[4i + 2h + e] = D[16w + g + 8h][8i + 2c + e]) += A (64 x 16 fp16 in registers,
// per warp rows 16 w .. as mma.sync's A) * B (16 x N fp16 in shared memory, K-major,
// 128-byte swizzle, described by `desc`).

// The matrix descriptor of a K-major, 128-byte-swizzled B whose first row starts at shared
// address `address` (8-row groups 1024 bytes apart).
AG_DEVICE uint64_t wgmma_desc_k128(uint32_t address) {
  return static_cast<uint64_t>((address >> 4) & 0x3FFF) | (static_cast<uint64_t>(1) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

AG_DEVICE void wgmma_fence() {
#if defined(__CUDA_ARCH__) && AG_WGMMA_DEVICE
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
AG_DEVICE void wgmma_commit() {
#if defined(__CUDA_ARCH__) && AG_WGMMA_DEVICE
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N>
AG_DEVICE void wgmma_wait() {
#if defined(__CUDA_ARCH__) && AG_WGMMA_DEVICE
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// This thread's shared-memory writes become visible to the async proxy (wgmma's reads).
AG_DEVICE void fence_proxy_async() {
#if defined(__CUDA_ARCH__) && AG_WGMMA_DEVICE
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// Keeps the compiler from moving reads or writes of `r` across this point (accumulators of
// wgmma in flight).
AG_DEVICE void fence_register(float& r) {
#if defined(__CUDA_ARCH__)
  asm volatile("" : "+f"(r)::"memory");
#else
  (void)r;
#endif
}

#if !defined(__CUDA_ARCH__) && defined(AG_EMU_SMEM_AT)
// The CPU emulation: each warp's 16 rows of D from its own A fragments and B decoded from
// the descriptor (start address, stride between 8-row groups, the 128-byte swizzle XORing
// address bits 4-6 with bits 7-9), as m16n8k16 products per 8 columns. B is K-major (row n
// holds k), or with TRANS_B N-major (row k holds n, at most 64 columns).
template <int N, typename T = __half, int TRANS_B = 0>
AG_DEVICE void emulated_wgmma(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc) {
  const int lane = threadIdx.x % kWarpSize;
  const int g = lane / 4, c = lane % 4;
  const uint32_t start = static_cast<uint32_t>(desc & 0x3FFF) << 4;
  const uint32_t stride = static_cast<uint32_t>((desc >> 32) & 0x3FFF) << 4;
  const auto element = [&](int k, int n) -> uint32_t {  // B[k][n]
    const uint32_t logical = TRANS_B ? start + (k / 8) * stride + (k % 8) * 128 + 2 * n
                                     : start + (n / 8) * stride + (n % 8) * 128 + 2 * k;
    const uint32_t physical = logical ^ (((logical >> 7) & 7) << 4);
    uint16_t v;
    std::memcpy(&v, AG_EMU_SMEM_AT(physical), 2);
    return v;
  };
  const auto pair = [&](int k, int n) { return element(k, n) | (element(k + 1, n) << 16); };
  for (int i = 0; i < N / 8; ++i) {
    const uint32_t b[2] = {pair(2 * c, 8 * i + g), pair(2 * c + 8, 8 * i + g)};
    float part[4] = {d[4 * i], d[4 * i + 1], d[4 * i + 2], d[4 * i + 3]};
    emulated_mma_m16n8k16<T>(part, a, b);
    for (int r = 0; r < 4; ++r) d[4 * i + r] = part[r];
  }
}
#endif

// The descriptor of an N-major (transposed), 128-byte-swizzled B of at most 64 columns
// whose row k0 (the first of the 16 a k step reads) starts at `address`: rows of 128
// bytes, 8-row groups 1024 bytes apart. Both offset fields get 1024 bytes: one is the
// stride between 8-row groups, the other that between 64-column atoms, which a 64-column
// B does not have.
AG_DEVICE uint64_t wgmma_desc_mn128(uint32_t address) {
  return static_cast<uint64_t>((address >> 4) & 0x3FFF) | (static_cast<uint64_t>(1024 >> 4) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

#if defined(__CUDA_ARCH__) && AG_WGMMA_DEVICE
#define AG_WGMMA64(TYPE)                                                                                        \
  asm volatile(                                                                                                    \
      "{\n.reg .pred p;\n"                                                                                         \
      "setp.ne.b32 p, %37, 0;\n"                                                                                   \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE                                                  \
      " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "     \
      "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n"              \
      "}\n"                                                                                                        \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),            \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),      \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),    \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])     \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1), "n"(TRANS_B))
#endif

// D (64 x 64 fp32, mma.sync's accumulator layout per warp) += A (64 x 16 of T in registers,
// mma.sync's A fragments per warp) * B (16 x 64 in shared memory, K-major, or N-major with
// TRANS_B).
template <typename T, int TRANS_B>
AG_DEVICE void wgmma64(float (&d)[32], const uint32_t (&a)[4], uint64_t desc) {
#if defined(__CUDA_ARCH__) && AG_WGMMA_DEVICE
  if constexpr (std::is_same<T, __half>::value) {
    AG_WGMMA64("f16");
  } else {
    AG_WGMMA64("bf16");
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // launched only where AG_WGMMA says the target has wgmma
#elif defined(AG_EMU_SMEM_AT)
  emulated_wgmma<64, T, TRANS_B>(d, a, desc);
#endif
}

#if defined(__CUDA_ARCH__) && AG_WGMMA_DEVICE
// The instruction for each N the kernel uses (the operand lists differ only in length),
// overloaded on D's size.
AG_DEVICE void wgmma_rs_asm(float (&d)[4], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %9, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, "
      "p, 1, 1, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

AG_DEVICE void wgmma_rs_asm(float (&d)[8], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, "
      "%9, %10, %11}, %12, p, 1, 1, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

AG_DEVICE void wgmma_rs_asm(float (&d)[16], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, "
      "%9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

AG_DEVICE void wgmma_rs_asm(float (&d)[32], const uint32_t (&a)[4], uint64_t desc) {
  wgmma64<__half, 0>(d, a, desc);
}

#endif

template <int N>
AG_DEVICE void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc) {
#if defined(__CUDA_ARCH__) && AG_WGMMA_DEVICE
  wgmma_rs_asm(d, a, desc);
#elif defined(__CUDA_ARCH__)
  __trap();  // launched only where AG_WGMMA says the target has wgmma
#elif defined(AG_EMU_SMEM_AT)
  emulated_wgmma<N>(d, a, desc);
#endif
}

template <int M_TILES, int WARPS>
struct WgmmaLayout {
  static constexpr int kRows = 8 * M_TILES;
  static constexpr int kCols = 32 * WARPS;                     // BN
  static constexpr int kXBytes = kRows * kTiledK * 2;          // first: 1024-byte aligned
  static constexpr int kWordsPerRow = kCols + 8;               // padded packed row
  static constexpr int kWeightBytes = kTiledPackedRows * kWordsPerRow * 4;
  static constexpr int kGroupBytes = 2 * kCols * 2;
  static constexpr int kStageBytes = (kXBytes + kWeightBytes + kGroupBytes + 1023) / 1024 * 1024;
  static constexpr int kSmemBytes = kWgmmaStages * kStageBytes + 1024;  // + alignment of the first slot
};

// The block's product over `at`'s stages of its column block: `piece` of the `pieces` that
// share them (counter `counter` of gp.counters). `smem` is the ring, 1024-byte aligned.
template <int M_TILES, int WARPS>
AG_DEVICE void wgmma_gemm_piece(const QuantGemmParams& gp, unsigned char* smem, const TiledPlace& at, int piece,
                                int pieces, int counter) {
  using L = WgmmaLayout<M_TILES, WARPS>;
  constexpr int kThreads = WARPS * kWarpSize;
  constexpr int kRows = L::kRows;
  constexpr int BN = L::kCols;
  constexpr int kAhead = kWgmmaStages - 2;  // stages in flight ahead of the one computed
  const QuantGemvParams& p = gp.q;
  const int c = at.c, col_base = at.col_base, wc = at.wc, s_begin = at.s_begin, count = at.count;

  const __half* x = static_cast<const __half*>(p.x);
  auto x_at = [&](int slot) { return smem + slot * L::kStageBytes; };
  auto weights_at = [&](int slot) { return reinterpret_cast<uint32_t*>(smem + slot * L::kStageBytes + L::kXBytes); };
  auto groups_at = [&](int slot) {
    return reinterpret_cast<__half*>(smem + slot * L::kStageBytes + L::kXBytes + L::kWeightBytes);
  };

  // The copies into the ring: the weights' and groups' as in the tiled kernel
  // (TiledWeightCopies); of x, thread t < 2 kRows copies the 32-row chunk t % 2 of x row
  // t / 2 (4 pieces of 16 bytes), which it later reorders.
  TiledWeightCopies<kThreads, BN, L::kWordsPerRow> weight_copies(p, col_base, s_begin);
  static_assert(2 * kRows <= kThreads, "one x chunk a thread at most");
  const bool x_task = threadIdx.x < 2 * kRows;
  const int x_row = threadIdx.x / 2, x_half = threadIdx.x % 2;
  const bool x_ok = x_task && x_row < p.m;
  const __half* x_src = x_ok ? x + static_cast<int64_t>(x_row) * p.x_stride + 32 * x_half + s_begin * kTiledK : x;
  int x_dst[4];  // byte offsets of the chunk's pieces in a slot, swizzled
#pragma unroll
  for (int q = 0; q < 4; ++q) x_dst[q] = x_row * 128 + 16 * ((4 * x_half + q) ^ (x_row & 7));

  auto load_weights = [&](int slot) { weight_copies.copy(weights_at(slot), groups_at(slot)); };
  auto load_x = [&](int slot) {
    if (!x_task) return;
    unsigned char* xs = x_at(slot);
#pragma unroll
    for (int q = 0; q < 4; ++q) cp_async16(xs + x_dst[q], x_src + 8 * q, x_ok);
    if (x_ok) x_src += kTiledK;
  };

  // Prologue: weights of the first kAhead stages before the wait for the kernel ahead, x
  // after it; stage i's x is commit group kAhead + i.
#pragma unroll
  for (int i = 0; i < kAhead; ++i) {
    if (i < count) load_weights(i);
    cp_async_commit();
  }
  grid_dependency_wait();
  launch_dependents();
#pragma unroll
  for (int i = 0; i < kAhead; ++i) {
    if (i < count) load_x(i);
    cp_async_commit();
  }

  float acc[2][4 * M_TILES];  // [tile t][4 i + 2 h + e]: column wc + 2t + h, x row 8i + 2c + e
#pragma unroll
  for (int t = 0; t < 2; ++t)
#pragma unroll
    for (int r = 0; r < 4 * M_TILES; ++r) acc[t][r] = 0.f;

  const uint32_t x_base = smem_address(smem);
  for (int i = 0; i < count; ++i) {
    cp_async_wait<kAhead - 1>();
    const int slot = i % kWgmmaStages;
    // This thread's x chunk in B's order: out piece j, register q = (x[8q + j], x[8q + j + 4])
    // of the chunk, i.e. halves j and j + 4 of in-piece q.
    if (x_task) {
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
    __syncthreads();  // stage i is in and reordered; every warp's products of stage i - 2 are done
    const int next = i + kAhead;
    if (next < count) {
      load_weights(next % kWgmmaStages);
      load_x(next % kWgmmaStages);
    }
    cp_async_commit();

    const uint32_t* w = weights_at(slot);
    const __half* gs = groups_at(slot);
    const QuantGroup grp = make_group(*reinterpret_cast<const uint2*>(gs + wc),
                                      *reinterpret_cast<const uint2*>(gs + BN + wc));
    const uint32_t x_slot = x_base + slot * L::kStageBytes;
#pragma unroll
    for (int ch = 0; ch < kTiledChunks; ++ch) {
      const uint4 wv = *reinterpret_cast<const uint4*>(w + (4 * ch + c) * L::kWordsPerRow + wc);
      const uint32_t words[4] = {wv.x, wv.y, wv.z, wv.w};
      // The A registers of chunk ch - 2 (the same set) must be free: at most the previous
      // chunk's products stay in flight.
      wgmma_wait<1>();
      uint32_t d[4][4];
#pragma unroll
      for (int j = 0; j < 4; ++j) dequant_word<true, true>(d[j], words[j], grp, j);
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
          wgmma_rs<8 * M_TILES>(acc[t], a, desc);
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
  cp_async_wait<0>();
#pragma unroll
  for (int t = 0; t < 2; ++t)
#pragma unroll
    for (int r = 0; r < 4 * M_TILES; ++r) fence_register(acc[t][r]);

  store_tiled_result<M_TILES, kThreads, BN>(gp, col_base, wc, c, piece, pieces, counter,
                                           [&](int mt, int t, int r) { return acc[t][4 * mt + r]; });
}

// Block (x, y) computes column block x over split y of K.
template <int M_TILES, int WARPS>
__global__ void __launch_bounds__(WARPS * kWarpSize, (M_TILES >= 8 ? 12 : 16) / WARPS)
    quant_gemm_4bit_wgmma_kernel(const QuantGemmParams gp) {
  AG_DYNAMIC_SMEM(smem_raw);
  unsigned char* smem = smem_raw + (1024 - smem_address(smem_raw) % 1024) % 1024;
  wgmma_gemm_piece<M_TILES, WARPS>(gp, smem, TiledPlace::of<32 * WARPS>(gp), blockIdx.y, gp.splits, blockIdx.x);
}

// A balanced launch (gp.stream_blocks): block b computes its run of the plan's units
// (plan_stream_gemm), one piece per column block the run touches. Its own kernel: the loop
// around a piece holds registers across it, which at 3 blocks an SM (the split kernel's
// bound) spill; these launch 1 (8 warps) or 2 (4 warps) blocks an SM.
template <int M_TILES, int WARPS>
__global__ void __launch_bounds__(WARPS * kWarpSize, WARPS == 8 ? 1 : 2)
    quant_gemm_4bit_wgmma_stream_kernel(const QuantGemmParams gp) {
  constexpr int BN = 32 * WARPS;
  AG_DYNAMIC_SMEM(smem_raw);
  unsigned char* smem = smem_raw + (1024 - smem_address(smem_raw) % 1024) % 1024;
  const int64_t stages = gp.q.k / kTiledK;
  const StreamMap map(ceil_div(gp.q.n, BN), stages, gp.stream_blocks);
  const int64_t end = map.start(blockIdx.x + 1);
  for (int64_t u = map.start(blockIdx.x); u < end;) {
    const int64_t col_block = u / stages, s_begin = u % stages;
    const int count = static_cast<int>(end - u < stages - s_begin ? end - u : stages - s_begin);
    const int64_t first = map.block_of(col_block * stages);
    const int64_t last = map.block_of(col_block * stages + stages - 1);
    wgmma_gemm_piece<M_TILES, WARPS>(gp, smem,
                                     TiledPlace::at<BN>(static_cast<int>(col_block), static_cast<int>(s_begin), count),
                                     static_cast<int>(blockIdx.x - first), static_cast<int>(last - first + 1),
                                     static_cast<int>(col_block));
    u += count;
    __syncthreads();  // every warp is done with the ring before the next piece refills it
  }
}

// Whether this build launches the warpgroup kernel: sm_90a device code (AG_WGMMA, defined
// by setup.py for such builds) or the CPU emulation.
#if defined(AG_WGMMA) || defined(AG_EMU_SMEM_ADDRESS)
constexpr bool kWgmmaBuilt = true;
#else
constexpr bool kWgmmaBuilt = false;
#endif

// The tiled GEMM's product by the warpgroup kernel: takes what quant_gemm_4bit_ok takes, in
// builds that have it (kWgmmaBuilt; the caller checks the device is sm_90). Returns false
// otherwise.
inline bool launch_quant_gemm_4bit_wgmma(const QuantGemmParams& p, cudaStream_t stream, bool dependent = false) {
  if (!kWgmmaBuilt || !quant_gemm_4bit_ok(p)) return false;
  dispatch_tiled_shape(p, [&](auto m_tiles, auto warps) {
    constexpr int M_TILES = decltype(m_tiles)::value, WARPS = decltype(warps)::value;
    constexpr int smem = WgmmaLayout<M_TILES, WARPS>::kSmemBytes;
    if (p.stream_blocks > 0) {
      if (smem > 48 * 1024) allow_dynamic_smem<quant_gemm_4bit_wgmma_stream_kernel<M_TILES, WARPS>>(smem);
      launch_tiled_kernel<WARPS>(quant_gemm_4bit_wgmma_stream_kernel<M_TILES, WARPS>, smem, p, stream, dependent);
    } else {
      if (smem > 48 * 1024) allow_dynamic_smem<quant_gemm_4bit_wgmma_kernel<M_TILES, WARPS>>(smem);
      launch_tiled_kernel<WARPS>(quant_gemm_4bit_wgmma_kernel<M_TILES, WARPS>, smem, p, stream, dependent);
    }
  });
  return true;
}

}  // namespace asyncgen
