// fy_comm's nccl backend (comm.h): collectives on device memory, enqueued on cuda streams, by NCCL.
//
// Setup: the mpi communicator handed to fy_comm_nccl_create (the bootstrap; owned from then on and
// freed with this communicator, also on failure) carries what NCCL cannot carry itself: rank 0's
// ncclUniqueId goes to every rank with fy_comm_broadcast, and one all-reduce of "did my local setup
// work" comes before ncclCommInitRank, so that a rank without a GPU makes every rank fail at once
// instead of leaving the others inside NCCL's init. Each rank uses GPU fy_comm_local_rank (or the
// only GPU it sees, when the launcher gives every rank its own CUDA_VISIBLE_DEVICES). A split is made
// the same way: MPI_Comm_split forms the group (every rank of the parent takes part), and the group's
// NCCL communicator is set up over that mpi child, on the parent's GPU, as the world's was. (Not
// ncclCommSplit: with NCCL 2.2x under CUDA 13 it gave a one-rank group no communicator, seen on an
// H200.) The mpi child is the nccl child's own, so MPI outlives every nccl communicator.
//
// Numbers: the sums are NCCL's, not ferry's. NCCL reduces in the order of the ring or tree it picked
// for the topology and the size, not in rank order as comm.h promises for the mpi backend: every
// rank gets the same bits, and a rerun with the same topology, world size and count gets them
// again, but they need not be the rank-order sum's bits (they are for two ranks, where a + b = b + a),
// and another machine may give others. bf16 is summed by NCCL's bf16 arithmetic.
//
// Streams: given a stream (of the cuda device the communicator runs on), a collective is enqueued on
// its cudaStream_t and run() returns once NCCL has accepted it; without one it runs on the default
// stream, and run() waits for it (cudaStreamSynchronize). fy_comm_barrier is an all-reduce of one
// float of device memory on the default stream.
//
// Waiting and failure. The communicator is non-blocking (ncclConfig_t.blocking = 0), so that no NCCL
// call can hang the caller: a call that answers ncclInProgress is polled (ncclCommGetAsyncError)
// until it settles, at most timeout_s. A collective's completion on the GPU is watched by a watchdog
// thread, one per communicator: each collective is bracketed by two events on its stream; the
// watchdog's clock for it starts when the first is reached (so the work queued before it on the
// stream does not count) and it polls the second, oldest collective first (NCCL runs a
// communicator's collectives in the order they were issued), every FY_NCCL_WATCH_NS while any is in
// flight, sleeping on a condition variable otherwise. It also polls ncclCommGetAsyncError.
// - Timeout (a collective not done within timeout_s of its start, or a launch still in progress
//   then): the message of the mpi backend ("all-reduce of 64 MiB did not complete within T s at
//   step S (a rank died or hangs)"), recorded (fy_comm_fail) and printed, then
//   MPI_Abort(MPI_COMM_WORLD, 3): the launcher ends the job, as comm.h's "Failure" says. Not
//   ncclCommAbort first: it makes NCCL's kernels give up, the stream moves on, and a thread
//   waiting on the stream (the trainer in fy_stream_sync) would go on with a collective that never
//   happened (a checkpoint of unreduced gradients) until MPI_Abort lands. Without MPI, or should
//   MPI_Abort come back, ncclCommAbort and _exit. Every rank runs its own watchdog, so every rank
//   stuck in that collective gets there (the first one to do so ends the job).
// - An asynchronous NCCL error or a CUDA error while a collective is in flight: ncclCommAbort, and
//   the error, naming the collective and its step, recorded on the communicator before the abort
//   releases the stream: fy_comm_status and every later collective report it (the offload engine
//   looks before a step's update, so that no update uses gradients that were never summed).
// (These polls are the communicator's own wait on the network with a deadline, as mpi's is; CUDA
// has no wait with a timeout. They order nothing in ferry: stream order and events do that.)
// Creation and split poll their NCCL calls with the same deadline, and fail (they do not end the
// job) when it passes.
//
// Point-to-point (fy_comm_group_p2p, pipeline stages): the messages of one call go as ncclSend and
// ncclRecv inside one ncclGroupStart/End, on the stream, watched as one collective (bracketed by
// its two events; a timeout names "send/receive of N MiB").
//
// Threads: collectives may be issued from any thread; every NCCL call on a communicator, and the
// watchdog's polls, are made under its mutex, and an abort first takes the communicator away under
// it, so that an abort by the watchdog never races a launch.
#include "runtime/comm.h"

