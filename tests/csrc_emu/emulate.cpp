// C entry points over the csrc kernel headers, run by the CPU emulator (emu_runtime.h);
// loaded with ctypes by tests/test_csrc_emulated.py. The structs are filled from Python
// with the same layout as the C++ ones.
#include "emu_runtime.h"

#include "cache_kernels.cuh"
#include "chunk_attention_wgmma.cuh"
#include "gemv.cuh"
#include "paged_attention.cuh"
#include "quant_gemm.cuh"
#include "quant_ws.cuh"

using asyncgen::ChunkAttentionParams;
using asyncgen::DecodeParams;
using asyncgen::DenseGemvParams;
using asyncgen::QuantGemmParams;
using asyncgen::QuantGemvParams;
using asyncgen::RotaryStoreParams;
using asyncgen::StoreKVParams;

extern "C" {

void ag_set_reverse_blocks(int reverse) { emu::g_reverse_blocks = reverse != 0; }

int ag_plan_decode(int num_seqs, int num_heads, int num_kv_heads, int max_seq_len,
                   int sliding_window, int num_sms, int requested_partition_size,
                   int* partition_size, int* num_partitions) {
  const asyncgen::DecodePlan plan =
      asyncgen::plan_decode(num_seqs, num_heads, num_kv_heads, max_seq_len, sliding_window,
                            num_sms, requested_partition_size);
  *partition_size = plan.partition_size;
  *num_partitions = plan.num_partitions;
  return 0;
}

// dtype: 0 = float16, 1 = bfloat16. Returns 0 on success.
int ag_paged_attention_decode(const DecodeParams* p, int dtype) {
  const bool ok = dtype == 0 ? asyncgen::launch_paged_attention_decode<__half>(*p, nullptr)
                             : asyncgen::launch_paged_attention_decode<__nv_bfloat16>(*p, nullptr);
  return ok ? 0 : 1;
}

// dtype as above; kernel: 0 the mma.sync kernel, 1 the warpgroup one. Returns 0 on
// success, 1 when the kernel does not take the shapes.
int ag_chunk_attention(const ChunkAttentionParams* p, int dtype, int head_dim, int kernel) {
  bool ok;
  if (kernel == 1) {
    ok = dtype == 0 ? asyncgen::launch_chunk_attention_wgmma<__half>(*p, head_dim, nullptr)
                    : asyncgen::launch_chunk_attention_wgmma<__nv_bfloat16>(*p, head_dim, nullptr);
  } else {
    ok = dtype == 0 ? asyncgen::launch_chunk_attention<__half>(*p, head_dim, nullptr)
                    : asyncgen::launch_chunk_attention<__nv_bfloat16>(*p, head_dim, nullptr);
  }
  return ok ? 0 : 1;
}

int ag_store_kv_cache(const StoreKVParams* p, int element_size, int slot_is_int64, int aligned16) {
  switch (element_size) {
    case 2: asyncgen::launch_store_kv_cache<uint16_t>(*p, slot_is_int64, aligned16, nullptr); return 0;
    case 4: asyncgen::launch_store_kv_cache<uint32_t>(*p, slot_is_int64, aligned16, nullptr); return 0;
    default: return 1;
  }
}

// dtype: 0 = float16, 1 = bfloat16, 2 = float32. Returns 0 on success and sets *vectorized
// to whether the launcher took the 16-byte kernel.
int ag_rotary_store_kv(const RotaryStoreParams* p, int dtype, int slot_is_int64, int pos_is_int64, int* vectorized) {
  bool vec = false;
  switch (dtype) {
    case 0: vec = asyncgen::launch_rotary_store_kv<__half>(*p, slot_is_int64, pos_is_int64, nullptr); break;
    case 1: vec = asyncgen::launch_rotary_store_kv<__nv_bfloat16>(*p, slot_is_int64, pos_is_int64, nullptr); break;
    case 2: vec = asyncgen::launch_rotary_store_kv<float>(*p, slot_is_int64, pos_is_int64, nullptr); break;
    default: return 1;
  }
  *vectorized = vec ? 1 : 0;
  return 0;
}

// dtype as above. Returns 0 on success.
int ag_dense_gemv(const DenseGemvParams* p, int dtype) {
  const bool ok = dtype == 0 ? asyncgen::launch_dense_gemv<__half>(*p, nullptr)
                             : asyncgen::launch_dense_gemv<__nv_bfloat16>(*p, nullptr);
  return ok ? 0 : 1;
}

// tensor_cores: 1 lets the launcher pick the mma kernel where it takes the shape, 0 keeps
// the CUDA-core kernel. Returns 0 on success.
int ag_quant_gemv_4bit(const QuantGemvParams* p, int tensor_cores) {
  return asyncgen::launch_quant_gemv_4bit(*p, nullptr, tensor_cores != 0) ? 0 : 1;
}

int ag_quant_gemv_4bit_mma_ok(const QuantGemvParams* p) { return asyncgen::quant_gemv_4bit_mma_ok(*p) ? 1 : 0; }
int ag_quant_gemv1_ok(const QuantGemvParams* p) { return asyncgen::quant_gemv1_ok(*p) ? 1 : 0; }

// The tiled 4-bit GEMM (quant_gemm.cuh). Returns 0 on success, 1 where it does not take p.
int ag_quant_gemm_4bit(const QuantGemmParams* p) {
  return asyncgen::launch_tiled_quant_gemm(*p, nullptr) ? 0 : 1;
}

void ag_plan_stream_gemm(int n, int k, int warps, int64_t blocks_wanted, int* blocks, int* most) {
  const asyncgen::StreamPlan plan = asyncgen::plan_stream_gemm(n, k, warps, blocks_wanted);
  *blocks = plan.blocks;
  *most = plan.max_segments;
}

int ag_sizeof_quant_gemm_params() { return sizeof(QuantGemmParams); }
int ag_sizeof_dense_gemv_params() { return sizeof(DenseGemvParams); }
int ag_sizeof_quant_gemv_params() { return sizeof(QuantGemvParams); }
int ag_sizeof_decode_params() { return sizeof(DecodeParams); }
int ag_sizeof_chunk_params() { return sizeof(ChunkAttentionParams); }
int ag_sizeof_store_params() { return sizeof(StoreKVParams); }
int ag_sizeof_rotary_store_params() { return sizeof(RotaryStoreParams); }

}  // extern "C"
