// store_kv_cache: writes each token's key and value rows into its slot of the paged cache
// (asyncgen/_ops/reference.py::store_kv_cache). Slot -1 marks a padding token: skipped.
//
//   key, value        [num_tokens, num_kv_heads, head_dim]     any token/head stride
//   k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim]
//   slot_mapping      [num_tokens] int64 or int32, block_id * block_size + offset
//
// One thread block per token; each thread copies 16-byte vectors (or single elements when
// an address or stride is not 16-byte aligned). The copy is dtype-agnostic: T is a storage
// type of the element's width, and key and cache share one dtype.
//
// Napkin math: 2 * num_kv_heads * head_dim * 2 bytes read and written per token (32 KiB
// per token for 32 kv heads x 128 x fp16): a pure copy, bandwidth-bound.
#pragma once

#include "common.cuh"

namespace asyncgen {

constexpr int kStoreMaxThreads = 512;

struct StoreKVParams {
  const void* key;           // [num_tokens, num_kv_heads, head_dim]
  const void* value;         // [num_tokens, num_kv_heads, head_dim]
  void* k_cache;             // [num_blocks, block_size, num_kv_heads, head_dim]
  void* v_cache;             // [num_blocks, block_size, num_kv_heads, head_dim]
  const void* slot_mapping;  // [num_tokens]
  int64_t key_stride_token, key_stride_head;
  int64_t value_stride_token, value_stride_head;
  int64_t k_stride_block, v_stride_block;
  int num_tokens, num_kv_heads, head_dim, block_size;
};

template <typename T, int VEC>
AG_DEVICE void copy_vec(T* dst, const T* src) {
  if constexpr (VEC * sizeof(T) == 16) {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) dst[i] = src[i];
  }
}

template <typename T, int VEC, typename SlotT>
__global__ void __launch_bounds__(kStoreMaxThreads) store_kv_cache_kernel(const StoreKVParams p) {
  const int token = blockIdx.x;
  const int64_t slot = static_cast<int64_t>(static_cast<const SlotT*>(p.slot_mapping)[token]);
  if (slot < 0) return;
  const int64_t block = slot / p.block_size;
  const int64_t offset = slot % p.block_size;
  const int64_t row = offset * p.num_kv_heads * p.head_dim;  // the slot, inside its block

  const T* key = static_cast<const T*>(p.key) + token * p.key_stride_token;
  const T* value = static_cast<const T*>(p.value) + token * p.value_stride_token;
  T* k_dst = static_cast<T*>(p.k_cache) + block * p.k_stride_block + row;
  T* v_dst = static_cast<T*>(p.v_cache) + block * p.v_stride_block + row;

  const int vecs_per_head = p.head_dim / VEC;
  const int num_vecs = p.num_kv_heads * vecs_per_head;
  for (int i = threadIdx.x; i < num_vecs; i += blockDim.x) {
    const int head = i / vecs_per_head;
    const int d = (i % vecs_per_head) * VEC;
    const int64_t dst = static_cast<int64_t>(head) * p.head_dim + d;
    copy_vec<T, VEC>(k_dst + dst, key + head * p.key_stride_head + d);
    copy_vec<T, VEC>(v_dst + dst, value + head * p.value_stride_head + d);
  }
}

template <typename T, int VEC>
void launch_store_kv_cache_vec(const StoreKVParams& p, bool slot_is_int64, cudaStream_t stream) {
  const int num_vecs = p.num_kv_heads * (p.head_dim / VEC);
  int threads = (num_vecs + kWarpSize - 1) / kWarpSize * kWarpSize;
  if (threads > kStoreMaxThreads) threads = kStoreMaxThreads;
  const dim3 grid(p.num_tokens);
  const dim3 block(threads);
  if (slot_is_int64) {
    auto kernel = store_kv_cache_kernel<T, VEC, int64_t>;
    AG_LAUNCH_KERNEL(kernel, grid, block, 0, stream, p);
  } else {
    auto kernel = store_kv_cache_kernel<T, VEC, int32_t>;
    AG_LAUNCH_KERNEL(kernel, grid, block, 0, stream, p);
  }
}

// T: an unsigned integer type as wide as the element (uint16_t for fp16/bf16).
// `aligned16`: every base pointer is 16-byte aligned and head_dim and every stride are
// multiples of 16 bytes, so whole 16-byte vectors can be moved.
template <typename T>
void launch_store_kv_cache(const StoreKVParams& p, bool slot_is_int64, bool aligned16,
                           cudaStream_t stream) {
  constexpr int VEC = 16 / sizeof(T);
  if (aligned16) {
    launch_store_kv_cache_vec<T, VEC>(p, slot_is_int64, stream);
  } else {
    launch_store_kv_cache_vec<T, 1>(p, slot_is_int64, stream);
  }
}

