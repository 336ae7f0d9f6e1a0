// bench/cpu_train: trains a preset (default the opt-125m shape, fp32, batch 4 x 128, 2 threads)
// on random tokens for a few steps and prints JSON lines: the training rate (tokens/s and model
// GFLOP/s, medians over the timed steps), the GEMM library's own fp32 rate on the model's largest
// matrix shape (the output projection) and the machine's fp32 multiply-add peak for comparison, and
// peak memory against what the step needs.
//
// usage: cpu_train [--model opt-125m] [--batch 4] [--seq 128] [--steps 6] [--threads 2]
//                  [--precision fp32|bf16]  (bf16: ferry train --precision bf16's numbers; the GEMM
//                                            and peak lines stay fp32's)
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core/opt.h"
#include "ops/ops.h"
#include "runtime/data.h"
#include "runtime/trainer.h"
#include "bench_util.h"

// Median GFLOP/s of out (M,N) = inp (M,K) @ W^T, W (N,K): the forward product of a linear layer.
static double gemm_rate(int64_t M, int64_t N, int64_t K) {
  float *a = malloc((size_t)(M * K) * 4), *b = malloc((size_t)(N * K) * 4), *c = malloc((size_t)(M * N) * 4);
  for (int64_t i = 0; i < M * K; i++) a[i] = (float)((i * 7) % 13) * 0.01f;
  for (int64_t i = 0; i < N * K; i++) b[i] = (float)((i * 5) % 11) * 0.01f;
  double t[7];
  for (int r = 0; r < 8; r++) {
    double t0 = fy_now();
    fy_matmul(c, a, b, M, N, K, false, true, 1.0f, 0.0f);
    if (r > 0) t[r - 1] = fy_now() - t0;  // the first run creates the primitive
  }
  double med = median(t, 7);
  free(a);
  free(b);
  free(c);
  return 2.0 * M * N * K / med / 1e9;
}

// The machine's fp32 multiply-add peak on `threads` threads (GFLOP/s): every thread runs twelve
// independent chains of 16-lane fused multiply-adds (compiled for this CPU: -march=native), the
// most a GEMM could reach. The best of three runs, summed over the threads.
typedef float fma_v16 __attribute__((vector_size(64)));

static double fma_peak(int threads) {
  double best = 0;
  for (int r = 0; r < 3; r++) {
    double sum = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sum)
    {
      fma_v16 b, c, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11;
      for (int l = 0; l < 16; l++) {
        b[l] = 0.999999f, c[l] = 1e-7f;
        a0[l] = a1[l] = a2[l] = a3[l] = a4[l] = a5[l] = 1.0f + (float)l * 1e-7f;
        a6[l] = a7[l] = a8[l] = a9[l] = a10[l] = a11[l] = 1.0f - (float)l * 1e-7f;
      }
      const long n = 20000000;
      double t0 = fy_now();
      for (long i = 0; i < n; i++) {  // each line is one fma (contracted: -ffp-contract=fast)
        a0 = a0 * b + c, a1 = a1 * b + c, a2 = a2 * b + c, a3 = a3 * b + c;
        a4 = a4 * b + c, a5 = a5 * b + c, a6 = a6 * b + c, a7 = a7 * b + c;
        a8 = a8 * b + c, a9 = a9 * b + c, a10 = a10 * b + c, a11 = a11 * b + c;
      }
      double t = fy_now() - t0;
      fma_v16 all = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)) + ((a8 + a9) + (a10 + a11));
      sum += all[0] > 0 ? n * 12.0 * 16 * 2 / t / 1e9 : 0;  // (uses the chains' results)
    }
    if (sum > best) best = sum;
  }
  return best;
}

int main(int argc, char **argv) {
  const char *model = "opt-125m";
  const char *precision = "fp32";
  int64_t batch = 4, seq = 128, steps = 6, threads = 2;
  for (int i = 1; i < argc; i++) {
    if (i + 1 < argc && strcmp(argv[i], "--model") == 0) model = argv[++i];
    else if (i + 1 < argc && strcmp(argv[i], "--batch") == 0) batch = atoll(argv[++i]);
    else if (i + 1 < argc && strcmp(argv[i], "--seq") == 0) seq = atoll(argv[++i]);
    else if (i + 1 < argc && strcmp(argv[i], "--steps") == 0) steps = atoll(argv[++i]);
    else if (i + 1 < argc && strcmp(argv[i], "--threads") == 0) threads = atoll(argv[++i]);
    else if (i + 1 < argc && strcmp(argv[i], "--precision") == 0) precision = argv[++i];
    else {
      fprintf(stderr, "usage: cpu_train [--model P] [--batch B] [--seq T] [--steps N] [--threads N] [--precision P]\n");
      return 2;
    }
  }
  omp_set_num_threads((int)threads);
  struct fy_opt_config cfg;
  if (fy_opt_preset(model, &cfg) != FY_OK) {
    fprintf(stderr, "cpu_train: %s\n", fy_error_msg());
    return 1;
  }
  // Random tokens: the rate does not depend on what is learnt.
  struct bench_shard shard;
  fy_status st = bench_shard_make(&shard, cfg.vocab_size, batch * (seq + 1) * (steps + 2) + 1);
  struct fy_train_opts o = bench_train_opts(model, &shard, batch, seq, steps, (int)threads);
  o.precision = precision;
  struct fy_train_result r;
  if (st == FY_OK) st = fy_train(&o, &r);
  bench_shard_remove(&shard);
  if (st != FY_OK) {
    fprintf(stderr, "cpu_train: %s\n", fy_error_msg());
    return 1;
  }
  int64_t M = batch * seq, N = cfg.vocab_size, K = cfg.word_embed_proj_dim;
  double gemm = gemm_rate(M, N, K);
  double need = r.model_state_bytes + r.activation_bytes;
  printf("{\"bench\":\"cpu_train\",\"model\":\"%s\",\"precision\":\"%s\",\"batch\":%lld,\"seq\":%lld,"
         "\"threads\":%lld,\"steps\":%lld,\"tokens_per_s\":%.1f,\"gflops\":%.1f,\"loss_first\":%.4f,"
         "\"loss_last\":%.4f}\n",
         model, precision, (long long)batch, (long long)seq, (long long)threads, (long long)r.steps, r.tokens_per_s,
         r.gflops, r.first_loss, r.last_loss);
  printf("{\"bench\":\"gemm_fp32\",\"shape\":\"%lldx%lldx%lld\",\"gflops\":%.1f,\"model_rate_fraction\":%.3f}\n",
         (long long)M, (long long)N, (long long)K, gemm, r.gflops / gemm);
  double peak = fma_peak((int)threads);
  printf("{\"bench\":\"fma_peak_fp32\",\"threads\":%lld,\"gflops\":%.1f,\"gemm_fraction\":%.3f,"
         "\"model_rate_fraction\":%.3f}\n",
         (long long)threads, peak, gemm / peak, r.gflops / peak);
  printf("{\"bench\":\"memory\",\"peak_rss_mib\":%.1f,\"model_state_mib\":%.1f,\"activations_mib\":%.1f,"
         "\"peak_over_needed\":%.3f}\n",
         r.peak_rss_bytes / 1048576.0, r.model_state_bytes / 1048576.0, r.activation_bytes / 1048576.0,
         r.peak_rss_bytes / need);
  fy_matmul_cache_clear();
  return 0;
}
