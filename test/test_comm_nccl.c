// runtime/comm_nccl.c, the nccl communicator, on GPUs with one rank per GPU (mpirun -np N, N at most
// the GPUs; one rank is a real run too): every collective on device memory against inputs that every
// rank can compute (f32 and bf16, counts that do not divide by the world size, in place), on the
// default stream and enqueued on a cuda stream, split groups, a buffer or stream it cannot take; and,
// with two ranks or more, the failure rules: a rank that skips a collective makes the job end after
// --comm-timeout with the message naming the operation and the step (on the default stream and on a
// stream, where the watchdog sees it), a rank that dies makes the job end.
//
// NCCL does not sum in rank order (comm.h): with one or two ranks the sums are still exact (a + b =
// b + a, and two bf16 values add exactly in fp32), with more they are checked against the exact sum
// within float rounding. Every rank must get the same bits, and a rerun the same bits again.
//
// usage: test_comm_nccl --gpus                       prints how many GPUs it sees
//        test_comm_nccl                              the checks
//        test_comm_nccl --timeout-case T [--stream]  mpirun -np 2: rank 1 skips an all-reduce at step 7;
//                                                    rank 0 must end the job after T s
//        test_comm_nccl --die-case                   mpirun -np 2: rank 1 exits mid-job
// Every form exits 77 (meson's skip) on a machine without a GPU. test/test_comm_nccl.sh runs them.
#include <math.h>
#include <string.h>
#include <unistd.h>

#include "core/device.h"
#include "core/device_cuda.h"
#include "core/dtype.h"
#include "core/status.h"
#include "runtime/comm.h"
#include "test/check.h"
#include "test/comm_inputs.h"

static struct fy_device *g_dev;
static fy_stream *g_s;

static const char *dt_name(enum fy_reduce_dtype dt) { return dt == FY_COMM_F32 ? "f32" : "bf16"; }

static float elem(const void *x, enum fy_reduce_dtype dt, size_t i) {
  return dt == FY_COMM_F32 ? ((const float *)x)[i] : fy_bf16_to_f32(((const uint16_t *)x)[i]);
}

// Elements of x (n of them, the sums' indices from `from`) that are not the sum over ranks[0..nr):
// bit for bit with up to two ranks, within rounding of the exact sum with more.
static size_t sum_mismatches(const void *x, enum fy_reduce_dtype dt, const int *ranks, int nr, size_t from,
                             size_t n) {
  size_t bad = 0;
  for (size_t i = 0; i < n; i++) {
    float got = elem(x, dt, i);
    if (nr <= 2) {
      float want = input_f32(dt, ranks[0], from + i);
      if (nr == 2) want += input_f32(dt, ranks[1], from + i);
      if (dt == FY_COMM_BF16) want = fy_bf16_to_f32(fy_f32_to_bf16(want));
      bad += memcmp(&got, &want, 4) != 0;
      continue;
    }
    double exact = 0, mag = 0;
    for (int q = 0; q < nr; q++) {
      double v = input_f32(dt, ranks[q], from + i);
      exact += v;
      mag += fabs(v);
    }
    double tol = nr * (dt == FY_COMM_F32 ? 0x1p-23 : 0x1p-7) * mag;
    bad += !(fabs(got - exact) <= tol);
  }
  return bad;
}

// ---- device memory ----

static void *dev_alloc(size_t n) {
  void *p = NULL;
  CHECK_OK(fy_device_alloc(g_dev, n, &p));
  return p;
}

static void put(void *d, const void *h, size_t n) {
  CHECK_OK(fy_copy_async(g_s, d, h, n));
  CHECK_OK(fy_stream_sync(g_s));
}

static void get(void *h, const void *d, size_t n) {
  CHECK_OK(fy_copy_async(g_s, h, d, n));
  CHECK_OK(fy_stream_sync(g_s));
}

