// Tests of the CPU kernels (ops/ops.h). For every op:
// - forward against a naive double-precision reference written here, on random inputs of odd
//   sizes (normalised error);
// - gradients: the backward kernel against central finite differences, in double, of that
//   reference's scalar loss L = sum(out * R) for a random R (the reference is itself checked
//   against the forward kernel, so the chain ties the backward kernel to the forward kernel); for
//   attention also against finite differences of the fp32 forward kernel itself;
// - accumulation: gradients start from random values, and a second backward call adds the same
//   gradient again;
// - the op's special rules (attention masks, ignored targets, in-place backward, NULL pointers,
//   matmul transposes/strides/alpha/beta, AdamW against a transcription of torch.optim.AdamW);
// - determinism: the same call twice gives the same bits.
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "core/dtype.h"
#include "ops/dropout.h"
#include "core/graph.h"
#include "ops/ops.h"
#include "test/check.h"

// ---- helpers ----

static void fill(float *x, int64_t n, float scale) {
  for (int64_t i = 0; i < n; i++) x[i] = check_frand(scale);
}
static double *dnew(int64_t n) {
  double *p = calloc((size_t)(n > 0 ? n : 1), sizeof(double));
  if (!p) abort();
  return p;
}
static float *frand_new(int64_t n, float scale) {
  float *p = check_fnew(n);
  fill(p, n, scale);
  return p;
}
static float *fdup(const float *x, int64_t n) {
  float *p = check_fnew(n);
  memcpy(p, x, (size_t)n * sizeof(float));
  return p;
}
static double *to_d(const float *x, int64_t n) {
  double *p = dnew(n);
  for (int64_t i = 0; i < n; i++) p[i] = x[i];
  return p;
}
// Normalised error of a float result against a double reference.
static double err_d(const float *got, const double *want, int64_t n) {
  float *w = check_fnew(n);
  for (int64_t i = 0; i < n; i++) w[i] = (float)want[i];
  double e = check_rel_err(got, w, n);
  free(w);
  return e;
}
// Normalised error of (got - base) against a double reference: an accumulated gradient.
static double err_acc(const float *got, const float *base, const double *want, int64_t n) {
  float *d = check_fnew(n);
  for (int64_t i = 0; i < n; i++) d[i] = got[i] - base[i];
  double e = err_d(d, want, n);
  free(d);
  return e;
}
static double dot_fd(const float *a, const float *r, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; i++) s += (double)a[i] * r[i];
  return s;
}
static double dot_dd(const double *a, const float *r, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; i++) s += a[i] * r[i];
  return s;
}
static bool same_bits(const float *a, const float *b, int64_t n) {
  return memcmp(a, b, (size_t)n * sizeof(float)) == 0;
}

// Central differences of a double loss f(ctx) with respect to every element of x.
typedef double (*loss_fn)(void *ctx);
static void fd_grad(double *g, double *x, int64_t n, loss_fn f, void *ctx, double h) {
  for (int64_t i = 0; i < n; i++) {
    double xi = x[i];
    x[i] = xi + h;
    double lp = f(ctx);
    x[i] = xi - h;
    double lm = f(ctx);
    x[i] = xi;
    g[i] = (lp - lm) / (2 * h);
  }
}
// The same on float inputs (fd of the fp32 kernels themselves; h must be large).
static void fd_grad_f(double *g, float *x, int64_t n, loss_fn f, void *ctx, float h) {
  for (int64_t i = 0; i < n; i++) {
    float xi = x[i];
    x[i] = xi + h;
    double lp = f(ctx);
    x[i] = xi - h;
    double lm = f(ctx);
    x[i] = xi;
    g[i] = (lp - lm) / (2.0 * h);
  }
}

#define FWD_TOL 1e-5
#define GRAD_TOL 1e-4  // fp32 backward vs an (almost exact) double fd estimate
#define FD_H 1e-6

// ---- matmul ----

// c = alpha * op(a) @ op(b) + beta * c on strided batches, in double.
static void matmul_ref(double *c, const float *a, const float *b, int64_t batch, int64_t M,
                       int64_t N, int64_t K, bool ta, bool tb, double alpha, double beta,
                       int64_t lda, int64_t ldb, int64_t ldc, int64_t sa, int64_t sb, int64_t sc) {
  for (int64_t n = 0; n < batch; n++)
    for (int64_t i = 0; i < M; i++)
      for (int64_t j = 0; j < N; j++) {
        double s = 0;
        for (int64_t k = 0; k < K; k++) {
          double av = ta ? a[n * sa + k * lda + i] : a[n * sa + i * lda + k];
          double bv = tb ? b[n * sb + j * ldb + k] : b[n * sb + k * ldb + j];
          s += av * bv;
        }
        double *cv = &c[n * sc + i * ldc + j];
        *cv = alpha * s + (beta == 0 ? 0 : beta * *cv);
      }
}

static void test_matmul(void) {
  // Packed, every (ta, tb), beta 0 and 1, alpha 1 and not; a small and a blocked size, and a
  // reduction long against the output (matmul.c's other implementation).
  const int64_t sizes[3][3] = {{13, 11, 7}, {131, 97, 203}, {9, 12, 1537}};
  for (int sz = 0; sz < 3; sz++)
    for (int ta = 0; ta < 2; ta++)
      for (int tb = 0; tb < 2; tb++)
        for (int beta = 0; beta < 2; beta++)
          for (int al = 0; al < 2; al++) {
            int64_t M = sizes[sz][0], N = sizes[sz][1], K = sizes[sz][2];
            float alpha = al ? -0.37f : 1.0f;
            float *a = frand_new(M * K, 1), *b = frand_new(K * N, 1), *c = frand_new(M * N, 1);
            if (!beta)
              for (int64_t i = 0; i < M * N; i++) c[i] = NAN;  // beta = 0 must not read c
            double *ref = to_d(c, M * N);
            CHECK_OK(fy_matmul(c, a, b, M, N, K, ta, tb, alpha, (float)beta));
            matmul_ref(ref, a, b, 1, M, N, K, ta, tb, alpha, beta, ta ? M : K, tb ? K : N, N, 0,
                       0, 0);
            double e = err_d(c, ref, M * N);
            CHECKF(e < FWD_TOL, "matmul M=%lld N=%lld K=%lld ta=%d tb=%d beta=%d alpha=%g: err %g",
                   (long long)M, (long long)N, (long long)K, ta, tb, beta, alpha, e);
            free(a), free(b), free(c), free(ref);
          }

  // Batched with row strides larger than the rows and gaps between matrices; the gaps in c must
  // stay untouched.
  for (int ta = 0; ta < 2; ta++)
    for (int tb = 0; tb < 2; tb++)
      for (int beta = 0; beta < 2; beta++) {
        int64_t batch = 3, M = 5, N = 6, K = 9;
        int64_t lda = (ta ? M : K) + 3, ldb = (tb ? K : N) + 2, ldc = N + 1;
        int64_t sa = (ta ? K : M) * lda + 7, sb = (tb ? N : K) * ldb + 5, sc = M * ldc + 4;
        float *a = frand_new(batch * sa, 1), *b = frand_new(batch * sb, 1);
        float *c = check_fnew(batch * sc);
        for (int64_t i = 0; i < batch * sc; i++) c[i] = 12345.0f;
        for (int64_t n = 0; n < batch; n++)
          for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < N; j++) c[n * sc + i * ldc + j] = check_frand(1);
        double *ref = to_d(c, batch * sc);
        CHECK_OK(fy_matmul_batched(c, a, b, batch, M, N, K, ta, tb, 0.5f, (float)beta, lda, ldb,
                                   ldc, sa, sb, sc));
        matmul_ref(ref, a, b, batch, M, N, K, ta, tb, 0.5, beta, lda, ldb, ldc, sa, sb, sc);
        double e = err_d(c, ref, batch * sc);  // gaps: 12345 on both sides
        CHECKF(e < FWD_TOL, "batched ta=%d tb=%d beta=%d: err %g", ta, tb, beta, e);
        int64_t gaps_ok = 1;
        for (int64_t n = 0; n < batch; n++)
          for (int64_t i = 0; i < M * ldc + 4 && n * sc + i < batch * sc; i++)
            if (i % ldc >= N || i >= M * ldc) gaps_ok &= c[n * sc + i] == 12345.0f;
        CHECKF(gaps_ok, "batched ta=%d tb=%d: wrote outside the matrices", ta, tb);
        free(a), free(b), free(c), free(ref);
      }

  // Batched with 0 strides and leading dimensions: packed.
  {
    int64_t batch = 4, M = 7, N = 3, K = 5;
    float *a = frand_new(batch * M * K, 1), *b = frand_new(batch * K * N, 1);
    float *c = frand_new(batch * M * N, 1);
    double *ref = to_d(c, batch * M * N);
    CHECK_OK(fy_matmul_batched(c, a, b, batch, M, N, K, false, true, 1, 1, 0, 0, 0, 0, 0, 0));
    matmul_ref(ref, a, b, batch, M, N, K, false, true, 1, 1, K, K, N, M * K, N * K, M * N);
    CHECKF(err_d(c, ref, batch * M * N) < FWD_TOL, "packed batched");
    free(a), free(b), free(c), free(ref);
  }

  // K = 0: an empty sum.
  {
    float a[1] = {0}, b[1] = {0}, c[6] = {1, 2, 3, 4, 5, 6};
    CHECK_OK(fy_matmul(c, a, b, 2, 3, 0, false, false, 1, 1));
    CHECK(c[0] == 1 && c[5] == 6);
    CHECK_OK(fy_matmul(c, a, b, 2, 3, 0, false, false, 1, 0));
    CHECK(c[0] == 0 && c[5] == 0);
  }
  // Bad arguments are errors, not crashes.
  {
    float a[4] = {0}, b[4] = {0}, c[4] = {0};
    CHECK_ERR(fy_matmul(c, a, b, -1, 2, 2, false, false, 1, 0), FY_ERR_INVALID);
    CHECK_ERR(fy_matmul_batched(c, a, b, 1, 2, 2, 2, false, false, 1, 0, 2, 2, 1, 0, 0, 0),
              FY_ERR_INVALID);
  }
  // Same problem twice (the cached primitive) gives the same bits.
  {
    int64_t M = 64, N = 48, K = 80;
    float *a = frand_new(M * K, 1), *b = frand_new(N * K, 1);
    float *c1 = check_fnew(M * N), *c2 = check_fnew(M * N);
    CHECK_OK(fy_matmul(c1, a, b, M, N, K, false, true, 1, 0));
    CHECK_OK(fy_matmul(c2, a, b, M, N, K, false, true, 1, 0));
    CHECK(same_bits(c1, c2, M * N));
    free(a), free(b), free(c1), free(c2);
  }
}

// Products of bf16 values (a bf16 model on the CPU): against the double product of the same
// values; bias, beta 0 and 1, every layout, a long reduction; the linear kernels' bf16 path against
// their fp32 one. With AMX (or AMD's AVX512-BF16) the products run in bf16 (fp32 accumulation in
// another order), without them they are fy_matmul's.
static void round_bf16(float *x, int64_t n) {
  for (int64_t i = 0; i < n; i++) x[i] = fy_bf16_to_f32(fy_f32_to_bf16(x[i]));
}

