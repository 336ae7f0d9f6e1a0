// Element types and conversions between them.
#ifndef FY_DTYPE_H
#define FY_DTYPE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

// (FY_I8, FY_U8: one-byte codes, 8-bit AdamW state in checkpoints; not a float type)
enum fy_dtype { FY_F32, FY_BF16, FY_F16, FY_I32, FY_U16, FY_I64, FY_I8, FY_U8 };

size_t fy_dtype_size(enum fy_dtype dt);
const char *fy_dtype_name(enum fy_dtype dt);  // "f32", "bf16", ...
// Safetensors spells them "F32", "BF16", "F16", "I32", "U16", "I64", "I8", "U8". Returns -1 if
// unknown.
int fy_dtype_from_safetensors(const char *s);
const char *fy_dtype_safetensors_name(enum fy_dtype dt);
// Compute precisions as the command line and plan files name them: "fp32", "bf16", "fp16" ->
// FY_F32, FY_BF16, FY_F16 (false for any other name, *dt untouched); and back (a static string).
bool fy_precision_dtype(const char *name, enum fy_dtype *dt);
const char *fy_precision_name(enum fy_dtype dt);

static inline float fy_bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, as PyTorch does; NaN stays NaN.
static inline uint16_t fy_f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

float fy_f16_to_f32(uint16_t h);
uint16_t fy_f32_to_f16(float f);

// Converts n elements of `src` (dtype `st`) to f32. st must be a float type. These four run on
// the OpenMP threads for large n (a chunk's worth).
void fy_convert_to_f32(float *dst, const void *src, enum fy_dtype st, size_t n);
// dst (f32) += src (dtype `st`) widened (exact), one float add an element: gradients summed over
// micro-batches, the same bits as converting first and adding.
void fy_add_to_f32(float *dst, const void *src, enum fy_dtype st, size_t n);
// Converts n f32 elements to dtype `dt` (a float type).
void fy_convert_from_f32(void *dst, enum fy_dtype dt, const float *src, size_t n);
// dst = src rounded to the nearest value of `dt` (bf16 or f16, round to nearest even; f16
// overflows to +-inf past 65504 and keeps its subnormals), still held as f32. In place when
// dst == src. f32: a copy.
void fy_round_to_dtype(float *dst, const float *src, enum fy_dtype dt, size_t n);

#endif
