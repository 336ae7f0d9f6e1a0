// AdamW with bf16 and 8-bit state (ops/cpu/adamw_state.c): the codes, the nearest-code rule
// against a brute-force search, the round trip's error bound, zero, NaN and outlier blocks, short
// last blocks, the fused update against decode + fy_adamw_update + encode, ranges with gaps and
// different decay, the thread count, the out-of-place update against the in-place one, and the
// drift of 8-bit m and v from fp32 state over 100 steps.
//
// usage: test_adamw_state                the checks
//        test_adamw_state --dump DIR     writes inputs and results for test/reference/adamw_state_ref.py
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "core/dtype.h"
#include "ops/ops.h"

static const float LR = 1e-3f, B1 = 0.9f, B2 = 0.999f, EPS = 1e-8f;

static void *xmalloc(size_t n) {
  void *p = calloc(n ? n : 1, 1);
  if (!p) abort();
  return p;
}

// The codes (ops/ops.h): magnitude k = 8 e + f, value f 2^-S (e = 0) or (8 + f) 2^(e-1-S), S = 17
// for m (top code 120 = 1.0, signed int8_t), 33 for v (top code 248 = 1.0).
static int S_of(enum fy_moment w) { return w == FY_MOMENT_M ? 17 : 33; }
static int top_of(enum fy_moment w) { return w == FY_MOMENT_M ? 120 : 248; }

// The value of magnitude k, from the definition, in double (exact).
static double mag_value(enum fy_moment w, int k) {
  const int e = k >> 3, f = k & 7, S = S_of(w);
  return e == 0 ? ldexp(f, -S) : ldexp(8 + f, e - 1 - S);
}

// The value of code byte c: m's byte is an int8_t, -k for negative values.
static double code_value(enum fy_moment w, int c) {
  if (w == FY_MOMENT_V) return mag_value(w, c);
  const int s = (int8_t)c;
  return s < 0 ? -mag_value(w, -s) : mag_value(w, s);
}

// The round trip's relative bound in the normal binades (|x| >= absmax 2^(3-S)): the nearest of
// r = fl(|x| * fl(1/absmax)) is within r/17 of it (the worst: r = 2^e (1 + 1/16), half a step
// from 2^e), plus the roundings of the reciprocal, of the product and of the read-back product
// (2^-24 each, relative): 1/17 + 2^-21 covers them.
static const double REL_BOUND = 1.0 / 17 + 0x1p-21;

static void test_codes(void) {
  for (int w = 0; w < 2; w++) {
    const enum fy_moment mo = w ? FY_MOMENT_V : FY_MOMENT_M;
    const float *c = fy_q8_code_values(mo);
    int bad = 0;
    for (int j = 0; j < 256; j++) bad += (double)c[j] != code_value(mo, j);
    for (int k = 1; k <= top_of(mo); k++) bad += !(mag_value(mo, k) > mag_value(mo, k - 1));
    CHECKF(bad == 0 && c[top_of(mo)] == 1.0f && mag_value(mo, 1) == ldexp(1, -S_of(mo)),
           "%s code: %d values differ from the definition", w ? "v" : "m", bad);
  }
  // m: the code of -x is minus that of x; -128 (never written) reads as the formula goes on: -2
  const float *cm = fy_q8_code_values(FY_MOMENT_M);
  int bad = 0;
  for (int k = 1; k < 128; k++) bad += cm[(uint8_t)(int8_t)-k] != -cm[k];
  CHECK(bad == 0 && cm[128] == -2.0f && cm[0] == 0.0f);
  fprintf(stderr, "  codes: m 0, %g .. 1 (top 120), v 0, %g .. 1 (top 248)\n", cm[1],
          fy_q8_code_values(FY_MOMENT_V)[1]);
  CHECK(fy_state_moment_bytes(FY_STATE_F32, 1000) == 4000 && fy_state_moment_bytes(FY_STATE_BF16, 1000) == 2000);
  CHECK(fy_q8_blocks(1000) == 4 && fy_q8_scales_offset(1000) == 1024 && fy_state_moment_bytes(FY_STATE_Q8, 1000) == 1040);
  CHECK(fy_state_bytes(FY_STATE_Q8, 256) == 2 * (256 + 4) && fy_state_moment_bytes(FY_STATE_Q8, 0) == 0);
  enum fy_state_format f = FY_STATE_F32;
  CHECK(fy_state_format_from_name("8bit", &f) && f == FY_STATE_Q8 && !strcmp(fy_state_format_name(f), "8bit"));
  CHECK(fy_state_format_from_name("bf16", &f) && f == FY_STATE_BF16 && !fy_state_format_from_name("int8", &f));
}

// x rounded to float's 24 bits, to nearest even, with no bounds on the exponent.
static double round24(double x) {
  if (x == 0) return 0;
  int e;
  frexp(x, &e);
  return ldexp((double)(float)ldexp(x, -e), e);  // ldexp(x, -e) in [0.5, 1): a normal float
}

// The code of x in a block of absmax amax, from the definition and by brute force: r =
// round24(|x| * round24(1 / amax)), then the code byte whose value is nearest to r among all 256,
// a tie to the even magnitude; -k for m's negative x; v: a positive x never gets 0.
static int brute(enum fy_moment w, float x, float amax) {
  static double val[2][256];
  if (val[0][1] == 0)
    for (int c = 0; c < 256; c++) val[0][c] = code_value(FY_MOMENT_M, c), val[1][c] = code_value(FY_MOMENT_V, c);
  const double *t = val[w == FY_MOMENT_V];
  const double r = round24(fabs((double)x) * round24(1.0 / amax));
  int best = 0;
  for (int c = 1; c < 256; c++) {
    const double d = fabs(r - t[c]), db = fabs(r - t[best]);
    const int k = w == FY_MOMENT_M ? abs((int8_t)c) : c;
    if (d < db || (d == db && k % 2 == 0)) best = c;
  }
  if (w == FY_MOMENT_M) {
    const int k = abs((int8_t)best);
    return x < 0 ? -k : k;
  }
  if (best == 0 && x > 0) best = 1;
  return best;
}

