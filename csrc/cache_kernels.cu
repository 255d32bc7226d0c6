// Torch glue for store_kv_cache (cache_kernels.cuh).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <climits>

#include "cache_kernels.cuh"
#include "check.h"
#include "ops.h"

namespace asyncgen {

void store_kv_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache,
                    const at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  AG_CHECK_DIM(key, 3);
  AG_CHECK_CUDA(key, key);
  AG_CHECK_CUDA(value, key);
  AG_CHECK_CUDA(k_cache, key);
  AG_CHECK_CUDA(v_cache, key);
  AG_CHECK_CUDA(slot_mapping, key);
  TORCH_CHECK(value.sizes() == key.sizes(), "value must have key's shape ", key.sizes(), ", got ", value.sizes());
  check_cache_layout(k_cache, "k_cache");
  check_cache_layout(v_cache, "v_cache");
  TORCH_CHECK(v_cache.sizes().slice(1) == k_cache.sizes().slice(1),
              "v_cache must match k_cache's [block_size, num_kv_heads, head_dim], got ",
              v_cache.sizes(), " vs ", k_cache.sizes());
  TORCH_CHECK(key.size(1) == k_cache.size(2) && key.size(2) == k_cache.size(3),
              "key must be [num_tokens, num_kv_heads=", k_cache.size(2), ", head_dim=", k_cache.size(3),
              "], got ", key.sizes());
  AG_CHECK_DTYPE(value, key.scalar_type());
  AG_CHECK_DTYPE(k_cache, key.scalar_type());
  AG_CHECK_DTYPE(v_cache, key.scalar_type());
  TORCH_CHECK(key.element_size() == 2 || key.element_size() == 4,
              "key must be a 2- or 4-byte dtype, got ", key.scalar_type());
  AG_CHECK_LAST_DIM_CONTIGUOUS(key);
  AG_CHECK_LAST_DIM_CONTIGUOUS(value);
  AG_CHECK_DIM(slot_mapping, 1);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong || slot_mapping.scalar_type() == at::kInt,
              "slot_mapping must be int64 or int32, got ", slot_mapping.scalar_type());
  TORCH_CHECK(slot_mapping.size(0) == key.size(0) && slot_mapping.is_contiguous(),
              "slot_mapping must be a contiguous [num_tokens=", key.size(0), "], got shape ",
              slot_mapping.sizes());
  TORCH_CHECK(key.size(0) <= INT_MAX, "too many tokens: ", key.size(0));
  const int64_t num_tokens = key.size(0);
  if (num_tokens == 0) return;

  const int64_t vec_elems = 16 / key.element_size();
  const bool aligned16 = is_aligned16(key) && is_aligned16(value) && is_aligned16(k_cache) &&
                         is_aligned16(v_cache) && key.size(2) % vec_elems == 0 &&
                         key.stride(0) % vec_elems == 0 && key.stride(1) % vec_elems == 0 &&
                         value.stride(0) % vec_elems == 0 && value.stride(1) % vec_elems == 0 &&
                         k_cache.stride(0) % vec_elems == 0 && v_cache.stride(0) % vec_elems == 0;

  StoreKVParams p{};
  p.key = key.data_ptr();
  p.value = value.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.slot_mapping = slot_mapping.data_ptr();
  p.key_stride_token = key.stride(0);
  p.key_stride_head = key.stride(1);
  p.value_stride_token = value.stride(0);
  p.value_stride_head = value.stride(1);
  p.k_stride_block = k_cache.stride(0);
  p.v_stride_block = v_cache.stride(0);
  p.num_tokens = static_cast<int>(num_tokens);
  p.num_kv_heads = static_cast<int>(k_cache.size(2));
  p.head_dim = static_cast<int>(k_cache.size(3));
  p.block_size = static_cast<int>(k_cache.size(1));

  const c10::cuda::CUDAGuard device_guard(key.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const bool slot_is_int64 = slot_mapping.scalar_type() == at::kLong;
  if (key.element_size() == 2) {
    launch_store_kv_cache<uint16_t>(p, slot_is_int64, aligned16, stream);
  } else {
    launch_store_kv_cache<uint32_t>(p, slot_is_int64, aligned16, stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void rotary_store_kv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions,
                     const at::Tensor& cos_sin_cache, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& slot_mapping) {
  AG_CHECK_DIM(q, 3);
  AG_CHECK_DIM(k, 3);
  AG_CHECK_DIM(v, 3);
  for (const at::Tensor* t : {&k, &v, &positions, &cos_sin_cache, &k_cache, &v_cache, &slot_mapping}) {
    AG_CHECK_CUDA((*t), q);
  }
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat,
              "q must be float16, bfloat16 or float32, got ", q.scalar_type());
  AG_CHECK_DTYPE(k, q.scalar_type());
  AG_CHECK_DTYPE(v, q.scalar_type());
  AG_CHECK_DTYPE(k_cache, q.scalar_type());
  AG_CHECK_DTYPE(v_cache, q.scalar_type());
  AG_CHECK_DTYPE(cos_sin_cache, at::kFloat);
  check_cache_layout(k_cache, "k_cache");
  check_cache_layout(v_cache, "v_cache");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "v_cache must have k_cache's shape ", k_cache.sizes(), ", got ",
              v_cache.sizes());
  const int64_t num_tokens = q.size(0), head_dim = q.size(2);
  TORCH_CHECK(head_dim % 2 == 0, "head_dim must be even for rotate-half, got ", head_dim);
  TORCH_CHECK(k.size(0) == num_tokens && k.size(1) == k_cache.size(2) && k.size(2) == head_dim &&
                  k_cache.size(3) == head_dim,
              "k must be [", num_tokens, ", num_kv_heads=", k_cache.size(2), ", ", head_dim, "], got ", k.sizes());
  TORCH_CHECK(v.sizes() == k.sizes(), "v must have k's shape ", k.sizes(), ", got ", v.sizes());
  AG_CHECK_LAST_DIM_CONTIGUOUS(q);
  AG_CHECK_LAST_DIM_CONTIGUOUS(k);
  AG_CHECK_LAST_DIM_CONTIGUOUS(v);
  TORCH_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.size(1) == head_dim && cos_sin_cache.stride(1) == 1,
              "cos_sin_cache must be [max_position, ", head_dim, "] contiguous in its last dim, got shape ",
              cos_sin_cache.sizes());
  for (const at::Tensor* t : {&positions, &slot_mapping}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == num_tokens && t->is_contiguous(),
                (t == &positions ? "positions" : "slot_mapping"), " must be a contiguous [", num_tokens,
                "], got shape ", t->sizes());
    TORCH_CHECK(t->scalar_type() == at::kLong || t->scalar_type() == at::kInt,
                (t == &positions ? "positions" : "slot_mapping"), " must be int64 or int32, got ", t->scalar_type());
  }
  TORCH_CHECK(num_tokens <= INT_MAX, "too many tokens: ", num_tokens);
  if (num_tokens == 0) return;

  RotaryStoreParams p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.positions = positions.data_ptr();
  p.cos_sin = cos_sin_cache.data_ptr<float>();
  p.slot_mapping = slot_mapping.data_ptr();
  p.q_stride_token = q.stride(0);
  p.q_stride_head = q.stride(1);
  p.k_stride_token = k.stride(0);
  p.k_stride_head = k.stride(1);
  p.v_stride_token = v.stride(0);
  p.v_stride_head = v.stride(1);
  p.k_stride_block = k_cache.stride(0);
  p.v_stride_block = v_cache.stride(0);
  p.cos_sin_stride = cos_sin_cache.stride(0);
  p.num_tokens = static_cast<int>(num_tokens);
  p.num_heads = static_cast<int>(q.size(1));
  p.num_kv_heads = static_cast<int>(k.size(1));
  p.head_dim = static_cast<int>(head_dim);
  p.block_size = static_cast<int>(k_cache.size(1));

  const c10::cuda::CUDAGuard device_guard(q.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const bool slot64 = slot_mapping.scalar_type() == at::kLong, pos64 = positions.scalar_type() == at::kLong;
  if (q.scalar_type() == at::kHalf) {
    launch_rotary_store_kv<__half>(p, slot64, pos64, stream);
  } else if (q.scalar_type() == at::kBFloat16) {
    launch_rotary_store_kv<__nv_bfloat16>(p, slot64, pos64, stream);
  } else {
    launch_rotary_store_kv<float>(p, slot64, pos64, stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace asyncgen
