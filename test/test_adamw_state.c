// AdamW with bf16 and 8-bit state (ops/cpu/adamw_state.c): the codes, the nearest-code rule
// against a brute-force search, the round trip's error bound, zero, NaN and outlier blocks, short
// last blocks, the fused update against decode + fy_adamw_update + encode, ranges with gaps and
// different decay, the thread count, and the drift of 8-bit m and v from fp32 state over 100 steps.
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

// Half the largest gap between neighbouring magnitudes of a code (the round trip's bound / absmax).
static double half_gap(enum fy_moment w) {
  const float *c = fy_q8_code_values(w);
  const int K = w == FY_MOMENT_M ? 127 : 255;
  double g = 0;
  for (int i = 1; i <= K; i++) g = fmax(g, (double)c[i] - (double)c[i - 1]);
  return g / 2;
}

// The code tables from their definition (ops/ops.h), computed here again.
static void test_codes(void) {
  static const int km[] = {49, 24, 14, 10, 10, 10, 10};
  static const int kv[] = {70, 38, 24, 17, 14, 12, 10, 10, 10, 10, 10, 10, 10, 10};
  static const double dec[] = {1e0, 1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-7, 1e-8, 1e-9, 1e-10, 1e-11, 1e-12, 1e-13};
  for (int w = 0; w < 2; w++) {
    const int *k = w ? kv : km, D = w ? 14 : 7;
    float want[256];
    int i = 0;
    want[0] = 0;
    for (int d = D - 1; d >= 0; d--)
      for (int j = 1; j <= k[d]; j++) want[++i] = (float)((1.0 + 9.0 * j / k[d]) / 10.0 * dec[d]);
    const float *c = fy_q8_code_values(w ? FY_MOMENT_V : FY_MOMENT_M);
    int bad = 0;
    for (int j = 0; j <= i; j++) bad += c[j] != want[j];
    if (!w) {
      for (int j = 1; j < 128; j++) bad += c[(uint8_t)(int8_t)-j] != -want[j];
      bad += c[128] != -1.0f;
    }
    CHECKF(bad == 0 && i == (w ? 255 : 127) && want[i] == 1.0f, "%s code: %d values differ", w ? "v" : "m", bad);
  }
  fprintf(stderr, "  half gaps: m %.5f v %.5f\n", half_gap(FY_MOMENT_M), half_gap(FY_MOMENT_V));
  CHECK(fabs(half_gap(FY_MOMENT_M) - 0.9 / 49 / 2) < 1e-6 && fabs(half_gap(FY_MOMENT_V) - 0.9 / 70 / 2) < 1e-6);
  CHECK(fy_state_moment_bytes(FY_STATE_F32, 1000) == 4000 && fy_state_moment_bytes(FY_STATE_BF16, 1000) == 2000);
  CHECK(fy_q8_blocks(1000) == 4 && fy_q8_scales_offset(1000) == 1024 && fy_state_moment_bytes(FY_STATE_Q8, 1000) == 1040);
  CHECK(fy_state_bytes(FY_STATE_Q8, 256) == 2 * (256 + 4) && fy_state_moment_bytes(FY_STATE_Q8, 0) == 0);
  enum fy_state_format f = FY_STATE_F32;
  CHECK(fy_state_format_from_name("8bit", &f) && f == FY_STATE_Q8 && !strcmp(fy_state_format_name(f), "8bit"));
  CHECK(fy_state_format_from_name("bf16", &f) && f == FY_STATE_BF16 && !fy_state_format_from_name("int8", &f));
}

// The code of a (in [0, 1], absmax 1) by brute force: the smallest |a - c| over all magnitudes,
// in double (exact for these), ties to the smaller magnitude; v: a > 0 never gives 0.
static int brute(enum fy_moment w, float a) {
  const float *c = fy_q8_code_values(w);
  const int K = w == FY_MOMENT_M ? 127 : 255;
  int best = 0;
  for (int i = 1; i <= K; i++)
    if (fabs((double)a - c[i]) < fabs((double)a - c[best])) best = i;
  if (w == FY_MOMENT_V && best == 0 && a > 0) best = 1;
  return best;
}