// The nearest-code rule against brute(): at every magnitude and the floats beside it, the
// midpoints between neighbours (exact ties) and the floats beside them, a sweep over all floats
// in [0, 1] (every 16411th), uniform and log-uniform random values over 45 decades; in blocks of
// absmax 1 (r = |x|), 3 (a reciprocal that rounds) and, for the blocks whose 1 / absmax would
// leave float's range, 1e-40 and 2e38; m's values also negated.
static void test_nearest(void) {
  enum { CAP = 120000 };
  float *a = xmalloc(CAP * sizeof(float));
  for (int w = 0; w < 2; w++) {
    const enum fy_moment mo = w ? FY_MOMENT_V : FY_MOMENT_M;
    const int K = top_of(mo);
    int n = 0;
    for (int i = 0; i <= K; i++) {
      const float c = (float)mag_value(mo, i);
      float x = c, y = c;
      for (int s = 0; s < 4; s++) {
        a[n++] = x, a[n++] = y;
        x = nextafterf(x, 2.0f), y = nextafterf(y, -1.0f);
      }
      if (i < K) {
        const float mid = (float)((mag_value(mo, i) + mag_value(mo, i + 1)) / 2);
        a[n++] = mid, a[n++] = nextafterf(mid, 2.0f), a[n++] = nextafterf(mid, -1.0f);
      }
    }
    for (uint32_t u = 0; u <= 0x3f800000u; u += 16411) memcpy(&a[n++], &u, 4);
    while (n < CAP * 3 / 4) a[n++] = (float)check_urand();
    while (n < CAP) a[n++] = (float)pow(10.0, -45.0 * check_urand());
    for (int i = 0; i < n; i++) a[i] = fminf(fmaxf(a[i], 0.0f), 1.0f);
    // blocks of [amax, 255 test values times amax]
    const int nb = (n + 254) / 255;
    const int64_t len = (int64_t)nb * FY_Q8_BLOCK;
    float *x = xmalloc((size_t)len * 4);
    uint8_t *q = xmalloc(fy_state_moment_bytes(FY_STATE_Q8, len));
    int bad = 0, ties = 0, tested = 0;
    for (int i = 0; i < n; i++) {
      const double r = a[i];
      for (int k = 0; k < K; k++) ties += r - mag_value(mo, k) == mag_value(mo, k + 1) - r;
    }
    static const float amaxes[] = {1.0f, 3.0f, 1e-40f, 2e38f};
    for (int ai = 0; ai < 4; ai++) {
      const float amax = amaxes[ai];
      for (int sign = 0; sign < (w ? 1 : 2); sign++) {
        for (int b = 0; b < nb; b++) {
          x[(int64_t)b * FY_Q8_BLOCK] = sign ? -amax : amax;
          for (int j = 1; j < FY_Q8_BLOCK; j++) {
            const int k = b * 255 + j - 1;
            const float v = k < n ? fminf(a[k] * amax, amax) : 0.0f;
            x[(int64_t)b * FY_Q8_BLOCK + j] = sign && j % 3 ? -v : v;
          }
        }
        fy_state_encode(FY_STATE_Q8, mo, q, x, len);
        for (int64_t i = 0; i < len; i++) {
          const int want = brute(mo, x[i], amax);
          const int got = w ? q[i] : (int8_t)q[i];
          tested++;
          if (got != want && bad++ < 5)
            fprintf(stderr, "  %s: %.9g in a block of absmax %g -> code %d, nearest %d\n", w ? "v" : "m", x[i], amax,
                    got, want);
        }
      }
    }
    fprintf(stderr, "  %s nearest: %d codes checked, %d exact ties among the values\n", w ? "v" : "m", tested, ties);
    CHECKF(bad == 0 && ties > 100, "%s: %d values away from the nearest code (%d ties)", w ? "v" : "m", bad, ties);
    free(x);
    free(q);
  }
  free(a);
}

