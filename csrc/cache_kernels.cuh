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
// of v, in one launch. A decode step otherwise runs two short kernels per layer here, each
// mostly launch and latency (on an H200 at one token about 2.4 and 1.8 us).
//
//   q [num_tokens, num_heads, head_dim], k and v [num_tokens, num_kv_heads, head_dim]
//   (any token/head stride, last dim contiguous), positions [num_tokens],
//   cos_sin [max_position, head_dim] fp32 (cos | sin, one value per rotated pair).
//
// A token's work is a list of tasks: one per rotated pair (d, d + head_dim / 2) of each q
// and k head, then one per element of v. Blocks (token, y) stride through the list, so
// a single token still spreads over several SMs. Rotation is in fp32, rounded once to the
// element type, as in the reference; the cache gets the rounded values k holds. Elements
// move one at a time, which suits a decode step's few tokens: past 8 tokens the backend
// (asyncgen/_ops/cuda_backend.py) runs the vectorized rotary and cache-write kernels.

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

// T: __half, __nv_bfloat16 or float.
template <typename T>
void launch_rotary_store_kv(const RotaryStoreParams& p, bool slot_is_int64, bool pos_is_int64, cudaStream_t stream) {
  const int tasks = (p.num_heads + p.num_kv_heads) * (p.head_dim / 2) + p.num_kv_heads * p.head_dim;
  int blocks = ceil_div(tasks, kRotaryThreads * kRotaryTasksPerThread);
  if (blocks > kRotaryMaxBlocksPerToken) blocks = kRotaryMaxBlocksPerToken;
  const dim3 grid(p.num_tokens, blocks);
  const dim3 block(kRotaryThreads);
  if (slot_is_int64 && pos_is_int64) {
    auto kernel = rotary_store_kv_kernel<T, int64_t, int64_t>;
    AG_LAUNCH_KERNEL(kernel, grid, block, 0, stream, p);
  } else if (slot_is_int64) {
    auto kernel = rotary_store_kv_kernel<T, int64_t, int32_t>;
    AG_LAUNCH_KERNEL(kernel, grid, block, 0, stream, p);
  } else if (pos_is_int64) {
    auto kernel = rotary_store_kv_kernel<T, int32_t, int64_t>;
    AG_LAUNCH_KERNEL(kernel, grid, block, 0, stream, p);
  } else {
    auto kernel = rotary_store_kv_kernel<T, int32_t, int32_t>;
    AG_LAUNCH_KERNEL(kernel, grid, block, 0, stream, p);
  }
}

}  // namespace asyncgen
