// bench/overlap: the same model trained all-resident (cpu device, no transfers at all) and
// offloaded on the sim device whose memory holds only a fraction of the model state, with the
// host<->device link throttled to a PCIe-like rate and prefetch on. Prints JSON lines with both
// step times (medians) and their ratio; the goal is offloaded >= 0.9x the resident speed when the
// transfers fit in the compute time.
//
// The sim device's copies are memcpy on a thread of their own, and the offloaded AdamW runs on
// host threads: on a machine with few cores they take cores from the kernels, which a GPU's copy
// engines would not. On a 2-core machine (opt-125m, 4 x 128, 1.8 GB across the link a step):
// --threads 2 measured 0.83-0.87 (the kernels lose to the copies' memcpy and the host AdamW),
// --threads 1, which leaves them a core, 0.94.
//
// usage: overlap [--model opt-125m] [--batch 4] [--seq 128] [--steps 5] [--link-gbps 12]
//                [--fraction 0.25] [--prefetch 2] [--threads 2]
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/opt.h"
#include "ops/ops.h"
#include "runtime/data.h"
#include "runtime/offload.h"
#include "runtime/trainer.h"
#include "bench_util.h"

int main(int argc, char **argv) {
  const char *model = "opt-125m";
  int64_t batch = 4, seq = 128, steps = 5, threads = 2, prefetch = 2;
  double link = 12, fraction = 0.25;
  for (int i = 1; i < argc; i++) {
    if (i + 1 < argc && strcmp(argv[i], "--model") == 0) model = argv[++i];
    else if (i + 1 < argc && strcmp(argv[i], "--batch") == 0) batch = atoll(argv[++i]);
    else if (i + 1 < argc && strcmp(argv[i], "--seq") == 0) seq = atoll(argv[++i]);
    else if (i + 1 < argc && strcmp(argv[i], "--steps") == 0) steps = atoll(argv[++i]);
    else if (i + 1 < argc && strcmp(argv[i], "--threads") == 0) threads = atoll(argv[++i]);
    else if (i + 1 < argc && strcmp(argv[i], "--prefetch") == 0) prefetch = atoll(argv[++i]);
    else if (i + 1 < argc && strcmp(argv[i], "--link-gbps") == 0) link = atof(argv[++i]);
    else if (i + 1 < argc && strcmp(argv[i], "--fraction") == 0) fraction = atof(argv[++i]);
    else {
      fprintf(stderr, "usage: overlap [--model P] [--batch B] [--seq T] [--steps N] [--link-gbps X] "
                      "[--fraction F] [--prefetch N] [--threads N]\n");
      return 2;
    }
  }
  struct fy_opt_config cfg;
  if (fy_opt_preset(model, &cfg) != FY_OK) {
    fprintf(stderr, "overlap: %s\n", fy_error_msg());
    return 1;
  }
  struct bench_shard shard;
  fy_status st = bench_shard_make(&shard, cfg.vocab_size, batch * (seq + 1) * (steps + 2) + 1);
  struct fy_train_opts o = bench_train_opts(model, &shard, batch, seq, steps, (int)threads);
  struct fy_train_result res, off;
  if (st == FY_OK) st = fy_train(&o, &res);
  // The device holds the activations and `fraction` of the model's parameters as cache blocks.
  size_t need = 0;
  int64_t chunk_elems = 0;
  if (st == FY_OK) st = fy_offload_plan_min_bytes(&cfg, batch, seq, 1, false, false, false, 4, 0, &need, &chunk_elems);
  double params_bytes = 4.0 * (double)fy_opt_num_params(&cfg);
  o.device = "sim";
  o.device_mem = need + (size_t)(fraction * params_bytes);
  o.sim_link_gbps = link;
  o.prefetch = (int)prefetch;
  if (st == FY_OK) st = fy_train(&o, &off);
  bench_shard_remove(&shard);
  if (st != FY_OK) {
    fprintf(stderr, "overlap: %s\n", fy_error_msg());
    return 1;
  }
  printf("{\"bench\":\"overlap\",\"model\":\"%s\",\"batch\":%lld,\"seq\":%lld,\"threads\":%lld,"
         "\"link_gbps\":%.1f,\"device_mib\":%.1f,\"blocks\":%d,\"chunks\":%d,\"chunk_mib\":%.1f,"
         "\"prefetch\":%lld,\"resident_step_s\":%.4f,\"offload_step_s\":%.4f,"
         "\"offload_speed_vs_resident\":%.3f,\"h2d_mb_per_step\":%.1f,\"d2h_mb_per_step\":%.1f,"
         "\"copy_busy_s_per_step\":%.4f}\n",
         model, (long long)batch, (long long)seq, (long long)threads, link, o.device_mem / 1048576.0,
         off.n_blocks, off.n_chunks, off.chunk_bytes / 1048576.0, (long long)prefetch, res.step_s, off.step_s,
         res.step_s / off.step_s, off.copy_bytes[0] / steps / 1e6, off.copy_bytes[1] / steps / 1e6,
         (off.copy_busy_s[0] + off.copy_busy_s[1]) / steps);
  fy_matmul_cache_clear();
  return 0;
}
