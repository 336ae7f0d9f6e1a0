// bench/checkpoint: opt-125m (fp32, batch 4 x 128, 2 threads) trained with a checkpoint every few
// steps, written in the background: the write time and size of one checkpoint, and the step
// time while a write is in flight against the same run's steps without one and a run with no
// checkpoints at all. Then the checksums' cost (runtime/checkpoint.c): checkpoints of the model
// written from a snapshot, the time of each write against the part of it that hashes the files
// (read back after the fsync), and the time to check them as a load does, from the page cache and
// with the files' pages dropped first (posix_fadvise: read from the disk, where it drops them).
// Then, for each --optimizer-state format, one checkpoint of the model written from a snapshot: its
// bytes a parameter (all files, and optimizer.safetensors, which holds m and v as the format stores
// them) and its write time. Prints JSON lines.
//
// usage: checkpoint [--model opt-125m] [--steps 10] [--every 3] [--dir DIR] [--writes 3] [--checksums-only]
//                   [--formats-only]
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/opt.h"
#include "ops/ops.h"
#include "runtime/checkpoint.h"
#include "runtime/trainer.h"
#include "bench_util.h"

// Bytes of the files of step directory dir; drop: their pages out of the page cache as well.
static double dir_files(const char *dir, bool drop) {
  DIR *d = opendir(dir);
  double total = 0;
  char p[4400];
  for (struct dirent *e; d && (e = readdir(d));) {
    struct stat sb;
    snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
    if (e->d_name[0] == '.' || stat(p, &sb) != 0 || !S_ISREG(sb.st_mode)) continue;
    total += (double)sb.st_size;
    int fd = drop ? open(p, O_RDONLY) : -1;
    if (fd >= 0) {
      posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);  // (clean pages: the write synced them)
      close(fd);
    }
  }
  if (d) closedir(d);
  return total;
}

// A cpu model of cfg with random weights and a checkpoint writer under root (the caller frees
// all three, whatever the status).
static fy_status model_and_writer(const struct fy_opt_config *cfg, const char *root, struct fy_device **dev,
                                  struct fy_model **m, struct fy_ckpt_writer **w) {
  FY_TRY(fy_device_cpu_create(0, dev));
  FY_TRY(fy_model_create(cfg, 1, 8, *dev, m));
  fy_model_init_random(*m, 1);
  return fy_ckpt_writer_create(root, 1, *m, w);
}