// Round trip: in the normal binades |x - decode(encode(x))| <= |x| REL_BOUND; below them the
// subnormal step's half (m: absmax 2^-18), or, for v's positive values below half the smallest
// code, that code (absmax 2^-33); on blocks of several kinds: uniform, 12 and 40 decades, zeros,
// one huge value, a NaN, an infinity, subnormal and near-overflow absmax; n not a multiple of the
// block. The largest relative error seen in the normal binades is printed (1/17 is the bound).
static void test_round_trip(void) {
  const int64_t n = 11 * FY_Q8_BLOCK + 77;
  float *x = xmalloc((size_t)n * 4), *y = xmalloc((size_t)n * 4);
  uint8_t *q = xmalloc(fy_state_moment_bytes(FY_STATE_Q8, n));
  for (int w = 0; w < 2; w++) {
    const enum fy_moment mo = w ? FY_MOMENT_V : FY_MOMENT_M;
    const int S = S_of(mo);
    for (int64_t i = 0; i < n; i++) {
      const int64_t b = i / FY_Q8_BLOCK;
      const float sgn = check_urand() < 0.5 ? -1.0f : 1.0f;
      float v = b == 0   ? check_frand(1.0f)                                               // uniform
                : b == 1 ? (float)pow(10.0, -12.0 * check_urand()) * sgn                   // 12 decades
                : b == 2 ? 0.0f                                                             // zeros
                : b == 3 ? (i % FY_Q8_BLOCK == 17 ? 1e30f : check_frand(1.0f))             // one huge value
                : b == 4 ? (i % FY_Q8_BLOCK == 5 ? NAN : check_frand(1.0f))                // a NaN
                : b == 5 ? check_frand(1e-30f)                                              // tiny
                : b == 6 ? (float)pow(10.0, -40.0 * check_urand()) * sgn                   // 40 decades
                : b == 7 ? (i % FY_Q8_BLOCK == 9 ? -INFINITY : check_frand(1.0f))          // an infinity
                : b == 8 ? check_frand(1e-39f)                                              // subnormal absmax
                : b == 9 ? (i % FY_Q8_BLOCK == 3 ? 1e-30f : check_frand(3e38f))            // near overflow
                         : check_frand(3.0f);                                               // and the short last block
      x[i] = w ? fabsf(v) : v;
    }
    fy_state_encode(FY_STATE_Q8, mo, q, x, n);
    fy_state_decode(FY_STATE_Q8, mo, y, q, n);
    const float *scale = (const float *)(q + fy_q8_scales_offset(n));
    double worst = 0;
    int bad = 0;
    for (int64_t i = 0; i < n; i++) {
      const int64_t b = i / FY_Q8_BLOCK;
      if (b == 4 || b == 7) {
        bad += !isnan(y[i]);
        continue;
      }
      double amax = 0;
      for (int64_t j = b * FY_Q8_BLOCK; j < (b + 1) * FY_Q8_BLOCK && j < n; j++) amax = fmax(amax, fabs(x[j]));
      bad += scale[b] != (float)amax;
      const double ax = fabs((double)x[i]), e = fabs((double)x[i] - y[i]);
      if (ax >= amax * ldexp(1, 3 - S)) {
        worst = fmax(worst, e / ax);
        bad += e > ax * REL_BOUND;
      } else {
        bad += e > amax * ldexp(w ? 1 : 0.5, -S) * (1 + 0x1p-20) + 0x1p-149;
      }
      if (w && x[i] > 0) bad += !(y[i] > 0);  // a positive v never reads back as 0
      if (ax == amax) bad += y[i] != x[i];    // the absmax element reads back exactly
    }
    // the huge value reads back exactly; its small neighbours as 0 (m) or the smallest code (v)
    bad += y[3 * FY_Q8_BLOCK + 17] != 1e30f;
    bad += w ? q[3 * FY_Q8_BLOCK + 18] != 1 : q[3 * FY_Q8_BLOCK + 18] != 0;
    for (int64_t i = 2 * FY_Q8_BLOCK; i < 3 * FY_Q8_BLOCK; i++) bad += q[i] != 0 || y[i] != 0.0f;
    for (int64_t i = 4 * FY_Q8_BLOCK; i < 5 * FY_Q8_BLOCK; i++) bad += q[i] != 0;
    bad += !isnan(scale[4]) || !isnan(scale[7]);
    fprintf(stderr, "  %s round trip: worst relative error in the normal binades %.5f (bound %.5f)\n", w ? "v" : "m",
            worst, REL_BOUND);
    CHECKF(bad == 0 && worst > 0.05, "%s round trip: %d bad values", w ? "v" : "m", bad);
  }
  // bf16: round to nearest even and back
  uint16_t *hb = xmalloc((size_t)n * 2);
  for (int64_t i = 0; i < n; i++) x[i] = check_frand(10.0f);
  fy_state_encode(FY_STATE_BF16, FY_MOMENT_M, hb, x, n);
  fy_state_decode(FY_STATE_BF16, FY_MOMENT_M, y, hb, n);
  int bad = 0;
  for (int64_t i = 0; i < n; i++) bad += hb[i] != fy_f32_to_bf16(x[i]) || y[i] != fy_bf16_to_f32(hb[i]);
  CHECK(bad == 0);
  free(hb);
  free(x);
  free(y);
  free(q);
}

// The ranges of test updates: two parameters with different decay, padding between them, a
// range crossing block boundaries, one of a single element, an empty one, the tail uncovered.
static int test_ranges(int64_t n, struct fy_adamw_range *r) {
  int k = 0;
  r[k++] = (struct fy_adamw_range){0, n / 3, 0.1f};
  r[k++] = (struct fy_adamw_range){n / 3 + 16, 1, 0.0f};
  r[k++] = (struct fy_adamw_range){n / 3 + 17, 0, 0.5f};
  r[k++] = (struct fy_adamw_range){n / 3 + 32, n / 3, 0.0f};
  r[k++] = (struct fy_adamw_range){2 * (n / 3) + 40, n - 2 * (n / 3) - 40 - 9, 0.01f};
  return k;
}

struct state {
  float *p;
  void *m, *v;
  float *g;
  uint16_t *gw;
};

static struct state state_new(enum fy_state_format f, int64_t n, const float *p, const float *m, const float *v,
                              const float *g) {
  struct state s = {xmalloc((size_t)n * 4), xmalloc(fy_state_moment_bytes(f, n)), xmalloc(fy_state_moment_bytes(f, n)),
                    xmalloc((size_t)n * 4), xmalloc((size_t)n * 2)};
  memcpy(s.p, p, (size_t)n * 4);
  memcpy(s.g, g, (size_t)n * 4);
  for (int64_t i = 0; i < n; i++) s.gw[i] = fy_f32_to_bf16(g[i]);
  fy_state_encode(f, FY_MOMENT_M, s.m, m, n);
  fy_state_encode(f, FY_MOMENT_V, s.v, v, n);
  return s;
}

static void state_free(struct state *s) {
  free(s->p), free(s->m), free(s->v), free(s->g), free(s->gw);
}

static bool state_equal(enum fy_state_format f, int64_t n, const struct state *a, const struct state *b) {
  const size_t mb = fy_state_moment_bytes(f, n);
  return !memcmp(a->p, b->p, (size_t)n * 4) && !memcmp(a->m, b->m, mb) && !memcmp(a->v, b->v, mb) &&
         !memcmp(a->gw, b->gw, (size_t)n * 2);
}

