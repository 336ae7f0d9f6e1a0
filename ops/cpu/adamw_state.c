// AdamW with m and v stored in bf16 or block-wise 8-bit (ops/ops.h "AdamW with compressed state"),
// and the conversions of a moment between float and its stored form.
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "core/dtype.h"
#include "ops/ops.h"

// ---- the 8-bit codes ----

// The decades of each code, largest first (ops/ops.h). Sums: 127 (m) and 255 (v).
static const int k_m[] = {49, 24, 14, 10, 10, 10, 10};
static const int k_v[] = {70, 38, 24, 17, 14, 12, 10, 10, 10, 10, 10, 10, 10, 10};
// 10^-d as the literals a reader (and the Python reference) writes, correctly rounded.
static const double decade[] = {1e0, 1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6,
                                1e-7, 1e-8, 1e-9, 1e-10, 1e-11, 1e-12, 1e-13};

// The nearest magnitude of a in [0, 1] is found in O(1): a's float bits, exponent and top 7
// mantissa bits, name a cell (binades from 2^(e0-127) up to [1, 2) cut in 128); the code's
// spacing (at least 0.9/70 of a decade's top) is wider than a cell (at most 1/128 of its lower
// end), so a cell holds at most one midpoint between neighbouring magnitudes, and the nearest
// index of every a in the cell is base, or base + 1 from a float thr of the cell on (none when
// the cell holds no midpoint). thr shares the cell's top 16 bits with a, so a >= thr compares
// their low 16 bits, and one 32-bit word a cell holds both: base << 17 | thr's low 16 bits
// (0x10000: none). One gather an element. Found when the tables are built with q_mag_exact, the
// rule itself (below). Cells below e0 (all of a below a quarter of the smallest magnitude)
// share cell 0: nearest 0. Checked when built; test_adamw_state checks the rule against a
// brute-force search.
#define CELL_BITS 7
#define MAX_CELLS (64 << CELL_BITS)

struct q8_code {
  int K;              // magnitudes mag[1..K], mag[0] = 0, mag[K] = 1
  float values[256];  // by code byte
  float mag[258];     // mag[0..K], then +inf
  int cell0, ncell;   // (e0 << CELL_BITS), cells
  uint32_t cell[MAX_CELLS];  // base << 17 | threshold's low bits
};

static struct q8_code codes[2];
static pthread_once_t codes_once = PTHREAD_ONCE_INIT;

static uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

static float bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// a in [0, 1] -> index of the nearest magnitude, ties to the smaller (the definition; used to build
// the tables). The floor by bisection, then the two distances in float, which decide exactly: for
// a in [mag[i], mag[i+1]] with mag[i] > 0, both differences are exact (Sterbenz: the neighbours
// are within a factor 2); with mag[i] == 0, a - 0 is exact and mag[1] - a, when inexact
// (a < mag[1] / 2), is still rounded to at least mag[1] / 2 > a; at the top mag[K+1] is +inf.
static int q_mag_exact(const struct q8_code *q, float a) {
  int lo = 0, hi = q->K;
  while (lo < hi) {
    int mid = (lo + hi + 1) / 2;
    if (q->mag[mid] <= a) lo = mid;
    else hi = mid - 1;
  }
  return lo + ((q->mag[lo + 1] - a) < (a - q->mag[lo]));
}