// `writes` checkpoints of the model (random weights) under root: medians of the write, its hashing,
// and the check of a written checkpoint warm and cold.
static fy_status bench_checksums(const char *model, const struct fy_opt_config *cfg, const char *root, int writes) {
  struct fy_device *dev = NULL;
  struct fy_model *m = NULL;
  struct fy_ckpt_writer *w = NULL;
  fy_status st = model_and_writer(cfg, root, &dev, &m, &w);
  double write_s[16], hash_s[16], warm_s[16], cold_s[16], bytes = 0;
  if (writes > 16) writes = 16;
  for (int i = 0; st == FY_OK && i < writes; i++) {
    struct fy_ckpt_snapshot *s = fy_ckpt_snapshot_buffers(w);
    if (!s) {
      st = FY_ERR_NOMEM;
      break;
    }
    size_t n = (size_t)m->graph->n_param_elems;
    memcpy(s->params, m->params, n * 4);
    for (size_t k = 0; k < n; k++) s->m[k] = s->params[k] * 1e-3f, s->v[k] = s->params[k] * s->params[k];
    s->meta = (struct fy_ckpt_meta){.step = 2 * i + 1, .loss_scale = 1.0};
    st = fy_ckpt_write_async(w);
    if (st == FY_OK) st = fy_ckpt_wait(w);
    char dir[4096];
    if (st == FY_OK) st = fy_ckpt_resolve(root, dir, sizeof dir);
    if (st != FY_OK) break;
    write_s[i] = fy_ckpt_last_seconds(w);
    hash_s[i] = fy_ckpt_last_hash_seconds(w);
    bytes = dir_files(dir, false);
    double t0 = fy_now();
    st = fy_ckpt_verify(dir);  // (the first check of this directory: it hashes every file)
    warm_s[i] = fy_now() - t0;
    // Cold: the same files again, their pages dropped; a new step directory (a new write) each
    // time, so the check is not skipped as done, hence a second write here.
    s = st == FY_OK ? fy_ckpt_snapshot_buffers(w) : NULL;
    if (st == FY_OK && !s) st = FY_ERR_NOMEM;
    if (st != FY_OK) break;
    s->meta.step = 2 * i + 2;
    st = fy_ckpt_write_async(w);
    if (st == FY_OK) st = fy_ckpt_wait(w);
    if (st == FY_OK) st = fy_ckpt_resolve(root, dir, sizeof dir);
    if (st != FY_OK) break;
    dir_files(dir, true);
    t0 = fy_now();
    st = fy_ckpt_verify(dir);
    cold_s[i] = fy_now() - t0;
  }
  fy_ckpt_writer_free(w);
  fy_model_free(m);
  fy_device_free(dev);
  if (st != FY_OK) return st;
  double ws = median(write_s, writes), hs = median(hash_s, writes), vw = median(warm_s, writes), vc = median(cold_s, writes);
  printf("{\"bench\":\"checkpoint_checksums\",\"model\":\"%s\",\"hash\":\"XXH3-128\",\"writes\":%d,\"size_mib\":%.1f,"
         "\"write_s\":%.3f,\"hash_s\":%.3f,\"hash_share_of_write\":%.3f,\"hash_gib_s\":%.2f,"
         "\"verify_warm_s\":%.3f,\"verify_cold_s\":%.3f}\n",
         model, writes, bytes / 1048576.0, ws, hs, hs / ws, bytes / hs / 1073741824.0, vw, vc);
  return FY_OK;
}

// One checkpoint of the model (random weights, m and v made from them) in each state format under
// root: bytes a parameter and the write's time.
static fy_status bench_formats(const char *model, const struct fy_opt_config *cfg, const char *root) {
  struct fy_device *dev = NULL;
  struct fy_model *m = NULL;
  struct fy_ckpt_writer *w = NULL;
  fy_status st = model_and_writer(cfg, root, &dev, &m, &w);
  const double params = (double)fy_opt_num_params(cfg);
  for (int f = FY_STATE_F32; st == FY_OK && f <= FY_STATE_Q8; f++) {
    struct fy_ckpt_snapshot *s = fy_ckpt_snapshot_buffers(w);
    if (!s) {
      st = FY_ERR_NOMEM;
      break;
    }
    size_t n = (size_t)m->graph->n_param_elems;
    memcpy(s->params, m->params, n * 4);
    for (size_t k = 0; k < n; k++) s->m[k] = s->params[k] * 1e-3f, s->v[k] = s->params[k] * s->params[k] * 1e-4f;
    s->meta = (struct fy_ckpt_meta){.step = f + 1, .loss_scale = 1.0};
    snprintf(s->meta.optimizer_state, sizeof s->meta.optimizer_state, "%s", fy_state_format_name((enum fy_state_format)f));
    st = fy_ckpt_write_async(w);
    if (st == FY_OK) st = fy_ckpt_wait(w);
    char dir[4096], opt[4200];
    if (st == FY_OK) st = fy_ckpt_resolve(root, dir, sizeof dir);
    if (st != FY_OK) break;
    struct stat sb;
    snprintf(opt, sizeof opt, "%s/optimizer.safetensors", dir);
    double all = dir_files(dir, false), state = stat(opt, &sb) == 0 ? (double)sb.st_size : 0;
    printf("{\"bench\":\"checkpoint_state_format\",\"model\":\"%s\",\"optimizer_state\":\"%s\",\"size_mib\":%.1f,"
           "\"bytes_a_parameter\":%.3f,\"optimizer_file_bytes_a_parameter\":%.3f,\"write_s\":%.3f,\"hash_s\":%.3f}\n",
           model, fy_state_format_name((enum fy_state_format)f), all / 1048576.0, all / params, state / params,
           fy_ckpt_last_seconds(w), fy_ckpt_last_hash_seconds(w));
  }
  fy_ckpt_writer_free(w);
  fy_model_free(m);
  fy_device_free(dev);
  return st;
}

