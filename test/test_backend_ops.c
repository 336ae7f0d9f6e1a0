// test_backend_ops: every CUDA kernel (ops/cuda/ops_cuda.h) against the CPU kernel of the same op
// (ops/ops.h), in the style of ggml's test-backend-ops. Inputs are random, of odd sizes (B=3,
// T=37, C=72, NH=6, V=1001 and a few shapes that cross attention's 64-row tiles and reach its
// largest head; in bf16, head sizes that are multiples of 16 take the tensor-core kernels), copied
// to the GPU through the cuda device's own copy; outputs come back the same way and are compared
// by normalised error ||gpu - cpu|| / ||cpu||: fp32 within 1e-5 (matrix products 1e-4), bf16
// within 1e-2. For bf16 the CPU kernel gets the same bf16-rounded inputs,
// widened, so only the GPU's arithmetic and output rounding are measured. Backward kernels start
// from random gradients, so accumulation (+=) is checked with them. The cuda device itself
// (accounting, streams, events, host functions, pinning, owns, copy statistics) is checked first.
//
// Without a GPU (no driver, no device) the program exits 77: meson counts it as skipped.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/device.h"
#include "core/device_cuda.h"
#include "core/dtype.h"
#include "ops/cuda/ops_cuda.h"
#include "ops/cuda/parts.h"
#include "ops/dropout.h"
#include "ops/ops.h"
#include "planner/probe.h"
#include "runtime/engine.h"
#include "runtime/engine_cuda.h"
#include "runtime/offload.h"
#include "runtime/model.h"
#include "test/check.h"

// ---- helpers ----

static struct fy_device *dev;
static fy_stream *st;
static cudaStream_t cs;

// Random values, already representable in dt (so the CPU sees exactly what the GPU sees).
static float *frand_new(int64_t n, float scale, enum fy_dtype dt) {
  float *p = check_fnew(n);
  for (int64_t i = 0; i < n; i++) p[i] = check_frand(scale);
  if (dt == FY_BF16)
    for (int64_t i = 0; i < n; i++) p[i] = fy_bf16_to_f32(fy_f32_to_bf16(p[i]));
  return p;
}
static float *fdup(const float *x, int64_t n) {
  float *p = check_fnew(n);
  memcpy(p, x, (size_t)n * sizeof(float));
  return p;
}

// Device buffers of the test, freed together at the end of each case.
#define MAX_BUFS 64
static struct { void *p; size_t n; } bufs[MAX_BUFS];
static int nbufs;

static void *dalloc(size_t n) {
  void *p = NULL;
  fy_status s = fy_device_alloc(dev, n, &p);
  if (s != FY_OK || nbufs == MAX_BUFS) {
    fprintf(stderr, "backend_ops: device allocation of %zu bytes failed: %s\n", n, fy_error_msg());
    exit(1);
  }
  bufs[nbufs].p = p;
  bufs[nbufs].n = n;
  nbufs++;
  CHECK_OK(dev->ops->memset_async(st, p, 0, n));
  return p;
}
static void dfree_all(void) {
  CHECK_OK(fy_stream_sync(st));
  for (int i = 0; i < nbufs; i++) fy_device_dealloc(dev, bufs[i].p, bufs[i].n);
  nbufs = 0;
}
static void *dput_raw(const void *h, size_t n) {
  void *d = dalloc(n);
  CHECK_OK(fy_copy_async(st, d, h, n));
  CHECK_OK(fy_stream_sync(st));
  return d;
}
static void *dput(const float *h, int64_t n, enum fy_dtype dt) {
  size_t bytes = (size_t)n * fy_dtype_size(dt);
  void *tmp = malloc(bytes ? bytes : 1);
  if (!tmp) abort();
  fy_convert_from_f32(tmp, dt, h, (size_t)n);
  void *d = dput_raw(tmp, bytes);
  free(tmp);
  return d;
}
static void dget(float *h, const void *d, int64_t n, enum fy_dtype dt) {
  size_t bytes = (size_t)n * fy_dtype_size(dt);
  void *tmp = malloc(bytes ? bytes : 1);
  if (!tmp) abort();
  CHECK_OK(fy_stream_sync(st));  // the kernels that wrote d are done (and their errors surface)
  CHECK_OK(fy_copy_async(st, tmp, d, bytes));
  CHECK_OK(fy_stream_sync(st));
  fy_convert_to_f32(h, tmp, dt, (size_t)n);
  free(tmp);
}
// The GPU's result in d against the CPU's in want.
static void cmp_dev(const char *what, enum fy_dtype dt, const void *d, const float *want, int64_t n,
                    bool gemm) {
  float *got = check_fnew(n);
  dget(got, d, n, dt);
  double tol = dt == FY_BF16 ? 1e-2 : gemm ? 1e-4 : 1e-5;
  double err = check_rel_err(got, want, n);
  bool finite = true;
  for (int64_t i = 0; i < n; i++) finite = finite && isfinite(got[i]);
  fprintf(stderr, "  %-40s %-4s err %.2e (tol %.0e)\n", what, fy_dtype_name(dt), err, tol);
  CHECKF(finite && err <= tol, "%s %s: err %.3e > %.0e (or not finite)", what, fy_dtype_name(dt),
         err, tol);
  free(got);
}

static const enum fy_dtype dtypes[] = {FY_F32, FY_BF16};

// ---- the device ----

static int host_fn_calls;
static void host_fn(void *arg) { (void)arg; host_fn_calls++; }

static void test_device(void) {
  fprintf(stderr, "device %s\n", dev->name);
  CHECK(dev->kind == FY_DEVICE_CUDA);
  size_t before = dev->bytes_in_use;
  void *p = NULL, *q = NULL;
  CHECK_OK(fy_device_alloc(dev, 1000, &p));
  CHECK(dev->bytes_in_use == before + 1024);  // counted in cudaMalloc's 256-byte units
  CHECK(fy_device_owns(dev, p));
  int on_stack = 0;
  CHECK(!fy_device_owns(dev, &on_stack));
  CHECK_OK(fy_device_alloc(dev, 0, &q));
  fy_device_dealloc(dev, q, 0);
  // The cap: a second device of 4 KiB refuses 8 KiB with FY_ERR_NOMEM.
  struct fy_device *small = NULL;
  CHECK_OK(fy_device_cuda_create(fy_cuda_ordinal(dev), 4096, &small));
  if (small) {
    void *r = NULL;
    CHECK_ERR(fy_device_alloc(small, 8192, &r), FY_ERR_NOMEM);
    CHECK(small->bytes_in_use == 0);
    CHECK_OK(fy_device_alloc(small, 4096, &r));
    CHECK(small->bytes_in_use == 4096 && small->bytes_peak == 4096);
    fy_device_dealloc(small, r, 4096);
    CHECK(small->bytes_in_use == 0);
    fy_device_free(small);
  }
  CHECK_ERR(fy_device_cuda_create(1 << 20, 0, &small), FY_ERR_INVALID);

  // Copies in both directions on two streams ordered by an event, a host function after them.
  enum { N = 1 << 20 };
  unsigned char *h = aligned_alloc(4096, N), *back = malloc(N);
  for (int i = 0; i < N; i++) h[i] = (unsigned char)(i * 7 + 3);
  memset(back, 0, N);
  CHECK_OK(fy_cuda_host_pin(h, N));  // pinned: a truly asynchronous copy
  void *d = NULL;
  CHECK_OK(fy_device_alloc(dev, N, &d));
  fy_stream *s2 = NULL;
  fy_event *e = NULL;
  CHECK_OK(fy_stream_create(dev, &s2));
  CHECK_OK(fy_event_create(dev, &e));
  struct fy_copy_stats cs0, cs1;
  fy_device_copy_stats(dev, &cs0);
  CHECK_OK(dev->ops->memset_async(st, d, 0xab, N));
  CHECK_OK(fy_copy_async(st, d, h, N / 2));
  CHECK_OK(fy_event_record(e, st));
  CHECK_OK(fy_stream_wait(s2, e));
  CHECK_OK(fy_copy_async(s2, back, d, N));
  host_fn_calls = 0;
  CHECK_OK(fy_stream_enqueue(s2, host_fn, NULL));
  CHECK_OK(fy_event_record(e, s2));
  CHECK_OK(fy_event_sync(e));
  CHECK(host_fn_calls == 1);
  CHECK(memcmp(back, h, N / 2) == 0);
  CHECK(back[N / 2] == 0xab && back[N - 1] == 0xab);
  fy_device_copy_stats(dev, &cs1);
  CHECK(cs1.bytes[0] - cs0.bytes[0] == N / 2);
  CHECK(cs1.bytes[1] - cs0.bytes[1] == N);
  fy_cuda_host_unpin(h);
  fy_event_free(e);
  fy_stream_free(s2);
  fy_device_dealloc(dev, d, N);
  fy_device_dealloc(dev, p, 1000);
  CHECK(dev->bytes_in_use == before);
  free(h);
  free(back);
}

// ---- the ops ----

enum { B = 3, T = 37, C = 72, NH = 6, V = 1001, BT = B * T };

static void test_embedding(enum fy_dtype dt) {
  int32_t ids[BT];
  for (int i = 0; i < BT; i++)  // half the ids among 20 values: many repeats to sum
    ids[i] = (int32_t)(i % 2 ? check_urand() * 20 : check_urand() * V);
  ids[0] = V - 1;
  float *table = frand_new((int64_t)V * C, 1.0f, dt);
  float *out = check_fnew(BT * C);
  fy_embedding_forward(out, ids, table, BT, C);
  void *d_table = dput(table, (int64_t)V * C, dt), *d_out = dalloc(BT * C * fy_dtype_size(dt));
  int32_t *d_ids = dput_raw(ids, sizeof ids);
  CHECK_OK(fy_cuda_embedding_forward(d_out, d_ids, d_table, dt, BT, C, cs));
  cmp_dev("embedding forward", dt, d_out, out, BT * C, false);

  float *dout = frand_new(BT * C, 1.0f, dt), *dtable = frand_new((int64_t)V * C, 1.0f, dt);
  void *d_dout = dput(dout, BT * C, dt), *d_dtable = dput(dtable, (int64_t)V * C, dt);
  fy_embedding_backward(dtable, dout, ids, BT, C, V);
  CHECK_OK(fy_cuda_embedding_backward(d_dtable, d_dout, d_ids, dt, BT, C, V, cs));
  cmp_dev("embedding backward dtable +=", dt, d_dtable, dtable, (int64_t)V * C, false);
  // A wide table: more than one channel block per row range.
  {
    const int64_t C2 = 300;
    float *g2 = frand_new(BT * C2, 1.0f, dt), *t2 = frand_new((int64_t)V * C2, 1.0f, dt);
    void *d_g2 = dput(g2, BT * C2, dt), *d_t2 = dput(t2, (int64_t)V * C2, dt);
    fy_embedding_backward(t2, g2, ids, BT, C2, V);
    CHECK_OK(fy_cuda_embedding_backward(d_t2, d_g2, d_ids, dt, BT, C2, V, cs));
    cmp_dev("embedding backward C=300", dt, d_t2, t2, (int64_t)V * C2, false);
    free(g2);
    free(t2);
  }
  dfree_all();
  free(table);
  free(out);
  free(dout);
  free(dtable);
}