static void build_code(struct q8_code *q, const int *k, int D, bool is_signed) {
  int i = 0;
  q->mag[0] = 0.0f;
  // smallest first: decade D-1 up to decade 0
  for (int d = D - 1; d >= 0; d--)
    for (int j = 1; j <= k[d]; j++) q->mag[++i] = (float)((1.0 + (9.0 * j) / k[d]) / 10.0 * decade[d]);
  q->K = i;
  FY_ASSERT(q->K == (is_signed ? 127 : 255) && q->mag[q->K] == 1.0f);
  for (int j = q->K + 1; j < 258; j++) q->mag[j] = INFINITY;
  for (int j = 1; j <= q->K; j++) FY_ASSERT(q->mag[j] > q->mag[j - 1] && (j == 1 || q->mag[j] <= 2.0f * q->mag[j - 1]));
  if (is_signed) {
    for (int c = 0; c < 128; c++) q->values[c] = q->mag[c];
    for (int c = 1; c < 128; c++) q->values[(uint8_t)(int8_t)-c] = -q->mag[c];
    q->values[128] = -1.0f;  // code -128: never written
  } else {
    for (int c = 0; c < 256; c++) q->values[c] = q->mag[c];
  }
  // e0: the binade of a quarter of the smallest magnitude
  const int e0 = (int)(f32_bits(q->mag[1] * 0.25f) >> 23);
  q->cell0 = e0 << CELL_BITS;
  q->ncell = (127 - e0 + 1) << CELL_BITS;
  FY_ASSERT(q->ncell <= MAX_CELLS);
  for (int c = 0; c < q->ncell; c++) {
    const uint32_t lo = c == 0 ? 0 : (uint32_t)(q->cell0 + c) << (23 - CELL_BITS);
    const uint32_t last = ((uint32_t)(q->cell0 + c + 1) << (23 - CELL_BITS)) - 1;
    const float flast = bits_f32(last) < 1.0f ? bits_f32(last) : 1.0f;
    const int b = q_mag_exact(q, bits_f32(lo)), e = q_mag_exact(q, flast);
    FY_ASSERT(e == b || e == b + 1);  // at most one midpoint inside the cell
    q->cell[c] = (uint32_t)b << 17 | 0x10000u;
    if (e == b + 1) {  // the first float of the cell whose nearest is b + 1
      uint32_t l = lo, h = f32_bits(flast);
      while (l < h) {
        uint32_t mid = l + (h - l) / 2;
        if (q_mag_exact(q, bits_f32(mid)) > b) h = mid;
        else l = mid + 1;
      }
      FY_ASSERT(c > 0 && l >> 16 == lo >> 16);
      q->cell[c] = (uint32_t)b << 17 | (l & 0xffffu);
    }
  }
}

static void build_codes(void) {
  build_code(&codes[FY_MOMENT_M], k_m, 7, true);
  build_code(&codes[FY_MOMENT_V], k_v, 14, false);
}

static const struct q8_code *code_of(enum fy_moment which) {
  pthread_once(&codes_once, build_codes);
  return &codes[which == FY_MOMENT_V];
}

const float *fy_q8_code_values(enum fy_moment which) { return code_of(which)->values; }

// a in [0, 1] -> index of the nearest magnitude: one gather and a compare.
static inline int q_mag(const struct q8_code *q, float a) {
  const uint32_t u = f32_bits(a);
  int c = (int)(u >> (23 - CELL_BITS)) - q->cell0;
  c = c < 0 ? 0 : c;
  c = c > q->ncell - 1 ? q->ncell - 1 : c;
  const uint32_t w = q->cell[c];
  return (int)(w >> 17) + ((u & 0xffffu) >= (w & 0x1ffffu));
}

// vals (len) -> codes (len), *scale: the block's store (ops/ops.h)
static void q8_store_block(const struct q8_code *q, bool is_signed, uint8_t *restrict code, float *scale,
                           const float *restrict vals, int64_t len) {
  // The largest |x| on the float's bits: for values >= 0 their order is the integers' (a vector
  // max without NaN rules); NaN's bits, above infinity's, are cut down to it.
  uint32_t amax_bits = 0;
  for (int64_t i = 0; i < len; i++) {
    uint32_t u = f32_bits(vals[i]) & 0x7fffffffu;
    u = u < 0x7f800000u ? u : 0x7f800000u;
    amax_bits = u > amax_bits ? u : amax_bits;
  }
  const float amax = bits_f32(amax_bits);
  if (amax_bits == 0x7f800000u || amax_bits == 0) {
    *scale = amax_bits ? NAN : 0.0f;
    memset(code, 0, (size_t)len);
    return;
  }
  *scale = amax;
  if (is_signed) {
    for (int64_t i = 0; i < len; i++) {
      const int k = q_mag(q, fabsf(vals[i]) / amax);
      code[i] = (uint8_t)(vals[i] < 0.0f ? -k : k);
    }
  } else {
    for (int64_t i = 0; i < len; i++) {
      const float x = vals[i], a = (x > 0.0f ? x : 0.0f) / amax;  // q_mag(0) is 0
      const int k = q_mag(q, a);
      code[i] = (uint8_t)(k + ((k == 0) & (x > 0.0f)));
    }
  }
}