#include <mpi.h>
#include <nccl.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "core/clock.h"
#include "core/device_cuda.h"

#define FY_NCCL_SPIN_S 0.002           // a call in progress: spin this long, then
#define FY_NCCL_POLL_NS 100000         // poll every 100 us
#define FY_NCCL_WATCH_NS 5000000       // the watchdog polls every 5 ms while collectives are in flight
#define FY_NCCL_ABORT_GRACE_S 60       // ncclCommAbort on a timeout gets this long before SIGALRM

// A collective in flight, as the watchdog sees it.
struct nccl_pending {
  struct nccl_pending *next;
  cudaEvent_t start, end;   // recorded on the collective's stream just before and just after it
  struct fy_comm_call call; // for messages
  bool started;             // `start` was reached, at t0
  double t0;
};

struct nccl_impl {
  struct fy_comm *boot;     // the mpi communicator over the same ranks (owned)
  int device;               // -1 until chosen
  ncclComm_t comm;          // NULL once aborted
  float *one;               // one float of device memory for the barrier
  pthread_mutex_t mu;       // comm and every NCCL call on it, the pending lists, stop
  pthread_cond_t cv;        // wakes the watchdog: a collective was added, or stop
  pthread_t watchdog;
  bool watching, stop;
  struct nccl_pending *head, *tail;  // in flight, oldest first
  struct nccl_pending *spare;        // done, events kept for reuse
};

static fy_status nccl_error(ncclComm_t comm, ncclResult_t r, const char *what) {
  const char *last = ncclGetLastError(comm);
  if (last && *last)
    return fy_error_set(FY_ERR_IO, "%s failed: NCCL: %s (%s)", what, ncclGetErrorString(r), last);
  return fy_error_set(FY_ERR_IO, "%s failed: NCCL: %s", what, ncclGetErrorString(r));
}

// The runtime's per-thread "last error" is cleared, so that a later, unrelated check does not see it.
static fy_status cuda_check(cudaError_t e, const char *what) {
  if (e == cudaSuccess) return FY_OK;
  (void)cudaGetLastError();
  return fy_error_set(FY_ERR_INTERNAL, "%s failed: cuda: %s", what, cudaGetErrorString(e));
}

static const char *nccl_fn_name(enum fy_collective op) {
  switch (op) {
    case FY_COMM_OP_ALL_REDUCE: return "ncclAllReduce";
    case FY_COMM_OP_REDUCE_SCATTER: return "ncclReduceScatter";
    case FY_COMM_OP_ALL_GATHER: return "ncclAllGather";
    case FY_COMM_OP_BROADCAST: return "ncclBroadcast";
    case FY_COMM_OP_BARRIER: return "ncclAllReduce (barrier)";
    case FY_COMM_OP_P2P: return "ncclSend/ncclRecv";
    case FY_COMM_OP_ALL_TO_ALL: break;
  }
  return "nccl";
}

// Prefixes the current message with the call ("all-reduce of 4 MiB at step 3: ...").
static fy_status wrap_call(struct fy_comm *c, const struct fy_comm_call *call, fy_status st) {
  char sz[32], stp[48];
  return fy_error_wrap(st, "%s of %s %s", fy_collective_name(call->op),
                       fy_comm_size_text(fy_comm_call_bytes(c, call), sz, sizeof sz),
                       fy_comm_step_text(call->step, stp, sizeof stp));
}

