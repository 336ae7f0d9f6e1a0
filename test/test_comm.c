// runtime/comm.c: the single backend (always) and, when started by mpirun with several ranks, the
// mpi backend: every collective against a hand-computed expectation (f32 and bf16, odd counts that
// do not divide by the world size), the same bits on every rank and on a rerun, in-place forms,
// split groups, collectives enqueued on sim-device streams (with injected delays, and on two
// communicators from two threads at once), argument errors.
//
// Every rank can compute every rank's input (value(rank, i) below), so each checks its own result
// exactly: a sum is expected to be ((x0 + x1) + x2) + ... in fp32, in rank order.
//
// usage: test_comm                       the tests (single; mpi too under mpirun -np N)
//        test_comm --timeout-case T      under mpirun -np 2: rank 1 skips an all-reduce at step 7; rank 0
//                                        must end the job after T s ("... did not complete within T s ...")
//        test_comm --die-case            under mpirun -np 2: rank 1 exits mid-job; the job must end
// test/test_comm_mpi.sh runs all of them.
#include <stdatomic.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core/device.h"
#include "core/dtype.h"
#include "core/status.h"
#include "runtime/comm.h"
#include "test/check.h"
#include "test/comm_inputs.h"

// Expected rank-order sum over ranks[0..n) at index i, in dt's bits (returned in a uint32).
static uint32_t expect_sum(enum fy_reduce_dtype dt, const int *ranks, int n, size_t i) {
  float acc = input_f32(dt, ranks[0], i);
  for (int q = 1; q < n; q++) acc += input_f32(dt, ranks[q], i);
  if (dt == FY_COMM_BF16) return fy_f32_to_bf16(acc);
  uint32_t u;
  memcpy(&u, &acc, 4);
  return u;
}

static uint32_t bits_at(const void *x, enum fy_reduce_dtype dt, size_t i) {
  if (dt == FY_COMM_BF16) return ((const uint16_t *)x)[i];
  uint32_t u;
  memcpy(&u, (const float *)x + i, 4);
  return u;
}

// Counts elements of x (n, from index `from` of the sums) that differ from the expected sum.
static size_t sum_mismatches(const void *x, enum fy_reduce_dtype dt, const int *ranks, int nr,
                             size_t from, size_t n) {
  size_t bad = 0;
  for (size_t i = 0; i < n; i++) bad += bits_at(x, dt, i) != expect_sum(dt, ranks, nr, from + i);
  return bad;
}

static const char *dt_name(enum fy_reduce_dtype dt) { return dt == FY_COMM_F32 ? "f32" : "bf16"; }

// ---- the single backend ----

