// core/dtype.c: bf16 and f16 conversions against known bit patterns, round-to-nearest-even,
// subnormals, inf and NaN, and exhaustive round trips.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/dtype.h"
#include "core/status.h"
#include "test/check.h"

static float f_of(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static uint32_t u_of(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

static uint64_t rng_state = 0x1234567887654321ull;
static uint64_t rng(void) {  // splitmix64
  uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static void test_names(void) {
  CHECK(fy_dtype_size(FY_F32) == 4 && fy_dtype_size(FY_BF16) == 2 && fy_dtype_size(FY_F16) == 2);
  CHECK(fy_dtype_size(FY_I32) == 4 && fy_dtype_size(FY_U16) == 2 && fy_dtype_size(FY_I64) == 8);
  CHECK(fy_dtype_from_safetensors("BF16") == FY_BF16);
  CHECK(fy_dtype_from_safetensors("I64") == FY_I64);
  CHECK(fy_dtype_from_safetensors("F64") == -1);
  enum fy_dtype pd = FY_I32;
  CHECK(fy_precision_dtype("bf16", &pd) && pd == FY_BF16 && !strcmp(fy_precision_name(pd), "bf16"));
  CHECK(fy_precision_dtype("fp16", &pd) && pd == FY_F16 && fy_precision_dtype("fp32", &pd) && pd == FY_F32);
  CHECK(!fy_precision_dtype("f32", &pd) && !fy_precision_dtype(NULL, &pd) && pd == FY_F32);
  CHECK(fy_dtype_from_safetensors("f32") == -1);
  CHECK(strcmp(fy_dtype_safetensors_name(FY_F16), "F16") == 0);
  CHECK(strcmp(fy_dtype_name(FY_BF16), "bf16") == 0);
}

static void test_bf16_patterns(void) {
  CHECK(fy_f32_to_bf16(1.0f) == 0x3f80);
  CHECK(fy_f32_to_bf16(-2.0f) == 0xc000);
  CHECK(fy_f32_to_bf16(0.0f) == 0x0000);
  CHECK(fy_f32_to_bf16(-0.0f) == 0x8000);
  CHECK(fy_f32_to_bf16(3.140625f) == 0x4049);  // exactly representable
  // Ties go to the even neighbour; anything above the tie rounds up.
  CHECK(fy_f32_to_bf16(f_of(0x3f808000)) == 0x3f80);
  CHECK(fy_f32_to_bf16(f_of(0x3f818000)) == 0x3f82);
  CHECK(fy_f32_to_bf16(f_of(0x3f808001)) == 0x3f81);
  CHECK(fy_f32_to_bf16(f_of(0x3f807fff)) == 0x3f80);
  CHECK(fy_f32_to_bf16(f_of(0xbf818000)) == 0xbf82);
  // Overflow to inf, inf and NaN.
  CHECK(fy_f32_to_bf16(f_of(0x7f7fffff)) == 0x7f80);
  CHECK(fy_f32_to_bf16(INFINITY) == 0x7f80);
  CHECK(fy_f32_to_bf16(-INFINITY) == 0xff80);
  CHECK(fy_f32_to_bf16(f_of(0x7fc00000)) == 0x7fc0);
  CHECK(fy_f32_to_bf16(f_of(0xffc00000)) == 0xffc0);
  uint16_t snan = fy_f32_to_bf16(f_of(0x7f800001));  // payload only in the low bits: must stay NaN
  CHECK((snan & 0x7f80) == 0x7f80 && (snan & 0x7f) != 0);
  CHECK(isnan(fy_bf16_to_f32(snan)));
  // Subnormals.
  CHECK(fy_f32_to_bf16(f_of(0x00000001)) == 0x0000);
  CHECK(fy_f32_to_bf16(f_of(0x00010000)) == 0x0001);
  CHECK(fy_f32_to_bf16(f_of(0x00018000)) == 0x0002);
  CHECK(fy_f32_to_bf16(f_of(0x00008000)) == 0x0000);
  CHECK(fy_f32_to_bf16(f_of(0x00008001)) == 0x0001);
  CHECK(u_of(fy_bf16_to_f32(0x0001)) == 0x00010000u);
  CHECK(fy_bf16_to_f32(0x3f80) == 1.0f);
  CHECK(fy_bf16_to_f32(0xff80) == -INFINITY);
}

static void test_bf16_exhaustive(void) {
  int bad = 0;
  for (uint32_t h = 0; h < 65536; h++) {
    float f = fy_bf16_to_f32((uint16_t)h);
    if (u_of(f) != h << 16) bad++;
    uint16_t back = fy_f32_to_bf16(f);
    if (isnan(f)) bad += !isnan(fy_bf16_to_f32(back)) || (back & 0x8000) != (h & 0x8000);
    else bad += back != h;
  }
  CHECKF(bad == 0, "%d bf16 values do not round trip", bad);
  // Random finite floats: the result is the nearer neighbour, the even one on a tie.
  bad = 0;
  for (int i = 0; i < 200000; i++) {
    uint32_t u = (uint32_t)rng();
    if ((u & 0x7f800000u) == 0x7f800000u) continue;
    float f = f_of(u);
    uint16_t lo = (uint16_t)(u >> 16), hi = (uint16_t)(lo + 1), r = fy_f32_to_bf16(f);
    double dl = fabs((double)f - (double)fy_bf16_to_f32(lo));
    double dh = (hi & 0x7f80) == 0x7f80 && (hi & 0x7f) == 0 ? INFINITY  // hi is inf
                : fabs((double)f - (double)fy_bf16_to_f32(hi));
    uint16_t want = dl < dh ? lo : dh < dl ? hi : ((lo & 1) ? hi : lo);
    if ((u & 0x7fffffffu) >= 0x7f7f8000u) want = (uint16_t)((u >> 16 & 0x8000) | 0x7f80);
    bad += r != want;
  }
  CHECKF(bad == 0, "%d random floats round to the wrong bf16", bad);
}

static void test_f16_patterns(void) {
  CHECK(fy_f32_to_f16(1.0f) == 0x3c00);
  CHECK(fy_f32_to_f16(-2.0f) == 0xc000);
  CHECK(fy_f32_to_f16(0.5f) == 0x3800);
  CHECK(fy_f32_to_f16(0.0f) == 0x0000);
  CHECK(fy_f32_to_f16(-0.0f) == 0x8000);
  CHECK(fy_f32_to_f16(65504.0f) == 0x7bff);
  CHECK(fy_f32_to_f16(65519.0f) == 0x7bff);
  CHECK(fy_f32_to_f16(65520.0f) == 0x7c00);  // the tie above the maximum goes to inf
  CHECK(fy_f32_to_f16(1e10f) == 0x7c00);
  CHECK(fy_f32_to_f16(-1e10f) == 0xfc00);
  CHECK(fy_f32_to_f16(INFINITY) == 0x7c00);
  CHECK(fy_f32_to_f16(-INFINITY) == 0xfc00);
  uint16_t n = fy_f32_to_f16(NAN);
  CHECK((n & 0x7c00) == 0x7c00 && (n & 0x3ff) != 0);
  CHECK(isnan(fy_f16_to_f32(0x7e00)) && isnan(fy_f16_to_f32(0x7c01)));
  CHECK(fy_f16_to_f32(0x7c00) == INFINITY && fy_f16_to_f32(0xfc00) == -INFINITY);
  // Round to nearest even among normals: 1 + 2^-11 is halfway between 1 and 1 + 2^-10.
  CHECK(fy_f32_to_f16(1.0f + 0x1p-11f) == 0x3c00);
  CHECK(fy_f32_to_f16(1.0f + 3 * 0x1p-11f) == 0x3c02);
  CHECK(fy_f32_to_f16(1.0f + 0x1p-11f + 0x1p-20f) == 0x3c01);
  // Subnormals: units of 2^-24.
  CHECK(fy_f32_to_f16(0x1p-24f) == 0x0001);
  CHECK(fy_f32_to_f16(0x1p-25f) == 0x0000);               // tie with 0 -> even
  CHECK(fy_f32_to_f16(0x1p-25f * 1.0000001f) == 0x0001);
  CHECK(fy_f32_to_f16(3 * 0x1p-25f) == 0x0002);           // tie between 1 and 2 -> 2
  CHECK(fy_f32_to_f16(5 * 0x1p-25f) == 0x0002);           // tie between 2 and 3 -> 2
  CHECK(fy_f32_to_f16(-0x1p-24f) == 0x8001);
  CHECK(fy_f32_to_f16(1023 * 0x1p-24f) == 0x03ff);        // largest subnormal
  CHECK(fy_f32_to_f16(0x1p-14f) == 0x0400);               // smallest normal
  CHECK(fy_f32_to_f16(1023.75f * 0x1p-24f) == 0x0400);    // rounds up into the normals
  CHECK(fy_f32_to_f16(1e-30f) == 0x0000);
  CHECK(fy_f16_to_f32(0x0001) == 0x1p-24f);
  CHECK(fy_f16_to_f32(0x03ff) == 1023 * 0x1p-24f);
  CHECK(fy_f16_to_f32(0x7bff) == 65504.0f);
  CHECK(u_of(fy_f16_to_f32(0x8000)) == 0x80000000u);
}

static void test_f16_exhaustive(void) {
  int bad = 0;
  for (uint32_t h = 0; h < 65536; h++) {
    float f = fy_f16_to_f32((uint16_t)h);
    uint16_t back = fy_f32_to_f16(f);
    if (isnan(f)) bad += !isnan(fy_f16_to_f32(back));
    else bad += back != h;
  }
  CHECKF(bad == 0, "%d f16 values do not round trip", bad);
  // Random floats in f16's range (normal and subnormal): nearest, ties to even.
  bad = 0;
  for (int i = 0; i < 200000; i++) {
    uint32_t u = (uint32_t)rng();
    u = (u & 0x807fffffu) | ((uint32_t)(96 + rng() % 48) << 23);  // 2^-31 .. 2^16
    float f = f_of(u);
    uint16_t r = fy_f32_to_f16(f);
    if ((r & 0x7c00) == 0x7c00) {
      bad += fabsf(f) < 65520.0f;
      continue;
    }
    double got = fy_f16_to_f32(r), err = fabs((double)f - got);
    // Neighbours of r in magnitude.
    uint16_t mag = r & 0x7fff, sgn = r & 0x8000;
    double up = mag < 0x7bff ? fy_f16_to_f32((uint16_t)(sgn | (mag + 1))) : INFINITY;
    double dn = mag > 0 ? fy_f16_to_f32((uint16_t)(sgn | (mag - 1))) : 0;
    double eu = fabs((double)f - up), ed = fabs((double)f - dn);
    if (err > eu || err > ed) bad++;
    else if ((err == eu || err == ed) && (mag & 1)) bad++;
  }
  CHECKF(bad == 0, "%d random floats round to the wrong f16", bad);
#ifdef __FLT16_MAX__
  // The compiler's own conversion (round to nearest even) as a second reference.
  bad = 0;
  for (int i = 0; i < 200000; i++) {
    float f = f_of((uint32_t)rng());
    if (isnan(f)) continue;
    _Float16 h = (_Float16)f;
    uint16_t want;
    memcpy(&want, &h, 2);
    bad += fy_f32_to_f16(f) != want;
  }
  CHECKF(bad == 0, "%d floats differ from the compiler's _Float16 conversion", bad);
#endif
}

static void test_arrays(void) {
  float src[7] = {0.0f, 1.0f, -1.5f, 3.140625f, 1e-3f, 65504.0f, -0.25f}, back[7];
  uint16_t h[7];
  fy_convert_from_f32(h, FY_BF16, src, 7);
  for (int i = 0; i < 7; i++) CHECK(h[i] == fy_f32_to_bf16(src[i]));
  fy_convert_to_f32(back, h, FY_BF16, 7);
  for (int i = 0; i < 7; i++) CHECK(back[i] == fy_bf16_to_f32(h[i]));
  fy_convert_from_f32(h, FY_F16, src, 7);
  for (int i = 0; i < 7; i++) CHECK(h[i] == fy_f32_to_f16(src[i]));
  fy_convert_to_f32(back, h, FY_F16, 7);
  CHECK(back[1] == 1.0f && back[2] == -1.5f && back[5] == 65504.0f);
  float f[7];
  fy_convert_from_f32(f, FY_F32, src, 7);
  CHECK(memcmp(f, src, sizeof f) == 0);
  fy_convert_to_f32(back, src, FY_F32, 7);
  CHECK(memcmp(back, src, sizeof f) == 0);
}

// dst += src widened: the float adds of widening first, for every dtype, on the threads too.
static void test_add_to_f32(void) {
  enum { N = 200003 };
  float *dst = malloc(N * sizeof *dst), *want = malloc(N * sizeof *want), *wide = malloc(N * sizeof *wide);
  float *src32 = malloc(N * sizeof *src32);
  uint16_t *src16 = malloc(N * sizeof *src16);
  if (!dst || !want || !wide || !src32 || !src16) abort();
  const enum fy_dtype dts[] = {FY_F32, FY_BF16, FY_F16};
  for (int d = 0; d < 3; d++) {
    for (int i = 0; i < N; i++) {
      dst[i] = want[i] = (float)((i * 37) % 1001) * 0.013f - 6.5f;
      src32[i] = (float)((i * 11) % 997) * 0.0071f - 3.0f;
    }
    const void *src = src32;
    if (dts[d] != FY_F32) {
      fy_convert_from_f32(src16, dts[d], src32, N);
      src = src16;
    }
    fy_convert_to_f32(wide, src, dts[d], N);
    for (int i = 0; i < N; i++) want[i] = want[i] + wide[i];
    fy_add_to_f32(dst, src, dts[d], N);
    CHECKF(memcmp(dst, want, N * sizeof *dst) == 0, "fy_add_to_f32 %s differs from widening, then adding",
           fy_dtype_name(dts[d]));
  }
  free(dst), free(want), free(wide), free(src32), free(src16);
}

int main(void) {
  test_names();
  test_bf16_patterns();
  test_bf16_exhaustive();
  test_f16_patterns();
  test_f16_exhaustive();
  test_arrays();
  test_add_to_f32();
  return check_summary("dtype");
}