// C (a parameter: the file's C elsewhere) picks the kernels' path: 16-byte pieces when a row is
// whole pieces (72; 264, more pieces than lanes), single elements otherwise (37).
static void test_layernorm_c(enum fy_dtype dt, const int64_t C) {
  fprintf(stderr, "  layernorm C=%lld\n", (long long)C);
  float *inp = frand_new(BT * C, 2.0f, dt);
  for (int i = 0; i < BT * C; i++) inp[i] += 0.5f;  // a mean away from 0
  if (dt == FY_BF16)
    for (int i = 0; i < BT * C; i++) inp[i] = fy_bf16_to_f32(fy_f32_to_bf16(inp[i]));
  float *w = frand_new(C, 1.0f, dt), *bias = frand_new(C, 1.0f, dt);
  float *out = check_fnew(BT * C), *mean = check_fnew(BT), *rstd = check_fnew(BT);
  fy_layernorm_forward(out, mean, rstd, inp, w, bias, BT, C, 1e-5f);
  void *d_inp = dput(inp, BT * C, dt), *d_w = dput(w, C, dt), *d_b = dput(bias, C, dt);
  void *d_out = dalloc(BT * C * fy_dtype_size(dt));
  float *d_mean = dalloc(BT * sizeof(float)), *d_rstd = dalloc(BT * sizeof(float));
  CHECK_OK(fy_cuda_layernorm_forward(d_out, d_mean, d_rstd, d_inp, d_w, d_b, dt, BT, C, 1e-5f, cs));
  cmp_dev("layernorm forward out", dt, d_out, out, BT * C, false);
  cmp_dev("layernorm forward mean", FY_F32, d_mean, mean, BT, false);
  cmp_dev("layernorm forward rstd", FY_F32, d_rstd, rstd, BT, false);

  float *dout = frand_new(BT * C, 1.0f, dt), *dinp = frand_new(BT * C, 1.0f, dt);
  float *dw = frand_new(C, 1.0f, dt), *db = frand_new(C, 1.0f, dt);
  void *d_dout = dput(dout, BT * C, dt), *d_dinp = dput(dinp, BT * C, dt);
  void *d_dw = dput(dw, C, dt), *d_db = dput(db, C, dt);
  fy_layernorm_backward(dinp, dw, db, dout, inp, w, mean, rstd, BT, C);
  float *d_lscr = dalloc(2 * FY_CUDA_LN_PARTS * C * sizeof(float));
  CHECK_OK(fy_cuda_layernorm_backward(d_dinp, d_dw, d_db, d_dout, d_inp, d_w, d_mean, d_rstd, dt,
                                      BT, C, d_lscr, cs));
  cmp_dev("layernorm backward dinp +=", dt, d_dinp, dinp, BT * C, false);
  cmp_dev("layernorm backward dweight +=", dt, d_dw, dw, C, false);
  cmp_dev("layernorm backward dbias +=", dt, d_db, db, C, false);
  // The parameter half alone, overwriting.
  fy_layernorm_backward_params(dw, db, dout, inp, mean, rstd, BT, C, false);
  CHECK_OK(fy_cuda_layernorm_backward_params(d_dw, d_db, d_dout, d_inp, d_mean, d_rstd, dt, BT, C,
                                             false, NULL, cs));
  cmp_dev("layernorm backward_params dweight =", dt, d_dw, dw, C, false);
  cmp_dev("layernorm backward_params dbias =", dt, d_db, db, C, false);
  // Split over row ranges, with more rows than ranges times 32 lanes.
  {
    const int64_t R = 1000;
    float *x2 = frand_new(R * C, 1.0f, dt), *g2 = frand_new(R * C, 1.0f, dt);
    float *m2 = check_fnew(R), *r2 = check_fnew(R), *o2 = check_fnew(R * C);
    fy_layernorm_forward(o2, m2, r2, x2, NULL, NULL, R, C, 1e-5f);
    void *d_x2 = dput(x2, R * C, dt), *d_g2 = dput(g2, R * C, dt);
    float *d_m2 = dput(m2, R, FY_F32), *d_r2 = dput(r2, R, FY_F32);
    fy_layernorm_backward_params(dw, db, g2, x2, m2, r2, R, C, true);
    CHECK_OK(fy_cuda_layernorm_backward_params(d_dw, d_db, d_g2, d_x2, d_m2, d_r2, dt, R, C, true,
                                               d_lscr, cs));
    cmp_dev("layernorm backward_params split dw +=", dt, d_dw, dw, C, false);
    cmp_dev("layernorm backward_params split db +=", dt, d_db, db, C, false);
    free(x2); free(g2); free(m2); free(r2); free(o2);
  }
  // No affine parameters.
  fy_layernorm_forward(out, mean, rstd, inp, NULL, NULL, BT, C, 1e-5f);
  CHECK_OK(fy_cuda_layernorm_forward(d_out, d_mean, d_rstd, d_inp, NULL, NULL, dt, BT, C, 1e-5f, cs));
  cmp_dev("layernorm forward (no weight, bias)", dt, d_out, out, BT * C, false);
  fy_layernorm_backward(dinp, NULL, NULL, dout, inp, NULL, mean, rstd, BT, C);
  CHECK_OK(fy_cuda_layernorm_backward(d_dinp, NULL, NULL, d_dout, d_inp, NULL, d_mean, d_rstd, dt,
                                      BT, C, NULL, cs));
  cmp_dev("layernorm backward (no weight)", dt, d_dinp, dinp, BT * C, false);
  dfree_all();
  free(inp); free(w); free(bias); free(out); free(mean); free(rstd);
  free(dout); free(dinp); free(dw); free(db);
}

static void test_layernorm(enum fy_dtype dt) {
  test_layernorm_c(dt, C);
  test_layernorm_c(dt, 37);
  test_layernorm_c(dt, 264);
}

static void test_elementwise(enum fy_dtype dt) {
  const int64_t N = BT * C + 5;
  float *a = frand_new(N, 1.0f, dt), *b = frand_new(N, 1.0f, dt), *out = check_fnew(N);
  void *d_a = dput(a, N, dt), *d_b = dput(b, N, dt), *d_out = dalloc(N * fy_dtype_size(dt));
  fy_relu_forward(out, a, N);
  CHECK_OK(fy_cuda_relu_forward(d_out, d_a, dt, N, cs));
  cmp_dev("relu forward", dt, d_out, out, N, false);
  float *dout = frand_new(N, 1.0f, dt), *dinp = frand_new(N, 1.0f, dt);
  void *d_dout = dput(dout, N, dt), *d_dinp = dput(dinp, N, dt);
  fy_relu_backward(dinp, dout, out, N);
  CHECK_OK(fy_cuda_relu_backward(d_dinp, d_dout, d_out, dt, N, cs));
  cmp_dev("relu backward dinp +=", dt, d_dinp, dinp, N, false);
  float *ip = fdup(dout, N);  // in place: dinp is dout, written over (the graph's shared gradient)
  void *d_ip = dput(ip, N, dt);
  fy_relu_backward(ip, ip, out, N);
  CHECK_OK(fy_cuda_relu_backward(d_ip, d_ip, d_out, dt, N, cs));
  cmp_dev("relu backward in place", dt, d_ip, ip, N, false);

  fy_gelu_forward(out, a, N);
  CHECK_OK(fy_cuda_gelu_forward(d_out, d_a, dt, N, cs));
  cmp_dev("gelu forward", dt, d_out, out, N, false);
  float *dinp2 = frand_new(N, 1.0f, dt);
  void *d_dinp2 = dput(dinp2, N, dt);
  fy_gelu_backward(dinp2, dout, a, N);
  CHECK_OK(fy_cuda_gelu_backward(d_dinp2, d_dout, d_a, dt, N, cs));
  cmp_dev("gelu backward dinp +=", dt, d_dinp2, dinp2, N, false);
  free(dinp2);
  memcpy(ip, dout, (size_t)N * sizeof(float));
  d_ip = dput(ip, N, dt);
  fy_gelu_backward(ip, ip, a, N);
  CHECK_OK(fy_cuda_gelu_backward(d_ip, d_ip, d_a, dt, N, cs));
  cmp_dev("gelu backward in place", dt, d_ip, ip, N, false);
  free(ip);

  fy_add_forward(out, a, b, N);
  CHECK_OK(fy_cuda_add_forward(d_out, d_a, d_b, dt, N, cs));
  cmp_dev("add forward", dt, d_out, out, N, false);
  float *da = fdup(a, N), *db = fdup(b, N);
  fy_add_backward(da, db, dout, N);
  CHECK_OK(fy_cuda_add_backward(d_a, d_b, d_dout, dt, N, cs));
  cmp_dev("add backward da +=", dt, d_a, da, N, false);
  cmp_dev("add backward db +=", dt, d_b, db, N, false);
  fy_add_backward(NULL, db, dout, N);
  CHECK_OK(fy_cuda_add_backward(NULL, d_b, d_dout, dt, N, cs));
  cmp_dev("add backward (da NULL)", dt, d_b, db, N, false);
  dfree_all();
  free(a); free(b); free(out); free(dout); free(dinp); free(da); free(db);
}

// Dropout fused with the residual add: the GPU draws the CPU's masks (ops/dropout.h), element for
// element (checked exactly on a mask of 0s and 2s), and the sums agree within rounding; rows of a
// multiple of 16 bytes (pieces), of an odd width, and misaligned rows (element by element).
static void test_dropout_add_c(enum fy_dtype dt, int64_t rows, int64_t C, int64_t skew) {
  const int64_t N = rows * C;
  const uint64_t key = fy_dropout_key(1337, 3);
  const int64_t u0 = 123457;
  char what[96];
  float *zero = check_fnew(N + skew), *one = check_fnew(N + skew), *mask = check_fnew(N), *got = check_fnew(N + skew);
  for (int64_t i = 0; i < N + skew; i++) one[i] = 1.0f;
  void *d_zero = dput(zero, N + skew, dt), *d_one = dput(one, N + skew, dt), *d_m = dalloc((size_t)(N + skew) * fy_dtype_size(dt));
  const size_t es = fy_dtype_size(dt);
  fy_dropout_add_forward(mask, zero, one, rows, C, key, u0, 0.5f);
  CHECK_OK(fy_cuda_dropout_add_forward((char *)d_m + skew * es, (char *)d_zero + skew * es, (char *)d_one + skew * es,
                                       dt, rows, C, key, u0, 0.5f, cs));
  dget(got, d_m, N + skew, dt);
  int64_t differ = 0;
  for (int64_t i = 0; i < N; i++) differ += got[skew + i] != mask[i];
  snprintf(what, sizeof what, "dropout mask (%lld x %lld, skew %lld)", (long long)rows, (long long)C, (long long)skew);
  fprintf(stderr, "  %-40s %-4s %lld of %lld elements differ\n", what, fy_dtype_name(dt), (long long)differ, (long long)N);
  CHECKF(differ == 0, "%s %s: %lld elements differ from the cpu's", what, fy_dtype_name(dt), (long long)differ);

  float *a = frand_new(N, 1.0f, dt), *b = frand_new(N, 1.0f, dt), *out = check_fnew(N);
  void *d_a = dput(a, N, dt), *d_b = dput(b, N, dt), *d_out = dalloc((size_t)N * es);
  fy_dropout_add_forward(out, a, b, rows, C, key, u0, 0.1f);
  CHECK_OK(fy_cuda_dropout_add_forward(d_out, d_a, d_b, dt, rows, C, key, u0, 0.1f, cs));
  snprintf(what, sizeof what, "dropout-add forward (C %lld)", (long long)C);
  cmp_dev(what, dt, d_out, out, N, false);
  float *dout = frand_new(N, 1.0f, dt), *da = fdup(a, N), *db = fdup(b, N);
  void *d_dout = dput(dout, N, dt);
  fy_dropout_add_backward(da, db, dout, rows, C, key, u0, 0.1f);
  CHECK_OK(fy_cuda_dropout_add_backward(d_a, d_b, d_dout, dt, rows, C, key, u0, 0.1f, cs));
  snprintf(what, sizeof what, "dropout-add backward da += (C %lld)", (long long)C);
  cmp_dev(what, dt, d_a, da, N, false);
  snprintf(what, sizeof what, "dropout-add backward db += (C %lld)", (long long)C);
  cmp_dev(what, dt, d_b, db, N, false);
  fy_dropout_add_backward(NULL, db, dout, rows, C, key, u0, 0.1f);
  CHECK_OK(fy_cuda_dropout_add_backward(NULL, d_b, d_dout, dt, rows, C, key, u0, 0.1f, cs));
  cmp_dev("dropout-add backward (da NULL)", dt, d_b, db, N, false);
  dfree_all();
  free(zero); free(one); free(mask); free(got); free(a); free(b); free(out); free(dout); free(da); free(db);
}

static void test_dropout_add(enum fy_dtype dt) {
  test_dropout_add_c(dt, BT, C, 0);
  test_dropout_add_c(dt, 37, 264, 0);
  test_dropout_add_c(dt, BT, 37, 0);
  test_dropout_add_c(dt, 9000, 16, 1);  // misaligned; more rows than blocks
}

