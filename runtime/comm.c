// fy_comm: the front end (argument checks, stream enqueue, sticky errors), the single backend and
// the mpi backend. See comm.h for the layouts, the numbers and the failure rules.
//
// mpi backend, how a sum stays deterministic: the reduction is ferry's, never MPI's. For an
// all-reduce of n elements, the buffer is cut into size nearly equal chunks (the first n % size one
// element longer); rank p owns chunk p. Reduce-scatter phase: every rank sends chunk p of its buffer
// to rank p (MPI_Isend / MPI_Irecv into a scratch buffer), and rank p adds the size contributions in
// rank order, in fp32, one element at a time ((x0 + x1) + x2 ...). All-gather phase: each owner
// sends its summed chunk to everybody. So each element is summed once, by one rank, in a fixed
// order, and every rank receives those bits. The data moved per rank is that of a ring all-reduce
// (2 (size-1)/size of the buffer). Long chunks go in segments so that the scratch stays below
// FY_COMM_SCRATCH_MAX and MPI's int counts never overflow.
//
// Waiting: every MPI transfer is non-blocking; the wait polls MPI_Testall, spinning (as MPI's own
// blocking calls do) for as long as the transfer should take (2 ms plus its bytes at 1 GB/s: a
// sleeping rank progresses its transfers late, and a late wake-up on a busy machine costs more than
// the transfer), and after that, when the peers are late, sleeping 100 us between polls,
// until the collective's timeout: then the message, MPI_Abort(MPI_COMM_WORLD, 3), the job ends.
// (This poll is the communicator's own wait on the network, as MPI_Wait's; it orders nothing in
// ferry: stream order and events do that, as docs/design.md asks.)
//
// Threads: collectives enqueued on a stream run on that stream's worker thread. MPI is initialised
// with MPI_THREAD_MULTIPLE when the library has it; with SERIALIZED every MPI call is made under one
// process-wide lock (taken per call, never across a wait, so that collectives on two communicators
// on two threads both progress). One collective at a time per communicator (its scratch and tags).
#include "runtime/comm.h"

#include <limits.h>
#include <mpi.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core/clock.h"
#include "core/dtype.h"
#include "fy_config.h"

#define FY_COMM_SCRATCH_MAX ((size_t)64 << 20)  // bytes of received contributions per segment
#define FY_COMM_SPIN_S 0.002                    // spin this long in a wait before sleeping,
#define FY_COMM_SPIN_BPS 1e9                    // plus the time its bytes take at 1 GB/s;
#define FY_COMM_POLL_NS 100000                  // then poll every 100 us

// ---------------------------------------------------------------------------------------------
// Common helpers

size_t fy_comm_dtype_size(enum fy_reduce_dtype dt) { return dt == FY_COMM_BF16 ? 2 : 4; }

const char *fy_collective_name(enum fy_collective op) {
  switch (op) {
    case FY_COMM_OP_ALL_REDUCE: return "all-reduce";
    case FY_COMM_OP_REDUCE_SCATTER: return "reduce-scatter";
    case FY_COMM_OP_ALL_GATHER: return "all-gather";
    case FY_COMM_OP_BROADCAST: return "broadcast";
    case FY_COMM_OP_BARRIER: return "barrier";
    case FY_COMM_OP_P2P: return "send/receive";
    case FY_COMM_OP_ALL_TO_ALL: return "all-to-all";
  }
  return "collective";
}

size_t fy_comm_call_bytes(const struct fy_comm *c, const struct fy_comm_call *call) {
  size_t es = fy_comm_dtype_size(call->dt);
  switch (call->op) {
    case FY_COMM_OP_ALL_REDUCE: return call->count * es;
    case FY_COMM_OP_REDUCE_SCATTER:
    case FY_COMM_OP_ALL_GATHER: return (size_t)c->size * call->count * es;
    case FY_COMM_OP_BROADCAST: return call->count;
    case FY_COMM_OP_BARRIER: return 0;
    case FY_COMM_OP_P2P:
    case FY_COMM_OP_ALL_TO_ALL: return call->count;
  }
  return 0;
}

const char *fy_comm_step_text(int64_t step, char *buf, size_t n) {
  if (step == INT64_MIN)
    snprintf(buf, n, "before the first step");
  else
    snprintf(buf, n, "at step %lld", (long long)step);
  return buf;
}

const char *fy_comm_size_text(size_t bytes, char *buf, size_t n) {
  static const char *unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = (double)bytes;
  int u = 0;
  while (v >= 1024 && u < 4) v /= 1024, u++;
  if (u == 0 || v == (double)(long long)v)
    snprintf(buf, n, "%.0f %s", v, unit[u]);
  else
    snprintf(buf, n, "%.1f %s", v, unit[u]);
  return buf;
}

fy_status fy_comm_fail(struct fy_comm *c, fy_status st) {
  pthread_mutex_lock(&c->err_mu);
  if (!atomic_load(&c->failed)) {
    c->err_st = st;
    snprintf(c->err_msg, sizeof c->err_msg, "%s", fy_error_msg());
    atomic_store(&c->failed, 1);
  }
  pthread_mutex_unlock(&c->err_mu);
  return st;
}

void fy_comm_init_base(struct fy_comm *c, enum fy_comm_kind kind, const struct fy_comm_ops *ops,
                       int rank, int size, int local_rank, double timeout_s) {
  c->kind = kind;
  c->ops = ops;
  c->rank = rank;
  c->size = size;
  c->local_rank = local_rank;
  c->local_size = 1;
  c->timeout_s = timeout_s;
  atomic_init(&c->step, INT64_MIN);
  atomic_init(&c->failed, 0);
  pthread_mutex_init(&c->err_mu, NULL);
  c->err_st = FY_OK;
  c->err_msg[0] = 0;
  c->impl = NULL;
}

static void comm_base_destroy(struct fy_comm *c) { pthread_mutex_destroy(&c->err_mu); }

