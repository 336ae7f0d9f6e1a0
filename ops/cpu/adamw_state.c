// AdamW with m and v stored in bf16 or block-wise 8-bit (ops/ops.h "AdamW with compressed state"),
// and the conversions of a moment between float and its stored form.
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "core/dtype.h"
#include "ops/ops.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// ---- the 8-bit codes ----

// A code's magnitude k (0..255) is a tiny float relative to the block's absmax (ops/ops.h): k =
// 8 e + f, f the 3 mantissa bits, e the exponent; value f 2^-S for e = 0 (subnormal), (8 + f)
// 2^(e-1-S) for e >= 1, so that k = 8 (S - 2) is exactly 1. S = 17 for m (4 exponent bits, k up
// to 120, a sign besides) and 33 for v (5 exponent bits, k up to 248).
#define S_M 17
#define S_V 33

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

// r, a float in [0, 1 + 2^-23] -> k, the magnitude nearest to r, ties to the even k (the
// format's round to nearest even; 1 + 2^-23 gives the top code). Branch-free, so that the loops
// calling it vectorise. The step of the codes in r's binade [2^E, 2^(E+1)) is 2^(E-3), and
// 2^(3-S), the smallest normal, below it (E clamped to Emin = 3 - S). The float sum magic + r with
// magic = 2^(E+20) has unit in the last place 2^(E-3), so the addition itself rounds r to the
// step, to nearest even (magic's mantissa is 0: the sum's last bit is k's); its bits minus
// magic's are d = r / step rounded: 8 + f in a normal binade (16 where it carries into the next),
// 0..8 below. k = 8 (E - Emin) + d, with E and Emin read off as float bits.
static inline uint32_t q8_mag(float r, int S) {
  const uint32_t emin = (uint32_t)(130 - S) << 23, e0 = f32_bits(r) & 0x7f800000u;
  const uint32_t e = e0 > emin ? e0 : emin;
  const uint32_t magic = e + (20u << 23);
  return f32_bits(r + bits_f32(magic)) - magic + ((e - emin) >> 20);
}

// k (any 0..255) -> its value, exact in float (4 significant bits). k << 20 as float bits is the
// float32 (1 + f/8) 2^(e-127) for e >= 1 and, for e = 0, the float32 subnormal f 2^-129: the
// value times 2^(S-129) in both cases, so one exact multiplication by 2^(129-S) gives the value
// (float32 subnormals are exact operands; nothing here runs with denormals flushed). Above the
// top code the formula goes on (up to 1.875, and 2 for k = 128), values that no store writes.
static inline float q8_val(uint32_t k, int S) { return bits_f32(k << 20) * bits_f32((uint32_t)(256 - S) << 23); }

// The signed code byte of m (int8_t: -k for negative values) and v's byte -> value.
static inline float q8_val_m(uint8_t c) {
  const int32_t s = (int8_t)c;
  const float a = q8_val((uint32_t)(s < 0 ? -s : s), S_M);
  return bits_f32(f32_bits(a) | ((uint32_t)s & 0x80000000u));
}

static inline float q8_val_v(uint8_t c) { return q8_val(c, S_V); }

// The read-back value of a widened code with the block's scale folded into the power of two:
// bits(k << 20) * (2^(129-S) scale) is the same real number as value(k) * scale, so it rounds the
// same, while 2^(129-S) scale stays finite (scale < 2^(S-1): q8_run checks).
static inline float q8_read_m(int32_t s, float sm2) {
  const uint32_t k = (uint32_t)(s < 0 ? -s : s);
  return bits_f32((k << 20) | ((uint32_t)s & 0x80000000u)) * sm2;
}

static inline float q8_read_v(int32_t c, float sv2) { return bits_f32((uint32_t)c << 20) * sv2; }

static float code_tables[2][256];
static pthread_once_t codes_once = PTHREAD_ONCE_INIT;

static void build_codes(void) {
  for (int c = 0; c < 256; c++) {
    code_tables[FY_MOMENT_M][c] = q8_val_m((uint8_t)c);
    code_tables[FY_MOMENT_V][c] = q8_val_v((uint8_t)c);
  }
}

const float *fy_q8_code_values(enum fy_moment which) {
  pthread_once(&codes_once, build_codes);
  return code_tables[which == FY_MOMENT_V];
}

// The largest |x| of vals (len) as float bits, NaN and infinities as infinity's bits: for values
// >= 0 the order of the bits is the integers' (a vector max without NaN rules); NaN's bits,
// above infinity's, are cut down to it.
static inline uint32_t amax_bits_of(const float *restrict vals, int64_t len) {
  uint32_t amax = 0;
  for (int64_t i = 0; i < len; i++) {
    uint32_t u = f32_bits(vals[i]) & 0x7fffffffu;
    u = u < 0x7f800000u ? u : 0x7f800000u;
    amax = u > amax ? u : amax;
  }
  return amax;
}

// A block's factor: r = |x| * inv with inv = 1 / absmax rounded to float, as if float's exponent
// had no bounds. For absmax in [2^-126, 2^126) it has; a block whose absmax is subnormal or
// at least 2^126 (where 1 / absmax overflows or turns subnormal) has its values multiplied by
// *adj = 2^64 or 2^-64 first, exactly, and inv = 1 / (absmax * adj). The one difference from
// unbounded products, a ratio below 2^-126 rounded as a subnormal, is far below the smallest
// step of either code (2^-33): the codes are those of the unbounded definition.
static inline float q8_block_inv(uint32_t amax_bits, float *adj) {
  *adj = amax_bits < 0x00800000u ? 0x1p64f : amax_bits >= (253u << 23) ? 0x1p-64f : 1.0f;
  return 1.0f / (bits_f32(amax_bits) * *adj);
}