// The fused update against its definition made of other pieces: decode, fy_adamw_update(_bf16)
// range by range on the floats, encode. Both gradient forms, both formats, several steps; and
// with 1 and 3 threads the same bytes.
static void test_update(void) {
  const int64_t n = 300000 + 77;  // above the parallel threshold; the last block short
  float *p = xmalloc((size_t)n * 4), *m = xmalloc((size_t)n * 4), *v = xmalloc((size_t)n * 4), *g = xmalloc((size_t)n * 4);
  for (int64_t i = 0; i < n; i++) {
    p[i] = check_frand(0.1f);
    g[i] = check_frand(1.0f) * (float)pow(10.0, -4.0 * check_urand());
  }
  // three whole blocks inside a range whose absmax leaves [2^-126, 2^126), which the update
  // stores by the plain path: v near 1e38, v subnormal, m subnormal (v then 0)
  for (int64_t i = 200 * FY_Q8_BLOCK; i < 201 * FY_Q8_BLOCK; i++) g[i] *= 4e20f;
  for (int64_t i = 201 * FY_Q8_BLOCK; i < 202 * FY_Q8_BLOCK; i++) g[i] *= 3e-20f;
  for (int64_t i = 202 * FY_Q8_BLOCK; i < 203 * FY_Q8_BLOCK; i++) g[i] *= 1e-38f;
  for (int64_t i = 0; i < n; i++) {
    m[i] = 0.1f * g[i];
    v[i] = 0.001f * g[i] * g[i];
  }
  struct fy_adamw_range r[8];
  const int nr = test_ranges(n, r);
  for (int fi = 0; fi < 3; fi++) {
    const enum fy_state_format f = (enum fy_state_format)fi;
    for (int bf = 0; bf < 2; bf++) {
      struct state s = state_new(f, n, p, m, v, g), t1 = state_new(f, n, p, m, v, g), ref = state_new(f, n, p, m, v, g);
      float *fm = xmalloc((size_t)n * 4), *fv = xmalloc((size_t)n * 4);
      int bad_ref = 0, bad_thr = 0;
      for (int step = 1; step <= 3; step++) {
        const float gs = step == 2 ? 0.5f : 1.0f;
        omp_set_num_threads(3);  // three runs of blocks: two pipeline seams against one thread's none
        CHECK_OK(bf ? fy_adamw_state_update_bf16(f, s.p, s.m, s.v, s.gw, n, r, nr, LR, B1, B2, EPS, step, gs)
                    : fy_adamw_state_update(f, s.p, s.m, s.v, s.g, n, r, nr, LR, B1, B2, EPS, step, gs));
        omp_set_num_threads(1);
        CHECK_OK(bf ? fy_adamw_state_update_bf16(f, t1.p, t1.m, t1.v, t1.gw, n, r, nr, LR, B1, B2, EPS, step, gs)
                    : fy_adamw_state_update(f, t1.p, t1.m, t1.v, t1.g, n, r, nr, LR, B1, B2, EPS, step, gs));
        omp_set_num_threads(2);
        fy_state_decode(f, FY_MOMENT_M, fm, ref.m, n);
        fy_state_decode(f, FY_MOMENT_V, fv, ref.v, n);
        for (int k = 0; k < nr; k++) {
          const int64_t o = r[k].off;
          if (bf)
            fy_adamw_update_bf16(ref.p + o, fm + o, fv + o, ref.gw + o, r[k].n, LR, B1, B2, EPS, r[k].weight_decay,
                                 step, gs);
          else
            fy_adamw_update(ref.p + o, fm + o, fv + o, ref.g + o, r[k].n, LR, B1, B2, EPS, r[k].weight_decay, step, gs);
        }
        fy_state_encode(f, FY_MOMENT_M, ref.m, fm, n);
        fy_state_encode(f, FY_MOMENT_V, ref.v, fv, n);
        bad_ref += !state_equal(f, n, &s, &ref);
        bad_thr += !state_equal(f, n, &s, &t1);
        if (bf)  // the next step's gradients over the new weights, as the offloaded chunks get them
          for (int64_t i = 0; i < n; i++) s.gw[i] = t1.gw[i] = ref.gw[i] = fy_f32_to_bf16(g[(i * 7 + step) % n]);
      }
      // padding and the uncovered tail: weights and gradients untouched
      int bad_pad = 0;
      for (int64_t i = r[0].off + r[0].n; i < r[1].off; i++) bad_pad += s.p[i] != p[i];
      for (int64_t i = r[4].off + r[4].n; i < n; i++) bad_pad += s.p[i] != p[i] || s.g[i] != g[i];
      // the fused update moved the weights (not a no-op)
      int moved = 0;
      for (int64_t i = 0; i < n; i++) moved += s.p[i] != p[i];
      fprintf(stderr, "  update %s %s grads: %d weights moved\n", fy_state_format_name(f), bf ? "bf16" : "fp32", moved);
      CHECKF(bad_ref == 0 && bad_thr == 0 && bad_pad == 0 && moved > n / 2,
             "%s %s: %d steps unlike decode+update+encode, %d unlike 1 thread (3 threads), %d padding touched",
             fy_state_format_name(f), bf ? "bf16" : "fp32", bad_ref, bad_thr, bad_pad);
      state_free(&s), state_free(&t1), state_free(&ref);
      free(fm), free(fv);
    }
  }
  // bad ranges and steps are refused before anything is written
  struct state s = state_new(FY_STATE_Q8, n, p, m, v, g);
  struct fy_adamw_range bad1[2] = {{0, 100, 0}, {50, 10, 0}}, bad2[1] = {{n - 5, 6, 0}}, bad3[1] = {{-1, 2, 0}};
  CHECK_ERR(fy_adamw_state_update(FY_STATE_Q8, s.p, s.m, s.v, s.g, n, bad1, 2, LR, B1, B2, EPS, 1, 1), FY_ERR_INVALID);
  CHECK_ERR(fy_adamw_state_update(FY_STATE_Q8, s.p, s.m, s.v, s.g, n, bad2, 1, LR, B1, B2, EPS, 1, 1), FY_ERR_INVALID);
  CHECK_ERR(fy_adamw_state_update(FY_STATE_BF16, s.p, s.m, s.v, s.g, n, bad3, 1, LR, B1, B2, EPS, 1, 1), FY_ERR_INVALID);
  CHECK_ERR(fy_adamw_state_update(FY_STATE_Q8, s.p, s.m, s.v, s.g, n, r, nr, LR, B1, B2, EPS, 0, 1), FY_ERR_INVALID);
  CHECK(!memcmp(s.p, p, (size_t)n * 4));
  state_free(&s);
  free(p), free(m), free(v), free(g);
}

