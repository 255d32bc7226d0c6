// One-row 4-bit decode: a chain of dependent products in one persistent launch.
//
// At one row a Llama layer after its attention is o_proj (+ residual), RMSNorm, gate|up
// (silu(gate) * up), down_proj (+ residual), and the next layer's RMSNorm and q|k|v: as
// separate kernels, six launches whose weights (9-48 MB each) take 2-18 us to stream, so
// every boundary's drain, launch and first DRAM round trip is a large share of the work
// (docs/BENCHMARKS.md, "The one-stream step with parts left out"). This kernel runs such a
// chain as phases of one launch: a phase is one product y = x @ dequant(W), its blocks
// separated from the next phase's by a barrier across the grid, and
//
// - the weights stream through one cp.async ring per thread that runs on across tiles and
//   phases: a block asks for the next phase's first weights (and their group constants)
//   before it waits at the barrier, so the DRAM keeps working across the boundary;
// - a residual epilogue (o_proj, down_proj) adds the product into the residual in place
//   and leaves each block's share of sum(residual^2) in `sumsq`, in the block's own slot;
//   the next phase, given a norm weight, stages RMSNorm(residual) * w as its x, summing
//   the slots in a fixed order (the same in every block, and run to run);
// - a gated epilogue (gate|up, columns gate | up) writes silu(gate) * up.
//
// Rounding follows the separate ops: each product is rounded to fp16, the residual sum is
// rounded before it is normalised, the normalised row before the norm weight multiplies it,
// and silu(gate) before it multiplies up (see triton_rms_norm.py and gemv.cuh).
//
// A phase's layout is the one-row kernel's (gemv.cuh): a tile is 4 * col_threads columns
// (gated: 2 * col_threads gate and as many up columns), the block's other threads split
// K into lanes of even packed rows; tiles go round-robin to the blocks. Each pair of
// packed rows a thread consumes was requested kChainDepth pairs earlier.
//
// The grid barrier needs every block resident at once: the launcher sizes the grid from
// the occupancy of this kernel alone (blocks that wait for SMs held by the kernel ahead
// become resident when it ends). The CPU emulation runs blocks one after another, so there
// each phase is a launch of its own (launch_quant_chain's `split`), which the GPU can also
// do; the results are the same either way.
#pragma once

#include "gemv.cuh"

#if !defined(__CUDACC__) && !defined(__grid_constant__)
#define __grid_constant__
#endif

