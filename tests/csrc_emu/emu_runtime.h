// A tiny single-threaded CUDA execution model for running the csrc kernel headers on a
// CPU, so their index arithmetic, masking and cross-lane logic can be tested against the
// torch reference without a GPU. Not a performance model.
//
// Each thread of a block is a ucontext fiber; blocks run one after another. Barriers
// (__syncthreads, __syncwarp) and warp shuffles switch fibers until every live thread of
// the block (or warp) has arrived, which also makes divergent barriers show up as a
// deadlock error instead of silently passing. __shared__ becomes `static`: with one block
// at a time, a function-local static is exactly per-block shared memory.
//
// Include this before any csrc header, and compile with a host C++20 compiler and the
// CUDA include directory (for cuda_fp16.h / cuda_bf16.h, which are host-usable).
#pragma once

#define __shared__ static
#define __launch_bounds__(...)
#define __grid_constant__

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <ucontext.h>
#include <vector_functions.h>
#include <vector_types.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

namespace emu {

struct Barrier {
  int expected = 0;
  int arrived = 0;
  unsigned generation = 0;
};

struct Fiber {
  ucontext_t context;
  dim3 thread_idx;
  bool done = false;
};

struct BlockRun {
  std::vector<Fiber> fibers;
  Barrier block_barrier;
  std::vector<Barrier> warp_barriers;
  std::vector<uint64_t> shuffle_slots;  // one per thread
  Barrier named_barriers[16];           // bar.sync id, count (id 0 unused: __syncthreads)
  std::function<void()> body;
  ucontext_t scheduler;
  int current = 0;
  uint64_t events = 0;  // arrivals, releases, exits: progress for deadlock detection
};

inline BlockRun* g_run = nullptr;
inline dim3 g_thread_idx, g_block_idx, g_block_dim, g_grid_dim;
inline std::vector<std::unique_ptr<char[]>> g_stacks;
inline std::vector<unsigned char> g_dynamic_smem;
// Blocks run in launch order (x fastest), or the reverse of it: on a GPU any order can
// happen, and logic that depends on which block finishes last gets both.
inline bool g_reverse_blocks = false;
constexpr size_t kStackBytes = 256 * 1024;

inline int linear_tid() {
  return static_cast<int>(g_thread_idx.x + g_block_dim.x * (g_thread_idx.y + g_block_dim.y * g_thread_idx.z));
}

inline void yield() {
  BlockRun& run = *g_run;
  swapcontext(&run.fibers[run.current].context, &run.scheduler);
}

inline void release_if_complete(Barrier& b) {
  if (b.arrived > 0 && b.arrived == b.expected) {
    b.arrived = 0;
    ++b.generation;
    ++g_run->events;
  }
}

inline void wait(Barrier& b) {
  const unsigned generation = b.generation;
  ++b.arrived;
  ++g_run->events;
  release_if_complete(b);
  while (b.generation == generation) yield();
}

inline void fiber_entry() {
  BlockRun& run = *g_run;
  run.body();
  // An exited thread no longer holds back barriers (as on the hardware).
  const int tid = linear_tid();
  --run.block_barrier.expected;
  release_if_complete(run.block_barrier);
  Barrier& warp = run.warp_barriers[tid / 32];
  --warp.expected;
  release_if_complete(warp);
  run.fibers[run.current].done = true;
  ++run.events;
}

inline void run_block(dim3 block_idx, dim3 block_dim, const std::function<void()>& body) {
  const int num_threads = static_cast<int>(block_dim.x * block_dim.y * block_dim.z);
  if (num_threads % 32 != 0) {
    std::fprintf(stderr, "emu: block size %d is not a multiple of 32\n", num_threads);
    std::abort();
  }
  BlockRun run;
  run.body = body;
  run.fibers.resize(num_threads);
  run.block_barrier.expected = num_threads;
  run.warp_barriers.resize(num_threads / 32);
  for (Barrier& b : run.warp_barriers) b.expected = 32;
  run.shuffle_slots.assign(num_threads, 0);
  while (static_cast<int>(g_stacks.size()) < num_threads) g_stacks.emplace_back(new char[kStackBytes]);
  g_run = &run;
  g_block_idx = block_idx;
  g_block_dim = block_dim;
  for (int t = 0; t < num_threads; ++t) {
    Fiber& f = run.fibers[t];
    f.thread_idx = dim3(t % block_dim.x, (t / block_dim.x) % block_dim.y, t / (block_dim.x * block_dim.y));
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = g_stacks[t].get();
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = &run.scheduler;
    makecontext(&f.context, fiber_entry, 0);
  }
  for (int live = num_threads; live > 0;) {
    const uint64_t events_before = run.events;
    live = 0;
    for (int t = 0; t < num_threads; ++t) {
      if (run.fibers[t].done) continue;
      run.current = t;
      g_thread_idx = run.fibers[t].thread_idx;
      swapcontext(&run.scheduler, &run.fibers[t].context);
      live += run.fibers[t].done ? 0 : 1;
    }
    if (live > 0 && run.events == events_before) {
      std::fprintf(stderr, "emu: deadlock in block (%u, %u, %u): divergent barrier or shuffle\n",
                   block_idx.x, block_idx.y, block_idx.z);
      std::abort();
    }
  }
  g_run = nullptr;
}

template <typename Kernel, typename... Args>
void launch(Kernel kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t /*stream*/,
            const Args&... args) {
  g_grid_dim = grid;
  // Dynamic shared memory: one buffer, reused by the blocks (which run one at a time),
  // filled with a pattern so that reads of unwritten bytes give garbage, not zeros.
  g_dynamic_smem.assign(smem + 16, 0xA5);
  const unsigned total = grid.x * grid.y * grid.z;
  for (unsigned n = 0; n < total; ++n) {
    const unsigned i = g_reverse_blocks ? total - 1 - n : n;
    run_block(dim3(i % grid.x, i / grid.x % grid.y, i / (grid.x * grid.y)), block, [&] { kernel(args...); });
  }
}

}  // namespace emu

