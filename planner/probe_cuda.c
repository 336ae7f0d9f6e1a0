// The probe on a GPU (ferry probe --device cuda): what the planner needs of the device itself —
// the memory free on it, its bf16 and fp32 GEMM rates through the kernels' own cuBLASLt path, and pinned
// copies each way — beside the host's rates, which fy_probe_measure takes from the CPU. Built only
// with CUDA (or its emulator, test/cudaemu), as the other *_cuda.c files.
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/device_cuda.h"
#include "ops/cuda/ops_cuda.h"
#include "ops/cuda/parts.h"
#include "planner/probe.h"

#define REPS 5

static fy_status cuda_check(cudaError_t e, const char *what) {
  if (e == cudaSuccess) return FY_OK;
  (void)cudaGetLastError();
  return fy_error_set(FY_ERR_IO, "probe on the GPU: %s: %s", what, cudaGetErrorString(e));
}

// What the timed calls share: a stream, two events, the GEMM handle and its workspace.
struct bench {
  cudaStream_t st;
  cudaEvent_t t0, t1;
  struct fy_cuda_blas *blas;
  void *workspace;
};

// Median milliseconds of REPS runs of `run` (after one warm-up), each between two events.
typedef fy_status (*bench_fn)(struct bench *b, void *arg);
static fy_status median_ms(struct bench *b, bench_fn run, void *arg, float *ms) {
  double t[REPS];
  FY_TRY(run(b, arg));
  for (int r = 0; r < REPS; r++) {
    float e = 0;
    FY_TRY(cuda_check(cudaEventRecord(b->t0, b->st), "cudaEventRecord"));
    FY_TRY(run(b, arg));
    FY_TRY(cuda_check(cudaEventRecord(b->t1, b->st), "cudaEventRecord"));
    FY_TRY(cuda_check(cudaEventSynchronize(b->t1), "cudaEventSynchronize"));
    FY_TRY(cuda_check(cudaEventElapsedTime(&e, b->t0, b->t1), "cudaEventElapsedTime"));
    t[r] = e;
  }
  *ms = (float)fy_probe_median(t, REPS);
  return FY_OK;
}

struct gemm { void *a, *b, *c; int64_t n; enum fy_dtype dt; };
static fy_status run_gemm(struct bench *b, void *arg) {
  const struct gemm *g = arg;
  return fy_cuda_matmul(b->blas, g->c, g->a, g->b, NULL, g->dt, g->n, g->n, g->n, false, true, 1.0f, 0.0f, b->st);
}

struct copy { void *dst; const void *src; size_t n; enum cudaMemcpyKind kind; };
static fy_status run_copy(struct bench *b, void *arg) {
  const struct copy *c = arg;
  return cuda_check(cudaMemcpyAsync(c->dst, c->src, c->n, c->kind, b->st), "cudaMemcpyAsync");
}

// Values of a few magnitudes around 1 in dtype dt (bf16 or fp32; never zeros: a GPU multiplies
// zeros faster).
static void fill(void *x, size_t n, enum fy_dtype dt) {
  uint32_t s = 12345;
  for (size_t i = 0; i < n; i++) {
    s = s * 1664525u + 1013904223u;
    uint16_t v = (uint16_t)(0x3e00u + ((s >> 16) & 0x1ffu)) | (uint16_t)((s & 1u) << 15);  // +-(2^-3 .. 2^0)
    if (dt == FY_BF16) {
      ((uint16_t *)x)[i] = v;
    } else {
      uint32_t w = (uint32_t)v << 16;
      memcpy((float *)x + i, &w, sizeof w);
    }
  }
}