// ---------------------------------------------------------------------------------------
// rotary_store_kv: rotary embedding (rotate-half, asyncgen/_ops/reference.py::
// rotary_embedding) applied in place to q and k, then store_kv_cache of the rotated k and
// of v, in one launch where the attention layer would otherwise run two (the rotary
// kernel, then the cache write), each mostly launch and latency at a decode step.
//
//   q [num_tokens, num_heads, head_dim], k and v [num_tokens, num_kv_heads, head_dim]
//   (any token/head stride, last dim contiguous), positions [num_tokens],
//   cos_sin [max_position, head_dim] fp32 (cos | sin, one value per rotated pair).
//
// Rotation is in fp32, rounded once to the element type, as in the reference; the cache
// gets the rounded values k holds. A padding token (slot -1) still has its q and k
// rotated, as the reference's two steps do; only its cache writes are skipped.
//
// Two kernels; launch_rotary_store_kv takes the vectorized one whenever
// rotary_store_vec_ok() holds (q, k and v as views of the model's packed qkv rows, fp32
// cos/sin, caches from the allocator) and the element-wise one otherwise.
//
// Napkin math (7B: 32 q and 32 kv heads, head_dim 128, fp16), per token: q|k|v read
// (24 KiB), q and k written back (16 KiB), k and v written to the cache (16 KiB), 512 bytes
// of cos/sin (from L2): 56 KiB, against 64 KiB for the rotary kernel and the cache write
// run apart (which read k twice). Bandwidth-bound past a few tokens; latency-bound below.

struct RotaryStoreParams {
  void* q;
  void* k;
  const void* v;
  void* k_cache;
  void* v_cache;
  const void* positions;
  const float* cos_sin;
  const void* slot_mapping;
  int64_t q_stride_token, q_stride_head, k_stride_token, k_stride_head, v_stride_token, v_stride_head;
  int64_t k_stride_block, v_stride_block, cos_sin_stride;
  int num_tokens, num_heads, num_kv_heads, head_dim, block_size;
};

// -- element-wise ------------------------------------------------------------------------
// A token's work is a list of tasks: one per rotated pair (d, d + head_dim / 2) of each q
// and k head, then one per element of v. Blocks (token, y) stride through the list, so
// a single token still spreads over several SMs. Elements move one at a time (2-byte
// accesses for fp16), so any alignment and stride is taken.

constexpr int kRotaryThreads = 256;
constexpr int kRotaryTasksPerThread = 4;  // sizes the blocks per token
constexpr int kRotaryMaxBlocksPerToken = 16;

template <typename T, typename SlotT, typename PosT>
__global__ void __launch_bounds__(kRotaryThreads) rotary_store_kv_kernel(const RotaryStoreParams p) {
  const int token = blockIdx.x;
  const int half = p.head_dim / 2;
  const int64_t pos = static_cast<int64_t>(static_cast<const PosT*>(p.positions)[token]);
  const float* cs = p.cos_sin + pos * p.cos_sin_stride;
  const int64_t slot = static_cast<int64_t>(static_cast<const SlotT*>(p.slot_mapping)[token]);
  const int64_t block = slot >= 0 ? slot / p.block_size : 0;
  const int64_t row = slot >= 0 ? (slot % p.block_size) * p.num_kv_heads * p.head_dim : 0;
  T* q = static_cast<T*>(p.q) + token * p.q_stride_token;
  T* k = static_cast<T*>(p.k) + token * p.k_stride_token;
  const T* v = static_cast<const T*>(p.v) + token * p.v_stride_token;
  T* k_dst = static_cast<T*>(p.k_cache) + block * p.k_stride_block + row;
  T* v_dst = static_cast<T*>(p.v_cache) + block * p.v_stride_block + row;

  const int rot_tasks = (p.num_heads + p.num_kv_heads) * half;
  const int total = rot_tasks + p.num_kv_heads * p.head_dim;
  for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < total; i += gridDim.y * blockDim.x) {
    if (i < rot_tasks) {
      const int head = i / half, d = i % half;
      const bool is_q = head < p.num_heads;
      const int kv_head = head - p.num_heads;
      T* x = is_q ? q + head * p.q_stride_head : k + kv_head * p.k_stride_head;
      const float x1 = to_float(x[d]), x2 = to_float(x[d + half]);
      const float c = cs[d], s = cs[half + d];
      const T y1 = from_float<T>(x1 * c - x2 * s);
      const T y2 = from_float<T>(x2 * c + x1 * s);
      x[d] = y1;
      x[d + half] = y2;
      if (!is_q && slot >= 0) {
        k_dst[kv_head * p.head_dim + d] = y1;
        k_dst[kv_head * p.head_dim + d + half] = y2;
      }
    } else if (slot >= 0) {
      const int j = i - rot_tasks;
      const int head = j / p.head_dim, d = j % p.head_dim;
      v_dst[head * p.head_dim + d] = v[head * p.v_stride_head + d];
    }
  }
}

