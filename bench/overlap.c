// bench/overlap: the same model trained all-resident (cpu device, no transfers at all) and
// offloaded on the sim device whose memory holds only a fraction of the model state, with the
// host<->device link throttled to a PCIe-like rate and prefetch on. Prints JSON lines with both
// step times (medians) and their ratio; the goal is offloaded >= 0.9x the resident speed when the
// transfers fit in the compute time.
//
// The sim device's copies are memcpy on threads of their own (one core copies ~8 GB/s here) and
// the offloaded AdamW runs on host threads: on a GPU machine the copy engines and the host run
// beside the device's kernels, on the sim device they take cores from them. So by default the
// kernels of both runs get all cores but one, which is left to the copies and the host (the
// machine a GPU would give them), and a second line repeats both runs with the kernels on every
// core ("kernels_share_cores": true), which measures the simulator's contention as well as the
// overlap. On a 2-core Sapphire Rapids, 5 steps (median), 12 GB/s: opt-125m (4 x 128, 1.45 GB across
// the link a step) 0.97 with the kernels on one core, 0.92-0.94 on both; opt-350m (--steps 4;
// 3.65 GB a step) 1.04 and 0.96. --threads N: one pair of runs with N kernel threads.
// --precision bf16 (or fp16) trains both in 16-bit compute (the sim device's chunks carry the
// weights rounded to 16 bits, and their AdamW takes the gradients over that copy);
// --optimizer-lag 1 gives the offloaded run the one-step-delayed update. --rounds R alternates
// resident and offloaded runs R times and compares the medians of all their timed steps.
// --spec-chunks K gives the offloaded run speculative updates (runtime/offload.h); --clip X sets
// both runs' clipping (default 1; a fresh model clips its first steps, which speculation redoes).
// --device-updates N has the offloaded run's device update N host chunks (runtime/offload.h).
//
// usage: overlap [--model opt-125m] [--batch 4] [--seq 128] [--steps 5] [--link-gbps 12]
//                [--fraction 0.25] [--prefetch 2] [--threads N] [--precision fp32]
//                [--optimizer-lag 0] [--rounds 1] [--spec-chunks 0] [--clip 1] [--device-updates 0]
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/opt.h"
#include "memory/chunk.h"
#include "ops/ops.h"
#include "runtime/data.h"
#include "runtime/offload.h"
#include "runtime/trainer.h"
#include "bench_util.h"

struct setup {
  const char *model, *precision;
  int64_t batch, seq, steps, prefetch, lag, rounds, spec, dup;
  double link, fraction, clip;
};


// Trains the model resident and offloaded with `threads` kernel threads; prints one JSON line.
static int measure(const struct setup *u, const struct fy_opt_config *cfg, int threads, int cores) {
  struct bench_shard shard;
  fy_status st = bench_shard_make(&shard, cfg->vocab_size, u->batch * (u->seq + 1) * (u->steps + 2) + 1);
  struct fy_train_opts o = bench_train_opts(u->model, &shard, u->batch, u->seq, u->steps, threads);
  o.precision = u->precision;
  o.adamw.clip = (float)u->clip;
  struct fy_train_opts r = o;  // (resident: the cpu device)
  struct fy_train_result res, off;
  if (st == FY_OK) st = fy_train(&r, &res);
  // The device holds the smallest working set (one operator's chunks and the activations) and
  // `fraction` of the model's parameters besides, but at least one chunk: without a block to spare,
  // the next chunk cannot come in while the kernels use the last one, and nothing can overlap.
  size_t need = 0;
  int64_t chunk_elems = 0;
  if (st == FY_OK)
    st = fy_offload_plan_min_bytes(cfg, u->batch, u->seq, 1, false, false, false, 4, 0, &need, &chunk_elems);
  double params_bytes = 4.0 * (double)fy_opt_num_params(cfg);
  o.device = "sim";
  double extra = u->fraction * params_bytes, chunk_bytes = 4.0 * (double)chunk_elems;
  o.device_mem = need + (size_t)(extra > chunk_bytes ? extra : chunk_bytes);
  // (device updates: their two staging sets besides, each a piece's master, m, v, gradients and
  // 16-bit copy, floats on sim, and a granule each for the rounding)
  if (u->dup > 0) o.device_mem += 2 * 5 * ((size_t)fy_chunk_piece_elems(chunk_elems) * 4 + 4096) + 4096;
  o.sim_link_gbps = u->link;
  o.prefetch = (int)u->prefetch;
  o.optimizer_lag = (int)u->lag;
  o.spec_chunks = (int)u->spec;
  o.device_updates = (int)u->dup;
  if (st == FY_OK) st = fy_train(&o, &off);
  // More rounds, alternating: the medians of every round's median step.
  double rs[64] = {res.step_s}, os[64] = {off.step_s};
  int n = 1;
  for (; st == FY_OK && n < u->rounds && n < 64; n++) {
    struct fy_train_result a, b;
    if ((st = fy_train(&r, &a)) == FY_OK) st = fy_train(&o, &b);
    rs[n] = a.step_s;
    os[n] = b.step_s;
  }
  if (st == FY_OK) {
    res.step_s = median(rs, n);
    off.step_s = median(os, n);
  }
  bench_shard_remove(&shard);
  if (st != FY_OK) {
    fprintf(stderr, "overlap: %s\n", fy_error_msg());
    return 1;
  }
  int64_t steps = u->steps;
  printf("{\"bench\":\"overlap\",\"model\":\"%s\",\"precision\":\"%s\",\"optimizer_lag\":%lld,\"spec_chunks\":%d,"
         "\"spec_steps_kept\":%lld,\"device_updates\":%d,\"clip\":%g,\"rounds\":%d,"
         "\"batch\":%lld,\"seq\":%lld,\"threads\":%d,\"cores\":%d,"
         "\"kernels_share_cores\":%s,\"link_gbps\":%.1f,\"device_mib\":%.1f,\"cached_param_fraction\":%.3f,\"blocks\":%d,\"chunks\":%d,"
         "\"chunk_mib\":%.1f,\"prefetch\":%lld,\"resident_step_s\":%.4f,\"offload_step_s\":%.4f,"
         "\"offload_speed_vs_resident\":%.3f,\"h2d_mb_per_step\":%.1f,\"d2h_mb_per_step\":%.1f,"
         "\"copy_busy_s_per_step\":%.4f}\n",
         u->model, u->precision, (long long)u->lag, off.spec_chunks, (long long)(off.spec_steps - off.spec_redone),
         off.device_updates, u->clip, n, (long long)u->batch, (long long)u->seq, threads, cores, threads >= cores ? "true" : "false",
         u->link, o.device_mem / 1048576.0, off.n_blocks * off.chunk_bytes / params_bytes, off.n_blocks, off.n_chunks, off.chunk_bytes / 1048576.0,
         (long long)u->prefetch, res.step_s, off.step_s, res.step_s / off.step_s, off.copy_bytes[0] / steps / 1e6,
         off.copy_bytes[1] / steps / 1e6, (off.copy_busy_s[0] + off.copy_busy_s[1]) / steps);
  fflush(stdout);
  return 0;
}

