// Torch glue for the paged-attention decode kernels (paged_attention.cuh): argument
// checks, the split-K plan, scratch buffers and the launch on the current stream.
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <climits>

#include "check.h"
#include "launch_policy.h"
#include "ops.h"
#include "paged_attention.cuh"

namespace asyncgen {

// Instantiated in paged_attention_fp16.cu / paged_attention_bf16.cu.
extern template bool launch_paged_attention_decode<__half>(const DecodeParams& p, cudaStream_t stream,
                                                             bool dependent);
extern template bool launch_paged_attention_decode<__nv_bfloat16>(const DecodeParams& p, cudaStream_t stream,
                                                             bool dependent);

namespace {

int clamp_to_int(int64_t x) { return static_cast<int>(x > INT_MAX ? INT_MAX : x); }

}  // namespace

namespace {

// Checks the decode arguments, plans the partitions, allocates the partials and fills
// the parameters the two ops share; returns false for an empty batch.
bool prepare_decode(DecodeParams& p, at::Tensor (&parts)[3], const at::Tensor& out, const at::Tensor& q,
                    const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
                    const at::Tensor& seq_lens, double scale, int64_t max_seq_len, int64_t sliding_window,
                    int64_t partition_size) {
  check_paged_attention_args(out, q, k_cache, v_cache, block_tables, seq_lens);
  const int64_t num_seqs = q.size(0);
  const int64_t num_heads = q.size(1);
  const int64_t head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1);
  const int64_t num_kv_heads = k_cache.size(2);
  TORCH_CHECK(decode_supports_head_dim(static_cast<int>(head_dim)),
              "head_dim must be 64, 128 or 256, got ", head_dim);
  TORCH_CHECK(block_size % kTile == 0, "k_cache block_size must be a multiple of ", kTile, ", got ", block_size);
  TORCH_CHECK(seq_lens.size(0) == num_seqs, "seq_lens must be [num_seqs=", num_seqs, "], got shape ",
              seq_lens.sizes());
  TORCH_CHECK(max_seq_len >= 0, "max_seq_len must be >= 0, got ", max_seq_len);
  TORCH_CHECK(partition_size < 0 || partition_size % kTile == 0,
              "partition_size must be < 0 (automatic), 0 (single pass) or a multiple of ", kTile,
              ", got ", partition_size);
  TORCH_CHECK(num_seqs <= 65535, "at most 65535 sequences per call, got ", num_seqs);
  if (num_seqs == 0) return false;

  const int window = sliding_window > 0 ? clamp_to_int(sliding_window) : 0;
  const DecodePlan plan = plan_decode(
      static_cast<int>(num_seqs), static_cast<int>(num_heads), static_cast<int>(num_kv_heads),
      clamp_to_int(max_seq_len), window, multiprocessor_count(q.get_device()),
      static_cast<int>(partition_size < 0 ? -1 : partition_size));

  if (plan.num_partitions > 1) {
    const auto opts = q.options().dtype(at::kFloat);
    parts[0] = at::empty({num_seqs, num_heads, plan.num_partitions}, opts);
    parts[1] = at::empty({num_seqs, num_heads, plan.num_partitions}, opts);
    parts[2] = at::empty({num_seqs, num_heads, plan.num_partitions, head_dim}, opts);
  }

