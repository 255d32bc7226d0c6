// Torch-facing entry points of the csrc extension, registered in bindings.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

namespace asyncgen {

// k_cache[slot // block_size, slot % block_size] = key[token] (same for value) for every
// token whose slot_mapping entry is >= 0.
void store_kv_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache,
                    const at::Tensor& v_cache, const at::Tensor& slot_mapping);

// Rotary embedding (rotate-half) applied to q and k in place, then store_kv_cache of the
// rotated k and of v, in one launch. cos_sin_cache: [max_position, head_dim] fp32.
void rotary_store_kv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions,
                     const at::Tensor& cos_sin_cache, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& slot_mapping);

// Decode attention (one query token per sequence) into `out`. max_seq_len must bound
// seq_lens from above; it sizes the split-K partitions. sliding_window <= 0: no window.
// partition_size: < 0 automatic, 0 single pass, > 0 split-K with that many tokens each.
void paged_attention_decode(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale, int64_t max_seq_len,
                            int64_t sliding_window, int64_t partition_size);

// paged_attention_decode of this step's q and k before rotary: rotates q (q itself is
// not written) and k, writes the rotated k and v into slot_mapping's slots (skipping
// slots < 0), then attends, the new token included. positions and slot_mapping: int64
// [num_seqs]; at most 8 query heads per kv head. split_counters (int32, all 0, at least
// num_seqs * num_kv_heads entries; left all 0): the last partition of a split combines
// them instead of a second kernel. The caller owns it; launches that may run at once
// need their own.
void rotary_paged_attention_decode(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k,
                                   const at::Tensor& v, const at::Tensor& positions, const at::Tensor& cos_sin_cache,
                                   const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                   const at::Tensor& seq_lens, const c10::optional<at::Tensor>& split_counters,
                                   double scale, int64_t max_seq_len, int64_t sliding_window,
                                   int64_t partition_size);

// Causal attention of prompt chunks (any query counts) over each sequence's paged K/V
// cache, on tensor cores (sm_80+): fp16 or bf16, head_dim 64 or 128, at most 8 query
// heads per kv head, no sliding window; block_tables, seq_lens and query_start_loc int32.
// num_splits > 1 splits each query tile's keys over that many blocks, and the last to
// finish combines them: split_counters (int32, all 0, at least
// (num_tokens / (64 / group) + num_seqs) * num_kv_heads entries; left all 0) is then
// required. The caller owns it; launches that may run at once need their own. kernel 1
// takes the warpgroup kernel (chunk_attention_wgmma.cuh: head_dim 128, sm_90 devices,
// builds with sm_90a code; 128 query rows a block, so (num_tokens / (128 / group) +
// num_seqs) * num_kv_heads counters).
void chunk_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                     const c10::optional<at::Tensor>& split_counters, double scale, int64_t num_splits,
                     int64_t kernel);

// out[m, n] = sum_k x[m, k] * weight[n, k] (+ bias[n]) for 1 to 8 rows of x; fp16 or bf16.
// warps_per_row: 1, 2, 4 or 8 warps share each output feature (0: one). gated: weight is
// gate | up (2 D rows) and out [M, D] = silu(x W_gate^T) * (x W_up^T), at most 4 warps a row.
void dense_gemv(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                const c10::optional<at::Tensor>& bias, int64_t warps_per_row, bool gated);

// out = x @ W (+ bias) for 1 to 64 rows of fp16 x, W given as 4-bit codes packed along K
// (qweight [K / 8, N] int32) with fp16 scales and zero points [ceil(K / group_size), N].
// kernel: 0 the tensor-core kernel where it takes the call, else the CUDA-core one (up to
// 8 rows); 1 the CUDA-core kernel; 2 the tensor-core kernel. gated (one row, kernel 0 or
// 1, N a multiple of 8): W is gate | up (N / 2 columns each) and out [1, N / 2] =
// silu(x W_gate) * (x W_up), from the one-row kernel.
void quant_gemv_4bit(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight,
                     const at::Tensor& scales, const at::Tensor& zeros, int64_t group_size,
                     const c10::optional<at::Tensor>& bias, int64_t kernel, bool gated);

// quant_gemv_4bit's product for 1 to 64 rows by the tiled tensor-core GEMM (quant_gemm.cuh):
// blocks of `warps` (4 or 8) warps own 32 * warps columns; splits > 1 divides K over that
// many blocks per column range, which then need a workspace (fp32, at least splits * M * N)
// and counters (int32, all 0, one per column range; left all 0). The caller owns both;
// launches that may run at once need their own. K and group_size multiples of 64. wgmma 1:
// the same product by the warpgroup kernel (quant_wgmma.cuh), 2: by the warpgroup kernel
// with producer warps (quant_ws.cuh; `warps` its consumer warps); both sm_90a builds on
// sm_90 GPUs.
void quant_gemm_4bit(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight,
                     const at::Tensor& scales, const at::Tensor& zeros, int64_t group_size,
                     const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& workspace,
                     const c10::optional<at::Tensor>& counters, int64_t warps, int64_t splits, int64_t wgmma);
}  // namespace asyncgen