// Random ranges over [0, n) for the out-of-place test: gaps of 0 to 40 elements and now and then
// one of several blocks (blocks in no range), runs of 1 to 5000 elements (across blocks and the
// out-of-place update's tiles), zero-length ones, four weight decays, an uncovered tail.
static int random_ranges(int64_t n, struct fy_adamw_range *r, int cap) {
  static const float wd[4] = {0.0f, 0.01f, 0.1f, 0.5f};
  int k = 0;
  int64_t pos = (int64_t)(check_urand() * 3);
  while (k < cap - 1) {
    const double u = check_urand();
    const int64_t len = u < 0.1 ? 0 : u < 0.3 ? 1 + (int64_t)(check_urand() * 20) : 1 + (int64_t)(check_urand() * 5000);
    if (pos + len > n - 5) break;
    r[k++] = (struct fy_adamw_range){pos, len, wd[(int)(check_urand() * 4)]};
    pos += len + (check_urand() < 0.1 ? 3 * FY_Q8_BLOCK : (int64_t)(check_urand() * 41));
  }
  return k;
}

// 64-byte aligned (the out-of-place update's streaming stores need outputs on 64 bytes).
static void *xmalloc64(size_t n) {
  void *p = aligned_alloc(64, (n + 64) & ~(size_t)63);
  if (!p) abort();
  return p;
}

// Copies of one call's buffers: param, m, v, fp32 and bf16 gradients; on 64 bytes if a64, else
// where calloc puts them (16 bytes: the out-of-place update's plain path for fp32 state).
static struct state state_copy_at(enum fy_state_format f, int64_t n, const struct state *a, bool a64) {
  const size_t mb = fy_state_moment_bytes(f, n);
  void *(*al)(size_t) = a64 ? xmalloc64 : xmalloc;
  struct state s = {al((size_t)n * 4), al(mb), al(mb), al((size_t)n * 4), al((size_t)n * 2)};
  memcpy(s.p, a->p, (size_t)n * 4), memcpy(s.m, a->m, mb), memcpy(s.v, a->v, mb);
  memcpy(s.g, a->g, (size_t)n * 4), memcpy(s.gw, a->gw, (size_t)n * 2);
  return s;
}

static struct state state_copy(enum fy_state_format f, int64_t n, const struct state *a) {
  return state_copy_at(f, n, a, false);
}

// Every byte of s's param, m, v and bf16 weights <- byte.
static void state_fill(enum fy_state_format f, int64_t n, struct state *s, int byte) {
  const size_t mb = fy_state_moment_bytes(f, n);
  memset(s->p, byte, (size_t)n * 4), memset(s->m, byte, mb), memset(s->v, byte, mb), memset(s->gw, byte, (size_t)n * 2);
}

// fy_adamw_state_update_into: in -> out (out.gw the bf16 weights when bf).
static fy_status update_into(enum fy_state_format f, bool bf, struct state *out, const struct state *in, int64_t n,
                             const struct fy_adamw_range *r, int nr, int64_t t, float gs) {
  return fy_adamw_state_update_into(f, out->p, out->m, out->v, bf ? out->gw : NULL, in->p, in->m, in->v,
                                    bf ? NULL : in->g, bf ? in->gw : NULL, n, r, nr, LR, B1, B2, EPS, t, gs);
}

