// The mixing behind every seeded stream of numbers (initialisation, data shuffling, dropout masks,
// the sampler, the sim device's and the disk tier's jitter): splitmix64's finaliser, and the
// generator that applies it to a counter stepped by the golden ratio. Header-only, and callable
// from CUDA kernels (ops/dropout.h draws its masks with it on both backends).
#ifndef FY_RAND_H
#define FY_RAND_H

#include <stdint.h>

#ifdef __CUDACC__
#define FY_RAND_FN static __host__ __device__ __forceinline__
#else
#define FY_RAND_FN static inline
#endif

FY_RAND_FN uint64_t fy_mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The next number of the stream whose state is *state.
FY_RAND_FN uint64_t fy_splitmix64(uint64_t *state) { return fy_mix64(*state += 0x9e3779b97f4a7c15ull); }

#endif
