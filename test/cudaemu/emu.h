// The CUDA emulator's device side: what a kernel file (ops/cuda/*.cu, rewritten by rewrite.py)
// needs to compile as host C++ and run on CPU threads. See README.md.
//
// A launch runs its blocks one after another, in an order drawn at random, on its stream's
// worker thread; a block's threads are fibers that switch only where CUDA threads meet:
// __syncthreads, the warp shuffles, mma.sync and ldmatrix (fy_emu_warp). Between meeting points
// the fibers of a block run in an order drawn at random (FY_EMU_SEED), so a missing barrier
// changes results. __shared__ variables are thread_local statics (one block at a time per worker
// thread); the dynamic shared memory is refilled with 0xff bytes (NaN as fp32 and bf16) before
// each block.
#ifndef FY_CUDAEMU_EMU_H
#define FY_CUDAEMU_EMU_H

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>

// The toolkit's qualifiers, for a host compiler
#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __shared__
#undef __launch_bounds__
#undef __align__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static thread_local
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))

extern thread_local uint3 threadIdx;
extern thread_local uint3 blockIdx;
extern thread_local dim3 blockDim;
extern thread_local dim3 gridDim;

void __syncthreads(void);
void *fy_emu_dynamic_smem(void);

// A warp-wide meeting: each lane hands in `in` (n bytes) and gets back `out` (n bytes) from fn,
// which the last lane to arrive runs over all of them (in[lane], out[lane], 64 bytes each).
typedef void (*fy_emu_warp_fn)(const unsigned char in[32][64], unsigned char out[32][64], int lanes);
void fy_emu_warp(unsigned mask, const char *what, fy_emu_warp_fn fn, const void *in, size_t n_in, void *out,
                 size_t n_out);

void fy_emu_shfl_xor_fn(const unsigned char in[32][64], unsigned char out[32][64], int lanes);
void fy_emu_shfl_up_fn(const unsigned char in[32][64], unsigned char out[32][64], int lanes);

struct fy_emu_shfl_in {
  uint64_t v;
  int32_t arg;  // the lane mask (xor) or the delta (up)
};

// A shuffle of up to 8 bytes: fn picks, for each lane, whose value it gets (arg: the xor mask or
// the delta)
template <typename T>
T fy_emu_shfl(unsigned mask, T v, int arg, fy_emu_warp_fn fn, const char *what) {
  static_assert(sizeof(T) <= 8, "shuffles of up to 8 bytes");
  fy_emu_shfl_in in = {0, arg};
  memcpy(&in.v, &v, sizeof v);
  uint64_t out;
  fy_emu_warp(mask, what, fn, &in, sizeof in, &out, sizeof out);
  T r;
  memcpy(&r, &out, sizeof r);
  return r;
}

// A fault of the emulated program (what a GPU would report as an illegal access, a launch
// failure or a hang): the message, and the process stops.
[[noreturn]] void fy_emu_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

// (A width under 32 is refused: ferry's kernels shuffle across whole warps.)
template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  if (width != 32) fy_emu_fail("__shfl_xor_sync with width %d: not emulated", width);
  return fy_emu_shfl(mask, v, lane_mask, fy_emu_shfl_xor_fn, "__shfl_xor_sync");
}
template <typename T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  if (width != 32) fy_emu_fail("__shfl_up_sync with width %d: not emulated", width);
  return fy_emu_shfl(mask, v, (int)delta, fy_emu_shfl_up_fn, "__shfl_up_sync");
}

// The tensor-core instructions the attention kernels use (ops/cuda/attention.cuh and
// attention_pipelined.cu, under FY_CUDA_EMU):
// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, c += a b with the PTX ISA's fragments
void fy_emu_mma_m16n8k16_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1);
// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lane l gives the address of row l % 8 of
// matrix l / 8; r[i] gets matrix i's fragment (transposed with .trans)
void fy_emu_ldmatrix_x4(uint32_t r[4], const void *row);
void fy_emu_ldmatrix_x4_trans(uint32_t r[4], const void *row);
// cp.async.cg.shared.global (16 bytes, or zeros when !ok), commit_group, wait_group 0: a copy
// lands at a moment drawn at random between its issue and the wait
void fy_emu_cp_async16(void *dst, const void *src, bool ok);
void fy_emu_cp_async_wait_all(void);

// cuda_runtime.h's overload for a kernel (nvcc only)
template <typename... P>
cudaError_t cudaFuncSetAttribute(void (*k)(P...), enum cudaFuncAttribute attr, int value) {
  return cudaFuncSetAttribute((const void *)k, attr, value);
}

// Launches: rewrite.py turns `k<<<g, b, s, st>>>(args)` into fy_emu_launch("k", k, g, b, s, st, args)
// (s and st 0 when the launch leaves them out)
void fy_emu_submit(const char *name, const void *fn, dim3 grid, dim3 block, size_t smem, cudaStream_t st,
                   std::function<void()> body);

// A kernel's pointer argument (i from 0): NULL, or inside (or just past) memory the launch's GPU
// can reach: its own device memory, or host memory that is pinned or registered. Pageable host
// memory or another GPU's memory is an illegal address on a GPU: the program stops.
void fy_emu_check_arg(const char *name, int i, const void *p);

template <typename T>
void fy_emu_check_args(const char *name, int i, const T &v) {
  if constexpr (std::is_pointer<T>::value) fy_emu_check_arg(name, i, (const void *)v);
}

template <typename... P, typename... A>
void fy_emu_launch(const char *name, void (*k)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t st,
                   A &&...a) {
  static_assert(sizeof...(P) == sizeof...(A), "a kernel's arguments");
  std::tuple<std::decay_t<P>...> args(std::forward<A>(a)...);  // converted as a launch does
  std::apply([name](const auto &...v) {
    int i = 0;
    (fy_emu_check_args(name, i++, v), ...);
  }, args);
  fy_emu_submit(name, (const void *)k, grid, block, smem, st, [k, args]() { std::apply(k, args); });
}
#endif
