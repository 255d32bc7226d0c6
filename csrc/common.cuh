// Small device helpers shared by the csrc kernels: 16-byte vector conversions for the
// 2-byte float types, warp reductions and integer helpers.
//
// Nothing here includes torch: the kernel headers build with nvcc alone, which keeps
// them compilable (and checkable) apart from the torch glue in the .cu files.
// torch builds extensions with __CUDA_NO_HALF_CONVERSIONS__ and friends, so every
// conversion below is an explicit intrinsic.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#if defined(__CUDACC__)
#include <cuda.h>  // CUtensorMap
#endif

#include <cmath>
#include <cstdint>

#ifndef AG_DEVICE
#define AG_DEVICE __device__ __forceinline__
#endif

// Kernels are launched through this macro so that the launch code can be reused by a
// host-side emulation of the kernels; `kernel` must be a plain name (a function pointer).
#ifndef AG_LAUNCH_KERNEL
#define AG_LAUNCH_KERNEL(kernel, grid, block, smem, stream, ...) \
  kernel<<<(grid), (block), (smem), (stream)>>>(__VA_ARGS__)
#endif

// The same as a launch that may begin before the kernel ahead of it in the stream has
// finished (programmatic dependent launch, sm_90+): the kernel must call
// grid_dependency_wait() before it reads anything that kernel wrote, or writes anything.
#ifndef AG_LAUNCH_KERNEL_DEPENDENT
#define AG_LAUNCH_KERNEL_DEPENDENT(kernel, grid, block, smem, stream, ...) \
  ::asyncgen::launch_dependent((kernel), (grid), (block), (smem), (stream), __VA_ARGS__)
namespace asyncgen {
template <typename... Params, typename... Args>
inline void launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                             const Args&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  (void)cudaLaunchKernelEx(&config, kernel, args...);  // an error stays for cudaGetLastError
}
}  // namespace asyncgen
#endif

// The block's dynamic shared memory (the launch's smem bytes), 16-byte aligned.
#ifndef AG_DYNAMIC_SMEM
#define AG_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif

namespace asyncgen {

// Lets KERNEL be launched with `bytes` (more than the default 48 KiB) of dynamic shared
// memory on the current device, once per kernel and device. A no-op off the GPU.
template <auto KERNEL>
inline void allow_dynamic_smem(int bytes) {
#if defined(__CUDACC__)
  static bool configured[64] = {};  // per device, one set per kernel (a template argument)
  int device = 0;
  cudaGetDevice(&device);
  if (device < 0 || device >= 64 || !configured[device]) {
    cudaFuncSetAttribute(KERNEL, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (device >= 0 && device < 64) configured[device] = true;
  }
#else
  (void)bytes;
#endif
}

// The shared-memory address (offset in the block's shared window) of a pointer into shared
// memory; in the CPU emulation, its offset in the emulated dynamic shared memory.
AG_DEVICE uint32_t smem_address(const void* ptr) {
#if defined(__CUDA_ARCH__)
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
#elif defined(AG_EMU_SMEM_ADDRESS)
  return AG_EMU_SMEM_ADDRESS(ptr);
#else
  return static_cast<uint32_t>(reinterpret_cast<uintptr_t>(ptr));
#endif
}

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

AG_DEVICE int imin(int a, int b) { return a < b ? a : b; }
AG_DEVICE int imax(int a, int b) { return a > b ? a : b; }
__host__ __device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

// ---------------------------------------------------------------------------------------
// One element of a float type to and from fp32 (round to nearest even).

AG_DEVICE float to_float(__half x) { return __half2float(x); }
AG_DEVICE float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
AG_DEVICE float to_float(float x) { return x; }
template <typename T>
AG_DEVICE T from_float(float x);
template <>
AG_DEVICE __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
AG_DEVICE __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
AG_DEVICE float from_float<float>(float x) { return x; }

// x rounded to T and back, as a value stored in T and read again.
template <typename T>
AG_DEVICE float round_to(float x) {
  return to_float(from_float<T>(x));
}

// silu(gate) * up as the separate SiLU-and-multiply op computes it from gate and up stored
// in T: silu rounded to T, then the product (to be rounded to T by the caller's store).
template <typename T>
AG_DEVICE float silu_times(float gate, float up) {
  return round_to<T>(gate / (1.f + __expf(-gate))) * up;
}

// ---------------------------------------------------------------------------------------
// 8 elements of a 2-byte float type travel as one 16-byte uint4.

template <typename T>
struct Float8;

template <>
struct Float8<__half> {
  static AG_DEVICE void unpack(const uint4& raw, float (&f)[8]) {
    const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 t = __half22float2(h[i]);
      f[2 * i] = t.x;
      f[2 * i + 1] = t.y;
    }
  }
};

template <>
struct Float8<__nv_bfloat16> {
  static AG_DEVICE void unpack(const uint4& raw, float (&f)[8]) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 t = __bfloat1622float2(h[i]);
      f[2 * i] = t.x;
      f[2 * i + 1] = t.y;
    }
  }
};

