// fy_comm: collectives across ranks (docs/design.md, "Communication (runtime/)"), one backend behind a
// table of functions like core/device.h.
//
// Backends: `single` (one rank: every collective is a copy or nothing; given a stream, the copy is a
// fy_copy_async on it, so any memory of that stream's device), `mpi` (host buffers; also the
// bootstrap that shares the NCCL id) and `nccl` (device buffers; runtime/comm_nccl.c). Jobs are
// launched with mpirun or srun, never by ferry itself.
//
// Layouts (those of MPI_Reduce_scatter_block / MPI_Allgather and NCCL):
// - reduce-scatter: `send` holds size*recv_count elements; rank r receives in `recv` the sum over all
//   ranks of elements [r*recv_count, (r+1)*recv_count). In place when recv == send + r*recv_count.
// - all-gather: each rank sends send_count elements; `recv` holds size*send_count elements, rank p's
//   at [p*send_count, (p+1)*send_count). In place when send == recv + r*send_count.
// - all-reduce: any count (the backend splits it into size nearly equal chunks internally).
// A total that does not divide by the world size is the caller's to pad (recv_count is per rank).
//
// Numbers: sums are deterministic. Every element of an all-reduce or reduce-scatter is the sum in
// rank order ((x0 + x1) + x2) + ... computed by one rank and sent to the others, so every rank gets
// the same bits whatever the timing, and a rerun gets the same bits again. bf16 sums are done in
// fp32 and rounded once to bf16 (round to nearest even).
// Except nccl: NCCL's own reduction order, deterministic for a fixed topology and count, not rank order.
//
// Ordering: collectives on one communicator must be issued in the same order on every rank (as in
// MPI and NCCL). Those given a stream run on that stream's worker in stream order; keep a
// communicator's collectives on one stream (or order the streams with events), and sync the stream
// before reading the result on the host or freeing the communicator.
//
// Failure: a collective that does not complete within timeout_s prints and records
// "<op> of N MiB did not complete within T s at step S (a rank died or hangs)" and then ends the
// job with MPI_Abort(MPI_COMM_WORLD, 3): mpirun (or srun) kills the other ranks, so the job ends
// instead of hanging, and the launcher exits non-zero. Aborting is deliberate: after a timed-out
// collective the other ranks are stuck inside theirs and no MPI call can release them. Other MPI
// errors come back as statuses (the communicators use MPI_ERRORS_RETURN) with MPI's message; after
// one, the communicator is broken: later collectives on it fail at once with the first error.
#ifndef FY_COMM_H
#define FY_COMM_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "core/device.h"
#include "core/status.h"

enum fy_comm_kind { FY_COMM_SINGLE, FY_COMM_MPI, FY_COMM_NCCL };
enum fy_reduce_dtype { FY_COMM_F32, FY_COMM_BF16 };

struct fy_comm;

// The default --comm-timeout, in seconds.
#define FY_COMM_DEFAULT_TIMEOUT_S 300.0

// kind: "single", "mpi" or "auto" (mpi when a launcher started more than one rank: mpirun's
// OMPI_COMM_WORLD_SIZE or PMI_SIZE, srun's SLURM_STEP_NUM_TASKS; else single. Not SLURM_NTASKS: sbatch
// sets it for the batch script too, which is one process). Rank, size and local rank then come from
// MPI; when the launcher's count and MPI's differ (srun without --mpi=pmix), creation fails and says so.
// timeout_s <= 0 means FY_COMM_DEFAULT_TIMEOUT_S. The mpi backend initialises MPI (MPI_Init_thread,
// MPI_THREAD_MULTIPLE when the library has it, else SERIALIZED with every MPI call under one lock)
// unless the program already did, and works on a duplicate of MPI_COMM_WORLD.
fy_status fy_comm_create(const char *kind, double timeout_s, struct fy_comm **out);
// Frees a communicator (NULL is fine). Freeing the last one created by fy_comm_create calls
// MPI_Finalize when the mpi backend initialised MPI; MPI cannot be initialised again afterwards.
void fy_comm_free(struct fy_comm *c);

// The ranks the launcher (mpirun, srun) started, from its environment, before any communicator
// exists; 1 when launched alone. And this process's rank among them (0 when launched alone).
int fy_comm_launch_size(void);
int fy_comm_launch_rank(void);