// The nearest-code rule at every magnitude, its neighbouring floats, the midpoints and the floats
// beside them, and random values (uniform and log-uniform over 16 decades), both signs for m.
static void test_nearest(void) {
  enum { CAP = 200000 };
  float *a = xmalloc(CAP * sizeof(float));
  for (int w = 0; w < 2; w++) {
    const enum fy_moment mo = w ? FY_MOMENT_V : FY_MOMENT_M;
    const float *c = fy_q8_code_values(mo);
    const int K = w ? 255 : 127;
    int n = 0;
    for (int i = 0; i <= K; i++) {
      float x = c[i], y = c[i];
      for (int s = 0; s < 4; s++) {
        a[n++] = x, a[n++] = y;
        x = nextafterf(x, 2.0f), y = nextafterf(y, -1.0f);
      }
      if (i < K) {
        float mid = (float)(((double)c[i] + c[i + 1]) / 2);
        a[n++] = mid, a[n++] = nextafterf(mid, 2.0f), a[n++] = nextafterf(mid, -1.0f);
      }
    }
    while (n < CAP / 2) a[n++] = (float)check_urand();
    while (n < CAP) a[n++] = (float)pow(10.0, -16.0 * check_urand());
    for (int i = 0; i < n; i++) a[i] = fminf(fmaxf(a[i], 0.0f), 1.0f);
    // blocks of [1 (the absmax, so a / absmax == a), 255 test values], m's also negated
    const int nb = (n + 254) / 255;
    const int64_t len = (int64_t)nb * FY_Q8_BLOCK;
    float *x = xmalloc((size_t)len * 4);
    uint8_t *q = xmalloc(fy_state_moment_bytes(FY_STATE_Q8, len));
    int bad = 0, ties = 0;
    for (int i = 0; i < n; i++) {
      int k = brute(mo, a[i]);
      ties += k < K && (double)a[i] - c[k] == (double)c[k + 1] - a[i];
    }
    for (int sign = 0; sign < (w ? 1 : 2); sign++) {
      for (int b = 0; b < nb; b++) {
        x[(int64_t)b * FY_Q8_BLOCK] = 1.0f;
        for (int j = 1; j < FY_Q8_BLOCK; j++) {
          int k = b * 255 + j - 1;
          float v = k < n ? a[k] : 0.0f;
          x[(int64_t)b * FY_Q8_BLOCK + j] = sign ? -v : v;
        }
      }
      fy_state_encode(FY_STATE_Q8, mo, q, x, len);
      for (int64_t i = 0; i < len; i++) {
        int want = brute(mo, fabsf(x[i]));
        if (x[i] < 0) want = -want;
        int got = w ? q[i] : (int8_t)q[i];
        if (got != want && bad++ < 5)
          fprintf(stderr, "  %s: %.9g -> code %d, nearest %d\n", w ? "v" : "m", x[i], got, want);
      }
    }
    fprintf(stderr, "  %s nearest: %d values, %d exact ties among them\n", w ? "v" : "m", n, ties);
    CHECKF(bad == 0 && ties > 10, "%s: %d values away from the nearest code (%d ties)", w ? "v" : "m", bad, ties);
    free(x);
    free(q);
  }
  free(a);
}

