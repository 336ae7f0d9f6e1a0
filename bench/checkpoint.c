// bench/checkpoint: opt-125m (fp32, batch 4 x 128, 2 threads) trained with a checkpoint every few
// steps, written in the background: the write time and size of one checkpoint, and the step
// time while a write is in flight against the same run's steps without one and a run with no
// checkpoints at all. Prints JSON lines.
//
// usage: checkpoint [--model opt-125m] [--steps 10] [--every 3] [--dir DIR]
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/opt.h"
#include "ops/ops.h"
#include "runtime/trainer.h"
#include "bench_util.h"

int main(int argc, char **argv) {
  const char *model = "opt-125m", *dir = NULL;
  int64_t steps = 10, every = 3;
  for (int i = 1; i < argc; i++) {
    if (i + 1 < argc && strcmp(argv[i], "--model") == 0) model = argv[++i];
    else if (i + 1 < argc && strcmp(argv[i], "--steps") == 0) steps = atoll(argv[++i]);
    else if (i + 1 < argc && strcmp(argv[i], "--every") == 0) every = atoll(argv[++i]);
    else if (i + 1 < argc && strcmp(argv[i], "--dir") == 0) dir = argv[++i];
    else {
      fprintf(stderr, "usage: checkpoint [--model P] [--steps N] [--every N] [--dir DIR]\n");
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
  if (st == FY_OK) st = fy_train(&o, &plain);
  o.save = root;
  o.save_every = every;
  o.keep = 1;
  if (st == FY_OK) st = fy_train(&o, &ck);
  char cmd[400];
  snprintf(cmd, sizeof cmd, "rm -rf %s", root);
  if (system(cmd) != 0) fprintf(stderr, "checkpoint: could not remove %s\n", root);
  bench_shard_remove(&shard);
  if (st != FY_OK) {
    fprintf(stderr, "checkpoint: %s\n", fy_error_msg());
    return 1;
  }
  printf("{\"bench\":\"checkpoint\",\"model\":\"%s\",\"checkpoints\":%d,\"write_s\":%.2f,\"size_mib\":%.1f,"
         "\"step_s_no_checkpoints\":%.3f,\"step_s_during_write\":%.3f,\"slowdown_during_write\":%.3f}\n",
         model, ck.checkpoints, ck.checkpoint_s, ck.checkpoint_bytes / 1048576.0, plain.step_s, ck.step_s_ckpt,
         ck.step_s_ckpt / plain.step_s);
  fy_matmul_cache_clear();
  return 0;
}