static void test_single(void) {
  struct fy_comm *c = NULL;
  CHECK_OK(fy_comm_create("single", 0, &c));
  if (!c) return;
  CHECK(fy_comm_rank(c) == 0 && fy_comm_size(c) == 1 && fy_comm_local_rank(c) == 0 && fy_comm_local_size(c) == 1);
  CHECK(fy_comm_kind(c) == FY_COMM_SINGLE && strcmp(fy_comm_kind_name(c), "single") == 0);
  CHECK(c->timeout_s == FY_COMM_DEFAULT_TIMEOUT_S);
  const size_t n = 1001;
  float *a = malloc(n * 4), *b = malloc(n * 4);
  fill(a, FY_COMM_F32, 0, 0, n);
  memcpy(b, a, n * 4);
  CHECK_OK(fy_comm_all_reduce(c, a, n, FY_COMM_F32, NULL));
  CHECK(memcmp(a, b, n * 4) == 0);
  struct fy_comm_req *q = NULL;  // (no peers: point-to-point is the mpi backend's)
  CHECK_ERR(fy_comm_isend(c, a, 4, 0, 1, &q), FY_ERR_UNSUPPORTED);
  CHECK(q == NULL);
  float *r = calloc(n, 4);
  CHECK_OK(fy_comm_reduce_scatter(c, a, r, n, FY_COMM_F32, NULL));
  CHECK(memcmp(r, b, n * 4) == 0);
  memset(r, 0, n * 4);
  CHECK_OK(fy_comm_all_gather(c, a, r, n, FY_COMM_F32, NULL));
  CHECK(memcmp(r, b, n * 4) == 0);
  CHECK_OK(fy_comm_broadcast(c, a, n * 4, 0, NULL));
  CHECK_OK(fy_comm_barrier(c));
  CHECK_ERR(fy_comm_broadcast(c, a, n * 4, 1, NULL), FY_ERR_INVALID);
  CHECK_ERR(fy_comm_all_reduce(c, NULL, n, FY_COMM_F32, NULL), FY_ERR_INVALID);
  CHECK_ERR(fy_comm_all_reduce(c, a, n, (enum fy_reduce_dtype)7, NULL), FY_ERR_INVALID);
  CHECK_ERR(fy_comm_reduce_scatter(c, a, a + 1, n - 1, FY_COMM_F32, NULL), FY_ERR_INVALID);
  CHECK_OK(fy_comm_status(c));
  int64_t cnt = (int64_t)n, got = 0;  // all-to-all with itself: a copy
  float *r2 = calloc(n, 4);
  CHECK_OK(fy_comm_all_to_all(c, &cnt, &got, 1));
  CHECK(got == cnt);
  CHECK_OK(fy_comm_all_to_all_v(c, b, &cnt, r2, &cnt));
  CHECK(memcmp(r2, b, n * 4) == 0);
  free(r2);

  // Stream form on the sim device, device memory: the copies go through the stream.
  struct fy_device *dev = NULL;
  CHECK_OK(fy_device_sim_create((size_t)16 << 20, 0, &dev));
  fy_stream *s = NULL;
  CHECK_OK(fy_stream_create(dev, &s));
  void *d1 = NULL, *d2 = NULL;
  CHECK_OK(fy_device_alloc(dev, n * 4, &d1));
  CHECK_OK(fy_device_alloc(dev, n * 4, &d2));
  CHECK_OK(fy_copy_async(s, d1, b, n * 4));
  CHECK_OK(fy_comm_all_reduce(c, d1, n, FY_COMM_F32, s));
  CHECK_OK(fy_comm_reduce_scatter(c, d1, d2, n, FY_COMM_F32, s));
  memset(r, 0, n * 4);
  CHECK_OK(fy_copy_async(s, r, d2, n * 4));
  CHECK_OK(fy_stream_sync(s));
  CHECK(memcmp(r, b, n * 4) == 0);
  fy_device_dealloc(dev, d1, n * 4);
  fy_device_dealloc(dev, d2, n * 4);
  fy_stream_free(s);
  fy_device_free(dev);

  struct fy_comm *sub = NULL;
  CHECK_OK(fy_comm_split(c, 3, 0, &sub));
  CHECK(sub && fy_comm_size(sub) == 1);
  fy_comm_free(sub);
  sub = (struct fy_comm *)1;
  CHECK_OK(fy_comm_split(c, -1, 0, &sub));
  CHECK(sub == NULL);

  struct fy_comm *x = NULL;
  CHECK_ERR(fy_comm_create("gloo", 0, &x), FY_ERR_INVALID);
  CHECK(x == NULL);
  char buf[32];
  CHECK(strcmp(fy_comm_size_text((size_t)64 << 20, buf, sizeof buf), "64 MiB") == 0);
  CHECK(strcmp(fy_comm_size_text(1536, buf, sizeof buf), "1.5 KiB") == 0);
  CHECK(strcmp(fy_comm_size_text(12, buf, sizeof buf), "12 B") == 0);
  free(a), free(b), free(r);
  fy_comm_free(c);
}

// ---- the mpi backend ----

static long env_long(const char *name) {
  const char *v = getenv(name);
  return v ? strtol(v, NULL, 10) : -1;
}

// The same 8 bytes on every rank? (all-gathered as 4 bf16 elements, which are only copied)
static bool same_everywhere(struct fy_comm *c, uint64_t h) {
  int n = fy_comm_size(c);
  uint64_t *all = calloc((size_t)n, 8);
  CHECK_OK(fy_comm_all_gather(c, &h, all, 4, FY_COMM_BF16, NULL));
  bool same = true;
  for (int p = 0; p < n; p++) same &= all[p] == h;
  free(all);
  return same;
}