enum fy_comm_kind fy_comm_kind(const struct fy_comm *c) { return c->kind; }
const char *fy_comm_kind_name(const struct fy_comm *c) {
  return c->kind == FY_COMM_SINGLE ? "single" : c->kind == FY_COMM_MPI ? "mpi" : "nccl";
}
int fy_comm_rank(const struct fy_comm *c) { return c->rank; }
int fy_comm_size(const struct fy_comm *c) { return c->size; }
int fy_comm_local_rank(const struct fy_comm *c) { return c->local_rank; }
int fy_comm_local_size(const struct fy_comm *c) { return c->local_size; }
void fy_comm_set_step(struct fy_comm *c, int64_t step) { atomic_store(&c->step, step); }

fy_status fy_comm_status(struct fy_comm *c) {
  if (!atomic_load(&c->failed)) return FY_OK;
  pthread_mutex_lock(&c->err_mu);
  fy_status st = fy_error_set(c->err_st, "%s", c->err_msg);
  pthread_mutex_unlock(&c->err_mu);
  return st;
}

// ---------------------------------------------------------------------------------------------
// Front end: checks, then run now or enqueue

struct comm_job {
  struct fy_comm *c;
  struct fy_comm_call call;
};

static void comm_job_run(void *arg) {
  struct comm_job *job = arg;
  struct fy_comm *c = job->c;
  if (!atomic_load(&c->failed)) {
    fy_status st = c->ops->run(c, &job->call, NULL);
    if (st != FY_OK) fy_comm_fail(c, st);
  }
  free(job);
}

static fy_status comm_submit(struct fy_comm *c, struct fy_comm_call *call, fy_stream *s) {
  if (atomic_load(&c->failed)) return fy_comm_status(c);
  call->step = atomic_load(&c->step);
  if (!s || c->ops->takes_stream) {
    fy_status st = c->ops->run(c, call, s);
    if (st != FY_OK) fy_comm_fail(c, st);
    return st;
  }
  struct comm_job *job = malloc(sizeof *job);
  if (!job) return fy_error_set(FY_ERR_NOMEM, "%s: cannot allocate a stream job", fy_collective_name(call->op));
  job->c = c;
  job->call = *call;
  fy_status st = fy_stream_enqueue(s, comm_job_run, job);
  if (st != FY_OK) free(job);
  return st;
}

static fy_status check_dt(const char *op, enum fy_reduce_dtype dt) {
  if (dt != FY_COMM_F32 && dt != FY_COMM_BF16)
    return fy_error_set(FY_ERR_INVALID, "%s: unknown element type %d (f32 or bf16)", op, (int)dt);
  return FY_OK;
}

static bool ranges_overlap(const void *a, size_t an, const void *b, size_t bn) {
  uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
  return x < y + bn && y < x + an;
}

fy_status fy_comm_all_reduce(struct fy_comm *c, void *buf, size_t count, enum fy_reduce_dtype dt,
                             fy_stream *s) {
  const char *op = "all-reduce";
  if (!c) return fy_error_set(FY_ERR_INVALID, "%s: no communicator", op);
  FY_TRY(check_dt(op, dt));
  if (count == 0) return FY_OK;
  if (!buf) return fy_error_set(FY_ERR_INVALID, "%s: NULL buffer", op);
  if (count > SIZE_MAX / 4) return fy_error_set(FY_ERR_INVALID, "%s: count %zu too large", op, count);
  struct fy_comm_call call = {.op = FY_COMM_OP_ALL_REDUCE, .buf = buf, .count = count, .dt = dt};
  return comm_submit(c, &call, s);
}

// Reduce-scatter and all-gather move between one rank's part (count elements) and the whole
// (size * count elements): the same checks, in place meaning part = whole + rank * count. *none:
// nothing to move (count 0).
static fy_status check_part_whole(const struct fy_comm *c, const char *op, const void *part, const char *part_name,
                                  const void *whole, const char *whole_name, size_t count, enum fy_reduce_dtype dt,
                                  bool *none) {
  *none = false;
  if (!c) return fy_error_set(FY_ERR_INVALID, "%s: no communicator", op);
  FY_TRY(check_dt(op, dt));
  if (count == 0) {
    *none = true;
    return FY_OK;
  }
  if (!part || !whole) return fy_error_set(FY_ERR_INVALID, "%s: NULL buffer", op);
  if (count > SIZE_MAX / 4 / (size_t)c->size) return fy_error_set(FY_ERR_INVALID, "%s: count %zu too large", op, count);
  size_t pbytes = count * fy_comm_dtype_size(dt), wbytes = pbytes * (size_t)c->size;
  if (ranges_overlap(part, pbytes, whole, wbytes) && (const char *)part != (const char *)whole + (size_t)c->rank * pbytes)
    return fy_error_set(FY_ERR_INVALID, "%s: %s overlaps %s (in place means %s = %s + rank*%s_count)", op, part_name,
                        whole_name, part_name, whole_name, part_name);
  return FY_OK;
}

fy_status fy_comm_reduce_scatter(struct fy_comm *c, const void *send, void *recv, size_t recv_count,
                                 enum fy_reduce_dtype dt, fy_stream *s) {
  bool none;
  FY_TRY(check_part_whole(c, "reduce-scatter", recv, "recv", send, "send", recv_count, dt, &none));
  if (none) return FY_OK;
  struct fy_comm_call call = {.op = FY_COMM_OP_REDUCE_SCATTER, .send = send, .buf = recv, .count = recv_count, .dt = dt};
  return comm_submit(c, &call, s);
}

fy_status fy_comm_all_gather(struct fy_comm *c, const void *send, void *recv, size_t send_count,
                             enum fy_reduce_dtype dt, fy_stream *s) {
  bool none;
  FY_TRY(check_part_whole(c, "all-gather", send, "send", recv, "recv", send_count, dt, &none));
  if (none) return FY_OK;
  struct fy_comm_call call = {.op = FY_COMM_OP_ALL_GATHER, .send = send, .buf = recv, .count = send_count, .dt = dt};
  return comm_submit(c, &call, s);
}

