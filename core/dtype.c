#include "core/dtype.h"

size_t fy_dtype_size(enum fy_dtype dt) {
  switch (dt) {
    case FY_F32: case FY_I32: return 4;
    case FY_BF16: case FY_F16: case FY_U16: return 2;
    case FY_I64: return 8;
    case FY_I8: case FY_U8: return 1;
  }
  return 0;
}

static const char *const fy_dtype_names[] = {"f32", "bf16", "f16", "i32", "u16", "i64", "i8", "u8"};
static const char *const fy_dtype_st_names[] = {"F32", "BF16", "F16", "I32", "U16", "I64", "I8", "U8"};

const char *fy_dtype_name(enum fy_dtype dt) { return fy_dtype_names[dt]; }
const char *fy_dtype_safetensors_name(enum fy_dtype dt) { return fy_dtype_st_names[dt]; }

static const struct { const char *name; enum fy_dtype dt; } fy_precisions[] = {
    {"fp32", FY_F32}, {"bf16", FY_BF16}, {"fp16", FY_F16}};

bool fy_precision_dtype(const char *name, enum fy_dtype *dt) {
  for (size_t i = 0; name && i < sizeof fy_precisions / sizeof *fy_precisions; i++)
    if (strcmp(name, fy_precisions[i].name) == 0) {
      *dt = fy_precisions[i].dt;
      return true;
    }
  return false;
}

const char *fy_precision_name(enum fy_dtype dt) {
  for (size_t i = 0; i < sizeof fy_precisions / sizeof *fy_precisions; i++)
    if (fy_precisions[i].dt == dt) return fy_precisions[i].name;
  return "?";
}

int fy_dtype_from_safetensors(const char *s) {
  for (int i = 0; i < (int)(sizeof fy_dtype_st_names / sizeof *fy_dtype_st_names); i++)
    if (strcmp(s, fy_dtype_st_names[i]) == 0) return i;
  return -1;
}

float fy_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while (!(man & 0x400u)) { man <<= 1; exp--; }
      u = sign | (exp << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  memcpy(&f, &u, 4);
  return f;
}

uint16_t fy_f32_to_f16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;            // NaN
  if (a >= 0x477ff000u) return sign | 0x7c00u;           // overflow (>= 65520) -> inf
  if (a < 0x38800000u) {                                 // subnormal or zero in f16
    if (a < 0x33000000u) return sign;                    // below half the smallest subnormal
    uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u;
    int shift = 126 - (int)e;  // value = m * 2^(e-150); f16 subnormal units are 2^-24
    uint32_t r = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1))) r++;
    return sign | (uint16_t)r;
  }
  uint32_t r = a + 0x0fffu + ((a >> 13) & 1u) - 0x38000000u;  // rebias 127 -> 15, round to even
  return sign | (uint16_t)(r >> 13);
}

void fy_convert_to_f32(float *dst, const void *src, enum fy_dtype st, size_t n) {
  if (st == FY_F32) { memcpy(dst, src, n * 4); return; }
  const uint16_t *s = src;
#pragma omp parallel for schedule(static) if (n > 65536)
  for (size_t i = 0; i < n; i++) dst[i] = st == FY_BF16 ? fy_bf16_to_f32(s[i]) : fy_f16_to_f32(s[i]);
}

void fy_add_to_f32(float *dst, const void *src, enum fy_dtype st, size_t n) {
  const float *f = src;
  const uint16_t *s = src;
#pragma omp parallel for schedule(static) if (n > 65536)
  for (size_t i = 0; i < n; i++)
    dst[i] = dst[i] + (st == FY_F32 ? f[i] : st == FY_BF16 ? fy_bf16_to_f32(s[i]) : fy_f16_to_f32(s[i]));
}

void fy_round_to_dtype(float *dst, const float *src, enum fy_dtype dt, size_t n) {
  if (dt == FY_F32) {
    if (dst != src) memmove(dst, src, n * 4);
    return;
  }
  // (split above ops' FY_PAR_ELEMENTWISE, as the planner counts this pass's parallel region)
#pragma omp parallel for schedule(static) if (n > 65536)
  for (size_t i = 0; i < n; i++)
    dst[i] = dt == FY_BF16 ? fy_bf16_to_f32(fy_f32_to_bf16(src[i])) : fy_f16_to_f32(fy_f32_to_f16(src[i]));
}

void fy_convert_from_f32(void *dst, enum fy_dtype dt, const float *src, size_t n) {
  if (dt == FY_F32) { memcpy(dst, src, n * 4); return; }
  uint16_t *d = dst;
#pragma omp parallel for schedule(static) if (n > 65536)
  for (size_t i = 0; i < n; i++) d[i] = dt == FY_BF16 ? fy_f32_to_bf16(src[i]) : fy_f32_to_f16(src[i]);
}