int main(int argc, char **argv) {
  struct setup u = {.model = "opt-125m", .precision = "fp32", .batch = 4, .seq = 128, .steps = 5, .prefetch = 2,
                    .rounds = 1, .link = 12, .fraction = 0.25, .clip = 1.0};
  int64_t threads = 0;  // 0: all cores but one, then all
  for (int i = 1; i < argc; i++) {
    if (i + 1 < argc && strcmp(argv[i], "--model") == 0) u.model = argv[++i];
    else if (i + 1 < argc && strcmp(argv[i], "--batch") == 0) u.batch = atoll(argv[++i]);
    else if (i + 1 < argc && strcmp(argv[i], "--seq") == 0) u.seq = atoll(argv[++i]);
    else if (i + 1 < argc && strcmp(argv[i], "--steps") == 0) u.steps = atoll(argv[++i]);
    else if (i + 1 < argc && strcmp(argv[i], "--threads") == 0) threads = atoll(argv[++i]);
    else if (i + 1 < argc && strcmp(argv[i], "--prefetch") == 0) u.prefetch = atoll(argv[++i]);
    else if (i + 1 < argc && strcmp(argv[i], "--link-gbps") == 0) u.link = atof(argv[++i]);
    else if (i + 1 < argc && strcmp(argv[i], "--fraction") == 0) u.fraction = atof(argv[++i]);
    else if (i + 1 < argc && strcmp(argv[i], "--precision") == 0) u.precision = argv[++i];
    else if (i + 1 < argc && strcmp(argv[i], "--optimizer-lag") == 0) u.lag = atoll(argv[++i]);
    else if (i + 1 < argc && strcmp(argv[i], "--rounds") == 0) u.rounds = atoll(argv[++i]);
    else if (i + 1 < argc && strcmp(argv[i], "--spec-chunks") == 0) u.spec = atoll(argv[++i]);
    else if (i + 1 < argc && strcmp(argv[i], "--clip") == 0) u.clip = atof(argv[++i]);
    else if (i + 1 < argc && strcmp(argv[i], "--device-updates") == 0) u.dup = atoll(argv[++i]);
    else {
      fprintf(stderr, "usage: overlap [--model P] [--batch B] [--seq T] [--steps N] [--link-gbps X] "
                      "[--fraction F] [--prefetch N] [--threads N] [--precision P] [--optimizer-lag L] "
                      "[--rounds R] [--spec-chunks K] [--clip X] [--device-updates N]\n");
      return 2;
    }
  }
  if (u.batch < 1 || u.seq < 1 || u.steps < 1 || u.prefetch < 0 || threads < 0 || !(u.link >= 0) ||
      !(u.fraction > 0) || u.rounds < 1 || u.rounds > 64 || u.lag < 0 || u.lag > 1 || u.spec < 0 || !(u.clip >= 0)) {
    fprintf(stderr, "overlap: --batch, --seq and --steps need whole numbers >= 1, --threads and --prefetch >= 0, "
                    "--link-gbps >= 0, --fraction > 0, --rounds 1 to 64, --optimizer-lag 0 or 1, --spec-chunks >= 0 "
                    "and --clip >= 0\n");
    return 2;
  }
  struct fy_opt_config cfg;
  if (fy_opt_preset(u.model, &cfg) != FY_OK) {
    fprintf(stderr, "overlap: %s\n", fy_error_msg());
    return 1;
  }
  int cores = omp_get_num_procs(), rc = 0;
  if (threads > 0) rc = measure(&u, &cfg, (int)threads, cores);
  else {
    if (cores > 1) rc = measure(&u, &cfg, cores - 1, cores);
    if (rc == 0) rc = measure(&u, &cfg, cores, cores);
  }
  fy_matmul_cache_clear();
  return rc;
}
