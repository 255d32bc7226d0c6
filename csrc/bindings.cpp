// The one place the extension's ops are declared to torch. After `import asyncgen._C`
// they are torch.ops.asyncgen_C.<name>; the Python launchers live in
// asyncgen/_ops/cuda_backend.py.
#include <torch/extension.h>
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(asyncgen_C, m) {
  m.def(
      "store_kv_cache(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_mapping) -> ()");
  m.def(
      "rotary_store_kv(Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor positions, Tensor cos_sin_cache, "
      "Tensor(c!) k_cache, Tensor(d!) v_cache, Tensor slot_mapping) -> ()");
  m.def(
      "paged_attention_decode(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
      "Tensor block_tables, Tensor seq_lens, float scale, int max_seq_len, int sliding_window, "
      "int partition_size=-1) -> ()");
  m.def(
      "rotary_paged_attention_decode(Tensor(a!) out, Tensor q, Tensor k, Tensor v, Tensor positions, "
      "Tensor cos_sin_cache, Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slot_mapping, Tensor block_tables, "
      "Tensor seq_lens, Tensor(d!)? split_counters, float scale, int max_seq_len, int sliding_window, "
      "int partition_size=-1) -> ()");
  m.def(
      "chunk_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor query_start_loc, Tensor(b!)? split_counters, float scale, int num_splits=1, "
      "int kernel=0) -> ()");
  m.def(
      "dense_gemv(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias, int warps_per_row=0, "
      "bool gated=False) -> ()");
  m.def(
      "quant_gemv_4bit(Tensor(a!) out, Tensor x, Tensor qweight, Tensor scales, Tensor zeros, "
      "int group_size, Tensor? bias, int kernel=0, bool gated=False) -> ()");
  m.def(
      "quant_gemm_4bit(Tensor(a!) out, Tensor x, Tensor qweight, Tensor scales, Tensor zeros, "
      "int group_size, Tensor? bias, Tensor(b!)? workspace, Tensor(c!)? counters, int warps=4, int splits=1, "
      "int wgmma=0) -> ()");
}

TORCH_LIBRARY_IMPL(asyncgen_C, CUDA, m) {
  m.impl("store_kv_cache", &asyncgen::store_kv_cache);
  m.impl("rotary_store_kv", &asyncgen::rotary_store_kv);
  m.impl("paged_attention_decode", &asyncgen::paged_attention_decode);
  m.impl("rotary_paged_attention_decode", &asyncgen::rotary_paged_attention_decode);
  m.impl("chunk_attention", &asyncgen::chunk_attention);
  m.impl("dense_gemv", &asyncgen::dense_gemv);
  m.impl("quant_gemv_4bit", &asyncgen::quant_gemv_4bit);
  m.impl("quant_gemm_4bit", &asyncgen::quant_gemm_4bit);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.doc() = "asyncgen CUDA kernels; the ops are registered under torch.ops.asyncgen_C";
  // Whether quant_gemm_4bit takes wgmma=1 or 2: the build has sm_90a code (setup.py).
#ifdef AG_WGMMA
  module.attr("has_wgmma") = true;
#else
  module.attr("has_wgmma") = false;
#endif
}