// Takes the NCCL communicator away (later launches fail at once) and aborts it: NCCL's kernels give
// up, its resources go. Holds m->mu, released meanwhile: the abort waits for NCCL's internal streams,
// which may wait for work on a user stream that a thread blocked on m->mu was about to release.
static void nccl_drop_locked(struct nccl_impl *m) {
  ncclComm_t comm = m->comm;
  if (!comm) return;
  m->comm = NULL;
  pthread_mutex_unlock(&m->mu);
  (void)ncclCommAbort(comm);
  pthread_mutex_lock(&m->mu);
}

// Moves every collective in flight to the spare list (after a failure nobody waits for them).
static void nccl_forget_locked(struct nccl_impl *m) {
  while (m->head) {
    struct nccl_pending *p = m->head;
    m->head = p->next;
    p->next = m->spare;
    m->spare = p;
  }
  m->tail = NULL;
}

// A collective ran out of time: the message, the abort, the end of the job. Holds m->mu (or runs
// before the watchdog exists).
static void nccl_end_job(struct fy_comm *c, const struct fy_comm_call *call) {
  fy_comm_timed_out(c, call, "aborting the job");
  // Should the exit hang (MPI_Abort's, or the CUDA runtime's teardown behind a kernel that never
  // ends), SIGALRM still ends this process, and the launcher the job.
  alarm(FY_NCCL_ABORT_GRACE_S);
  // Not under comm.c's lock for MPI_THREAD_SERIALIZED (private to it): this is the last MPI call
  // the process makes, and it only has to reach the launcher.
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (init && !fin) MPI_Abort(MPI_COMM_WORLD, 3);
  nccl_drop_locked(c->impl);  // without MPI: NCCL's own resources go before the process does
  _exit(3);
}

// Waits until an NCCL call that answered r settles. `comm` is the communicator whose state tells
// (the new one for init and split); t0: when the call was made. Past timeout_s, a collective (call
// not NULL) ends the job; creation and split fail with `what` in the message.
static fy_status nccl_settle(struct fy_comm *c, ncclComm_t comm, ncclResult_t r, const struct fy_comm_call *call,
                             const char *what, double t0) {
  while (r == ncclInProgress) {
    double t = fy_now();
    if (t - t0 > c->timeout_s) {
      if (call) nccl_end_job(c, call);
      return fy_error_set(FY_ERR_IO, "%s did not complete within %g s (a rank died or hangs)", what, c->timeout_s);
    }
    if (t - t0 >= FY_NCCL_SPIN_S) {
      struct timespec ts = {0, FY_NCCL_POLL_NS};
      nanosleep(&ts, NULL);
    }
    ncclResult_t state = ncclSuccess, q = ncclCommGetAsyncError(comm, &state);
    r = q != ncclSuccess ? q : state;
  }
  return r == ncclSuccess ? FY_OK : nccl_error(comm, r, what);
}

// ---------------------------------------------------------------------------------------------
// The watchdog

// Records the error in the calling thread's message against `call`, aborts the communicator and
// drops what was in flight. Holds m->mu.
static void nccl_fail_locked(struct fy_comm *c, const struct fy_comm_call *call, fy_status st) {
  struct nccl_impl *m = c->impl;
  fy_comm_fail(c, wrap_call(c, call, st));
  nccl_forget_locked(m);
  nccl_drop_locked(m);
}

