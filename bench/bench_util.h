// Shared by the benchmark programs: the clock, medians, a throwaway shard of random tokens, and the
// training options every training benchmark starts from.
#ifndef FY_BENCH_UTIL_H
#define FY_BENCH_UTIL_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "core/clock.h"
#include "runtime/data.h"
#include "runtime/trainer.h"

static inline int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

// The median of v[0..n) (sorts v).
static inline double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct bench_shard {
  char dir[64], path[96];
};

// Writes n random tokens below vocab (xorshift, fixed seed) to a shard in a new temporary directory.
static inline fy_status bench_shard_make(struct bench_shard *s, int64_t vocab, int64_t n) {
  snprintf(s->dir, sizeof s->dir, "/tmp/ferry_bench_XXXXXX");
  if (!mkdtemp(s->dir)) return fy_error_set(FY_ERR_IO, "cannot create a temporary directory");
  snprintf(s->path, sizeof s->path, "%s/rand.bin", s->dir);
  uint16_t *tok = malloc((size_t)n * 2);
  if (!tok) return fy_error_set(FY_ERR_NOMEM, "cannot allocate %lld tokens", (long long)n);
  uint64_t x = 88172645463325252ull;
  for (int64_t i = 0; i < n; i++) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    tok[i] = (uint16_t)(x % (uint64_t)vocab);
  }
  fy_status st = fy_shard_write(s->path, tok, n);
  free(tok);
  return st;
}

// A quiet, unshuffled run of `model` on the shard at a small constant learning rate: the rate of a
// step does not depend on what is learnt.
static inline struct fy_train_opts bench_train_opts(const char *model, const struct bench_shard *shard, int64_t batch,
                                                    int64_t seq, int64_t steps, int threads) {
  struct fy_train_opts o;
  fy_train_opts_defaults(&o);
  o.model = model;
  o.data = shard->path;
  o.batch = batch;
  o.seq = seq;
  o.steps = steps;
  o.lr = 1e-4f;
  o.warmup = 0;
  o.quiet = true;
  o.shuffle = false;
  o.threads = threads;
  return o;
}

static inline void bench_shard_remove(struct bench_shard *s) {
  unlink(s->path);
  rmdir(s->dir);
}

#endif