#define threadIdx (emu::g_thread_idx)
#define blockIdx (emu::g_block_idx)
#define blockDim (emu::g_block_dim)
#define gridDim (emu::g_grid_dim)
#define AG_LAUNCH_KERNEL(kernel, grid, block, smem, stream, ...) \
  emu::launch(kernel, grid, block, smem, stream, __VA_ARGS__)
#define AG_LAUNCH_KERNEL_DEPENDENT(kernel, grid, block, smem, stream, ...) \
  emu::launch(kernel, grid, block, smem, stream, __VA_ARGS__)
#define AG_DYNAMIC_SMEM(name) \
  unsigned char* name = reinterpret_cast<unsigned char*>( \
      (reinterpret_cast<uintptr_t>(emu::g_dynamic_smem.data()) + 15) / 16 * 16)

// Shared addresses are offsets in the emulated dynamic shared memory (smem_address, and
// the wgmma emulation's reads through a descriptor).
#define AG_EMU_SMEM_ADDRESS(ptr) \
  static_cast<uint32_t>(static_cast<const unsigned char*>(ptr) - emu::g_dynamic_smem.data())
#define AG_EMU_SMEM_AT(address) (emu::g_dynamic_smem.data() + (address))

inline void __syncthreads() { emu::wait(emu::g_run->block_barrier); }

inline void __syncwarp(unsigned mask = 0xffffffffu) {
  if (mask != 0xffffffffu) std::abort();  // only full-warp syncs are modelled
  emu::wait(emu::g_run->warp_barriers[emu::linear_tid() / 32]);
}

namespace emu {

// Every lane of the warp deposits `value`, then reads the one deposited by `source(lane)`.
template <typename T, typename Source>
T shuffle(unsigned mask, T value, int width, Source source) {
  static_assert(sizeof(T) <= sizeof(uint64_t), "shuffle of a wide type");
  if (mask != 0xffffffffu || width != 32) std::abort();
  BlockRun& run = *g_run;
  const int tid = linear_tid();
  const int warp = tid / 32;
  std::memcpy(&run.shuffle_slots[tid], &value, sizeof(T));
  wait(run.warp_barriers[warp]);
  T result;
  std::memcpy(&result, &run.shuffle_slots[warp * 32 + (source(tid % 32) & 31)], sizeof(T));
  wait(run.warp_barriers[warp]);
  return result;
}

}  // namespace emu