fy_status fy_comm_broadcast(struct fy_comm *c, void *buf, size_t bytes, int root, fy_stream *s) {
  const char *op = "broadcast";
  if (!c) return fy_error_set(FY_ERR_INVALID, "%s: no communicator", op);
  if (root < 0 || root >= c->size)
    return fy_error_set(FY_ERR_INVALID, "%s: root %d is not a rank (world of %d)", op, root, c->size);
  if (bytes == 0) return FY_OK;
  if (!buf) return fy_error_set(FY_ERR_INVALID, "%s: NULL buffer", op);
  struct fy_comm_call call = {.op = FY_COMM_OP_BROADCAST, .buf = buf, .count = bytes, .root = root};
  return comm_submit(c, &call, s);
}

fy_status fy_comm_barrier(struct fy_comm *c) {
  if (!c) return fy_error_set(FY_ERR_INVALID, "barrier: no communicator");
  struct fy_comm_call call = {.op = FY_COMM_OP_BARRIER};
  return comm_submit(c, &call, NULL);
}

fy_status fy_comm_group_p2p(struct fy_comm *c, const struct fy_comm_p2p *msgs, int n, fy_stream *s) {
  const char *op = "send/receive";
  if (!c) return fy_error_set(FY_ERR_INVALID, "%s: no communicator", op);
  if (c->kind != FY_COMM_NCCL)
    return fy_error_set(FY_ERR_UNSUPPORTED, "%s of device memory needs the nccl communicator, not %s (host buffers: "
                        "fy_comm_isend and fy_comm_recv)", op, fy_comm_kind_name(c));
  size_t total = 0;
  for (int k = 0; k < n; k++) {
    if (msgs[k].peer < 0 || msgs[k].peer >= c->size || msgs[k].peer == c->rank)
      return fy_error_set(FY_ERR_INVALID, "%s with rank %d: rank %d of a communicator of %d", op, msgs[k].peer, c->rank,
                          c->size);
    if (msgs[k].bytes && !msgs[k].buf) return fy_error_set(FY_ERR_INVALID, "%s: NULL buffer", op);
    total += msgs[k].bytes;
  }
  if (total == 0) return FY_OK;
  struct fy_comm_call call = {.op = FY_COMM_OP_P2P, .count = total, .root = msgs[0].peer, .msgs = msgs, .n_msgs = n};
  return comm_submit(c, &call, s);
}

fy_status fy_comm_split(struct fy_comm *c, int color, int key, struct fy_comm **out) {
  *out = NULL;
  if (!c) return fy_error_set(FY_ERR_INVALID, "split: no communicator");
  if (atomic_load(&c->failed)) return fy_comm_status(c);
  FY_TRY(c->ops->split(c, color, key, out));
  if (*out) atomic_store(&(*out)->step, atomic_load(&c->step));
  return FY_OK;
}

void fy_comm_free(struct fy_comm *c) {
  if (c) c->ops->destroy(c);
}

// ---------------------------------------------------------------------------------------------
// single: one rank; reductions are the identity, gathers and scatters are copies

static fy_status single_run(struct fy_comm *c, const struct fy_comm_call *call, fy_stream *s) {
  if (call->op != FY_COMM_OP_REDUCE_SCATTER && call->op != FY_COMM_OP_ALL_GATHER) return FY_OK;
  size_t n = call->count * fy_comm_dtype_size(call->dt);
  if (call->send == call->buf) return FY_OK;
  if (s) return fy_copy_async(s, call->buf, call->send, n);
  memmove(call->buf, call->send, n);
  return FY_OK;
}

static fy_status single_new(double timeout_s, struct fy_comm **out);

static fy_status single_split(struct fy_comm *c, int color, int key, struct fy_comm **out) {
  if (color < 0) return FY_OK;
  return single_new(c->timeout_s, out);
}

static void single_destroy(struct fy_comm *c) {
  comm_base_destroy(c);
  free(c);
}

static const struct fy_comm_ops single_ops = {
    .run = single_run, .split = single_split, .destroy = single_destroy, .takes_stream = 1};

static fy_status single_new(double timeout_s, struct fy_comm **out) {
  struct fy_comm *c = calloc(1, sizeof *c);
  if (!c) return fy_error_set(FY_ERR_NOMEM, "cannot allocate a communicator");
  fy_comm_init_base(c, FY_COMM_SINGLE, &single_ops, 0, 1, 0, timeout_s);
  *out = c;
  return FY_OK;
}

// ---------------------------------------------------------------------------------------------
// mpi

static pthread_mutex_t g_mpi_mu = PTHREAD_MUTEX_INITIALIZER;   // every MPI call, when SERIALIZED
static pthread_mutex_t g_life_mu = PTHREAD_MUTEX_INITIALIZER;  // init, finalize, g_live
static bool g_serialized, g_we_init;
static int g_live;  // mpi communicators alive

static inline void mpi_lock(void) {
  if (g_serialized) pthread_mutex_lock(&g_mpi_mu);
}
static inline void mpi_unlock(void) {
  if (g_serialized) pthread_mutex_unlock(&g_mpi_mu);
}

static fy_status mpi_error(int rc, const char *what) {
  char msg[MPI_MAX_ERROR_STRING];
  int n = 0;
  if (MPI_Error_string(rc, msg, &n) != MPI_SUCCESS) snprintf(msg, sizeof msg, "MPI error %d", rc);
  return fy_error_set(FY_ERR_IO, "%s failed: %s", what, msg);
}

struct mpi_impl {
  MPI_Comm comm;
  pthread_mutex_t op_mu;   // one collective at a time on this communicator
  unsigned seq;            // collectives issued (tags)
  char *scratch;
  size_t scratch_cap;
  MPI_Request *reqs;       // 2 (size-1)
  const void **srcs;       // size
  size_t *off, *len;       // size
};

void fy_comm_timed_out(struct fy_comm *c, const struct fy_comm_call *call, const char *then) {
  char sz[32], stp[48];
  fy_error_set(FY_ERR_IO, "%s of %s did not complete within %g s %s (a rank died or hangs)",
               fy_collective_name(call->op), fy_comm_size_text(fy_comm_call_bytes(c, call), sz, sizeof sz),
               c->timeout_s, fy_comm_step_text(call->step, stp, sizeof stp));
  fy_comm_fail(c, FY_ERR_IO);
  fprintf(stderr, "ferry: rank %d: %s; %s\n", c->rank, fy_error_msg(), then);
  fflush(stderr);
}