// Round trip: |x - decode(encode(x))| <= absmax * (half gap + 2^-23) (the division's and the
// product's roundings), on blocks of several kinds; zero, NaN and huge-outlier blocks; n not a
// multiple of the block.
static void test_round_trip(void) {
  const int64_t n = 7 * FY_Q8_BLOCK + 77;
  float *x = xmalloc((size_t)n * 4), *y = xmalloc((size_t)n * 4);
  uint8_t *q = xmalloc(fy_state_moment_bytes(FY_STATE_Q8, n));
  for (int w = 0; w < 2; w++) {
    const enum fy_moment mo = w ? FY_MOMENT_V : FY_MOMENT_M;
    for (int64_t i = 0; i < n; i++) {
      const int64_t b = i / FY_Q8_BLOCK;
      float v = b == 0   ? check_frand(1.0f)                                        // uniform
                : b == 1 ? (float)pow(10.0, -12.0 * check_urand()) * (check_urand() < 0.5 ? -1 : 1)  // 12 decades
                : b == 2 ? 0.0f                                                      // zeros
                : b == 3 ? (i % FY_Q8_BLOCK == 17 ? 1e30f : check_frand(1.0f))      // one huge value
                : b == 4 ? (i % FY_Q8_BLOCK == 5 ? NAN : check_frand(1.0f))         // a NaN
                : b == 5 ? check_frand(1e-30f)                                       // tiny (subnormal ratios)
                         : check_frand(3.0f);                                        // and the short last block
      y[i] = v;
      x[i] = w ? fabsf(v) : v;
    }
    fy_state_encode(FY_STATE_Q8, mo, q, x, n);
    fy_state_decode(FY_STATE_Q8, mo, y, q, n);
    const float *scale = (const float *)(q + fy_q8_scales_offset(n));
    const double h = half_gap(mo) + 0x1p-23;
    double worst = 0;
    int bad = 0;
    for (int64_t i = 0; i < n; i++) {
      const int64_t b = i / FY_Q8_BLOCK;
      if (b == 4) {
        bad += !isnan(y[i]);
        continue;
      }
      double amax = 0;
      for (int64_t j = b * FY_Q8_BLOCK; j < (b + 1) * FY_Q8_BLOCK && j < n; j++) amax = fmax(amax, fabs(x[j]));
      bad += scale[b] != (float)amax;
      double e = fabs((double)x[i] - y[i]);
      if (amax > 0) worst = fmax(worst, e / amax);
      bad += e > h * amax;
      if (w && x[i] > 0) bad += !(y[i] > 0);  // a positive v never reads back as 0
    }
    // the huge value reads back exactly; its small neighbours as 0 (m) or the smallest code (v)
    bad += y[3 * FY_Q8_BLOCK + 17] != 1e30f;
    bad += w ? q[3 * FY_Q8_BLOCK + 18] != 1 : q[3 * FY_Q8_BLOCK + 18] != 0;
    for (int64_t i = 2 * FY_Q8_BLOCK; i < 3 * FY_Q8_BLOCK; i++) bad += q[i] != 0 || y[i] != 0.0f;
    bad += !isnan(scale[4]);
    fprintf(stderr, "  %s round trip: worst error %.5f of absmax (bound %.5f)\n", w ? "v" : "m", worst, h);
    CHECKF(bad == 0, "%s round trip: %d bad values", w ? "v" : "m", bad);
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
// with 1 and 2 threads the same bytes.
static void test_update(void) {
  const int64_t n = 300000 + 77;  // above the parallel threshold; the last block short
  float *p = xmalloc((size_t)n * 4), *m = xmalloc((size_t)n * 4), *v = xmalloc((size_t)n * 4), *g = xmalloc((size_t)n * 4);
  for (int64_t i = 0; i < n; i++) {
    p[i] = check_frand(0.1f);
    g[i] = check_frand(1.0f) * (float)pow(10.0, -4.0 * check_urand());
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
        omp_set_num_threads(2);
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
             "%s %s: %d steps unlike decode+update+encode, %d unlike 1 thread, %d padding touched",
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

// 100 steps of random gradients (with a heavy-tailed magnitude, so blocks hold values of several
// decades) through fp32 state and 8-bit state: the 8-bit m and v against the fp32 ones.
// Bound: each step's store moves a value by at most h * A (h the half gap, A the block's new
// absmax; plus float rounding), and an error already there shrinks by beta each step, so after t
// steps |m8 - m32| <= h * Amax * (1 - b1^t) / (1 - b1) with Amax the largest scale the element's
// block had (the same for v with b2): 10 h Amax for m, 95 h Amax for v at t = 100, b2 = 0.999. The
// roundings' errors do not all push one way, so the typical error is far smaller: the RMS over
// all elements is also printed and held under a tenth of the worst-case bound's scale.
static void test_drift(void) {
  const int64_t n = 64 * FY_Q8_BLOCK + 100;
  const int T = 100;
  float *p = xmalloc((size_t)n * 4), *m = xmalloc((size_t)n * 4), *v = xmalloc((size_t)n * 4), *g = xmalloc((size_t)n * 4);
  float *p8 = xmalloc((size_t)n * 4), *dm = xmalloc((size_t)n * 4), *dv = xmalloc((size_t)n * 4);
  void *m8 = xmalloc(fy_state_moment_bytes(FY_STATE_Q8, n)), *v8 = xmalloc(fy_state_moment_bytes(FY_STATE_Q8, n));
  float *col = xmalloc((size_t)n * 4);
  const int64_t nb = fy_q8_blocks(n);
  double *amax_m = xmalloc((size_t)nb * 8), *amax_v = xmalloc((size_t)nb * 8);
  for (int64_t i = 0; i < n; i++) {
    p[i] = p8[i] = check_frand(0.1f);
    col[i] = (float)pow(10.0, -3.0 * check_urand());  // each element's own gradient scale
  }
  struct fy_adamw_range r = {0, n, 0.01f};
  fy_state_encode(FY_STATE_Q8, FY_MOMENT_M, m8, m, n);
  fy_state_encode(FY_STATE_Q8, FY_MOMENT_V, v8, v, n);
  for (int t = 1; t <= T; t++) {
    for (int64_t i = 0; i < n; i++) g[i] = check_frand(1.0f) * col[i];
    fy_adamw_update(p, m, v, g, n, LR, B1, B2, EPS, 0.01f, t, 1.0f);
    CHECK_OK(fy_adamw_state_update(FY_STATE_Q8, p8, m8, v8, g, n, &r, 1, LR, B1, B2, EPS, t, 1.0f));
    const float *sm = (const float *)((char *)m8 + fy_q8_scales_offset(n));
    const float *sv = (const float *)((char *)v8 + fy_q8_scales_offset(n));
    for (int64_t b = 0; b < nb; b++) amax_m[b] = fmax(amax_m[b], sm[b]), amax_v[b] = fmax(amax_v[b], sv[b]);
  }
  fy_state_decode(FY_STATE_Q8, FY_MOMENT_M, dm, m8, n);
  fy_state_decode(FY_STATE_Q8, FY_MOMENT_V, dv, v8, n);
  const double fm = (1 - pow(B1, T)) / (1 - B1), fv = (1 - pow(B2, T)) / (1 - B2);
  const double hm = half_gap(FY_MOMENT_M) + 0x1p-22, hv = half_gap(FY_MOMENT_V) + 0x1p-22;
  int bad = 0;
  double worst_m = 0, worst_v = 0, sq_m = 0, sq_v = 0, ref_m = 0, ref_v = 0;
  for (int64_t i = 0; i < n; i++) {
    const int64_t b = i / FY_Q8_BLOCK;
    const double em = fabs((double)dm[i] - m[i]), ev = fabs((double)dv[i] - v[i]);
    bad += em > hm * amax_m[b] * fm || ev > hv * amax_v[b] * fv;
    worst_m = fmax(worst_m, em / (amax_m[b] * fm * hm));
    worst_v = fmax(worst_v, ev / (amax_v[b] * fv * hv));
    sq_m += (em / amax_m[b]) * (em / amax_m[b]);
    sq_v += (ev / amax_v[b]) * (ev / amax_v[b]);
    ref_m += (double)m[i] * m[i], ref_v += (double)v[i] * v[i];
  }
  const double rms_m = sqrt(sq_m / n), rms_v = sqrt(sq_v / n);
  double pd = 0, pn = 0;
  for (int64_t i = 0; i < n; i++) pd += ((double)p8[i] - p[i]) * ((double)p8[i] - p[i]), pn += (double)(p[i] - 0) * p[i];
  fprintf(stderr,
          "  drift after %d steps: worst |m8-m| %.3f and |v8-v| %.3f of their bounds; RMS error / block absmax: m "
          "%.2e (h %.2e), v %.2e (h %.2e); weights' relative distance %.2e\n",
          T, worst_m, worst_v, rms_m, hm, rms_v, hv, sqrt(pd / pn));
  CHECKF(bad == 0, "%d elements drifted past the bound", bad);
  CHECKF(rms_m < hm * fm / 10 && rms_v < hv * fv / 10, "RMS drift m %.3e v %.3e", rms_m, rms_v);
  free(p), free(m), free(v), free(g), free(p8), free(dm), free(dv), free(m8), free(v8), free(col), free(amax_m),
      free(amax_v);
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
  // (exact ties where the float holds them) and the floats beside them, both signs; absmax 1.
  for (int w = 0; w < 2; w++) {
    const enum fy_moment mo = w ? FY_MOMENT_V : FY_MOMENT_M;
    const float *c = fy_q8_code_values(mo);
    const int K = w ? 255 : 127;
    const int64_t cn = 6 * 256 + 1;
    float *x = xmalloc((size_t)cn * 4);
    int64_t k = 0;
    x[k++] = w ? 1.0f : -1.0f;
    for (int i = 0; i < K; i++) {
      const float mid = (float)(((double)c[i] + c[i + 1]) / 2), s = i % 2 ? -1.0f : 1.0f;
      x[k++] = (w ? 1 : s) * c[i];
      x[k++] = (w ? 1 : s) * mid;
      x[k++] = (w ? 1 : -s) * nextafterf(mid, 2.0f);
      x[k++] = (w ? 1 : s) * nextafterf(mid, -1.0f);
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
  test_drift();
  return check_summary("adamw_state");
}