  p = DecodeParams{};
  p.out = out.data_ptr();
  p.q = q.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.block_tables = block_tables.data_ptr<int>();
  p.seq_lens = seq_lens.data_ptr<int>();
  p.part_max = plan.num_partitions > 1 ? parts[0].data_ptr<float>() : nullptr;
  p.part_sum = plan.num_partitions > 1 ? parts[1].data_ptr<float>() : nullptr;
  p.part_out = plan.num_partitions > 1 ? parts[2].data_ptr<float>() : nullptr;
  p.out_stride_seq = out.stride(0);
  p.out_stride_head = out.stride(1);
  p.q_stride_seq = q.stride(0);
  p.q_stride_head = q.stride(1);
  p.k_stride_block = k_cache.stride(0);
  p.v_stride_block = v_cache.stride(0);
  p.block_table_stride = block_tables.stride(0);
  p.num_seqs = static_cast<int>(num_seqs);
  p.num_heads = static_cast<int>(num_heads);
  p.num_kv_heads = static_cast<int>(num_kv_heads);
  p.head_dim = static_cast<int>(head_dim);
  p.block_size = static_cast<int>(block_size);
  p.sliding_window = window;
  p.partition_size = plan.partition_size;
  p.max_partitions = plan.num_partitions;
  p.scale = static_cast<float>(scale);
  return true;
}

void launch_decode_checked(const DecodeParams& p, const at::Tensor& q) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const bool dependent = p.cos_sin != nullptr && dependent_launch(q.get_device());
  const bool launched = q.scalar_type() == at::kHalf
                            ? launch_paged_attention_decode<__half>(p, stream, dependent)
                            : launch_paged_attention_decode<__nv_bfloat16>(p, stream, dependent);
  TORCH_CHECK(launched, "no decode kernel for head_dim ", p.head_dim, " and ", p.num_heads / p.num_kv_heads,
              " query heads per kv head");
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void paged_attention_decode(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale, int64_t max_seq_len,
                            int64_t sliding_window, int64_t partition_size) {
  AG_CHECK_CUDA(q, q);
  const c10::cuda::CUDAGuard device_guard(q.device());
  DecodeParams p;
  at::Tensor parts[3];
  if (!prepare_decode(p, parts, out, q, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len,
                      sliding_window, partition_size)) {
    return;
  }
  launch_decode_checked(p, q);
}

void rotary_paged_attention_decode(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k,
                                   const at::Tensor& v, const at::Tensor& positions, const at::Tensor& cos_sin_cache,
                                   const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                   const at::Tensor& seq_lens, const c10::optional<at::Tensor>& split_counters,
                                   double scale, int64_t max_seq_len, int64_t sliding_window,
                                   int64_t partition_size) {
  AG_CHECK_CUDA(q, q);
  const c10::cuda::CUDAGuard device_guard(q.device());
  DecodeParams p;
  at::Tensor parts[3];
  AG_CHECK_DIM(k, 3);
  AG_CHECK_DIM(v, 3);
  AG_CHECK_CUDA(k, q);
  AG_CHECK_CUDA(v, q);
  AG_CHECK_CUDA(positions, q);
  AG_CHECK_CUDA(cos_sin_cache, q);
  AG_CHECK_CUDA(slot_mapping, q);
  AG_CHECK_DTYPE(k, q.scalar_type());
  AG_CHECK_DTYPE(v, q.scalar_type());
  AG_CHECK_DTYPE(positions, at::kLong);
  AG_CHECK_DTYPE(slot_mapping, at::kLong);
  AG_CHECK_DTYPE(cos_sin_cache, at::kFloat);
  AG_CHECK_LAST_DIM_CONTIGUOUS(k);
  AG_CHECK_LAST_DIM_CONTIGUOUS(v);
  AG_CHECK_DIM(cos_sin_cache, 2);
  AG_CHECK_LAST_DIM_CONTIGUOUS(cos_sin_cache);
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(1) == k_cache.size(2) && k.size(2) == q.size(2),
              "k must be [num_seqs=", q.size(0), ", num_kv_heads=", k_cache.size(2), ", head_dim=", q.size(2),
              "], got ", k.sizes());
  TORCH_CHECK(v.sizes() == k.sizes(), "v must have k's shape ", k.sizes(), ", got ", v.sizes());
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == q.size(0) && positions.is_contiguous(),
              "positions must be a contiguous [num_seqs=", q.size(0), "], got ", positions.sizes());
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == q.size(0) && slot_mapping.is_contiguous(),
              "slot_mapping must be a contiguous [num_seqs=", q.size(0), "], got ", slot_mapping.sizes());
  TORCH_CHECK(cos_sin_cache.size(1) == q.size(2), "cos_sin_cache must have head_dim=", q.size(2),
              " columns (cos | sin), got ", cos_sin_cache.sizes());
  TORCH_CHECK(q.size(1) <= k_cache.size(2) * kMaxHeadsPerBlock, "the fused rotary takes at most ",
              kMaxHeadsPerBlock, " query heads per kv head, got ", q.size(1), " for ", k_cache.size(2));
  if (!prepare_decode(p, parts, out, q, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len,
                      sliding_window, partition_size)) {
    return;
  }
  p.k_new = k.data_ptr();
  p.v_new = v.data_ptr();
  p.k_new_stride_seq = k.stride(0);
  p.k_new_stride_head = k.stride(1);
  p.v_new_stride_seq = v.stride(0);
  p.v_new_stride_head = v.stride(1);
  p.positions = positions.data_ptr<int64_t>();
  p.slot_mapping = slot_mapping.data_ptr<int64_t>();
  p.cos_sin = cos_sin_cache.data_ptr<float>();
  p.cos_sin_stride = cos_sin_cache.stride(0);
  if (p.max_partitions > 1 && split_counters.has_value()) {
    const at::Tensor& c = *split_counters;
    AG_CHECK_CUDA(c, q);
    AG_CHECK_DTYPE(c, at::kInt);
    TORCH_CHECK(c.dim() == 1 && c.is_contiguous(), "split_counters must be a contiguous 1-d tensor");
    // One counter per block column (kv head; one head chunk with the fused rotary) and sequence.
    const int64_t needed = static_cast<int64_t>(p.num_seqs) * p.num_kv_heads;
    TORCH_CHECK(c.numel() >= needed, "split_counters has ", c.numel(), " entries; ", p.num_seqs, " sequences x ",
                p.num_kv_heads, " kv heads need ", needed);
    p.split_counters = c.data_ptr<int>();
  }
  launch_decode_checked(p, q);
}

}  // namespace asyncgen