// One look at the collectives in flight: pops the finished ones, fails the communicator on an error
// and ends the job on a timeout. Holds m->mu.
static void nccl_watch_locked(struct fy_comm *c) {
  struct nccl_impl *m = c->impl;
  if (!m->head) return;
  if (!m->comm) {  // aborted after a failure, already recorded
    nccl_forget_locked(m);
    return;
  }
  ncclResult_t state = ncclSuccess, q = ncclCommGetAsyncError(m->comm, &state);
  if (q != ncclSuccess) state = q;
  if (state != ncclSuccess && state != ncclInProgress) {
    nccl_error(m->comm, state, nccl_fn_name(m->head->call.op));
    nccl_fail_locked(c, &m->head->call, FY_ERR_IO);
    return;
  }
  while (m->head) {
    struct nccl_pending *p = m->head;
    cudaError_t e;
    if (!p->started) {
      e = cudaEventQuery(p->start);
      if (e == cudaErrorNotReady) return;  // the stream has not got there yet: no clock runs
      if (e != cudaSuccess) {
        nccl_fail_locked(c, &p->call, cuda_check(e, "cudaEventQuery"));
        return;
      }
      p->started = true;
      p->t0 = fy_now();
    }
    e = cudaEventQuery(p->end);
    if (e == cudaErrorNotReady) {
      if (fy_now() - p->t0 > c->timeout_s) nccl_end_job(c, &p->call);
      return;
    }
    if (e != cudaSuccess) {
      nccl_fail_locked(c, &p->call, cuda_check(e, "cudaEventQuery"));
      return;
    }
    m->head = p->next;
    if (!m->head) m->tail = NULL;
    p->next = m->spare;
    m->spare = p;
  }
}

static void *nccl_watchdog(void *arg) {
  struct fy_comm *c = arg;
  struct nccl_impl *m = c->impl;
  (void)cudaSetDevice(m->device);  // for the event queries; an error shows in them
  pthread_mutex_lock(&m->mu);
  while (!m->stop) {
    if (!m->head) {
      pthread_cond_wait(&m->cv, &m->mu);
      continue;
    }
    nccl_watch_locked(c);
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_nsec += FY_NCCL_WATCH_NS;
    if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
    pthread_cond_timedwait(&m->cv, &m->mu, &ts);
  }
  pthread_mutex_unlock(&m->mu);
  return NULL;
}

static fy_status nccl_watch_start(struct fy_comm *c) {
  struct nccl_impl *m = c->impl;
  if (pthread_create(&m->watchdog, NULL, nccl_watchdog, c) != 0)
    return fy_error_set(FY_ERR_NOMEM, "nccl: cannot start the watchdog thread");
  m->watching = true;
  return FY_OK;
}

// ---------------------------------------------------------------------------------------------
// Collectives

// A pending record with its two events (reused from the spare list when there is one). Holds m->mu.
static fy_status nccl_pending_get(struct nccl_impl *m, struct nccl_pending **out) {
  struct nccl_pending *p = m->spare;
  if (p) {
    m->spare = p->next;
  } else {
    p = calloc(1, sizeof *p);
    if (!p) return fy_error_set(FY_ERR_NOMEM, "cannot allocate a collective's record");
    fy_status st = cuda_check(cudaEventCreateWithFlags(&p->start, cudaEventDisableTiming), "cudaEventCreate");
    if (st == FY_OK) {
      st = cuda_check(cudaEventCreateWithFlags(&p->end, cudaEventDisableTiming), "cudaEventCreate");
      if (st != FY_OK) (void)cudaEventDestroy(p->start);
    }
    if (st != FY_OK) {
      free(p);
      return st;
    }
  }
  p->next = NULL;
  p->started = false;
  *out = p;
  return FY_OK;
}

static void nccl_pending_free(struct nccl_pending *p) {
  while (p) {
    struct nccl_pending *next = p->next;
    (void)cudaEventDestroy(p->start);
    (void)cudaEventDestroy(p->end);
    free(p);
    p = next;
  }
}