namespace asyncgen {

constexpr int kChainMaxPhases = 4;
constexpr int kChainThreads = 256;
constexpr int kChainDepth = 4;  // pairs of packed rows in flight per thread
constexpr int kChainMaxBlocks = 1024;
constexpr int kChainMaxSmem = 200 * 1024;  // dynamic shared memory a launch may ask for

enum ChainEpilogue : int {
  kChainOut = 0,       // out[n] = y[n]
  kChainResidual = 1,  // out[n] = out[n] + y[n] (out is the residual); sumsq[block] = the block's sum of out^2
  kChainGated = 2,     // out[j] = silu(y[j]) * y[N / 2 + j]
};

struct ChainPhase {
  const int32_t* qweight;   // [K / 8, N], codes packed along K
  const void* scales;       // [G, N] fp16
  const void* zeros;        // [G, N] fp16
  const void* x;            // [K] fp16: the input, or with norm_weight the residual to normalise
  const void* norm_weight;  // [K] fp16, or null
  void* out;                // see ChainEpilogue
  int64_t qweight_stride, scales_stride, zeros_stride;
  int n, k, group_size;
  int col_threads;  // 4 or 8
  int epilogue;
};

struct ChainParams {
  ChainPhase phase[kChainMaxPhases];
  float* sumsq;       // [kChainMaxBlocks]
  unsigned* barrier;  // [2]: arrivals, generation (zero at first; each barrier leaves arrivals at 0)
  float eps;          // the norm's epsilon
  int first, last;    // the phases this launch runs
  int partials;       // how many sumsq slots the last residual epilogue wrote (its grid)
};

__host__ __device__ __forceinline__ int chain_tiles(const ChainPhase& ph) {
  return ph.epilogue == kChainGated ? ceil_div(ph.n / 2, 2 * ph.col_threads) : ceil_div(ph.n, 4 * ph.col_threads);
}

// Dynamic shared memory: the weight ring [depth][2][threads], the group constants of each
// ring slot [depth][threads] (zeros, then scales), then x.
__host__ __device__ __forceinline__ int quant_chain_smem(int max_k) {
  return kChainDepth * 3 * kChainThreads * 16 + 16 * quant_gemv1_x_slots(max_k);
}

// A thread's place in a phase: its column thread, its range of packed rows, how many
// pairs that is, and how many tiles its block takes.
struct ChainLane {
  int col_thread, begin, pairs, tiles, rows_per_group, first_left;
};

AG_DEVICE ChainLane chain_lane(const ChainPhase& ph, int tid, int block, int grid) {
  ChainLane l;
  const int lanes = kChainThreads / ph.col_threads;
  l.col_thread = tid % ph.col_threads;
  const int rows = ph.k / 8;
  const int per_lane = 2 * ceil_div(ceil_div(rows, lanes), 2);
  l.begin = imin((tid / ph.col_threads) * per_lane, rows);
  l.pairs = (imin(l.begin + per_lane, rows) - l.begin) / 2;
  const int tiles = chain_tiles(ph);
  l.tiles = block < tiles ? ceil_div(tiles - block, grid) : 0;
  l.rows_per_group = ph.group_size / 8;
  l.first_left = l.rows_per_group - l.begin % l.rows_per_group;  // rows to the lane's first group change
  return l;
}

// The first of the 4 columns a thread covers in `tile`; false past the last column.
AG_DEVICE bool chain_col0(const ChainPhase& ph, int col_thread, int tile, int& col0) {
  if (ph.epilogue == kChainGated) {
    const int half = ph.col_threads / 2;
    const int within = tile * 2 * ph.col_threads + 4 * (col_thread % half);
    col0 = (col_thread >= half ? ph.n / 2 : 0) + within;
    return within < ph.n / 2;
  }
  col0 = tile * 4 * ph.col_threads + 4 * col_thread;
  return col0 < ph.n;
}

// Loads that bypass L1: what other blocks of this launch wrote before a grid barrier.
AG_DEVICE uint4 load16_l2(const void* ptr) {
#if defined(__CUDA_ARCH__)
  return __ldcg(reinterpret_cast<const uint4*>(ptr));
#else
  return *reinterpret_cast<const uint4*>(ptr);
#endif
}
AG_DEVICE float load_float_l2(const float* ptr) {
#if defined(__CUDA_ARCH__)
  return __ldcg(ptr);
#else
  return *ptr;
#endif
}
AG_DEVICE __half load_half_l2(const void* ptr) {
#if defined(__CUDA_ARCH__)
  return __ldcg(reinterpret_cast<const __half*>(ptr));
#else
  return *reinterpret_cast<const __half*>(ptr);
#endif
}

struct Uint4x2 {
  uint4 a, b;
};
AG_DEVICE Uint4x2 make_uint4x2(const uint4& a, const uint4& b) { return Uint4x2{a, b}; }

// An 8-byte asynchronous copy (zeros where !pred); immediate in the CPU emulation.
AG_DEVICE void cp_async8(void* smem, const void* gmem, bool pred) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(gmem), "r"(pred ? 8 : 0));
#else
  *reinterpret_cast<uint2*>(smem) = pred ? *reinterpret_cast<const uint2*>(gmem) : make_uint2(0, 0);
#endif
}

// Every block of the grid arrives before any leaves; what a block wrote before it is
// visible to every block after it. `bar` = {arrivals, generation}: the last block to
// arrive resets the arrivals and then advances the generation, which the others wait for.
AG_DEVICE void chain_grid_barrier(unsigned* bar) {
#if defined(__CUDA_ARCH__)
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned generation = *reinterpret_cast<volatile unsigned*>(bar + 1);
    __threadfence();
    if (atomicAdd(bar, 1u) == gridDim.x - 1) {
      atomicExch(bar, 0u);
      __threadfence();
      atomicAdd(bar + 1, 1u);
    } else {
      unsigned now;
      do {
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(now) : "l"(bar + 1) : "memory");
      } while (now == generation);
    }
    __threadfence();
  }
  __syncthreads();