static void test_matmul16(void) {
  printf("bf16 products in hardware: %s\n", fy_matmul_bf16_native() ? "yes" : "no (fp32 products)");
  const int64_t sizes[3][3] = {{13, 11, 7}, {131, 97, 203}, {9, 12, 1537}};
  for (int sz = 0; sz < 3; sz++)
    for (int ta = 0; ta < 2; ta++)
      for (int tb = 0; tb < 2; tb++)
        for (int beta = 0; beta < 2; beta++) {
          int64_t M = sizes[sz][0], N = sizes[sz][1], K = sizes[sz][2];
          float *a = frand_new(M * K, 1), *b = frand_new(K * N, 1), *c = frand_new(M * N, 1);
          float *bias = frand_new(N, 1);
          round_bf16(a, M * K), round_bf16(b, K * N);
          if (!beta)
            for (int64_t i = 0; i < M * N; i++) c[i] = NAN;  // beta = 0 must not read c
          double *ref = to_d(c, M * N);
          const bool with_bias = (ta + tb + beta) % 2;
          CHECK_OK(fy_matmul16(c, a, b, with_bias ? bias : NULL, M, N, K, ta, tb, (float)beta));
          matmul_ref(ref, a, b, 1, M, N, K, ta, tb, 1.0, beta, ta ? M : K, tb ? K : N, N, 0, 0, 0);
          if (with_bias)
            for (int64_t i = 0; i < M * N; i++) ref[i] += bias[i % N];
          double e = err_d(c, ref, M * N);
          CHECKF(e < FWD_TOL, "matmul16 M=%lld N=%lld K=%lld ta=%d tb=%d beta=%d bias=%d: err %g", (long long)M,
                 (long long)N, (long long)K, ta, tb, beta, with_bias, e);
          free(a), free(b), free(c), free(bias), free(ref);
        }
  // The linear kernels: forward, input and parameter gradients in bf16 against fp32 (the same values).
  const int64_t BT = 37, C = 48, OC = 72;
  float *inp = frand_new(BT * C, 1), *w = frand_new(OC * C, 1), *bias = frand_new(OC, 1), *dout = frand_new(BT * OC, 1);
  round_bf16(inp, BT * C), round_bf16(w, OC * C), round_bf16(dout, BT * OC);
  float *o32 = check_fnew(BT * OC), *o16 = check_fnew(BT * OC);
  float *di32 = frand_new(BT * C, 1), *dw32 = frand_new(OC * C, 1), *db32 = frand_new(OC, 1);
  float *di16 = check_fnew(BT * C), *dw16 = check_fnew(OC * C), *db16 = check_fnew(OC);
  memcpy(di16, di32, (size_t)(BT * C) * 4), memcpy(dw16, dw32, (size_t)(OC * C) * 4), memcpy(db16, db32, (size_t)OC * 4);
  CHECK_OK(fy_linear_forward(o32, inp, w, bias, BT, C, OC, false));
  CHECK_OK(fy_linear_forward(o16, inp, w, bias, BT, C, OC, true));
  CHECKF(check_rel_err(o16, o32, BT * OC) < FWD_TOL, "linear forward bf16: err %g", check_rel_err(o16, o32, BT * OC));
  CHECK_OK(fy_linear_backward(di32, dw32, db32, dout, inp, w, BT, C, OC, false));
  CHECK_OK(fy_linear_backward(di16, dw16, db16, dout, inp, w, BT, C, OC, true));
  CHECKF(check_rel_err(di16, di32, BT * C) < FWD_TOL, "linear dinp bf16: err %g", check_rel_err(di16, di32, BT * C));
  CHECKF(check_rel_err(dw16, dw32, OC * C) < FWD_TOL, "linear dweight bf16: err %g", check_rel_err(dw16, dw32, OC * C));
  CHECK(same_bits(db16, db32, OC));  // the bias gradient is a sum of dout, whatever the products
  CHECK_OK(fy_linear_backward_params(dw32, NULL, dout, inp, BT, C, OC, false, false));
  CHECK_OK(fy_linear_backward_params(dw16, NULL, dout, inp, BT, C, OC, false, true));
  CHECKF(check_rel_err(dw16, dw32, OC * C) < FWD_TOL, "linear dweight (written) bf16: err %g", check_rel_err(dw16, dw32, OC * C));
  free(inp), free(w), free(bias), free(dout), free(o32), free(o16);
  free(di32), free(dw32), free(db32), free(di16), free(dw16), free(db16);
}

// ---- embedding ----

struct emb_ctx {
  const int32_t *ids;
  double *table;
  const float *R;
  int64_t BT, C;
};
static void embedding_ref(double *out, const int32_t *ids, const double *table, int64_t BT,
                          int64_t C) {
  for (int64_t i = 0; i < BT; i++)
    for (int64_t c = 0; c < C; c++) out[i * C + c] = table[ids[i] * C + c];
}
static double emb_loss(void *p) {
  struct emb_ctx *x = p;
  double *out = dnew(x->BT * x->C);
  embedding_ref(out, x->ids, x->table, x->BT, x->C);
  double L = dot_dd(out, x->R, x->BT * x->C);
  free(out);
  return L;
}

static void test_embedding(void) {
  const int64_t BT = 21, C = 20, V = 37;
  int32_t ids[21];
  // Few distinct ids, so rows repeat and the scatter-add must sum them.
  for (int64_t i = 0; i < BT; i++) ids[i] = (int32_t)(check_urand() * 6) * 5 + 1;
  ids[BT - 1] = (int32_t)V - 1;
  float *table = frand_new(V * C, 1), *out = check_fnew(BT * C), *R = frand_new(BT * C, 1);
  double *tab_d = to_d(table, V * C), *ref = dnew(BT * C);
  fy_embedding_forward(out, ids, table, BT, C);
  embedding_ref(ref, ids, tab_d, BT, C);
  CHECK(err_d(out, ref, BT * C) == 0);

  float *dtable = frand_new(V * C, 1), *dt0 = fdup(dtable, V * C);
  fy_embedding_backward(dtable, R, ids, BT, C, V);
  struct emb_ctx ctx = {ids, tab_d, R, BT, C};
  double *g = dnew(V * C);
  fd_grad(g, tab_d, V * C, emb_loss, &ctx, FD_H);
  double e = err_acc(dtable, dt0, g, V * C);
  CHECKF(e < GRAD_TOL, "embedding dtable err %g", e);
  fy_embedding_backward(dtable, R, ids, BT, C, V);
  for (int64_t i = 0; i < V * C; i++) g[i] *= 2;
  e = err_acc(dtable, dt0, g, V * C);
  CHECKF(e < GRAD_TOL, "embedding accumulate err %g", e);

  // Determinism and thread-count independence on a larger, heavily repeated problem.
  {
    int64_t BT2 = 4096, C2 = 200, V2 = 50;
    int32_t *id2 = malloc(BT2 * sizeof(int32_t));
    for (int64_t i = 0; i < BT2; i++) id2[i] = (int32_t)(check_urand() * V2);
    float *d2 = frand_new(BT2 * C2, 1), *t1 = check_fnew(V2 * C2), *t2 = check_fnew(V2 * C2);
    fy_embedding_backward(t1, d2, id2, BT2, C2, V2);
    int nt = omp_get_max_threads();
    omp_set_num_threads(1);
    fy_embedding_backward(t2, d2, id2, BT2, C2, V2);
    omp_set_num_threads(nt);
    CHECK(same_bits(t1, t2, V2 * C2));
    free(id2), free(d2), free(t1), free(t2);
  }
  free(table), free(out), free(R), free(tab_d), free(ref), free(dtable), free(dt0), free(g);
}

// ---- layernorm ----

struct ln_ctx {
  double *inp, *w, *b;  // w, b may be NULL
  const float *R;
  int64_t BT, C;
  double eps;
};
static void layernorm_ref(double *out, double *mean, double *rstd, const double *inp,
                          const double *w, const double *b, int64_t BT, int64_t C, double eps) {
  for (int64_t i = 0; i < BT; i++) {
    const double *x = inp + i * C;
    double m = 0, v = 0;
    for (int64_t c = 0; c < C; c++) m += x[c];
    m /= C;
    for (int64_t c = 0; c < C; c++) v += (x[c] - m) * (x[c] - m);
    v /= C;  // biased, as nn.LayerNorm
    double r = 1 / sqrt(v + eps);
    for (int64_t c = 0; c < C; c++)
      out[i * C + c] = (x[c] - m) * r * (w ? w[c] : 1) + (b ? b[c] : 0);
    if (mean) mean[i] = m;
    if (rstd) rstd[i] = r;
  }
}
static double ln_loss(void *p) {
  struct ln_ctx *x = p;
  double *out = dnew(x->BT * x->C);
  layernorm_ref(out, NULL, NULL, x->inp, x->w, x->b, x->BT, x->C, x->eps);
  double L = dot_dd(out, x->R, x->BT * x->C);
  free(out);
  return L;
}

static void test_layernorm(void) {
  const int64_t BT = 21, C = 20;
  const float eps = 1e-5f;
  for (int affine = 0; affine < 2; affine++) {
    float *inp = frand_new(BT * C, 2), *w = affine ? frand_new(C, 1) : NULL;
    float *b = affine ? frand_new(C, 1) : NULL;
    for (int64_t i = 0; i < BT * C; i++) inp[i] += 0.5f;  // a non-zero mean
    float *out = check_fnew(BT * C), *mean = check_fnew(BT), *rstd = check_fnew(BT), *R = frand_new(BT * C, 1);
    double *inp_d = to_d(inp, BT * C), *w_d = affine ? to_d(w, C) : NULL;
    double *b_d = affine ? to_d(b, C) : NULL;
    double *ref = dnew(BT * C), *mref = dnew(BT), *rref = dnew(BT);
    fy_layernorm_forward(out, mean, rstd, inp, w, b, BT, C, eps);
    layernorm_ref(ref, mref, rref, inp_d, w_d, b_d, BT, C, eps);
    double e = err_d(out, ref, BT * C);
    CHECKF(e < FWD_TOL, "layernorm affine=%d out err %g", affine, e);
    CHECKF(err_d(mean, mref, BT) < FWD_TOL, "layernorm mean");
    CHECKF(err_d(rstd, rref, BT) < FWD_TOL, "layernorm rstd");

    float *dinp = frand_new(BT * C, 1), *dw = frand_new(C, 1), *db = frand_new(C, 1);
    float *dinp0 = fdup(dinp, BT * C), *dw0 = fdup(dw, C), *db0 = fdup(db, C);
    fy_layernorm_backward(dinp, affine ? dw : NULL, affine ? db : NULL, R, inp, w, mean, rstd,
                          BT, C);
    struct ln_ctx ctx = {inp_d, w_d, b_d, R, BT, C, eps};
    double *gi = dnew(BT * C), *gw = dnew(C), *gb = dnew(C);
    fd_grad(gi, inp_d, BT * C, ln_loss, &ctx, FD_H);
    e = err_acc(dinp, dinp0, gi, BT * C);
    CHECKF(e < GRAD_TOL, "layernorm affine=%d dinp err %g", affine, e);
    if (affine) {
      fd_grad(gw, w_d, C, ln_loss, &ctx, FD_H);
      fd_grad(gb, b_d, C, ln_loss, &ctx, FD_H);
      e = err_acc(dw, dw0, gw, C);
      CHECKF(e < GRAD_TOL, "layernorm dweight err %g", e);
      e = err_acc(db, db0, gb, C);
      CHECKF(e < GRAD_TOL, "layernorm dbias err %g", e);
      // Second call accumulates the same again.
      fy_layernorm_backward(dinp, dw, db, R, inp, w, mean, rstd, BT, C);
      for (int64_t i = 0; i < BT * C; i++) gi[i] *= 2;
      for (int64_t i = 0; i < C; i++) gw[i] *= 2, gb[i] *= 2;
      CHECKF(err_acc(dinp, dinp0, gi, BT * C) < GRAD_TOL, "layernorm dinp accumulate");
      CHECKF(err_acc(dw, dw0, gw, C) < GRAD_TOL, "layernorm dweight accumulate");
      CHECKF(err_acc(db, db0, gb, C) < GRAD_TOL, "layernorm dbias accumulate");
    } else {
      CHECK(same_bits(dw, dw0, C) && same_bits(db, db0, C));  // NULL: nothing written
    }
    free(inp), free(w), free(b), free(out), free(mean), free(rstd), free(R), free(inp_d);
    free(w_d), free(b_d), free(ref), free(mref), free(rref), free(dinp), free(dw), free(db);
    free(dinp0), free(dw0), free(db0), free(gi), free(gw), free(gb);
  }
  // Determinism and thread-count independence at a model-like size.
  {
    int64_t BT2 = 512, C2 = 768;
    float *x = frand_new(BT2 * C2, 1), *w = frand_new(C2, 1), *b = frand_new(C2, 1);
    float *g = frand_new(BT2 * C2, 1), *out = check_fnew(BT2 * C2), *m = check_fnew(BT2), *r = check_fnew(BT2);
    fy_layernorm_forward(out, m, r, x, w, b, BT2, C2, 1e-5f);
    float *di[2], *dw[2], *db[2];
    int nt = omp_get_max_threads();
    for (int k = 0; k < 2; k++) {
      di[k] = check_fnew(BT2 * C2), dw[k] = check_fnew(C2), db[k] = check_fnew(C2);
      omp_set_num_threads(k ? 1 : nt);
      fy_layernorm_backward(di[k], dw[k], db[k], g, x, w, m, r, BT2, C2);
    }
    omp_set_num_threads(nt);
    CHECK(same_bits(di[0], di[1], BT2 * C2) && same_bits(dw[0], dw[1], C2) &&
          same_bits(db[0], db[1], C2));
    free(x), free(w), free(b), free(g), free(out), free(m), free(r);
    for (int k = 0; k < 2; k++) free(di[k]), free(dw[k]), free(db[k]);
  }
}