static ncclResult_t nccl_enqueue(struct nccl_impl *m, const struct fy_comm_call *call, cudaStream_t cs) {
  ncclDataType_t t = call->dt == FY_COMM_BF16 ? ncclBfloat16 : ncclFloat32;
  switch (call->op) {
    case FY_COMM_OP_ALL_REDUCE:
      return ncclAllReduce(call->buf, call->buf, call->count, t, ncclSum, m->comm, cs);
    case FY_COMM_OP_REDUCE_SCATTER:  // in place (recv = send + rank*count) is NCCL's in place too
      return ncclReduceScatter(call->send, call->buf, call->count, t, ncclSum, m->comm, cs);
    case FY_COMM_OP_ALL_GATHER:      // in place (send = recv + rank*count) likewise
      return ncclAllGather(call->send, call->buf, call->count, t, m->comm, cs);
    case FY_COMM_OP_BROADCAST:
      return ncclBroadcast(call->buf, call->buf, call->count, ncclUint8, call->root, m->comm, cs);
    case FY_COMM_OP_BARRIER:
      return ncclAllReduce(m->one, m->one, 1, ncclFloat32, ncclSum, m->comm, cs);
    case FY_COMM_OP_P2P: {  // one group: NCCL progresses its sends and receives together
      // (A non-blocking communicator may answer ncclInProgress; the group's end is what settles.)
      ncclResult_t r = ncclGroupStart();
      for (int k = 0; k < call->n_msgs && (r == ncclSuccess || r == ncclInProgress); k++) {
        const struct fy_comm_p2p *q = &call->msgs[k];
        if (q->bytes == 0) continue;
        r = q->send ? ncclSend(q->buf, q->bytes, ncclUint8, q->peer, m->comm, cs)
                    : ncclRecv(q->buf, q->bytes, ncclUint8, q->peer, m->comm, cs);
      }
      ncclResult_t e = ncclGroupEnd();  // (also after a failed call: the group is closed)
      return r != ncclSuccess && r != ncclInProgress ? r : e;
    }
    case FY_COMM_OP_ALL_TO_ALL: break;  // (the mpi communicator's alone)
  }
  return ncclInvalidArgument;
}

// Launches the call on cs between its two events and hands it to the watchdog. Holds m->mu.
static fy_status nccl_launch_locked(struct fy_comm *c, const struct fy_comm_call *call, cudaStream_t cs) {
  struct nccl_impl *m = c->impl;
  // What happened since the watchdog's last look (an error of an earlier collective fails this one).
  nccl_watch_locked(c);
  if (atomic_load(&c->failed)) return fy_comm_status(c);
  if (!m->comm) return fy_error_set(FY_ERR_IO, "the NCCL communicator was aborted after an earlier error");
  struct nccl_pending *p = NULL;
  FY_TRY(nccl_pending_get(m, &p));
  p->call = *call;
  p->call.msgs = NULL;  // (the watchdog keeps the call for messages alone: the list is the caller's)
  fy_status st = cuda_check(cudaEventRecord(p->start, cs), "cudaEventRecord");
  if (st == FY_OK) {
    double t0 = fy_now();
    st = nccl_settle(c, m->comm, nccl_enqueue(m, call, cs), call, nccl_fn_name(call->op), t0);
    // After a failed launch the communicator's state is unknown and the peers may be inside the
    // collective: it is not used again. Recorded before the abort, so that a thread released by the
    // abort finds the error.
    if (st != FY_OK) nccl_fail_locked(c, call, st);
  }
  if (st == FY_OK) st = cuda_check(cudaEventRecord(p->end, cs), "cudaEventRecord");
  if (st != FY_OK) {
    p->next = m->spare;
    m->spare = p;
    return st;
  }
  if (m->tail)
    m->tail->next = p;
  else
    m->head = p;
  m->tail = p;
  pthread_cond_signal(&m->cv);
  return FY_OK;
}

// NCCL takes device memory (or managed); a host pointer would fault on the GPU and take the whole
// CUDA context with it, so it is refused here.
static fy_status nccl_check_ptr(struct nccl_impl *m, const void *p, const char *which) {
  struct cudaPointerAttributes a;
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();  // a pointer CUDA does not know is plain host memory
    a.type = cudaMemoryTypeUnregistered;
  }
  if (a.type == cudaMemoryTypeManaged) return FY_OK;
  if (a.type != cudaMemoryTypeDevice)
    return fy_error_set(FY_ERR_INVALID, "%s %p is host memory; the nccl communicator takes device memory", which, p);
  if (a.device != m->device)
    return fy_error_set(FY_ERR_INVALID, "%s %p is on cuda:%d, the communicator on cuda:%d", which, p, a.device,
                        m->device);
  return FY_OK;
}