// Called when a collective ran out of time: the message, then the end of the job.
static void mpi_timeout(struct fy_comm *c, const struct fy_comm_call *call) {
  fy_comm_timed_out(c, call, "aborting the job");
  mpi_lock();
  MPI_Abort(MPI_COMM_WORLD, 3);
  _exit(3);  // not reached: MPI_Abort does not return
}

// Waits for n requests that move `bytes` (sent plus received by this rank); t0: the collective's start.
static fy_status mpi_wait(struct fy_comm *c, const struct fy_comm_call *call, MPI_Request *reqs, int n,
                          size_t bytes, double t0) {
  if (n == 0) return FY_OK;
  double spin_until = fy_now() + FY_COMM_SPIN_S + (double)bytes / FY_COMM_SPIN_BPS;
  for (;;) {
    int done = 0;
    mpi_lock();
    int rc = MPI_Testall(n, reqs, &done, MPI_STATUSES_IGNORE);
    mpi_unlock();
    if (rc != MPI_SUCCESS) return mpi_error(rc, "MPI_Testall");
    if (done) return FY_OK;
    double t = fy_now();
    if (t - t0 > c->timeout_s) mpi_timeout(c, call);
    if (t >= spin_until) {
      struct timespec ts = {0, FY_COMM_POLL_NS};
      nanosleep(&ts, NULL);
    }
  }
}

static fy_status mpi_scratch(struct mpi_impl *m, size_t bytes) {
  if (bytes <= m->scratch_cap) return FY_OK;
  char *p = NULL;
  if (posix_memalign((void **)&p, 64, bytes) != 0)
    return fy_error_set(FY_ERR_NOMEM, "cannot allocate %zu bytes of scratch", bytes);
  free(m->scratch);
  m->scratch = p;
  m->scratch_cap = bytes;
  return FY_OK;
}

#define SUM_BLK 2048

// out[i] = ((src[0][i] + src[1][i]) + src[2][i]) + ... in fp32; n >= 2. out may be one of the
// sources (exactly, not shifted): each block is read whole before it is written.
static void sum_f32(float *out, const void *const *src, int n, size_t len) {
  float acc[SUM_BLK];
  for (size_t b = 0; b < len; b += SUM_BLK) {
    size_t m = len - b < SUM_BLK ? len - b : SUM_BLK;
    const float *s0 = (const float *)src[0] + b, *s1 = (const float *)src[1] + b;
    for (size_t i = 0; i < m; i++) acc[i] = s0[i] + s1[i];
    for (int q = 2; q < n; q++) {
      const float *sq = (const float *)src[q] + b;
      for (size_t i = 0; i < m; i++) acc[i] += sq[i];
    }
    memcpy(out + b, acc, m * sizeof *acc);
  }
}

static void sum_bf16(uint16_t *out, const void *const *src, int n, size_t len) {
  float acc[SUM_BLK];
  for (size_t b = 0; b < len; b += SUM_BLK) {
    size_t m = len - b < SUM_BLK ? len - b : SUM_BLK;
    const uint16_t *s0 = (const uint16_t *)src[0] + b, *s1 = (const uint16_t *)src[1] + b;
    for (size_t i = 0; i < m; i++) acc[i] = fy_bf16_to_f32(s0[i]) + fy_bf16_to_f32(s1[i]);
    for (int q = 2; q < n; q++) {
      const uint16_t *sq = (const uint16_t *)src[q] + b;
      for (size_t i = 0; i < m; i++) acc[i] += fy_bf16_to_f32(sq[i]);
    }
    for (size_t i = 0; i < m; i++) out[b + i] = fy_f32_to_bf16(acc[i]);
  }
}

static size_t min_sz(size_t a, size_t b) { return a < b ? a : b; }

// Reduce-scatter phase: rank p's result is the rank-order sum of the chunks [off[p], off[p]+len[p])
// of every rank's `src`, written to `out` (len[rank] elements; may be src + off[rank]).
static fy_status mpi_reduce_phase(struct fy_comm *c, const struct fy_comm_call *call, const char *src,
                                  char *out, int tag, double t0) {
  struct mpi_impl *m = c->impl;
  int N = c->size, r = c->rank;
  size_t es = fy_comm_dtype_size(call->dt);
  MPI_Datatype type = call->dt == FY_COMM_BF16 ? MPI_UINT16_T : MPI_FLOAT;
  const char *own = src + m->off[r] * es;
  if (N == 1) {
    if (out != own) memmove(out, own, m->len[r] * es);
    return FY_OK;
  }
  size_t maxlen = 0;
  for (int p = 0; p < N; p++) maxlen = m->len[p] > maxlen ? m->len[p] : maxlen;
  size_t seg = FY_COMM_SCRATCH_MAX / (es * (size_t)(N - 1));
  seg = seg < 1 ? 1 : seg > INT_MAX ? INT_MAX : seg;
  size_t stride = min_sz(seg, maxlen);
  FY_TRY(mpi_scratch(m, stride * es * (size_t)(N - 1)));
  for (size_t o = 0; o < maxlen; o += seg) {
    size_t mine = o < m->len[r] ? min_sz(seg, m->len[r] - o) : 0;
    int nreq = 0, rc = MPI_SUCCESS;
    size_t moved = 0;
    mpi_lock();
    for (int p = 0; p < N && rc == MPI_SUCCESS; p++) {
      if (p == r || !mine) continue;
      moved += mine * es;
      int slot = p < r ? p : p - 1;
      rc = MPI_Irecv(m->scratch + (size_t)slot * stride * es, (int)mine, type, p, tag, m->comm, &m->reqs[nreq++]);
    }
    for (int p = 0; p < N && rc == MPI_SUCCESS; p++) {
      size_t np = o < m->len[p] ? min_sz(seg, m->len[p] - o) : 0;
      if (p == r || !np) continue;
      moved += np * es;
      rc = MPI_Isend(src + (m->off[p] + o) * es, (int)np, type, p, tag, m->comm, &m->reqs[nreq++]);
    }
    mpi_unlock();
    if (rc != MPI_SUCCESS) return mpi_error(rc, "MPI_Isend/MPI_Irecv");
    FY_TRY(mpi_wait(c, call, m->reqs, nreq, moved, t0));
    if (!mine) continue;
    for (int q = 0; q < N; q++) {
      int slot = q < r ? q : q - 1;
      m->srcs[q] = q == r ? own + o * es : m->scratch + (size_t)slot * stride * es;
    }
    if (call->dt == FY_COMM_BF16)
      sum_bf16((uint16_t *)(out + o * es), m->srcs, N, mine);
    else
      sum_f32((float *)(out + o * es), m->srcs, N, mine);
  }
  return FY_OK;
}