// The out-of-place update against the in-place one, byte for byte: param, m and v whole (8-bit
// scales included) and the bf16 weights, for the three formats, both gradient forms, n below a
// block, of several 4096-element work items, not a multiple of the block, and above the parallel
// threshold (1 and 3 threads then give the same bytes; the 1-thread outputs on 64 bytes, the
// 3-thread ones where calloc puts them: fp32 and bf16 state's streaming and plain paths); random
// ranges with gaps, blocks of zeros (m, v and gradients), a NaN and an infinite gradient, and
// blocks in no range; the inputs left as they were; and the refusals, which write nothing.
static void test_into(void) {
  static const int64_t ns[] = {1, 100, 256, 1000, 5000 + 3, 3 * 8192 + 77, 70000 + 133};
  enum { CAP = 256 };
  struct fy_adamw_range r[CAP];
  int cases = 0, bad_eq = 0, bad_in = 0, bad_thr = 0, moved_total = 0;
  for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++) {
    const int64_t n = ns[ni];
    float *p = xmalloc((size_t)n * 4), *m = xmalloc((size_t)n * 4), *v = xmalloc((size_t)n * 4);
    float *g = xmalloc((size_t)n * 4);
    for (int64_t i = 0; i < n; i++) {
      const int64_t b = i / FY_Q8_BLOCK;
      p[i] = check_frand(0.1f);
      g[i] = b % 7 == 3 ? 0.0f : check_frand(1.0f) * (float)pow(10.0, -4.0 * check_urand());
      m[i] = b % 5 == 2 ? 0.0f : 0.1f * check_frand(1.0f) * (float)pow(10.0, -4.0 * check_urand());
      v[i] = b % 5 == 2 ? 0.0f : 0.01f * m[i] * m[i] + 1e-12f * (float)check_urand();
    }
    if (n > 3000) g[n / 2 + 1] = NAN, g[n / 2 + 700] = INFINITY;  // NaN weights (and 8-bit blocks) from here
    const int nr = n < 8 ? (r[0] = (struct fy_adamw_range){0, n, 0.1f}, 1) : random_ranges(n, r, CAP);
    for (int fi = 0; fi < 3; fi++) {
      const enum fy_state_format f = (enum fy_state_format)fi;
      for (int bf = 0; bf < 2; bf++) {
        struct state in = state_new(f, n, p, m, v, g);
        for (int64_t t = 1; t <= 2; t++) {
          const float gs = t == 2 ? 0.5f : 1.0f;
          struct state keep = state_copy(f, n, &in), ref = state_copy(f, n, &in);
          struct state o1 = state_copy_at(f, n, &in, true), o3 = state_copy(f, n, &in);
          state_fill(f, n, &o1, 0xa5), state_fill(f, n, &o3, 0x5a);  // (outputs: every byte written)
          CHECK_OK(bf ? fy_adamw_state_update_bf16(f, ref.p, ref.m, ref.v, ref.gw, n, r, nr, LR, B1, B2, EPS, t, gs)
                      : fy_adamw_state_update(f, ref.p, ref.m, ref.v, ref.g, n, r, nr, LR, B1, B2, EPS, t, gs));
          omp_set_num_threads(1);
          CHECK_OK(update_into(f, bf, &o1, &in, n, r, nr, t, gs));
          omp_set_num_threads(3);
          CHECK_OK(update_into(f, bf, &o3, &in, n, r, nr, t, gs));
          omp_set_num_threads(2);
          if (!bf) memcpy(o1.gw, ref.gw, (size_t)n * 2), memcpy(o3.gw, ref.gw, (size_t)n * 2);  // (not outputs)
          memcpy(o1.g, ref.g, (size_t)n * 4), memcpy(o3.g, ref.g, (size_t)n * 4);
          const bool eq = state_equal(f, n, &o1, &ref), thr = state_equal(f, n, &o3, &o1);
          const bool same_in = state_equal(f, n, &in, &keep) && !memcmp(in.g, keep.g, (size_t)n * 4);
          if ((!eq || !thr || !same_in) && bad_eq + bad_thr + bad_in < 5)
            fprintf(stderr, "  into %s %s grads n %lld step %lld: %s%s%s\n", fy_state_format_name(f),
                    bf ? "bf16" : "fp32", (long long)n, (long long)t, eq ? "" : "unlike in place; ",
                    thr ? "" : "3 threads unlike 1; ", same_in ? "" : "inputs written");
          bad_eq += !eq, bad_thr += !thr, bad_in += !same_in;
          for (int64_t i = 0; i < n; i++) moved_total += o1.p[i] != in.p[i];
          cases++;
          state_free(&in);  // the next step starts from this one's result
          in = ref;
          state_free(&keep), state_free(&o1), state_free(&o3);
        }
        state_free(&in);
      }
    }
    free(p), free(m), free(v), free(g);
  }
  fprintf(stderr, "  into: %d cases (formats x gradients x n x steps), %d weights moved\n", cases, moved_total);
  CHECKF(bad_eq == 0 && bad_thr == 0 && bad_in == 0 && moved_total > 100000,
         "into: %d unlike in place, %d unlike 1 thread, %d wrote its inputs (of %d)", bad_eq, bad_thr, bad_in, cases);
  // the refusals: nothing written
  const int64_t n = 3000;
  float *z = xmalloc((size_t)n * 4);
  struct state in = state_new(FY_STATE_Q8, n, z, z, z, z), out = state_new(FY_STATE_Q8, n, z, z, z, z);
  state_fill(FY_STATE_Q8, n, &out, 0x77);
  struct state keep = state_copy(FY_STATE_Q8, n, &out);
  struct fy_adamw_range ok[1] = {{0, n, 0}}, bad1[2] = {{0, 100, 0}, {50, 10, 0}}, bad2[1] = {{n - 5, 6, 0}};
#define INTO(W, G, GW, R, NR, T)                                                                              \
  fy_adamw_state_update_into(FY_STATE_Q8, out.p, out.m, out.v, (W), in.p, in.m, in.v, (G), (GW), n, (R), (NR), LR, \
                             B1, B2, EPS, (T), 1.0f)
  CHECK_ERR(INTO(NULL, in.g, in.gw, ok, 1, 1), FY_ERR_INVALID);    // both gradients
  CHECK_ERR(INTO(out.gw, NULL, NULL, ok, 1, 1), FY_ERR_INVALID);   // neither
  CHECK_ERR(INTO(out.gw, in.g, NULL, ok, 1, 1), FY_ERR_INVALID);   // fp32 gradients and w16_out
  CHECK_ERR(INTO(NULL, NULL, in.gw, ok, 1, 1), FY_ERR_INVALID);    // bf16 gradients, no w16_out
  CHECK_ERR(INTO(NULL, in.g, NULL, bad1, 2, 1), FY_ERR_INVALID);   // overlapping ranges
  CHECK_ERR(INTO(NULL, in.g, NULL, bad2, 1, 1), FY_ERR_INVALID);   // a range past n
  CHECK_ERR(INTO(out.gw, NULL, in.gw, ok, 1, 0), FY_ERR_INVALID);  // step 0
#undef INTO
  CHECK(state_equal(FY_STATE_Q8, n, &out, &keep));
  state_free(&in), state_free(&out), state_free(&keep);
  free(z);
}