static fy_status nccl_check_buffers(struct nccl_impl *m, const struct fy_comm_call *call) {
  switch (call->op) {
    case FY_COMM_OP_REDUCE_SCATTER:
    case FY_COMM_OP_ALL_GATHER:
      FY_TRY(nccl_check_ptr(m, call->send, "send buffer"));
      return nccl_check_ptr(m, call->buf, "receive buffer");
    case FY_COMM_OP_ALL_REDUCE:
    case FY_COMM_OP_BROADCAST: return nccl_check_ptr(m, call->buf, "buffer");
    case FY_COMM_OP_BARRIER: return FY_OK;
    case FY_COMM_OP_P2P:
      for (int k = 0; k < call->n_msgs; k++)
        if (call->msgs[k].bytes)
          FY_TRY(nccl_check_ptr(m, call->msgs[k].buf, call->msgs[k].send ? "send buffer" : "receive buffer"));
      return FY_OK;
    case FY_COMM_OP_ALL_TO_ALL: return FY_OK;  // (never a backend's call)
  }
  return FY_OK;
}

static fy_status nccl_stream_of(struct nccl_impl *m, fy_stream *s, cudaStream_t *out) {
  if (s->dev->kind != FY_DEVICE_CUDA)
    return fy_error_set(FY_ERR_INVALID, "the nccl communicator enqueues on cuda streams, not on %s's", s->dev->name);
  int ord = fy_cuda_ordinal(s->dev);
  if (ord != m->device)
    return fy_error_set(FY_ERR_INVALID, "a stream of cuda:%d, the communicator is on cuda:%d", ord, m->device);
  *out = fy_cuda_stream(s);
  return FY_OK;
}

static fy_status nccl_run(struct fy_comm *c, const struct fy_comm_call *call, fy_stream *s) {
  struct nccl_impl *m = c->impl;
  cudaStream_t cs = NULL;  // the default stream when s is NULL
  fy_status st = s ? nccl_stream_of(m, s, &cs) : FY_OK;
  if (st == FY_OK) st = cuda_check(cudaSetDevice(m->device), "cudaSetDevice");
  if (st == FY_OK) st = nccl_check_buffers(m, call);
  if (st == FY_OK) {
    pthread_mutex_lock(&m->mu);
    st = nccl_launch_locked(c, call, cs);
    pthread_mutex_unlock(&m->mu);
  }
  // The watchdog guards this wait too: on an error it aborts the communicator, NCCL's kernels
  // return, and so does the wait. Then one more look, for an error NCCL met on the way that the
  // watchdog has not seen yet.
  if (st == FY_OK && !s) {
    st = cuda_check(cudaStreamSynchronize(cs), "cudaStreamSynchronize");
    pthread_mutex_lock(&m->mu);
    nccl_watch_locked(c);
    pthread_mutex_unlock(&m->mu);
  }
  if (atomic_load(&c->failed)) return fy_comm_status(c);  // its message names the failed call
  return st == FY_OK ? FY_OK : wrap_call(c, call, st);
}

// ---------------------------------------------------------------------------------------------
// Life cycle

// Finalises (flushes, at most timeout_s) and destroys the NCCL communicator; aborts it instead when
// it failed or does not finalise in time.
static void nccl_close(struct fy_comm *c) {
  struct nccl_impl *m = c->impl;
  bool ok = !atomic_load(&c->failed);
  if (ok && nccl_settle(c, m->comm, ncclCommFinalize(m->comm), NULL, "ncclCommFinalize", fy_now()) != FY_OK) {
    fprintf(stderr, "ferry: rank %d: freeing the nccl communicator: %s; aborted it instead\n", c->rank, fy_error_msg());
    ok = false;
  }
  (void)(ok ? ncclCommDestroy(m->comm) : ncclCommAbort(m->comm));
  m->comm = NULL;
}