// All-gather phase: rank p's `own` (len[p] elements) lands at dst + off[p] on every rank.
static fy_status mpi_gather_phase(struct fy_comm *c, const struct fy_comm_call *call, const char *own,
                                  char *dst, int tag, double t0) {
  struct mpi_impl *m = c->impl;
  int N = c->size, r = c->rank;
  size_t es = fy_comm_dtype_size(call->dt);
  MPI_Datatype type = call->dt == FY_COMM_BF16 ? MPI_UINT16_T : MPI_FLOAT;
  char *mine_at = dst + m->off[r] * es;
  if (own != mine_at) memcpy(mine_at, own, m->len[r] * es);
  if (N == 1) return FY_OK;
  size_t maxlen = 0;
  for (int p = 0; p < N; p++) maxlen = m->len[p] > maxlen ? m->len[p] : maxlen;
  const size_t seg = (size_t)1 << 28;
  for (size_t o = 0; o < maxlen; o += seg) {
    size_t mine = o < m->len[r] ? min_sz(seg, m->len[r] - o) : 0;
    int nreq = 0, rc = MPI_SUCCESS;
    size_t moved = 0;
    mpi_lock();
    for (int p = 0; p < N && rc == MPI_SUCCESS; p++) {
      size_t np = o < m->len[p] ? min_sz(seg, m->len[p] - o) : 0;
      if (p == r || !np) continue;
      moved += np * es;
      rc = MPI_Irecv(dst + (m->off[p] + o) * es, (int)np, type, p, tag, m->comm, &m->reqs[nreq++]);
    }
    for (int p = 0; p < N && rc == MPI_SUCCESS; p++) {
      if (p == r || !mine) continue;
      moved += mine * es;
      rc = MPI_Isend(mine_at + o * es, (int)mine, type, p, tag, m->comm, &m->reqs[nreq++]);
    }
    mpi_unlock();
    if (rc != MPI_SUCCESS) return mpi_error(rc, "MPI_Isend/MPI_Irecv");
    FY_TRY(mpi_wait(c, call, m->reqs, nreq, moved, t0));
  }
  return FY_OK;
}

static void mpi_blocks(struct fy_comm *c, size_t block) {
  struct mpi_impl *m = c->impl;
  for (int p = 0; p < c->size; p++) m->off[p] = (size_t)p * block, m->len[p] = block;
}

static fy_status mpi_run_locked(struct fy_comm *c, const struct fy_comm_call *call, double t0) {
  struct mpi_impl *m = c->impl;
  int N = c->size;
  int tag = (int)(((m->seq++ & 0x7ffu) << 3) | (unsigned)call->op);
  switch (call->op) {
    case FY_COMM_OP_ALL_REDUCE: {
      size_t q = call->count / (size_t)N, extra = call->count % (size_t)N;
      for (int p = 0; p < N; p++) {
        m->len[p] = q + ((size_t)p < extra);
        m->off[p] = (size_t)p * q + min_sz((size_t)p, extra);
      }
      char *buf = call->buf;
      char *mine = buf + m->off[c->rank] * fy_comm_dtype_size(call->dt);
      FY_TRY(mpi_reduce_phase(c, call, buf, mine, tag, t0));
      return mpi_gather_phase(c, call, mine, buf, tag, t0);
    }
    case FY_COMM_OP_REDUCE_SCATTER:
      mpi_blocks(c, call->count);
      return mpi_reduce_phase(c, call, call->send, call->buf, tag, t0);
    case FY_COMM_OP_ALL_GATHER:
      mpi_blocks(c, call->count);
      return mpi_gather_phase(c, call, call->send, call->buf, tag, t0);
    case FY_COMM_OP_BROADCAST: {
      const size_t seg = (size_t)1 << 30;
      for (size_t o = 0; o < call->count; o += seg) {
        MPI_Request req;
        mpi_lock();
        int rc = MPI_Ibcast((char *)call->buf + o, (int)min_sz(seg, call->count - o), MPI_BYTE, call->root,
                            m->comm, &req);
        mpi_unlock();
        if (rc != MPI_SUCCESS) return mpi_error(rc, "MPI_Ibcast");
        FY_TRY(mpi_wait(c, call, &req, 1, min_sz(seg, call->count - o), t0));
      }
      return FY_OK;
    }
    case FY_COMM_OP_BARRIER: {
      MPI_Request req;
      mpi_lock();
      int rc = MPI_Ibarrier(m->comm, &req);
      mpi_unlock();
      if (rc != MPI_SUCCESS) return mpi_error(rc, "MPI_Ibarrier");
      return mpi_wait(c, call, &req, 1, 0, t0);
    }
    case FY_COMM_OP_P2P:  // (fy_comm_group_p2p refuses it first: device memory, nccl alone)
      return fy_error_set(FY_ERR_UNSUPPORTED, "grouped send/receive on the mpi communicator (fy_comm_isend, "
                          "fy_comm_recv)");
    case FY_COMM_OP_ALL_TO_ALL: break;  // (fy_comm_all_to_all_v runs it)
  }
  return fy_error_set(FY_ERR_INTERNAL, "unknown collective %d", (int)call->op);
}