// Waits for what was enqueued on s (nothing to do for the default stream: the call waited).
static void done(fy_stream *s) {
  if (s) CHECK_OK(fy_stream_sync(s));
}

// The same 8 bytes on every rank? (all-gathered through the communicator as 4 bf16, only copied)
static bool same_everywhere(struct fy_comm *c, uint64_t h) {
  int n = fy_comm_size(c);
  uint64_t *d = dev_alloc(8 + (size_t)n * 8), *all = calloc((size_t)n, 8);
  put(d, &h, 8);
  CHECK_OK(fy_comm_all_gather(c, d, d + 1, 4, FY_COMM_BF16, NULL));
  get(all, d + 1, (size_t)n * 8);
  bool same = true;
  for (int p = 0; p < n; p++) same &= all[p] == h;
  fy_device_dealloc(g_dev, d, 8 + (size_t)n * 8);
  free(all);
  return same;
}

// ---- the collectives ----

static void test_all_reduce(struct fy_comm *c, enum fy_reduce_dtype dt, size_t n, fy_stream *s) {
  int N = fy_comm_size(c), r = fy_comm_rank(c);
  size_t es = fy_comm_dtype_size(dt);
  int *ranks = all_ranks(N);
  void *x = malloc(n * es), *d = dev_alloc(n * es);
  fill(x, dt, r, 0, n);
  put(d, x, n * es);
  CHECK_OK(fy_comm_all_reduce(c, d, n, dt, s));
  done(s);
  get(x, d, n * es);
  size_t bad = sum_mismatches(x, dt, ranks, N, 0, n);
  CHECKF(bad == 0, "all-reduce %s of %zu%s: %zu elements wrong", dt_name(dt), n, s ? " on a stream" : "", bad);
  uint64_t h = hash_bytes(x, n * es);
  CHECKF(same_everywhere(c, h), "all-reduce %s of %zu: the ranks got different bits", dt_name(dt), n);
  fill(x, dt, r, 0, n);  // again: the same bits
  put(d, x, n * es);
  CHECK_OK(fy_comm_all_reduce(c, d, n, dt, s));
  done(s);
  get(x, d, n * es);
  CHECKF(hash_bytes(x, n * es) == h, "all-reduce %s of %zu: a rerun gave other bits", dt_name(dt), n);
  fy_device_dealloc(g_dev, d, n * es);
  free(x);
  free(ranks);
}

static void test_reduce_scatter(struct fy_comm *c, enum fy_reduce_dtype dt, size_t rc, bool in_place, fy_stream *s) {
  int N = fy_comm_size(c), r = fy_comm_rank(c);
  size_t es = fy_comm_dtype_size(dt), total = (size_t)N * rc;
  int *ranks = all_ranks(N);
  char *x = malloc(total * es), *send = dev_alloc(total * es);
  char *recv = in_place ? send + (size_t)r * rc * es : dev_alloc(rc * es);
  fill(x, dt, r, 0, total);
  put(send, x, total * es);
  CHECK_OK(fy_comm_reduce_scatter(c, send, recv, rc, dt, s));
  done(s);
  get(x, recv, rc * es);
  size_t bad = sum_mismatches(x, dt, ranks, N, (size_t)r * rc, rc);
  CHECKF(bad == 0, "reduce-scatter %s of %zu per rank%s%s: %zu elements wrong", dt_name(dt), rc,
         in_place ? " in place" : "", s ? " on a stream" : "", bad);
  if (!in_place) {  // the send buffer is left alone
    char *ref = malloc(total * es);
    fill(ref, dt, r, 0, total);
    get(x, send, total * es);
    CHECK(memcmp(ref, x, total * es) == 0);
    free(ref);
    fy_device_dealloc(g_dev, recv, rc * es);
  }
  fy_device_dealloc(g_dev, send, total * es);
  free(x);
  free(ranks);
}

