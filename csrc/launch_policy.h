// Host-side facts about the device that choose how kernels are launched, shared by the
// torch glue files. Each is asked of the driver once per device and cached.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdlib>
#include <string>

namespace asyncgen {

// A device attribute, asked of the driver once per device (0: unknown device index).
template <cudaDeviceAttr ATTR>
inline int cached_device_attribute(int device) {
  static std::atomic<int> value[64] = {};  // 0: not asked yet
  if (device < 0 || device >= 64) return 0;
  int v = value[device].load(std::memory_order_relaxed);
  if (v == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&v, ATTR, device));
    value[device].store(v, std::memory_order_relaxed);
  }
  return v;
}

// The device's compute capability major version.
inline int compute_major(int device) { return cached_device_attribute<cudaDevAttrComputeCapabilityMajor>(device); }

// The device's number of SMs.
inline int multiprocessor_count(int device) { return cached_device_attribute<cudaDevAttrMultiProcessorCount>(device); }

// Whether the device has fp16 mma.sync (sm_80+).
inline bool has_tensor_cores(int device) { return compute_major(device) >= 8; }

// Whether kernels that support it are launched as dependents of the kernel ahead
// (programmatic dependent launch: sm_90+, unless ASYNCGEN_PDL=0 was set when the first
// such kernel was launched).
inline bool dependent_launch(int device) {
  static const bool enabled = [] {
    const char* v = std::getenv("ASYNCGEN_PDL");
    return v == nullptr || std::string(v) != "0";
  }();
  return enabled && compute_major(device) >= 9;
}

}  // namespace asyncgen