// ---- sizes and names ----

int64_t fy_q8_blocks(int64_t n) { return n <= 0 ? 0 : (n + FY_Q8_BLOCK - 1) / FY_Q8_BLOCK; }

size_t fy_q8_scales_offset(int64_t n) { return n <= 0 ? 0 : ((size_t)n + 63) & ~(size_t)63; }

size_t fy_state_moment_bytes(enum fy_state_format f, int64_t n) {
  if (n <= 0) return 0;
  switch (f) {
    case FY_STATE_F32: return (size_t)n * 4;
    case FY_STATE_BF16: return (size_t)n * 2;
    case FY_STATE_Q8: return fy_q8_scales_offset(n) + (size_t)fy_q8_blocks(n) * 4;
  }
  return 0;
}

size_t fy_state_bytes(enum fy_state_format f, int64_t n) { return 2 * fy_state_moment_bytes(f, n); }

static const char *const format_names[] = {"fp32", "bf16", "8bit"};

const char *fy_state_format_name(enum fy_state_format f) {
  return (unsigned)f < 3 ? format_names[f] : "?";
}

bool fy_state_format_from_name(const char *name, enum fy_state_format *f) {
  for (int i = 0; i < 3; i++)
    if (name && !strcmp(name, format_names[i])) {
      *f = (enum fy_state_format)i;
      return true;
    }
  return false;
}

// ---- the update ----

// The per-step constants, as ops/cpu/adamw.c computes them (in double, then float).
struct step_k {
  float step, bc2_sqrt, b1, b2, ob1, ob2, eps, gs;
  double lr;
};

static struct step_k step_consts(float lr, float beta1, float beta2, float eps, int64_t t, float gs) {
  const double bc1 = 1.0 - pow((double)beta1, (double)t);
  const double bc2 = 1.0 - pow((double)beta2, (double)t);
  return (struct step_k){.step = (float)((double)lr / bc1), .bc2_sqrt = (float)sqrt(bc2), .b1 = beta1,
                         .b2 = beta2, .ob1 = 1.0f - beta1, .ob2 = 1.0f - beta2, .eps = eps, .gs = gs,
                         .lr = (double)lr};
}

static float range_decay(const struct step_k *k, float wd) { return (float)(1.0 - k->lr * (double)wd); }

fy_status fy_adamw_ranges_check(int64_t n, const struct fy_adamw_range *r, int nr) {
  if (n < 0 || nr < 0 || (nr > 0 && !r))
    return fy_error_set(FY_ERR_INVALID, "adamw state: %lld elements, %d ranges", (long long)n, nr);
  int64_t end = 0;
  for (int i = 0; i < nr; i++) {
    if (r[i].off < end || r[i].n < 0 || r[i].n > n - r[i].off)
      return fy_error_set(FY_ERR_INVALID,
                          "adamw state: range %d [%lld, +%lld) overlaps the one before, is unsorted or "
                          "leaves [0, %lld)", i, (long long)r[i].off, (long long)r[i].n, (long long)n);
    end = r[i].off + r[i].n;
  }
  return FY_OK;
}

