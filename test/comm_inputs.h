// The collectives tests' inputs (test_comm.c, test_comm_nccl.c): every rank's values, derived from
// its rank and the index, so that each rank can compute what any other sent and what a sum must be.
#ifndef FY_TEST_COMM_INPUTS_H
#define FY_TEST_COMM_INPUTS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "core/dtype.h"
#include "runtime/comm.h"

static inline uint64_t comm_mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Rank r's input at index i: signed, exponents over 2^-6..2^9, so that the order of a sum (or a
// lost contribution) shows.
static inline float value(int r, size_t i) {
  uint64_t u = comm_mix(((uint64_t)r << 40) ^ (uint64_t)i);
  float m = 1.0f + (float)(u & 0xffffff) / (float)(1 << 24);
  float v = ldexpf(m, (int)((u >> 24) % 16) - 6);
  return (u >> 40) & 1 ? -v : v;
}

// 0, 1, ..., n-1 (malloc'd): the ranks of a split that keeps them all.
static inline int *all_ranks(int n) {
  int *r = malloc((size_t)n * sizeof *r);
  for (int i = 0; i < n; i++) r[i] = i;
  return r;
}

static inline uint64_t hash_bytes(const void *p, size_t n) {
  const unsigned char *b = p;
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

// Fills x with rank r's input (n elements from index `from`) in dt.
static inline void fill(void *x, enum fy_reduce_dtype dt, int r, size_t from, size_t n) {
  for (size_t i = 0; i < n; i++) {
    if (dt == FY_COMM_F32)
      ((float *)x)[i] = value(r, from + i);
    else
      ((uint16_t *)x)[i] = fy_f32_to_bf16(value(r, from + i));
  }
}

// Rank r's input at i as the collective sees it (rounded to bf16 for bf16).
static inline float input_f32(enum fy_reduce_dtype dt, int r, size_t i) {
  float v = value(r, i);
  return dt == FY_COMM_F32 ? v : fy_bf16_to_f32(fy_f32_to_bf16(v));
}

#endif