// One value's code: x, the block's adj and inv -> m's signed code, v's code (the rule for
// positive v on x itself: x * adj may underflow to 0).
static inline int32_t q8_code_m(float x, float adj, float inv) {
  const int32_t k = (int32_t)q8_mag(fabsf(x * adj) * inv, S_M);
  return x < 0.0f ? -k : k;
}

static inline uint32_t q8_code_v(float x, float adj, float inv) {
  const uint32_t k = q8_mag(x * adj * inv, S_V);  // (any bits for x <= 0: not used)
  return x > 0.0f ? (k > 1 ? k : 1) : 0;
}

// vals (len), their amax_bits_of -> codes (len), *scale: the block's store (ops/ops.h). m: the
// code of -x is minus the code of x; v: a positive value never gets code 0, a negative one (not
// written by the update) gets 0. A block holding NaN or infinity: scale NaN, codes 0; absmax 0:
// scale 0, codes 0.
static void q8_store(enum fy_moment which, void *restrict code, float *scale, const float *restrict vals,
                     int64_t len, uint32_t amax_bits) {
  if (amax_bits == 0x7f800000u || amax_bits == 0) {
    *scale = amax_bits ? NAN : 0.0f;
    memset(code, 0, (size_t)len);
    return;
  }
  float adj;
  const float inv = q8_block_inv(amax_bits, &adj);
  *scale = bits_f32(amax_bits);
  if (which == FY_MOMENT_M)
    for (int64_t i = 0; i < len; i++) ((int8_t *)code)[i] = (int8_t)q8_code_m(vals[i], adj, inv);
  else
    for (int64_t i = 0; i < len; i++) ((uint8_t *)code)[i] = (uint8_t)q8_code_v(vals[i], adj, inv);
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

// One call's arguments, shared by the workers. Out of place (fy_adamw_state_update_into) param,
// m, v and gh are the outputs and the inputs follow; in place the inputs are not set.
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
  const float *pin;
  const void *min, *vin;
  const float *smin, *svin;  // 8-bit: the inputs' scales (of block 0 of min, vin)
  const uint16_t *ghin;      // bf16 gradients in (gh: the bf16 weights out)
};

// The AdamW element of ops/cpu/adamw.c, operation for operation: p, the moments read back mo, vo,
// the gradient g (not yet scaled) -> *mi, *vi, the new weight.
static inline float adamw_elem(const struct step_k *k, float p, float decay, float mo, float vo, float g, float *mi,
                               float *vi) {
  g = g * k->gs;
  *mi = k->b1 * mo + k->ob1 * g;
  *vi = k->b2 * vo + k->ob2 * g * g;
  return p * decay - k->step * (*mi / (sqrtf(*vi) / k->bc2_sqrt + k->eps));
}

// 8-bit, a block's elements [lo, hi) of one range (decay): m and v (indexed from lo) read back
// and updated in place; param and gradients at [lo, hi).
static inline void update_run(const struct upd *u, int64_t lo, int64_t hi, float decay, float *restrict m,
                              float *restrict v) {
  const int64_t len = hi - lo;
  const struct step_k k = u->k;
  float *restrict p = u->param + lo;
  if (u->gf) {
    const float *restrict g = u->gf + lo;
    for (int64_t i = 0; i < len; i++) p[i] = adamw_elem(&k, p[i], decay, m[i], v[i], g[i], m + i, v + i);
  } else {
    uint16_t *restrict g = u->gh + lo;
    for (int64_t i = 0; i < len; i++) {
      const float pn = adamw_elem(&k, p[i], decay, m[i], v[i], fy_bf16_to_f32(g[i]), m + i, v + i);
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
      float mi, vi;
      p[i] = adamw_elem(&k, p[i], decay, fy_bf16_to_f32(m[i]), fy_bf16_to_f32(v[i]), g[i], &mi, &vi);
      m[i] = fy_f32_to_bf16(mi);
      v[i] = fy_f32_to_bf16(vi);
    }
  } else {
    uint16_t *restrict g = u->gh + lo;
    for (int64_t i = 0; i < len; i++) {
      float mi, vi;
      const float pn = adamw_elem(&k, p[i], decay, fy_bf16_to_f32(m[i]), fy_bf16_to_f32(v[i]), fy_bf16_to_f32(g[i]),
                                  &mi, &vi);
      m[i] = fy_f32_to_bf16(mi);
      v[i] = fy_f32_to_bf16(vi);
      p[i] = pn;
      g[i] = fy_f32_to_bf16(pn);
    }
  }
}

// The elements of a bf16 work item: a few thousand, so that a thread's share of a chunk is split
// in pieces of one size whatever the ranges.
#define WORK_BF16 4096

// bf16 state: elements [b0, b0 + len) (a work item), updated range by range.
static void update_items_bf16(const struct upd *u, int64_t b0, int64_t len) {
  const int64_t end = b0 + len;
  for (int r = first_range(u->r, u->nr, b0); r < u->nr && u->r[r].off < end; r++) {
    const int64_t lo = u->r[r].off > b0 ? u->r[r].off : b0;
    const int64_t hi = u->r[r].off + u->r[r].n < end ? u->r[r].off + u->r[r].n : end;
    if (lo < hi) update_run_bf16(u, lo, hi, range_decay(&u->k, u->r[r].weight_decay));
  }
}