static void test_all_gather(struct fy_comm *c, enum fy_reduce_dtype dt, size_t sc, bool in_place, fy_stream *s) {
  int N = fy_comm_size(c), r = fy_comm_rank(c);
  size_t es = fy_comm_dtype_size(dt), total = (size_t)N * sc;
  char *x = calloc(total, es), *recv = dev_alloc(total * es);
  char *send = in_place ? recv + (size_t)r * sc * es : dev_alloc(sc * es);
  put(recv, x, total * es);  // zeros, so that a part left out shows
  fill(x, dt, r, (size_t)r * sc, sc);
  put(send, x, sc * es);
  CHECK_OK(fy_comm_all_gather(c, send, recv, sc, dt, s));
  done(s);
  get(x, recv, total * es);
  char *want = malloc(sc * es);
  for (int p = 0; p < N; p++) {
    fill(want, dt, p, (size_t)p * sc, sc);
    CHECKF(memcmp(x + (size_t)p * sc * es, want, sc * es) == 0, "all-gather %s%s%s: rank %d's part is wrong",
           dt_name(dt), in_place ? " in place" : "", s ? " on a stream" : "", p);
  }
  free(want);
  if (!in_place) fy_device_dealloc(g_dev, send, sc * es);
  fy_device_dealloc(g_dev, recv, total * es);
  free(x);
}

static void test_broadcast(struct fy_comm *c, size_t bytes, int root, fy_stream *s) {
  unsigned char *b = malloc(bytes), *d = dev_alloc(bytes);
  for (size_t i = 0; i < bytes; i++) b[i] = fy_comm_rank(c) == root ? (unsigned char)(comm_mix(i) >> 7) : 0xee;
  put(d, b, bytes);
  CHECK_OK(fy_comm_broadcast(c, d, bytes, root, s));
  done(s);
  get(b, d, bytes);
  size_t bad = 0;
  for (size_t i = 0; i < bytes; i++) bad += b[i] != (unsigned char)(comm_mix(i) >> 7);
  CHECKF(bad == 0, "broadcast of %zu bytes from %d%s: %zu bytes wrong", bytes, root, s ? " on a stream" : "", bad);
  fy_device_dealloc(g_dev, d, bytes);
  free(b);
}

// Several collectives enqueued back to back on one stream (the all-gather reads what the
// reduce-scatter wrote), one sync, then every result.
static void test_stream_chain(struct fy_comm *c) {
  int N = fy_comm_size(c), r = fy_comm_rank(c);
  int *ranks = all_ranks(N);
  const size_t n = 300007, rc = 70001;
  float *a = malloc(n * 4), *send = malloc((size_t)N * rc * 4), *ag = malloc((size_t)N * rc * 4);
  uint16_t *h = malloc(n * 2);
  float *da = dev_alloc(n * 4), *dsend = dev_alloc((size_t)N * rc * 4), *drs = dev_alloc(rc * 4);
  float *dag = dev_alloc((size_t)N * rc * 4);
  uint16_t *dh = dev_alloc(n * 2);
  fill(a, FY_COMM_F32, r, 0, n);
  fill(h, FY_COMM_BF16, r, 0, n);
  fill(send, FY_COMM_F32, r, 0, (size_t)N * rc);
  put(da, a, n * 4);
  put(dh, h, n * 2);
  put(dsend, send, (size_t)N * rc * 4);
  fy_comm_set_step(c, 3);
  CHECK_OK(fy_comm_all_reduce(c, da, n, FY_COMM_F32, g_s));
  CHECK_OK(fy_comm_all_reduce(c, dh, n, FY_COMM_BF16, g_s));
  CHECK_OK(fy_comm_reduce_scatter(c, dsend, drs, rc, FY_COMM_F32, g_s));
  CHECK_OK(fy_comm_all_gather(c, drs, dag, rc, FY_COMM_F32, g_s));
  CHECK_OK(fy_comm_broadcast(c, dsend, rc * 4, N - 1, g_s));
  CHECK_OK(fy_stream_sync(g_s));
  CHECK_OK(fy_comm_status(c));
  get(a, da, n * 4);
  get(h, dh, n * 2);
  get(ag, dag, (size_t)N * rc * 4);
  get(send, dsend, rc * 4);
  CHECK(sum_mismatches(a, FY_COMM_F32, ranks, N, 0, n) == 0);
  CHECK(sum_mismatches(h, FY_COMM_BF16, ranks, N, 0, n) == 0);
  size_t bad = 0;
  for (int p = 0; p < N; p++) bad += sum_mismatches(ag + (size_t)p * rc, FY_COMM_F32, ranks, N, (size_t)p * rc, rc);
  CHECKF(bad == 0, "stream all-gather of the reduce-scatter: %zu elements wrong", bad);
  float *want = malloc(rc * 4);
  fill(want, FY_COMM_F32, N - 1, 0, rc);
  CHECK(memcmp(send, want, rc * 4) == 0);
  free(want);
  fy_device_dealloc(g_dev, da, n * 4);
  fy_device_dealloc(g_dev, dh, n * 2);
  fy_device_dealloc(g_dev, dsend, (size_t)N * rc * 4);
  fy_device_dealloc(g_dev, drs, rc * 4);
  fy_device_dealloc(g_dev, dag, (size_t)N * rc * 4);
  free(a), free(h), free(send), free(ag), free(ranks);
}