static void test_all_reduce(struct fy_comm *c, enum fy_reduce_dtype dt, size_t n) {
  int N = fy_comm_size(c), r = fy_comm_rank(c);
  size_t es = fy_comm_dtype_size(dt);
  int *ranks = all_ranks(N);
  void *x = malloc(n * es);
  fill(x, dt, r, 0, n);
  CHECK_OK(fy_comm_all_reduce(c, x, n, dt, NULL));
  size_t bad = sum_mismatches(x, dt, ranks, N, 0, n);
  CHECKF(bad == 0, "all-reduce %s of %zu: %zu elements differ from the rank-order sum", dt_name(dt), n, bad);
  uint64_t h = hash_bytes(x, n * es);
  CHECKF(same_everywhere(c, h), "all-reduce %s: ranks disagree", dt_name(dt));
  fill(x, dt, r, 0, n);  // run twice: the same bits
  CHECK_OK(fy_comm_all_reduce(c, x, n, dt, NULL));
  CHECKF(hash_bytes(x, n * es) == h, "all-reduce %s: a rerun gave other bits", dt_name(dt));
  free(x);
  free(ranks);
}

static void test_reduce_scatter(struct fy_comm *c, enum fy_reduce_dtype dt, size_t rc, bool in_place) {
  int N = fy_comm_size(c), r = fy_comm_rank(c);
  size_t es = fy_comm_dtype_size(dt);
  int *ranks = all_ranks(N);
  char *send = malloc((size_t)N * rc * es);
  fill(send, dt, r, 0, (size_t)N * rc);
  char *recv = in_place ? send + (size_t)r * rc * es : malloc(rc * es);
  CHECK_OK(fy_comm_reduce_scatter(c, send, recv, rc, dt, NULL));
  size_t bad = sum_mismatches(recv, dt, ranks, N, (size_t)r * rc, rc);
  CHECKF(bad == 0, "reduce-scatter %s of %zu per rank%s: %zu elements differ", dt_name(dt), rc,
         in_place ? " in place" : "", bad);
  if (!in_place) {  // the send buffer is left alone
    char *ref = malloc((size_t)N * rc * es);
    fill(ref, dt, r, 0, (size_t)N * rc);
    CHECK(memcmp(ref, send, (size_t)N * rc * es) == 0);
    free(ref);
    free(recv);
  }
  free(send);
  free(ranks);
}

static void test_all_gather(struct fy_comm *c, enum fy_reduce_dtype dt, size_t sc, bool in_place) {
  int N = fy_comm_size(c), r = fy_comm_rank(c);
  size_t es = fy_comm_dtype_size(dt);
  char *recv = calloc((size_t)N * sc, es);
  char *send = in_place ? recv + (size_t)r * sc * es : malloc(sc * es);
  fill(send, dt, r, (size_t)r * sc, sc);
  CHECK_OK(fy_comm_all_gather(c, send, recv, sc, dt, NULL));
  char *want = malloc(sc * es);
  for (int p = 0; p < N; p++) {
    fill(want, dt, p, (size_t)p * sc, sc);
    CHECKF(memcmp(recv + (size_t)p * sc * es, want, sc * es) == 0, "all-gather %s%s: rank %d's part is wrong",
           dt_name(dt), in_place ? " in place" : "", p);
  }
  free(want);
  if (!in_place) free(send);
  free(recv);
}

static void test_broadcast(struct fy_comm *c, size_t bytes, int root) {
  unsigned char *b = malloc(bytes);
  for (size_t i = 0; i < bytes; i++) b[i] = fy_comm_rank(c) == root ? (unsigned char)(comm_mix(i) >> 7) : 0xee;
  CHECK_OK(fy_comm_broadcast(c, b, bytes, root, NULL));
  size_t bad = 0;
  for (size_t i = 0; i < bytes; i++) bad += b[i] != (unsigned char)(comm_mix(i) >> 7);
  CHECKF(bad == 0, "broadcast of %zu bytes from %d: %zu bytes wrong", bytes, root, bad);
  free(b);
}