static void nccl_destroy(struct fy_comm *c) {
  struct nccl_impl *m = c->impl;
  if (m->watching) {
    pthread_mutex_lock(&m->mu);
    m->stop = true;
    pthread_cond_broadcast(&m->cv);
    pthread_mutex_unlock(&m->mu);
    pthread_join(m->watchdog, NULL);
  }
  if (m->device >= 0) (void)cudaSetDevice(m->device);
  if (m->comm) nccl_close(c);
  nccl_pending_free(m->head);
  nccl_pending_free(m->spare);
  if (m->one) (void)cudaFree(m->one);
  (void)cudaGetLastError();
  pthread_cond_destroy(&m->cv);
  pthread_mutex_destroy(&m->mu);
  fy_comm_free(m->boot);
  free(m);
  pthread_mutex_destroy(&c->err_mu);  // the common part (comm.c's own helper for this is static)
  free(c);
}

static fy_status nccl_split(struct fy_comm *c, int color, int key, struct fy_comm **out);

static const struct fy_comm_ops nccl_ops = {
    .run = nccl_run, .split = nccl_split, .destroy = nccl_destroy, .takes_stream = 1};

// A communicator over boot's ranks with no NCCL communicator yet. Takes boot (freed on failure too).
static fy_status nccl_alloc(struct fy_comm *boot, struct fy_comm **out) {
  struct fy_comm *c = calloc(1, sizeof *c);
  struct nccl_impl *m = calloc(1, sizeof *m);
  if (!c || !m) {
    free(c);
    free(m);
    fy_comm_free(boot);
    return fy_error_set(FY_ERR_NOMEM, "nccl: cannot allocate a communicator");
  }
  fy_comm_init_base(c, FY_COMM_NCCL, &nccl_ops, boot->rank, boot->size, boot->local_rank, boot->timeout_s);
  c->local_size = boot->local_size;
  m->boot = boot;
  m->device = -1;
  pthread_mutex_init(&m->mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);  // the watchdog's deadlines are monotonic
  pthread_cond_init(&m->cv, &ca);
  pthread_condattr_destroy(&ca);
  c->impl = m;
  *out = c;
  return FY_OK;
}

// Makes `device` current and allocates the barrier's float.
static fy_status nccl_use_device(struct nccl_impl *m, int device) {
  FY_TRY(cuda_check(cudaSetDevice(device), "cudaSetDevice"));
  m->device = device;
  FY_TRY(cuda_check(cudaMalloc((void **)&m->one, sizeof *m->one), "cudaMalloc"));
  return cuda_check(cudaMemset(m->one, 0, sizeof *m->one), "cudaMemset");
}

// GPU local_rank; or GPU 0 when the launcher shows each rank only its own GPU.
static fy_status nccl_pick_device(struct fy_comm *c) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) return cuda_check(e, "nccl: cudaGetDeviceCount");
  if (n == 0) return fy_error_set(FY_ERR_UNSUPPORTED, "nccl: rank %d sees no GPU", c->rank);
  if (c->local_rank >= n && n > 1)
    return fy_error_set(FY_ERR_INVALID, "nccl: rank %d is local rank %d but its node has %d GPUs (one rank per GPU)",
                        c->rank, c->local_rank, n);
  return nccl_use_device(c->impl, c->local_rank < n ? c->local_rank : 0);
}

static fy_status nccl_init_rank(struct fy_comm *c, const ncclUniqueId *id) {
  struct nccl_impl *m = c->impl;
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclComm_t comm = NULL;
  double t0 = fy_now();
  ncclResult_t r = ncclCommInitRankConfig(&comm, c->size, *id, c->rank, &cfg);
  fy_status st = nccl_settle(c, comm, r, NULL, "nccl: ncclCommInitRank", t0);
  if (st != FY_OK) {
    if (comm) (void)ncclCommAbort(comm);
    return st;
  }
  m->comm = comm;
  return FY_OK;
}