static void test_split(struct fy_comm *c) {
  int N = fy_comm_size(c), r = fy_comm_rank(c);
  // Color by parity, key reversed: members ordered by descending world rank.
  struct fy_comm *sub = NULL;
  CHECK_OK(fy_comm_split(c, r % 2, -r, &sub));
  CHECK(sub != NULL);
  if (!sub) return;
  CHECK(fy_comm_kind(sub) == FY_COMM_NCCL);
  int members[64], n = 0, me = -1;
  for (int p = N - 1; p >= 0; p--)
    if (p % 2 == r % 2) members[n++] = p;
  for (int q = 0; q < n; q++)
    if (members[q] == r) me = q;
  CHECK(fy_comm_size(sub) == n && fy_comm_rank(sub) == me);
  CHECK(fy_comm_local_rank(sub) == fy_comm_local_rank(c));
  const size_t cnt = 100003;
  float *x = malloc(cnt * 4), *d = dev_alloc(cnt * 4);
  fill(x, FY_COMM_F32, r, 0, cnt);
  put(d, x, cnt * 4);
  CHECK_OK(fy_comm_all_reduce(sub, d, cnt, FY_COMM_F32, NULL));
  get(x, d, cnt * 4);
  size_t bad = sum_mismatches(x, FY_COMM_F32, members, n, 0, cnt);
  CHECKF(bad == 0, "split all-reduce: %zu elements differ from the group's sum", bad);
  CHECK_OK(fy_comm_barrier(sub));
  fy_comm_free(sub);
  fy_device_dealloc(g_dev, d, cnt * 4);
  free(x);

  // A negative color leaves a rank out; the others form a group.
  sub = NULL;
  CHECK_OK(fy_comm_split(c, r == 0 ? -1 : 0, r, &sub));
  if (r == 0) {
    CHECK(sub == NULL);
  } else {
    CHECK(sub && fy_comm_size(sub) == N - 1 && fy_comm_rank(sub) == r - 1);
    if (sub) CHECK_OK(fy_comm_barrier(sub));
  }
  fy_comm_free(sub);
}