static void test_split(struct fy_comm *c) {
  int N = fy_comm_size(c), r = fy_comm_rank(c);
  // Color by parity, key reversed: members ordered by descending world rank.
  struct fy_comm *sub = NULL;
  CHECK_OK(fy_comm_split(c, r % 2, -r, &sub));
  if (!sub) return;
  int members[64], n = 0;
  for (int p = N - 1; p >= 0; p--)
    if (p % 2 == r % 2) members[n++] = p;
  CHECK(fy_comm_size(sub) == n);
  int me = -1;
  for (int q = 0; q < n; q++)
    if (members[q] == r) me = q;
  CHECK(fy_comm_rank(sub) == me);
  CHECK(fy_comm_local_rank(sub) == fy_comm_local_rank(c) && fy_comm_local_size(sub) == fy_comm_local_size(c));
  const size_t cnt = 100003;
  float *x = malloc(cnt * 4);
  fill(x, FY_COMM_F32, r, 0, cnt);
  CHECK_OK(fy_comm_all_reduce(sub, x, cnt, FY_COMM_F32, NULL));
  size_t bad = sum_mismatches(x, FY_COMM_F32, members, n, 0, cnt);
  CHECKF(bad == 0, "split all-reduce: %zu elements differ from the sum in the group's rank order", bad);
  fy_comm_free(sub);
  free(x);

  // A negative color leaves a rank out; the others form a group.
  CHECK_OK(fy_comm_split(c, r == 0 ? -1 : 0, r, &sub));
  if (r == 0) {
    CHECK(sub == NULL);
  } else {
    CHECK(sub && fy_comm_size(sub) == N - 1 && fy_comm_rank(sub) == r - 1);
    if (sub) CHECK_OK(fy_comm_barrier(sub));
  }
  fy_comm_free(sub);
}

struct direct_arg {
  struct fy_comm *c;
  float *x;
  size_t n;
  fy_status st;
};

// The stream form: collectives on sim-device streams with injected delays, their results read after
// a sync; meanwhile the main thread runs collectives on another communicator.
static void test_streams(struct fy_comm *c) {
  int N = fy_comm_size(c), r = fy_comm_rank(c);
  int *ranks = all_ranks(N);
  struct fy_device *dev = NULL;
  CHECK_OK(fy_device_sim_create((size_t)16 << 20, 0, &dev));
  fy_device_sim_set_jitter(dev, 300, 1234 + (uint64_t)r);
  fy_stream *s = NULL;
  CHECK_OK(fy_stream_create(dev, &s));
  struct fy_comm *other = NULL;  // a second communicator over the same ranks
  CHECK_OK(fy_comm_split(c, 0, r, &other));

  const size_t n = 300007, rc = 70001;
  float *a = malloc(n * 4), *send = malloc((size_t)N * rc * 4), *rs = malloc(rc * 4);
  float *ag = malloc((size_t)N * rc * 4), *b = malloc(n * 4);
  uint16_t *h = malloc(n * 2);
  fill(a, FY_COMM_F32, r, 0, n);
  fill(h, FY_COMM_BF16, r, 0, n);
  fill(send, FY_COMM_F32, r, 0, (size_t)N * rc);
  fy_comm_set_step(c, 3);
  CHECK_OK(fy_comm_all_reduce(c, a, n, FY_COMM_F32, s));
  CHECK_OK(fy_comm_all_reduce(c, h, n, FY_COMM_BF16, s));
  CHECK_OK(fy_comm_reduce_scatter(c, send, rs, rc, FY_COMM_F32, s));
  CHECK_OK(fy_comm_all_gather(c, rs, ag, rc, FY_COMM_F32, s));
  CHECK_OK(fy_comm_broadcast(c, send, rc * 4, N - 1, s));
  // Meanwhile, on this thread, another communicator.
  fill(b, FY_COMM_F32, r, 0, n);
  CHECK_OK(fy_comm_all_reduce(other, b, n, FY_COMM_F32, NULL));
  CHECK_OK(fy_comm_barrier(other));
  CHECK_OK(fy_stream_sync(s));
  CHECK_OK(fy_comm_status(c));
  CHECK(sum_mismatches(a, FY_COMM_F32, ranks, N, 0, n) == 0);
  CHECK(sum_mismatches(h, FY_COMM_BF16, ranks, N, 0, n) == 0);
  CHECK(sum_mismatches(b, FY_COMM_F32, ranks, N, 0, n) == 0);
  CHECK(sum_mismatches(rs, FY_COMM_F32, ranks, N, (size_t)r * rc, rc) == 0);
  size_t bad = 0;
  for (int p = 0; p < N; p++) bad += sum_mismatches(ag + (size_t)p * rc, FY_COMM_F32, ranks, N, (size_t)p * rc, rc);
  CHECKF(bad == 0, "stream all-gather of the reduce-scatter: %zu elements wrong", bad);
  float *want = malloc(rc * 4);
  fill(want, FY_COMM_F32, N - 1, 0, rc);
  CHECK(memcmp(send, want, rc * 4) == 0);
  free(want);

  // Errors of the arguments come back from the call itself, not later.
  CHECK_ERR(fy_comm_broadcast(c, a, 16, N, s), FY_ERR_INVALID);
  CHECK_OK(fy_comm_status(c));

  fy_stream_free(s);
  fy_device_free(dev);
  fy_comm_free(other);
  free(a), free(send), free(rs), free(ag), free(b), free(h), free(ranks);
}

