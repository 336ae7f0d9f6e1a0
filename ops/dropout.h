// Dropout masks that are never stored: whether element (token u, column j) of a dropout site is
// kept is a hash of (key, u, j). The key names the run's seed and the site (a decoder layer's
// attention or feed-forward residual); u is the token's place in the data stream (row s of the
// stream, position t: u = s*T + t, the same on every rank and micro-batch size, runtime/data.h);
// j is the column in the full width. So backward and recomputation regenerate the forward's mask
// bit for bit, and every backend, placement, rank count and tensor-parallel split draws the same
// one: dropout changes no result beyond rounding (docs/design.md, "Correctness rule").
//
// The hashes are splitmix64's finaliser (core/rand.h, per site and per token) and murmur3's 32-bit
// one (per element: 32-bit multiplies vectorise on a CPU and are single instructions on a GPU). A plain C
// header for the CPU kernels, the CUDA kernels and the tests (test/reference/check_variants.py
// repeats it in numpy to give transformers the same masks).
#ifndef FY_OPS_DROPOUT_H
#define FY_OPS_DROPOUT_H

#include <stdbool.h>
#include <stdint.h>

#include "core/rand.h"  // (FY_RAND_FN: host and, under nvcc, device functions)

FY_RAND_FN uint32_t fy_dropout_mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x85ebca6bu;
  x ^= x >> 13;
  x *= 0xc2b2ae35u;
  return x ^ (x >> 16);
}

// The key of one site for a run's seed.
FY_RAND_FN uint64_t fy_dropout_key(uint64_t seed, int site) {
  return fy_mix64(fy_mix64(seed) + (uint64_t)(site + 1) * 0x9e3779b97f4a7c15ull);
}

// The hash of token u at a site; each column j draws from it.
FY_RAND_FN uint64_t fy_dropout_token(uint64_t key, int64_t u) {
  return fy_mix64(key ^ ((uint64_t)u * 0xd1b54a32d192ed03ull));
}

// Element j of a token is dropped when its 32-bit draw is below the threshold (p * 2^32).
FY_RAND_FN uint32_t fy_dropout_draw(uint64_t token, int64_t j) {
  return fy_dropout_mix32(((uint32_t)token + (uint32_t)j * 0x9e3779b9u) ^ (uint32_t)(token >> 32));
}

FY_RAND_FN uint32_t fy_dropout_threshold(float p) {
  double t = (double)p * 4294967296.0;
  return p <= 0 ? 0u : t >= 4294967295.0 ? 0xffffffffu : (uint32_t)t;
}

// What a kept element is multiplied by: 1 / (1 - p), as torch.nn.functional.dropout.
FY_RAND_FN float fy_dropout_scale(float p) { return p < 1 ? 1.0f / (1.0f - p) : 0.0f; }

#endif