// -- vectorized --------------------------------------------------------------------------
// A token's rows are its q heads, then its k heads, then its v heads; one thread takes one
// (token, row, chunk): the V = 16 / sizeof(T) elements at d and the V at d + head_dim / 2
// that rotate-half pairs with them, as two 16-byte vectors, and for a q or k row the
// pairs' cos and sin (V floats each, one or two 16-byte loads):
//
//   row of x  [ x1 = x[d, d+V) | ...... | x2 = x[d+half, d+half+V) | ...... ]
//   cos_sin   [ cos[d, d+V)    | ...... | sin[d, d+V)              | ...... ]
//   y1 = x1 cos - x2 sin  -> x[d, d+V)            (and the cache row, for k)
//   y2 = x2 cos + x1 sin  -> x[d+half, d+half+V)
//   v rows: both vectors copied to the cache row.
//
// The grid is flat over (token, row, chunk), so every thread holds exactly one task and
// makes one round trip to memory: at one 7B decode token that is 768 threads in 6 blocks;
// at a 78-token prompt chunk 468 blocks, spread over every SM. Adjacent threads take
// adjacent chunks of a row, so a warp reads whole contiguous half rows (128 bytes each at
// head_dim 128 in fp16). It takes decode too, where it is expected to be no slower than
// the element-wise kernel, whose threads each take four pairs or elements in turn, a
// round trip apiece; tests/gpu/check_csrc_ops.py times both from 1 to 256 tokens.

constexpr int kRotaryVecThreads = 128;

// 16 bytes of T (16 / sizeof(T) elements) to and from fp32; pack16 rounds to nearest
// even, as from_float does.
template <typename T>
AG_DEVICE void unpack16(const uint4& raw, float (&f)[16 / sizeof(T)]) {
  if constexpr (sizeof(T) == 4) {
    const float* x = reinterpret_cast<const float*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) f[i] = x[i];
  } else {
    Float8<T>::unpack(raw, f);
  }
}

template <typename T>
AG_DEVICE uint4 pack16(const float (&f)[16 / sizeof(T)]) {
  uint4 raw;
  if constexpr (sizeof(T) == 4) {
    float* x = reinterpret_cast<float*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) x[i] = f[i];
  } else {
    uint32_t* w = reinterpret_cast<uint32_t*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = pack2<T>(f[2 * i], f[2 * i + 1]);
  }
  return raw;
}

template <typename T, typename SlotT, typename PosT>
__global__ void __launch_bounds__(kRotaryVecThreads) rotary_store_kv_vec_kernel(const RotaryStoreParams p) {
  constexpr int V = 16 / sizeof(T);
  const int half = p.head_dim / 2;
  const int chunks = half / V;  // vectors in each half of a row
  const int rot_rows = p.num_heads + p.num_kv_heads;
  const int tasks_per_token = (rot_rows + p.num_kv_heads) * chunks;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<int64_t>(p.num_tokens) * tasks_per_token) return;
  const int task = static_cast<int>(i);  // the launcher keeps the count within int
  const int token = task / tasks_per_token;
  const int in_token = task - token * tasks_per_token;
  const int row = in_token / chunks;
  const int d = (in_token - row * chunks) * V;

  if (row >= rot_rows) {  // a v row: a copy
    const int64_t slot = static_cast<int64_t>(static_cast<const SlotT*>(p.slot_mapping)[token]);
    if (slot < 0) return;
    const int head = row - rot_rows;
    const T* src = static_cast<const T*>(p.v) + token * p.v_stride_token + head * p.v_stride_head + d;
    T* dst = static_cast<T*>(p.v_cache) + (slot / p.block_size) * p.v_stride_block +
             ((slot % p.block_size) * p.num_kv_heads + head) * p.head_dim + d;
    const uint4 lo = load16(src), hi = load16(src + half);
    store16(dst, lo);
    store16(dst + half, hi);
    return;
  }

  const bool is_q = row < p.num_heads;
  const int kv_head = row - p.num_heads;
  T* x = is_q ? static_cast<T*>(p.q) + token * p.q_stride_token + row * p.q_stride_head + d
              : static_cast<T*>(p.k) + token * p.k_stride_token + kv_head * p.k_stride_head + d;
  const int64_t pos = static_cast<int64_t>(static_cast<const PosT*>(p.positions)[token]);
  const float* cs = p.cos_sin + pos * p.cos_sin_stride + d;
  float x1[V], x2[V], c[V], s[V];
  unpack16<T>(load16(x), x1);
  unpack16<T>(load16(x + half), x2);