#else
  (void)bar;  // the emulation runs one phase a launch
#endif
}

__global__ void __launch_bounds__(kChainThreads) quant_chain_kernel(const __grid_constant__ ChainParams p) {
  AG_DYNAMIC_SMEM(staged);
  uint4* ring = reinterpret_cast<uint4*>(staged);
  uint4* consts = ring + kChainDepth * 2 * kChainThreads;
  uint4* xs = consts + kChainDepth * kChainThreads;
  constexpr int kWarps = kChainThreads / kWarpSize;
  __shared__ float partial[2][kWarps][kWarpSize];
  __shared__ float inv_rms;
  __shared__ uint32_t masks[3];

  const int tid = threadIdx.x;
  const int block = blockIdx.x;
  const int grid = gridDim.x;
  const int warp = tid / kWarpSize;
  const int lane_id = tid % kWarpSize;

  // The producer: the next pair to request (phase, tile round, pair) and its group count.
  int req_phase = p.first, req_round = 0, req_pair = 0, req_left = 0;
  ChainLane req = chain_lane(p.phase[p.first], tid, block, grid);
  auto settle = [&]() {  // past the phases (or their ends) with nothing left for this thread
    while (req_phase <= p.last && (req.pairs == 0 || req_round >= req.tiles)) {
      ++req_phase;
      req_round = 0;
      req_pair = 0;
      if (req_phase <= p.last) req = chain_lane(p.phase[req_phase], tid, block, grid);
    }
  };
  settle();
  int slot = 0;  // the ring slot consumed next, and refilled right after
  // One commit group per pair, empty past the last phase, so that "at most kChainDepth - 1
  // groups pending" always means the pair in `slot` has landed.
  auto request = [&]() {
    if (req_phase <= p.last) {
      const ChainPhase& ph = p.phase[req_phase];
      int col0 = 0;
      const bool active = chain_col0(ph, req.col_thread, block + req_round * grid, col0);
      const int r = req.begin + 2 * req_pair;
      const int32_t* src = active ? ph.qweight + static_cast<int64_t>(r) * ph.qweight_stride + col0 : ph.qweight;
      cp_async16(ring + (2 * slot) * kChainThreads + tid, src, active);
      cp_async16(ring + (2 * slot + 1) * kChainThreads + tid, active ? src + ph.qweight_stride : src, active);
      if (req_pair == 0 || req_left == 0) {  // a group starts at this pair: its constants come with it
        req_left = req_pair == 0 ? req.first_left : req.rows_per_group;
        const int64_t g = r / req.rows_per_group;
        const __half* z = static_cast<const __half*>(ph.zeros) + (active ? g * ph.zeros_stride + col0 : 0);
        const __half* s = static_cast<const __half*>(ph.scales) + (active ? g * ph.scales_stride + col0 : 0);
        uint2* c = reinterpret_cast<uint2*>(consts + slot * kChainThreads + tid);
        cp_async8(c, z, active);
        cp_async8(c + 1, s, active);
      }
      req_left -= 2;
      if (++req_pair == req.pairs) {
        req_pair = 0;
        ++req_round;
        settle();
      }
    }
    cp_async_commit();
    slot = slot + 1 == kChainDepth ? 0 : slot + 1;
  };
#pragma unroll 1
  for (int u = 0; u < kChainDepth; ++u) request();

  if (tid == 0) {
    masks[0] = 0x000F000Fu;
    masks[1] = 0x00F000F0u;
    masks[2] = 0x64006400u;
  }

#pragma unroll 1
  for (int phase = p.first; phase <= p.last; ++phase) {
    const ChainPhase& ph = p.phase[phase];
    const ChainLane lane = chain_lane(ph, tid, block, grid);
    const int cols = 4 * ph.col_threads;
    if (phase == p.first) {
      grid_dependency_wait();  // everything above reads only weights
    } else {
      chain_grid_barrier(p.barrier);  // the ring already holds this phase's first weights
    }
    if (phase == p.last) launch_dependents();

    // x, in the one-row kernel's order (gemv.cuh): packed row r as the half2 pairs
    // (x[8r + j], x[8r + j + 4]).
    const bool norm = ph.norm_weight != nullptr;
    if (norm) {
      if (warp == 0) {
        float s = 0.f;
        for (int i = lane_id; i < p.partials; i += kWarpSize) s += load_float_l2(p.sumsq + i);
        s = warp_sum(s);
        if (lane_id == 0) inv_rms = rsqrtf(s / static_cast<float>(ph.k) + p.eps);
      }
      __syncthreads();
    }
    const float scale = norm ? inv_rms : 1.f;
    const __half* x = static_cast<const __half*>(ph.x);
    const __half* w = static_cast<const __half*>(ph.norm_weight);
    const int rows = ph.k / 8;
    if (norm) {
      stage_rows(rows, tid, kChainThreads, [&](int r) { return make_uint4x2(load16_l2(x + 8 * r), load16(w + 8 * r)); },
                 [&](int r, const Uint4x2& v) {
                   uint4 out;
                   const __half* in = reinterpret_cast<const __half*>(&v.a);
                   const __half* wh = reinterpret_cast<const __half*>(&v.b);
                   __half* h = reinterpret_cast<__half*>(&out);
#pragma unroll
                   for (int j = 0; j < 8; ++j) {
                     const float normed = round_to<__half>(__half2float(in[j]) * scale);
                     h[j] = __float2half_rn(__half2float(wh[j]) * normed);
                   }
                   xs[x_slot(r)] = x_pairs(out);
                 });
    } else {
      stage_rows(rows, tid, kChainThreads, [&](int r) { return load16_l2(x + 8 * r); },
                 [&](int r, const uint4& raw) { xs[x_slot(r)] = x_pairs(raw); });
    }
    __syncthreads();
    const uint32_t m_lo = masks[0], m_hi = masks[1], magic = masks[2];

    float squares = 0.f;  // residual epilogue: this thread's columns' share of sum(residual^2)
#pragma unroll 1
    for (int round = 0; round < lane.tiles; ++round) {
      float total[4] = {0.f, 0.f, 0.f, 0.f};
      const int tile = block + round * grid;
      // The residual this thread's epilogue adds to, asked for now: loaded at the epilogue it
      // would hold warp 0, and with it the block's next tile, for an L2 round trip.
      const int own = tile * cols + tid;
      const bool adds = ph.epilogue == kChainResidual && tid < cols && own < ph.n;
      const float before = adds ? __half2float(load_half_l2(static_cast<const __half*>(ph.out) + own)) : 0.f;
      QuantGroup grp{};
      int left = 0;
#pragma unroll 1
      for (int i = 0; i < lane.pairs; ++i) {
        const int r = lane.begin + 2 * i;
        cp_async_wait<kChainDepth - 1>();
        if (i == 0 || left == 0) {
          left = i == 0 ? lane.first_left : lane.rows_per_group;
          const uint4 c = consts[slot * kChainThreads + tid];
          grp = make_group(make_uint2(c.x, c.y), make_uint2(c.z, c.w));
        }
        left -= 2;
        const uint4 wa4 = ring[(2 * slot) * kChainThreads + tid], wb4 = ring[(2 * slot + 1) * kChainThreads + tid];
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
        request();  // this slot's words are in registers: refill it, maybe with the next phase's
      }

      // Sum over the K lanes: a warp's with shuffles, then the warps' in shared memory
      // (double-buffered by round, so one barrier a tile suffices).
      float(*part)[kWarpSize] = partial[round & 1];
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        float v = total[c];
        for (int mask = kWarpSize / 2; mask >= ph.col_threads; mask >>= 1) v += __shfl_xor_sync(kFullMask, v, mask);
        if (lane_id < ph.col_threads) part[warp][4 * lane_id + c] = v;
      }
      __syncthreads();
      if (ph.epilogue == kChainGated) {
        const int outs = cols / 2;
        const int j = tile * outs + tid;
        if (tid < outs && j < ph.n / 2) {
          float gate = 0.f, up = 0.f;
#pragma unroll
          for (int k = 0; k < kWarps; ++k) {
            gate += part[k][tid];
            up += part[k][outs + tid];
          }
          static_cast<__half*>(ph.out)[j] =
              __float2half_rn(silu_times<__half>(round_to<__half>(gate), round_to<__half>(up)));
        }
      } else {
        const int n = tile * cols + tid;
        if (tid < cols && n < ph.n) {
          float v = 0.f;
#pragma unroll
          for (int k = 0; k < kWarps; ++k) v += part[k][tid];
          __half* out = static_cast<__half*>(ph.out);
          if (ph.epilogue == kChainResidual) {
            const __half sum = __float2half_rn(round_to<__half>(v) + before);
            out[n] = sum;
            const float f = __half2float(sum);
            squares = fmaf(f, f, squares);
          } else {
            out[n] = __float2half_rn(v);
          }
        }
      }
    }
    if (ph.epilogue == kChainResidual && warp == 0) {  // the columns' threads are all in warp 0
      const float s = warp_sum(squares);
      if (lane_id == 0) p.sumsq[block] = s;
    }
  }
  cp_async_wait<0>();
}