// A 16-byte load; `ptr` must be 16-byte aligned.
template <typename T>
AG_DEVICE uint4 load16(const T* ptr) {
  return *reinterpret_cast<const uint4*>(ptr);
}

// A 16-byte store; `ptr` must be 16-byte aligned.
template <typename T>
AG_DEVICE void store16(T* ptr, const uint4& raw) {
  *reinterpret_cast<uint4*>(ptr) = raw;
}

// ---------------------------------------------------------------------------------------
// Butterfly reductions over lanes that differ in the bits FIRST_MASK..16; every lane ends
// with the result. FIRST_MASK = 1 reduces the whole warp.

template <int FIRST_MASK = 1>
AG_DEVICE float warp_max(float v) {
#pragma unroll
  for (int mask = FIRST_MASK; mask < kWarpSize; mask <<= 1) {
    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, mask));
  }
  return v;
}

template <int FIRST_MASK = 1>
AG_DEVICE float warp_sum(float v) {
#pragma unroll
  for (int mask = FIRST_MASK; mask < kWarpSize; mask <<= 1) {
    v += __shfl_xor_sync(kFullMask, v, mask);
  }
  return v;
}

// ---------------------------------------------------------------------------------------
// The low 16 bits of `bits` as a T (__half or __nv_bfloat16), in fp32.
template <typename T>
AG_DEVICE float bits_to_float(uint32_t bits);
template <>
AG_DEVICE float bits_to_float<__half>(uint32_t bits) {
  __half_raw raw;
  raw.x = static_cast<unsigned short>(bits);
  return __half2float(__half(raw));
}
template <>
AG_DEVICE float bits_to_float<__nv_bfloat16>(uint32_t bits) {
  __nv_bfloat16_raw raw;
  raw.x = static_cast<unsigned short>(bits);
  return __bfloat162float(__nv_bfloat16(raw));
}

// The CPU emulation's m16n8k16 product: gathered from the other lanes, summed in fp32.
template <typename T>
AG_DEVICE void emulated_mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  const int lane = threadIdx.x % kWarpSize;
  const int g = lane / 4, c = lane % 4;
  float sum[4] = {0.f, 0.f, 0.f, 0.f};
  for (int src = 0; src < 4; ++src) {  // the lanes holding k = 2 src, 2 src + 1, 2 src + 8, 2 src + 9
    uint32_t ar[4], b0[2], b1[2];
    for (int r = 0; r < 4; ++r) ar[r] = __shfl_sync(kFullMask, a[r], 4 * g + src);
    for (int r = 0; r < 2; ++r) {
      b0[r] = __shfl_sync(kFullMask, b[r], 4 * (2 * c) + src);
      b1[r] = __shfl_sync(kFullMask, b[r], 4 * (2 * c + 1) + src);
    }
    for (int kh = 0; kh < 2; ++kh) {
      for (int e = 0; e < 2; ++e) {
        const float top = bits_to_float<T>(ar[2 * kh] >> (16 * e));
        const float bottom = bits_to_float<T>(ar[2 * kh + 1] >> (16 * e));
        const float x0 = bits_to_float<T>(b0[kh] >> (16 * e));
        const float x1 = bits_to_float<T>(b1[kh] >> (16 * e));
        sum[0] += top * x0;
        sum[1] += top * x1;
        sum[2] += bottom * x0;
        sum[3] += bottom * x1;
      }
    }
  }
  for (int i = 0; i < 4; ++i) d[i] += sum[i];
}