// A row-split linear's bias, added to every row after the partial products are summed; skew
// elements into the buffers leaves them misaligned (the element-by-element path).
static void test_bias_add_c(enum fy_dtype dt, int64_t rows, int64_t C, int64_t skew) {
  const int64_t N = rows * C;
  const size_t es = fy_dtype_size(dt);
  float *out = frand_new(N + skew, 1.0f, dt), *bias = frand_new(C + skew, 1.0f, dt);
  void *d_out = dput(out, N + skew, dt), *d_bias = dput(bias, C + skew, dt);
  fy_bias_add(out + skew, bias + skew, rows, C);
  CHECK_OK(fy_cuda_bias_add((char *)d_out + skew * es, (char *)d_bias + skew * es, dt, rows, C, cs));
  char what[64];
  snprintf(what, sizeof what, "bias add (%lld x %lld, skew %lld)", (long long)rows, (long long)C, (long long)skew);
  cmp_dev(what, dt, d_out, out, N + skew, false);
  dfree_all();
  free(out);
  free(bias);
}

static void test_bias_add(enum fy_dtype dt) {
  test_bias_add_c(dt, BT, C, 0);
  test_bias_add_c(dt, 37, 264, 0);
  test_bias_add_c(dt, BT, 37, 0);
  test_bias_add_c(dt, 9000, 16, 1);
  test_bias_add_c(dt, 1, 8, 0);
}

// fp32 -> bf16 rounds to nearest even exactly as the CPU's conversion; bf16 -> fp32 is exact.
static void test_convert(void) {
  const int64_t N = 100003;
  float *a = frand_new(N, 100.0f, FY_F32), *back = check_fnew(N);
  uint16_t *want = malloc((size_t)N * 2), *got = malloc((size_t)N * 2);
  if (!want || !got) abort();
  a[0] = 1.0f + 0x1p-8f;  // a tie: rounds to even (1.0)
  a[1] = -0.0f;
  a[2] = 3.0e38f;
  fy_convert_from_f32(want, FY_BF16, a, (size_t)N);
  void *d_a = dput(a, N, FY_F32), *d_16 = dalloc((size_t)N * 2), *d_back = dalloc((size_t)N * 4);
  CHECK_OK(fy_cuda_convert(d_16, FY_BF16, d_a, FY_F32, N, cs));
  CHECK_OK(fy_stream_sync(st));
  CHECK_OK(fy_copy_async(st, got, d_16, (size_t)N * 2));
  CHECK_OK(fy_stream_sync(st));
  int64_t diff = 0;
  for (int64_t i = 0; i < N; i++) diff += got[i] != want[i];
  CHECKF(diff == 0, "convert f32 -> bf16: %lld of %lld differ from the CPU's rounding", (long long)diff, (long long)N);
  CHECK_OK(fy_cuda_convert(d_back, FY_F32, d_16, FY_BF16, N, cs));
  float *wback = check_fnew(N);
  fy_convert_to_f32(wback, want, FY_BF16, (size_t)N);
  dget(back, d_back, N, FY_F32);
  CHECK(memcmp(back, wback, (size_t)N * 4) == 0);
  CHECK_ERR(fy_cuda_convert(d_16, FY_F16, d_a, FY_F32, N, cs), FY_ERR_UNSUPPORTED);
  fprintf(stderr, "  %-40s bf16 exact\n", "convert f32 <-> bf16");
  dfree_all();
  free(a); free(back); free(want); free(got); free(wback);
}

static void test_crossentropy(enum fy_dtype dt) {
  float *logits = frand_new((int64_t)BT * V, 4.0f, dt);
  int32_t targets[BT];
  for (int i = 0; i < BT; i++) targets[i] = i % 9 == 4 ? -100 : (int32_t)(check_urand() * V);
  targets[1] = 0;
  targets[2] = V - 1;
  float *losses = check_fnew(BT);
  int64_t count = fy_crossentropy_forward(losses, logits, targets, BT, V);
  void *d_logits = dput(logits, (int64_t)BT * V, dt);
  int32_t *d_t = dput_raw(targets, sizeof targets);
  float *d_losses = dalloc(BT * sizeof(float)), *d_lse = dalloc(BT * sizeof(float));
  CHECK_OK(fy_cuda_crossentropy_forward(d_losses, d_lse, d_logits, d_t, dt, BT, V, cs));
  // The losses are fp32 from the same inputs whatever dt: held to fp32's tolerance.
  cmp_dev("crossentropy forward losses", FY_F32, d_losses, losses, BT, false);

  float dloss = 1.0f / (float)count;
  float *dlogits = check_fnew((int64_t)BT * V);
  fy_crossentropy_backward(dlogits, logits, targets, BT, V, dloss);
  void *d_dl = dalloc((size_t)BT * V * fy_dtype_size(dt));
  CHECK_OK(fy_cuda_crossentropy_backward(d_dl, d_logits, d_t, d_lse, dt, BT, V, dloss, cs));
  cmp_dev("crossentropy backward (saved lse)", dt, d_dl, dlogits, (int64_t)BT * V, false);
  CHECK_OK(fy_cuda_crossentropy_backward(d_dl, d_logits, d_t, NULL, dt, BT, V, dloss, cs));
  cmp_dev("crossentropy backward (recomputed)", dt, d_dl, dlogits, (int64_t)BT * V, false);
  CHECK_OK(fy_cuda_crossentropy_backward(d_logits, d_logits, d_t, NULL, dt, BT, V, dloss, cs));
  cmp_dev("crossentropy backward (in place)", dt, d_logits, dlogits, (int64_t)BT * V, false);
  dfree_all();
  free(logits); free(losses); free(dlogits);
}

static void test_adamw(enum fy_dtype dt) {
  const int64_t n = 100003;
  float *p = frand_new(n, 1.0f, FY_F32), *m = frand_new(n, 0.01f, FY_F32), *v = check_fnew(n);
  float *g = frand_new(n, 1.0f, dt);
  for (int64_t i = 0; i < n; i++) v[i] = check_frand(0.01f) * check_frand(0.01f) + 1e-4f;  // v >= 0
  float *d_p = dput(p, n, FY_F32), *d_m = dput(m, n, FY_F32), *d_v = dput(v, n, FY_F32);
  void *d_g = dput(g, n, dt);
  uint16_t *d_p16 = dalloc((size_t)n * 2);
  fy_adamw_update(p, m, v, g, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 3, 0.5f);
  CHECK_OK(fy_cuda_adamw_update(d_p, d_m, d_v, d_g, dt, d_p16, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f,
                                3, 0.5f, cs));
  // The state is fp32 whatever the gradient's type, and the inputs are the same: fp32 tolerance.
  cmp_dev("adamw param", FY_F32, d_p, p, n, false);
  cmp_dev("adamw m", FY_F32, d_m, m, n, false);
  cmp_dev("adamw v", FY_F32, d_v, v, n, false);
  cmp_dev("adamw param bf16 copy", FY_BF16, d_p16, p, n, false);
  // Deferred (the offload engine's chunks on the device): the scale and the skip flag are read
  // from device memory when the kernel runs; a skipped step writes nothing, the bf16 copy neither.
  float scale_skip[4] = {0.25f, 0.0f, 0.25f, 1.0f};
  float *d_ss = dput(scale_skip, 4, FY_F32);
  fy_adamw_update(p, m, v, g, n, 2e-3f, 0.9f, 0.95f, 1e-8f, 0.0f, 4, 0.25f);
  CHECK_OK(fy_cuda_adamw_update_deferred(d_p, d_m, d_v, d_g, dt, d_p16, n, 2e-3f, 0.9f, 0.95f, 1e-8f, 0.0f, 4, d_ss,
                                         cs));
  CHECK_OK(fy_cuda_adamw_update_deferred(d_p, d_m, d_v, d_g, dt, d_p16, n, 2e-3f, 0.9f, 0.95f, 1e-8f, 0.0f, 5,
                                         d_ss + 2, cs));  // skipped
  cmp_dev("adamw deferred param", FY_F32, d_p, p, n, false);
  cmp_dev("adamw deferred m", FY_F32, d_m, m, n, false);
  cmp_dev("adamw deferred v", FY_F32, d_v, v, n, false);
  cmp_dev("adamw deferred bf16 copy", FY_BF16, d_p16, p, n, false);
  CHECK_ERR(fy_cuda_adamw_update_deferred(d_p, d_m, d_v, d_g, dt, NULL, n, 2e-3f, 0.9f, 0.95f, 1e-8f, 0.0f, 4, NULL,
                                          cs), FY_ERR_INVALID);
  dfree_all();
  free(p); free(m); free(v); free(g);
}

// AdamW with bf16 and 8-bit state against the CPU's fy_adamw_state_update(_bf16): the same bytes
// (weights, codes, scales), not a tolerance: the kernels round every operation as the CPU does.
// Ranges with padding between them and different decay, a short last block, a plain step, a
// deferred one (scale from device memory) and a skipped one; with bf16 gradients the new weights
// are written over them (param_bf16 == grad), as the offloaded chunks use it.
static bool dsame(const void *d, const void *h, size_t n, const char *what) {
  unsigned char *got = malloc(n ? n : 1);
  if (!got) abort();
  CHECK_OK(fy_stream_sync(st));
  CHECK_OK(fy_copy_async(st, got, d, n));
  CHECK_OK(fy_stream_sync(st));
  size_t diff = 0;
  for (size_t i = 0; i < n; i++) diff += got[i] != ((const unsigned char *)h)[i];
  free(got);
  fprintf(stderr, "  %-40s %zu of %zu bytes differ\n", what, diff, n);
  return diff == 0;
}

static void test_adamw_state(enum fy_dtype dt) {
  const int64_t n = 157 * FY_Q8_BLOCK - 99;
  float *p = frand_new(n, 0.1f, FY_F32), *m = check_fnew(n), *v = check_fnew(n), *g = frand_new(n, 1.0f, dt);
  for (int64_t i = 0; i < n; i++) {
    g[i] *= (float)pow(10.0, -4.0 * check_urand());
    if (dt == FY_BF16) g[i] = fy_bf16_to_f32(fy_f32_to_bf16(g[i]));
    m[i] = 0.1f * g[i] * (float)pow(10.0, -2.0 * check_urand());
    v[i] = 0.01f * m[i] * m[i] + 1e-12f * (i % 3);
  }
  g[1000] = 50.0f;  // one block with an outlier
  // blocks whose absmax leaves [2^-126, 2^126) (the 8-bit ratio's scaled path): v near 2.4e38, v
  // subnormal, m subnormal (v 0), from zero state
  for (int64_t i = 10 * FY_Q8_BLOCK; i < 13 * FY_Q8_BLOCK; i++) {
    const float f = i < 11 * FY_Q8_BLOCK ? 7e19f : i < 12 * FY_Q8_BLOCK ? 3e-20f : 1e-38f;
    g[i] = (i % FY_Q8_BLOCK == 0 ? 0.99f : g[i]) * f;
    if (dt == FY_BF16) g[i] = fy_bf16_to_f32(fy_f32_to_bf16(g[i]));
    m[i] = v[i] = 0.0f;
  }
  const struct fy_adamw_range r[] = {{0, 10000, 0.1f}, {10016, 1, 0.0f}, {10032, 20000, 0.0f}, {30048, n - 30048 - 40, 0.05f}};
  const int nr = 4;
  CHECK_OK(fy_adamw_ranges_check(n, r, nr));
  uint16_t *g16 = malloc((size_t)n * 2);
  if (!g16) abort();
  for (int64_t i = 0; i < n; i++) g16[i] = fy_f32_to_bf16(g[i]);
  for (int fi = 1; fi <= 2; fi++) {
    const enum fy_state_format f = (enum fy_state_format)fi;
    const size_t mb = fy_state_moment_bytes(f, n);
    void *hm = malloc(mb), *hv = malloc(mb);
    float *hp = fdup(p, n);
    if (!hm || !hv) abort();
    fy_state_encode(f, FY_MOMENT_M, hm, m, n);
    fy_state_encode(f, FY_MOMENT_V, hv, v, n);
    float *d_p = dput(p, n, FY_F32);
    void *d_m = dput_raw(hm, mb), *d_v = dput_raw(hv, mb), *d_r = dput_raw(r, sizeof r);
    void *d_g = dput(g, n, dt);
    uint16_t *d_p16 = dt == FY_BF16 ? d_g : dalloc((size_t)n * 2);  // bf16: the weights over the gradients
    const float scale_skip[4] = {0.5f, 0.0f, 0.5f, 1.0f};
    float *d_ss = dput(scale_skip, 4, FY_F32);
    uint16_t *gw = malloc((size_t)n * 2), *w16 = malloc((size_t)n * 2);
    if (!gw || !w16) abort();
    bool ok = true;
    char what[64];
    for (int t = 1; t <= 3; t++) {
      if (t > 1) {  // fresh gradients (the bf16 ones were overwritten by the weights)
        CHECK_OK(fy_copy_async(st, d_g, dt == FY_BF16 ? (const void *)g16 : (const void *)g, (size_t)n * fy_dtype_size(dt)));
        CHECK_OK(fy_stream_sync(st));
      }
      memcpy(gw, g16, (size_t)n * 2);
      const float gs = t == 1 ? 1.0f : 0.5f;
      if (t < 3) {  // the CPU skips step 3 as the device's flag says
        if (dt == FY_BF16)
          CHECK_OK(fy_adamw_state_update_bf16(f, hp, hm, hv, gw, n, r, nr, 1e-3f, 0.9f, 0.95f, 1e-8f, t, gs));
        else
          CHECK_OK(fy_adamw_state_update(f, hp, hm, hv, g, n, r, nr, 1e-3f, 0.9f, 0.95f, 1e-8f, t, gs));
      }
      CHECK_OK(fy_cuda_adamw_state_update(f, d_p, d_m, d_v, d_g, dt, d_p16, n, d_r, nr, 1e-3f, 0.9f, 0.95f, 1e-8f, t,
                                          gs, t == 1 ? NULL : d_ss + 2 * (t - 2), cs));
      snprintf(what, sizeof what, "adamw %s state step %d weights", fy_state_format_name(f), t);
      ok &= dsame(d_p, hp, (size_t)n * 4, what);
      snprintf(what, sizeof what, "adamw %s state step %d m", fy_state_format_name(f), t);
      ok &= dsame(d_m, hm, mb, what);
      snprintf(what, sizeof what, "adamw %s state step %d v", fy_state_format_name(f), t);
      ok &= dsame(d_v, hv, mb, what);
      if (t < 3) {  // the bf16 weights: written where a range covers (over the gradients for bf16)
        for (int64_t i = 0; i < n; i++) w16[i] = dt == FY_BF16 ? gw[i] : fy_f32_to_bf16(hp[i]);
        if (dt == FY_F32)  // a copy of its own: written inside the ranges only (zeros elsewhere)
          for (int64_t i = 0, k = 0; i < n; i++) {
            while (k < nr && r[k].off + r[k].n <= i) k++;
            if (!(k < nr && r[k].off <= i)) w16[i] = 0;
          }
        snprintf(what, sizeof what, "adamw %s state step %d bf16 weights", fy_state_format_name(f), t);
        ok &= dsame(d_p16, w16, (size_t)n * 2, what);
      }
    }
    CHECKF(ok, "adamw %s state, %s gradients: the GPU's bytes differ from the CPU's", fy_state_format_name(f),
           fy_dtype_name(dt));
    free(hm), free(hv), free(hp), free(gw), free(w16);
    dfree_all();
  }
  CHECK_ERR(fy_cuda_adamw_state_update(FY_STATE_F32, NULL, NULL, NULL, NULL, dt, NULL, 10, NULL, 1, 1e-3f, 0.9f, 0.95f,
                                       1e-8f, 1, 1.0f, NULL, cs), FY_ERR_UNSUPPORTED);
  free(p), free(m), free(v), free(g), free(g16);
}

