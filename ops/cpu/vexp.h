// A vectorisable exp for the softmax kernels (attention, cross-entropy).
#ifndef FY_OPS_CPU_VEXP_H
#define FY_OPS_CPU_VEXP_H

#include <math.h>
#include <stdint.h>
#include <string.h>

// exp(x) in a form gcc vectorises (glibc's expf is only vectorised under -ffast-math): Cody-Waite
// range reduction x = n ln2 + r, Cephes' degree-6 polynomial for exp(r), 2^n from the exponent
// bits. Within 1.5 ulp of exp over [-87, 88]; x is clamped to that range (callers subtract the
// row maximum, so x <= 0, and values below e^-87 are negligible against the row sum >= 1).
static inline float fy_expf_(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  float n = rintf(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // Unsigned arithmetic: a NaN input (n undefined) must give NaN, not undefined behaviour.
  uint32_t bits = ((uint32_t)(int32_t)n + 127u) << 23;
  float scale;
  memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

#endif