static fy_status mpi_run(struct fy_comm *c, const struct fy_comm_call *call, fy_stream *s) {
  (void)s;
  struct mpi_impl *m = c->impl;
  pthread_mutex_lock(&m->op_mu);
  fy_status st = mpi_run_locked(c, call, fy_now());
  pthread_mutex_unlock(&m->op_mu);
  if (st != FY_OK) {
    char sz[32], stp[48];
    fy_error_wrap(st, "%s of %s %s", fy_collective_name(call->op),
                  fy_comm_size_text(fy_comm_call_bytes(c, call), sz, sizeof sz),
                  fy_comm_step_text(call->step, stp, sizeof stp));
  }
  return st;
}

// ---- point-to-point (comm.h): pipeline stages' activations and their gradients ----

struct fy_comm_req {
  MPI_Request req;
  size_t bytes;
  int peer;
  bool send;
  double t0;
};

// Waits for one message as mpi_wait does for a collective's; past the timeout, the message and
// the end of the job (the peer stage died or hangs).
static fy_status p2p_wait(struct fy_comm *c, struct fy_comm_req *q) {
  double spin_until = fy_now() + FY_COMM_SPIN_S + (double)q->bytes / FY_COMM_SPIN_BPS;
  for (;;) {
    int done = 0;
    mpi_lock();
    int rc = MPI_Test(&q->req, &done, MPI_STATUS_IGNORE);
    mpi_unlock();
    if (rc != MPI_SUCCESS) return fy_comm_fail(c, mpi_error(rc, "MPI_Test"));
    if (done) return FY_OK;
    double t = fy_now();
    if (t - q->t0 > c->timeout_s) {
      char sz[32], stp[48];
      fy_error_set(FY_ERR_IO, "%s of %s %s rank %d did not complete within %g s %s (a rank died or hangs)",
                   q->send ? "send" : "receive", fy_comm_size_text(q->bytes, sz, sizeof sz), q->send ? "to" : "from",
                   q->peer, c->timeout_s, fy_comm_step_text(atomic_load(&c->step), stp, sizeof stp));
      fy_comm_fail(c, FY_ERR_IO);
      fprintf(stderr, "ferry: rank %d: %s; aborting the job\n", c->rank, fy_error_msg());
      fflush(stderr);
      mpi_lock();
      MPI_Abort(MPI_COMM_WORLD, 3);
      _exit(3);
    }
    if (t >= spin_until) {
      struct timespec ts = {0, FY_COMM_POLL_NS};
      nanosleep(&ts, NULL);
    }
  }
}

static fy_status p2p_start(struct fy_comm *c, void *buf, size_t bytes, int peer, int tag, bool send,
                           struct fy_comm_req *q) {
  if (c->kind != FY_COMM_MPI)
    return fy_error_set(FY_ERR_UNSUPPORTED, "point-to-point messages need the mpi communicator, not %s",
                        fy_comm_kind_name(c));
  if (atomic_load(&c->failed)) return fy_comm_status(c);
  if (peer < 0 || peer >= c->size || peer == c->rank || bytes % 4 != 0 || bytes / 4 > INT_MAX || tag < 0)
    return fy_error_set(FY_ERR_INVALID, "%s of %zu bytes with rank %d (tag %d) on a communicator of %d ranks",
                        send ? "send" : "receive", bytes, peer, tag, c->size);
  struct mpi_impl *m = c->impl;
  *q = (struct fy_comm_req){.bytes = bytes, .peer = peer, .send = send, .t0 = fy_now()};
  mpi_lock();
  int rc = send ? MPI_Isend(buf, (int)(bytes / 4), MPI_FLOAT, peer, tag, m->comm, &q->req)
                : MPI_Irecv(buf, (int)(bytes / 4), MPI_FLOAT, peer, tag, m->comm, &q->req);
  mpi_unlock();
  return rc == MPI_SUCCESS ? FY_OK : fy_comm_fail(c, mpi_error(rc, send ? "MPI_Isend" : "MPI_Irecv"));
}

fy_status fy_comm_isend(struct fy_comm *c, const void *buf, size_t bytes, int peer, int tag, struct fy_comm_req **out) {
  *out = NULL;
  struct fy_comm_req *q = malloc(sizeof *q);
  if (!q) return fy_error_set(FY_ERR_NOMEM, "cannot allocate a send request");
  fy_status st = p2p_start(c, (void *)buf, bytes, peer, tag, true, q);
  if (st != FY_OK) {
    free(q);
    return st;
  }
  *out = q;
  return FY_OK;
}

fy_status fy_comm_recv(struct fy_comm *c, void *buf, size_t bytes, int peer, int tag) {
  struct fy_comm_req q;
  FY_TRY(p2p_start(c, buf, bytes, peer, tag, false, &q));
  return p2p_wait(c, &q);
}

fy_status fy_comm_wait(struct fy_comm *c, struct fy_comm_req *req) {
  if (!req) return FY_OK;
  fy_status st = p2p_wait(c, req);
  free(req);
  return st;
}

// ---- all-to-all (comm.h): expert parallelism's tokens to their experts' ranks and back ----