static fy_status check_args(enum fy_state_format f, int64_t n, const struct fy_adamw_range *r, int nr,
                            int64_t t) {
  if ((unsigned)f > FY_STATE_Q8) return fy_error_set(FY_ERR_INVALID, "adamw state: format %d", (int)f);
  if (t < 1) return fy_error_set(FY_ERR_INVALID, "adamw state: step %lld (counts from 1)", (long long)t);
  return fy_adamw_ranges_check(n, r, nr);
}

// The first range that ends after pos.
static int first_range(const struct fy_adamw_range *r, int nr, int64_t pos) {
  int lo = 0, hi = nr;
  while (lo < hi) {
    int mid = (lo + hi) / 2;
    if (r[mid].off + r[mid].n > pos) hi = mid;
    else lo = mid + 1;
  }
  return lo;
}

// One call's arguments, shared by the workers.
struct upd {
  enum fy_state_format f;
  float *param;
  void *m, *v;
  const float *gf;  // fp32 gradients, or
  uint16_t *gh;     // bf16 gradients in, bf16 weights out
  int64_t n;
  const struct fy_adamw_range *r;
  int nr;
  struct step_k k;
  const struct q8_code *qm, *qv;
};

// 8-bit: elements [lo, hi) of one range (decay): the old moments from mo/vo (read back), the new
// ones to mn/vn (indexed from lo), param and gradients at [lo, hi).
static inline void update_run(const struct upd *u, int64_t lo, int64_t hi, float decay, const float *restrict mo,
                              const float *restrict vo, float *restrict mn, float *restrict vn) {
  const int64_t len = hi - lo;
  const struct step_k k = u->k;
  float *restrict p = u->param + lo;
  if (u->gf) {
    const float *restrict g = u->gf + lo;
    for (int64_t i = 0; i < len; i++) {
      const float gi = g[i] * k.gs;
      const float mi = k.b1 * mo[i] + k.ob1 * gi;
      const float vi = k.b2 * vo[i] + k.ob2 * gi * gi;
      mn[i] = mi;
      vn[i] = vi;
      p[i] = p[i] * decay - k.step * (mi / (sqrtf(vi) / k.bc2_sqrt + k.eps));
    }
  } else {
    uint16_t *restrict g = u->gh + lo;
    for (int64_t i = 0; i < len; i++) {
      const float gi = fy_bf16_to_f32(g[i]) * k.gs;
      const float mi = k.b1 * mo[i] + k.ob1 * gi;
      const float vi = k.b2 * vo[i] + k.ob2 * gi * gi;
      mn[i] = mi;
      vn[i] = vi;
      const float pn = p[i] * decay - k.step * (mi / (sqrtf(vi) / k.bc2_sqrt + k.eps));
      p[i] = pn;
      g[i] = fy_f32_to_bf16(pn);
    }
  }
}

// bf16 state: elements [lo, hi) of one range, read, updated and stored in one loop.
static inline void update_run_bf16(const struct upd *u, int64_t lo, int64_t hi, float decay) {
  const int64_t len = hi - lo;
  const struct step_k k = u->k;
  float *restrict p = u->param + lo;
  uint16_t *restrict m = (uint16_t *)u->m + lo, *restrict v = (uint16_t *)u->v + lo;
  if (u->gf) {
    const float *restrict g = u->gf + lo;
    for (int64_t i = 0; i < len; i++) {
      const float gi = g[i] * k.gs;
      const float mi = k.b1 * fy_bf16_to_f32(m[i]) + k.ob1 * gi;
      const float vi = k.b2 * fy_bf16_to_f32(v[i]) + k.ob2 * gi * gi;
      m[i] = fy_f32_to_bf16(mi);
      v[i] = fy_f32_to_bf16(vi);
      p[i] = p[i] * decay - k.step * (mi / (sqrtf(vi) / k.bc2_sqrt + k.eps));
    }
  } else {
    uint16_t *restrict g = u->gh + lo;
    for (int64_t i = 0; i < len; i++) {
      const float gi = fy_bf16_to_f32(g[i]) * k.gs;
      const float mi = k.b1 * fy_bf16_to_f32(m[i]) + k.ob1 * gi;
      const float vi = k.b2 * fy_bf16_to_f32(v[i]) + k.ob2 * gi * gi;
      m[i] = fy_f32_to_bf16(mi);
      v[i] = fy_f32_to_bf16(vi);
      const float pn = p[i] * decay - k.step * (mi / (sqrtf(vi) / k.bc2_sqrt + k.eps));
      p[i] = pn;
      g[i] = fy_f32_to_bf16(pn);
    }
  }
}

