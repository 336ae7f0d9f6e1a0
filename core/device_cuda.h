// The cuda device (docs/design.md, "The objects"): cudaMalloc'd memory counted against a cap, streams
// that are cudaStream_t, events that are cudaEvent_t, host functions through cudaLaunchHostFunc.
// Only cuda-aware code includes this header (it pulls in the CUDA runtime's types); the rest of
// ferry sees the device through core/device.h alone.
#ifndef FY_DEVICE_CUDA_H
#define FY_DEVICE_CUDA_H

#include <stddef.h>

#include <cuda_runtime_api.h>

#include "core/device.h"

// The GPUs the CUDA runtime sees; 0 when there is no driver, no GPU or any other error (tests use
// it to skip).
int fy_cuda_device_count(void);
// FY_OK when GPU `ordinal` is there; else FY_ERR_NOT_FOUND saying why, for `who` (e.g. "--device
// cuda"): the driver is older than the CUDA runtime ferry was built with, there is no driver,
// CUDA_VISIBLE_DEVICES hides the GPUs, or fewer GPUs than asked.
fy_status fy_cuda_find_gpu(int ordinal, const char *who);

// A device on GPU `ordinal`. cap: bytes it may hand out (0 = unlimited; the GPU's own memory still
// bounds it). Allocations are counted rounded up to 256 bytes (cudaMalloc's alignment), exactly as
// given back by free, so bytes_in_use returns to 0 when everything is freed. Streams are
// non-blocking (they never wait on the legacy default stream); events carry no timing. Host
// functions run on a CUDA runtime thread and must not call the CUDA API (cudaLaunchHostFunc's rule).
// copy_stats counts bytes per direction, as cudaPointerGetAttributes sees the two sides; busy time
// is not measured (0).
fy_status fy_device_cuda_create(int ordinal, size_t cap, struct fy_device **out);

// The CUDA handles behind a stream of a cuda device, for launching kernels on it (ops/cuda).
cudaStream_t fy_cuda_stream(fy_stream *s);
int fy_cuda_ordinal(const struct fy_device *dev);

// Pin hooks for the host tier (memory/tier.h fy_host_tier_create): page-locks [p, p+n) with
// cudaHostRegister (portable: usable from every GPU's context) so that copies from it are true
// asynchronous DMA; unpin undoes it. Thread-safe, as the tier requires.
fy_status fy_cuda_host_pin(void *p, size_t n);
void fy_cuda_host_unpin(void *p);

#endif
