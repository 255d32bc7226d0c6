// Torch glue for the GEMV kernels (gemv.cuh): argument checks and the launch on the
// current stream. The Python launchers (asyncgen/_ops/cuda_backend.py) route only the
// shapes these accept; the checks here name what is wrong for anything else.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <climits>

#include "check.h"
#include "gemv.cuh"
#include "quant_gemm.cuh"
#include "quant_ws.cuh"
#include "launch_policy.h"
#include "ops.h"

namespace asyncgen {

namespace {

void check_rows(const at::Tensor& out, const at::Tensor& x, int64_t n, int64_t k, int max_rows) {
  AG_CHECK_DIM(x, 2);
  AG_CHECK_DIM(out, 2);
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= max_rows, "x must have 1 to ", max_rows, " rows, got ", x.size(0));
  TORCH_CHECK(x.size(1) == k, "x must have ", k, " columns, got shape ", x.sizes());
  TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == n, "out must have shape [", x.size(0), ", ", n, "], got ",
              out.sizes());
  AG_CHECK_LAST_DIM_CONTIGUOUS(x);
  AG_CHECK_LAST_DIM_CONTIGUOUS(out);
  TORCH_CHECK(is_aligned16(x) && x.stride(0) % 8 == 0, "x must be 16-byte aligned with a row stride that is a "
              "multiple of 8, got strides ", x.strides());
  TORCH_CHECK(k % 8 == 0, "the input size must be a multiple of 8, got ", k);
  TORCH_CHECK(n <= INT_MAX && k <= INT_MAX, "too large: n=", n, ", k=", k);
}

void check_bias(const c10::optional<at::Tensor>& bias, const at::Tensor& x, int64_t n) {
  if (!bias.has_value()) return;
  AG_CHECK_CUDA((*bias), x);
  AG_CHECK_DTYPE((*bias), x.scalar_type());
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous(), "bias must be a contiguous [", n,
              "], got shape ", bias->sizes());
}

// The product's checks and parameters; out has N columns, or N / 2 gated.
DenseGemvParams dense_params(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                             const c10::optional<at::Tensor>& bias, int64_t warps_per_row, bool gated) {
  TORCH_CHECK(warps_per_row == 0 || warps_per_row == 1 || warps_per_row == 2 || warps_per_row == 4 ||
                  warps_per_row == 8,
              "warps_per_row must be 0 (one), 1, 2, 4 or 8, got ", warps_per_row);
  AG_CHECK_DIM(weight, 2);
  AG_CHECK_CUDA(x, weight);
  AG_CHECK_CUDA(out, weight);
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(!gated || (n % 2 == 0 && warps_per_row <= 4),
              "gated takes an even number of weight rows (gate | up) and at most 4 warps a row, got ", n,
              " rows and warps_per_row=", warps_per_row);
  check_rows(out, x, gated ? n / 2 : n, k, kGemvMaxRows);
  TORCH_CHECK(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16,
              "x must be float16 or bfloat16, got ", x.scalar_type());
  AG_CHECK_DTYPE(weight, x.scalar_type());
  AG_CHECK_DTYPE(out, x.scalar_type());
  AG_CHECK_LAST_DIM_CONTIGUOUS(weight);
  TORCH_CHECK(is_aligned16(weight) && weight.stride(0) % 8 == 0, "weight must be 16-byte aligned with a row stride "
              "that is a multiple of 8, got strides ", weight.strides());
  check_bias(bias, x, n);

  DenseGemvParams p{};
  p.out = out.data_ptr();
  p.x = x.data_ptr();
  p.weight = weight.data_ptr();
  p.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  p.out_stride = out.stride(0);
  p.x_stride = x.stride(0);
  p.weight_stride = weight.stride(0);
  p.m = static_cast<int>(x.size(0));
  p.n = static_cast<int>(n);
  p.k = static_cast<int>(k);
  p.warps_per_row = static_cast<int>(warps_per_row);
  p.gated = gated;
  return p;
}