// ---- the 8-bit update ----
//
// Per element the update itself waits on the divider (a square root and two divisions, as
// fp32 state), while reading back and quantising are a few dozen integer and float operations
// on the other units. In one loop the two overlap, so a thread's run of blocks is pipelined: the
// loop that updates block b also quantises block b - 1 (whose absmax is then known). A block
// qualifies when it is whole and inside one range (all but a parameter's end blocks); others
// take the plain path (read back, update the ranges' parts, store). The codes cross between
// bytes and int32 in loops of their own: a loop that reads or writes bytes is vectorised 64
// elements at a time and runs out of registers.

struct q8_blk {  // a block's buffers and the result of its store
  int8_t *cm;
  uint8_t *cv;
  float *sm, *sv;
};

static struct q8_blk q8_blk_of(const struct upd *u, int64_t b0) {
  const int64_t b = b0 / FY_Q8_BLOCK;
  return (struct q8_blk){.cm = (int8_t *)u->m + b0, .cv = (uint8_t *)u->v + b0,
                         .sm = (float *)((char *)u->m + fy_q8_scales_offset(u->n)) + b,
                         .sv = (float *)((char *)u->v + fy_q8_scales_offset(u->n)) + b};
}

// A thread's buffers: the codes of the block being updated (widened), the new m and v of it and
// of the block before, the codes of the block before (int32).
struct q8_pipe {
  int32_t cm[FY_Q8_BLOCK], cv[FY_Q8_BLOCK], qm[FY_Q8_BLOCK], qv[FY_Q8_BLOCK];
  float mn[2][FY_Q8_BLOCK], vn[2][FY_Q8_BLOCK];
};

// The plain path: elements [b0, b0 + len) read back, updated range by range (elements in no
// range keep their m and v), stored.
static void q8_block_plain(const struct upd *u, int64_t b0, int64_t len, int r, float *restrict mn,
                           float *restrict vn) {
  const struct q8_blk q = q8_blk_of(u, b0);
  const float sm = *q.sm, sv = *q.sv;
  const int64_t end = b0 + len;
  for (int64_t i = 0; i < len; i++) {
    mn[i] = q8_val_m((uint8_t)q.cm[i]) * sm;
    vn[i] = q8_val_v(q.cv[i]) * sv;
  }
  for (; r < u->nr && u->r[r].off < end; r++) {
    const int64_t lo = u->r[r].off > b0 ? u->r[r].off : b0;
    const int64_t hi = u->r[r].off + u->r[r].n < end ? u->r[r].off + u->r[r].n : end;
    if (lo < hi) update_run(u, lo, hi, range_decay(&u->k, u->r[r].weight_decay), mn + (lo - b0), vn + (lo - b0));
  }
  q8_store(FY_MOMENT_M, q.cm, q.sm, mn, len, amax_bits_of(mn, len));
  q8_store(FY_MOMENT_V, q.cv, q.sv, vn, len, amax_bits_of(vn, len));
}

// The pipelined loop over one whole block at b0 (decay): its widened codes w->cm, w->cv read back
// with the folded scales sm2 = 2^112 sm, sv2 = 2^96 sv (q8_read_m), updated, the new m and v to
// mn, vn and their amax_bits_of to *am, *av; and the block before's new m and v pm, pv quantised
// with inv_m, inv_v to w->qm, w->qv; P the old weight (p[i], out of place the input's).
#define Q8_PIPE_ELEM(P, G)                                                                               \
  const float mo = q8_read_m(w->cm[i], sm2), vo = q8_read_v(w->cv[i], sv2);                             \
  float mi, vi;                                                                                          \
  const float pn = adamw_elem(&k, (P), decay, mo, vo, (G), &mi, &vi);                                    \
  p[i] = pn;                                                                                             \
  mn[i] = mi;                                                                                            \
  vn[i] = vi;                                                                                            \
  const uint32_t a = f32_bits(mi) & 0x7fffffffu, c = f32_bits(vi) & 0x7fffffffu;                         \
  amm = a > amm ? a : amm; /* NaN's bits above infinity's: cut down after the loop */                    \
  amv = c > amv ? c : amv;                                                                               \
  w->qm[i] = q8_code_m(pm[i], 1.0f, inv_m);                                                              \
  w->qv[i] = (int32_t)q8_code_v(pv[i], 1.0f, inv_v);

static void q8_block_pipe(const struct upd *u, int64_t b0, float decay, float sm2, float sv2,
                          struct q8_pipe *restrict w, float *restrict mn, float *restrict vn,
                          const float *restrict pm, const float *restrict pv, float inv_m, float inv_v, uint32_t *am,
                          uint32_t *av) {
  const struct step_k k = u->k;
  float *restrict p = u->param + b0;
  uint32_t amm = 0, amv = 0;
  if (u->gf) {
    const float *restrict g = u->gf + b0;
    for (int i = 0; i < FY_Q8_BLOCK; i++) {
      Q8_PIPE_ELEM(p[i], g[i])
    }
  } else {
    uint16_t *restrict g = u->gh + b0;
    for (int i = 0; i < FY_Q8_BLOCK; i++) {
      Q8_PIPE_ELEM(p[i], fy_bf16_to_f32(g[i]))
      g[i] = fy_f32_to_bf16(pn);
    }
  }
  *am = amm < 0x7f800000u ? amm : 0x7f800000u;
  *av = amv < 0x7f800000u ? amv : 0x7f800000u;
}

