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

}  // namespace asyncgen