// One m16n8k16 tensor-core product, D = A * B + D: A (16 x 16, row-major) and B (16 x 8,
// column-major) of T (__half or __nv_bfloat16), fp32 D (16 x 8), each spread over the warp
// as PTX lays out mma.sync fragments. With lane = 4 * g + c:
//   a[0] = A[g][2c, 2c+1]      a[1] = A[g+8][2c, 2c+1]
//   a[2] = A[g][2c+8, 2c+9]    a[3] = A[g+8][2c+8, 2c+9]    (two T per register, low first)
//   b[0] = B[2c, 2c+1][g]      b[1] = B[2c+8, 2c+9][g]
//   d    = D[g][2c], D[g][2c+1], D[g+8][2c], D[g+8][2c+1]
// Off the GPU (the CPU emulation of the kernels) the same product is gathered from the
// other lanes with shuffles and summed in fp32. Call from all 32 lanes of a warp.
template <typename T>
AG_DEVICE void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]);
template <>
AG_DEVICE void mma_m16n8k16<__half>(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#elif defined(__CUDA_ARCH__)
  __trap();  // the launchers route to tensor-core kernels only on sm_80 and newer
#else
  emulated_mma_m16n8k16<__half>(d, a, b);
#endif
}
template <>
AG_DEVICE void mma_m16n8k16<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#elif defined(__CUDA_ARCH__)
  __trap();
#else
  emulated_mma_m16n8k16<__nv_bfloat16>(d, a, b);
#endif
}

// Hides how `v` was computed from the compiler, which then keeps it in a register rather
// than recomputing it where it is used.
AG_DEVICE void opaque(int& v) {
#if defined(__CUDA_ARCH__)
  asm volatile("" : "+r"(v));
#else
  (void)v;
#endif
}

// 2^x by the special-function unit (ex2.approx.ftz: relative error about 2^-22, 0 for
// -inf): one instruction where exp2f adds a range check and a rescale around it.
AG_DEVICE float fast_exp2(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
#else
  return exp2f(x);
#endif
}

// Two floats as one register of two T (round to nearest even), `lo` in the low half.
template <typename T>
AG_DEVICE uint32_t pack2(float lo, float hi);
template <>
AG_DEVICE uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const uint32_t l = __bfloat16_as_ushort(__float2bfloat16_rn(lo));
  const uint32_t h = __bfloat16_as_ushort(__float2bfloat16_rn(hi));
  return l | (h << 16);
}
template <>
AG_DEVICE uint32_t pack2<__half>(float lo, float hi) {
  const uint32_t l = __half_as_ushort(__float2half_rn(lo));
  const uint32_t h = __half_as_ushort(__float2half_rn(hi));
  return l | (h << 16);
}

// Four 8 x 8 matrices of 16-bit elements from shared memory into mma.sync fragments
// (sm_75+): lane 8 j + i passes the address of row i of matrix j (16 bytes, 16-byte
// aligned), and with lane = 4 g + c, r[j] receives matrix j's row g, elements 2c and
// 2c + 1, or with TRANS its rows 2c and 2c + 1 at element g (low half first). Call from
// all 32 lanes of a warp.
template <bool TRANS>
AG_DEVICE void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(row));
  if constexpr (TRANS) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
  }
#elif defined(__CUDA_ARCH__)
  __trap();
#else
  const int lane = threadIdx.x % kWarpSize;
  const int g = lane / 4, c = lane % 4;
  const uintptr_t mine = reinterpret_cast<uintptr_t>(row);
  for (int j = 0; j < 4; ++j) {
    uint32_t lo, hi;
    if (TRANS) {
      const auto* r0 = reinterpret_cast<const uint16_t*>(__shfl_sync(kFullMask, mine, 8 * j + 2 * c));
      const auto* r1 = reinterpret_cast<const uint16_t*>(__shfl_sync(kFullMask, mine, 8 * j + 2 * c + 1));
      lo = r0[g];
      hi = r1[g];
    } else {
      const auto* rg = reinterpret_cast<const uint16_t*>(__shfl_sync(kFullMask, mine, 8 * j + g));
      lo = rg[2 * c];
      hi = rg[2 * c + 1];
    }
    r[j] = lo | (hi << 16);
  }
#endif
}

// Whole-block reductions; `scratch` holds one float per warp. Every thread gets the
// result. Contains __syncthreads(): call from all threads of the block.
template <int NUM_WARPS>
AG_DEVICE float block_max(float v, float* scratch) {
  v = warp_max(v);
  const int warp = threadIdx.x / kWarpSize;
  if (threadIdx.x % kWarpSize == 0) scratch[warp] = v;
  __syncthreads();
  float r = scratch[0];
#pragma unroll
  for (int w = 1; w < NUM_WARPS; ++w) r = fmaxf(r, scratch[w]);
  __syncthreads();  // scratch may be reused right after
  return r;
}