enum fy_comm_kind fy_comm_kind(const struct fy_comm *c);
const char *fy_comm_kind_name(const struct fy_comm *c);  // "single", "mpi", "nccl"
int fy_comm_rank(const struct fy_comm *c);
int fy_comm_size(const struct fy_comm *c);
// The rank among the processes of this node (MPI_COMM_TYPE_SHARED) in the world communicator: the
// index of the GPU to use. A split communicator keeps its parent's.
int fy_comm_local_rank(const struct fy_comm *c);
// The processes of this node in the world communicator (1 for single): the ranks that share its
// memory and GPUs. A split communicator keeps its parent's.
int fy_comm_local_size(const struct fy_comm *c);

// Sub-groups (tensor-parallel groups inside data-parallel ones): ranks that pass the same color form
// one communicator, ordered by key then by parent rank. Collective over c. A negative color leaves
// this rank out (*out = NULL). The child has c's timeout and starts with c's step label. Blocking
// and not covered by the timeout (as creation): call it at setup, with no collective in flight.
fy_status fy_comm_split(struct fy_comm *c, int color, int key, struct fy_comm **out);

// Collectives. Buffers are host memory for the mpi backend, which keeps a scratch buffer of up to
// 64 MiB per communicator (the contributions it receives) until the communicator is freed. `s` NULL: runs now, on the caller.
// `s` a stream: enqueued as a host function (fy_stream_enqueue) that runs in stream order; the return
// value then covers only the arguments and the enqueue, and an error of the collective itself is
// reported by fy_comm_status (and by every later collective on c). count, recv_count, send_count are
// in elements of dt.
fy_status fy_comm_all_reduce(struct fy_comm *c, void *buf, size_t count, enum fy_reduce_dtype dt,
                             fy_stream *s);
fy_status fy_comm_reduce_scatter(struct fy_comm *c, const void *send, void *recv, size_t recv_count,
                                 enum fy_reduce_dtype dt, fy_stream *s);
fy_status fy_comm_all_gather(struct fy_comm *c, const void *send, void *recv, size_t send_count,
                             enum fy_reduce_dtype dt, fy_stream *s);
fy_status fy_comm_broadcast(struct fy_comm *c, void *buf, size_t bytes, int root, fy_stream *s);
fy_status fy_comm_barrier(struct fy_comm *c);
// Point-to-point messages (pipeline parallelism: runtime/pipeline.c), mpi backend only (host
// buffers, on the calling thread): `bytes` (a multiple of 4) to or from rank `peer` of c. Messages
// from one rank to another with one tag arrive in the order they were sent. fy_comm_isend starts a
// send and hands back its request, to be waited on (fy_comm_wait, which frees it; NULL is done)
// before the buffer changes; fy_comm_recv returns once the message is in buf. A wait that passes
// the timeout ends the job as a collective's does ("send of 4 KiB to rank 1 did not complete ...").
struct fy_comm_req;
fy_status fy_comm_isend(struct fy_comm *c, const void *buf, size_t bytes, int peer, int tag, struct fy_comm_req **out);
fy_status fy_comm_recv(struct fy_comm *c, void *buf, size_t bytes, int peer, int tag);
fy_status fy_comm_wait(struct fy_comm *c, struct fy_comm_req *req);
// Point-to-point messages on device memory, nccl backend only (ncclSend and ncclRecv; pipeline
// stages on GPUs): the n messages (each `bytes` to or from rank `peer` of c, not this rank) go as one
// NCCL group enqueued on stream s (of the communicator's GPU), so that they progress together. A
// send blocks its stream until the peer has received it (NCCL's rule), so two ranks that send to
// each other at once must each group the send with the receive. Messages from one rank to another
// arrive in the order they were issued; a receive must name the bytes the peer sends. Errors and
// timeouts are a collective's (the watchdog's "send/receive of 4 KiB ... did not complete").
struct fy_comm_p2p {
  void *buf;
  size_t bytes;
  int peer;
  int send;  // 1: buf goes to peer; 0: it comes from peer
};
fy_status fy_comm_group_p2p(struct fy_comm *c, const struct fy_comm_p2p *msgs, int n, fy_stream *s);

// All-to-all of varying sizes (expert parallelism: runtime/ep.c), mpi and single backends (host
// buffers, on the calling thread, as MPI_Alltoallv): this rank sends send_counts[p] floats to rank p,
// its block p of send (the blocks in rank order, packed), and receives recv_counts[p] floats from
// rank p into its block p of recv (packed likewise). The counts must agree pairwise across ranks
// (the callers exchange them first, with fy_comm_all_to_all of one count a pair). Past the timeout
// it ends the job as a collective does ("all-to-all of 4 KiB did not complete ...").
fy_status fy_comm_all_to_all_v(struct fy_comm *c, const float *send, const int64_t *send_counts, float *recv,
                               const int64_t *recv_counts);
