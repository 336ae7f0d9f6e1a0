// bench/max_model: the largest OPT preset that trains on the sim device with a given device
// memory and host memory (and, with --disk-dir, a disk tier for AdamW state), with its parameters
// per GiB of device memory and its step time. The device memory bounds only speed: a preset is
// refused only when even its smallest working set (one operator's chunks plus activations, with
// recomputation) does not fit, or when host memory plus disk cannot hold its state.
//
// usage: max_model [--device-mem 1GiB-in-MiB: 1024] [--host-mib N] [--disk-dir DIR]
//                  [--batch 1] [--seq 128] [--steps 2] [--threads 2] [--only PRESET] [--dry-run]
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "core/opt.h"
#include "ops/ops.h"
#include "runtime/data.h"
#include "runtime/offload.h"
#include "runtime/trainer.h"
#include "bench_util.h"

int main(int argc, char **argv) {
  double dev_mib = 1024, host_mib = 0;
  const char *disk = NULL, *only = NULL;
  int64_t batch = 1, seq = 128, steps = 2, threads = 2;
  int dry = 0;
  for (int i = 1; i < argc; i++) {
    if (i + 1 < argc && strcmp(argv[i], "--device-mib") == 0) dev_mib = atof(argv[++i]);
    else if (i + 1 < argc && strcmp(argv[i], "--host-mib") == 0) host_mib = atof(argv[++i]);
    else if (i + 1 < argc && strcmp(argv[i], "--disk-dir") == 0) disk = argv[++i];
    else if (i + 1 < argc && strcmp(argv[i], "--batch") == 0) batch = atoll(argv[++i]);
    else if (i + 1 < argc && strcmp(argv[i], "--seq") == 0) seq = atoll(argv[++i]);
    else if (i + 1 < argc && strcmp(argv[i], "--steps") == 0) steps = atoll(argv[++i]);
    else if (i + 1 < argc && strcmp(argv[i], "--threads") == 0) threads = atoll(argv[++i]);
    else if (i + 1 < argc && strcmp(argv[i], "--only") == 0) only = argv[++i];
    else if (strcmp(argv[i], "--dry-run") == 0) dry = 1;
    else {
      fprintf(stderr, "usage: max_model [--device-mib N] [--host-mib N] [--disk-dir DIR] [--batch B] [--seq T] "
                      "[--steps N] [--threads N] [--only PRESET] [--dry-run]\n");
      return 2;
    }
  }
  double ram = (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGESIZE);
  // Leave room for the process itself, the sim device's pool and the page cache of the disk tier.
  if (host_mib <= 0) host_mib = (ram - dev_mib * 1048576.0) / 1048576.0 - 3072;
  double disk_free = 0;
  struct statvfs vfs;
  if (disk && statvfs(disk, &vfs) == 0) disk_free = (double)vfs.f_bavail * (double)vfs.f_frsize;
  const char *const *names = fy_opt_preset_names();
  int n = 0;
  while (names[n]) n++;
  const char *chosen = NULL;
  for (int i = n - 1; i >= 0 && !chosen; i--) {
    if (strcmp(names[i], "opt-tiny") == 0 || strcmp(names[i], "opt-demo") == 0) continue;
    if (only && strcmp(only, names[i]) != 0) continue;
    struct fy_opt_config cfg;
    fy_opt_preset(names[i], &cfg);
    size_t need = 0;
    int64_t chunk_elems = 0;
    if (fy_offload_plan_min_bytes(&cfg, batch, seq, 1, true, false, false, 4, 0, &need, &chunk_elems) != FY_OK) continue;
    double chunk = 4.0 * (double)chunk_elems;
    double p = (double)fy_opt_num_params(&cfg);
    // Parameters stay in the host tier; gradients and AdamW state go to disk when they must.
    double host_need = 4 * p + 8.0 * chunk, adam = 12 * p;
    double adam_on_host = host_mib * 1048576.0 - host_need;
    if (adam_on_host < 0) adam_on_host = 0;
    if (adam_on_host > adam) adam_on_host = adam;
    double adam_on_disk = adam - adam_on_host;
    bool fits = need <= dev_mib * 1048576.0 && host_need <= host_mib * 1048576.0 &&
                (adam_on_disk == 0 || (disk && adam_on_disk * 1.1 < disk_free));
    printf("{\"bench\":\"max_model_check\",\"model\":\"%s\",\"params\":%.0f,\"min_device_mib\":%.1f,"
           "\"host_need_gib\":%.2f,\"state_on_disk_gib\":%.2f,\"fits\":%s}\n",
           names[i], p, need / 1048576.0, host_need / 1073741824.0, adam_on_disk / 1073741824.0,
           fits ? "true" : "false");
    if (fits) chosen = names[i];
  }
  fflush(stdout);
  if (!chosen) {
    fprintf(stderr, "max_model: no preset fits\n");
    return 1;
  }
  if (dry) return 0;
  struct fy_opt_config cfg;
  fy_opt_preset(chosen, &cfg);
  struct bench_shard shard;
  fy_status st = bench_shard_make(&shard, cfg.vocab_size, batch * (seq + 1) * (steps + 2) + 1);
  struct fy_train_opts o = bench_train_opts(chosen, &shard, batch, seq, steps, (int)threads);
  o.lr = 1e-5f;
  o.device = "sim";
  o.device_mem = (size_t)(dev_mib * 1048576.0);
  o.host_mem = (size_t)(host_mib * 1048576.0);
  o.disk_dir = disk;
  o.recompute = true;
  struct fy_train_result r;
  if (st == FY_OK) st = fy_train(&o, &r);
  bench_shard_remove(&shard);
  if (st != FY_OK) {
    fprintf(stderr, "max_model: %s: %s\n", chosen, fy_error_msg());
    return 1;
  }
  printf("{\"bench\":\"max_model\",\"model\":\"%s\",\"params\":%lld,\"device_mib\":%.0f,\"host_mib\":%.0f,"
         "\"params_per_device_gib\":%.3g,\"blocks\":%d,\"chunks\":%d,\"chunk_mib\":%.1f,\"disk_chunks\":%d,"
         "\"batch\":%lld,\"seq\":%lld,\"step_s\":%.2f,\"tokens_per_s\":%.1f,\"device_peak_mib\":%.1f,"
         "\"peak_rss_gib\":%.2f,\"loss_first\":%.4f,\"loss_last\":%.4f}\n",
         chosen, (long long)fy_opt_num_params(&cfg), dev_mib, host_mib,
         fy_opt_num_params(&cfg) / (dev_mib / 1024.0), r.n_blocks, r.n_chunks, r.chunk_bytes / 1048576.0,
         r.n_disk_chunks, (long long)batch, (long long)seq, r.step_s, r.tokens_per_s,
         r.device_peak_bytes / 1048576.0, r.peak_rss_bytes / 1073741824.0, r.first_loss, r.last_loss);
  fy_matmul_cache_clear();
  return 0;
}