// The sum of a chunk's gradients over micro-batches: dst (fp32) = src, then += src, widened from
// dt exactly, so the result equals the CPU's float adds bit for bit.
static void test_accumulate(enum fy_dtype dt) {
  const int64_t n = 100003;
  float *a = frand_new(n, 1.0f, dt), *b = frand_new(n, 1.0f, dt), *want = check_fnew(n), *got = check_fnew(n);
  for (int64_t i = 0; i < n; i++) want[i] = a[i] + b[i];
  void *d_a = dput(a, n, dt), *d_b = dput(b, n, dt);
  float *d_sum = dalloc((size_t)n * 4);
  CHECK_OK(fy_cuda_accumulate(d_sum, d_a, dt, n, true, cs));
  dget(got, d_sum, n, FY_F32);
  CHECKF(memcmp(got, a, (size_t)n * 4) == 0, "accumulate %s (first): not the widened values", fy_dtype_name(dt));
  CHECK_OK(fy_cuda_accumulate(d_sum, d_b, dt, n, false, cs));
  dget(got, d_sum, n, FY_F32);
  CHECKF(memcmp(got, want, (size_t)n * 4) == 0, "accumulate %s (+=): not the CPU's sums", fy_dtype_name(dt));
  fprintf(stderr, "  %-40s %-4s exact\n", "accumulate (= then +=) into fp32", fy_dtype_name(dt));
  dfree_all();
  free(a); free(b); free(want); free(got);
}

// Sizes from one element to past a full grid (1024 blocks of 256): partial grids, a final tree
// over a power of two larger than the parts, and blocks that loop.
static void test_sumsq(enum fy_dtype dt) {
  const int64_t sizes[] = {1, 255, 257, 70001, 1000003};
  for (size_t si = 0; si < sizeof sizes / sizeof *sizes; si++) {
    const int64_t n = sizes[si];
    float *x = frand_new(n, 3.0f, dt);
    double want = fy_sumsq(x, n);
    void *d_x = dput(x, n, dt);
    double *d_out = dalloc(sizeof(double)), *d_scr = dalloc(FY_CUDA_SUMSQ_PARTS * sizeof(double));
    double got[3];
    CHECK_OK(fy_cuda_sumsq(d_out, d_x, dt, n, d_scr, false, cs));
    CHECK_OK(fy_copy_async(st, &got[0], d_out, sizeof(double)));
    CHECK_OK(fy_cuda_sumsq(d_out, d_x, dt, n, d_scr, false, cs));
    CHECK_OK(fy_copy_async(st, &got[1], d_out, sizeof(double)));
    CHECK_OK(fy_cuda_sumsq(d_out, d_x, dt, n, d_scr, true, cs));
    CHECK_OK(fy_copy_async(st, &got[2], d_out, sizeof(double)));
    CHECK_OK(fy_stream_sync(st));
    double err = fabs(got[0] - want) / want;
    fprintf(stderr, "  %-40s %-4s err %.2e (tol 1e-12)\n", "sumsq", fy_dtype_name(dt), err);
    CHECKF(err <= 1e-12, "sumsq %s n=%lld: %.17g vs %.17g", fy_dtype_name(dt), (long long)n, got[0], want);
    CHECKF(memcmp(&got[0], &got[1], sizeof(double)) == 0, "sumsq n=%lld is not deterministic", (long long)n);
    CHECKF(got[2] == 2 * got[0], "sumsq accumulate n=%lld: %.17g vs 2 x %.17g", (long long)n, got[2], got[0]);
    // n = 0 gives exactly 0.
    if (si == 0) {
      CHECK_OK(fy_cuda_sumsq(d_out, d_x, dt, 0, d_scr, false, cs));
      CHECK_OK(fy_copy_async(st, &got[0], d_out, sizeof(double)));
      CHECK_OK(fy_stream_sync(st));
      CHECK(got[0] == 0.0);
    }
    dfree_all();
    free(x);
  }
}

// plain: h's cuBLASLt has no epilogues (the bias is added after the product, rounded once more).
static void test_matmul(struct fy_cuda_blas *h, enum fy_dtype dt, bool plain) {
  const int64_t M = 37, N = 45, K = 72;
  float *a = frand_new(M * K, 1.0f, dt), *b = frand_new(K * N, 1.0f, dt);
  float *bias = frand_new(N, 1.0f, dt), *c0 = frand_new(M * N, 1.0f, dt);
  void *d_a = dput(a, M * K, dt), *d_b = dput(b, K * N, dt), *d_bias = dput(bias, N, dt);
  for (int ta = 0; ta < 2; ta++)
    for (int tb = 0; tb < 2; tb++)
      for (int acc = 0; acc < 2; acc++)
        for (int wb = 0; wb < 2; wb++) {
          float *c = fdup(c0, M * N);
          void *d_c = dput(c, M * N, dt);
          // alpha != 1 only without bias: oneDNN's output scale also scales the bias, cuBLASLt's
          // epilogue adds it unscaled (ops_cuda.h), and nn.Linear uses alpha = 1.
          float beta = acc ? 1.0f : 0.0f, alpha = wb ? 1.0f : 0.7f;
          CHECK_OK(fy_matmul_bias(c, a, b, wb ? bias : NULL, 1, M, N, K, ta, tb, alpha, beta, 0, 0,
                                  0, 0, 0, 0));
          CHECK_OK(fy_cuda_matmul(h, d_c, d_a, d_b, wb ? d_bias : NULL, dt, M, N, K, ta, tb, alpha,
                                  beta, cs));
          char what[64];
          snprintf(what, sizeof what, "matmul ta=%d tb=%d beta=%d bias=%d", ta, tb, acc, wb);
          cmp_dev(what, dt, d_c, c, M * N, true);
          free(c);
        }
  // The same shapes again come from the descriptor cache; a misaligned c (offset by one element)
  // must get its own entry and still be right.
  {
    float *c = fdup(c0, M * N);
    char *d_c = dalloc((size_t)(M * N + 1) * fy_dtype_size(dt));
    void *tmp = dput(c, M * N, dt);
    CHECK_OK(fy_copy_async(st, d_c + fy_dtype_size(dt), tmp, (size_t)(M * N) * fy_dtype_size(dt)));
    CHECK_OK(fy_matmul(c, a, b, M, N, K, false, false, 1.0f, 1.0f));
    CHECK_OK(fy_cuda_matmul(h, d_c + fy_dtype_size(dt), d_a, d_b, NULL, dt, M, N, K, false, false,
                            1.0f, 1.0f, cs));
    cmp_dev("matmul misaligned c", dt, d_c + fy_dtype_size(dt), c, M * N, true);
    free(c);
  }
  // A tuning handle runs the shape's first calls with the heuristic's candidates in turn, then the
  // fastest: every call, accumulating into c, is right. Each call is checked alone: the reference
  // goes on from the GPU's c, for in bf16 each call rounds the sum once, and two sums that began
  // 1 ulp apart drift further apart with every call (16 calls on an H200 reached 1.2e-2).
  {
    struct fy_cuda_blas *t = NULL;
    void *ws = NULL;
    const size_t ws_bytes = (size_t)4 << 20;
    CHECK_OK(fy_device_alloc(dev, ws_bytes, &ws));
    CHECK_OK(fy_cuda_blas_create(ws, ws_bytes, &t));
    fy_cuda_blas_set_tuning(t, 4);
    if (plain) fy_cuda_blas_set_epilogue(t, false);
    float *c = fdup(c0, M * N);
    void *d_c = dput(c, M * N, dt);
    for (int call = 0; call < 16; call++) {
      CHECK_OK(fy_matmul_bias(c, a, b, plain ? NULL : bias, 1, M, N, K, false, true, 1.0f, call ? 1.0f : 0.0f, 0, 0,
                              0, 0, 0, 0));
      CHECK_OK(fy_cuda_matmul(t, d_c, d_a, d_b, d_bias, dt, M, N, K, false, true, 1.0f, call ? 1.0f : 0.0f, cs));
      if (plain) {  // the product rounded to dt, then the bias added
        fy_round_to_dtype(c, c, dt, (size_t)(M * N));
        fy_bias_add(c, bias, M, N);
      }
      fy_round_to_dtype(c, c, dt, (size_t)(M * N));  // the GPU's c is dt after every call: so is the reference's
      char what[64];
      snprintf(what, sizeof what, "matmul while tuning, call %d", call);
      cmp_dev(what, dt, d_c, c, M * N, true);
      dget(c, d_c, M * N, dt);
    }
    CHECK_OK(fy_stream_sync(st));
    fy_cuda_blas_free(t);
    fy_device_dealloc(dev, ws, ws_bytes);
    free(c);
  }
  dfree_all();
  free(a); free(b); free(bias); free(c0);
}