// What the nccl communicator refuses. Each refusal breaks the communicator it happens on (every
// error of a collective does, comm.h), so each gets a group of its own; every rank makes the same
// mistake, so nobody is left inside NCCL.
static void test_refusals(struct fy_comm *c) {
  const size_t n = 1024;
  float *host = calloc(n, 4), *d = dev_alloc(n * 4);

  // Argument errors come from the front end and break nothing.
  CHECK_ERR(fy_comm_broadcast(c, d, 16, fy_comm_size(c), g_s), FY_ERR_INVALID);
  CHECK_OK(fy_comm_status(c));

  struct fy_comm *e = NULL;
  CHECK_OK(fy_comm_split(c, 0, 0, &e));
  if (e) {  // host memory
    CHECK_ERR(fy_comm_all_reduce(e, host, n, FY_COMM_F32, NULL), FY_ERR_INVALID);
    CHECK_ERR(fy_comm_status(e), FY_ERR_INVALID);
    CHECK(strstr(fy_error_msg(), "host memory") != NULL);
    CHECK_ERR(fy_comm_all_reduce(e, d, n, FY_COMM_F32, NULL), FY_ERR_INVALID);  // at once: broken
    fy_comm_free(e);
  }
  e = NULL;
  CHECK_OK(fy_comm_split(c, 0, 0, &e));
  struct fy_device *sim = NULL;
  fy_stream *ss = NULL;
  CHECK_OK(fy_device_sim_create((size_t)1 << 20, 0, &sim));
  if (sim) CHECK_OK(fy_stream_create(sim, &ss));
  if (e && ss) {  // a stream that is not a cuda stream
    CHECK_ERR(fy_comm_all_reduce(e, d, n, FY_COMM_F32, ss), FY_ERR_INVALID);
    CHECK_ERR(fy_comm_barrier(e), FY_ERR_INVALID);
  }
  fy_comm_free(e);
  if (ss) fy_stream_free(ss);
  fy_device_free(sim);
  CHECK_OK(fy_comm_status(c));  // the parent is untouched
  CHECK_OK(fy_comm_barrier(c));
  fy_device_dealloc(g_dev, d, n * 4);
  free(host);
}

// ---- setup ----

static long env_long(const char *name) {
  const char *v = getenv(name);
  return v && *v ? strtol(v, NULL, 10) : -1;
}

// The communicator and this rank's device and stream (the GPU the communicator picked).
static struct fy_comm *open_comm(double timeout_s) {
  struct fy_comm *c = NULL;
  if (fy_comm_create("nccl", timeout_s, &c) != FY_OK) {
    fprintf(stderr, "test_comm_nccl: %s\n", fy_error_msg());
    return NULL;
  }
  int gpus = fy_cuda_device_count(), local = fy_comm_local_rank(c);
  if (fy_device_cuda_create(local < gpus ? local : 0, 0, &g_dev) != FY_OK ||
      fy_stream_create(g_dev, &g_s) != FY_OK) {
    fprintf(stderr, "test_comm_nccl: %s\n", fy_error_msg());
    fy_comm_free(c);
    return NULL;
  }
  return c;
}

static void close_comm(struct fy_comm *c) {
  fy_stream_free(g_s);
  fy_device_free(g_dev);
  fy_comm_free(c);
}

// ---- point-to-point (fy_comm_group_p2p: ncclSend and ncclRecv in one group) ----