// The elements of a bf16 work item: a few thousand, so that a thread's share of a chunk is split
// in pieces of one size whatever the ranges.
#define WORK_BF16 4096

// Elements [b0, b0 + len) (one 8-bit block, or a bf16 work item): read back, updated range by
// range (elements in no range keep their m and v), stored back.
static void update_block(const struct upd *u, int64_t b0, int64_t len) {
  const bool q8 = u->f == FY_STATE_Q8;
  float mo[FY_Q8_BLOCK], vo[FY_Q8_BLOCK], mn[FY_Q8_BLOCK], vn[FY_Q8_BLOCK];
  float *scale_m = NULL, *scale_v = NULL;
  if (q8) {
    scale_m = (float *)((char *)u->m + fy_q8_scales_offset(u->n)) + b0 / FY_Q8_BLOCK;
    scale_v = (float *)((char *)u->v + fy_q8_scales_offset(u->n)) + b0 / FY_Q8_BLOCK;
    const int8_t *cm = (const int8_t *)u->m + b0;
    const uint8_t *cv = (const uint8_t *)u->v + b0;
    const float sm = *scale_m, sv = *scale_v, *tm = u->qm->values, *tv = u->qv->values;
    for (int64_t i = 0; i < len; i++) {
      mo[i] = tm[(uint8_t)cm[i]] * sm;
      vo[i] = tv[cv[i]] * sv;
    }
    memcpy(mn, mo, sizeof mn);  // the elements in no range
    memcpy(vn, vo, sizeof vn);
  }
  const int64_t end = b0 + len;
  for (int r = first_range(u->r, u->nr, b0); r < u->nr && u->r[r].off < end; r++) {
    const int64_t lo = u->r[r].off > b0 ? u->r[r].off : b0;
    const int64_t hi = u->r[r].off + u->r[r].n < end ? u->r[r].off + u->r[r].n : end;
    if (lo >= hi) continue;
    const float decay = range_decay(&u->k, u->r[r].weight_decay);
    if (q8) update_run(u, lo, hi, decay, mo + (lo - b0), vo + (lo - b0), mn + (lo - b0), vn + (lo - b0));
    else update_run_bf16(u, lo, hi, decay);
  }
  if (q8) {
    q8_store_block(u->qm, true, (uint8_t *)u->m + b0, scale_m, mn, len);
    q8_store_block(u->qv, false, (uint8_t *)u->v + b0, scale_v, vn, len);
  }
}

static fy_status state_update(struct upd *u, float lr, float beta1, float beta2, float eps, int64_t t,
                              float grad_scale) {
  FY_TRY(check_args(u->f, u->n, u->r, u->nr, t));
  if (u->f == FY_STATE_F32) {  // today's kernels, range by range: the same bits
    for (int i = 0; i < u->nr; i++) {
      const int64_t o = u->r[i].off;
      if (u->r[i].n == 0) continue;
      if (u->gh)
        fy_adamw_update_bf16(u->param + o, (float *)u->m + o, (float *)u->v + o, u->gh + o, u->r[i].n, lr, beta1,
                             beta2, eps, u->r[i].weight_decay, t, grad_scale);
      else
        fy_adamw_update(u->param + o, (float *)u->m + o, (float *)u->v + o, u->gf + o, u->r[i].n, lr, beta1, beta2,
                        eps, u->r[i].weight_decay, t, grad_scale);
    }
    return FY_OK;
  }
  u->k = step_consts(lr, beta1, beta2, eps, t, grad_scale);
  u->qm = code_of(FY_MOMENT_M);
  u->qv = code_of(FY_MOMENT_V);
  // Q8: one 8-bit block a work item; bf16: WORK_BF16 elements (any split gives the same bits).
  const int64_t bs = u->f == FY_STATE_Q8 ? FY_Q8_BLOCK : WORK_BF16, nb = (u->n + bs - 1) / bs;
#pragma omp parallel for schedule(static) if (parallel : u->n > FY_PAR_ELEMENTWISE)
  for (int64_t b = 0; b < nb; b++) {
    const int64_t b0 = b * bs;
    update_block(u, b0, u->n - b0 < bs ? u->n - b0 : bs);
  }
  return FY_OK;
}