void launch_dense(const DenseGemvParams& p, const at::Tensor& x) {
  if (p.n == 0) return;
  const c10::cuda::CUDAGuard device_guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const bool dependent = dependent_launch(x.get_device());
  const bool ok = x.scalar_type() == at::kHalf ? launch_dense_gemv<__half>(p, stream, dependent)
                                               : launch_dense_gemv<__nv_bfloat16>(p, stream, dependent);
  TORCH_CHECK(ok, "no dense GEMV kernel takes warps_per_row=", p.warps_per_row, p.gated ? " gated" : "");
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The 4-bit products' checks and parameters (both ops take the same tensors); out has N
// columns, or N / 2 gated.
QuantGemvParams quant_params(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight,
                             const at::Tensor& scales, const at::Tensor& zeros, int64_t group_size,
                             const c10::optional<at::Tensor>& bias, bool gated = false) {
  AG_CHECK_DIM(qweight, 2);
  AG_CHECK_CUDA(x, qweight);
  AG_CHECK_CUDA(out, qweight);
  AG_CHECK_CUDA(scales, qweight);
  AG_CHECK_CUDA(zeros, qweight);
  const int64_t n = qweight.size(1), k = qweight.size(0) * 8;
  TORCH_CHECK(!gated || (n % 8 == 0 && x.dim() == 2 && x.size(0) == 1),
              "gated takes one row of x and a multiple of 8 columns (gate | up), got x ", x.sizes(), " and ", n,
              " columns");
  check_rows(out, x, gated ? n / 2 : n, k, kMmaMaxRows);
  AG_CHECK_DTYPE(x, at::kHalf);
  AG_CHECK_DTYPE(out, at::kHalf);
  AG_CHECK_DTYPE(qweight, at::kInt);
  AG_CHECK_DTYPE(scales, at::kHalf);
  AG_CHECK_DTYPE(zeros, at::kHalf);
  AG_CHECK_LAST_DIM_CONTIGUOUS(qweight);
  TORCH_CHECK(n % 4 == 0 && is_aligned16(qweight) && qweight.stride(0) % 4 == 0,
              "qweight must have a multiple of 4 columns, be 16-byte aligned and have a row stride that is a "
              "multiple of 4, got shape ", qweight.sizes(), " strides ", qweight.strides());
  TORCH_CHECK(group_size > 0 && group_size % 8 == 0, "group_size must be a positive multiple of 8, got ", group_size);
  const int64_t groups = (k + group_size - 1) / group_size;
  for (const at::Tensor* t : {&scales, &zeros}) {
    TORCH_CHECK(t->dim() == 2 && t->size(0) == groups && t->size(1) == n && t->stride(1) == 1,
                (t == &scales ? "scales" : "zeros"), " must be [", groups, ", ", n,
                "] and contiguous in its last dim, got shape ", t->sizes(), " strides ", t->strides());
  }
  check_bias(bias, x, n);

  QuantGemvParams p{};
  p.out = out.data_ptr();
  p.x = x.data_ptr();
  p.qweight = qweight.data_ptr<int32_t>();
  p.scales = scales.data_ptr();
  p.zeros = zeros.data_ptr();
  p.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  p.out_stride = out.stride(0);
  p.x_stride = x.stride(0);
  p.qweight_stride = qweight.stride(0);
  p.scales_stride = scales.stride(0);
  p.zeros_stride = zeros.stride(0);
  p.m = static_cast<int>(x.size(0));
  p.n = static_cast<int>(n);
  p.k = static_cast<int>(k);
  p.group_size = static_cast<int>(group_size);
  p.gated = gated ? 1 : 0;
  return p;
}

}  // namespace

void dense_gemv(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                const c10::optional<at::Tensor>& bias, int64_t warps_per_row, bool gated) {
  launch_dense(dense_params(out, x, weight, bias, warps_per_row, gated), x);
}