// ---- linear ----

struct lin_ctx {
  double *inp, *w, *b;
  const float *R;
  int64_t BT, C, OC;
};
static void linear_ref(double *out, const double *inp, const double *w, const double *b,
                       int64_t BT, int64_t C, int64_t OC) {
  for (int64_t i = 0; i < BT; i++)
    for (int64_t o = 0; o < OC; o++) {
      double s = b ? b[o] : 0;
      for (int64_t c = 0; c < C; c++) s += inp[i * C + c] * w[o * C + c];
      out[i * OC + o] = s;
    }
}
static double lin_loss(void *p) {
  struct lin_ctx *x = p;
  double *out = dnew(x->BT * x->OC);
  linear_ref(out, x->inp, x->w, x->b, x->BT, x->C, x->OC);
  double L = dot_dd(out, x->R, x->BT * x->OC);
  free(out);
  return L;
}

static void test_linear(void) {
  const int64_t BT = 21, C = 20, OC = 13;
  float *inp = frand_new(BT * C, 1), *w = frand_new(OC * C, 1), *b = frand_new(OC, 1);
  float *out = check_fnew(BT * OC), *R = frand_new(BT * OC, 1);
  double *inp_d = to_d(inp, BT * C), *w_d = to_d(w, OC * C), *b_d = to_d(b, OC);
  double *ref = dnew(BT * OC);
  for (int hb = 0; hb < 2; hb++) {
    CHECK_OK(fy_linear_forward(out, inp, w, hb ? b : NULL, BT, C, OC, false));
    linear_ref(ref, inp_d, w_d, hb ? b_d : NULL, BT, C, OC);
    double e = err_d(out, ref, BT * OC);
    CHECKF(e < FWD_TOL, "linear bias=%d forward err %g", hb, e);
  }
  float *di = frand_new(BT * C, 1), *dw = frand_new(OC * C, 1), *db = frand_new(OC, 1);
  float *di0 = fdup(di, BT * C), *dw0 = fdup(dw, OC * C), *db0 = fdup(db, OC);
  CHECK_OK(fy_linear_backward(di, dw, db, R, inp, w, BT, C, OC, false));
  struct lin_ctx ctx = {inp_d, w_d, b_d, R, BT, C, OC};
  double *gi = dnew(BT * C), *gw = dnew(OC * C), *gb = dnew(OC);
  fd_grad(gi, inp_d, BT * C, lin_loss, &ctx, FD_H);
  fd_grad(gw, w_d, OC * C, lin_loss, &ctx, FD_H);
  fd_grad(gb, b_d, OC, lin_loss, &ctx, FD_H);
  double e;
  CHECKF((e = err_acc(di, di0, gi, BT * C)) < GRAD_TOL, "linear dinp err %g", e);
  CHECKF((e = err_acc(dw, dw0, gw, OC * C)) < GRAD_TOL, "linear dweight err %g", e);
  CHECKF((e = err_acc(db, db0, gb, OC)) < GRAD_TOL, "linear dbias err %g", e);
  CHECK_OK(fy_linear_backward(di, dw, db, R, inp, w, BT, C, OC, false));
  for (int64_t i = 0; i < BT * C; i++) gi[i] *= 2;
  for (int64_t i = 0; i < OC * C; i++) gw[i] *= 2;
  for (int64_t i = 0; i < OC; i++) gb[i] *= 2;
  CHECKF(err_acc(di, di0, gi, BT * C) < GRAD_TOL, "linear dinp accumulate");
  CHECKF(err_acc(dw, dw0, gw, OC * C) < GRAD_TOL, "linear dweight accumulate");
  CHECKF(err_acc(db, db0, gb, OC) < GRAD_TOL, "linear dbias accumulate");
  // NULL gradients are skipped; the others are still written.
  memcpy(di, di0, BT * C * sizeof(float));
  memcpy(dw, dw0, OC * C * sizeof(float));
  memcpy(db, db0, OC * sizeof(float));
  CHECK_OK(fy_linear_backward(NULL, dw, NULL, R, inp, w, BT, C, OC, false));
  CHECK(same_bits(di, di0, BT * C) && same_bits(db, db0, OC));
  for (int64_t i = 0; i < OC * C; i++) gw[i] /= 2;
  CHECKF(err_acc(dw, dw0, gw, OC * C) < GRAD_TOL, "linear dweight alone");
  CHECK_OK(fy_linear_backward(di, NULL, NULL, R, inp, w, BT, C, OC, false));
  for (int64_t i = 0; i < BT * C; i++) gi[i] /= 2;
  CHECKF(err_acc(di, di0, gi, BT * C) < GRAD_TOL, "linear dinp alone");
  free(inp), free(w), free(b), free(out), free(R), free(inp_d), free(w_d), free(b_d), free(ref);
  free(di), free(dw), free(db), free(di0), free(dw0), free(db0), free(gi), free(gw), free(gb);
}

// ---- attention ----

static void attention_ref(double *out, double *att, const double *qkv, const int32_t *mask,
                          int64_t B, int64_t T, int64_t C, int64_t NH, double scale) {
  int64_t HS = C / NH;
  double *sc = dnew(T);
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < NH; h++)
      for (int64_t t = 0; t < T; t++) {
        const double *q = qkv + (b * T + t) * 3 * C + h * HS;
        double mx = -INFINITY;
        for (int64_t s = 0; s < T; s++) {
          sc[s] = -INFINITY;
          if (s > t || (mask && !mask[b * T + s])) continue;
          const double *k = qkv + (b * T + s) * 3 * C + C + h * HS;
          double d = 0;
          for (int64_t i = 0; i < HS; i++) d += q[i] * k[i];
          sc[s] = d * scale;
          if (sc[s] > mx) mx = sc[s];
        }
        double sum = 0;
        for (int64_t s = 0; s < T; s++) sum += sc[s] == -INFINITY ? 0 : exp(sc[s] - mx);
        double *o = out + (b * T + t) * C + h * HS;
        for (int64_t i = 0; i < HS; i++) o[i] = 0;
        for (int64_t s = 0; s < T; s++) {
          double p = sc[s] == -INFINITY ? 0 : exp(sc[s] - mx) / sum;
          if (att) att[((b * NH + h) * T + t) * T + s] = p;
          const double *v = qkv + (b * T + s) * 3 * C + 2 * C + h * HS;
          for (int64_t i = 0; i < HS; i++) o[i] += p * v[i];
        }
      }
  free(sc);
}
// The analytic backward in double (dqkv +=), itself checked by finite differences below.
static void attention_backward_ref(double *dqkv, const double *dout, const double *qkv,
                                   const int32_t *mask, int64_t B, int64_t T, int64_t C,
                                   int64_t NH, double scale) {
  int64_t HS = C / NH, C3 = 3 * C;
  double *att = dnew(B * NH * T * T), *out = dnew(B * T * C), *ds = dnew(T);
  attention_ref(out, att, qkv, mask, B, T, C, NH, scale);
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < NH; h++)
      for (int64_t t = 0; t < T; t++) {
        const double *p = att + ((b * NH + h) * T + t) * T, *g = dout + (b * T + t) * C + h * HS;
        double dot = 0;
        for (int64_t s = 0; s < T; s++) {
          const double *v = qkv + (b * T + s) * C3 + 2 * C + h * HS;
          double dp = 0;
          for (int64_t i = 0; i < HS; i++) dp += g[i] * v[i];
          ds[s] = dp;
          dot += p[s] * dp;
        }
        const double *q = qkv + (b * T + t) * C3 + h * HS;
        double *dq = dqkv + (b * T + t) * C3 + h * HS;
        for (int64_t s = 0; s < T; s++) {
          double d = p[s] * (ds[s] - dot) * scale;
          const double *k = qkv + (b * T + s) * C3 + C + h * HS;
          double *dk = dqkv + (b * T + s) * C3 + C + h * HS, *dv = dk + C;
          for (int64_t i = 0; i < HS; i++) {
            dq[i] += d * k[i];
            dk[i] += d * q[i];
            dv[i] += p[s] * g[i];
          }
        }
      }
  free(att), free(out), free(ds);
}

struct att_ctx {
  double *qkv;
  float *qkv_f;  // for fd of the fp32 kernel
  float *out_f, *att_f;
  const int32_t *mask;
  const float *R;
  int64_t B, T, C, NH;
  double scale;
};
static double att_loss(void *p) {
  struct att_ctx *x = p;
  double *out = dnew(x->B * x->T * x->C);
  attention_ref(out, NULL, x->qkv, x->mask, x->B, x->T, x->C, x->NH, x->scale);
  double L = dot_dd(out, x->R, x->B * x->T * x->C);
  free(out);
  return L;
}
static double att_loss_f(void *p) {
  struct att_ctx *x = p;
  fy_status st = fy_attention_forward(x->out_f, x->att_f, x->qkv_f, x->mask, x->B, x->T, x->C,
                                      x->NH, (float)x->scale);
  if (st != FY_OK) return NAN;
  return dot_fd(x->out_f, x->R, x->B * x->T * x->C);
}