// Point-to-point (pipeline stages): each rank sends two messages around the ring, both in flight
// before either is received, and they arrive in the order sent, whole; bad arguments are refused.
static void test_p2p(struct fy_comm *c) {
  const int N = fy_comm_size(c), r = fy_comm_rank(c), next = (r + 1) % N, prev = (r + N - 1) % N;
  const size_t n = 300001;
  float *a = malloc(n * 4), *b = malloc(n * 4), *got = malloc(n * 4);
  for (size_t i = 0; i < n; i++) a[i] = (float)(r * 7 + (int)(i % 1000)), b[i] = -a[i];
  struct fy_comm_req *qa = NULL, *qb = NULL;
  CHECK_OK(fy_comm_isend(c, a, n * 4, next, 5, &qa));
  CHECK_OK(fy_comm_isend(c, b, n * 4, next, 5, &qb));
  CHECK_OK(fy_comm_recv(c, got, n * 4, prev, 5));
  size_t bad = 0;
  for (size_t i = 0; i < n; i++) bad += got[i] != (float)(prev * 7 + (int)(i % 1000));
  CHECK_OK(fy_comm_recv(c, got, n * 4, prev, 5));
  for (size_t i = 0; i < n; i++) bad += got[i] != -(float)(prev * 7 + (int)(i % 1000));
  CHECKF(bad == 0, "point-to-point: %zu elements wrong or out of order", bad);
  CHECK_OK(fy_comm_wait(c, qa));
  CHECK_OK(fy_comm_wait(c, qb));
  CHECK_OK(fy_comm_wait(c, NULL));
  struct fy_comm_req *q = NULL;
  CHECK_ERR(fy_comm_isend(c, a, 4, r, 5, &q), FY_ERR_INVALID);  // to itself
  CHECK_ERR(fy_comm_isend(c, a, 4, N, 5, &q), FY_ERR_INVALID);  // no such rank
  CHECK_ERR(fy_comm_recv(c, got, 6, prev, 5), FY_ERR_INVALID);  // not whole floats
  CHECK(q == NULL);
  free(a), free(b), free(got);
}

// All-to-all (expert parallelism): rank r sends (r + 2p) % 3 * 1000 floats to rank p (some pairs
// nothing), the counts exchanged first by fy_comm_all_to_all as runtime/ep.c does; every block
// arrives whole and in place.
static void test_all_to_all(struct fy_comm *c) {
  const int N = fy_comm_size(c), r = fy_comm_rank(c);
  int64_t send_n[N], recv_n[N], sent = 0;
  for (int p = 0; p < N; p++) sent += send_n[p] = (r + 2 * p) % 3 * 1000;
  CHECK_OK(fy_comm_all_to_all(c, send_n, recv_n, 1));
  int64_t got = 0;
  for (int p = 0; p < N; p++) {
    CHECKF(recv_n[p] == (p + 2 * r) % 3 * 1000, "all-to-all: rank %d's count from rank %d", r, p);
    got += recv_n[p];
  }
  float *a = malloc((size_t)(sent + 1) * 4), *b = malloc((size_t)(got + 1) * 4);
  for (int p = 0, k = 0; p < N; p++)
    for (int64_t i = 0; i < send_n[p]; i++) a[k++] = (float)(r * 100000 + p * 10000 + i);
  CHECK_OK(fy_comm_all_to_all_v(c, a, send_n, b, recv_n));
  size_t bad = 0;
  for (int p = 0, k = 0; p < N; p++)
    for (int64_t i = 0; i < recv_n[p]; i++) bad += b[k++] != (float)(p * 100000 + r * 10000 + i);
  CHECKF(bad == 0, "all-to-all: %zu elements wrong", bad);
  free(a), free(b);
}