// The block before's store after the pipelined loop: its codes from w->qm, w->qv, or, for a block
// whose absmax is 0, not finite or outside [2^-126, 2^126) (pipe_inv said so: done false), by
// the plain store from its values.
static void q8_pipe_store(struct q8_blk q, const struct q8_pipe *restrict w, const float *restrict pm,
                          const float *restrict pv, uint32_t am, uint32_t av, bool done_m, bool done_v) {
  if (done_m) {
    *q.sm = bits_f32(am);
    for (int i = 0; i < FY_Q8_BLOCK; i++) q.cm[i] = (int8_t)w->qm[i];
  } else {
    q8_store(FY_MOMENT_M, q.cm, q.sm, pm, FY_Q8_BLOCK, am);
  }
  if (done_v) {
    *q.sv = bits_f32(av);
    for (int i = 0; i < FY_Q8_BLOCK; i++) q.cv[i] = (uint8_t)w->qv[i];
  } else {
    q8_store(FY_MOMENT_V, q.cv, q.sv, pv, FY_Q8_BLOCK, av);
  }
}

// inv of a block's absmax for the pipelined quantising, when the block needs no special
// handling (absmax in [2^-126, 2^126)); else 0 (the loop then computes codes nobody uses).
static inline float pipe_inv(uint32_t amax_bits, bool *ok) {
  *ok = amax_bits >= 0x00800000u && amax_bits < (253u << 23);
  return *ok ? 1.0f / bits_f32(amax_bits) : 0.0f;
}

static void q8_run(const struct upd *u, int64_t bb, int64_t be);

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
  if (u->f == FY_STATE_Q8) {  // each thread a run of whole blocks (any split gives the same bytes)
    const int64_t nb = fy_q8_blocks(u->n);
#pragma omp parallel if (parallel : u->n > FY_PAR_ELEMENTWISE)
    {
      const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
      q8_run(u, nb * t / nt, nb * (t + 1) / nt);
    }
    return FY_OK;
  }
  // bf16: WORK_BF16 elements a work item (any split gives the same bits).
  const int64_t nb = (u->n + WORK_BF16 - 1) / WORK_BF16;