static void test_attention(void) {
  const int64_t B = 3, T = 7, C = 20, NH = 4, HS = C / NH;
  const float scale = 1.0f / sqrtf((float)HS);
  // Batch 0 right-padded (2 pads), batch 1 left-padded (2 pads), batch 2 unpadded.
  int32_t mask[3 * 7];
  for (int64_t b = 0; b < B; b++)
    for (int64_t t = 0; t < T; t++)
      mask[b * T + t] = !((b == 0 && t >= T - 2) || (b == 1 && t < 2));
  for (int use_mask = 0; use_mask < 2; use_mask++) {
    const int32_t *mk = use_mask ? mask : NULL;
    float *qkv = frand_new(B * T * 3 * C, 1.5f), *R = frand_new(B * T * C, 1);
    float *out = check_fnew(B * T * C), *att = check_fnew(B * NH * T * T);
    for (int64_t i = 0; i < B * NH * T * T; i++) att[i] = NAN;  // every entry must be written
    double *qkv_d = to_d(qkv, B * T * 3 * C), *oref = dnew(B * T * C);
    double *aref = dnew(B * NH * T * T);
    CHECK_OK(fy_attention_forward(out, att, qkv, mk, B, T, C, NH, scale));
    attention_ref(oref, aref, qkv_d, mk, B, T, C, NH, scale);
    double e;
    CHECKF((e = err_d(out, oref, B * T * C)) < FWD_TOL, "attention mask=%d out err %g", use_mask,
           e);
    CHECKF((e = err_d(att, aref, B * NH * T * T)) < FWD_TOL, "attention mask=%d att err %g",
           use_mask, e);
    // The probability rules, exactly: zero above the diagonal and on padded keys, rows sum to 1,
    // and a query with no key has a zero row and a zero output.
    int zeros_ok = 1, sums_ok = 1, empty_ok = 1;
    for (int64_t b = 0; b < B; b++)
      for (int64_t h = 0; h < NH; h++)
        for (int64_t t = 0; t < T; t++) {
          const float *row = att + ((b * NH + h) * T + t) * T;
          double sum = 0;
          int any = 0;
          for (int64_t s = 0; s < T; s++) {
            int allowed = s <= t && (!mk || mk[b * T + s]);
            any |= allowed;
            if (!allowed) zeros_ok &= row[s] == 0.0f;
            sum += row[s];
          }
          if (any) {
            sums_ok &= fabs(sum - 1) < 1e-5;
          } else {
            empty_ok &= sum == 0;
            for (int64_t i = 0; i < HS; i++) empty_ok &= out[(b * T + t) * C + h * HS + i] == 0;
          }
        }
    CHECK(zeros_ok);
    CHECK(sums_ok);
    CHECK(empty_ok);
    if (use_mask) {
      // The left-padded row 1 has two queries with nothing to attend to: they are covered above;
      // make sure the test really met them.
      CHECK(att[((1 * NH + 0) * T + 0) * T + 0] == 0 && att[((1 * NH + 0) * T + 2) * T + 2] == 1);
    }

    // Gradients: kernel backward vs fd of the double reference.
    float *dqkv = frand_new(B * T * 3 * C, 1), *d0 = fdup(dqkv, B * T * 3 * C);
    float *scratch = check_fnew(B * NH * T * T);
    CHECK_OK(fy_attention_backward(dqkv, scratch, R, qkv, att, B, T, C, NH, scale));
    struct att_ctx ctx = {qkv_d, qkv, check_fnew(B * T * C), check_fnew(B * NH * T * T), mk, R, B, T, C, NH,
                          scale};
    double *g = dnew(B * T * 3 * C);
    fd_grad(g, qkv_d, B * T * 3 * C, att_loss, &ctx, FD_H);
    CHECKF((e = err_acc(dqkv, d0, g, B * T * 3 * C)) < GRAD_TOL, "attention mask=%d dqkv err %g",
           use_mask, e);
    // Queries with no key get zero gradient: dq of batch 1, t = 0, 1 is untouched.
    if (use_mask) {
      int untouched = 1;
      for (int64_t t = 0; t < 2; t++)
        for (int64_t i = 0; i < C; i++)
          untouched &= dqkv[(1 * T + t) * 3 * C + i] == d0[(1 * T + t) * 3 * C + i];
      CHECK(untouched);
    }
    // The analytic double reference agrees with the fd of the double forward.
    {
      double *gr = dnew(B * T * 3 * C), *R_d = to_d(R, B * T * C);
      attention_backward_ref(gr, R_d, qkv_d, mk, B, T, C, NH, scale);
      double num = 0, den = 0;
      for (int64_t i = 0; i < B * T * 3 * C; i++) num += (gr[i] - g[i]) * (gr[i] - g[i]);
      for (int64_t i = 0; i < B * T * 3 * C; i++) den += g[i] * g[i];
      CHECKF(sqrt(num / den) < 1e-7, "attention analytic reference vs fd: %g", sqrt(num / den));
      free(gr), free(R_d);
    }
    // fd of the fp32 kernel itself (loose: eps 1e-2 in fp32).
    double *gf = dnew(B * T * 3 * C);
    fd_grad_f(gf, qkv, B * T * 3 * C, att_loss_f, &ctx, 1e-2f);
    CHECKF((e = err_acc(dqkv, d0, gf, B * T * 3 * C)) < 2e-3, "attention fp32 fd err %g", e);
    // Accumulate.
    CHECK_OK(fy_attention_backward(dqkv, scratch, R, qkv, att, B, T, C, NH, scale));
    for (int64_t i = 0; i < B * T * 3 * C; i++) g[i] *= 2;
    CHECKF((e = err_acc(dqkv, d0, g, B * T * 3 * C)) < GRAD_TOL, "attention accumulate err %g",
           e);
    free(qkv), free(R), free(out), free(att), free(qkv_d), free(oref), free(aref), free(dqkv);
    free(d0), free(scratch), free(ctx.out_f), free(ctx.att_f), free(g), free(gf);
  }
  // Sequences longer than the kernel's tile of query rows (128), the last tile partial; right and
  // left padding; forward and backward against the double references.
  {
    int64_t B2 = 2, T2 = 300, C2 = 32, NH2 = 2;
    int32_t *m2 = malloc(B2 * T2 * sizeof(int32_t));
    for (int64_t i = 0; i < B2 * T2; i++) m2[i] = !(i >= T2 - 40 && i < T2 + 3);
    float sc = 0.25f;
    float *qkv = frand_new(B2 * T2 * 3 * C2, 1.5f), *dout = frand_new(B2 * T2 * C2, 1);
    float *out = check_fnew(B2 * T2 * C2), *att = check_fnew(B2 * NH2 * T2 * T2);
    float *dq = frand_new(B2 * T2 * 3 * C2, 1), *dq0 = fdup(dq, B2 * T2 * 3 * C2);
    float *scr = check_fnew(B2 * NH2 * T2 * T2);
    double *qd = to_d(qkv, B2 * T2 * 3 * C2), *dd = to_d(dout, B2 * T2 * C2);
    double *oref = dnew(B2 * T2 * C2), *gref = dnew(B2 * T2 * 3 * C2);
    double *aref = dnew(B2 * NH2 * T2 * T2);
    CHECK_OK(fy_attention_forward(out, att, qkv, m2, B2, T2, C2, NH2, sc));
    CHECK_OK(fy_attention_backward(dq, scr, dout, qkv, att, B2, T2, C2, NH2, sc));
    attention_ref(oref, aref, qd, m2, B2, T2, C2, NH2, sc);
    attention_backward_ref(gref, dd, qd, m2, B2, T2, C2, NH2, sc);
    double e;
    CHECKF((e = err_d(out, oref, B2 * T2 * C2)) < FWD_TOL, "attention T=300 out err %g", e);
    CHECKF((e = err_d(att, aref, B2 * NH2 * T2 * T2)) < FWD_TOL, "attention T=300 att err %g", e);
    CHECKF((e = err_acc(dq, dq0, gref, B2 * T2 * 3 * C2)) < GRAD_TOL,
           "attention T=300 dqkv err %g", e);
    free(m2), free(qkv), free(dout), free(out), free(att), free(dq), free(dq0), free(scr);
    free(qd), free(dd), free(oref), free(gref), free(aref);
  }
  // A longer sequence with bigger heads against the reference, and determinism.
  {
    int64_t B2 = 2, T2 = 67, C2 = 96, NH2 = 3;
    int32_t *m2 = malloc(B2 * T2 * sizeof(int32_t));
    for (int64_t i = 0; i < B2 * T2; i++) m2[i] = !(i >= T2 - 9 && i < T2);  // batch 0 padded
    float *qkv = frand_new(B2 * T2 * 3 * C2, 1), *dout = frand_new(B2 * T2 * C2, 1);
    float *out1 = check_fnew(B2 * T2 * C2), *out2 = check_fnew(B2 * T2 * C2);
    float *att1 = check_fnew(B2 * NH2 * T2 * T2), *att2 = check_fnew(B2 * NH2 * T2 * T2);
    float *dq1 = check_fnew(B2 * T2 * 3 * C2), *dq2 = check_fnew(B2 * T2 * 3 * C2);
    float *scr = check_fnew(B2 * NH2 * T2 * T2);
    float sc = 1.0f / sqrtf(32.0f);
    CHECK_OK(fy_attention_forward(out1, att1, qkv, m2, B2, T2, C2, NH2, sc));
    CHECK_OK(fy_attention_forward(out2, att2, qkv, m2, B2, T2, C2, NH2, sc));
    CHECK_OK(fy_attention_backward(dq1, scr, dout, qkv, att1, B2, T2, C2, NH2, sc));
    CHECK_OK(fy_attention_backward(dq2, scr, dout, qkv, att1, B2, T2, C2, NH2, sc));
    CHECK(same_bits(out1, out2, B2 * T2 * C2) && same_bits(att1, att2, B2 * NH2 * T2 * T2));
    CHECK(same_bits(dq1, dq2, B2 * T2 * 3 * C2));
    double *qd = to_d(qkv, B2 * T2 * 3 * C2), *oref = dnew(B2 * T2 * C2);
    attention_ref(oref, NULL, qd, m2, B2, T2, C2, NH2, sc);
    double e = err_d(out1, oref, B2 * T2 * C2);
    CHECKF(e < FWD_TOL, "attention T=67 err %g", e);
    CHECK_ERR(fy_attention_forward(out1, att1, qkv, m2, B2, T2, C2, 5, sc), FY_ERR_INVALID);
    free(m2), free(qkv), free(dout), free(out1), free(out2), free(att1), free(att2), free(dq1);
    free(dq2), free(scr), free(qd), free(oref);
  }
  // Incremental decoding: the rows of an unmasked forward, a few tokens at a time (runs of 1, 7,
  // 1, 13 and 23) against the cache of the keys and values before them.
  {
    int64_t T2 = 45, C2 = 48, NH2 = 3, cap = 50, runs[] = {1, 7, 1, 13, 23};
    float sc = 0.3f;
    float *qkv = frand_new(T2 * 3 * C2, 1.5f), *out = check_fnew(T2 * C2), *att = check_fnew(NH2 * T2 * T2);
    float *kc = check_fnew(cap * C2), *vc = check_fnew(cap * C2);
    float *sa = check_fnew(NH2 * 23 * cap);  // (23: the longest run)
    float *o1 = check_fnew(T2 * C2);
    CHECK_OK(fy_attention_forward(out, att, qkv, NULL, 1, T2, C2, NH2, sc));
    double worst = 0;
    for (int64_t t = 0, r = 0; t < T2; t += runs[r++]) {
      CHECK_OK(fy_attention_decode(o1, kc, vc, sa, qkv + t * 3 * C2, t, runs[r], cap, C2, NH2, sc));
      for (int64_t i = 0; i < runs[r] * C2; i++) worst = fmax(worst, fabs((double)o1[i] - out[t * C2 + i]));
    }
    CHECKF(worst < 1e-5, "attention decode vs forward: %g", worst);
    CHECK_ERR(fy_attention_decode(o1, kc, vc, sa, qkv, cap, 1, cap, C2, NH2, sc), FY_ERR_INVALID);
    CHECK_ERR(fy_attention_decode(o1, kc, vc, sa, qkv, cap - 2, 3, cap, C2, NH2, sc), FY_ERR_INVALID);
    CHECK_ERR(fy_attention_decode(o1, kc, vc, sa, qkv, 0, 0, cap, C2, NH2, sc), FY_ERR_INVALID);
    CHECK_ERR(fy_attention_decode(o1, kc, vc, sa, qkv, 0, 1, cap, C2, 5, sc), FY_ERR_INVALID);
    free(qkv), free(out), free(att), free(kc), free(vc), free(sa), free(o1);
  }
}

