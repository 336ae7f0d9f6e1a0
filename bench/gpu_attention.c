// bench/gpu_attention: causal attention of one OPT layer on the GPU, forward and backward, for each
// set of kernels (fy_cuda_attention_set_variant: "basic", "pipelined", "narrow"; the bf16 forward
// and backward are chosen apart), through the calls the cuda engine makes. Inputs are random; each
// call is timed with CUDA events over --reps runs after 3 warm-ups, and its median printed as a
// JSON line with the rate in the usual count of useful FLOPs (causal: forward 2 B T^2 C, backward
// 2.5 times that), then one line with a layer's forward and backward per step for the default
// (auto) and for the fastest pairing, as FERRY_CUDA_ATTENTION would name it ("faster"), and what
// that would save a step.
//
// usage: gpu_attention [--model opt-1.3b] [--batch 8] [--seq 2048] [--dtype bf16|fp32] [--reps 10]
// Exits 77 without a GPU.
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "core/device.h"
#include "core/device_cuda.h"
#include "core/dtype.h"
#include "core/opt.h"
#include "ops/cuda/ops_cuda.h"
#include "bench/gpu_bench.h"

static struct fy_device *dev;
static cudaStream_t cs;

static void die(const char *what) { gpu_bench_die("gpu_attention", what); }

struct args {
  void *out, *qkv, *dout, *dqkv;
  float *lse, *scratch;
  enum fy_dtype dt;
  int64_t B, T, C, NH;
  float scale;
};

static fy_status run_forward(void *arg) {
  const struct args *a = arg;
  return fy_cuda_attention_forward(a->out, a->lse, a->qkv, NULL, a->dt, a->B, a->T, a->C, a->NH, a->scale, cs);
}

static fy_status run_backward(void *arg) {
  const struct args *a = arg;
  return fy_cuda_attention_backward(a->dqkv, a->scratch, a->dout, a->qkv, a->out, a->lse, NULL, a->dt, a->B, a->T,
                                    a->C, a->NH, a->scale, cs);
}

int main(int argc, char **argv) {
  struct gpu_bench_opts o;
  int rc = gpu_bench_args(argc, argv, "gpu_attention",
                          "usage: gpu_attention [--model opt-1.3b] [--batch 8] [--seq 2048] [--dtype bf16|fp32] "
                          "[--reps 10]",
                          false, &o);
  if (rc >= 0) return rc;
  const struct fy_opt_config cfg = o.cfg;
  const enum fy_dtype dt = o.dt;
  const char *model = o.model, *dtype = o.dtype;
  const int64_t batch = o.batch, seq = o.seq;
  const int reps = o.reps;
  fy_stream *st = NULL;
  gpu_bench_device("gpu_attention", &dev, &st, &cs);

  const int64_t B = batch, T = seq, C = cfg.hidden_size, NH = cfg.num_attention_heads;
  struct args a = {.dt = dt, .B = B, .T = T, .C = C, .NH = NH, .scale = 1.0f / sqrtf((float)(C / NH))};
  a.qkv = gpu_bench_rand(dev, B * T * 3 * C, dt, "gpu_attention");
  a.out = gpu_bench_rand(dev, B * T * C, dt, "gpu_attention");
  a.dout = gpu_bench_rand(dev, B * T * C, dt, "gpu_attention");
  a.dqkv = gpu_bench_rand(dev, B * T * 3 * C, dt, "gpu_attention");
  if (fy_device_alloc(dev, (size_t)(B * NH * T) * 4, (void **)&a.lse) != FY_OK ||
      fy_device_alloc(dev, (size_t)(B * NH * T) * 4, (void **)&a.scratch) != FY_OK)
    die("allocation");
  const double fwd_flop = 2.0 * (double)B * (double)T * (double)T * (double)C, bwd_flop = 2.5 * fwd_flop;
  const char *kinds[] = {"basic", "pipelined", "narrow", "auto"};
  enum { NK = 4, AUTO = 3 };
  float ms[NK][2] = {{0}};
  for (int k = 0; k < NK; k++) {
    if (fy_cuda_attention_set_variant(kinds[k]) != FY_OK) die("variant");
    for (int bwd = 0; bwd < 2; bwd++) {
      ms[k][bwd] = gpu_bench_time(cs, 3, reps, bwd ? run_backward : run_forward, &a, "gpu_attention",
                                  bwd ? "backward" : "forward");
      printf("{\"bench\":\"gpu_attention\",\"variant\":\"%s\",\"pass\":\"%s\",\"model\":\"%s\",\"dtype\":\"%s\","
             "\"batch\":%lld,\"seq\":%lld,\"ms\":%.3f,\"tflops\":%.1f}\n",
             kinds[k], bwd ? "backward" : "forward", model, dtype, (long long)B, (long long)T, ms[k][bwd],
             (bwd ? bwd_flop : fwd_flop) / (ms[k][bwd] * 1e-3) / 1e12);
      fflush(stdout);
    }
  }
  // The fastest forward and backward apart (each backward reads any forward's out and lse), against
  // auto's, for one layer times the step's num_hidden_layers.
  int best[2] = {0, 0};
  for (int bwd = 0; bwd < 2; bwd++)
    for (int k = 1; k < AUTO; k++)
      if (ms[k][bwd] < ms[best[bwd]][bwd]) best[bwd] = k;
  const double L = (double)cfg.num_hidden_layers;
  const double auto_ms = ((double)ms[AUTO][0] + ms[AUTO][1]) * L;
  double best_ms = ((double)ms[best[0]][0] + ms[best[1]][1]) * L;
  char faster[64];
  if (best_ms < auto_ms) {
    if (best[0] == best[1]) snprintf(faster, sizeof faster, "%s", kinds[best[0]]);
    else snprintf(faster, sizeof faster, "%s,%s", kinds[best[0]], kinds[best[1]]);
  } else {
    snprintf(faster, sizeof faster, "auto");
    best_ms = auto_ms;
  }
  printf("{\"bench\":\"gpu_attention_step\",\"model\":\"%s\",\"dtype\":\"%s\",\"basic_ms\":%.2f,\"pipelined_ms\":%.2f,"
         "\"narrow_ms\":%.2f,\"auto_ms\":%.2f,\"faster\":\"%s\",\"faster_ms\":%.2f,\"step_saving_ms\":%.1f,"
         "\"speedup\":%.3f}\n",
         model, dtype, ((double)ms[0][0] + ms[0][1]) * L, ((double)ms[1][0] + ms[1][1]) * L,
         ((double)ms[2][0] + ms[2][1]) * L, auto_ms, faster, best_ms, auto_ms - best_ms, auto_ms / best_ms);
  fy_device_dealloc(dev, a.qkv, (size_t)(B * T * 3 * C) * fy_dtype_size(dt));
  fy_device_dealloc(dev, a.dqkv, (size_t)(B * T * 3 * C) * fy_dtype_size(dt));
  fy_device_dealloc(dev, a.out, (size_t)(B * T * C) * fy_dtype_size(dt));
  fy_device_dealloc(dev, a.dout, (size_t)(B * T * C) * fy_dtype_size(dt));
  fy_device_dealloc(dev, a.lse, (size_t)(B * NH * T) * 4);
  fy_device_dealloc(dev, a.scratch, (size_t)(B * NH * T) * 4);
  fy_stream_free(st);
  fy_device_free(dev);
  return 0;
}
