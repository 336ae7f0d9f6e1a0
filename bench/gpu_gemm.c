// bench/gpu_gemm: the matrix products of one OPT training step on the GPU, one shape at a time,
// through the same calls the cuda engine makes (ops/cuda: fy_cuda_linear_forward,
// fy_cuda_linear_relu_forward, fy_cuda_linear_add_forward, fy_cuda_linear_backward,
// fy_cuda_linear_backward_params): for every distinct linear layer of the model (C -> OC over BT =
// batch x seq rows) the forward as the step runs it (its bias, and the relu after fc1 or the residual
// add after out_proj and fc2, in the product's epilogue), the same product alone (no bias, relu or
// residual), the input gradient (accumulating, as in training), the weight gradient and the bias
// gradient, in bf16 (or fp32). Inputs are random (never zeros); each product is timed with CUDA
// events over --reps runs after 3 warm-ups and its median printed as a JSON line with its rate,
// then one line per phase with the step's total for the model (every layer, the tied output
// projection once).
// A forward with a bias or relu is timed again through a handle that runs them as a kernel after
// the product instead of in cuBLASLt's epilogue (fy_cuda_blas_set_epilogue): "kernels_ms" beside
// "ms", and on the step's line the forward both ways and "kernels_speedup" (> 1: the kernels are
// the faster; FERRY_CUDA_EPILOGUE=kernels makes ferry run them).
// With --tune N, each product is timed again through a handle that tunes (fy_cuda_blas_set_tuning:
// the fastest of the heuristic's first N algorithms), after enough warm-up calls for it to decide:
// "tuned_ms" beside "ms", and the step's totals both ways.
//
// usage: gpu_gemm [--model opt-1.3b] [--batch 8] [--seq 2048] [--dtype bf16|fp32] [--reps 10] [--tune N]
// Exits 77 without a GPU.
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

static void die(const char *what) { gpu_bench_die("gpu_gemm", what); }
static void *gpu_rand(int64_t n, enum fy_dtype dt) { return gpu_bench_rand(dev, n, dt, "gpu_gemm"); }

enum what { FWD, FWD_ALONE, DINP, DW, DBIAS };
static const char *what_name[] = {"forward", "forward_product_alone", "input_grad", "weight_grad", "bias_grad"};

// What follows a layer's product in the step's forward, in its epilogue (the engine's fusions).
enum after { AFTER_NONE, AFTER_RELU, AFTER_ADD };

struct op_call {
  enum what w;
  struct fy_cuda_blas *h;
  enum fy_dtype dt;
  int64_t BT, C, OC;
  void *in, *wt, *bias, *out, *dout, *dinp, *dw, *db;
  enum after after;
};

static fy_status run_op(void *arg) {
  const struct op_call *o = arg;
  switch (o->w) {
    case FWD:  // (the residual of the add: dout, a buffer of the output's shape)
      if (o->after == AFTER_RELU)
        return fy_cuda_linear_relu_forward(o->h, o->out, o->in, o->wt, o->bias, o->dt, o->BT, o->C, o->OC, cs);
      if (o->after == AFTER_ADD)
        return fy_cuda_linear_add_forward(o->h, o->out, o->in, o->wt, o->bias, o->dout, o->dt, o->BT, o->C, o->OC,
                                          cs);
      return fy_cuda_linear_forward(o->h, o->out, o->in, o->wt, o->bias, o->dt, o->BT, o->C, o->OC, cs);
    case FWD_ALONE: return fy_cuda_linear_forward(o->h, o->out, o->in, o->wt, NULL, o->dt, o->BT, o->C, o->OC, cs);
    case DINP:
      return fy_cuda_linear_backward(o->h, o->dinp, NULL, NULL, o->dout, o->in, o->wt, o->dt, o->BT, o->C, o->OC, cs);
    case DW: return fy_cuda_linear_backward_params(o->h, o->dw, NULL, o->dout, o->in, o->dt, o->BT, o->C, o->OC, false, cs);
    case DBIAS:
      return fy_cuda_linear_backward_params(o->h, NULL, o->db, o->dout, o->in, o->dt, o->BT, o->C, o->OC, false, cs);
  }
  return FY_ERR_INVALID;
}