#pragma omp parallel for schedule(static) if (parallel : u->n > FY_PAR_ELEMENTWISE)
  for (int64_t b = 0; b < nb; b++) {
    const int64_t b0 = b * WORK_BF16;
    update_items_bf16(u, b0, u->n - b0 < WORK_BF16 ? u->n - b0 : WORK_BF16);
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

// ---- the out-of-place update ----
//
// fy_adamw_state_update_into runs out-of-place copies of the 8-bit kernels above, and loops of its
// own for fp32 and bf16 state (their in-place elements), reading the inputs and writing the
// outputs in one pass: each element's operations are the in-place ones, and every kernel gives
// the same bytes for any split into whole blocks (8-bit) or elements, so the outputs are the
// in-place bytes. What no range covers is copied.
//
// fp32 and bf16 state store with AVX-512 streaming stores where the machine has them: the
// outputs are a spare slot, not read again soon, and a plain store first reads each output line
// (write-allocate), more memory traffic than the in-place update's (bench/adamw --into, 2 threads
// on a shared 2-core Zen 4: out of place took 1.7x the in-place time with plain stores for fp32
// state, 1.1-1.35x with streaming ones; bf16 state 1.4-1.6x and 1.2-1.45x). The 8-bit update was
// no faster through a block's buffer and streaming stores (1.2-1.4x the in-place time either
// way): it stores directly. Streaming stores are weakly ordered: each thread fences its own once,
// at the end of its share.

// The 8-bit kernels' out-of-place copies: update_run, q8_block_plain and q8_block_pipe operation
// for operation, reading the inputs and writing the outputs (test_adamw_state compares the bytes
// with the in-place ones). Copies, not one kernel with a flag for both: gcc compiled the in-place
// loops differently inside a shared always-inlined kernel (1-3% slower). The loop over a thread's
// blocks that calls them is one for both (q8_blocks; the in-place update measured no slower). The
// copies are always inlined into q8_run_into (a few % faster than gcc's own choice here).
#define INTO_KERNEL static inline __attribute__((always_inline))

INTO_KERNEL void update_run_into(const struct upd *u, int64_t lo, int64_t hi, float decay, float *restrict m,
                                 float *restrict v) {
  const int64_t len = hi - lo;
  const struct step_k k = u->k;
  float *restrict p = u->param + lo;
  const float *restrict pi = u->pin + lo;
  if (u->gf) {
    const float *restrict g = u->gf + lo;
    for (int64_t i = 0; i < len; i++) p[i] = adamw_elem(&k, pi[i], decay, m[i], v[i], g[i], m + i, v + i);
  } else {
    uint16_t *restrict w = u->gh + lo;
    const uint16_t *restrict g = u->ghin + lo;
    for (int64_t i = 0; i < len; i++) {
      const float pn = adamw_elem(&k, pi[i], decay, m[i], v[i], fy_bf16_to_f32(g[i]), m + i, v + i);
      p[i] = pn;
      w[i] = fy_f32_to_bf16(pn);
    }
  }
}

// The input's block at b0 (only read through).
static struct q8_blk q8_blk_in(const struct upd *u, int64_t b0) {
  const int64_t b = b0 / FY_Q8_BLOCK;
  return (struct q8_blk){.cm = (int8_t *)u->min + b0, .cv = (uint8_t *)u->vin + b0,
                         .sm = (float *)u->smin + b, .sv = (float *)u->svin + b};
}

INTO_KERNEL void q8_block_plain_into(const struct upd *u, int64_t b0, int64_t len, int r, float *restrict mn,
                                     float *restrict vn) {
  const struct q8_blk q = q8_blk_of(u, b0), qi = q8_blk_in(u, b0);
  const float sm = *qi.sm, sv = *qi.sv;
  const int64_t end = b0 + len;
  for (int64_t i = 0; i < len; i++) {
    mn[i] = q8_val_m((uint8_t)qi.cm[i]) * sm;
    vn[i] = q8_val_v(qi.cv[i]) * sv;
  }
  for (; r < u->nr && u->r[r].off < end; r++) {
    const int64_t lo = u->r[r].off > b0 ? u->r[r].off : b0;
    const int64_t hi = u->r[r].off + u->r[r].n < end ? u->r[r].off + u->r[r].n : end;
    if (lo < hi)
      update_run_into(u, lo, hi, range_decay(&u->k, u->r[r].weight_decay), mn + (lo - b0), vn + (lo - b0));
  }
  q8_store(FY_MOMENT_M, q.cm, q.sm, mn, len, amax_bits_of(mn, len));
  q8_store(FY_MOMENT_V, q.cv, q.sv, vn, len, amax_bits_of(vn, len));
}

INTO_KERNEL void q8_block_pipe_into(const struct upd *u, int64_t b0, float decay, float sm2, float sv2,
                                    struct q8_pipe *restrict w, float *restrict mn, float *restrict vn,
                                    const float *restrict pm, const float *restrict pv, float inv_m, float inv_v,
                                    uint32_t *am, uint32_t *av) {
  const struct step_k k = u->k;
  float *restrict p = u->param + b0;
  const float *restrict pi = u->pin + b0;
  uint32_t amm = 0, amv = 0;
  if (u->gf) {
    const float *restrict g = u->gf + b0;
    for (int i = 0; i < FY_Q8_BLOCK; i++) {
      Q8_PIPE_ELEM(pi[i], g[i])
    }
  } else {
    uint16_t *restrict wo = u->gh + b0;
    const uint16_t *restrict g = u->ghin + b0;
    for (int i = 0; i < FY_Q8_BLOCK; i++) {
      Q8_PIPE_ELEM(pi[i], fy_bf16_to_f32(g[i]))
      wo[i] = fy_f32_to_bf16(pn);
    }
  }
  *am = amm < 0x7f800000u ? amm : 0x7f800000u;
  *av = amv < 0x7f800000u ? amv : 0x7f800000u;
}

// Blocks [bb, be) of one thread: each whole block inside one range pipelined (q8_block_pipe), the
// others plain. into, a constant at each caller: out of place, the codes and scales read from the
// inputs and the out-of-place kernels run (the same machine code as two loops written out).
INTO_KERNEL void q8_blocks(const struct upd *u, int64_t bb, int64_t be, const bool into) {
  struct q8_pipe w;
  memset(w.mn, 0, sizeof w.mn);  // the "block before" of the first pipelined block: zeros
  memset(w.vn, 0, sizeof w.vn);
  int cur = 0;
  bool pending = false;  // block pb waits for its store: its values in w.mn[cur ^ 1], w.vn[cur ^ 1]
  int64_t pb = 0;
  uint32_t pam = 0, pav = 0;
  for (int64_t b = bb; b < be; b++) {
    const int64_t b0 = b * FY_Q8_BLOCK, len = u->n - b0 < FY_Q8_BLOCK ? u->n - b0 : FY_Q8_BLOCK;
    const int r = first_range(u->r, u->nr, b0);
    const struct q8_blk q = into ? q8_blk_in(u, b0) : q8_blk_of(u, b0);
    // whole and inside one range, and scales whose folded read-back factors stay finite (< 2^16
    // for m, < 2^32 for v; NaN fails too)
    const bool whole = len == FY_Q8_BLOCK && r < u->nr && u->r[r].off <= b0 && u->r[r].off + u->r[r].n >= b0 + len &&
                       *q.sm < 0x1p16f && *q.sv < 0x1p32f;
    if (!whole) {  // (the next pipelined block's "block before" then holds stale values: unused)
      if (pending) q8_pipe_store(q8_blk_of(u, pb * FY_Q8_BLOCK), &w, w.mn[cur ^ 1], w.vn[cur ^ 1], pam, pav, 0, 0);
      pending = false;
      if (into) q8_block_plain_into(u, b0, len, r, w.mn[cur], w.vn[cur]);
      else q8_block_plain(u, b0, len, r, w.mn[cur], w.vn[cur]);
      continue;
    }
    for (int i = 0; i < FY_Q8_BLOCK; i++) {
      w.cm[i] = q.cm[i];
      w.cv[i] = q.cv[i];
    }
    bool ok_m = false, ok_v = false;
    const float inv_m = pending ? pipe_inv(pam, &ok_m) : 0.0f, inv_v = pending ? pipe_inv(pav, &ok_v) : 0.0f;
    uint32_t am, av;
    const float decay = range_decay(&u->k, u->r[r].weight_decay), sm2 = *q.sm * 0x1p112f, sv2 = *q.sv * 0x1p96f;
    if (into)
      q8_block_pipe_into(u, b0, decay, sm2, sv2, &w, w.mn[cur], w.vn[cur], w.mn[cur ^ 1], w.vn[cur ^ 1], inv_m, inv_v,
                         &am, &av);
    else
      q8_block_pipe(u, b0, decay, sm2, sv2, &w, w.mn[cur], w.vn[cur], w.mn[cur ^ 1], w.vn[cur ^ 1], inv_m, inv_v, &am,
                    &av);
    if (pending) q8_pipe_store(q8_blk_of(u, pb * FY_Q8_BLOCK), &w, w.mn[cur ^ 1], w.vn[cur ^ 1], pam, pav, ok_m, ok_v);
    pending = true;
    pb = b, pam = am, pav = av;
    cur ^= 1;
  }
  if (pending) q8_pipe_store(q8_blk_of(u, pb * FY_Q8_BLOCK), &w, w.mn[cur ^ 1], w.vn[cur ^ 1], pam, pav, 0, 0);
}

static void q8_run(const struct upd *u, int64_t bb, int64_t be) { q8_blocks(u, bb, be, false); }
static void q8_run_into(const struct upd *u, int64_t bb, int64_t be) { q8_blocks(u, bb, be, true); }

static void stores_fence(void) {
#if defined(__AVX512F__)
  _mm_sfence();
#endif
}

// fp32 and bf16 state, out of place: one range's run of len elements (decay), the pointers at its
// start, fp32 gradients g or bf16 gradients gh (the new bf16 weights to w): the element of
// fy_adamw_update(_bf16), of update_run_bf16. Functions of their own, with restrict parameters: in
// a caller's body gcc loses the restrict of local pointers and, with seven streams, gives up on
// vectorising. Elements [i0, i1) here.
static inline void f32_into_loop(const struct step_k *kp, float decay, int64_t i0, int64_t i1, float *restrict p,
                                 float *restrict m, float *restrict v, uint16_t *restrict w, const float *restrict pi,
                                 const float *restrict mi, const float *restrict vi, const float *restrict g,
                                 const uint16_t *restrict gh) {
  const struct step_k k = *kp;
  if (g) {
    for (int64_t i = i0; i < i1; i++) p[i] = adamw_elem(&k, pi[i], decay, mi[i], vi[i], g[i], m + i, v + i);
  } else {
    for (int64_t i = i0; i < i1; i++) {
      const float pn = adamw_elem(&k, pi[i], decay, mi[i], vi[i], fy_bf16_to_f32(gh[i]), m + i, v + i);
      p[i] = pn;
      w[i] = fy_f32_to_bf16(pn);
    }
  }
}

#if defined(__AVX512F__)
// adamw_elem on 16 lanes, operation for operation (IEEE operations, no fused multiply-adds: the
// same bits).
static inline __m512 adamw_elem16(const struct step_k *k, __m512 p, float decay, __m512 mo, __m512 vo, __m512 g,
                                  __m512 *mn, __m512 *vn) {
  g = _mm512_mul_ps(g, _mm512_set1_ps(k->gs));
  *mn = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(k->b1), mo), _mm512_mul_ps(_mm512_set1_ps(k->ob1), g));
  *vn = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(k->b2), vo),
                      _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(k->ob2), g), g));
  const __m512 den =
      _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(*vn), _mm512_set1_ps(k->bc2_sqrt)), _mm512_set1_ps(k->eps));
  return _mm512_sub_ps(_mm512_mul_ps(p, _mm512_set1_ps(decay)),
                       _mm512_mul_ps(_mm512_set1_ps(k->step), _mm512_div_ps(*mn, den)));
}