// Every rank sends to the next (in a ring) and receives from the one before, in one group (with two
// ranks: both directions at once, which only a group lets NCCL complete); messages of several
// pieces of the emulator's channel and of odd sizes; then three messages in a row to the next rank
// grouped with their three receives, which must arrive in order; each rank's bytes are its own
// pattern, so a message from the wrong rank or in the wrong order shows. On s (NULL: the default
// stream). One rank: a message to itself and a mpi-style call refused.
static void test_p2p(struct fy_comm *c, fy_stream *s) {
  int N = fy_comm_size(c), r = fy_comm_rank(c);
  if (N == 1) {
    float *d = dev_alloc(4);
    struct fy_comm_p2p self = {.buf = d, .bytes = 4, .peer = 0, .send = 1};
    CHECK(fy_comm_group_p2p(c, &self, 1, s) == FY_ERR_INVALID);
    fy_device_dealloc(g_dev, d, 4);
    return;
  }
  const int next = (r + 1) % N, prev = (r + N - 1) % N;
  const size_t sizes[] = {4, 1000003 * 4, 3 * (1 << 20) + 12};
  for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
    const size_t n = sizes[k] / 4;
    float *x = malloc(sizes[k]), *y = malloc(sizes[k]);
    void *ds = dev_alloc(sizes[k]), *dr = dev_alloc(sizes[k]);
    fill(x, FY_COMM_F32, r, k * 7, n);
    put(ds, x, sizes[k]);
    struct fy_comm_p2p m[2] = {{.buf = ds, .bytes = sizes[k], .peer = next, .send = 1},
                               {.buf = dr, .bytes = sizes[k], .peer = prev, .send = 0}};
    CHECK_OK(fy_comm_group_p2p(c, m, 2, s));
    done(s);
    get(y, dr, sizes[k]);
    fill(x, FY_COMM_F32, prev, k * 7, n);
    CHECK(memcmp(x, y, sizes[k]) == 0);
    fy_device_dealloc(g_dev, ds, sizes[k]);
    fy_device_dealloc(g_dev, dr, sizes[k]);
    free(x);
    free(y);
  }
  enum { K = 3, E = 70001 };
  float *x = malloc(K * E * 4), *y = malloc(K * E * 4);
  float *ds = dev_alloc(K * E * 4), *dr = dev_alloc(K * E * 4);
  struct fy_comm_p2p m[2 * K];
  for (int k = 0; k < K; k++) {
    fill(x + k * E, FY_COMM_F32, r, (size_t)k * E, E);
    m[k] = (struct fy_comm_p2p){.buf = ds + k * E, .bytes = E * 4, .peer = next, .send = 1};
    m[K + k] = (struct fy_comm_p2p){.buf = dr + k * E, .bytes = E * 4, .peer = prev, .send = 0};
  }
  put(ds, x, K * E * 4);
  CHECK_OK(fy_comm_group_p2p(c, m, 2 * K, s));
  done(s);
  get(y, dr, K * E * 4);
  fill(x, FY_COMM_F32, prev, 0, K * E);
  CHECK(memcmp(x, y, K * E * 4) == 0);
  // One direction alone needs no group: rank 0 sends to rank 1 and rank 1 receives, on its own.
  if (r < 2) {
    fill(x, FY_COMM_F32, 0, 5, E);
    if (r == 0) put(ds, x, E * 4);
    struct fy_comm_p2p one = {.buf = r == 0 ? (void *)ds : (void *)dr, .bytes = E * 4, .peer = 1 - r, .send = r == 0};
    CHECK_OK(fy_comm_group_p2p(c, &one, 1, s));
    done(s);
    if (r == 1) {
      get(y, dr, E * 4);
      CHECK(memcmp(x, y, E * 4) == 0);
    }
  }
  fy_device_dealloc(g_dev, ds, K * E * 4);
  fy_device_dealloc(g_dev, dr, K * E * 4);
  free(x);
  free(y);
}