template <int NUM_WARPS>
AG_DEVICE float block_sum(float v, float* scratch) {
  v = warp_sum(v);
  const int warp = threadIdx.x / kWarpSize;
  if (threadIdx.x % kWarpSize == 0) scratch[warp] = v;
  __syncthreads();
  float r = 0.f;
#pragma unroll
  for (int w = 0; w < NUM_WARPS; ++w) r += scratch[w];
  __syncthreads();
  return r;
}

// A barrier among threads 0 .. threads - 1 of the block only (id 1-15; __syncthreads is id 0).
AG_DEVICE void named_barrier_sync(int id, int threads) {
#if defined(__CUDA_ARCH__)
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
#elif defined(AG_EMU_MBARRIER)
  emu::named_barrier(id, threads);
#else
  (void)id, (void)threads;
#endif
}

// atomicAdd with acquire and release semantics at GPU scope (the relaxed atomicAdd orders
// nothing by itself).
AG_DEVICE int atomic_add_acq_rel(int* address, int value) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;\n" : "=r"(old) : "l"(address), "r"(value) : "memory");
  return old;
#elif defined(__CUDA_ARCH__)
  __threadfence();
  const int old = atomicAdd(address, value);
  __threadfence();
  return old;
#else
  return atomicAdd(address, value);
#endif
}

// Whether this block is the last of `num_parts` blocks sharing `counter` to finish (each
// takes a ticket with an atomic add once its partial results are written; the one that
// draws the last ticket may read them all) and, if so, resets the counter to 0 for the
// next launch. Called by every thread of the block, or with NAMED_THREADS > 0 by threads
// 0 .. NAMED_THREADS - 1 only (they meet at named barrier 1).
template <int NAMED_THREADS = 0>
AG_DEVICE bool takes_last_ticket(int* counter, int num_parts) {
  __shared__ int ticket;
  const auto sync = [] {
    if constexpr (NAMED_THREADS > 0) {
      named_barrier_sync(1, NAMED_THREADS);
    } else {
      __syncthreads();
    }
  };
  // The barrier orders every thread's partials before thread 0's ticket, whose acq_rel add
  // releases them device-wide (a fence is cumulative) and, for the last block, acquires the
  // other blocks' (each released with its ticket); the second barrier passes that on to
  // the threads that read them. A fence in every thread before the barrier instead took
  // 0.8-1.5 us of a 64-row GEMM block's store on an H200 (docs/BENCHMARKS.md, run 49).
  sync();
  if (threadIdx.x == 0) ticket = atomic_add_acq_rel(counter, 1);
  sync();
  const bool last = ticket == num_parts - 1;
  if (last && threadIdx.x == 0) *counter = 0;  // ready for the next launch
  return last;
}

// ---------------------------------------------------------------------------------------
// Programmatic dependent launch (sm_90+). grid_dependency_wait: returns once the kernel
// ahead of this one (when this one was launched with AG_LAUNCH_KERNEL_DEPENDENT) has
// finished and its writes are visible; at once otherwise. launch_dependents: lets a
// kernel launched as this one's dependent start now (it waits for this one's results
// itself); no effect otherwise. Both are no-ops before sm_90 and in the CPU emulation.

AG_DEVICE void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

AG_DEVICE void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Asks for the 128-byte line holding `ptr` to be brought into L2; nothing waits for it and
// no register receives it, so it may be issued before grid_dependency_wait() for data no
// kernel ahead writes. A no-op in the CPU emulation.
AG_DEVICE void prefetch_l2(const void* ptr) {
#if defined(__CUDA_ARCH__)
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(ptr));
#else
  (void)ptr;
#endif
}

// ---------------------------------------------------------------------------------------
// Asynchronous 16-byte copies from global to shared memory (sm_80+): they hold no
// registers while in flight. `pred` false writes zeros and reads nothing. A thread's
// copies become visible to it after cp_async_wait<N> leaves at most N of its commit groups
// pending. Elsewhere (the CPU emulation) the copy is immediate.

AG_DEVICE void cp_async16(void* smem, const void* gmem, bool pred) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(pred ? 16 : 0));
#else
  if (pred) {
    *reinterpret_cast<uint4*>(smem) = *reinterpret_cast<const uint4*>(gmem);
  } else {
    *reinterpret_cast<uint4*>(smem) = make_uint4(0, 0, 0, 0);
  }
#endif
}

AG_DEVICE void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

