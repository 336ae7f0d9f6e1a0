// Shared by the CUDA emulator's parts (kernels, runtime, cuBLASLt): not for kernel files.
#ifndef FY_CUDAEMU_INTERNAL_H
#define FY_CUDAEMU_INTERNAL_H

#include <stdint.h>

#include "test/cudaemu/emu.h"

// Runs a launch's blocks, one after another, on the calling thread (a stream's worker).
void fy_emu_run_grid(const char *name, dim3 grid, dim3 block, size_t smem, uint64_t seed,
                     const std::function<void()> &body);

// Runs job on stream st's worker after the work queued before it (as a kernel would run).
void fy_emu_enqueue(cudaStream_t st, std::function<void()> job);

// Whether [p, p + n) lies inside memory the emulated device can reach (cudaMalloc'd, or host
// memory pinned or registered); what names the access in a failure.
void fy_emu_check_range(const void *p, size_t n, const char *what);

// The calling thread's current device; the device a stream was made on (-1: the legacy stream);
// the device whose memory holds all of [p, p + n) (-1: not in one device allocation).
int fy_emu_current_device(void);
int fy_emu_stream_device(cudaStream_t st);
int fy_emu_device_of(const void *p, size_t n);
// The machine's GPU behind device `ordinal` of this process: CUDA_VISIBLE_DEVICES's entry for it
// when set (a launcher that gives each rank its own GPU), else the ordinal (the emulated GPUs are
// the same for every process on the machine).
int fy_emu_physical_gpu(int ordinal);

uint64_t fy_emu_seed(void);  // FY_EMU_SEED (default 1)

#endif