static void test_linear(struct fy_cuda_blas *h, enum fy_dtype dt) {
  const int64_t OC = V;
  float *inp = frand_new(BT * C, 1.0f, dt), *w = frand_new(OC * C, 0.2f, dt);
  float *bias = frand_new(OC, 1.0f, dt), *out = check_fnew(BT * OC);
  void *d_inp = dput(inp, BT * C, dt), *d_w = dput(w, OC * C, dt), *d_bias = dput(bias, OC, dt);
  void *d_out = dalloc((size_t)(BT * OC) * fy_dtype_size(dt));
  CHECK_OK(fy_linear_forward(out, inp, w, bias, BT, C, OC, false));
  CHECK_OK(fy_cuda_linear_forward(h, d_out, d_inp, d_w, d_bias, dt, BT, C, OC, cs));
  cmp_dev("linear forward (bias)", dt, d_out, out, BT * OC, true);
  CHECK_OK(fy_linear_forward(out, inp, w, NULL, BT, C, OC, false));
  CHECK_OK(fy_cuda_linear_forward(h, d_out, d_inp, d_w, NULL, dt, BT, C, OC, cs));
  cmp_dev("linear forward (no bias)", dt, d_out, out, BT * OC, true);
  for (int wb = 0; wb < 2; wb++) {  // linear and relu in one call (the epilogue)
    CHECK_OK(fy_linear_forward(out, inp, w, wb ? bias : NULL, BT, C, OC, false));
    fy_relu_forward(out, out, BT * OC);
    CHECK_OK(fy_cuda_linear_relu_forward(h, d_out, d_inp, d_w, wb ? d_bias : NULL, dt, BT, C, OC, cs));
    cmp_dev(wb ? "linear+relu forward (bias)" : "linear+relu forward (no bias)", dt, d_out, out, BT * OC, true);
  }
  {  // linear and the residual add in one call: into another buffer, and in place on the residual
    float *res = frand_new(BT * OC, 1.0f, dt);
    void *d_res = dput(res, BT * OC, dt);
    CHECK_OK(fy_linear_forward(out, inp, w, bias, BT, C, OC, false));
    fy_add_forward(out, out, res, BT * OC);
    CHECK_OK(fy_cuda_linear_add_forward(h, d_out, d_inp, d_w, d_bias, d_res, dt, BT, C, OC, cs));
    cmp_dev("linear+add forward", dt, d_out, out, BT * OC, true);
    CHECK_OK(fy_cuda_linear_add_forward(h, d_res, d_inp, d_w, NULL, d_res, dt, BT, C, OC, cs));
    CHECK_OK(fy_linear_forward(out, inp, w, NULL, BT, C, OC, false));
    fy_add_forward(out, out, res, BT * OC);
    cmp_dev("linear+add forward (in place, no bias)", dt, d_res, out, BT * OC, true);
    free(res);
  }

  float *dout = frand_new(BT * OC, 1.0f, dt), *dinp = frand_new(BT * C, 1.0f, dt);
  float *dw = frand_new(OC * C, 1.0f, dt), *db = frand_new(OC, 1.0f, dt);
  void *d_dout = dput(dout, BT * OC, dt), *d_dinp = dput(dinp, BT * C, dt);
  void *d_dw = dput(dw, OC * C, dt), *d_db = dput(db, OC, dt);
  CHECK_OK(fy_linear_backward(dinp, dw, db, dout, inp, w, BT, C, OC, false));
  CHECK_OK(fy_cuda_linear_backward(h, d_dinp, d_dw, d_db, d_dout, d_inp, d_w, dt, BT, C, OC, cs));
  cmp_dev("linear backward dinp +=", dt, d_dinp, dinp, BT * C, true);
  cmp_dev("linear backward dweight +=", dt, d_dw, dw, OC * C, true);
  cmp_dev("linear backward dbias +=", dt, d_db, db, OC, false);
  CHECK_OK(fy_linear_backward_params(dw, db, dout, inp, BT, C, OC, false, false));
  CHECK_OK(fy_cuda_linear_backward_params(h, d_dw, d_db, d_dout, d_inp, dt, BT, C, OC, false, cs));
  cmp_dev("linear backward_params dweight =", dt, d_dw, dw, OC * C, true);
  cmp_dev("linear backward_params dbias =", dt, d_db, db, OC, false);
  // Enough rows for the bias gradient's row-split kernels (partial sums through the workspace).
  {
    const int64_t R = 1000, OC2 = 77;
    float *x2 = frand_new(R * C, 1.0f, dt), *g2 = frand_new(R * OC2, 1.0f, dt);
    float *dw2 = frand_new(OC2 * C, 1.0f, dt), *db2 = frand_new(OC2, 1.0f, dt);
    void *d_x2 = dput(x2, R * C, dt), *d_g2 = dput(g2, R * OC2, dt);
    void *d_dw2 = dput(dw2, OC2 * C, dt), *d_db2 = dput(db2, OC2, dt);
    for (int acc = 1; acc >= 0; acc--) {
      CHECK_OK(fy_linear_backward_params(dw2, db2, g2, x2, R, C, OC2, acc, false));
      CHECK_OK(fy_cuda_linear_backward_params(h, d_dw2, d_db2, d_g2, d_x2, dt, R, C, OC2, acc, cs));
      cmp_dev(acc ? "linear backward_params split dbias +=" : "linear backward_params split dbias =", dt, d_db2,
              db2, OC2, false);
      cmp_dev("linear backward_params split dweight", dt, d_dw2, dw2, OC2 * C, true);
    }
    free(x2); free(g2); free(dw2); free(db2);
  }
  dfree_all();
  free(inp); free(w); free(bias); free(out); free(dout); free(dinp); free(dw); free(db);
}

// The mixture of experts (ops/cuda/moe.cu) against ops/cpu/moe.c: E = 5 experts, top 2, of
// F = 40 features, relu with biases and gelu without; every token's first channel and expert 4's
// gate make expert 4's logit about -16, so that it gets no token (its gradient: zero, or left as
// it was when accumulating). The routing record (probabilities, choices, weights, rows) is compared
// too; backward with random starting gradients, accumulating and not, the first with the forward's
// counts handed in (no wait), the second counting them again. Padded: a mask (the first 5 tokens
// and about a fifth of the rest padding) routes those tokens to no expert, out of the balance term.
static void test_moe_case(struct fy_cuda_blas *h, enum fy_dtype dt, bool gelu, bool bias, bool padded) {
  const int E = 5, K = 2;
  const int64_t F = 40, S = E + 3 * K, cap = fy_moe_rows_cap(BT, E, K);
  int32_t *mask = NULL;
  if (padded) {
    mask = malloc((size_t)BT * sizeof *mask);
    CHECKF(mask != NULL, "moe test: out of memory");
    for (int64_t t = 0; t < BT; t++) mask[t] = t >= 5 && check_urand() > 0.2;
  }
  int32_t *d_mask = mask ? dput_raw(mask, (size_t)BT * sizeof *mask) : NULL;
  // (the cpu's with the mask in host memory, the GPU's with it in device memory)
  const struct fy_moe_dims d = {.BT = BT, .C = C, .F = F, .E = E, .K = K, .gelu = gelu, .bf16 = false, .mask = mask};
  const struct fy_moe_dims dg = {.BT = BT, .C = C, .F = F, .E = E, .K = K, .gelu = gelu, .bf16 = false, .mask = d_mask};
  float *inp = frand_new(BT * C, 1.0f, dt), *gate = frand_new(E * C, 0.3f, dt);
  for (int64_t t = 0; t < BT; t++) inp[t * C] = 4.0f;
  gate[4 * C] = -4.0f;
  float *w1 = frand_new(E * F * C, 0.2f, dt), *b1 = bias ? frand_new(E * F, 0.5f, dt) : NULL;
  float *w2 = frand_new(E * C * F, 0.2f, dt), *b2 = bias ? frand_new(E * C, 0.5f, dt) : NULL;
  float *out = check_fnew(BT * C), *route = check_fnew(BT * S), *rows = check_fnew(cap * (F + C));
  double bal = 0, gbal = 0;
  CHECK_OK(fy_moe_forward(out, route, rows, &bal, inp, gate, w1, b1, w2, b2, &d));
  int64_t to4 = 0;
  for (int64_t t = 0; t < BT; t++)
    for (int j = 0; j < K; j++) to4 += (int)route[t * S + E + j] == 4;
  CHECKF(to4 == 0, "moe test: expert 4 got %lld tokens (the case wants none)", (long long)to4);
  int64_t unrouted = 0, padding = 0;
  for (int64_t t = 0; t < BT; t++) unrouted += (int)route[t * S + E] < 0, padding += mask && !mask[t];
  CHECKF(unrouted == padding && (!padded || (padding > 5 && padding < BT)),
         "moe test: %lld tokens routed to no expert, %lld padding", (long long)unrouted, (long long)padding);
  void *d_inp = dput(inp, BT * C, dt), *d_gate = dput(gate, E * C, dt), *d_w1 = dput(w1, E * F * C, dt);
  void *d_w2 = dput(w2, E * C * F, dt), *d_b1 = bias ? dput(b1, E * F, dt) : NULL;
  void *d_b2 = bias ? dput(b2, E * C, dt) : NULL;
  void *d_out = dalloc((size_t)(BT * C) * fy_dtype_size(dt));
  float *d_route = dalloc((size_t)(BT * S) * 4);
  void *d_rows = dalloc((size_t)(cap * (F + C)) * 4), *work = dalloc(fy_cuda_moe_workspace_bytes(&d, dt));
  void *pinned = NULL;
  CHECKF(cudaMallocHost(&pinned, fy_cuda_moe_pinned_bytes(&d)) == cudaSuccess, "moe test: pinned memory");
  char what[96];
  const char *kind = gelu ? "gelu, no bias" : "relu, bias";
  CHECK_OK(fy_cuda_moe_forward(h, d_out, d_route, d_rows, &gbal, d_inp, d_gate, d_w1, d_b1, d_w2, d_b2, dt, &dg,
                               work, pinned, cs));
  int counts[5];
  memcpy(counts, pinned, sizeof counts);  // (the forward's, as runtime/engine_cuda.c keeps them)
  if (padded) kind = gelu ? "gelu, no bias, padded" : "relu, bias, padded";
  snprintf(what, sizeof what, "moe forward (%s)", kind);
  cmp_dev(what, dt, d_out, out, BT * C, true);
  snprintf(what, sizeof what, "moe routing record (%s)", kind);
  cmp_dev(what, FY_F32, d_route, route, BT * S, true);
  CHECKF(fabs(gbal - bal) <= 1e-5 * fabs(bal), "moe balance: cuda %.9g, cpu %.9g", gbal, bal);

  float *dout = frand_new(BT * C, 1.0f, dt);
  void *d_dout = dput(dout, BT * C, dt);
  for (int acc = 1; acc >= 0; acc--) {
    float *dinp = frand_new(BT * C, 1.0f, dt), *dgate = frand_new(E * C, 1.0f, dt);
    float *dw1 = frand_new(E * F * C, 1.0f, dt), *dw2 = frand_new(E * C * F, 1.0f, dt);
    float *db1 = bias ? frand_new(E * F, 1.0f, dt) : NULL, *db2 = bias ? frand_new(E * C, 1.0f, dt) : NULL;
    void *d_dinp = dput(dinp, BT * C, dt), *d_dgate = dput(dgate, E * C, dt), *d_dw1 = dput(dw1, E * F * C, dt);
    void *d_dw2 = dput(dw2, E * C * F, dt), *d_db1 = bias ? dput(db1, E * F, dt) : NULL;
    void *d_db2 = bias ? dput(db2, E * C, dt) : NULL;
    CHECK_OK(fy_moe_backward(dinp, dgate, dw1, db1, dw2, db2, dout, inp, route, rows, gate, w1, w2, 0.37f, acc, &d));
    memset(pinned, 0xff, sizeof counts);  // (not read when the counts are handed in)
    CHECK_OK(fy_cuda_moe_backward(h, d_dinp, d_dgate, d_dw1, d_db1, d_dw2, d_db2, d_dout, d_inp, d_route, d_rows,
                                  d_gate, d_w1, d_w2, 0.37f, acc, dt, &dg, work, pinned, acc ? counts : NULL, cs));
    const char *op = acc ? "+=" : "=";
    snprintf(what, sizeof what, "moe backward dinp += (%s)", kind);
    cmp_dev(what, dt, d_dinp, dinp, BT * C, true);
    snprintf(what, sizeof what, "moe backward dgate %s (%s)", op, kind);
    cmp_dev(what, dt, d_dgate, dgate, E * C, true);
    snprintf(what, sizeof what, "moe backward dw1 %s (%s)", op, kind);
    cmp_dev(what, dt, d_dw1, dw1, E * F * C, true);
    snprintf(what, sizeof what, "moe backward dw2 %s (%s)", op, kind);
    cmp_dev(what, dt, d_dw2, dw2, E * C * F, true);
    if (bias) {
      snprintf(what, sizeof what, "moe backward db1 %s (%s)", op, kind);
      cmp_dev(what, dt, d_db1, db1, E * F, true);
      snprintf(what, sizeof what, "moe backward db2 %s (%s)", op, kind);
      cmp_dev(what, dt, d_db2, db2, E * C, true);
    }
    // Expert 4 (no token): exactly what it was, or zeros.
    float *got = check_fnew(E * F * C);
    dget(got, d_dw1, E * F * C, dt);
    bool same = true;
    for (int64_t i = 4 * F * C; i < 5 * F * C; i++) same = same && got[i] == (acc ? dw1[i] : 0.0f);
    CHECKF(same, "moe backward (%s, %s): expert 4's dw1 is not %s", kind, fy_dtype_name(dt), acc ? "unchanged" : "zero");
    dget(got, d_dw2, E * C * F, dt);
    for (int64_t i = 4 * C * F; i < 5 * C * F; i++) same = same && got[i] == (acc ? dw2[i] : 0.0f);
    CHECKF(same, "moe backward (%s, %s): expert 4's dw2 is not %s", kind, fy_dtype_name(dt), acc ? "unchanged" : "zero");
    free(got);
    free(dinp); free(dgate); free(dw1); free(dw2); free(db1); free(db2);
  }
  CHECK_OK(fy_stream_sync(st));
  cudaFreeHost(pinned);
  dfree_all();
  free(inp); free(gate); free(w1); free(b1); free(w2); free(b2); free(out); free(route); free(rows); free(dout);
  free(mask);
}

