// Argument checks shared by the torch glue: every message names the argument.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#define AG_CHECK_CUDA(x, ref) \
  TORCH_CHECK((x).is_cuda() && (x).device() == (ref).device(), #x " must be a CUDA tensor on ", (ref).device(), ", got ", (x).device())
#define AG_CHECK_DIM(x, n) TORCH_CHECK((x).dim() == (n), #x " must have " #n " dims, got shape ", (x).sizes())
#define AG_CHECK_DTYPE(x, t) TORCH_CHECK((x).scalar_type() == (t), #x " must have dtype ", (t), ", got ", (x).scalar_type())
#define AG_CHECK_LAST_DIM_CONTIGUOUS(x) TORCH_CHECK((x).stride(-1) == 1, #x " must be contiguous in its last dim, got strides ", (x).strides())

namespace asyncgen {

// [num_blocks, block_size, num_kv_heads, head_dim] with the inner three dims contiguous;
// the block stride may be larger (a cache that is a slice of a bigger allocation).
inline void check_cache_layout(const at::Tensor& cache, const char* name) {
  TORCH_CHECK(cache.dim() == 4, name, " must be [num_blocks, block_size, num_kv_heads, head_dim], got shape ", cache.sizes());
  const int64_t head_dim = cache.size(3);
  TORCH_CHECK(cache.stride(3) == 1 && cache.stride(2) == head_dim && cache.stride(1) == cache.size(2) * head_dim &&
                  cache.stride(0) >= cache.size(1) * cache.stride(1),
              name, " must be contiguous within a block, got strides ", cache.strides(), " for shape ", cache.sizes());
}

inline bool is_aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

}  // namespace asyncgen