// fy_bf16_to_f32 and fy_f32_to_bf16 (round to nearest even, NaN kept quiet) on 16 lanes.
static inline __m512 bf16_16_to_f32(const uint16_t *h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)h)), 16));
}

static inline __m256i f32_16_to_bf16(__m512 f) {
  const __m512i u = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  const __m512i q = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, nan, q));
}

// Elements [h, end) of the run with streaming stores, h the first at which p, m and v sit on 64
// bytes (and w on 32): the index reached (h, nothing done, where the outputs' alignments differ;
// the caller's plain loop does the rest).
static int64_t f32_into_nt(const struct step_k *k, float decay, int64_t len, float *restrict p, float *restrict m,
                           float *restrict v, uint16_t *restrict w, const float *restrict pi,
                           const float *restrict mi, const float *restrict vi, const float *restrict g,
                           const uint16_t *restrict gh, int64_t h) {
  if (((uintptr_t)(p + h) | (uintptr_t)(m + h) | (uintptr_t)(v + h)) & 63 || (w && ((uintptr_t)(w + h) & 31)))
    return h;
  int64_t i = h;
  for (; i + 16 <= len; i += 16) {
    __m512 mn, vn;
    const __m512 gi = g ? _mm512_loadu_ps(g + i) : bf16_16_to_f32(gh + i);
    const __m512 pn =
        adamw_elem16(k, _mm512_loadu_ps(pi + i), decay, _mm512_loadu_ps(mi + i), _mm512_loadu_ps(vi + i), gi, &mn, &vn);
    _mm512_stream_ps(p + i, pn);
    _mm512_stream_ps(m + i, mn);
    _mm512_stream_ps(v + i, vn);
    if (w) _mm256_stream_si256((__m256i *)(w + i), f32_16_to_bf16(pn));
  }
  return i;
}
#endif

static __attribute__((noinline)) void run_f32_into(const struct step_k *kp, float decay, int64_t len,
                                                   float *restrict p, float *restrict m, float *restrict v,
                                                   uint16_t *restrict w, const float *restrict pi,
                                                   const float *restrict mi, const float *restrict vi,
                                                   const float *restrict g, const uint16_t *restrict gh) {
  int64_t i = 0;
#if defined(__AVX512F__)
  int64_t h = (int64_t)((-(uintptr_t)p & 63) / 4);  // (p holds floats: 4-byte aligned)
  h = h < len ? h : len;
  f32_into_loop(kp, decay, 0, h, p, m, v, w, pi, mi, vi, g, gh);
  i = f32_into_nt(kp, decay, len, p, m, v, w, pi, mi, vi, g, gh, h);
#endif
  f32_into_loop(kp, decay, i, len, p, m, v, w, pi, mi, vi, g, gh);
}

