// Shared by the GPU benchmark programs (bench/gpu_gemm, bench/gpu_attention): their common
// options and device, random device buffers, and the median time of a call on a stream.
#ifndef FY_GPU_BENCH_H
#define FY_GPU_BENCH_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "core/device.h"
#include "core/device_cuda.h"
#include "core/dtype.h"
#include "core/opt.h"

static void gpu_bench_die(const char *bench, const char *what) {
  fprintf(stderr, "%s: %s: %s\n", bench, what, fy_error_msg());
  exit(1);
}

struct gpu_bench_opts {
  const char *model, *dtype;
  int64_t batch, seq;
  int reps, tune;  // tune: only where the program takes --tune
  struct fy_opt_config cfg;
  enum fy_dtype dt;
};

// Reads [--model opt-1.3b] [--batch 8] [--seq 2048] [--dtype bf16|fp32] [--reps 10] (and
// [--tune N] when tune_ok), with `usage` for --help. Returns -1 to go on, else the exit status:
// 0 after --help, 2 for bad usage, 77 without a GPU.
static int gpu_bench_args(int argc, char **argv, const char *bench, const char *usage, bool tune_ok,
                          struct gpu_bench_opts *o) {
  *o = (struct gpu_bench_opts){.model = "opt-1.3b", .dtype = "bf16", .batch = 8, .seq = 2048, .reps = 10};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
      printf("%s\n", usage);
      return 0;
    }
    if (!v) {
      fprintf(stderr, "%s: %s needs a value (--help)\n", bench, a);
      return 2;
    }
    if (!strcmp(a, "--model")) o->model = v;
    else if (!strcmp(a, "--batch")) o->batch = atoll(v);
    else if (!strcmp(a, "--seq")) o->seq = atoll(v);
    else if (!strcmp(a, "--dtype")) o->dtype = v;
    else if (!strcmp(a, "--reps")) o->reps = atoi(v);
    else if (tune_ok && !strcmp(a, "--tune")) o->tune = atoi(v);
    else {
      fprintf(stderr, "%s: unknown option %s (--help)\n", bench, a);
      return 2;
    }
    i++;
  }
  o->dt = !strcmp(o->dtype, "fp32") ? FY_F32 : FY_BF16;
  if ((strcmp(o->dtype, "fp32") && strcmp(o->dtype, "bf16")) || o->batch < 1 || o->seq < 1 || o->reps < 1 ||
      o->tune < 0 || o->tune > 16) {
    fprintf(stderr, "%s: bad --dtype, --batch, --seq, --reps or --tune (0 to 16)\n", bench);
    return 2;
  }
  if (fy_opt_preset(o->model, &o->cfg) != FY_OK) gpu_bench_die(bench, "--model");
  if (fy_cuda_device_count() == 0) {
    fprintf(stderr, "%s: no GPU: skipped\n", bench);
    return 77;
  }
  return -1;
}

// GPU 0 and a stream on it (its CUDA stream in *cs).
static void gpu_bench_device(const char *bench, struct fy_device **dev, fy_stream **st, cudaStream_t *cs) {
  if (fy_device_cuda_create(0, 0, dev) != FY_OK) gpu_bench_die(bench, "cuda device");
  if (fy_stream_create(*dev, st) != FY_OK) gpu_bench_die(bench, "stream");
  *cs = fy_cuda_stream(*st);
}

// n random values in [-1, 1) of dt on dev (a 1 Mi-element random block, made once per element
// size, tiled).
static void *gpu_bench_rand(struct fy_device *dev, int64_t n, enum fy_dtype dt, const char *bench) {
  const size_t es = fy_dtype_size(dt), block = (size_t)1 << 20;
  void *p = NULL;
  if (fy_device_alloc(dev, (size_t)n * es, &p) != FY_OK) gpu_bench_die(bench, "device allocation");
  static void *host[2];
  void **h = &host[es == 2];
  if (!*h) {
    if (!(*h = malloc(block * es))) gpu_bench_die(bench, "host allocation");
    uint64_t x = 0x9E3779B97F4A7C15ull;
    for (size_t i = 0; i < block; i++) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      float v = (float)((double)(x >> 11) * 0x1.0p-53 * 2.0 - 1.0);
      if (es == 2) ((uint16_t *)*h)[i] = fy_f32_to_bf16(v);
      else ((float *)*h)[i] = v;
    }
  }
  for (size_t off = 0; off < (size_t)n; off += block) {
    size_t k = (size_t)n - off < block ? (size_t)n - off : block;
    if (cudaMemcpy((char *)p + off * es, *h, k * es, cudaMemcpyHostToDevice) != cudaSuccess)
      gpu_bench_die(bench, "upload");
  }
  return p;
}

static int gpu_bench_cmp(const void *a, const void *b) {
  float x = *(const float *)a, y = *(const float *)b;
  return (x > y) - (x < y);
}

// The median milliseconds of call(ctx) on stream s over reps runs, after warmup runs, each timed
// with CUDA events; a failed call or kernel ends the program naming `what`.
static float gpu_bench_time(cudaStream_t s, int warmup, int reps, fy_status (*call)(void *ctx), void *ctx,
                            const char *bench, const char *what) {
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  float *ms = calloc((size_t)reps, sizeof *ms);
  if (!ms) gpu_bench_die(bench, "host allocation");
  for (int r = -warmup; r < reps; r++) {
    cudaEventRecord(e0, s);
    if (call(ctx) != FY_OK) gpu_bench_die(bench, what);
    cudaEventRecord(e1, s);
    if (cudaEventSynchronize(e1) != cudaSuccess) {
      fprintf(stderr, "%s: %s: %s\n", bench, what, cudaGetErrorString(cudaGetLastError()));
      exit(1);
    }
    if (r >= 0) cudaEventElapsedTime(&ms[r], e0, e1);
  }
  qsort(ms, (size_t)reps, sizeof *ms, gpu_bench_cmp);
  float med = ms[reps / 2];
  free(ms);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return med;
}

#endif