static int run_checks(void) {
  struct fy_comm *c = open_comm(60);
  CHECK(c != NULL);
  if (!c) return check_summary("test_comm_nccl");
  int N = fy_comm_size(c), r = fy_comm_rank(c);
  CHECK(fy_comm_kind(c) == FY_COMM_NCCL && strcmp(fy_comm_kind_name(c), "nccl") == 0);
  CHECK(c->timeout_s == 60);
  if (env_long("OMPI_COMM_WORLD_SIZE") > 0) {
    CHECK(N == env_long("OMPI_COMM_WORLD_SIZE"));
    CHECK(r == env_long("OMPI_COMM_WORLD_RANK"));
  }
  CHECK_OK(fy_comm_barrier(c));
  for (int d = 0; d < 2; d++) {
    enum fy_reduce_dtype dt = d ? FY_COMM_BF16 : FY_COMM_F32;
    test_all_reduce(c, dt, 1000003, NULL);
    test_all_reduce(c, dt, 1, NULL);  // fewer elements than ranks
    test_all_reduce(c, dt, (size_t)N + 1, NULL);
    test_all_reduce(c, dt, 1000003, g_s);
    test_reduce_scatter(c, dt, 333333, false, NULL);
    test_reduce_scatter(c, dt, 333333, true, NULL);
    test_reduce_scatter(c, dt, 1, false, g_s);
    test_all_gather(c, dt, 333331, false, NULL);
    test_all_gather(c, dt, 333331, true, g_s);
  }
  test_broadcast(c, 1000003, N - 1, NULL);
  test_broadcast(c, 1, 0, g_s);
  test_stream_chain(c);
  test_p2p(c, NULL);
  test_p2p(c, g_s);
  test_split(c);
  test_refusals(c);
  CHECK_OK(fy_comm_status(c));
  if (r == 0) fprintf(stderr, "nccl backend: %d ranks\n", N);
  close_comm(c);
  return check_summary("test_comm_nccl");
}

// ---- failure cases, each run as its own job by the runner ----

static int timeout_case(double t, bool on_stream) {
  struct fy_comm *c = open_comm(t);
  if (!c) return 1;
  const size_t n = (size_t)1 << 18;  // 1 MiB of f32
  float *d = dev_alloc(n * 4);
  fy_stream *s = on_stream ? g_s : NULL;
  // Once together, so that NCCL's connections for this size exist and the skipped one below hangs
  // on the GPU (where only the watchdog sees it), not in its launch.
  CHECK_OK(fy_comm_all_reduce(c, d, n, FY_COMM_F32, s));
  if (s) CHECK_OK(fy_stream_sync(s));
  fy_comm_set_step(c, 7);
  if (fy_comm_rank(c) == 1) {
    sleep(60);  // skips the all-reduce; the job is over before this returns
  } else {
    fy_status st = fy_comm_all_reduce(c, d, n, FY_COMM_F32, s);
    if (st == FY_OK && s) st = fy_stream_sync(s);
    fprintf(stderr, "test_comm_nccl: the all-reduce returned %d (%s) instead of ending the job\n", (int)st,
            st == FY_OK ? "ok" : fy_error_msg());
  }
  return 1;
}

static int die_case(void) {
  struct fy_comm *c = open_comm(120);
  if (!c) return 1;
  const size_t n = (size_t)1 << 18;
  float *d = dev_alloc(n * 4);
  CHECK_OK(fy_comm_all_reduce(c, d, n, FY_COMM_F32, NULL));
  fy_comm_set_step(c, 5);
  if (fy_comm_rank(c) == 1) _exit(9);  // dies without a word to MPI or NCCL
  fy_status st = fy_comm_all_reduce(c, d, n, FY_COMM_F32, NULL);
  if (st == FY_OK) fprintf(stderr, "test_comm_nccl: rank 0 got past the all-reduce with a dead peer\n");
  else fprintf(stderr, "test_comm_nccl: rank 0: %s\n", fy_error_msg());
  return 1;
}

int main(int argc, char **argv) {
  int gpus = fy_cuda_device_count();
  if (argc > 1 && strcmp(argv[1], "--gpus") == 0) {
    printf("%d\n", gpus);
    return gpus > 0 ? 0 : 77;
  }
  if (gpus == 0) {
    fprintf(stderr, "test_comm_nccl: no GPU: skipped\n");
    return 77;
  }
  if (argc > 2 && strcmp(argv[1], "--timeout-case") == 0)
    return timeout_case(atof(argv[2]), argc > 3 && strcmp(argv[3], "--stream") == 0);
  if (argc > 1 && strcmp(argv[1], "--die-case") == 0) return die_case();
  return run_checks();
}