// ---- elementwise ----

struct ew_ctx {
  double *a, *b;
  const float *R;
  int64_t N;
  int op;  // 0 relu, 1 add, 2 gelu
};
static double gelu_d(double x) { return 0.5 * x * (1.0 + erf(x / sqrt(2.0))); }
static double ew_loss(void *p) {
  struct ew_ctx *x = p;
  double L = 0;
  for (int64_t i = 0; i < x->N; i++)
    L += (x->op == 1 ? x->a[i] + x->b[i] : x->op == 2 ? gelu_d(x->a[i]) : (x->a[i] > 0 ? x->a[i] : 0)) * x->R[i];
  return L;
}

static void test_elementwise(void) {
  const int64_t N = 137;
  float *a = frand_new(N, 1), *b = frand_new(N, 1), *R = frand_new(N, 1), *out = check_fnew(N);
  for (int64_t i = 0; i < N; i++)
    if (fabsf(a[i]) < 0.05f) a[i] = 0.3f;  // away from relu's kink, for the fd
  double *a_d = to_d(a, N), *b_d = to_d(b, N), *g = dnew(N);
  fy_relu_forward(out, a, N);
  int ok = 1;
  for (int64_t i = 0; i < N; i++) ok &= out[i] == (a[i] > 0 ? a[i] : 0.0f);
  CHECK(ok);
  float *da = frand_new(N, 1), *da0 = fdup(da, N), *db = frand_new(N, 1), *db0 = fdup(db, N);
  fy_relu_backward(da, R, out, N);
  struct ew_ctx ctx = {a_d, b_d, R, N, 0};
  fd_grad(g, a_d, N, ew_loss, &ctx, FD_H);
  double e;
  CHECKF((e = err_acc(da, da0, g, N)) < GRAD_TOL, "relu grad err %g", e);
  fy_relu_backward(da, R, out, N);
  for (int64_t i = 0; i < N; i++) g[i] *= 2;
  CHECKF((e = err_acc(da, da0, g, N)) < GRAD_TOL, "relu accumulate err %g", e);
  // In place.
  float *ip = fdup(a, N);
  fy_relu_forward(ip, ip, N);
  CHECK(same_bits(ip, out, N));
  // Backward in place (dinp is dout: written over it, not added to it), as into zeros.
  float *zero_d = check_fnew(N), *ipd = fdup(R, N);
  fy_relu_backward(zero_d, R, out, N);
  fy_relu_backward(ipd, ipd, out, N);
  CHECK(same_bits(ipd, zero_d, N));

  fy_add_forward(out, a, b, N);
  ok = 1;
  for (int64_t i = 0; i < N; i++) ok &= out[i] == a[i] + b[i];
  CHECK(ok);
  memcpy(da, da0, N * sizeof(float));
  ctx.op = 1;
  fd_grad(g, a_d, N, ew_loss, &ctx, FD_H);
  fy_add_backward(da, db, R, N);
  CHECKF((e = err_acc(da, da0, g, N)) < GRAD_TOL, "add da err %g", e);
  fd_grad(g, b_d, N, ew_loss, &ctx, FD_H);
  CHECKF((e = err_acc(db, db0, g, N)) < GRAD_TOL, "add db err %g", e);
  fy_add_backward(NULL, db, R, N);
  for (int64_t i = 0; i < N; i++) g[i] *= 2;
  CHECKF((e = err_acc(db, db0, g, N)) < GRAD_TOL, "add db accumulate err %g", e);
  for (int64_t i = 0; i < N; i++) g[i] /= 2;
  CHECKF(err_acc(da, da0, g, N) < GRAD_TOL, "add da untouched when NULL passed for it");

  // gelu (exact, with erf) against double precision, its gradient by finite differences, in place.
  fy_gelu_forward(out, a, N);
  double worst = 0;
  for (int64_t i = 0; i < N; i++) worst = fmax(worst, fabs(out[i] - gelu_d(a[i])) / (fabs(gelu_d(a[i])) + 1e-3));
  CHECKF(worst < 1e-5, "gelu forward err %g", worst);
  memcpy(da, da0, N * sizeof(float));
  fy_gelu_backward(da, R, a, N);
  ctx.op = 2;
  fd_grad(g, a_d, N, ew_loss, &ctx, FD_H);
  CHECKF((e = err_acc(da, da0, g, N)) < GRAD_TOL, "gelu grad err %g", e);
  fy_gelu_backward(da, R, a, N);
  for (int64_t i = 0; i < N; i++) g[i] *= 2;
  CHECKF((e = err_acc(da, da0, g, N)) < GRAD_TOL, "gelu accumulate err %g", e);
  memcpy(ip, a, N * sizeof(float));
  fy_gelu_forward(ip, ip, N);
  CHECK(same_bits(ip, out, N));
  memset(zero_d, 0, N * sizeof(float));
  memcpy(ipd, R, N * sizeof(float));
  fy_gelu_backward(zero_d, R, a, N);
  fy_gelu_backward(ipd, ipd, a, N);
  CHECK(same_bits(ipd, zero_d, N));
  free(zero_d), free(ipd);
  // Far out in the tails: 0 and x, no NaN.
  float tails[4] = {-40.0f, -8.0f, 8.0f, 40.0f}, tout[4], tg[4] = {0}, ones[4] = {1, 1, 1, 1};
  fy_gelu_forward(tout, tails, 4);
  fy_gelu_backward(tg, ones, tails, 4);
  CHECK(tout[0] == 0.0f && fabsf(tout[1]) < 1e-12f && tout[2] == 8.0f && tout[3] == 40.0f);
  CHECK(tg[0] == 0.0f && fabsf(tg[1]) < 1e-12f && tg[2] == 1.0f && tg[3] == 1.0f);

  // Large arrays (the threaded path) against a plain loop.
  {
    int64_t N2 = 300001;
    float *x = frand_new(N2, 1), *y = frand_new(N2, 1), *o = check_fnew(N2), *d = check_fnew(N2);
    fy_relu_forward(o, x, N2);
    fy_relu_backward(d, y, o, N2);
    int good = 1;
    for (int64_t i = 0; i < N2; i++)
      good &= o[i] == (x[i] > 0 ? x[i] : 0.0f) && d[i] == (x[i] > 0 ? y[i] : 0.0f);
    float *yd = fdup(y, N2), *gd = check_fnew(N2);  // in place, and gelu's backward, threaded
    fy_relu_backward(yd, yd, o, N2);
    good &= same_bits(yd, d, N2);
    memcpy(yd, y, (size_t)N2 * sizeof(float));
    fy_gelu_backward(gd, y, x, N2);
    fy_gelu_backward(yd, yd, x, N2);
    good &= same_bits(yd, gd, N2);
    free(yd), free(gd);
    fy_add_forward(o, x, y, N2);
    for (int64_t i = 0; i < N2; i++) good &= o[i] == x[i] + y[i];
    float *o1 = check_fnew(N2);
    fy_gelu_forward(o, x, N2);
    fy_gelu_forward(o1, x, 1000);  // (small: the unthreaded path)
    for (int64_t i = 0; i < 1000; i++) good &= o[i] == o1[i];
    free(o1);
    CHECK(good);
    free(x), free(y), free(o), free(d);
  }
  free(a), free(b), free(R), free(out), free(a_d), free(b_d), free(g), free(da), free(da0);
  free(db), free(db0), free(ip);
}

// ---- dropout fused with the residual add ----

static void test_dropout(void) {
  // The hashes are pinned: the masks of a run (and of a resumed one) must not change between
  // versions, and test/reference/check_variants.py computes the same numbers in numpy.
  const uint64_t k0 = fy_dropout_key(1337, 0), k5 = fy_dropout_key(1337, 5);
  CHECK(k0 == 0xb7984abd98746a94ull && k5 == 0x588397beca8365b6ull);
  const uint64_t t0 = fy_dropout_token(k0, 0), t1 = fy_dropout_token(k5, 123456789);
  CHECK(t0 == 0x5ef9092d7bb25137ull && t1 == 0xb7bd5fc18094af07ull);
  CHECK(fy_dropout_draw(t0, 0) == 0x60138e4eu && fy_dropout_draw(t0, 7) == 0x84ff579eu &&
        fy_dropout_draw(t1, 4095) == 0x9c57f1a4u);
  CHECK(fy_dropout_threshold(0) == 0 && fy_dropout_threshold(0.1f) == 429496736u && fy_dropout_scale(0) == 1.0f);

  const int64_t rows = 96, C = 250, N = rows * C;
  float *a = frand_new(N, 1), *b = frand_new(N, 1), *out = check_fnew(N), *ref = check_fnew(N);
  float *zero = check_fnew(N), *one = check_fnew(N), *mask = check_fnew(N);
  for (int64_t i = 0; i < N; i++) one[i] = 1.0f;
  // p = 0 is the plain add, bit for bit.
  fy_dropout_add_forward(out, a, b, rows, C, k0, 0, 0.0f);
  fy_add_forward(ref, a, b, N);
  CHECK(same_bits(out, ref, N));
  for (int pi = 0; pi < 3; pi++) {
    const float p = pi == 0 ? 0.1f : pi == 1 ? 0.5f : 0.9f, s = 1.0f / (1.0f - p);
    // The mask itself (0 + 1 * keep / (1-p)): values 0 or the scale; the kept share, the share of
    // neighbours (next column, next token) kept together and the overlap with another site's mask
    // are those of independent draws, within 5 standard deviations.
    fy_dropout_add_forward(mask, zero, one, rows, C, k0, 1000, p);
    float *other = check_fnew(N);
    fy_dropout_add_forward(other, zero, one, rows, C, k5, 1000, p);
    int64_t kept = 0, pairs_c = 0, both_c = 0, pairs_t = 0, both_t = 0, both_site = 0, bad = 0;
    for (int64_t r = 0; r < rows; r++)
      for (int64_t j = 0; j < C; j++) {
        const float m = mask[r * C + j];
        bad += m != 0.0f && m != s;
        kept += m != 0;
        both_site += m != 0 && other[r * C + j] != 0;
        if (j + 1 < C) pairs_c++, both_c += m != 0 && mask[r * C + j + 1] != 0;
        if (r + 1 < rows) pairs_t++, both_t += m != 0 && mask[(r + 1) * C + j] != 0;
      }
    const double q = 1.0 - p;
    double z_keep = (kept - N * q) / sqrt(N * q * p), z_c = (both_c - pairs_c * q * q) / sqrt(pairs_c * q * q * (1 - q * q));
    double z_t = (both_t - pairs_t * q * q) / sqrt(pairs_t * q * q * (1 - q * q));
    double z_s = (both_site - N * q * q) / sqrt(N * q * q * (1 - q * q));
    CHECKF(bad == 0 && fabs(z_keep) < 5 && fabs(z_c) < 5 && fabs(z_t) < 5 && fabs(z_s) < 5,
           "p %g: %lld odd values; z kept %.2f, column pairs %.2f, token pairs %.2f, two sites %.2f", (double)p,
           (long long)bad, z_keep, z_c, z_t, z_s);
    // The output is a + b * mask; rows cut into two calls (another micro-batch size) draw the same.
    fy_dropout_add_forward(out, a, b, rows, C, k0, 1000, p);
    int ok = 1;
    for (int64_t i = 0; i < N; i++) ok &= out[i] == a[i] + (mask[i] != 0 ? b[i] * s : 0.0f);
    CHECK(ok);
    fy_dropout_add_forward(ref, a, b, 37, C, k0, 1000, p);
    fy_dropout_add_forward(ref + 37 * C, a + 37 * C, b + 37 * C, rows - 37, C, k0, 1000 + 37, p);
    CHECK(same_bits(out, ref, N));
    // In place over the residual (out = a), as the graph may run it.
    float *ip = fdup(a, N);
    fy_dropout_add_forward(ip, ip, b, rows, C, k0, 1000, p);
    CHECK(same_bits(ip, out, N));
    // Backward: da += dout, db += dout * mask (the forward's mask, regenerated); accumulates; NULL skips.
    float *dout = frand_new(N, 1), *da = frand_new(N, 1), *db = frand_new(N, 1), *da0 = fdup(da, N), *db0 = fdup(db, N);
    fy_dropout_add_backward(da, db, dout, rows, C, k0, 1000, p);
    ok = 1;
    for (int64_t i = 0; i < N; i++)
      ok &= da[i] == da0[i] + dout[i] && db[i] == db0[i] + (mask[i] != 0 ? dout[i] * s : 0.0f);
    CHECK(ok);
    memcpy(db, db0, (size_t)N * 4);
    fy_dropout_add_backward(NULL, db, dout, rows, C, k0, 1000, p);
    fy_dropout_add_backward(NULL, db, dout, rows, C, k0, 1000, p);
    ok = 1;
    for (int64_t i = 0; i < N; i++) ok &= fabsf(db[i] - (db0[i] + 2 * (mask[i] != 0 ? dout[i] * s : 0.0f))) <= 1e-5f;
    CHECK(ok);
    free(other), free(ip), free(dout), free(da), free(db), free(da0), free(db0);
  }
  // Large (threaded) against small (one row at a time) calls.
  {
    const int64_t R2 = 700, C2 = 1024, N2 = R2 * C2;
    float *x = frand_new(N2, 1), *y = frand_new(N2, 1), *o = check_fnew(N2), *o1 = check_fnew(N2);
    fy_dropout_add_forward(o, x, y, R2, C2, k5, 77, 0.3f);
    for (int64_t r = 0; r < R2; r++) fy_dropout_add_forward(o1 + r * C2, x + r * C2, y + r * C2, 1, C2, k5, 77 + r, 0.3f);
    CHECK(same_bits(o, o1, N2));
    free(x), free(y), free(o), free(o1);
  }
  free(a), free(b), free(out), free(ref), free(zero), free(one), free(mask);
}