// One MPI_Ialltoallv of `type` elements (counts and displacements in elements, ints for MPI) and its wait.
static fy_status a2a_run(struct fy_comm *c, const void *send, const int64_t *sc, void *recv, const int64_t *rc_,
                         MPI_Datatype type, size_t esize) {
  const int N = c->size;
  int scnt[N], sdis[N], rcnt[N], rdis[N];
  int64_t so = 0, ro = 0;
  for (int p = 0; p < N; p++) {
    if (sc[p] < 0 || rc_[p] < 0 || so + sc[p] > INT_MAX || ro + rc_[p] > INT_MAX)
      return fy_error_set(FY_ERR_INVALID, "all-to-all: counts %lld to and %lld from rank %d (at most 2^31 elements "
                          "in all)", (long long)sc[p], (long long)rc_[p], p);
    scnt[p] = (int)sc[p], sdis[p] = (int)so, rcnt[p] = (int)rc_[p], rdis[p] = (int)ro;
    so += sc[p], ro += rc_[p];
  }
  struct mpi_impl *m = c->impl;
  pthread_mutex_lock(&m->op_mu);
  double t0 = fy_now();
  MPI_Request req;
  mpi_lock();
  int rc = MPI_Ialltoallv(send, scnt, sdis, type, recv, rcnt, rdis, type, m->comm, &req);
  mpi_unlock();
  // (waited for as a collective: past the timeout, the message and the end of the job)
  const struct fy_comm_call call = {.op = FY_COMM_OP_ALL_TO_ALL, .count = (size_t)(so + ro) * esize,
                                    .step = atomic_load(&c->step)};
  fy_status st = rc == MPI_SUCCESS ? mpi_wait(c, &call, &req, 1, call.count, t0) : mpi_error(rc, "MPI_Ialltoallv");
  if (st != FY_OK) fy_comm_fail(c, st);
  pthread_mutex_unlock(&m->op_mu);
  return st;
}

static fy_status a2a_check(struct fy_comm *c) {
  if (!c) return fy_error_set(FY_ERR_INVALID, "all-to-all: no communicator");
  if (c->kind != FY_COMM_MPI && c->kind != FY_COMM_SINGLE)
    return fy_error_set(FY_ERR_UNSUPPORTED, "all-to-all needs the mpi or single communicator, not %s",
                        fy_comm_kind_name(c));
  if (atomic_load(&c->failed)) return fy_comm_status(c);
  return FY_OK;
}

fy_status fy_comm_all_to_all_v(struct fy_comm *c, const float *send, const int64_t *send_counts, float *recv,
                               const int64_t *recv_counts) {
  FY_TRY(a2a_check(c));
  if (c->kind == FY_COMM_SINGLE) {
    if (send_counts[0] != recv_counts[0])
      return fy_error_set(FY_ERR_INVALID, "all-to-all on one rank: %lld floats sent, %lld received",
                          (long long)send_counts[0], (long long)recv_counts[0]);
    if (send_counts[0] > 0 && send != recv) memmove(recv, send, (size_t)send_counts[0] * 4);
    return FY_OK;
  }
  return a2a_run(c, send, send_counts, recv, recv_counts, MPI_FLOAT, 4);
}

fy_status fy_comm_all_to_all(struct fy_comm *c, const int64_t *send, int64_t *recv, size_t count) {
  FY_TRY(a2a_check(c));
  if (count == 0) return FY_OK;
  if (c->kind == FY_COMM_SINGLE) {
    if (send != recv) memmove(recv, send, count * sizeof *send);
    return FY_OK;
  }
  int64_t n[c->size];
  for (int p = 0; p < c->size; p++) n[p] = (int64_t)count;
  return a2a_run(c, send, n, recv, n, MPI_INT64_T, 8);
}

// Finalises MPI when ferry initialised it and no communicator is left. Holds g_life_mu.
static void mpi_release_locked(void) {
  if (g_live == 0 && g_we_init) {
    int fin = 0;
    MPI_Finalized(&fin);
    if (!fin) MPI_Finalize();
    g_we_init = false;
  }
}

static void mpi_destroy(struct fy_comm *c) {
  struct mpi_impl *m = c->impl;
  if (m) {
    if (m->comm != MPI_COMM_NULL) {
      mpi_lock();
      MPI_Comm_free(&m->comm);
      mpi_unlock();
    }
    pthread_mutex_destroy(&m->op_mu);
    free(m->scratch);
    free(m->reqs);
    free(m->srcs);
    free(m->off);
    free(m->len);
    free(m);
  }
  comm_base_destroy(c);
  free(c);
  pthread_mutex_lock(&g_life_mu);
  g_live--;
  mpi_release_locked();
  pthread_mutex_unlock(&g_life_mu);
}

static fy_status mpi_split(struct fy_comm *c, int color, int key, struct fy_comm **out);

static const struct fy_comm_ops mpi_ops = {
    .run = mpi_run, .split = mpi_split, .destroy = mpi_destroy, .takes_stream = 0};

// Wraps an MPI communicator (owned from here on, freed on failure too).
static fy_status mpi_wrap(MPI_Comm comm, int local_rank, int local_size, double timeout_s, struct fy_comm **out) {
  int rank = 0, size = 1, rc;
  mpi_lock();
  rc = MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_rank(comm, &rank);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_size(comm, &size);
  mpi_unlock();
  struct fy_comm *c = calloc(1, sizeof *c);
  struct mpi_impl *m = calloc(1, sizeof *m);
  if (rc == MPI_SUCCESS && c && m) {
    m->reqs = calloc(2 * (size_t)size, sizeof *m->reqs);
    m->srcs = calloc((size_t)size, sizeof *m->srcs);
    m->off = calloc((size_t)size, sizeof *m->off);
    m->len = calloc((size_t)size, sizeof *m->len);
  }
  if (rc != MPI_SUCCESS || !c || !m || !m->reqs || !m->srcs || !m->off || !m->len) {
    fy_status st = rc != MPI_SUCCESS ? mpi_error(rc, "MPI_Comm_set_errhandler")
                                     : fy_error_set(FY_ERR_NOMEM, "cannot allocate a communicator");
    if (m) free(m->reqs), free(m->srcs), free(m->off), free(m->len);
    free(m);
    free(c);
    mpi_lock();
    MPI_Comm_free(&comm);
    mpi_unlock();
    return st;
  }
  m->comm = comm;
  pthread_mutex_init(&m->op_mu, NULL);
  fy_comm_init_base(c, FY_COMM_MPI, &mpi_ops, rank, size, local_rank, timeout_s);
  c->local_size = local_size;
  c->impl = m;
  pthread_mutex_lock(&g_life_mu);
  g_live++;
  pthread_mutex_unlock(&g_life_mu);
  *out = c;
  return FY_OK;
}