fy_status fy_adamw_state_update(enum fy_state_format f, float *param, void *m, void *v, const float *grad,
                                int64_t n, const struct fy_adamw_range *ranges, int n_ranges, float lr,
                                float beta1, float beta2, float eps, int64_t t, float grad_scale) {
  struct upd u = {.f = f, .param = param, .m = m, .v = v, .gf = grad, .n = n, .r = ranges, .nr = n_ranges};
  return state_update(&u, lr, beta1, beta2, eps, t, grad_scale);
}

fy_status fy_adamw_state_update_bf16(enum fy_state_format f, float *param, void *m, void *v, uint16_t *gw,
                                     int64_t n, const struct fy_adamw_range *ranges, int n_ranges, float lr,
                                     float beta1, float beta2, float eps, int64_t t, float grad_scale) {
  struct upd u = {.f = f, .param = param, .m = m, .v = v, .gh = gw, .n = n, .r = ranges, .nr = n_ranges};
  return state_update(&u, lr, beta1, beta2, eps, t, grad_scale);
}

// ---- conversions ----

void fy_state_encode(enum fy_state_format f, enum fy_moment which, void *dst, const float *src, int64_t n) {
  if (n <= 0) return;
  if (f == FY_STATE_F32) {
    memcpy(dst, src, (size_t)n * 4);
  } else if (f == FY_STATE_BF16) {
    uint16_t *h = dst;
#pragma omp parallel for simd schedule(static) if (parallel : n > FY_PAR_ELEMENTWISE)
    for (int64_t i = 0; i < n; i++) h[i] = fy_f32_to_bf16(src[i]);
  } else {
    const struct q8_code *q = code_of(which);
    float *scale = (float *)((char *)dst + fy_q8_scales_offset(n));
    const int64_t nb = fy_q8_blocks(n);
#pragma omp parallel for schedule(static) if (parallel : n > FY_PAR_ELEMENTWISE)
    for (int64_t b = 0; b < nb; b++) {
      const int64_t b0 = b * FY_Q8_BLOCK, len = n - b0 < FY_Q8_BLOCK ? n - b0 : FY_Q8_BLOCK;
      q8_store_block(q, which == FY_MOMENT_M, (uint8_t *)dst + b0, scale + b, src + b0, len);
    }
  }
}

void fy_state_decode(enum fy_state_format f, enum fy_moment which, float *dst, const void *src, int64_t n) {
  if (n <= 0) return;
  if (f == FY_STATE_F32) {
    memcpy(dst, src, (size_t)n * 4);
  } else if (f == FY_STATE_BF16) {
    const uint16_t *h = src;
#pragma omp parallel for simd schedule(static) if (parallel : n > FY_PAR_ELEMENTWISE)
    for (int64_t i = 0; i < n; i++) dst[i] = fy_bf16_to_f32(h[i]);
  } else {
    const float *t = code_of(which)->values;
    const uint8_t *c = src;
    const float *scale = (const float *)((const char *)src + fy_q8_scales_offset(n));
#pragma omp parallel for schedule(static) if (parallel : n > FY_PAR_ELEMENTWISE)
    for (int64_t i = 0; i < n; i++) dst[i] = t[c[i]] * scale[i / FY_Q8_BLOCK];
  }
}