// ---- cross-entropy ----

struct ce_ctx {
  double *logits;
  const int32_t *targets;
  int64_t BT, V;
  double dloss;
};
static int64_t crossentropy_ref(double *losses, const double *logits, const int32_t *targets,
                                int64_t BT, int64_t V) {
  int64_t n = 0;
  for (int64_t i = 0; i < BT; i++) {
    losses[i] = 0;
    if (targets[i] == -100) continue;
    const double *x = logits + i * V;
    double mx = -INFINITY, s = 0;
    for (int64_t j = 0; j < V; j++) mx = x[j] > mx ? x[j] : mx;
    for (int64_t j = 0; j < V; j++) s += exp(x[j] - mx);
    losses[i] = mx + log(s) - x[targets[i]];
    n++;
  }
  return n;
}
static double ce_loss(void *p) {
  struct ce_ctx *x = p;
  double *l = dnew(x->BT), L = 0;
  crossentropy_ref(l, x->logits, x->targets, x->BT, x->V);
  for (int64_t i = 0; i < x->BT; i++) L += l[i];
  free(l);
  return x->dloss * L;
}

static void test_crossentropy(void) {
  const int64_t BT = 21, V = 37;
  int32_t targets[21];
  for (int64_t i = 0; i < BT; i++) targets[i] = (int32_t)(check_urand() * V);
  targets[3] = targets[11] = targets[20] = -100;
  targets[0] = 0, targets[1] = (int32_t)V - 1;
  float *logits = frand_new(BT * V, 3), *losses = check_fnew(BT);
  for (int64_t i = 0; i < BT; i++) losses[i] = NAN;
  double *lg_d = to_d(logits, BT * V), *lref = dnew(BT);
  int64_t n = fy_crossentropy_forward(losses, logits, targets, BT, V);
  int64_t nref = crossentropy_ref(lref, lg_d, targets, BT, V);
  CHECK(n == BT - 3 && n == nref);
  double e;
  CHECKF((e = err_d(losses, lref, BT)) < FWD_TOL, "crossentropy loss err %g", e);
  CHECK(losses[3] == 0 && losses[11] == 0 && losses[20] == 0);

  float dloss = 1.0f / (float)n;
  float *dl = frand_new(BT * V, 1);  // overwritten, so garbage first
  fy_crossentropy_backward(dl, logits, targets, BT, V, dloss);
  struct ce_ctx ctx = {lg_d, targets, BT, V, dloss};
  double *g = dnew(BT * V);
  fd_grad(g, lg_d, BT * V, ce_loss, &ctx, FD_H);
  CHECKF((e = err_d(dl, g, BT * V)) < GRAD_TOL, "crossentropy dlogits err %g", e);
  int zero = 1;
  for (int64_t j = 0; j < V; j++) zero &= dl[3 * V + j] == 0 && dl[20 * V + j] == 0;
  CHECK(zero);
  // In place gives the same bits.
  float *ip = fdup(logits, BT * V);
  fy_crossentropy_backward(ip, ip, targets, BT, V, dloss);
  CHECK(same_bits(ip, dl, BT * V));

  // Large logits: no overflow (the max is subtracted).
  for (int64_t i = 0; i < BT * V; i++) logits[i] *= 300.0f, lg_d[i] = logits[i];
  fy_crossentropy_forward(losses, logits, targets, BT, V);
  crossentropy_ref(lref, lg_d, targets, BT, V);
  CHECKF((e = err_d(losses, lref, BT)) < FWD_TOL, "crossentropy large logits err %g", e);
  fy_crossentropy_backward(dl, logits, targets, BT, V, 1.0f);
  int finite = 1;
  for (int64_t i = 0; i < BT * V; i++) finite &= isfinite(dl[i]);
  CHECK(finite);

  // A vocabulary-sized row, threaded, deterministic.
  {
    int64_t BT2 = 16, V2 = 50272;
    float *x = frand_new(BT2 * V2, 4), *l1 = check_fnew(BT2), *l2 = check_fnew(BT2);
    int32_t t2[16];
    for (int64_t i = 0; i < BT2; i++) t2[i] = (int32_t)(check_urand() * V2);
    fy_crossentropy_forward(l1, x, t2, BT2, V2);
    fy_crossentropy_forward(l2, x, t2, BT2, V2);
    CHECK(same_bits(l1, l2, BT2));
    double *xd = to_d(x, BT2 * V2), *lr = dnew(BT2);
    crossentropy_ref(lr, xd, t2, BT2, V2);
    CHECKF((e = err_d(l1, lr, BT2)) < FWD_TOL, "crossentropy V=50272 err %g", e);
    free(x), free(l1), free(l2), free(xd), free(lr);
  }
  free(logits), free(losses), free(lg_d), free(lref), free(dl), free(g), free(ip);
}

// ---- AdamW ----

static void test_adamw(void) {
  const int64_t sizes[2] = {1003, 200003};  // the second takes the threaded path
  const float lr = 1e-2f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, wd = 0.1f, gs = 0.5f;
  for (int si = 0; si < 2; si++) {
    int64_t n = sizes[si];
    float *p = frand_new(n, 1), *m = check_fnew(n), *v = check_fnew(n), *g = check_fnew(n), *p0 = fdup(p, n);
    double *pd = to_d(p, n), *md = dnew(n), *vd = dnew(n);
    for (int64_t t = 1; t <= 5; t++) {
      fill(g, n, 2);
      g[0] = 0;  // a zero gradient on the first element, every step
      fy_adamw_update(p, m, v, g, n, lr, b1, b2, eps, wd, t, gs);
      // torch.optim.AdamW (single tensor, non-amsgrad, non-maximize), transcribed in double.
      double bc1 = 1 - pow(b1, (double)t), bc2 = 1 - pow(b2, (double)t);
      for (int64_t i = 0; i < n; i++) {
        double gi = (double)g[i] * gs;
        pd[i] *= 1 - (double)lr * wd;
        md[i] = b1 * md[i] + (1 - (double)b1) * gi;
        vd[i] = b2 * vd[i] + (1 - (double)b2) * gi * gi;
        double denom = sqrt(vd[i]) / sqrt(bc2) + eps;
        pd[i] -= (lr / bc1) * md[i] / denom;
      }
    }
    // Compare the change of the parameters, which is what the update computes.
    double *dp = dnew(n);
    for (int64_t i = 0; i < n; i++) dp[i] = pd[i] - p0[i];
    double e;
    CHECKF((e = err_acc(p, p0, dp, n)) < 1e-4, "adamw n=%lld param change err %g", (long long)n,
           e);
    CHECKF((e = err_d(m, md, n)) < FWD_TOL, "adamw m err %g", e);
    CHECKF((e = err_d(v, vd, n)) < FWD_TOL, "adamw v err %g", e);
    CHECKF(fabs(p[0] - pd[0]) < 1e-6, "adamw zero-grad element %g vs %g", p[0], pd[0]);
    free(p), free(m), free(v), free(g), free(p0), free(pd), free(md), free(vd), free(dp);
  }
}

static void test_sumsq(void) {
  CHECK(fy_sumsq(NULL, 0) == 0.0);
  float small[5] = {1, -2, 3, 0.5f, -0.25f};
  CHECK(fy_sumsq(small, 5) == 1 + 4 + 9 + 0.25 + 0.0625);
  int64_t n = 1000003;
  float *x = frand_new(n, 3);
  long double ref = 0;
  for (int64_t i = 0; i < n; i++) ref += (long double)x[i] * x[i];
  double s = fy_sumsq(x, n);
  CHECKF(fabs(s - (double)ref) / (double)ref < 1e-12, "sumsq %.17g vs %.17g", s, (double)ref);
  int nt = omp_get_max_threads();
  omp_set_num_threads(1);
  double s1 = fy_sumsq(x, n);
  omp_set_num_threads(nt);
  CHECK(memcmp(&s, &s1, sizeof s) == 0);  // independent of the thread count
  free(x);
}

// The bf16-gradient forms (runtime/offload.c's chunks whose gradients come home over their bf16
// weights): bit for bit the f32 forms on the widened values, the new weights rounded to bf16 in
// place of the gradients; any thread count.
static void test_bf16_grads(void) {
  const int64_t sizes[3] = {1, 1003, 200003};
  for (int si = 0; si < 3; si++) {
    int64_t n = sizes[si];
    float *g = frand_new(n, 1), *p = frand_new(n, 1), *m = check_fnew(n), *v = check_fnew(n);
    float *p2 = fdup(p, n), *m2 = check_fnew(n), *v2 = check_fnew(n);
    uint16_t *gw = malloc((size_t)n * 2);
    for (int64_t t = 1; t <= 3; t++) {
      fill(g, n, 2);
      for (int64_t i = 0; i < n; i++) gw[i] = fy_f32_to_bf16(g[i]), g[i] = fy_bf16_to_f32(gw[i]);
      double s = fy_sumsq(g, n), s16 = fy_sumsq_bf16(gw, n);
      CHECKF(memcmp(&s, &s16, sizeof s) == 0, "sumsq_bf16 n=%lld: %.17g vs %.17g", (long long)n, s16, s);
      fy_adamw_update(p, m, v, g, n, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, t, 0.5f);
      fy_adamw_update_bf16(p2, m2, v2, gw, n, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, t, 0.5f);
      CHECKF(memcmp(p, p2, (size_t)n * 4) == 0 && memcmp(m, m2, (size_t)n * 4) == 0 &&
             memcmp(v, v2, (size_t)n * 4) == 0, "adamw_bf16 n=%lld step %lld: not the f32 update's bits",
             (long long)n, (long long)t);
      int64_t bad = 0;
      for (int64_t i = 0; i < n; i++) bad += gw[i] != fy_f32_to_bf16(p[i]);
      CHECKF(bad == 0, "adamw_bf16 n=%lld: %lld weights not rounded to bf16 in place", (long long)n, (long long)bad);
    }
    int nt = omp_get_max_threads();
    omp_set_num_threads(1);
    double s1 = fy_sumsq_bf16(gw, n);
    omp_set_num_threads(nt);
    double s2 = fy_sumsq_bf16(gw, n);
    CHECK(memcmp(&s1, &s2, sizeof s1) == 0);
    free(g), free(p), free(m), free(v), free(p2), free(m2), free(v2), free(gw);
  }
}