// The same for bf16 state: elements [i0, i1) by the plain loop, [h, end) with streaming stores
// (p on 64 bytes, m, v and w on 32, else nothing done: h returned), update_run_bf16's element.
static inline void bf16_into_loop(const struct step_k *kp, float decay, int64_t i0, int64_t i1, float *restrict p,
                                  uint16_t *restrict m, uint16_t *restrict v, uint16_t *restrict w,
                                  const float *restrict pi, const uint16_t *restrict mi, const uint16_t *restrict vi,
                                  const float *restrict g, const uint16_t *restrict gh) {
  const struct step_k k = *kp;
  if (g) {
    for (int64_t i = i0; i < i1; i++) {
      float mn, vn;
      p[i] = adamw_elem(&k, pi[i], decay, fy_bf16_to_f32(mi[i]), fy_bf16_to_f32(vi[i]), g[i], &mn, &vn);
      m[i] = fy_f32_to_bf16(mn);
      v[i] = fy_f32_to_bf16(vn);
    }
  } else {
    for (int64_t i = i0; i < i1; i++) {
      float mn, vn;
      const float pn = adamw_elem(&k, pi[i], decay, fy_bf16_to_f32(mi[i]), fy_bf16_to_f32(vi[i]),
                                  fy_bf16_to_f32(gh[i]), &mn, &vn);
      m[i] = fy_f32_to_bf16(mn);
      v[i] = fy_f32_to_bf16(vn);
      p[i] = pn;
      w[i] = fy_f32_to_bf16(pn);
    }
  }
}

#if defined(__AVX512F__)
static int64_t bf16_into_nt(const struct step_k *k, float decay, int64_t len, float *restrict p, uint16_t *restrict m,
                            uint16_t *restrict v, uint16_t *restrict w, const float *restrict pi,
                            const uint16_t *restrict mi, const uint16_t *restrict vi, const float *restrict g,
                            const uint16_t *restrict gh, int64_t h) {
  if ((uintptr_t)(p + h) & 63 || ((uintptr_t)(m + h) | (uintptr_t)(v + h)) & 31 || (w && ((uintptr_t)(w + h) & 31)))
    return h;
  int64_t i = h;
  for (; i + 16 <= len; i += 16) {
    __m512 mn, vn;
    const __m512 gi = g ? _mm512_loadu_ps(g + i) : bf16_16_to_f32(gh + i);
    const __m512 pn =
        adamw_elem16(k, _mm512_loadu_ps(pi + i), decay, bf16_16_to_f32(mi + i), bf16_16_to_f32(vi + i), gi, &mn, &vn);
    _mm512_stream_ps(p + i, pn);
    _mm256_stream_si256((__m256i *)(m + i), f32_16_to_bf16(mn));
    _mm256_stream_si256((__m256i *)(v + i), f32_16_to_bf16(vn));
    if (w) _mm256_stream_si256((__m256i *)(w + i), f32_16_to_bf16(pn));
  }
  return i;
}
#endif

static __attribute__((noinline)) void run_bf16_into(const struct step_k *kp, float decay, int64_t len,
                                                    float *restrict p, uint16_t *restrict m, uint16_t *restrict v,
                                                    uint16_t *restrict w, const float *restrict pi,
                                                    const uint16_t *restrict mi, const uint16_t *restrict vi,
                                                    const float *restrict g, const uint16_t *restrict gh) {
  int64_t i = 0;
#if defined(__AVX512F__)
  int64_t h = (int64_t)((-(uintptr_t)p & 63) / 4);
  h = h < len ? h : len;
  bf16_into_loop(kp, decay, 0, h, p, m, v, w, pi, mi, vi, g, gh);
  i = bf16_into_nt(kp, decay, len, p, m, v, w, pi, mi, vi, g, gh, h);
#endif
  bf16_into_loop(kp, decay, i, len, p, m, v, w, pi, mi, vi, g, gh);
}

// Elements [lo, hi) of u's outputs that no range covers <- the inputs: param, the bf16 weights
// (the gradients, as in place), and m and v but in 8 bits (whose blocks the kernels store whole).
static void copy_gaps(const struct upd *u, int64_t lo, int64_t hi) {
  const size_t es = u->f == FY_STATE_F32 ? 4 : 2;
  int64_t pos = lo;
  for (int r = first_range(u->r, u->nr, lo);; r++) {
    const int64_t g1 = r < u->nr && u->r[r].off < hi ? u->r[r].off : hi;
    if (g1 > pos) {
      memcpy(u->param + pos, u->pin + pos, (size_t)(g1 - pos) * 4);
      if (u->gh) memcpy(u->gh + pos, u->ghin + pos, (size_t)(g1 - pos) * 2);
      if (u->f != FY_STATE_Q8) {
        memcpy((char *)u->m + pos * es, (const char *)u->min + pos * es, (size_t)(g1 - pos) * es);
        memcpy((char *)u->v + pos * es, (const char *)u->vin + pos * es, (size_t)(g1 - pos) * es);
      }
    }
    if (g1 == hi) break;
    const int64_t e = u->r[r].off + u->r[r].n;
    pos = e > pos ? e : pos;
  }
}