// 100 steps of random gradients (with a heavy-tailed magnitude, so blocks hold values of several
// decades) through fp32 state and 8-bit state: the 8-bit m and v against the fp32 ones.
// Bound, per element: a store moves the unrounded new value x by at most |x| / 17 (+ roundings)
// in the normal binades and c A (A the block's new absmax; c = 2^-18 for m, 2^-33 for v) below
// them; with |x| <= (17/16) (|y| + c A), y the value read back, one store's error is at most
// d = (|y| + c A) / 16 + c A. An error already there shrinks by beta each step and the float
// roundings of the two runs add at most 2^-20 (|y| + |x32|), so B_t = beta B_(t-1) + d_t +
// 2^-20 (|y_t| + |x32_t|) bounds |y_t - x32_t| after step t (checked at every step). The RMS of
// the error relative to each element's fp32 value (m: of values at least a hundredth of their
// block's absmax) is printed and held under 1/4: each store's error is up to 1/17 of the value
// and they add up over the steps (about 0.15 here for both; a wrong code or scale gives >= 1).
static void test_drift(void) {
  const int64_t n = 64 * FY_Q8_BLOCK + 100;
  const int T = 100;
  float *p = xmalloc((size_t)n * 4), *m = xmalloc((size_t)n * 4), *v = xmalloc((size_t)n * 4), *g = xmalloc((size_t)n * 4);
  float *p8 = xmalloc((size_t)n * 4), *dm = xmalloc((size_t)n * 4), *dv = xmalloc((size_t)n * 4);
  double *bm = xmalloc((size_t)n * 8), *bv = xmalloc((size_t)n * 8);
  void *m8 = xmalloc(fy_state_moment_bytes(FY_STATE_Q8, n)), *v8 = xmalloc(fy_state_moment_bytes(FY_STATE_Q8, n));
  float *col = xmalloc((size_t)n * 4);
  for (int64_t i = 0; i < n; i++) {
    p[i] = p8[i] = check_frand(0.1f);
    col[i] = (float)pow(10.0, -3.0 * check_urand());  // each element's own gradient scale
  }
  struct fy_adamw_range r = {0, n, 0.01f};
  fy_state_encode(FY_STATE_Q8, FY_MOMENT_M, m8, m, n);
  fy_state_encode(FY_STATE_Q8, FY_MOMENT_V, v8, v, n);
  const double cm = 0x1p-18, cv = 0x1p-33;
  int bad = 0;
  double worst_m = 0, worst_v = 0;
  for (int t = 1; t <= T; t++) {
    for (int64_t i = 0; i < n; i++) g[i] = check_frand(1.0f) * col[i];
    fy_adamw_update(p, m, v, g, n, LR, B1, B2, EPS, 0.01f, t, 1.0f);
    CHECK_OK(fy_adamw_state_update(FY_STATE_Q8, p8, m8, v8, g, n, &r, 1, LR, B1, B2, EPS, t, 1.0f));
    fy_state_decode(FY_STATE_Q8, FY_MOMENT_M, dm, m8, n);
    fy_state_decode(FY_STATE_Q8, FY_MOMENT_V, dv, v8, n);
    const float *sm = (const float *)((char *)m8 + fy_q8_scales_offset(n));
    const float *sv = (const float *)((char *)v8 + fy_q8_scales_offset(n));
    for (int64_t i = 0; i < n; i++) {
      const double am = sm[i / FY_Q8_BLOCK], av = sv[i / FY_Q8_BLOCK];
      const double ym = fabs(dm[i]), yv = fabs(dv[i]);
      bm[i] = B1 * bm[i] + (ym + cm * am) / 16 + cm * am + 0x1p-20 * (ym + fabs(m[i]));
      bv[i] = B2 * bv[i] + (yv + cv * av) / 16 + cv * av + 0x1p-20 * (yv + fabs(v[i]));
      const double em = fabs((double)dm[i] - m[i]), ev = fabs((double)dv[i] - v[i]);
      bad += em > bm[i] || ev > bv[i];
      worst_m = fmax(worst_m, em / bm[i]);
      worst_v = fmax(worst_v, ev / bv[i]);
    }
  }
  const float *sm = (const float *)((char *)m8 + fy_q8_scales_offset(n));
  const float *sv = (const float *)((char *)v8 + fy_q8_scales_offset(n));
  double sq_m = 0, sq_v = 0, sa_m = 0, sa_v = 0;  // relative to the value; to the block's absmax
  int64_t cnt_m = 0;
  for (int64_t i = 0; i < n; i++) {
    const double am = ((double)dm[i] - m[i]) / sm[i / FY_Q8_BLOCK], av = ((double)dv[i] - v[i]) / sv[i / FY_Q8_BLOCK];
    sa_m += am * am, sa_v += av * av;
    if (fabs(m[i]) >= sm[i / FY_Q8_BLOCK] / 100) {
      const double e = ((double)dm[i] - m[i]) / m[i];
      sq_m += e * e, cnt_m++;
    }
    const double e = ((double)dv[i] - v[i]) / v[i];
    sq_v += e * e;
  }
  const double rms_m = sqrt(sq_m / (double)cnt_m), rms_v = sqrt(sq_v / (double)n);
  double pd = 0, pn = 0;
  for (int64_t i = 0; i < n; i++) pd += ((double)p8[i] - p[i]) * ((double)p8[i] - p[i]), pn += (double)p[i] * p[i];
  fprintf(stderr,
          "  drift after %d steps: worst |m8-m| %.3f and |v8-v| %.3f of their bounds; RMS relative error: m %.2e "
          "(%lld values >= absmax/100), v %.2e; RMS error / block absmax: m %.2e, v %.2e; weights' relative "
          "distance %.2e\n",
          T, worst_m, worst_v, rms_m, (long long)cnt_m, rms_v, sqrt(sa_m / n), sqrt(sa_v / n), sqrt(pd / pn));
  CHECKF(bad == 0, "%d element-steps drifted past the bound", bad);
  CHECKF(rms_m < 0.25 && rms_v < 0.25 && cnt_m > n / 4, "RMS relative drift m %.3e v %.3e", rms_m, rms_v);
  free(p), free(m), free(v), free(g), free(p8), free(dm), free(dv), free(m8), free(v8), free(col), free(bm), free(bv);
}

// ---- --dump DIR: the reference test's inputs and ferry's results ----

static void write_file(const char *dir, const char *name, const void *p, size_t n) {
  FILE *f = fopen(check_path(dir, name), "wb");
  if (!f || fwrite(p, 1, n, f) != n || fclose(f) != 0) {
    fprintf(stderr, "adamw_state --dump: cannot write %s/%s\n", dir, name);
    exit(1);
  }
}