int main(int argc, char **argv) {
  const char *model = "opt-125m", *dir = NULL;
  int64_t steps = 10, every = 3;
  int writes = 3;
  bool sums_only = false, formats_only = false;
  for (int i = 1; i < argc; i++) {
    if (i + 1 < argc && strcmp(argv[i], "--model") == 0) model = argv[++i];
    else if (i + 1 < argc && strcmp(argv[i], "--steps") == 0) steps = atoll(argv[++i]);
    else if (i + 1 < argc && strcmp(argv[i], "--every") == 0) every = atoll(argv[++i]);
    else if (i + 1 < argc && strcmp(argv[i], "--dir") == 0) dir = argv[++i];
    else if (i + 1 < argc && strcmp(argv[i], "--writes") == 0) writes = atoi(argv[++i]);
    else if (strcmp(argv[i], "--checksums-only") == 0) sums_only = true;
    else if (strcmp(argv[i], "--formats-only") == 0) formats_only = sums_only = true;
    else {
      fprintf(stderr, "usage: checkpoint [--model P] [--steps N] [--every N] [--dir DIR] [--writes N] [--checksums-only]"
                      " [--formats-only]\n");
      return 2;
    }
  }
  struct fy_opt_config cfg;
  if (fy_opt_preset(model, &cfg) != FY_OK) return 1;
  struct bench_shard shard;
  fy_status st = bench_shard_make(&shard, cfg.vocab_size, 4 * 129 * (steps + 2) + 1);
  char root[256];
  snprintf(root, sizeof root, "%s/ckpt", dir ? dir : shard.dir);
  struct fy_train_opts o = bench_train_opts(model, &shard, 4, 128, steps, 2);
  struct fy_train_result plain, ck;
  if (st == FY_OK && !sums_only) st = fy_train(&o, &plain);
  o.save = root;
  o.save_every = every;
  o.keep = 1;
  if (st == FY_OK && !sums_only) st = fy_train(&o, &ck);
  char cmd[400];
  snprintf(cmd, sizeof cmd, "rm -rf %s", root);
  if (system(cmd) != 0) fprintf(stderr, "checkpoint: could not remove %s\n", root);
  if (st != FY_OK) {
    bench_shard_remove(&shard);
    fprintf(stderr, "checkpoint: %s\n", fy_error_msg());
    return 1;
  }
  if (!sums_only)
    printf("{\"bench\":\"checkpoint\",\"model\":\"%s\",\"checkpoints\":%d,\"write_s\":%.2f,\"size_mib\":%.1f,"
         "\"step_s_no_checkpoints\":%.3f,\"step_s_during_write\":%.3f,\"slowdown_during_write\":%.3f}\n",
         model, ck.checkpoints, ck.checkpoint_s, ck.checkpoint_bytes / 1048576.0, plain.step_s, ck.step_s_ckpt,
         ck.step_s_ckpt / plain.step_s);
  char sroot[300];
  snprintf(sroot, sizeof sroot, "%s/sums", dir ? dir : shard.dir);
  st = formats_only ? FY_OK : bench_checksums(model, &cfg, sroot, writes < 1 ? 1 : writes);
  snprintf(cmd, sizeof cmd, "rm -rf %s", sroot);
  if (system(cmd) != 0) fprintf(stderr, "checkpoint: could not remove %s\n", sroot);
  if (st == FY_OK) st = bench_formats(model, &cfg, sroot);
  if (system(cmd) != 0) fprintf(stderr, "checkpoint: could not remove %s\n", sroot);
  bench_shard_remove(&shard);
  if (st != FY_OK) {
    fprintf(stderr, "checkpoint: %s\n", fy_error_msg());
    return 1;
  }
  fy_matmul_cache_clear();
  return 0;
}