// Tensor parallelism on the GPU's kernels (fy_moe_dims.tp_sum, device memory, fp32): a pair
// emulated in one process as test_ops's is: rank 1 runs first and its sums keep copies of what it
// would send, rank 0 then adds them in the same order, so that its results are the pair's. Rank
// 0's (each expert's fc1 rows and fc2 columns [0, F/2), fc2's bias) against the cpu's one rank on
// the whole experts (as test_moe_case, relu with biases).
struct moe_tp_pair {
  bool add;        // rank 0's turn
  int k;           // the sums so far this turn
  float *sent[3];  // rank 1's buffers (host copies), in order
};
static fy_status moe_tp_sum(void *ctx, float *buf, int64_t n) {
  struct moe_tp_pair *x = ctx;
  FY_ASSERT(x->k < 3);
  float *h = check_fnew(n);
  dget(h, buf, n, FY_F32);
  if (x->add) {
    for (int64_t i = 0; i < n; i++) h[i] += x->sent[x->k][i];
    CHECK_OK(fy_copy_async(st, buf, h, (size_t)n * 4));
    CHECK_OK(fy_stream_sync(st));
    free(x->sent[x->k]);
    free(h);
  } else {
    x->sent[x->k] = h;
  }
  x->k++;
  return FY_OK;
}
static void test_moe_tp(struct fy_cuda_blas *h, enum fy_dtype dt) {
  const int E = 5, K = 2;
  const int64_t F = 40, Fl = F / 2, S = E + 3 * K, cap = fy_moe_rows_cap(BT, E, K);
  const struct fy_moe_dims d = {.BT = BT, .C = C, .F = F, .E = E, .K = K};
  float *inp = frand_new(BT * C, 1.0f, dt), *gate = frand_new(E * C, 0.3f, dt);
  float *w1 = frand_new(E * F * C, 0.2f, dt), *b1 = frand_new(E * F, 0.5f, dt);
  float *w2 = frand_new(E * C * F, 0.2f, dt), *b2 = frand_new(E * C, 0.5f, dt);
  float *dout = frand_new(BT * C, 1.0f, dt), *dinp0 = frand_new(BT * C, 1.0f, dt);
  float *out = check_fnew(BT * C), *route = check_fnew(BT * S), *rows = check_fnew(cap * (F + C));
  float *dinp = fdup(dinp0, BT * C), *dgate = check_fnew(E * C), *dw1 = check_fnew(E * F * C);
  float *db1 = check_fnew(E * F), *dw2 = check_fnew(E * C * F), *db2 = check_fnew(E * C);
  double bal = 0, gbal = 0;
  CHECK_OK(fy_moe_forward(out, route, rows, &bal, inp, gate, w1, b1, w2, b2, &d));
  CHECK_OK(fy_moe_backward(dinp, dgate, dw1, db1, dw2, db2, dout, inp, route, rows, gate, w1, w2, 0.37f, false, &d));
  struct moe_tp_pair pair = {0};
  struct fy_moe_dims dp = d;
  dp.F = Fl, dp.tp_sum = moe_tp_sum, dp.tp_ctx = &pair;
  // Rank r's slices: w1 rows [e F + r F/2, +F/2) of every expert (b1 likewise), w2 columns [r F/2, +F/2).
  float *w1r = check_fnew(E * Fl * C), *b1r = check_fnew(E * Fl), *w2r = check_fnew(E * C * Fl);
  void *d_inp = dput(inp, BT * C, dt), *d_gate = dput(gate, E * C, dt), *d_dout = dput(dout, BT * C, dt);
  void *d_b2 = dput(b2, E * C, dt), *work = dalloc(fy_cuda_moe_workspace_bytes(&dp, dt));
  void *pinned = NULL;
  CHECKF(cudaMallocHost(&pinned, fy_cuda_moe_pinned_bytes(&dp)) == cudaSuccess, "moe tp test: pinned memory");
  void *d_out = NULL, *d_dinp = NULL, *d_dgate = NULL, *d_dw1 = NULL, *d_db1 = NULL, *d_dw2 = NULL, *d_db2 = NULL;
  for (int r = 1; r >= 0; r--) {
    for (int64_t e = 0; e < E; e++) {
      memcpy(w1r + e * Fl * C, w1 + (e * F + r * Fl) * C, (size_t)(Fl * C) * 4);
      memcpy(b1r + e * Fl, b1 + e * F + r * Fl, (size_t)Fl * 4);
    }
    for (int64_t i = 0; i < E * C; i++) memcpy(w2r + i * Fl, w2 + i * F + r * Fl, (size_t)Fl * 4);
    void *d_w1 = dput(w1r, E * Fl * C, dt), *d_b1 = dput(b1r, E * Fl, dt), *d_w2 = dput(w2r, E * C * Fl, dt);
    d_out = dalloc((size_t)(BT * C) * fy_dtype_size(dt));
    float *d_route = dalloc((size_t)(BT * S) * 4);
    void *d_rows = dalloc((size_t)(cap * (Fl + C)) * fy_dtype_size(dt));
    d_dinp = dput(dinp0, BT * C, dt), d_dgate = dalloc((size_t)(E * C) * fy_dtype_size(dt));
    d_dw1 = dalloc((size_t)(E * Fl * C) * fy_dtype_size(dt)), d_db1 = dalloc((size_t)(E * Fl) * fy_dtype_size(dt));
    d_dw2 = dalloc((size_t)(E * C * Fl) * fy_dtype_size(dt)), d_db2 = dalloc((size_t)(E * C) * fy_dtype_size(dt));
    pair.add = r == 0, pair.k = 0;
    CHECK_OK(fy_cuda_moe_forward(h, d_out, d_route, d_rows, &gbal, d_inp, d_gate, d_w1, d_b1, d_w2,
                                 r == 0 ? d_b2 : NULL, dt, &dp, work, pinned, cs));
    CHECKF(pair.k == 1, "moe tp rank %d: %d sums in forward, wanted 1 (the output)", r, pair.k);
    CHECK_OK(fy_cuda_moe_backward(h, d_dinp, d_dgate, d_dw1, d_db1, d_dw2, d_db2, d_dout, d_inp, d_route, d_rows,
                                  d_gate, d_w1, d_w2, 0.37f, false, dt, &dp, work, pinned, NULL, cs));
    CHECKF(pair.k == 3, "moe tp rank %d: %d sums in backward, wanted 2", r, pair.k - 1);
  }
  // Rank 0's: the whole output and input gradient, the router's gradient, its slices' gradients.
  for (int64_t e = 0; e < E; e++) {
    memcpy(w1r + e * Fl * C, dw1 + e * F * C, (size_t)(Fl * C) * 4);
    memcpy(b1r + e * Fl, db1 + e * F, (size_t)Fl * 4);
  }
  for (int64_t i = 0; i < E * C; i++) memcpy(w2r + i * Fl, dw2 + i * F, (size_t)Fl * 4);
  cmp_dev("moe tp 2 forward (rank 0)", dt, d_out, out, BT * C, true);
  CHECKF(fabs(gbal - bal) <= 1e-5 * fabs(bal), "moe tp balance: cuda %.9g, cpu %.9g", gbal, bal);
  cmp_dev("moe tp 2 backward dinp +=", dt, d_dinp, dinp, BT * C, true);
  cmp_dev("moe tp 2 backward dgate", dt, d_dgate, dgate, E * C, true);
  cmp_dev("moe tp 2 backward dw1 (slice)", dt, d_dw1, w1r, E * Fl * C, true);
  cmp_dev("moe tp 2 backward db1 (slice)", dt, d_db1, b1r, E * Fl, true);
  cmp_dev("moe tp 2 backward dw2 (slice)", dt, d_dw2, w2r, E * C * Fl, true);
  cmp_dev("moe tp 2 backward db2", dt, d_db2, db2, E * C, true);
  CHECK_OK(fy_stream_sync(st));
  cudaFreeHost(pinned);
  dfree_all();
  float *hb[] = {inp, gate, w1, b1, w2, b2, dout, dinp0, out, route, rows, dinp, dgate, dw1, db1, dw2, db2, w1r, b1r, w2r};
  for (size_t i = 0; i < sizeof hb / sizeof *hb; i++) free(hb[i]);
}

static void test_moe(struct fy_cuda_blas *h, enum fy_dtype dt) {
  test_moe_case(h, dt, false, true, false);
  test_moe_case(h, dt, true, false, false);
  test_moe_case(h, dt, false, true, true);
  test_moe_tp(h, dt);
}

