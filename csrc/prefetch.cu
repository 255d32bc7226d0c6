// Torch glue for prefetch_l2 (prefetch.cuh).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "check.h"
#include "ops.h"
#include "prefetch.cuh"

namespace asyncgen {

void prefetch_l2(const at::Tensor& t, int64_t max_bytes) {
  TORCH_CHECK(t.is_cuda(), "t must be a CUDA tensor, got ", t.device());
  TORCH_CHECK(t.is_contiguous(), "t must be contiguous, got strides ", t.strides(), " for shape ", t.sizes());
  TORCH_CHECK(is_aligned16(t), "t must start 16-byte aligned");
  TORCH_CHECK(max_bytes >= 0, "max_bytes must be >= 0, got ", max_bytes);
  const int64_t nbytes = t.numel() * static_cast<int64_t>(t.element_size());
  PrefetchParams p{};
  p.base = t.data_ptr();
  p.bytes = (max_bytes < nbytes ? max_bytes : nbytes) / 16 * 16;
  if (p.bytes == 0) return;
  const c10::cuda::CUDAGuard device_guard(t.device());
  launch_prefetch_l2(p, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace asyncgen
