// Shared by the benchmark programs: a throwaway shard of random tokens.
#ifndef FY_BENCH_UTIL_H
#define FY_BENCH_UTIL_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "runtime/data.h"

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

static inline void bench_shard_remove(struct bench_shard *s) {
  unlink(s->path);
  rmdir(s->dir);
}

#endif