// Square products in dt (bf16 or fp32; fp32 accumulation), grown from 512 until one takes 2 ms or
// reaches 8192 (or the free memory): a GPU's sustained rate on products as large as a step's.
static fy_status measure_gemm(struct bench *b, size_t free_bytes, enum fy_dtype dt, double *gflops) {
  fy_status st = FY_OK;
  const size_t es = fy_dtype_size(dt);
  int64_t n = 512;
  for (;;) {
    size_t bytes = (size_t)(n * n) * es;
    struct gemm g = {.n = n, .dt = dt};
    void *host = malloc(bytes);
    if (!host) return fy_error_set(FY_ERR_NOMEM, "probe on the GPU: out of host memory");
    fill(host, (size_t)(n * n), dt);
    st = cuda_check(cudaMalloc(&g.a, bytes), "cudaMalloc");
    if (st == FY_OK) st = cuda_check(cudaMalloc(&g.b, bytes), "cudaMalloc");
    if (st == FY_OK) st = cuda_check(cudaMalloc(&g.c, bytes), "cudaMalloc");
    if (st == FY_OK) st = cuda_check(cudaMemcpy(g.a, host, bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
    if (st == FY_OK) st = cuda_check(cudaMemcpy(g.b, host, bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
    free(host);
    float ms = 0;
    if (st == FY_OK) st = median_ms(b, run_gemm, &g, &ms);
    cudaFree(g.a);
    cudaFree(g.b);
    cudaFree(g.c);
    if (st != FY_OK) return st;
    *gflops = 2.0 * (double)n * (double)n * (double)n / (ms > 0 ? ms * 1e-3 : 1e-9) / 1e9;
    if (ms >= 2.0f || n >= 8192 || (size_t)(4 * n * n) * es * 3 > free_bytes / 2) return FY_OK;
    n *= 2;
  }
}

// Pinned copies of up to 256 MiB each way (GB/s), and what one small copy costs (microseconds).
static fy_status measure_copies(struct bench *b, size_t free_bytes, double *h2d, double *d2h, double *latency_us) {
  size_t n = (size_t)256 << 20;
  while (n > ((size_t)1 << 20) && n > free_bytes / 4) n /= 2;
  void *host = NULL, *dev = NULL;
  fy_status st = cuda_check(cudaMallocHost(&host, n), "cudaMallocHost");
  if (st == FY_OK) st = cuda_check(cudaMalloc(&dev, n), "cudaMalloc");
  if (st == FY_OK) memset(host, 1, n);
  float ms[3] = {0};
  struct copy up = {dev, host, n, cudaMemcpyHostToDevice}, down = {host, dev, n, cudaMemcpyDeviceToHost},
              small = {dev, host, 4096, cudaMemcpyHostToDevice};
  if (st == FY_OK) st = median_ms(b, run_copy, &up, &ms[0]);
  if (st == FY_OK) st = median_ms(b, run_copy, &down, &ms[1]);
  if (st == FY_OK) st = median_ms(b, run_copy, &small, &ms[2]);
  if (dev) cudaFree(dev);
  if (host) cudaFreeHost(host);
  if (st != FY_OK) return st;
  *h2d = (double)n / (ms[0] > 0 ? ms[0] * 1e-3 : 1e-9) / 1e9;
  *d2h = (double)n / (ms[1] > 0 ? ms[1] * 1e-3 : 1e-9) / 1e9;
  *latency_us = ms[2] * 1e3;
  return FY_OK;
}

// A copy within the GPU of up to 512 MiB (an eighth of the free memory at most): its bytes read and
// written over the time, GB/s.
static fy_status measure_device_mem(struct bench *b, size_t free_bytes, double *gbps) {
  size_t n = (size_t)512 << 20;
  while (n > ((size_t)1 << 20) && n > free_bytes / 8) n /= 2;
  void *src = NULL, *dst = NULL;
  fy_status st = cuda_check(cudaMalloc(&src, n), "cudaMalloc");
  if (st == FY_OK) st = cuda_check(cudaMalloc(&dst, n), "cudaMalloc");
  if (st == FY_OK) st = cuda_check(cudaMemset(src, 1, n), "cudaMemset");
  float ms = 0;
  struct copy c = {dst, src, n, cudaMemcpyDeviceToDevice};
  if (st == FY_OK) st = median_ms(b, run_copy, &c, &ms);
  if (dst) cudaFree(dst);
  if (src) cudaFree(src);
  if (st == FY_OK) *gbps = 2.0 * (double)n / (ms > 0 ? ms * 1e-3 : 1e-9) / 1e9;
  return st;
}

int fy_probe_gpu_count(void) { return fy_cuda_device_count(); }

fy_status fy_probe_find_gpu(int ordinal) { return fy_cuda_find_gpu(ordinal, "probe on the GPU"); }

fy_status fy_probe_measure_gpu(int ordinal, struct fy_probe *p) {
  FY_TRY(fy_probe_find_gpu(ordinal));
  FY_TRY(fy_cuda_gpu_usable(ordinal));
  FY_TRY(cuda_check(cudaSetDevice(ordinal), "cudaSetDevice"));
  size_t free_bytes = 0, total = 0;
  FY_TRY(cuda_check(cudaMemGetInfo(&free_bytes, &total), "cudaMemGetInfo"));
  struct bench b = {0};
  fy_status st = cuda_check(cudaStreamCreateWithFlags(&b.st, cudaStreamNonBlocking), "cudaStreamCreate");
  if (st == FY_OK) st = cuda_check(cudaEventCreate(&b.t0), "cudaEventCreate");
  if (st == FY_OK) st = cuda_check(cudaEventCreate(&b.t1), "cudaEventCreate");
  if (st == FY_OK) st = cuda_check(cudaMalloc(&b.workspace, FY_CUDA_GEMM_WORKSPACE), "cudaMalloc");
  if (st == FY_OK) st = fy_cuda_blas_create(b.workspace, FY_CUDA_GEMM_WORKSPACE, &b.blas);
  double gflops = 0, gflops32 = 0, mem = 0, h2d = 0, d2h = 0, latency = 0;
  if (st == FY_OK) st = measure_gemm(&b, free_bytes, FY_BF16, &gflops);
  if (st == FY_OK) st = measure_gemm(&b, free_bytes, FY_F32, &gflops32);
  if (st == FY_OK) st = measure_device_mem(&b, free_bytes, &mem);
  if (st == FY_OK) st = measure_copies(&b, free_bytes, &h2d, &d2h, &latency);
  if (b.blas) fy_cuda_blas_free(b.blas);
  if (b.workspace) cudaFree(b.workspace);
  if (b.t0) cudaEventDestroy(b.t0);
  if (b.t1) cudaEventDestroy(b.t1);
  if (b.st) cudaStreamDestroy(b.st);
  FY_TRY(st);
  snprintf(p->device, sizeof p->device, "cuda");
  p->device_mem = (double)(free_bytes / 100 * FY_CUDA_FREE_PERCENT);  // (what ferry train takes of it)
  p->device_gflops = gflops;
  p->bf16_speedup = gflops32 > 0 ? round(gflops / gflops32 * 1000) / 1000 : 0;
  p->device_mem_gbps = mem;
  p->h2d_gbps = h2d;
  p->d2h_gbps = d2h;
  p->copy_latency_us = latency;
  p->kernel_overhead_us = 0;  // (a GPU's op costs are its FLOPs and bytes: planner/profile.c)
  struct cudaDeviceProp prop;
  p->peak_gflops = cudaGetDeviceProperties(&prop, ordinal) == cudaSuccess ? fy_probe_gpu_peak_gflops(prop.name) : 0;
  return FY_OK;
}
