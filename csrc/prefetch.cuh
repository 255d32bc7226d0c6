// prefetch_l2: asks the memory system to bring a byte range into the L2 cache, and returns
// without waiting for it. Nothing is written; the only effect is on later reads' latency.
//
// Why: at small batches a decode step streams every weight once, one product after the
// other, and between the products run short kernels (norms, rotary, the cache write,
// attention over a short context) that move few bytes. While they run, HBM idles. Issued
// on a side stream as soon as the previous product ends, a prefetch of the next product's
// weight keeps HBM busy through that window, and the product then reads from L2.
//
//   [base, base + bytes)   16-byte aligned base; bytes is rounded down to a multiple of 16
//
// One thread per chunk of kPrefetchChunk bytes (the last one shorter), a grid of at most
// kPrefetchMaxBlocks blocks striding over the chunks. On sm_90 each chunk is one bulk
// prefetch (`cp.async.bulk.prefetch.L2`, handled by the copy engine; the thread goes on at
// once); older GPUs get one `prefetch.global.L2` per 128-byte line.
//
// Napkin math: a 4096 x 4096 fp16 weight is 32 MiB, 8,192 chunks: 64 threads a block over
// 16 blocks issue 8 each. At 4.3 TB/s the bytes take 7.8 us to arrive, about the length of
// the attention kernels they overlap at batch 1.
#pragma once

#include "common.cuh"

namespace asyncgen {

constexpr int64_t kPrefetchChunk = 4096;
constexpr int kPrefetchThreads = 64;
constexpr int kPrefetchMaxBlocks = 16;

struct PrefetchParams {
  const void* base;  // 16-byte aligned
  int64_t bytes;     // a multiple of 16
};

// Where the host emulation records each issued range (tests/csrc_emu); nothing on a GPU.
#ifndef AG_EMU_PREFETCH
#define AG_EMU_PREFETCH(ptr, size) ((void)(ptr), (void)(size))
#endif

AG_DEVICE void prefetch_range_l2(const char* ptr, uint32_t size) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(__cvta_generic_to_global(ptr)), "r"(size)
               : "memory");
#elif defined(__CUDA_ARCH__)
  for (uint32_t off = 0; off < size; off += 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(ptr + off));
#else
  AG_EMU_PREFETCH(ptr, size);
#endif
}

__global__ void __launch_bounds__(kPrefetchThreads) prefetch_l2_kernel(const PrefetchParams p) {
  const char* base = static_cast<const char*>(p.base);
  const int64_t num_chunks = (p.bytes + kPrefetchChunk - 1) / kPrefetchChunk;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < num_chunks; c += stride) {
    const int64_t start = c * kPrefetchChunk;
    const int64_t size = p.bytes - start < kPrefetchChunk ? p.bytes - start : kPrefetchChunk;
    prefetch_range_l2(base + start, static_cast<uint32_t>(size));
  }
}

inline int prefetch_num_blocks(int64_t bytes) {
  const int64_t chunks = (bytes + kPrefetchChunk - 1) / kPrefetchChunk;
  const int64_t blocks = (chunks + kPrefetchThreads - 1) / kPrefetchThreads;
  return static_cast<int>(blocks < kPrefetchMaxBlocks ? blocks : kPrefetchMaxBlocks);
}

// Launches nothing for an empty range. `bytes` must already be a multiple of 16.
inline void launch_prefetch_l2(const PrefetchParams& p, cudaStream_t stream) {
  if (p.bytes <= 0) return;
  AG_LAUNCH_KERNEL(prefetch_l2_kernel, dim3(prefetch_num_blocks(p.bytes)), dim3(kPrefetchThreads), 0, stream, p);
}

}  // namespace asyncgen