namespace emu {

// bar.sync id, threads: a barrier among the first `threads` threads to arrive.
inline void named_barrier(int id, int threads) {
  if (id <= 0 || id >= 16) std::abort();
  Barrier& b = g_run->named_barriers[id];
  if (b.arrived == 0) b.expected = threads;
  if (b.expected != threads) {
    std::fprintf(stderr, "emu: named barrier %d used with %d and %d threads\n", id, b.expected, threads);
    std::abort();
  }
  wait(b);
}

// An mbarrier in its 8 bytes of shared memory: the expected arrivals (bits 0-11), the
// arrivals still pending in the current phase (bits 12-23), the current phase's parity
// (bit 24), and the bytes still to land (bits 32-63, signed: a copy may land before its
// bytes are announced).
struct MbarrierFields {
  uint32_t expected, pending, phase;
  int32_t tx;
};
inline MbarrierFields mbarrier_read(const uint64_t* bar) {
  const uint64_t v = *bar;
  return {static_cast<uint32_t>(v & 0xFFF), static_cast<uint32_t>((v >> 12) & 0xFFF),
          static_cast<uint32_t>((v >> 24) & 1), static_cast<int32_t>(static_cast<uint32_t>(v >> 32))};
}
inline void mbarrier_write(uint64_t* bar, const MbarrierFields& f) {
  *bar = static_cast<uint64_t>(f.expected) | (static_cast<uint64_t>(f.pending) << 12) |
         (static_cast<uint64_t>(f.phase) << 24) | (static_cast<uint64_t>(static_cast<uint32_t>(f.tx)) << 32);
}
inline void mbarrier_init(uint64_t* bar, int count) {
  if (count <= 0 || count >= 4096) std::abort();
  mbarrier_write(bar, {static_cast<uint32_t>(count), static_cast<uint32_t>(count), 0, 0});
}
inline void mbarrier_settle(uint64_t* bar, MbarrierFields f) {
  if (f.pending == 0 && f.tx == 0) {  // the phase completes; the next one begins
    f.pending = f.expected;
    f.phase ^= 1;
  }
  mbarrier_write(bar, f);
  ++g_run->events;
}
inline void mbarrier_arrive(uint64_t* bar) {
  MbarrierFields f = mbarrier_read(bar);
  if (f.pending == 0) {
    std::fprintf(stderr, "emu: arrival at an mbarrier with none pending\n");
    std::abort();
  }
  --f.pending;
  mbarrier_settle(bar, f);
}
inline void mbarrier_expect_tx(uint64_t* bar, uint32_t bytes) {
  MbarrierFields f = mbarrier_read(bar);
  f.tx += static_cast<int32_t>(bytes);
  mbarrier_settle(bar, f);
}
inline void mbarrier_complete_tx(uint64_t* bar, uint32_t bytes) {
  MbarrierFields f = mbarrier_read(bar);
  f.tx -= static_cast<int32_t>(bytes);
  mbarrier_settle(bar, f);
}
// Whether the phase of parity `parity` has completed: the current phase is the other one.
inline bool mbarrier_phase_done(const uint64_t* bar, uint32_t parity) {
  return mbarrier_read(bar).phase != (parity & 1);
}

}  // namespace emu

#define AG_EMU_MBARRIER 1

template <typename T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32) {
  return emu::shuffle(mask, value, width, [&](int lane) { return lane ^ lane_mask; });
}

template <typename T>
T __shfl_sync(unsigned mask, T value, int source_lane, int width = 32) {
  return emu::shuffle(mask, value, width, [&](int) { return source_lane; });
}

// Whether any lane of the mask has `predicate` set (every lane gets the same answer).
inline int __any_sync(unsigned mask, int predicate) {
  int any = predicate != 0;
  for (int lane_mask = 1; lane_mask < 32; lane_mask <<= 1) any |= __shfl_xor_sync(mask, any, lane_mask);
  return any;
}

inline float __expf(float x) { return std::exp(x); }

// Blocks run one at a time, so atomics and fences need no more than plain memory.
inline int atomicAdd(int* address, int value) {
  const int old = *address;
  *address = old + value;
  return old;
}
inline void __threadfence() {}
template <typename T>
T __ldcg(const T* address) {
  return *address;
}