#pragma unroll
  for (int j = 0; j < V; j += 4) {
    const float4 cj = *reinterpret_cast<const float4*>(cs + j);
    const float4 sj = *reinterpret_cast<const float4*>(cs + half + j);
    c[j] = cj.x;
    c[j + 1] = cj.y;
    c[j + 2] = cj.z;
    c[j + 3] = cj.w;
    s[j] = sj.x;
    s[j + 1] = sj.y;
    s[j + 2] = sj.z;
    s[j + 3] = sj.w;
  }
  float y1[V], y2[V];
#pragma unroll
  for (int j = 0; j < V; ++j) {  // as the element-wise kernel, rounded once by pack16
    y1[j] = x1[j] * c[j] - x2[j] * s[j];
    y2[j] = x2[j] * c[j] + x1[j] * s[j];
  }
  const uint4 lo = pack16<T>(y1), hi = pack16<T>(y2);
  store16(x, lo);
  store16(x + half, hi);
  if (!is_q) {
    const int64_t slot = static_cast<int64_t>(static_cast<const SlotT*>(p.slot_mapping)[token]);
    if (slot < 0) return;
    T* dst = static_cast<T*>(p.k_cache) + (slot / p.block_size) * p.k_stride_block +
             ((slot % p.block_size) * p.num_kv_heads + kv_head) * p.head_dim + d;
    store16(dst, lo);
    store16(dst + half, hi);
  }
}

// Whether rotary_store_kv_vec_kernel takes p: every base pointer 16-byte aligned, each half
// of head_dim a whole number of 16-byte vectors of T, every q/k/v and cache block stride a
// multiple of one vector, the cos_sin row stride a multiple of 4 floats (16 bytes), and
// the tasks (and the grid's rounding up of them) countable in an int.
template <typename T>
inline bool rotary_store_vec_ok(const RotaryStoreParams& p) {
  constexpr int64_t V = 16 / sizeof(T);
  const auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  if (!(aligned(p.q) && aligned(p.k) && aligned(p.v) && aligned(p.k_cache) && aligned(p.v_cache) &&
        aligned(p.cos_sin))) {
    return false;
  }
  if (p.head_dim % (2 * V) != 0 || p.cos_sin_stride % 4 != 0) return false;
  for (const int64_t stride : {p.q_stride_token, p.q_stride_head, p.k_stride_token, p.k_stride_head,
                               p.v_stride_token, p.v_stride_head, p.k_stride_block, p.v_stride_block}) {
    if (stride % V != 0) return false;
  }
  const int64_t tasks = static_cast<int64_t>(p.num_tokens) * (p.num_heads + 2 * p.num_kv_heads) * (p.head_dim / 2 / V);
  return tasks <= INT32_MAX - kRotaryVecThreads;
}

// Calls f(SlotT{}, PosT{}) with the index types the flags name.
template <typename F>
void with_index_types(bool slot_is_int64, bool pos_is_int64, F&& f) {
  if (slot_is_int64 && pos_is_int64) {
    f(int64_t{}, int64_t{});
  } else if (slot_is_int64) {
    f(int64_t{}, int32_t{});
  } else if (pos_is_int64) {
    f(int32_t{}, int64_t{});
  } else {
    f(int32_t{}, int32_t{});
  }
}

// T: __half, __nv_bfloat16 or float. Returns whether the vectorized kernel ran.
template <typename T>
bool launch_rotary_store_kv(const RotaryStoreParams& p, bool slot_is_int64, bool pos_is_int64, cudaStream_t stream) {
  if (rotary_store_vec_ok<T>(p)) {
    constexpr int V = 16 / sizeof(T);
    const int tasks = p.num_tokens * (p.num_heads + 2 * p.num_kv_heads) * (p.head_dim / 2 / V);
    const dim3 grid(ceil_div(tasks, kRotaryVecThreads));
    const dim3 block(kRotaryVecThreads);
    with_index_types(slot_is_int64, pos_is_int64, [&](auto slot, auto pos) {
      auto kernel = rotary_store_kv_vec_kernel<T, decltype(slot), decltype(pos)>;
      AG_LAUNCH_KERNEL(kernel, grid, block, 0, stream, p);
    });
    return true;
  }
  const int tasks = (p.num_heads + p.num_kv_heads) * (p.head_dim / 2) + p.num_kv_heads * p.head_dim;
  int blocks = ceil_div(tasks, kRotaryThreads * kRotaryTasksPerThread);
  if (blocks > kRotaryMaxBlocksPerToken) blocks = kRotaryMaxBlocksPerToken;
  const dim3 grid(p.num_tokens, blocks);
  const dim3 block(kRotaryThreads);
  with_index_types(slot_is_int64, pos_is_int64, [&](auto slot, auto pos) {
    auto kernel = rotary_store_kv_kernel<T, decltype(slot), decltype(pos)>;
    AG_LAUNCH_KERNEL(kernel, grid, block, 0, stream, p);
  });
  return false;
}

}  // namespace asyncgen