template <int N>
AG_DEVICE void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// ---------------------------------------------------------------------------------------
// Barriers in shared memory (mbarrier, sm_90) and the copies that complete on them, for
// kernels whose warps take roles (some copy, the others compute) and meet at a ring of
// such barriers instead of block-wide ones. A barrier's phase completes when `count`
// arrivals have been made and the bytes announced with expect_tx have landed;
// waiting names the parity of the phase waited for. In the CPU emulation (emu_runtime.h)
// the copies are immediate and a waiting thread yields to the others until the phase
// completes.

AG_DEVICE void mbarrier_init(uint64_t* bar, int count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_address(bar)), "r"(count) : "memory");
#elif defined(AG_EMU_MBARRIER)
  emu::mbarrier_init(bar, count);
#else
  (void)bar, (void)count;
#endif
}

AG_DEVICE void mbarrier_arrive(uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(smem_address(bar))
               : "memory");
#elif defined(AG_EMU_MBARRIER)
  emu::mbarrier_arrive(bar);
#else
  (void)bar;
#endif
}

// `bytes` more to land before the current phase completes, without an arrival.
AG_DEVICE void mbarrier_expect_tx(uint64_t* bar, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(smem_address(bar)), "r"(bytes)
               : "memory");
#elif defined(AG_EMU_MBARRIER)
  emu::mbarrier_expect_tx(bar, bytes);
#else
  (void)bar, (void)bytes;
#endif
}

AG_DEVICE bool mbarrier_try_wait(uint64_t* bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(smem_address(bar)), "r"(parity)
      : "memory");
  return done != 0;
#elif defined(AG_EMU_MBARRIER)
  return emu::mbarrier_phase_done(bar, parity);
#else
  (void)bar, (void)parity;
  return true;
#endif
}

// Returns once the phase of parity `parity` has completed.
AG_DEVICE void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  while (!mbarrier_try_wait(bar, parity)) {
#if !defined(__CUDA_ARCH__) && defined(AG_EMU_MBARRIER)
    emu::yield();
#endif
  }
}

// ---------------------------------------------------------------------------------------
// Tensor maps (sm_90 TMA): a 2-D box of a row-major matrix copied to shared memory by one
// instruction, the box's rows packed one after another, elements past the matrix's edges
// filled with zeros (and counted in the bytes that complete the barrier); optionally in
// the 128-byte swizzle (16-byte piece j of a 128-byte row r at j ^ (r % 8)). On the GPU
// the map is the driver's CUtensorMap, built on the host (make_tma_map_2d) and passed to
// the kernel as a __grid_constant__ parameter; in the CPU emulation, this struct.
#if defined(__CUDACC__)
using TmaMap = CUtensorMap;
#else
struct alignas(64) TmaMap {
  const void* base;
  uint64_t cols, rows, row_bytes;  // the matrix: cols elements a row (the inner dimension)
  uint32_t box_cols, box_rows, elem_bytes;
  bool swizzle128;
};
#endif

// Fetches a tensor map into the copy engine's cache ahead of its first copy.
AG_DEVICE void tma_prefetch_map(const TmaMap* map) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
#else
  (void)map;
#endif
}

// The box whose first element is (column c, row r) of the matrix, into `smem` (128-byte
// aligned; 1024 with the swizzle), completing on `bar` (whose bytes the caller announced).
AG_DEVICE void tma_load_2d(void* smem, const TmaMap* map, int c, int r, uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          smem_address(smem)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c), "r"(r), "r"(smem_address(bar))
      : "memory");
#elif defined(AG_EMU_MBARRIER)
  unsigned char* dst = static_cast<unsigned char*>(smem);
  const unsigned char* src = static_cast<const unsigned char*>(map->base);
  const uint32_t e = map->elem_bytes, row_bytes = map->box_cols * e;
  for (uint32_t i = 0; i < map->box_rows; ++i) {
    for (uint32_t j = 0; j < map->box_cols; ++j) {
      const int64_t gr = static_cast<int64_t>(r) + i, gc = static_cast<int64_t>(c) + j;
      uint32_t off = i * row_bytes + j * e;
      if (map->swizzle128) off ^= ((off >> 7) & 7) << 4;
      if (gr < static_cast<int64_t>(map->rows) && gc < static_cast<int64_t>(map->cols)) {
        std::memcpy(dst + off, src + gr * map->row_bytes + gc * e, e);
      } else {
        std::memset(dst + off, 0, e);
      }
    }
  }
  emu::mbarrier_complete_tx(bar, map->box_rows * row_bytes);
#else
  (void)smem, (void)map, (void)c, (void)r, (void)bar;
#endif
}

}  // namespace asyncgen