// Mask kinds: 0 = none (NULL), 1 = padding: batch 1 left-padded by 5 and right-padded by 3 (its
// first queries have no key), batch 2 with random holes.
static void test_attention_shape(enum fy_dtype dt, int64_t Bn, int64_t Tn, int64_t Cn, int64_t NHn,
                                 int mask_kind) {
  const int64_t HS = Cn / NHn, C3 = 3 * Cn;
  const float scale = 1.0f / sqrtf((float)HS);
  float *qkv = frand_new(Bn * Tn * C3, 1.5f, dt), *out = check_fnew(Bn * Tn * Cn);
  float *att = check_fnew(Bn * NHn * Tn * Tn), *scr = check_fnew(Bn * NHn * Tn * Tn);
  int32_t *mask = NULL;
  if (mask_kind) {
    mask = malloc((size_t)(Bn * Tn) * sizeof(int32_t));
    for (int64_t b = 0; b < Bn; b++)
      for (int64_t t = 0; t < Tn; t++)
        mask[b * Tn + t] = b == 1 ? (t >= 5 && t < Tn - 3) : b == 2 ? check_urand() > 0.2 : 1;
  }
  CHECK_OK(fy_attention_forward(out, att, qkv, mask, Bn, Tn, Cn, NHn, scale));
  void *d_qkv = dput(qkv, Bn * Tn * C3, dt), *d_out = dalloc((size_t)(Bn * Tn * Cn) * fy_dtype_size(dt));
  float *d_lse = dalloc((size_t)(Bn * NHn * Tn) * sizeof(float));
  float *d_scr = dalloc((size_t)(Bn * NHn * Tn) * sizeof(float));
  int32_t *d_mask = mask ? dput_raw(mask, (size_t)(Bn * Tn) * sizeof(int32_t)) : NULL;
  CHECK_OK(fy_cuda_attention_forward(d_out, d_lse, d_qkv, d_mask, dt, Bn, Tn, Cn, NHn, scale, cs));
  char what[96];
  snprintf(what, sizeof what, "attention fwd B%lld T%lld C%lld NH%lld m%d", (long long)Bn,
           (long long)Tn, (long long)Cn, (long long)NHn, mask_kind);
  cmp_dev(what, dt, d_out, out, Bn * Tn * Cn, false);

  // Backward from the GPU's own forward output, as training runs it (for bf16 that output is
  // rounded; D = rowsum(dout * out) sees the rounding, well inside bf16's tolerance).
  float *dout = frand_new(Bn * Tn * Cn, 1.0f, dt), *dqkv = frand_new(Bn * Tn * C3, 1.0f, dt);
  void *d_dout = dput(dout, Bn * Tn * Cn, dt), *d_dqkv = dput(dqkv, Bn * Tn * C3, dt);
  void *d_dqkv1 = mask_kind == 0 ? dput(dqkv, Bn * Tn * C3, dt) : NULL;  // (for the all-ones mask below)
  CHECK_OK(fy_attention_backward(dqkv, scr, dout, qkv, att, Bn, Tn, Cn, NHn, scale));
  CHECK_OK(fy_cuda_attention_backward(d_dqkv, d_scr, d_dout, d_qkv, d_out, d_lse, d_mask, dt, Bn,
                                      Tn, Cn, NHn, scale, cs));
  snprintf(what, sizeof what, "attention bwd B%lld T%lld C%lld NH%lld m%d", (long long)Bn,
           (long long)Tn, (long long)Cn, (long long)NHn, mask_kind);
  cmp_dev(what, dt, d_dqkv, dqkv, Bn * Tn * C3, false);
  // The left-padded queries of batch 1 (no key) must give exactly zero output.
  if (mask_kind && Bn > 1) {
    float *got = check_fnew(Bn * Tn * Cn);
    dget(got, d_out, Bn * Tn * Cn, dt);
    bool zero = true;
    for (int64_t t = 0; t < 5; t++)
      for (int64_t c = 0; c < Cn; c++) zero = zero && got[(Tn + t) * Cn + c] == 0.0f;
    CHECKF(zero, "attention: a query with no key has a non-zero output");
    free(got);
  }
  // Without a mask, the tensor-core kernels skip the mask's tests on the tiles no causal limit cuts;
  // a mask of ones (every tile tested) must give the same numbers, up to the last bits of a
  // contraction (a systematic slip of even 1% in those tiles is far over the bound).
  if (mask_kind == 0) {
    int32_t *ones = malloc((size_t)(Bn * Tn) * sizeof(int32_t));
    for (int64_t i = 0; i < Bn * Tn; i++) ones[i] = 1;
    int32_t *d_ones = dput_raw(ones, (size_t)(Bn * Tn) * sizeof(int32_t));
    void *d_out1 = dalloc((size_t)(Bn * Tn * Cn) * fy_dtype_size(dt));
    float *d_lse1 = dalloc((size_t)(Bn * NHn * Tn) * sizeof(float));
    CHECK_OK(fy_cuda_attention_forward(d_out1, d_lse1, d_qkv, d_ones, dt, Bn, Tn, Cn, NHn, scale, cs));
    CHECK_OK(fy_cuda_attention_backward(d_dqkv1, d_scr, d_dout, d_qkv, d_out1, d_lse1, d_ones, dt, Bn, Tn, Cn, NHn,
                                        scale, cs));
    const int64_t n[2] = {Bn * Tn * Cn, Bn * Tn * C3};
    void *const a[2] = {d_out, d_dqkv}, *const b[2] = {d_out1, d_dqkv1};
    for (int k = 0; k < 2; k++) {
      float *x = check_fnew(n[k]), *y = check_fnew(n[k]);
      dget(x, a[k], n[k], dt);
      dget(y, b[k], n[k], dt);
      const double err = check_rel_err(x, y, n[k]);
      snprintf(what, sizeof what, "attention %s B%lld T%lld C%lld NH%lld, no mask vs ones", k ? "bwd" : "fwd",
               (long long)Bn, (long long)Tn, (long long)Cn, (long long)NHn);
      fprintf(stderr, "  %-40s %-4s err %.2e (tol 1e-04)\n", what, fy_dtype_name(dt), err);
      CHECKF(err <= 1e-4, "%s %s: err %.3e > 1e-4", what, fy_dtype_name(dt), err);
      free(x);
      free(y);
    }
    free(ones);
  }
  dfree_all();
  free(qkv); free(out); free(att); free(scr); free(mask); free(dout); free(dqkv);
}

static void test_attention(enum fy_dtype dt) {
  test_attention_shape(dt, B, T, C, NH, 0);     // HS 12, one tile
  test_attention_shape(dt, B, T, C, NH, 1);
  test_attention_shape(dt, 3, 130, 128, 2, 1);  // HS 64, three tiles, a ragged last one
  test_attention_shape(dt, 2, 150, 256, 2, 1);  // HS 128 (the largest), three tiles
  test_attention_shape(dt, 1, 64, 40, 2, 0);    // HS 20, exactly one tile
  test_attention_shape(dt, 3, 100, 160, 2, 1);  // HS 80 (OPT-2.7B's), two tiles, padding
  test_attention_shape(dt, 2, 200, 128, 1, 0);  // HS 128 with one head, four tiles
  test_attention_shape(dt, 3, 300, 256, 4, 1);  // HS 64: three 128-query tiles, a ragged last one
  test_attention_shape(dt, 1, 260, 64, 2, 0);   // HS 32, 128-row tiles and one row past them
  test_attention_shape(dt, 2, 200, 256, 4, 0);  // HS 64 (OPT-1.3B's) unmasked: whole tiles below the diagonal
}

// Incremental decoding: runs of 1, 5, 1 and 17 tokens in turn against the cached keys and
// values, as the CPU's kernel does it (outputs and the caches), and the positions a cache refuses.
static void test_attention_decode(enum fy_dtype dt, int64_t Tn, int64_t Cn, int64_t NHn) {
  const int64_t C3 = 3 * Cn, cap = Tn + 3;
  const size_t es = fy_dtype_size(dt);
  const float scale = 1.0f / sqrtf((float)(Cn / NHn));
  float *qkv = frand_new(Tn * C3, 1.5f, dt), *out = check_fnew(Tn * Cn);
  float *kc = check_fnew(cap * Cn), *vc = check_fnew(cap * Cn);
  float *sa = check_fnew(NHn * 17 * cap);  // (17: the longest run)
  void *d_qkv = dput(qkv, Tn * C3, dt), *d_out = dalloc((size_t)(Tn * Cn) * es);
  void *d_k = dalloc((size_t)(cap * Cn) * es), *d_v = dalloc((size_t)(cap * Cn) * es);
  const int64_t runs[] = {1, 5, 1, 17};
  for (int64_t t = 0, r = 0, n; t < Tn; t += n, r = (r + 1) % 4) {
    n = runs[r] < Tn - t ? runs[r] : Tn - t;
    CHECK_OK(fy_attention_decode(out + t * Cn, kc, vc, sa, qkv + t * C3, t, n, cap, Cn, NHn, scale));
    CHECK_OK(fy_cuda_attention_decode((char *)d_out + t * Cn * es, d_k, d_v, (const char *)d_qkv + t * C3 * es, dt, t,
                                      n, cap, Cn, NHn, scale, cs));
  }
  char what[96];
  snprintf(what, sizeof what, "attention decode T%lld C%lld NH%lld", (long long)Tn, (long long)Cn, (long long)NHn);
  cmp_dev(what, dt, d_out, out, Tn * Cn, false);
  snprintf(what, sizeof what, "attention decode's key cache T%lld C%lld", (long long)Tn, (long long)Cn);
  cmp_dev(what, dt, d_k, kc, Tn * Cn, false);
  snprintf(what, sizeof what, "attention decode's value cache T%lld C%lld", (long long)Tn, (long long)Cn);
  cmp_dev(what, dt, d_v, vc, Tn * Cn, false);
  CHECK_ERR(fy_cuda_attention_decode(d_out, d_k, d_v, d_qkv, dt, cap, 1, cap, Cn, NHn, scale, cs), FY_ERR_INVALID);
  CHECK_ERR(fy_cuda_attention_decode(d_out, d_k, d_v, d_qkv, dt, cap - 1, 2, cap, Cn, NHn, scale, cs), FY_ERR_INVALID);
  CHECK_ERR(fy_cuda_attention_decode(d_out, d_k, d_v, d_qkv, dt, 0, 0, cap, Cn, NHn, scale, cs), FY_ERR_INVALID);
  CHECK_ERR(fy_cuda_attention_decode(d_out, d_k, d_v, d_qkv, dt, 0, 1, 12001, Cn, NHn, scale, cs), FY_ERR_UNSUPPORTED);
  CHECK_ERR(fy_cuda_attention_decode(d_out, d_k, d_v, d_qkv, dt, 0, 1, cap, Cn, Cn + 1, scale, cs), FY_ERR_INVALID);
  dfree_all();
  free(qkv); free(out); free(kc); free(vc); free(sa);
}

// Errors a caller can make are reported, not crashed on.
static void test_errors(struct fy_cuda_blas *h) {
  CHECK_ERR(fy_cuda_relu_forward(NULL, NULL, FY_I32, 10, cs), FY_ERR_UNSUPPORTED);
  CHECK_ERR(fy_cuda_attention_forward(NULL, NULL, NULL, NULL, FY_F32, 1, 8, 516, 2, 1.0f, cs),
            FY_ERR_UNSUPPORTED);  // head size 258
  CHECK_ERR(fy_cuda_attention_forward(NULL, NULL, NULL, NULL, FY_F32, 1, 8, 10, 3, 1.0f, cs),
            FY_ERR_INVALID);
  CHECK_ERR(fy_cuda_matmul(h, NULL, NULL, NULL, NULL, FY_F16, 2, 2, 2, false, false, 1, 0, cs),
            FY_ERR_UNSUPPORTED);
}

// A model resident on the GPU takes what the planner prices a resident plan at
// (fy_graph_model_bytes and the kernels' scratch), to the byte: fp32 and bf16, training with and
// without accumulation, recomputation, and the weights alone (evaluation); post-LN and projected
// embeddings (opt-350m's shape, small).
static void test_model_bytes(void) {
  struct fy_opt_config cfg;
  CHECK_OK(fy_opt_preset("opt-tiny", &cfg));
  for (int variant = 0; variant < 2; variant++) {
    if (variant == 1) {
      cfg.do_layer_norm_before = false;
      cfg.word_embed_proj_dim = cfg.hidden_size / 2;
    }
    for (int i = 0; i < 16; i++) {
      const bool bf16 = i & 1, accumulate = i & 2, recompute = i & 4, train = !(i & 8);
      if (!train && accumulate) continue;
      size_t before = dev->bytes_in_use;
      struct fy_model_opts mo = {.recompute = recompute, .inference = !train, .act16 = bf16, .weights16 = !train};
      struct fy_model *m = NULL;
      CHECK_OK(fy_model_create_with(&cfg, 3, 40, dev, &mo, &m));
      if (!m) continue;
      CHECK_OK(fy_engine_cuda_attach(m));
      if (bf16) CHECK_OK(fy_model_set_compute_dtype(m, FY_BF16));
      if (accumulate) CHECK_OK(fy_model_enable_accumulation(m));
      const struct fy_graph *g = m->graph;
      double want = fy_graph_model_bytes(g, cfg.hidden_size, train, bf16, accumulate, FY_CUDA_ALLOC_GRANULE) +
                    (double)fy_cuda_scratch_bytes(g->n_params, fy_graph_max_channels(g));
      double got = (double)(dev->bytes_in_use - before);
      CHECKF(got == want, "%s%s%s%s%s: the model takes %.0f bytes of the GPU, fy_graph_model_bytes says %.0f",
             variant ? "post-LN, projected: " : "", bf16 ? "bf16" : "fp32", accumulate ? ", accumulated" : "",
             recompute ? ", recompute" : "", train ? "" : ", weights alone", got, want);
      fy_engine_cuda_detach(m);
      fy_model_free(m);
      CHECK(dev->bytes_in_use == before);
    }
  }
}

