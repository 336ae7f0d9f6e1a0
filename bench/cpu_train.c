// bench/cpu_train: trains a preset (default the opt-125m shape, fp32, batch 4 x 128, 2 threads)
// on random tokens for a few steps and prints JSON lines: the training rate (tokens/s and model
// GFLOP/s, medians over the timed steps: model FLOPs as PaLM and Megatron count them, and llm.c's
// count beside them, core/opt.c), the GEMM library's own fp32 rate on the model's largest matrix
// shape (the output projection) and the machine's fp32 multiply-add peak for comparison (real FMA
// instructions, the widest the processor has: planner/probe.c), and peak memory against what the
// step needs.
//
// usage: cpu_train [--model opt-125m] [--batch 4] [--seq 128] [--steps 6] [--threads 2]
//                  [--precision fp32|bf16]  (bf16: ferry train --precision bf16's numbers; the GEMM
//                                            and peak lines stay fp32's)
//                  [--data SHARD]  (its windows in order, as bench/peers/torch_opt.py --data takes
//                                   them; default: a shard of random tokens)
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core/opt.h"
#include "ops/ops.h"
#include "planner/probe.h"
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

int main(int argc, char **argv) {
  const char *model = "opt-125m";
  const char *precision = "fp32", *data = NULL;
  int64_t batch = 4, seq = 128, steps = 6, threads = 2;
  for (int i = 1; i < argc; i++) {
    if (i + 1 < argc && strcmp(argv[i], "--model") == 0) model = argv[++i];
    else if (i + 1 < argc && strcmp(argv[i], "--batch") == 0) batch = atoll(argv[++i]);
    else if (i + 1 < argc && strcmp(argv[i], "--seq") == 0) seq = atoll(argv[++i]);
    else if (i + 1 < argc && strcmp(argv[i], "--steps") == 0) steps = atoll(argv[++i]);
    else if (i + 1 < argc && strcmp(argv[i], "--threads") == 0) threads = atoll(argv[++i]);
    else if (i + 1 < argc && strcmp(argv[i], "--precision") == 0) precision = argv[++i];
    else if (i + 1 < argc && strcmp(argv[i], "--data") == 0) data = argv[++i];
    else {
      fprintf(stderr, "usage: cpu_train [--model P] [--batch B] [--seq T] [--steps N] [--threads N] [--precision P] "
              "[--data SHARD]\n");
      return 2;
    }
  }
  omp_set_num_threads((int)threads);
  struct fy_opt_config cfg;
  if (fy_opt_preset(model, &cfg) != FY_OK) {
    fprintf(stderr, "cpu_train: %s\n", fy_error_msg());
    return 1;
  }
  // Random tokens unless given: the rate does not depend on what is learnt. (bench_train_opts runs
  // unshuffled: the windows in order.)
  struct bench_shard shard;
  fy_status st = data ? FY_OK : bench_shard_make(&shard, cfg.vocab_size, batch * (seq + 1) * (steps + 2) + 1);
  struct fy_train_opts o = bench_train_opts(model, &shard, batch, seq, steps, (int)threads);
  if (data) o.data = data;
  o.precision = precision;
  struct fy_train_result r;
  if (st == FY_OK) st = fy_train(&o, &r);
  if (!data) bench_shard_remove(&shard);
  if (st != FY_OK) {
    fprintf(stderr, "cpu_train: %s\n", fy_error_msg());
    return 1;
  }
  int64_t M = batch * seq, N = cfg.vocab_size, K = cfg.word_embed_proj_dim;
  double gemm = gemm_rate(M, N, K);
  double need = r.model_state_bytes + r.activation_bytes;
  printf("{\"bench\":\"cpu_train\",\"model\":\"%s\",\"precision\":\"%s\",\"batch\":%lld,\"seq\":%lld,"
         "\"threads\":%lld,\"steps\":%lld,\"tokens_per_s\":%.1f,\"gflops\":%.1f,\"gflops_llmc\":%.1f,"
         "\"flops_per_step\":%.0f,\"flops_per_step_llmc\":%.0f,\"flops_count\":\"palm\",\"loss_first\":%.4f,"
         "\"loss_last\":%.4f}\n",
         model, precision, (long long)batch, (long long)seq, (long long)threads, (long long)r.steps, r.tokens_per_s,
         r.gflops, r.gflops_llmc, fy_opt_step_flops(&cfg, batch, seq, FY_FLOPS_PALM),
         fy_opt_step_flops(&cfg, batch, seq, FY_FLOPS_LLMC), r.first_loss, r.last_loss);
  printf("{\"bench\":\"gemm_fp32\",\"shape\":\"%lldx%lldx%lld\",\"gflops\":%.1f,\"model_rate_fraction\":%.3f}\n",
         (long long)M, (long long)N, (long long)K, gemm, r.gflops / gemm);
  // The widest FMA the processor has, and AVX2's 256-bit one beside it where it has AVX-512 (a
  // core that splits 512-bit FMAs in two, as Zen 4 does, peaks no higher with them): the peak is
  // the better of the two.
  const char *isa = fy_probe_fma_isa();
  const long iters = 4000000;  // (short runs: on a shared machine, a quiet moment is more likely)
  double wide = fy_probe_fma_peak_gflops((int)threads, iters, isa);
  double avx2 = strcmp(isa, "avx512") == 0 ? fy_probe_fma_peak_gflops((int)threads, iters, "avx2") : 0;
  double peak = wide > avx2 ? wide : avx2;
  printf("{\"bench\":\"fma_peak_fp32\",\"isa\":\"%s\",\"threads\":%lld,\"gflops\":%.1f,\"gemm_fraction\":%.3f,"
         "\"model_rate_fraction\":%.3f,\"model_rate_fraction_llmc\":%.3f,\"%s_gflops\":%.1f",
         isa, (long long)threads, peak, gemm / peak, r.gflops / peak, r.gflops_llmc / peak, isa, wide);
  if (avx2 > 0) printf(",\"avx2_gflops\":%.1f", avx2);
  printf("}\n");
  printf("{\"bench\":\"memory\",\"peak_rss_mib\":%.1f,\"model_state_mib\":%.1f,\"activations_mib\":%.1f,"
         "\"peak_over_needed\":%.3f}\n",
         r.peak_rss_bytes / 1048576.0, r.model_state_bytes / 1048576.0, r.activation_bytes / 1048576.0,
         r.peak_rss_bytes / need);
  fy_matmul_cache_clear();
  return 0;
}
