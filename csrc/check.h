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

// What every paged-attention op checks: q [tokens, heads, head_dim] float16 or bfloat16 and
// out of its shape and dtype, the caches in q's dtype and the layout above (16-byte
// aligned, block strides multiples of 8, head_dim as q's, num_kv_heads dividing q's
// heads), int32 block tables with contiguous rows and int32 contiguous seq_lens, all on
// q's device.
inline void check_paged_attention_args(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                                       const at::Tensor& v_cache, const at::Tensor& block_tables,
                                       const at::Tensor& seq_lens) {
  AG_CHECK_DIM(q, 3);
  AG_CHECK_CUDA(q, q);
  AG_CHECK_CUDA(out, q);
  AG_CHECK_CUDA(k_cache, q);
  AG_CHECK_CUDA(v_cache, q);
  AG_CHECK_CUDA(block_tables, q);
  AG_CHECK_CUDA(seq_lens, q);
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
              "q must be float16 or bfloat16, got ", q.scalar_type());
  AG_CHECK_DTYPE(out, q.scalar_type());
  AG_CHECK_DTYPE(k_cache, q.scalar_type());
  AG_CHECK_DTYPE(v_cache, q.scalar_type());
  AG_CHECK_DTYPE(block_tables, at::kInt);
  AG_CHECK_DTYPE(seq_lens, at::kInt);
  AG_CHECK_LAST_DIM_CONTIGUOUS(q);
  AG_CHECK_LAST_DIM_CONTIGUOUS(out);
  TORCH_CHECK(out.sizes() == q.sizes(), "out must have q's shape ", q.sizes(), ", got ", out.sizes());
  check_cache_layout(k_cache, "k_cache");
  check_cache_layout(v_cache, "v_cache");
  TORCH_CHECK(v_cache.sizes().slice(1) == k_cache.sizes().slice(1),
              "v_cache must match k_cache's [block_size, num_kv_heads, head_dim], got ", v_cache.sizes(), " vs ",
              k_cache.sizes());
  TORCH_CHECK(k_cache.size(3) == q.size(2), "k_cache head_dim ", k_cache.size(3), " != q head_dim ", q.size(2));
  TORCH_CHECK(k_cache.size(2) > 0 && q.size(1) % k_cache.size(2) == 0, "q's num_heads (", q.size(1),
              ") must be a multiple of k_cache's num_kv_heads (", k_cache.size(2), ")");
  TORCH_CHECK(k_cache.stride(0) % 8 == 0 && v_cache.stride(0) % 8 == 0 && is_aligned16(k_cache) &&
                  is_aligned16(v_cache),
              "k_cache and v_cache must be 16-byte aligned with a block stride that is a multiple of 8");
  const int64_t num_seqs = seq_lens.numel();
  AG_CHECK_DIM(block_tables, 2);
  TORCH_CHECK(block_tables.size(0) == num_seqs && block_tables.stride(1) == 1,
              "block_tables must be [num_seqs=", num_seqs, ", max_blocks] with contiguous rows, got shape ",
              block_tables.sizes(), " strides ", block_tables.strides());
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.is_contiguous(), "seq_lens must be a contiguous 1-d tensor, got shape ",
              seq_lens.sizes());
}

}  // namespace asyncgen