static fy_status mpi_split(struct fy_comm *c, int color, int key, struct fy_comm **out) {
  struct mpi_impl *m = c->impl;
  MPI_Comm nc = MPI_COMM_NULL;
  pthread_mutex_lock(&m->op_mu);
  mpi_lock();
  int rc = MPI_Comm_split(m->comm, color < 0 ? MPI_UNDEFINED : color, key, &nc);
  mpi_unlock();
  pthread_mutex_unlock(&m->op_mu);
  if (rc != MPI_SUCCESS) return mpi_error(rc, "split: MPI_Comm_split");
  if (nc == MPI_COMM_NULL) return FY_OK;
  return mpi_wrap(nc, c->local_rank, c->local_size, c->timeout_s, out);
}

static long env_long(const char *name) {
  const char *v = getenv(name);
  return v && *v ? strtol(v, NULL, 10) : 0;
}

// Ranks the launcher started: mpirun (Open MPI, MPICH's hydra), srun. 0 when none says.
static long launcher_size(const char **who) {
  static const char *vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS"};
  for (size_t i = 0; i < sizeof vars / sizeof *vars; i++) {
    long n = env_long(vars[i]);
    if (n > 0) {
      if (who) *who = vars[i];
      return n;
    }
  }
  return 0;
}

int fy_comm_launch_size(void) {
  long n = launcher_size(NULL);
  return n > 1 ? (int)n : 1;
}

int fy_comm_launch_rank(void) {
  static const char *vars[] = {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"};
  if (fy_comm_launch_size() == 1) return 0;
  for (size_t i = 0; i < sizeof vars / sizeof *vars; i++) {  // the first the launcher set
    const char *v = getenv(vars[i]);
    if (v && *v) return (int)env_long(vars[i]);
  }
  return 0;
}

static const char *thread_level_name(int l) {
  return l == MPI_THREAD_SINGLE ? "MPI_THREAD_SINGLE" : l == MPI_THREAD_FUNNELED ? "MPI_THREAD_FUNNELED"
       : l == MPI_THREAD_SERIALIZED ? "MPI_THREAD_SERIALIZED" : "MPI_THREAD_MULTIPLE";
}

static fy_status mpi_init_locked(void) {
  int inited = 0, fin = 0, provided = MPI_THREAD_SINGLE;
  MPI_Finalized(&fin);
  if (fin)
    return fy_error_set(FY_ERR_INVALID, "MPI was finalised (the last communicator was freed); it cannot start again");
  MPI_Initialized(&inited);
  if (!inited) {
    // FY_COMM_MPI_THREAD=serialized asks for SERIALIZED (tests the one-lock path).
    const char *want = getenv("FY_COMM_MPI_THREAD");
    int level = want && strcmp(want, "serialized") == 0 ? MPI_THREAD_SERIALIZED : MPI_THREAD_MULTIPLE;
    int rc = MPI_Init_thread(NULL, NULL, level, &provided);
    if (rc != MPI_SUCCESS) return fy_error_set(FY_ERR_IO, "MPI_Init_thread failed (error %d)", rc);
    g_we_init = true;
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  } else {
    MPI_Query_thread(&provided);
  }
  if (provided < MPI_THREAD_SERIALIZED)
    return fy_error_set(FY_ERR_UNSUPPORTED,
                        "MPI runs at %s; ferry calls MPI from stream threads and needs MPI_THREAD_SERIALIZED "
                        "or MPI_THREAD_MULTIPLE", thread_level_name(provided));
  g_serialized = provided < MPI_THREAD_MULTIPLE;
  return FY_OK;
}

static fy_status mpi_create(double timeout_s, struct fy_comm **out) {
  pthread_mutex_lock(&g_life_mu);
  fy_status st = mpi_init_locked();
  MPI_Comm dup = MPI_COMM_NULL, node = MPI_COMM_NULL;
  int size = 0, local = 0, local_size = 1, rc = MPI_SUCCESS;
  if (st == FY_OK) {
    mpi_lock();
    rc = MPI_Comm_dup(MPI_COMM_WORLD, &dup);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_size(dup, &size);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_split_type(dup, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_rank(node, &local);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_size(node, &local_size);
    if (node != MPI_COMM_NULL) MPI_Comm_free(&node);
    mpi_unlock();
    if (rc != MPI_SUCCESS) st = mpi_error(rc, "creating the MPI communicator");
  }
  const char *who = NULL;
  long want = launcher_size(&who);
  if (st == FY_OK && want > 1 && size != want)
    st = fy_error_set(FY_ERR_INVALID,
                      "the launcher started %ld ranks (%s) but MPI sees %d: under srun, pass --mpi=pmix "
                      "(or pmi2) so that MPI finds its peers", want, who, size);
  if (st != FY_OK) {
    if (dup != MPI_COMM_NULL) {
      mpi_lock();
      MPI_Comm_free(&dup);
      mpi_unlock();
    }
    mpi_release_locked();
    pthread_mutex_unlock(&g_life_mu);
    return st;
  }
  pthread_mutex_unlock(&g_life_mu);
  return mpi_wrap(dup, local, local_size, timeout_s, out);
}

// ---------------------------------------------------------------------------------------------

fy_status fy_comm_create(const char *kind, double timeout_s, struct fy_comm **out) {
  *out = NULL;
  if (!(timeout_s > 0)) timeout_s = FY_COMM_DEFAULT_TIMEOUT_S;
  if (!kind || strcmp(kind, "auto") == 0) kind = launcher_size(NULL) > 1 ? "mpi" : "single";
  if (strcmp(kind, "single") == 0) return single_new(timeout_s, out);
  if (strcmp(kind, "mpi") == 0) return mpi_create(timeout_s, out);
  if (strcmp(kind, "nccl") == 0) {
#if defined(FY_HAVE_NCCL) && FY_HAVE_NCCL
    struct fy_comm *boot = NULL;
    FY_TRY(mpi_create(timeout_s, &boot));
    return fy_comm_nccl_create(boot, out);
#else
    return fy_error_set(FY_ERR_UNSUPPORTED, "communicator 'nccl': this ferry was built without NCCL");
#endif
  }
  return fy_error_set(FY_ERR_INVALID, "unknown communicator '%s' (single, mpi, nccl or auto)", kind);
}