// Whether the chain kernel takes every phase of `p` (first..last).
inline bool quant_chain_ok(const ChainParams& p) {
  if (p.first < 0 || p.last >= kChainMaxPhases || p.first > p.last) return false;
  const auto aligned = [](const void* ptr, int bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; };
  for (int i = p.first; i <= p.last; ++i) {
    const ChainPhase& ph = p.phase[i];
    const bool gated = ph.epilogue == kChainGated;
    if (!(ph.col_threads == 4 || ph.col_threads == 8) || ph.epilogue < kChainOut || ph.epilogue > kChainGated) return false;
    if (ph.k <= 0 || ph.n <= 0 || ph.k % 16 != 0 || ph.group_size % 16 != 0 || ph.k % ph.group_size != 0) return false;
    if (ph.n % (gated ? 8 : 4) != 0 || ph.scales_stride % 4 != 0 || ph.zeros_stride % 4 != 0 || ph.qweight_stride % 4 != 0) return false;
    if (!aligned(ph.x, 16) || !aligned(ph.qweight, 16) || !aligned(ph.scales, 8) || !aligned(ph.zeros, 8)) return false;
    // A normalised phase reads the sums of squares the phase before it left (as the first
    // phase of a launch, the launch before did: the caller's to ensure).
    if (ph.norm_weight != nullptr && (!aligned(ph.norm_weight, 16) || (i > p.first && p.phase[i - 1].epilogue != kChainResidual))) {
      return false;
    }
    if (quant_chain_smem(ph.k) > kChainMaxSmem) return false;
  }
  return true;
}

// Runs phases p.first..p.last: in one launch of `grid` blocks, or with `split` one launch a
// phase (the CPU emulation's way). `grid` must not exceed the blocks that fit the GPU at
// once (quant_chain_max_grid); p.partials is set here.
inline void launch_quant_chain(ChainParams p, int grid, cudaStream_t stream, bool dependent, bool split) {
  int max_k = 0;
  for (int i = p.first; i <= p.last; ++i) max_k = max_k > p.phase[i].k ? max_k : p.phase[i].k;
  const int smem = quant_chain_smem(max_k);
  allow_dynamic_smem<quant_chain_kernel>(kChainMaxSmem);
  p.partials = grid;
  const int first = p.first, last = p.last;
  for (int i = first; i <= last; i = split ? i + 1 : last + 1) {
    p.first = i;
    p.last = split ? i : last;
    if (dependent && i == first) {
      AG_LAUNCH_KERNEL_DEPENDENT(quant_chain_kernel, dim3(grid), dim3(kChainThreads), smem, stream, p);
    } else {
      AG_LAUNCH_KERNEL(quant_chain_kernel, dim3(grid), dim3(kChainThreads), smem, stream, p);
    }
  }
}

}  // namespace asyncgen