// fp32 and bf16 state: a work item [b0, b0 + len), range by range, and what no range covers.
static void into_items(const struct upd *u, int64_t b0, int64_t len) {
  const int64_t end = b0 + len;
  for (int r = first_range(u->r, u->nr, b0); r < u->nr && u->r[r].off < end; r++) {
    const int64_t lo = u->r[r].off > b0 ? u->r[r].off : b0;
    const int64_t hi = u->r[r].off + u->r[r].n < end ? u->r[r].off + u->r[r].n : end;
    if (lo >= hi) continue;
    const float decay = range_decay(&u->k, u->r[r].weight_decay);
    const float *g = u->gf ? u->gf + lo : NULL;
    const uint16_t *gh = u->ghin ? u->ghin + lo : NULL;
    uint16_t *w = u->gh ? u->gh + lo : NULL;
    if (u->f == FY_STATE_F32)
      run_f32_into(&u->k, decay, hi - lo, u->param + lo, (float *)u->m + lo, (float *)u->v + lo, w, u->pin + lo,
                   (const float *)u->min + lo, (const float *)u->vin + lo, g, gh);
    else
      run_bf16_into(&u->k, decay, hi - lo, u->param + lo, (uint16_t *)u->m + lo, (uint16_t *)u->v + lo, w,
                    u->pin + lo, (const uint16_t *)u->min + lo, (const uint16_t *)u->vin + lo, g, gh);
  }
  copy_gaps(u, b0, end);
}

fy_status fy_adamw_state_update_into(enum fy_state_format f, float *param_out, void *m_out, void *v_out,
                                     uint16_t *w16_out, const float *param, const void *m, const void *v,
                                     const float *grad, const uint16_t *gw, int64_t n,
                                     const struct fy_adamw_range *ranges, int n_ranges, float lr, float beta1,
                                     float beta2, float eps, int64_t t, float grad_scale) {
  FY_TRY(check_args(f, n, ranges, n_ranges, t));
  if (!grad == !gw || (grad && w16_out) || (gw && !w16_out))
    return fy_error_set(FY_ERR_INVALID, "adamw state into: give fp32 gradients, or bf16 gradients and w16_out");
  if (n == 0) return FY_OK;
  if (!param_out || !m_out || !v_out || !param || !m || !v)
    return fy_error_set(FY_ERR_INVALID, "adamw state into: a NULL buffer for %lld elements", (long long)n);
  const bool q8 = f == FY_STATE_Q8;
  const struct upd u = {.f = f, .param = param_out, .m = m_out, .v = v_out, .gf = grad, .gh = w16_out, .pin = param,
                        .min = m, .vin = v,
                        .smin = q8 ? (const float *)((const char *)m + fy_q8_scales_offset(n)) : NULL,
                        .svin = q8 ? (const float *)((const char *)v + fy_q8_scales_offset(n)) : NULL, .ghin = gw,
                        .n = n, .r = ranges, .nr = n_ranges, .k = step_consts(lr, beta1, beta2, eps, t, grad_scale)};
  if (q8) {  // as in place, each thread a run of whole blocks
    const size_t pad = fy_q8_scales_offset(n) - (size_t)n;  // (the bytes before the scales: the buffers equal whole)
    memcpy((char *)m_out + n, (const char *)m + n, pad);
    memcpy((char *)v_out + n, (const char *)v + n, pad);
    const int64_t nb = fy_q8_blocks(n);
#pragma omp parallel if (parallel : n > FY_PAR_ELEMENTWISE)
    {
      const int64_t nt = omp_get_num_threads(), th = omp_get_thread_num(), bb = nb * th / nt, be = nb * (th + 1) / nt;
      q8_run_into(&u, bb, be);
      copy_gaps(&u, bb * FY_Q8_BLOCK, be * FY_Q8_BLOCK < n ? be * FY_Q8_BLOCK : n);
    }
    return FY_OK;
  }
  const int64_t nb = (n + WORK_BF16 - 1) / WORK_BF16;
#pragma omp parallel if (parallel : n > FY_PAR_ELEMENTWISE)
  {
#pragma omp for schedule(static) nowait
    for (int64_t b = 0; b < nb; b++) {
      const int64_t b0 = b * WORK_BF16;
      into_items(&u, b0, n - b0 < WORK_BF16 ? n - b0 : WORK_BF16);
    }
    stores_fence();
  }
  return FY_OK;
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
    float *scale = (float *)((char *)dst + fy_q8_scales_offset(n));
    const int64_t nb = fy_q8_blocks(n);
#pragma omp parallel for schedule(static) if (parallel : n > FY_PAR_ELEMENTWISE)
    for (int64_t b = 0; b < nb; b++) {
      const int64_t b0 = b * FY_Q8_BLOCK, len = n - b0 < FY_Q8_BLOCK ? n - b0 : FY_Q8_BLOCK;
      const uint32_t am = amax_bits_of(src + b0, len);
      q8_store(which, (uint8_t *)dst + b0, scale + b, src + b0, len, am);
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
    const uint8_t *c = src;
    const float *scale = (const float *)((const char *)src + fy_q8_scales_offset(n));
    const int64_t nb = fy_q8_blocks(n);
#pragma omp parallel for schedule(static) if (parallel : n > FY_PAR_ELEMENTWISE)
    for (int64_t b = 0; b < nb; b++) {
      const int64_t b0 = b * FY_Q8_BLOCK, len = n - b0 < FY_Q8_BLOCK ? n - b0 : FY_Q8_BLOCK;
      const float s = scale[b];
      if (which == FY_MOMENT_M)
        for (int64_t i = b0; i < b0 + len; i++) dst[i] = q8_val_m(c[i]) * s;
      else
        for (int64_t i = b0; i < b0 + len; i++) dst[i] = q8_val_v(c[i]) * s;
    }
  }
}