// Median milliseconds of one call of `w` for the shape.
static float time_op(const struct op_call *o, struct fy_cuda_blas *h, int reps, int warmup) {
  struct op_call c = *o;
  c.h = h;
  return gpu_bench_time(cs, warmup, reps, run_op, &c, "gpu_gemm", what_name[o->w]);
}

int main(int argc, char **argv) {
  struct gpu_bench_opts o;
  int rc = gpu_bench_args(argc, argv, "gpu_gemm",
                          "usage: gpu_gemm [--model opt-1.3b] [--batch 8] [--seq 2048] [--dtype bf16|fp32] [--reps 10] "
                          "[--tune N]",
                          true, &o);
  if (rc >= 0) return rc;
  const struct fy_opt_config cfg = o.cfg;
  const enum fy_dtype dt = o.dt;
  const char *model = o.model, *dtype = o.dtype;
  const int64_t batch = o.batch, seq = o.seq;
  const int reps = o.reps, tune = o.tune;
  fy_stream *st = NULL;
  gpu_bench_device("gpu_gemm", &dev, &st, &cs);
  const size_t ws_bytes = (size_t)32 << 20;  // what the engine gives cuBLASLt
  void *ws = NULL;
  struct fy_cuda_blas *h = NULL;
  if (fy_device_alloc(dev, ws_bytes, &ws) != FY_OK || fy_cuda_blas_create(ws, ws_bytes, &h) != FY_OK) die("cuBLASLt");
  fy_cuda_blas_set_tuning(h, 0);  // the default, whatever FERRY_CUDA_GEMM_TUNE says
  fy_cuda_blas_set_epilogue(h, true);  // (whatever FERRY_CUDA_EPILOGUE says)
  struct fy_cuda_blas *hk = NULL;  // the bias and relu as kernels after the product (the same workspace)
  if (fy_cuda_blas_create(ws, ws_bytes, &hk) != FY_OK) die("cuBLASLt");
  fy_cuda_blas_set_tuning(hk, 0);
  fy_cuda_blas_set_epilogue(hk, false);
  struct fy_cuda_blas *ht = NULL;  // the tuning handle (the same workspace: one stream)
  if (tune > 1) {
    if (fy_cuda_blas_create(ws, ws_bytes, &ht) != FY_OK) die("cuBLASLt");
    fy_cuda_blas_set_tuning(ht, tune);
    fy_cuda_blas_set_epilogue(ht, true);
  }

  // The model's linear layers (C -> OC, how many per step, bias or not, what the epilogue adds:
  // the relu after fc1 where the activation is relu, the residual after out_proj and fc2 where no
  // dropout comes between).
  const int64_t D = cfg.hidden_size, F = cfg.ffn_dim, E = cfg.word_embed_proj_dim, L = cfg.num_hidden_layers;
  const enum after res = cfg.dropout > 0 ? AFTER_NONE : AFTER_ADD;
  struct { const char *name; int64_t C, OC, count; bool bias; enum after after; } shapes[] = {
      {"qkv", D, 3 * D, L, cfg.enable_bias, AFTER_NONE},
      {"out_proj", D, D, L, cfg.enable_bias, res},
      {"fc1", D, F, L, cfg.enable_bias, cfg.activation == FY_ACT_RELU ? AFTER_RELU : AFTER_NONE},
      {"fc2", F, D, L, cfg.enable_bias, res},
      {"lm_head", E, cfg.vocab_size, 1, false, AFTER_NONE},
  };
  const int64_t BT = batch * seq;
  double total_ms[5] = {0}, total_flop[5] = {0}, tuned_ms[5] = {0}, kernels_ms = 0;
  for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
    const int64_t C = shapes[s].C, OC = shapes[s].OC;
    void *in = gpu_rand(BT * C, dt), *wt = gpu_rand(OC * C, dt), *bias = gpu_rand(OC, dt), *out = gpu_rand(BT * OC, dt);
    void *dout = gpu_rand(BT * OC, dt), *dinp = gpu_rand(BT * C, dt), *dw = gpu_rand(OC * C, dt), *db = gpu_rand(OC, dt);
    const bool epilogue = shapes[s].bias || shapes[s].after == AFTER_RELU;  // (what the kernels can take)
    for (int w = FWD; w <= DBIAS; w++) {
      // (the product alone is the forward itself when nothing rides it)
      if ((w == FWD_ALONE && !shapes[s].bias && shapes[s].after == AFTER_NONE) || (w == DBIAS && !shapes[s].bias))
        continue;
      struct op_call call = {(enum what)w, h, dt, BT, C, OC, in, wt, shapes[s].bias ? bias : NULL, out, dout, dinp,
                             dw, db, shapes[s].after};
      float ms = time_op(&call, h, reps, 3);
      float kms = w == FWD && epilogue ? time_op(&call, hk, reps, 3) : 0;
      // Tuned: enough warm-ups for every candidate's trials (3 each) and the decision after them.
      float tms = ht ? time_op(&call, ht, reps, 3 * tune + 4) : 0;
      double flop = w == DBIAS ? 0 : 2.0 * (double)BT * (double)C * (double)OC;
      printf("{\"bench\":\"gpu_gemm\",\"layer\":\"%s\",\"op\":\"%s\",\"dtype\":\"%s\",\"rows\":%lld,\"in\":%lld,"
             "\"out\":%lld,\"ms\":%.4f,\"tflops\":%.1f,\"gbps\":%.1f",
             shapes[s].name, what_name[w], dtype, (long long)BT, (long long)C, (long long)OC, ms,
             flop / (ms * 1e-3) / 1e12, (double)BT * OC * fy_dtype_size(dt) / (ms * 1e-3) / 1e9);
      if (kms > 0) printf(",\"kernels_ms\":%.4f,\"kernels_tflops\":%.1f", kms, flop / (kms * 1e-3) / 1e12);
      if (ht) printf(",\"tuned_ms\":%.4f,\"tuned_tflops\":%.1f", tms, flop / (tms * 1e-3) / 1e12);
      printf("}\n");
      fflush(stdout);
      if (w != FWD_ALONE) {  // the step's own calls: forward with its bias, relu or residual
        int k = w == FWD ? 0 : w == DINP ? 1 : w == DW ? 2 : 3;
        total_ms[k] += ms * shapes[s].count;
        tuned_ms[k] += tms * shapes[s].count;
        total_flop[k] += flop * shapes[s].count;
        if (w == FWD) kernels_ms += (kms > 0 ? kms : ms) * shapes[s].count;
      }
    }
    void *bufs[] = {in, wt, bias, out, dout, dinp, dw, db};
    size_t sizes[] = {(size_t)(BT * C), (size_t)(OC * C), (size_t)OC, (size_t)(BT * OC),
                      (size_t)(BT * OC), (size_t)(BT * C), (size_t)(OC * C), (size_t)OC};
    for (int i = 0; i < 8; i++) fy_device_dealloc(dev, bufs[i], sizes[i] * fy_dtype_size(dt));
  }
  // The step's products per phase (milliseconds, and TFLOP/s where there are FLOPs), on one line.
  printf("{\"bench\":\"gpu_gemm_step\",\"model\":\"%s\",\"dtype\":\"%s\",\"rows\":%lld", model, dtype, (long long)BT);
  const char *phase[] = {"forward", "input_grad", "weight_grad", "bias_grad"};
  for (int k = 0; k < 4; k++) {
    printf(",\"%s_ms\":%.2f", phase[k], total_ms[k]);
    if (total_flop[k] > 0) printf(",\"%s_tflops\":%.1f", phase[k], total_flop[k] / (total_ms[k] * 1e-3) / 1e12);
  }
  // The forward with the bias and relu as kernels after the products (FERRY_CUDA_EPILOGUE=kernels).
  printf(",\"forward_kernels_ms\":%.2f,\"kernels_speedup\":%.3f", kernels_ms, total_ms[0] / kernels_ms);
  if (ht) {
    double a = 0, b = 0;
    for (int k = 0; k < 4; k++) {
      printf(",\"tuned_%s_ms\":%.2f", phase[k], tuned_ms[k]);
      a += total_ms[k], b += tuned_ms[k];
    }
    printf(",\"tune\":%d,\"step_ms\":%.2f,\"tuned_step_ms\":%.2f,\"tuned_speedup\":%.3f", tune, a, b, a / b);
  }
  printf("}\n");
  fy_cuda_blas_free(h);
  fy_cuda_blas_free(hk);
  fy_cuda_blas_free(ht);
  fy_device_dealloc(dev, ws, ws_bytes);
  fy_stream_free(st);
  fy_device_free(dev);
  return 0;
}