// Everything but the allocation: see the header comment. On GPU `device` (-1: picked by local
// rank); `pre`, when not FY_OK, is this rank's failure before it came here, which every rank hears
// of. On failure c still needs nccl_destroy.
static fy_status nccl_setup(struct fy_comm *c, int device, fy_status pre) {
  struct nccl_impl *m = c->impl;
  char why[512] = "";
  fy_status local = pre != FY_OK ? pre : device < 0 ? nccl_pick_device(c) : nccl_use_device(m, device);
  ncclUniqueId id;
  memset(&id, 0, sizeof id);
  if (local == FY_OK && c->rank == 0) {
    ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) local = nccl_error(NULL, r, "nccl: ncclGetUniqueId");
  }
  if (local != FY_OK) snprintf(why, sizeof why, "%s", fy_error_msg());
  // Every rank takes part in both, whatever its own setup gave: nobody is left waiting.
  fy_status st = fy_comm_broadcast(m->boot, &id, sizeof id, 0, NULL);
  if (st != FY_OK) return fy_error_wrap(st, "nccl: sharing the NCCL id");
  float bad = local != FY_OK;
  st = fy_comm_all_reduce(m->boot, &bad, 1, FY_COMM_F32, NULL);
  if (st != FY_OK) return fy_error_wrap(st, "nccl: agreeing on the setup");
  if (local != FY_OK) return fy_error_set(local, "%s", why);
  if (bad > 0)
    return fy_error_set(FY_ERR_IO, "nccl: %.0f of %d ranks could not set up their GPU (their messages say why)",
                        bad, c->size);
  FY_TRY(nccl_init_rank(c, &id));
  return nccl_watch_start(c);
}

// A communicator over the mpi communicator boot (taken, and freed on failure), set up as
// nccl_setup says; on failure an NCCL communicator made already is aborted, not finalised.
static fy_status nccl_make(struct fy_comm *boot, int device, fy_status pre, struct fy_comm **out) {
  struct fy_comm *c = NULL;
  FY_TRY(nccl_alloc(boot, &c));
  fy_status st = nccl_setup(c, device, pre);
  if (st != FY_OK) {
    fy_comm_fail(c, st);
    nccl_destroy(c);
    return st;
  }
  *out = c;
  return FY_OK;
}

fy_status fy_comm_nccl_create(struct fy_comm *bootstrap, struct fy_comm **out) {
  *out = NULL;
  if (!bootstrap) return fy_error_set(FY_ERR_INVALID, "nccl: no bootstrap communicator");
  if (bootstrap->kind != FY_COMM_MPI) {
    const char *kind = fy_comm_kind_name(bootstrap);
    fy_status st = fy_error_set(FY_ERR_INVALID, "nccl: the bootstrap communicator is %s, not mpi", kind);
    fy_comm_free(bootstrap);
    return st;
  }
  return nccl_make(bootstrap, -1, FY_OK, out);
}

static fy_status nccl_split(struct fy_comm *c, int color, int key, struct fy_comm **out) {
  struct nccl_impl *m = c->impl;
  pthread_mutex_lock(&m->mu);
  bool aborted = m->comm == NULL;
  pthread_mutex_unlock(&m->mu);
  struct fy_comm *boot = NULL;
  fy_status st = fy_comm_split(m->boot, color, key, &boot);
  if (st != FY_OK) return fy_error_wrap(st, "split: the mpi side");
  if (!boot) return FY_OK;  // a negative color: in no group
  // A rank whose parent was aborted still takes part, so that its group fails at once with it.
  st = nccl_make(boot, m->device, aborted ? fy_error_set(FY_ERR_IO, "split: the NCCL communicator was aborted") : FY_OK,
                 out);
  return st == FY_OK ? FY_OK : fy_error_wrap(st, "split");
}
