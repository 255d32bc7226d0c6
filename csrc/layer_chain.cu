// Torch glue for the chain of one-row 4-bit products (layer_chain.cuh): argument checks
// and the launch on the current stream.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <climits>

#include "check.h"
#include "launch_policy.h"
#include "layer_chain.cuh"
#include "ops.h"

namespace asyncgen {

int64_t quant_chain_max_grid(const at::Tensor& like, int64_t max_k) {
  TORCH_CHECK(like.is_cuda(), "quant_chain_max_grid: `like` must be a CUDA tensor");
  TORCH_CHECK(max_k > 0 && quant_chain_smem(static_cast<int>(max_k)) <= kChainMaxSmem, "K=", max_k,
              " needs more shared memory than the chain kernel may use");
  const c10::cuda::CUDAGuard device_guard(like.device());
  allow_dynamic_smem<quant_chain_kernel>(kChainMaxSmem);
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, quant_chain_kernel, kChainThreads,
                                                                   quant_chain_smem(static_cast<int>(max_k))));
  const int64_t blocks = static_cast<int64_t>(per_sm) * multiprocessor_count(like.get_device());
  return blocks < kChainMaxBlocks ? blocks : kChainMaxBlocks;
}

void quant_chain_4bit(at::TensorList qweights, at::TensorList scales, at::TensorList zeros, at::TensorList xs,
                      const c10::List<c10::optional<at::Tensor>>& norm_weights, at::TensorList outs,
                      at::IntArrayRef group_sizes, at::IntArrayRef col_threads, at::IntArrayRef epilogues,
                      const at::Tensor& sumsq, const at::Tensor& barrier, double eps, int64_t grid, bool split) {
  const size_t phases = qweights.size();
  TORCH_CHECK(phases >= 1 && phases <= kChainMaxPhases, "a chain has 1 to ", kChainMaxPhases, " phases, got ", phases);
  TORCH_CHECK(scales.size() == phases && zeros.size() == phases && xs.size() == phases &&
                  norm_weights.size() == phases && outs.size() == phases && group_sizes.size() == phases &&
                  col_threads.size() == phases && epilogues.size() == phases,
              "every argument list must have one entry a phase (", phases, ")");
  const at::Tensor& ref = qweights[0];
  AG_CHECK_CUDA(sumsq, ref);
  AG_CHECK_CUDA(barrier, ref);
  AG_CHECK_DTYPE(sumsq, at::kFloat);
  AG_CHECK_DTYPE(barrier, at::kInt);
  TORCH_CHECK(sumsq.is_contiguous() && sumsq.numel() >= kChainMaxBlocks, "sumsq must be contiguous with at least ",
              kChainMaxBlocks, " floats");
  TORCH_CHECK(barrier.is_contiguous() && barrier.numel() >= 2, "barrier must be 2 contiguous int32 (zeros at first)");
  ChainParams p{};
  int max_k = 0;
  for (size_t i = 0; i < phases; ++i) {
    const at::Tensor& q = qweights[i];
    AG_CHECK_CUDA(q, ref);
    AG_CHECK_DTYPE(q, at::kInt);
    TORCH_CHECK(q.dim() == 2 && q.stride(1) == 1, "phase ", i, ": qweight must be [K / 8, N], contiguous in N");
    const int64_t k = q.size(0) * 8, n = q.size(1);
    TORCH_CHECK(k <= INT_MAX && n <= INT_MAX, "phase ", i, ": too large");
    const int64_t g = group_sizes[i];
    TORCH_CHECK(g > 0 && k % g == 0, "phase ", i, ": group_size ", g, " must divide K=", k);
    for (const at::Tensor* t : {&scales[i], &zeros[i]}) {
      AG_CHECK_CUDA((*t), ref);
      AG_CHECK_DTYPE((*t), at::kHalf);
      TORCH_CHECK(t->dim() == 2 && t->size(0) == k / g && t->size(1) == n && t->stride(1) == 1, "phase ", i, ": ",
                  (t == &scales[i] ? "scales" : "zeros"), " must be [", k / g, ", ", n, "], contiguous in N");
    }
    const int64_t epilogue = epilogues[i];
    TORCH_CHECK(epilogue >= kChainOut && epilogue <= kChainGated, "phase ", i, ": epilogue must be 0, 1 or 2");
    const at::Tensor& x = xs[i];
    AG_CHECK_CUDA(x, ref);
    AG_CHECK_DTYPE(x, at::kHalf);
    TORCH_CHECK(x.is_contiguous() && x.numel() == k, "phase ", i, ": x must be one contiguous row of ", k);
    const c10::optional<at::Tensor> norm = norm_weights.get(i);
    if (norm.has_value()) {
      AG_CHECK_CUDA((*norm), ref);
      AG_CHECK_DTYPE((*norm), at::kHalf);
      TORCH_CHECK(norm->is_contiguous() && norm->numel() == k, "phase ", i, ": the norm weight must have ", k,
                  " contiguous elements");
    }
    const at::Tensor& out = outs[i];
    AG_CHECK_CUDA(out, ref);
    AG_CHECK_DTYPE(out, at::kHalf);
    const int64_t out_n = epilogue == kChainGated ? n / 2 : n;
    TORCH_CHECK(out.is_contiguous() && out.numel() == out_n, "phase ", i, ": out must be one contiguous row of ",
                out_n);
    ChainPhase& ph = p.phase[i];
    ph.qweight = q.data_ptr<int32_t>();
    ph.scales = scales[i].data_ptr();
    ph.zeros = zeros[i].data_ptr();
    ph.x = x.data_ptr();
    ph.norm_weight = norm.has_value() ? norm->data_ptr() : nullptr;
    ph.out = out.data_ptr();
    ph.qweight_stride = q.stride(0);
    ph.scales_stride = scales[i].stride(0);
    ph.zeros_stride = zeros[i].stride(0);
    ph.n = static_cast<int>(n);
    ph.k = static_cast<int>(k);
    ph.group_size = static_cast<int>(g);
    ph.col_threads = static_cast<int>(col_threads[i]);
    ph.epilogue = static_cast<int>(epilogue);
    max_k = max_k > ph.k ? max_k : ph.k;
  }
  p.sumsq = sumsq.data_ptr<float>();
  p.barrier = reinterpret_cast<unsigned*>(barrier.data_ptr<int32_t>());
  p.eps = static_cast<float>(eps);
  p.first = 0;
  p.last = static_cast<int>(phases) - 1;
  TORCH_CHECK(quant_chain_ok(p), "the chain kernel does not take these phases: it needs K and group_size multiples "
              "of 16, N a multiple of 4 (gated 8), 4 or 8 column threads, 16-byte aligned x, qweight and norm "
              "weights, 8-byte aligned scales and zeros, and a normalised phase after a residual one");
  const int64_t most = quant_chain_max_grid(ref, max_k);
  TORCH_CHECK(grid >= 1 && grid <= most, "grid must be 1 to ", most, " (the blocks that fit the GPU at once), got ",
              grid);
  const c10::cuda::CUDAGuard device_guard(ref.device());
  launch_quant_chain(p, static_cast<int>(grid), c10::cuda::getCurrentCUDAStream(), dependent_launch(ref.get_device()),
                     split);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace asyncgen