// The parameter halves that may overwrite: = gives what += gives on zeros, bit for bit, and the
// gradient may be written over the weights it replaces (they are not read).
static void test_params_overwrite(void) {
  const int64_t BT = 11, C = 13, OC = 7;
  float inp[11 * 13], dout[11 * 7], w[7 * 13], b[7], dw0[7 * 13] = {0}, db0[7] = {0};
  for (int i = 0; i < BT * C; i++) inp[i] = sinf(0.3f * i);
  for (int i = 0; i < BT * OC; i++) dout[i] = cosf(0.7f * i);
  for (int i = 0; i < OC * C; i++) w[i] = 100.0f + i;  // garbage that must not leak in
  for (int i = 0; i < OC; i++) b[i] = -50.0f;
  CHECK_OK(fy_linear_backward_params(dw0, db0, dout, inp, BT, C, OC, true, false));
  CHECK_OK(fy_linear_backward_params(w, b, dout, inp, BT, C, OC, false, false));
  CHECK(memcmp(w, dw0, sizeof w) == 0 && memcmp(b, db0, sizeof b) == 0);
  // Accumulate on top doubles.
  CHECK_OK(fy_linear_backward_params(w, b, dout, inp, BT, C, OC, true, false));
  CHECK(fabsf(w[5] - 2 * dw0[5]) <= 1e-5f * fabsf(dw0[5]) && fabsf(b[3] - 2 * db0[3]) <= 1e-5f * fabsf(db0[3]));

  float x[11 * 13], g[11 * 13], mean[11], rstd[11], out[11 * 13], lw[13], lb[13], dlw[13] = {0}, dlb[13] = {0};
  for (int i = 0; i < BT * C; i++) { x[i] = sinf(1.1f * i) * 2; g[i] = cosf(0.13f * i); }
  for (int i = 0; i < C; i++) { lw[i] = 1 + 0.1f * i; lb[i] = 0.5f; }
  fy_layernorm_forward(out, mean, rstd, x, lw, lb, BT, C, 1e-5f);
  fy_layernorm_backward_params(dlw, dlb, g, x, mean, rstd, BT, C, true);
  fy_layernorm_backward_params(lw, lb, g, x, mean, rstd, BT, C, false);
  CHECK(memcmp(lw, dlw, sizeof lw) == 0 && memcmp(lb, dlb, sizeof lb) == 0);
}


// ---- mixture of experts ----

struct moe_ctx {
  double *inp, *gate, *w1, *b1, *w2, *b2;  // b1, b2 NULL without biases
  const float *R;                          // the loss: sum(out * R) + dbal * balance
  double dbal;
  int64_t BT, C, F;
  int E, K;
  bool gelu;
  int *picks;                              // (BT, K): the experts the fp32 kernel chose
  const int32_t *mask;                     // (BT) 0: padding, no expert (NULL: none)
};

// The block in double by its definition, each token alone; the routing is the kernel's (picks),
// checked apart, so that finite differences move the weights, not the choice.
static double moe_ref(const struct moe_ctx *x, double *out, double *balance) {
  const int64_t BT = x->BT, C = x->C, F = x->F;
  const int E = x->E, K = x->K;
  double P[E], cnt[E], N = 0;
  for (int e = 0; e < E; e++) P[e] = cnt[e] = 0;
  for (int64_t t = 0; t < BT; t++) N += !x->mask || x->mask[t];
  for (int64_t t = 0; t < BT; t++) {
    double p[E], mx = -1e300, sum = 0, chosen = 0;
    if (x->mask && !x->mask[t]) {  // padding: every logit masked, no expert, out 0
      for (int64_t c = 0; c < C; c++) out[t * C + c] = 0;
      continue;
    }
    for (int e = 0; e < E; e++) {
      p[e] = 0;
      for (int64_t c = 0; c < C; c++) p[e] += x->inp[t * C + c] * x->gate[e * C + c];
      mx = p[e] > mx ? p[e] : mx;
    }
    for (int e = 0; e < E; e++) sum += p[e] = exp(p[e] - mx);
    for (int e = 0; e < E; e++) P[e] += (p[e] /= sum) / N;
    for (int j = 0; j < K; j++) chosen += p[x->picks[t * K + j]];
    for (int64_t c = 0; c < C; c++) out[t * C + c] = 0;
    for (int j = 0; j < K; j++) {
      const int e = x->picks[t * K + j];
      cnt[e] += 1;
      double h[F];
      for (int64_t f = 0; f < F; f++) {
        double s = x->b1 ? x->b1[e * F + f] : 0;
        for (int64_t c = 0; c < C; c++) s += x->inp[t * C + c] * x->w1[(e * F + f) * C + c];
        h[f] = x->gelu ? 0.5 * s * erfc(-s / sqrt(2.0)) : (s > 0 ? s : 0);
      }
      for (int64_t c = 0; c < C; c++) {
        double s = x->b2 ? x->b2[e * C + c] : 0;
        for (int64_t f = 0; f < F; f++) s += h[f] * x->w2[(e * C + c) * F + f];
        out[t * C + c] += p[e] / chosen * s;
      }
    }
  }
  double b = 0;
  for (int e = 0; e < E && N > 0; e++) b += cnt[e] / N * P[e];
  *balance = E * b;
  return *balance;
}
static double moe_loss(void *p) {
  struct moe_ctx *x = p;
  double *out = dnew(x->BT * x->C), bal;
  moe_ref(x, out, &bal);
  double L = dot_dd(out, x->R, x->BT * x->C) + x->dbal * bal;
  free(out);
  return L;
}

// One configuration: forward against the double reference (the routing checked by its own top-K
// of the double probabilities), backward against finite differences, written then accumulated;
// with `starve`, expert E-1 gets no token and its gradient must be 0 (written) or untouched.
// With mask_every n > 0, every n-th token (from the second) is padding: routed to no expert, its
// output row 0, its input's gradient from the block 0, left out of the balance term.
static void moe_case_masked(int64_t BT, int64_t C, int64_t F, int E, int K, bool gelu, bool bias, bool starve,
                            int mask_every) {
  const int S = E + 3 * K;
  const int64_t cap = fy_moe_rows_cap(BT, E, K);
  float *inp = frand_new(BT * C, 1), *gate = frand_new(E * C, 1), *w1 = frand_new(E * F * C, 0.5f);
  float *b1 = frand_new(E * F, 0.5f), *w2 = frand_new(E * C * F, 0.5f), *b2 = frand_new(E * C, 0.5f);
  if (starve) {  // inputs positive, the last expert's row negative: its logit is the lowest
    for (int64_t i = 0; i < BT * C; i++) inp[i] = 0.2f + fabsf(inp[i]);
    for (int64_t c = 0; c < C; c++) gate[(E - 1) * C + c] = -2.0f;
  }
  float *out = check_fnew(BT * C), *route = check_fnew(BT * S), *rows = check_fnew(cap * (F + C));
  float *R = frand_new(BT * C, 1);
  int32_t *mask = NULL;
  if (mask_every > 0) {
    mask = malloc((size_t)BT * sizeof *mask);
    for (int64_t t = 0; t < BT; t++) mask[t] = t % mask_every != 1;
  }
  const struct fy_moe_dims d = {.BT = BT, .C = C, .F = F, .E = E, .K = K, .gelu = gelu, .mask = mask};
  double balance;
  CHECK_OK(fy_moe_forward(out, route, rows, &balance, inp, gate, w1, bias ? b1 : NULL, w2, bias ? b2 : NULL, &d));
  int *picks = calloc((size_t)(BT * K), sizeof(int));
  bool picks_ok = true, starved = true;
  bool pads_ok = true;
  for (int64_t t = 0; t < BT; t++)
    for (int j = 0; j < K; j++) {
      picks[t * K + j] = (int)route[t * S + E + j];
      if (mask && !mask[t]) {  // no expert, no weight, no row, nothing out
        pads_ok &= picks[t * K + j] == -1 && route[t * S + E + K + j] == 0.0f && route[t * S + E + 2 * K + j] == -1.0f;
        for (int64_t c = 0; c < C; c++) pads_ok &= out[t * C + c] == 0.0f;
        continue;
      }
      starved &= picks[t * K + j] != E - 1;
      // the pick is the j-th largest probability: exactly j others are larger
      int larger = 0;
      for (int e = 0; e < E; e++) larger += route[t * S + e] > route[t * S + picks[t * K + j]];
      picks_ok &= larger == j;
    }
  CHECKF(picks_ok, "moe E=%d K=%d: the routing is not the top %d", E, K, K);
  if (starve) CHECKF(starved, "moe: the starved expert got a token");
  CHECKF(pads_ok, "moe: a padding token was routed or has an output");
  struct moe_ctx ctx = {to_d(inp, BT * C), to_d(gate, E * C), to_d(w1, E * F * C), bias ? to_d(b1, E * F) : NULL,
                        to_d(w2, E * C * F), bias ? to_d(b2, E * C) : NULL, R, 0.7, BT, C, F, E, K, gelu, picks, mask};
  double *ref = dnew(BT * C), rbal, e;
  moe_ref(&ctx, ref, &rbal);
  CHECKF((e = err_d(out, ref, BT * C)) < FWD_TOL, "moe E=%d K=%d gelu=%d bias=%d forward err %g", E, K, gelu, bias, e);
  CHECKF(fabs(balance - rbal) < 1e-6 * fabs(rbal), "moe balance %g, reference %g", balance, rbal);

  // Backward, written (the parameter gradients pre-filled with garbage) and then accumulated.
  float *di = frand_new(BT * C, 1), *dg = frand_new(E * C, 1), *dw1 = frand_new(E * F * C, 1);
  float *db1 = frand_new(E * F, 1), *dw2 = frand_new(E * C * F, 1), *db2 = frand_new(E * C, 1);
  float *di0 = fdup(di, BT * C);
  CHECK_OK(fy_moe_backward(di, dg, dw1, bias ? db1 : NULL, dw2, bias ? db2 : NULL, R, inp, route, rows, gate, w1, w2,
                           (float)ctx.dbal, false, &d));
  double *gi = dnew(BT * C), *gg = dnew(E * C), *gw1 = dnew(E * F * C), *gb1 = dnew(E * F), *gw2 = dnew(E * C * F);
  double *gb2 = dnew(E * C);
  fd_grad(gi, ctx.inp, BT * C, moe_loss, &ctx, FD_H);
  fd_grad(gg, ctx.gate, E * C, moe_loss, &ctx, FD_H);
  fd_grad(gw1, ctx.w1, E * F * C, moe_loss, &ctx, FD_H);
  fd_grad(gw2, ctx.w2, E * C * F, moe_loss, &ctx, FD_H);
  if (bias) {
    fd_grad(gb1, ctx.b1, E * F, moe_loss, &ctx, FD_H);
    fd_grad(gb2, ctx.b2, E * C, moe_loss, &ctx, FD_H);
  }
  CHECKF((e = err_acc(di, di0, gi, BT * C)) < GRAD_TOL, "moe dinp err %g", e);
  CHECKF((e = err_d(dg, gg, E * C)) < GRAD_TOL, "moe dgate err %g", e);
  CHECKF((e = err_d(dw1, gw1, E * F * C)) < GRAD_TOL, "moe dw1 err %g", e);
  CHECKF((e = err_d(dw2, gw2, E * C * F)) < GRAD_TOL, "moe dw2 err %g", e);
  if (bias) {
    CHECKF((e = err_d(db1, gb1, E * F)) < GRAD_TOL, "moe db1 err %g", e);
    CHECKF((e = err_d(db2, gb2, E * C)) < GRAD_TOL, "moe db2 err %g", e);
  }
  if (starve) {  // written: exactly zero
    bool zero = true;
    for (int64_t i = (E - 1) * F * C; i < E * F * C; i++) zero &= dw1[i] == 0.0f && dw2[i] == 0.0f;
    for (int64_t i = (E - 1) * F; i < E * F && bias; i++) zero &= db1[i] == 0.0f;
    for (int64_t i = (E - 1) * C; i < E * C && bias; i++) zero &= db2[i] == 0.0f;
    CHECKF(zero, "moe: the starved expert's gradient is not zero");
  }
  float *dw1a = fdup(dw1, E * F * C), *dga = fdup(dg, E * C);
  CHECK_OK(fy_moe_backward(NULL, dg, dw1, bias ? db1 : NULL, dw2, bias ? db2 : NULL, R, inp, route, rows, gate, w1, w2,
                           (float)ctx.dbal, true, &d));
  CHECKF((e = err_acc(dw1, dw1a, gw1, E * F * C)) < GRAD_TOL, "moe dw1 accumulated err %g", e);
  CHECKF((e = err_acc(dg, dga, gg, E * C)) < GRAD_TOL, "moe dgate accumulated err %g", e);
  free(ctx.inp), free(ctx.gate), free(ctx.w1), free(ctx.b1), free(ctx.w2), free(ctx.b2), free(picks);
  free(inp), free(gate), free(w1), free(b1), free(w2), free(b2), free(out), free(route), free(rows), free(R), free(ref);
  free(di), free(dg), free(dw1), free(db1), free(dw2), free(db2), free(di0), free(dw1a), free(dga);
  free(gi), free(gg), free(gw1), free(gb1), free(gw2), free(gb2), free(mask);
}
static void moe_case(int64_t BT, int64_t C, int64_t F, int E, int K, bool gelu, bool bias, bool starve) {
  moe_case_masked(BT, C, F, E, K, gelu, bias, starve, 0);
}