static void test_mpi(void) {
  struct fy_comm *c = NULL;
  CHECK_OK(fy_comm_create("auto", 60, &c));
  if (!c) return;
  CHECK(fy_comm_kind(c) == FY_COMM_MPI);
  int N = fy_comm_size(c), r = fy_comm_rank(c);
  CHECK(N == env_long("OMPI_COMM_WORLD_SIZE"));
  CHECK(r == env_long("OMPI_COMM_WORLD_RANK"));
  CHECK(fy_comm_local_rank(c) == env_long("OMPI_COMM_WORLD_LOCAL_RANK"));
  CHECK(fy_comm_local_size(c) == env_long("OMPI_COMM_WORLD_LOCAL_SIZE"));
  CHECK(c->timeout_s == 60);
  CHECK_OK(fy_comm_barrier(c));
  for (int d = 0; d < 2; d++) {
    enum fy_reduce_dtype dt = d ? FY_COMM_BF16 : FY_COMM_F32;
    test_all_reduce(c, dt, 1000003);
    test_all_reduce(c, dt, 1);                 // fewer elements than ranks
    test_all_reduce(c, dt, (size_t)N + 1);
    test_reduce_scatter(c, dt, 333333, false);
    test_reduce_scatter(c, dt, 333333, true);
    test_reduce_scatter(c, dt, 1, false);
    test_all_gather(c, dt, 333331, false);
    test_all_gather(c, dt, 333331, true);
  }
  test_broadcast(c, 1000003, N - 1);
  test_broadcast(c, 1, 0);
  test_split(c);
  test_streams(c);
  test_p2p(c);
  test_all_to_all(c);
  CHECK_ERR(fy_comm_broadcast(c, &N, 4, -1, NULL), FY_ERR_INVALID);
  CHECK_OK(fy_comm_status(c));
  CHECK_OK(fy_comm_barrier(c));
  if (r == 0) fprintf(stderr, "mpi backend: %d ranks\n", N);
  fy_comm_free(c);
}

// ---- failure cases, each run as its own job by the runner ----

static int timeout_case(double t) {
  struct fy_comm *c = NULL;
  if (fy_comm_create("mpi", t, &c) != FY_OK) {
    fprintf(stderr, "test_comm: %s\n", fy_error_msg());
    return 1;
  }
  CHECK_OK(fy_comm_barrier(c));
  fy_comm_set_step(c, 7);
  const size_t n = (size_t)1 << 18;  // 1 MiB of f32
  float *x = calloc(n, 4);
  if (fy_comm_rank(c) == 1) {
    sleep(60);  // skips the all-reduce; the job is over before this returns
  } else {
    fy_status st = fy_comm_all_reduce(c, x, n, FY_COMM_F32, NULL);
    fprintf(stderr, "test_comm: the all-reduce returned %d (%s) instead of ending the job\n", (int)st, fy_error_msg());
  }
  return 1;
}

static int die_case(void) {
  struct fy_comm *c = NULL;
  if (fy_comm_create("mpi", 120, &c) != FY_OK) return 1;
  CHECK_OK(fy_comm_barrier(c));
  fy_comm_set_step(c, 5);
  const size_t n = (size_t)1 << 18;
  float *x = calloc(n, 4);
  if (fy_comm_rank(c) == 1) _exit(9);  // dies without a word to MPI
  fy_comm_all_reduce(c, x, n, FY_COMM_F32, NULL);
  fprintf(stderr, "test_comm: rank 0 got past the all-reduce with a dead peer\n");
  return 1;
}

int main(int argc, char **argv) {
  if (argc > 2 && strcmp(argv[1], "--timeout-case") == 0) return timeout_case(atof(argv[2]));
  if (argc > 1 && strcmp(argv[1], "--die-case") == 0) return die_case();
  test_single();
  if (env_long("OMPI_COMM_WORLD_SIZE") > 1 || env_long("PMI_SIZE") > 1) test_mpi();
  else {
    struct fy_comm *c = NULL;  // auto with no launcher: single
    CHECK_OK(fy_comm_create("auto", 0, &c));
    CHECK(c && fy_comm_kind(c) == FY_COMM_SINGLE);
    fy_comm_free(c);
  }
  return check_summary("test_comm");
}