static int dump(const char *dir) {
  const int64_t n = 11 * FY_Q8_BLOCK + 184;
  const int steps = 6;
  struct fy_adamw_range r[8];
  const int nr = test_ranges(n, r);
  float *p = xmalloc((size_t)n * 4), *m = xmalloc((size_t)n * 4), *v = xmalloc((size_t)n * 4);
  float *g = xmalloc((size_t)n * 4 * steps);
  for (int64_t i = 0; i < n; i++) {
    p[i] = check_frand(0.1f);
    m[i] = check_frand(0.01f) * (float)pow(10.0, -6.0 * check_urand());
    v[i] = m[i] * m[i] * 10.0f;
  }
  for (int64_t i = 0; i < n; i++) {  // a NaN-free but wide spread; block 3 holds one huge gradient
    for (int s = 0; s < steps; s++) g[s * n + i] = check_frand(1.0f) * (float)pow(10.0, -5.0 * check_urand());
  }
  g[3 * FY_Q8_BLOCK + 9] = 1e4f;
  FILE *meta = fopen(check_path(dir, "meta.txt"), "w");
  if (!meta) return 1;
  fprintf(meta, "n %lld\nsteps %d\nlr %a\nbeta1 %a\nbeta2 %a\neps %a\nblock %d\n", (long long)n, steps, LR, B1, B2,
          EPS, FY_Q8_BLOCK);
  for (int k = 0; k < nr; k++)
    fprintf(meta, "range %lld %lld %a\n", (long long)r[k].off, (long long)r[k].n, r[k].weight_decay);
  fclose(meta);
  write_file(dir, "param.bin", p, (size_t)n * 4);
  write_file(dir, "m.bin", m, (size_t)n * 4);
  write_file(dir, "v.bin", v, (size_t)n * 4);
  write_file(dir, "grads.bin", g, (size_t)n * 4 * steps);
  // The nearest-code rule on its hard cases: every magnitude, the midpoints between neighbours
  // (exact ties) and the floats beside them, both signs; each block opens with +-1 (its absmax).
  for (int w = 0; w < 2; w++) {
    const enum fy_moment mo = w ? FY_MOMENT_V : FY_MOMENT_M;
    const int K = top_of(mo);
    const int64_t cn = 6 * 256 + 1;
    float *x = xmalloc((size_t)cn * 4);
    int64_t k = 0;
    for (int i = 0; i < K; i++) {
      const float c = (float)mag_value(mo, i), mid = (float)((mag_value(mo, i) + mag_value(mo, i + 1)) / 2);
      const float s = i % 2 ? -1.0f : 1.0f, hard[4] = {(w ? 1 : s) * c, (w ? 1 : s) * mid,
                                                      (w ? 1 : -s) * nextafterf(mid, 2.0f),
                                                      (w ? 1 : s) * nextafterf(mid, -1.0f)};
      for (int j = 0; j < 4; j++) {
        if (k % FY_Q8_BLOCK == 0) {
          x[k] = w || k % 512 ? 1.0f : -1.0f;
          k++;
        }
        x[k++] = hard[j];
      }
    }
    while (k < cn) x[k++] = 0.0f;
    uint8_t *q = xmalloc(fy_state_moment_bytes(FY_STATE_Q8, cn));
    fy_state_encode(FY_STATE_Q8, mo, q, x, cn);
    write_file(dir, w ? "nearest_v_in.bin" : "nearest_m_in.bin", x, (size_t)cn * 4);
    write_file(dir, w ? "nearest_v.bin" : "nearest_m.bin", q, fy_state_moment_bytes(FY_STATE_Q8, cn));
    free(x);
    free(q);
  }
  // runs: q8 (fp32 grads), q8bf (bf16 grads in the copy), bf16 (fp32 grads), f32 (fp32 grads)
  const char *names[] = {"q8", "q8bf", "bf16", "f32"};
  const enum fy_state_format fmts[] = {FY_STATE_Q8, FY_STATE_Q8, FY_STATE_BF16, FY_STATE_F32};
  char name[64];
  for (int run = 0; run < 4; run++) {
    const enum fy_state_format f = fmts[run];
    struct state s = state_new(f, n, p, m, v, g);
    const size_t mb = fy_state_moment_bytes(f, n);
    snprintf(name, sizeof name, "%s_m0.bin", names[run]);
    write_file(dir, name, s.m, mb);
    snprintf(name, sizeof name, "%s_v0.bin", names[run]);
    write_file(dir, name, s.v, mb);
    for (int st = 1; st <= steps; st++) {
      const float gs = st % 2 ? 1.0f : 0.5f;
      const float *gt = g + (size_t)(st - 1) * n;
      fy_status rc;
      if (run == 1) {
        for (int64_t i = 0; i < n; i++) s.gw[i] = fy_f32_to_bf16(gt[i]);
        rc = fy_adamw_state_update_bf16(f, s.p, s.m, s.v, s.gw, n, r, nr, LR, B1, B2, EPS, st, gs);
      } else {
        rc = fy_adamw_state_update(f, s.p, s.m, s.v, gt, n, r, nr, LR, B1, B2, EPS, st, gs);
      }
      if (rc != FY_OK) {
        fprintf(stderr, "adamw_state --dump: %s\n", fy_error_msg());
        return 1;
      }
      snprintf(name, sizeof name, "%s_param%d.bin", names[run], st);
      write_file(dir, name, s.p, (size_t)n * 4);
      snprintf(name, sizeof name, "%s_m%d.bin", names[run], st);
      write_file(dir, name, s.m, mb);
      snprintf(name, sizeof name, "%s_v%d.bin", names[run], st);
      write_file(dir, name, s.v, mb);
      if (run == 1) {
        snprintf(name, sizeof name, "%s_gw%d.bin", names[run], st);
        write_file(dir, name, s.gw, (size_t)n * 2);
      }
    }
    state_free(&s);
  }
  free(p), free(m), free(v), free(g);
  return 0;
}

int main(int argc, char **argv) {
  if (argc == 3 && !strcmp(argv[1], "--dump")) return dump(argv[2]);
  test_codes();
  test_nearest();
  test_round_trip();
  test_update();
  test_into();
  test_drift();
  return check_summary("adamw_state");
}