// A model for evaluation in bf16 that keeps its weights in bf16 alone (weights16: converted on the
// host as they are initialised or loaded) computes what one with fp32 weights and their bf16 copy
// computes, bit for bit, in 4 bytes a parameter less; it cannot be saved or computed in fp32.
static void test_weights16(void) {
  struct fy_opt_config cfg;
  CHECK_OK(fy_opt_preset("opt-tiny", &cfg));
  struct fy_model *m[2] = {NULL, NULL};
  size_t bytes[2];
  float logits[2][2 * 16 * 8];
  double loss[2];
  for (int w16 = 0; w16 < 2; w16++) {
    size_t before = dev->bytes_in_use;
    struct fy_model_opts mo = {.inference = true, .act16 = true, .weights16 = w16};
    CHECK_OK(fy_model_create_with(&cfg, 2, 16, dev, &mo, &m[w16]));
    if (!m[w16]) return;
    CHECK_OK(fy_engine_cuda_attach(m[w16]));
    CHECK_OK(fy_model_set_compute_dtype(m[w16], FY_BF16));
    bytes[w16] = dev->bytes_in_use - before;
    fy_model_init_random(m[w16], 7);
    CHECK(m[w16]->weights16 == w16 && (m[w16]->params == NULL) == w16);
    int32_t in[32], tg[32];
    for (int i = 0; i < 32; i++) in[i] = (i * 37 + 5) % 97, tg[i] = (i * 11 + 3) % 97;
    struct fy_batch b = {.B = 2, .T = 16, .inputs = in, .targets = tg};
    struct fy_loss l;
    CHECK_OK(fy_engine_forward_eval(m[w16], &b, &l));
    loss[w16] = l.sum;
    // The first 8 logits of each of the 32 rows (bf16 on the device).
    const uint16_t *lg = (const uint16_t *)fy_engine_act(m[w16], m[w16]->graph->logits_slot);
    uint16_t row[8];
    for (int r = 0; r < 32; r++) {
      CHECK_OK(fy_model_download(m[w16], row, lg + (size_t)r * 97, sizeof row));
      fy_convert_to_f32(logits[w16] + r * 8, row, FY_BF16, 8);
    }
  }
  CHECKF(loss[0] == loss[1], "bf16 weights alone: loss %.9g, with fp32 weights %.9g", loss[1], loss[0]);
  CHECK(memcmp(logits[0], logits[1], sizeof logits[0]) == 0);
  CHECKF(bytes[0] - bytes[1] >= (size_t)m[0]->graph->n_param_elems * 4,
         "bf16 weights alone take %zu bytes, with fp32 weights %zu", bytes[1], bytes[0]);
  CHECK_ERR(fy_model_save(m[1], "/nonexistent/w16", FY_F32, 0), FY_ERR_UNSUPPORTED);
  CHECK_ERR(fy_model_set_compute_dtype(m[1], FY_F32), FY_ERR_INVALID);
  for (int w16 = 0; w16 < 2; w16++) {
    fy_engine_cuda_detach(m[w16]);
    fy_model_free(m[w16]);
  }
}

static fy_status fill_from_source(void *ctx, int64_t lo, int64_t hi, float *dst) {
  fy_model_source_fill(ctx, lo, hi, dst);
  return FY_OK;
}

// Offloaded evaluation in bf16 from a model without fp32 weights (fy_offload weights16, as ferry
// eval --offload sets it up): the pinned host tier holds the chunks' bf16 copies and no fp32
// weights (under 2 bytes a parameter and a few chunk buffers), the chunks are filled as the model's
// initialisation draws them, and a forward pass through a cache of 3 blocks gives the loss of the
// same model resident in bf16.
static void test_offload_weights16(void) {
  struct fy_opt_config cfg;
  CHECK_OK(fy_opt_preset("opt-tiny", &cfg));
  int64_t ce = 0;
  size_t need = 0;
  CHECK_OK(fy_offload_plan_min_bytes(&cfg, 2, 16, 1, false, true, true, 2, 0, &need, &ce));
  struct fy_host_tier *host = NULL;
  CHECK_OK(fy_engine_cuda_host_tier((size_t)1 << 30, &host));
  if (!host) return;
  struct fy_model_opts mo = {.inference = true, .chunk_elems = ce, .host = host, .no_params = true, .act16 = true};
  struct fy_model *m = NULL, *r = NULL;
  CHECK_OK(fy_model_create_with(&cfg, 2, 16, dev, &mo, &m));
  if (!m) return;
  CHECK_OK(fy_engine_cuda_attach(m));
  CHECK_OK(fy_model_set_compute_dtype(m, FY_BF16));
  const size_t before = fy_host_in_use(host);
  struct fy_offload *x = NULL;
  CHECK_OK(fy_offload_create(m, &(struct fy_offload_opts){.forward_only = true, .n_blocks = 3}, &x));
  if (!x) return;
  const double np = (double)m->graph->n_param_elems, chunks = (double)m->layout->n_chunks * (double)ce;
  const double held = (double)(fy_host_in_use(host) - before);
  CHECKF(m->params == NULL && held >= 2 * np && held <= 2 * chunks + 4.0 * 4 * (double)ce,
         "the host tier holds %.0f bytes for %.0f parameters in %d chunks of %lld", held, np, m->layout->n_chunks,
         (long long)ce);
  struct fy_model_source *src = NULL;
  CHECK_OK(fy_model_source_open(m, NULL, 7, &src));
  CHECK_OK(fy_offload_set_shards(x, fill_from_source, src));
  fy_model_source_close(src);
  int32_t in[32], tg[32];
  for (int i = 0; i < 32; i++) in[i] = (i * 37 + 5) % 97, tg[i] = (i * 11 + 3) % 97;
  struct fy_batch b = {.B = 2, .T = 16, .inputs = in, .targets = tg};
  double off = 0;
  CHECK_OK(fy_offload_forward(x, &b, &off));
  struct fy_model_opts ro = {.inference = true, .act16 = true, .weights16 = true};
  CHECK_OK(fy_model_create_with(&cfg, 2, 16, dev, &ro, &r));
  CHECK_OK(fy_engine_cuda_attach(r));
  CHECK_OK(fy_model_set_compute_dtype(r, FY_BF16));
  fy_model_init_random(r, 7);
  struct fy_loss l;
  CHECK_OK(fy_engine_forward_eval(r, &b, &l));
  CHECKF(fabs(off - l.sum) <= 1e-5 * fabs(l.sum), "offloaded bf16 weights alone: loss %.9g, resident %.9g", off, l.sum);
  fy_engine_cuda_detach(r);
  fy_model_free(r);
  fy_offload_free(x);
  fy_engine_cuda_detach(m);
  fy_model_free(m);
  fy_host_tier_free(host);
}

// The probe's GPU part (planner/probe_cuda.c): the device's figures measured and named "cuda", the
// host's left as they were; a GPU that is not there is refused.
static void test_probe_gpu(int ngpu) {
  struct fy_probe p;
  memset(&p, 0, sizeof p);
  snprintf(p.device, sizeof p.device, "sim");
  p.host_mem = 123e9;
  p.host_adamw_gbps = 7;
  CHECK(fy_probe_gpu_count() == ngpu);
  CHECK_OK(fy_probe_measure_gpu(0, &p));
  size_t free_b = 0, total = 0;
  CHECK(cudaMemGetInfo(&free_b, &total) == cudaSuccess);
  fprintf(stderr, "  probe: %.1f GiB free of %.1f, bf16 GEMM %.1f GFLOP/s, copies %.2f / %.2f GB/s, %.1f us a small one\n",
          p.device_mem / 1073741824.0, total / 1073741824.0, p.device_gflops, p.h2d_gbps, p.d2h_gbps, p.copy_latency_us);
  CHECK(strcmp(p.device, "cuda") == 0 && p.device_mem > 0 && p.device_mem <= (double)total);
  CHECK(p.device_gflops > 0 && p.h2d_gbps > 0 && p.d2h_gbps > 0 && p.copy_latency_us > 0);
  CHECK(p.host_mem == 123e9 && p.host_adamw_gbps == 7);
  CHECK_ERR(fy_probe_measure_gpu(ngpu, &p), FY_ERR_NOT_FOUND);
}

int main(void) {
  // Every op kind has its cuda kernels in the engine's op table (runtime/engine_cuda.c).
  CHECKF(fy_engine_cuda_ops_missing() < 0, "the cuda op table lacks op kind %d", fy_engine_cuda_ops_missing());
  int ngpu = fy_cuda_device_count();
  if (ngpu == 0) {
    fprintf(stderr, "backend_ops: no GPU (or no driver): skipped\n");
    return 77;
  }
  if (fy_device_cuda_create(0, 0, &dev) != FY_OK) {
    fprintf(stderr, "backend_ops: %s\n", fy_error_msg());
    return 1;
  }
  struct cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess)
    fprintf(stderr, "backend_ops: %s, compute capability %d.%d\n", prop.name, prop.major,
            prop.minor);
  CHECK_OK(fy_stream_create(dev, &st));
  cs = fy_cuda_stream(st);
  test_device();
  test_model_bytes();
  test_weights16();
  test_offload_weights16();
  test_probe_gpu(ngpu);

  const size_t ws_bytes = 32u << 20;
  void *ws = NULL;
  struct fy_cuda_blas *h = NULL;
  CHECK_OK(fy_device_alloc(dev, ws_bytes, &ws));
  CHECK_OK(fy_cuda_blas_create(ws, ws_bytes, &h));
  for (int i = 0; i < 2; i++) {
    enum fy_dtype dt = dtypes[i];
    fprintf(stderr, "== %s\n", fy_dtype_name(dt));
    test_embedding(dt);
    test_layernorm(dt);
    test_elementwise(dt);
    test_dropout_add(dt);
    test_bias_add(dt);
    test_crossentropy(dt);
    test_adamw(dt);
    test_adamw_state(dt);
    test_accumulate(dt);
    test_sumsq(dt);
    test_matmul(h, dt, false);
    test_linear(h, dt);
    test_moe(h, dt);
    CHECK_OK(fy_cuda_attention_set_variant("basic"));
    test_attention(dt);
    test_attention_decode(dt, 37, 36, 3);    // HS 12
    test_attention_decode(dt, 200, 256, 2);  // HS 128, more keys than the block has threads
    if (dt == FY_BF16) {
      // The pipelined tensor-core kernels (bf16 only), wide and narrow (the default, auto), against
      // the same CPU results; backwards reading another forward's out and lse.
      const char *kinds[] = {"pipelined", NULL, "pipelined,basic", "basic,narrow"};
      for (int k = 0; k < 4; k++) {
        fprintf(stderr, "== bf16, %s attention\n", kinds[k] ? kinds[k] : "auto");
        CHECK_OK(fy_cuda_attention_set_variant(kinds[k]));
        test_attention(dt);
      }
      CHECK_OK(fy_cuda_attention_set_variant("basic"));
    }
  }
  CHECK_ERR(fy_cuda_attention_set_variant("fastest"), FY_ERR_INVALID);
  CHECK_ERR(fy_cuda_attention_set_variant("basic,"), FY_ERR_INVALID);
  CHECK_ERR(fy_cuda_attention_set_variant("narrow,wide"), FY_ERR_INVALID);
  CHECK_OK(fy_cuda_attention_set_variant("pipelined,basic"));
  CHECK_OK(fy_cuda_attention_set_variant(NULL));
  for (int way = 0; way < 2; way++) {
    // The products without the bias and relu epilogues, a kernel adding the bias and applying the
    // relu after them, to the same results: asked for (fy_cuda_blas_set_epilogue, on any GPU), and
    // where cuBLASLt has no algorithm with those epilogues (the emulator's FY_EMU_LT_NO_EPILOGUE; a
    // GPU's cuBLASLt ignores it and keeps them).
    if (way == 1) setenv("FY_EMU_LT_NO_EPILOGUE", "1", 1);
    struct fy_cuda_blas *plain = NULL;
    CHECK_OK(fy_cuda_blas_create(ws, ws_bytes, &plain));
    if (way == 0) fy_cuda_blas_set_epilogue(plain, false);
    for (int i = 0; i < 2; i++) {
      fprintf(stderr, "== %s, products without epilogues (%s)\n", fy_dtype_name(dtypes[i]),
              way == 0 ? "asked for" : "none offered");
      test_matmul(plain, dtypes[i], true);
      test_linear(plain, dtypes[i]);
    }
    CHECK_OK(fy_stream_sync(st));
    fy_cuda_blas_free(plain);
    unsetenv("FY_EMU_LT_NO_EPILOGUE");
  }
  test_convert();
  test_errors(h);
  CHECK_OK(fy_stream_sync(st));
  fy_cuda_blas_free(h);
  fy_device_dealloc(dev, ws, ws_bytes);
  fy_stream_free(st);
  CHECKF(dev->bytes_in_use == 0, "%zu bytes still counted in use", dev->bytes_in_use);
  fy_device_free(dev);
  fy_matmul_cache_clear();
  return check_summary("backend_ops");
}