// All-to-all of `count` int64 values a pair: rank p's block of send goes to rank p, which
// receives it as this rank's block of recv (both size x count values).
fy_status fy_comm_all_to_all(struct fy_comm *c, const int64_t *send, int64_t *recv, size_t count);

// FY_OK, or the first error of a collective on c (an enqueued one included), with its message set
// as the calling thread's fy_error_msg(). Sticky: the communicator is broken after an error.
fy_status fy_comm_status(struct fy_comm *c);

// Labels the current step for error messages ("all-reduce of 64 MiB ... at step 12"). A collective
// enqueued on a stream keeps the step that was current when it was enqueued.
void fy_comm_set_step(struct fy_comm *c, int64_t step);

// ---- For backends (runtime/comm.c, runtime/comm_nccl.c) ----

enum fy_collective { FY_COMM_OP_ALL_REDUCE, FY_COMM_OP_REDUCE_SCATTER, FY_COMM_OP_ALL_GATHER,
                  FY_COMM_OP_BROADCAST, FY_COMM_OP_BARRIER, FY_COMM_OP_P2P,
                  FY_COMM_OP_ALL_TO_ALL };  // (fy_comm_all_to_all_v's, count its bytes: no backend's run())

// One collective, as the front end hands it to a backend (already checked).
struct fy_comm_call {
  enum fy_collective op;
  const void *send;   // reduce-scatter, all-gather
  void *buf;          // all-reduce and broadcast: the buffer; reduce-scatter, all-gather: recv
  size_t count;       // elements: all-reduce count, reduce-scatter recv_count, all-gather send_count;
                      // bytes for broadcast
  enum fy_reduce_dtype dt;
  int root;
  int64_t step;       // for messages
  const struct fy_comm_p2p *msgs;  // point-to-point (count: their bytes in all; valid during run() alone)
  int n_msgs;
};

struct fy_comm_ops {
  // Runs a call to completion on the calling thread (or, for device backends, enqueues it on s).
  fy_status (*run)(struct fy_comm *c, const struct fy_comm_call *call, fy_stream *s);
  fy_status (*split)(struct fy_comm *c, int color, int key, struct fy_comm **out);
  void (*destroy)(struct fy_comm *c);
  // True when run() takes the stream itself (device backends); else the front end enqueues a host
  // function that calls run() with s = NULL.
  int takes_stream;
};

struct fy_comm {
  enum fy_comm_kind kind;
  const struct fy_comm_ops *ops;
  int rank, size, local_rank, local_size;
  double timeout_s;
  _Atomic int64_t step;          // INT64_MIN: not set
  _Atomic int failed;            // a collective failed: err_st / err_msg hold the first error
  pthread_mutex_t err_mu;
  fy_status err_st;
  char err_msg[512];
  void *impl;                    // backend state
};

// Fills the common fields (step unset, no error, local_size 1) of a communicator a backend allocated.
void fy_comm_init_base(struct fy_comm *c, enum fy_comm_kind kind, const struct fy_comm_ops *ops,
                       int rank, int size, int local_rank, double timeout_s);
// Provided by runtime/comm_nccl.c in builds with NCCL (a weak reference here: without it, kind
// "nccl" is refused: fy_comm_create calls it when fy_config.h sets FY_HAVE_NCCL to 1). Takes
// ownership of `bootstrap` (also on failure), an mpi communicator over the same ranks that shares
// the NCCL id (fy_comm_broadcast) and is freed with the NCCL communicator.
fy_status fy_comm_nccl_create(struct fy_comm *bootstrap, struct fy_comm **out);

size_t fy_comm_dtype_size(enum fy_reduce_dtype dt);
const char *fy_collective_name(enum fy_collective op);  // "all-reduce", ...
// Total bytes a call moves as nccl-tests size it (the larger buffer: size*count for reduce-scatter
// and all-gather).
size_t fy_comm_call_bytes(const struct fy_comm *c, const struct fy_comm_call *call);
// Records the first error of c (the calling thread's st and fy_error_msg()) and returns st.
fy_status fy_comm_fail(struct fy_comm *c, fy_status st);
// "at step 12" or "before the first step" into buf, for messages.
const char *fy_comm_step_text(int64_t step, char *buf, size_t n);
// "64 MiB", "1.5 KiB", "12 B".
const char *fy_comm_size_text(size_t bytes, char *buf, size_t n);
// A collective of c ran out of time: sets the error ("all-reduce of 64 MiB did not complete
// within 300 s at step 12 (a rank died or hangs)"), records it as c's first error, and prints
// "ferry: rank R: <message>; <then>" to stderr. The backend then ends the job its own way.
void fy_comm_timed_out(struct fy_comm *c, const struct fy_comm_call *call, const char *then);

#endif
