// Which GPUs this build's kernels run on (FY_CUDA_ARCHS, fy_config.h: what -Dgpu_arch compiled).
//
// The kernels are compiled for the architectures of meson's -Dgpu_arch (machine code for each, and
// PTX that a newer GPU's driver compiles when it loads them). A GPU outside them would fail at the
// first kernel with the runtime's "no kernel image is available"; a GPU older than compute
// capability 8.0 has no bf16 tensor cores, which the GEMMs and attention need. Both are found when
// the GPU is opened, by asking the runtime for a kernel's attributes (which loads its code for the
// GPU, JIT-compiling PTX where that is what fits), and said in terms of what to do.
#include "fy_config.h"
#include "ops/cuda/common.cuh"

// Never launched: the kernel whose code the check loads.
__global__ void arch_probe_kernel(int *x) {
  if (x) *x = 0;
}

extern "C" fy_status fy_cuda_gpu_usable(int ordinal) {
  int prev = 0;
  if (cudaGetDevice(&prev) != cudaSuccess) prev = 0;
  cudaDeviceProp prop;
  cudaError_t e = cudaSetDevice(ordinal);
  if (e == cudaSuccess) e = cudaGetDeviceProperties(&prop, ordinal);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    cudaSetDevice(prev);
    return fy_error_set(FY_ERR_UNSUPPORTED, "cuda: GPU %d: %s", ordinal, cudaGetErrorString(e));
  }
  const int major = prop.major, minor = prop.minor;
  fy_status st = FY_OK;
  if (major < 8) {
    st = fy_error_set(FY_ERR_UNSUPPORTED,
                      "cuda: GPU %d (%s) has compute capability %d.%d; ferry's kernels need 8.0 or newer "
                      "(bf16 on tensor cores: A100, RTX 30xx and every GPU since); train on it with "
                      "--device sim or cpu",
                      ordinal, prop.name, major, minor);
  } else {
    cudaFuncAttributes attr;
    e = cudaFuncGetAttributes(&attr, (const void *)arch_probe_kernel);
    if (e == cudaErrorUnsupportedPtxVersion || e == cudaErrorInsufficientDriver) {
      (void)cudaGetLastError();
      st = fy_error_set(FY_ERR_UNSUPPORTED,
                        "cuda: GPU %d (%s, sm_%d%d) has no machine code in this build (%s) and its driver is "
                        "too old to compile the PTX: update the NVIDIA driver, or rebuild for this GPU "
                        "(meson configure build -Dgpu_arch=%d%d && ninja -C build)",
                        ordinal, prop.name, major, minor, FY_CUDA_ARCHS, major, minor);
    } else if (e != cudaSuccess) {
      (void)cudaGetLastError();
      st = fy_error_set(FY_ERR_UNSUPPORTED,
                        "cuda: GPU %d (%s, sm_%d%d) cannot run this build's kernels (compiled for %s: %s): "
                        "rebuild for it with meson configure build -Dgpu_arch=%d%d (or native) && ninja -C build",
                        ordinal, prop.name, major, minor, FY_CUDA_ARCHS, cudaGetErrorString(e), major, minor);
    }
  }
  cudaSetDevice(prev);
  return st;
}
