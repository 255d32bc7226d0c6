// Torch glue for the prompt-chunk attention kernel (chunk_attention.cuh): argument checks,
// the split partials and the launch on the current stream.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cmath>

#include "check.h"
#include "chunk_attention_wgmma.cuh"
#include "ops.h"

namespace asyncgen {

void chunk_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                     const c10::optional<at::Tensor>& split_counters, double scale, int64_t num_splits,
                     int64_t kernel) {
  AG_CHECK_CUDA(q, q);
  const c10::cuda::CUDAGuard device_guard(q.device());
  check_paged_attention_args(out, q, k_cache, v_cache, block_tables, seq_lens);
  AG_CHECK_CUDA(query_start_loc, q);
  AG_CHECK_DTYPE(query_start_loc, at::kInt);
  const int64_t num_tokens = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(2);
  TORCH_CHECK(chunk_attention_supported(static_cast<int>(head_dim), static_cast<int>(num_heads / num_kv_heads),
                                        static_cast<int>(num_splits)),
              "chunk_attention takes head_dim 64 or 128, at most ", kChunkMaxGroup,
              " query heads per kv head and 1 to ", kChunkMaxSplits, " splits; got head_dim ", head_dim, ", ",
              num_heads / num_kv_heads, " heads per kv head, ", num_splits, " splits");
  // 16-byte copies: every row of q and of the caches starts 16-byte aligned.
  TORCH_CHECK(q.stride(2) == 1 && q.stride(0) % 8 == 0 && q.stride(1) % 8 == 0 && is_aligned16(q),
              "q must be 16-byte aligned with token and head strides that are multiples of 8, got strides ",
              q.strides());
  TORCH_CHECK(out.stride(2) == 1 && out.stride(0) % 2 == 0 && out.stride(1) % 2 == 0 &&
                  reinterpret_cast<uintptr_t>(out.data_ptr()) % 4 == 0,
              "out must be 4-byte aligned with even token and head strides, got strides ", out.strides());
  const int64_t num_seqs = seq_lens.numel();
  TORCH_CHECK(query_start_loc.dim() == 1 && query_start_loc.size(0) == num_seqs + 1 && query_start_loc.is_contiguous(),
              "query_start_loc must be a contiguous [num_seqs + 1=", num_seqs + 1, "], got ", query_start_loc.sizes());
  TORCH_CHECK(num_tokens < (1 << 30) && num_seqs < (1 << 30), "too many tokens or sequences for one call");
  TORCH_CHECK(kernel == 0 || kernel == 1, "chunk_attention's kernel is 0 (mma.sync) or 1 (wgmma), got ", kernel);
  const int64_t block_size = k_cache.size(1);
  TORCH_CHECK(block_size > 0 && (block_size & (block_size - 1)) == 0 && block_size <= kChunkKeys,
              "chunk_attention needs a power-of-two block_size of at most ", kChunkKeys, ", got ", block_size);
  int shift = 0;
  while ((int64_t{1} << shift) < block_size) ++shift;
  const int group = static_cast<int>(num_heads / num_kv_heads);
  if (kernel == 1) {
    TORCH_CHECK(chunk_attention_wgmma_supported(static_cast<int>(head_dim), group, static_cast<int>(num_splits), shift),
                "chunk_attention's wgmma kernel takes head_dim ", kCwHeadDim,
                " in builds with sm_90a code (this one: ", kWgmmaBuilt ? "yes" : "no", "); got head_dim ", head_dim);
    const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
    TORCH_CHECK(prop->major == 9 && prop->minor == 0, "chunk_attention's wgmma kernel needs an sm_90 device, got sm_",
                prop->major, prop->minor);
  }
  if (num_tokens == 0 || num_seqs == 0) return;

  ChunkAttentionParams p{};
  const int grid_x = chunk_grid_x(static_cast<int>(num_tokens), static_cast<int>(num_seqs), group,
                                  kernel == 1 ? kCwRows : kChunkRows);
  at::Tensor part_out, part_ml;
  if (num_splits > 1) {
    TORCH_CHECK(split_counters.has_value(), "chunk_attention with ", num_splits, " splits needs split_counters");
    const at::Tensor& c = *split_counters;
    AG_CHECK_CUDA(c, q);
    AG_CHECK_DTYPE(c, at::kInt);
    TORCH_CHECK(c.dim() == 1 && c.is_contiguous(), "split_counters must be a contiguous 1-d tensor");
    const int64_t needed = static_cast<int64_t>(grid_x) * num_kv_heads;
    TORCH_CHECK(c.numel() >= needed, "split_counters has ", c.numel(), " entries; ", grid_x, " query blocks x ",
                num_kv_heads, " kv heads need ", needed);
    p.split_counters = c.data_ptr<int>();
    const auto opts = q.options().dtype(at::kFloat);
    part_out = at::empty({num_tokens, num_heads, num_splits, head_dim}, opts);
    part_ml = at::empty({num_tokens, num_heads, num_splits, 2}, opts);
    p.part_out = part_out.data_ptr<float>();
    p.part_ml = part_ml.data_ptr<float>();
  }
  p.out = out.data_ptr();
  p.q = q.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.block_tables = block_tables.data_ptr<int>();
  p.seq_lens = seq_lens.data_ptr<int>();
  p.query_start_loc = query_start_loc.data_ptr<int>();
  p.q_stride_token = q.stride(0);
  p.q_stride_head = q.stride(1);
  p.out_stride_token = out.stride(0);
  p.out_stride_head = out.stride(1);
  p.k_stride_block = k_cache.stride(0);
  p.v_stride_block = v_cache.stride(0);
  p.block_table_stride = block_tables.stride(0);
  p.num_tokens = static_cast<int>(num_tokens);
  p.num_seqs = static_cast<int>(num_seqs);
  p.num_heads = static_cast<int>(num_heads);
  p.num_kv_heads = static_cast<int>(num_kv_heads);
  TORCH_CHECK(num_kv_heads * head_dim * kCwKeys < (int64_t{1} << 31), "too many kv heads for chunk_attention");
  p.block_shift = shift;
  p.num_splits = static_cast<int>(num_splits);
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const bool half = q.scalar_type() == at::kHalf;
  const int hd = static_cast<int>(head_dim);
  const bool launched = kernel == 1 ? (half ? launch_chunk_attention_wgmma<__half>(p, hd, stream)
                                            : launch_chunk_attention_wgmma<__nv_bfloat16>(p, hd, stream))
                                    : (half ? launch_chunk_attention<__half>(p, hd, stream)
                                            : launch_chunk_attention<__nv_bfloat16>(p, hd, stream));
  TORCH_CHECK(launched, "no chunk_attention kernel for head_dim ", head_dim);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace asyncgen