// A tensor-parallel pair emulated in one process (fy_moe_dims.tp_sum): rank 1 runs first and its
// sums keep copies of what it would send; rank 0 then adds those copies in the same order, so its
// results are what the pair's sums would give it. They must be one rank's on the whole experts.
struct moe_tp_pair {
  bool add;        // rank 0's turn: add rank 1's buffers
  int k;           // the sums so far this turn
  float *sent[4];  // rank 1's buffers, in order
};

static fy_status moe_tp_sum(void *ctx, float *buf, int64_t n) {
  struct moe_tp_pair *x = ctx;
  FY_ASSERT(x->k < 4);
  if (x->add) {
    for (int64_t i = 0; i < n; i++) buf[i] += x->sent[x->k][i];
    free(x->sent[x->k]);
  } else {
    x->sent[x->k] = fdup(buf, n);
  }
  x->k++;
  return FY_OK;
}

// Slices of rank r of 2: w1 (E*F,C) rows [e F + r F/2, +F/2) of every expert, b1 likewise, w2
// (E*C,F) columns [r F/2, +F/2).
static void moe_tp_slice(float *w1r, float *b1r, float *w2r, const float *w1, const float *b1, const float *w2,
                         int64_t C, int64_t F, int E, int r) {
  const int64_t Fl = F / 2;
  for (int64_t e = 0; e < E; e++) {
    memcpy(w1r + e * Fl * C, w1 + (e * F + r * Fl) * C, (size_t)(Fl * C) * 4);
    memcpy(b1r + e * Fl, b1 + e * F + r * Fl, (size_t)Fl * 4);
  }
  for (int64_t i = 0; i < E * C; i++) memcpy(w2r + i * Fl, w2 + i * F + r * Fl, (size_t)Fl * 4);
}

static void moe_tp_case(int64_t BT, int64_t C, int64_t F, int E, int K, bool gelu, int mask_every) {
  const int S = E + 3 * K;
  const int64_t cap = fy_moe_rows_cap(BT, E, K), Fl = F / 2;
  float *inp = frand_new(BT * C, 1), *gate = frand_new(E * C, 1), *w1 = frand_new(E * F * C, 0.5f);
  float *b1 = frand_new(E * F, 0.5f), *w2 = frand_new(E * C * F, 0.5f), *b2 = frand_new(E * C, 0.5f);
  float *R = frand_new(BT * C, 1);
  int32_t *mask = NULL;
  if (mask_every > 0) {
    mask = malloc((size_t)BT * sizeof *mask);
    for (int64_t t = 0; t < BT; t++) mask[t] = t % mask_every != 1;
  }
  // One rank, whole experts.
  struct fy_moe_dims d = {.BT = BT, .C = C, .F = F, .E = E, .K = K, .gelu = gelu, .mask = mask};
  float *out = check_fnew(BT * C), *route = check_fnew(BT * S), *rows = check_fnew(cap * (F + C));
  double balance, bal[2];
  CHECK_OK(fy_moe_forward(out, route, rows, &balance, inp, gate, w1, b1, w2, b2, &d));
  float *di = check_fnew(BT * C), *dg = check_fnew(E * C), *dw1 = check_fnew(E * F * C), *db1 = check_fnew(E * F);
  float *dw2 = check_fnew(E * C * F), *db2 = check_fnew(E * C);
  CHECK_OK(fy_moe_backward(di, dg, dw1, db1, dw2, db2, R, inp, route, rows, gate, w1, w2, 0.3f, false, &d));
  // The pair: rank 1, then rank 0 (fc2's bias: rank 0's alone).
  struct moe_tp_pair pair = {0};
  struct fy_moe_dims dt = d;
  dt.F = Fl, dt.tp_sum = moe_tp_sum, dt.tp_ctx = &pair;
  float *w1r = check_fnew(E * Fl * C), *b1r = check_fnew(E * Fl), *w2r = check_fnew(E * C * Fl);
  float *outr[2], *router[2], *rowsr[2], *dir[2], *dgr[2], *dw1r[2], *db1r[2], *dw2r[2], *db2r[2];
  for (int r = 1; r >= 0; r--) {
    pair.add = r == 0, pair.k = 0;
    moe_tp_slice(w1r, b1r, w2r, w1, b1, w2, C, F, E, r);
    outr[r] = check_fnew(BT * C), router[r] = check_fnew(BT * S), rowsr[r] = check_fnew(cap * (Fl + C));
    CHECK_OK(fy_moe_forward(outr[r], router[r], rowsr[r], &bal[r], inp, gate, w1r, b1r, w2r, r == 0 ? b2 : NULL, &dt));
    CHECKF(pair.k == 1, "moe tp rank %d: %d sums in forward, wanted 1 (the output)", r, pair.k);
    dir[r] = check_fnew(BT * C), dgr[r] = check_fnew(E * C), dw1r[r] = check_fnew(E * Fl * C);
    db1r[r] = check_fnew(E * Fl), dw2r[r] = check_fnew(E * C * Fl), db2r[r] = check_fnew(E * C);
    CHECK_OK(fy_moe_backward(dir[r], dgr[r], dw1r[r], db1r[r], dw2r[r], db2r[r], R, inp, router[r], rowsr[r], gate, w1r,
                             w2r, 0.3f, false, &dt));
    CHECKF(pair.k == 3, "moe tp rank %d: %d sums in backward, wanted 2 (the weights' and the input's gradients)", r,
           pair.k - 1);
  }
  // Rank 0's whole results are one rank's; its slices' gradients are the matching parts.
  moe_tp_slice(w1r, b1r, w2r, dw1, db1, dw2, C, F, E, 0);
  double e;
  CHECKF((e = check_rel_err(outr[0], out, BT * C)) < 1e-5, "moe tp BT %lld F %lld gelu %d mask %d: forward err %g", (long long)BT, (long long)F, gelu, mask_every, e);
  CHECK(bal[0] == balance && bal[1] == balance && memcmp(router[0], route, (size_t)(BT * S) * 4) == 0);
  CHECKF((e = check_rel_err(dir[0], di, BT * C)) < 1e-5, "moe tp dinp err %g", e);
  CHECKF((e = check_rel_err(dgr[0], dg, E * C)) < 1e-5, "moe tp dgate err %g", e);
  CHECKF((e = check_rel_err(dw1r[0], w1r, E * Fl * C)) < 1e-5, "moe tp dw1 err %g", e);
  CHECKF((e = check_rel_err(db1r[0], b1r, E * Fl)) < 1e-5, "moe tp db1 err %g", e);
  CHECKF((e = check_rel_err(dw2r[0], w2r, E * C * Fl)) < 1e-5, "moe tp dw2 err %g", e);
  CHECKF((e = check_rel_err(db2r[0], db2, E * C)) < 1e-5, "moe tp db2 err %g", e);
  for (int r = 0; r < 2; r++) {
    float *bufs[] = {outr[r], router[r], rowsr[r], dir[r], dgr[r], dw1r[r], db1r[r], dw2r[r], db2r[r]};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) free(bufs[i]);
  }
  float *bufs[] = {inp, gate, w1, b1, w2, b2, R, out, route, rows, di, dg, dw1, db1, dw2, db2, w1r, b1r, w2r};
  for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) free(bufs[i]);
  free(mask);
}

static void test_moe(void) {
  // fy_moe_rows: 3 significant bits, at least 8, under 1/8 more rows
  CHECK(fy_moe_rows(0) == 0 && fy_moe_rows(1) == 8 && fy_moe_rows(8) == 8 && fy_moe_rows(15) == 15);
  CHECK(fy_moe_rows(16) == 16 && fy_moe_rows(17) == 18 && fy_moe_rows(33) == 36 && fy_moe_rows(1000) == 1024);
  bool bound = true;
  for (int64_t n = 1; n < 5000; n++) bound &= fy_moe_rows(n) >= n && fy_moe_rows(n) <= n + n / 8 + 8;
  CHECK(bound);
  moe_case(13, 6, 5, 4, 2, false, true, false);
  moe_case(11, 5, 7, 3, 1, true, false, false);
  moe_case(9, 4, 3, 3, 3, false, true, false);   // every expert for every token
  moe_case(40, 6, 5, 4, 2, true, true, true);    // expert 3 gets no token (more than 8 rows an expert)
  moe_case_masked(13, 6, 5, 4, 2, false, true, false, 3);  // tokens 1, 4, 7, 10 padding: no expert
  moe_tp_case(13, 6, 8, 4, 2, false, 0);  // tensor parallelism over 2 ranks, emulated
  moe_tp_case(40, 6, 10, 4, 2, true, 3);  // (more than 8 rows an expert, padding)
}

int main(void) {
  test_matmul();
  test_matmul16();
  test_embedding();
  test_layernorm();
  test_linear();
  test_moe();
  test_attention();
  test_elementwise();
  test_dropout();
  test_crossentropy();
  test_adamw();
  test_sumsq();
  test_bf16_grads();
  test_params_overwrite();
  fy_matmul_cache_clear();
  return check_summary("ops");
}