void quant_gemv_4bit(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight,
                     const at::Tensor& scales, const at::Tensor& zeros, int64_t group_size,
                     const c10::optional<at::Tensor>& bias, int64_t kernel, bool gated) {
  TORCH_CHECK(kernel >= 0 && kernel <= 2, "kernel must be 0 (either), 1 (CUDA cores) or 2 (tensor cores), got ",
              kernel);
  TORCH_CHECK(!gated || kernel != 2, "gated runs on the one-row CUDA-core kernel, not the tensor-core one");
  const QuantGemvParams p = quant_params(out, x, qweight, scales, zeros, group_size, bias, gated);
  const int64_t k = p.k;
  if (p.n == 0) return;
  const c10::cuda::CUDAGuard device_guard(x.device());
  const bool tensor_cores = has_tensor_cores(x.get_device());
  if (kernel == 2) {
    TORCH_CHECK(tensor_cores && quant_gemv_4bit_mma_ok(p), "the tensor-core kernel needs an sm_80+ GPU, K and "
                "group_size multiples of 32, 8-byte aligned scales and zeros, and at most ", kMmaMaxSmem / 128,
                " groups; got K=", k, ", group_size=", group_size);
  }
  TORCH_CHECK(!gated || quant_gemv1_gated_ok(p), "gated needs the one-row kernel: K and group_size multiples of "
              "16, 8-byte aligned scales and zeros and K within its shared memory; got K=", k, ", group_size=",
              group_size);
  TORCH_CHECK(launch_quant_gemv_4bit(p, c10::cuda::getCurrentCUDAStream(), tensor_cores && kernel != 1,
                                     dependent_launch(x.get_device())), "x has ",
              p.m, " rows; more than ", kGemvMaxRows, " need the tensor-core kernel, which needs an sm_80+ GPU, K "
              "and group_size multiples of 32, 8-byte aligned scales and zeros, and at most ", kMmaMaxSmem / 128,
              " groups");
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void quant_gemm_4bit(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight,
                     const at::Tensor& scales, const at::Tensor& zeros, int64_t group_size,
                     const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& workspace,
                     const c10::optional<at::Tensor>& counters, int64_t warps, int64_t splits, int64_t wgmma) {
  QuantGemmParams p{};
  p.q = quant_params(out, x, qweight, scales, zeros, group_size, bias);
  TORCH_CHECK(warps == 4 || warps == 8, "warps must be 4 or 8, got ", warps);
  TORCH_CHECK(wgmma >= 0 && wgmma <= 2, "wgmma must be 0 (the mma.sync kernel), 1 (the warpgroup kernel) or 2 (the "
              "warpgroup kernel with producer warps), got ", wgmma);
  TORCH_CHECK((splits >= 1 && splits <= kTiledMaxSplits) || (wgmma && splits >= -kMaxStreamBlocksPerSm && splits <= -1),
              "splits must be 1 to ", kTiledMaxSplits, " (or, with wgmma, -1 to -", kMaxStreamBlocksPerSm,
              ": a balanced launch of that many blocks an SM), got ", splits);
  p.warps = static_cast<int>(warps);
  p.wgmma = static_cast<int>(wgmma);
  TORCH_CHECK(!wgmma || kWgmmaBuilt, "wgmma: this build of asyncgen._C has no sm_90a code (build with "
              "ASYNCGEN_CUDA_ARCHS=90a)");
  if (splits < 0) {
    TORCH_CHECK(p.q.k % kTiledK == 0, "the tiled 4-bit GEMM takes K a multiple of ", kTiledK, ", got ", p.q.k);
    const StreamPlan plan = plan_stream_gemm(p.q.n, p.q.k, p.warps,
                                             static_cast<int64_t>(-splits) * multiprocessor_count(x.get_device()));
    TORCH_CHECK(plan.max_segments <= kTiledMaxSplits, "a balanced launch of ", -splits, " blocks an SM shares a "
                "column block among ", plan.max_segments, " blocks, more than ", kTiledMaxSplits);
    p.stream_blocks = plan.blocks;
    splits = plan.max_segments;
  }
  p.splits = static_cast<int>(splits);
  if (splits > 1) {
    TORCH_CHECK(workspace.has_value() && counters.has_value(), "splits > 1 needs a workspace and counters");
    AG_CHECK_CUDA((*workspace), qweight);
    AG_CHECK_CUDA((*counters), qweight);
    AG_CHECK_DTYPE((*workspace), at::kFloat);
    AG_CHECK_DTYPE((*counters), at::kInt);
    TORCH_CHECK(workspace->is_contiguous() && workspace->numel() >= splits * p.q.m * p.q.n,
                "workspace must be contiguous with at least splits * m * n = ", splits * p.q.m * p.q.n,
                " floats, got ", workspace->numel());
    const int64_t blocks = (p.q.n + 32 * warps - 1) / (32 * warps);
    TORCH_CHECK(counters->is_contiguous() && counters->numel() >= blocks, "counters must be contiguous with at least ",
                blocks, " entries, got ", counters->numel());
    p.workspace = workspace->data_ptr<float>();
    p.counters = counters->data_ptr<int>();
  }
  TORCH_CHECK(quant_gemm_4bit_ok(p), "the tiled 4-bit GEMM takes 1 to ", kTiledMaxRows, " rows, K and group_size "
              "multiples of ", kTiledK, ", N a multiple of 8, 16-byte aligned x rows, scales and zeros, and an even "
              "output stride; got m=", p.q.m, ", n=", p.q.n, ", k=", p.q.k, ", group_size=", p.q.group_size);
  if (p.q.n == 0) return;
  const c10::cuda::CUDAGuard device_guard(x.device());
  TORCH_CHECK(has_tensor_cores(x.get_device()), "the tiled 4-bit GEMM needs an sm_80+ GPU");
  TORCH_CHECK(!wgmma || compute_major(x.get_device()) == 9, "wgmma: the warpgroup 4-bit GEMM needs an sm_90 GPU, "
              "got compute capability ", compute_major(x.get_device()), ".x");
  launch_tiled_quant_gemm(p, c10::cuda::getCurrentCUDAStream(), dependent_launch(x.get_device()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace asyncgen
