// The CUDA emulator's NCCL: the part of NCCL's API that runtime/comm_nccl.c calls, between the
// processes of an mpirun job (one rank per process, as ferry runs), over POSIX shared memory.
//
// A communicator is a shared segment named in its ncclUniqueId: a header (a barrier, each rank's
// description of the collective it is in) and one 1 MiB slot per rank. A collective runs on its
// stream's worker thread, in stream order, as NCCL's kernel would: in pieces of a slot, each rank
// copies its part of the piece into its slot, all meet at the barrier, each computes its result
// from every slot, all meet again. Sums are taken in rank order in fp32 (bf16 rounded once, at the
// end): for two ranks the bits a GPU gives, for more within rounding of them, which is all NCCL
// promises (comm_nccl.c). A collective whose ranks disagree (another operation, count, type or
// root: a hang or garbage on GPUs) stops the program with what each rank called.
//
// As NCCL: a communicator is bound to the GPU current at its creation, and takes device memory of
// that GPU and streams of it (anything else stops the program: on a GPU, a fault); a non-blocking
// one (config.blocking = 0) answers ncclInProgress from its creation until every rank has joined,
// and from ncclCommFinalize until its collectives are done; a collective waiting for a rank that
// never comes waits for ever, until ncclCommAbort, which makes it give up (its results undefined).
// Not emulated: collectives inside ncclGroupStart/End, other reductions, ncclCommSplit.
//
// Point-to-point (ncclSend, ncclRecv): each ordered pair of ranks that exchanges messages has a
// channel of its own, a shared segment (named after the communicator's, made by whichever rank
// comes first) holding one 1 MiB piece at a time. A send runs on its stream's worker as NCCL's
// kernel does, blocking that stream until the peer's ncclRecv has taken its last piece (NCCL calls
// both blocking for the GPU), so a schedule whose sends and receives wait on each other hangs here
// as it would on GPUs. Between ncclGroupStart and ncclGroupEnd the sends and receives of one stream
// form one job that advances them all together, as NCCL's group does (the only way two ranks can
// send to each other at once). A receive whose count (in bytes) is not the send's stops the program.
//
// FY_EMU_NCCL_FAIL=OP:N (OP one of ncclAllReduce, ncclReduceScatter, ncclAllGather, ncclBroadcast)
// makes the process's N-th collective of that kind (counted from 1, over all its communicators) fail
// on its stream as a lost peer makes NCCL's fail: the communicator's asynchronous error becomes
// ncclRemoteError, and the collective waits (NCCL's kernel waits for data that never comes) until
// ncclCommAbort, its results left as they were. Set for every rank, every rank fails there.
#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <nccl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "test/cudaemu/emu_internal.h"

namespace {

const size_t SLOT = 1 << 20;  // bytes each rank hands over per piece
const int MAX_RANKS = 64;

enum op_kind { OP_ALL_REDUCE = 1, OP_REDUCE_SCATTER, OP_ALL_GATHER, OP_BROADCAST };

struct op_desc {  // what a rank called: every rank of a collective must agree
  uint32_t op, dt, root, pad;
  uint64_t count, seq;
};

struct shm_header {
  std::atomic<uint32_t> nranks;    // set by the first rank to join; the others must agree
  std::atomic<uint32_t> attached;  // ranks that joined
  std::atomic<uint32_t> arrived;   // at the barrier, this round
  std::atomic<uint32_t> gen;       // barrier rounds completed (the futex word)
  op_desc desc[MAX_RANKS];
  int32_t gpu[MAX_RANKS];  // the machine's GPU each rank is on (set before it counts itself attached)
};

size_t header_bytes() { return (sizeof(shm_header) + 4095) / 4096 * 4096; }

// A point-to-point channel from one rank to another: one piece of a message at a time.
struct p2p_channel {
  std::atomic<uint32_t> attached;  // ranks that mapped it (the second unlinks its name)
  std::atomic<uint32_t> filled;    // pieces written by the sender (a futex word)
  std::atomic<uint32_t> drained;   // pieces taken by the receiver (a futex word)
  uint32_t pad;
  uint64_t piece_bytes;  // the piece in the buffer
  uint64_t msg_bytes;    // the message it belongs to (the receiver's must be the same)
};
const size_t P2P_HEADER = 4096;

// A communicator's state, shared by its handle and the collectives queued on streams (which may
// run after ncclCommAbort or ncclCommDestroy returned: they find `aborted` and give up).
struct comm_state {
  int rank = 0, nranks = 1, device = 0;
  bool blocking = true;
  std::string name;
  shm_header *hdr = nullptr;
  unsigned char *slots = nullptr;
  size_t map_bytes = 0;
  std::atomic<bool> aborted{false}, ready{false}, finalizing{false};
  std::atomic<ncclResult_t> error{ncclSuccess};
  std::atomic<int64_t> pending{0};  // collectives queued and not finished
  std::mutex mu;                    // seq, last
  uint64_t seq = 0;                 // collectives issued
  std::string last;                 // ncclGetLastError
  std::map<std::pair<int, int>, p2p_channel *> channels;  // (from, to): mapped point-to-point channels
  ~comm_state() {
    if (hdr) munmap(hdr, map_bytes);
    for (auto &c : channels) munmap(c.second, P2P_HEADER + SLOT);
  }
};

}  // namespace

struct ncclComm {
  std::shared_ptr<comm_state> st;
};

namespace {

// One send or receive of a group, as the job that runs the group advances it.
struct p2p_op {
  bool send;
  int peer;
  unsigned char *buf;
  size_t bytes, off;  // off: bytes written (send) or taken (receive) so far
  p2p_channel *ch;
  bool done;
};

// Ops that ncclSend and ncclRecv gathered since ncclGroupStart, with their stream (this thread's).
thread_local int group_depth = 0;
thread_local std::vector<p2p_op> group_ops;
thread_local std::shared_ptr<comm_state> group_comm;
thread_local cudaStream_t group_stream;

thread_local std::string last_error_text;  // ncclGetLastError(NULL)

ncclResult_t set_error(comm_state *c, ncclResult_t r, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
ncclResult_t set_error(comm_state *c, ncclResult_t r, const char *fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  last_error_text = buf;
  if (c) {
    std::lock_guard<std::mutex> lk(c->mu);
    c->last = buf;
  }
  return r;
}

void nap(long ns) {
  struct timespec ts = {0, ns};
  nanosleep(&ts, NULL);
}

void futex_wait(std::atomic<uint32_t> *w, uint32_t v) {
  struct timespec ts = {0, 1000000};  // 1 ms: then look at `aborted` again
  syscall(SYS_futex, (uint32_t *)w, FUTEX_WAIT, v, &ts, NULL, 0);
}

void futex_wake(std::atomic<uint32_t> *w) { syscall(SYS_futex, (uint32_t *)w, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0); }

// Every rank meets here; false when the communicator was aborted meanwhile.
bool barrier(comm_state *s) {
  shm_header *h = s->hdr;
  const uint32_t g = h->gen.load(std::memory_order_acquire);
  if (h->arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == (uint32_t)s->nranks) {
    h->arrived.store(0, std::memory_order_relaxed);
    h->gen.fetch_add(1, std::memory_order_release);
    futex_wake(&h->gen);
    return true;
  }
  while (h->gen.load(std::memory_order_acquire) == g) {
    if (s->aborted.load()) return false;
    futex_wait(&h->gen, g);
  }
  return true;
}

// Joins the segment (made by whichever rank comes first) and waits for every rank to join; ranks
// on the same GPU fail there, as they do in NCCL.
ncclResult_t attach(comm_state *s, std::string *why) {
  int fd = shm_open(s->name.c_str(), O_RDWR | O_CREAT, 0600);
  if (fd < 0) {
    *why = std::string("shm_open ") + s->name + ": " + strerror(errno);
    return ncclSystemError;
  }
  s->map_bytes = header_bytes() + (size_t)s->nranks * SLOT;
  // posix_fallocate only grows it (a rank that joined already keeps its header; a rank with another
  // nranks is caught below), and takes the pages now: a full /dev/shm is an error here, not a
  // SIGBUS in the middle of a collective
  int e = posix_fallocate(fd, 0, (off_t)s->map_bytes);
  if (e != 0) {
    *why = std::string("sizing ") + s->name + " (/dev/shm) to " + std::to_string(s->map_bytes) + " bytes: " + strerror(e);
    close(fd);
    return ncclSystemError;
  }
  void *m = mmap(NULL, s->map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (m == MAP_FAILED) {
    *why = std::string("mmap ") + s->name + ": " + strerror(errno);
    return ncclSystemError;
  }
  s->hdr = (shm_header *)m;
  s->slots = (unsigned char *)m + header_bytes();
  uint32_t want = 0;
  if (!s->hdr->nranks.compare_exchange_strong(want, (uint32_t)s->nranks) && want != (uint32_t)s->nranks) {
    *why = "ranks disagree on the communicator's size (" + std::to_string(want) + " and " + std::to_string(s->nranks) + ")";
    return ncclInvalidUsage;
  }
  s->hdr->gpu[s->rank] = fy_emu_physical_gpu(s->device);
  if (s->hdr->attached.fetch_add(1) + 1 == (uint32_t)s->nranks)
    shm_unlink(s->name.c_str());  // everyone has it mapped: the name can go
  while (s->hdr->attached.load() < (uint32_t)s->nranks) {
    if (s->aborted.load()) {
      *why = "aborted while waiting for the other ranks";
      return ncclInvalidUsage;
    }
    nap(200000);
  }
  for (int q = 0; q < s->nranks; q++)  // as NCCL: one rank per GPU
    if (q != s->rank && s->hdr->gpu[q] == s->hdr->gpu[s->rank]) {
      *why = "Duplicate GPU detected : rank " + std::to_string(s->rank < q ? s->rank : q) + " and rank " +
             std::to_string(s->rank < q ? q : s->rank) + " both on CUDA device " + std::to_string(s->hdr->gpu[q]);
      return ncclInvalidUsage;
    }
  return ncclSuccess;
}

const char *op_name(uint32_t op) {
  switch (op) {
    case OP_ALL_REDUCE: return "ncclAllReduce";
    case OP_REDUCE_SCATTER: return "ncclReduceScatter";
    case OP_ALL_GATHER: return "ncclAllGather";
    case OP_BROADCAST: return "ncclBroadcast";
  }
  return "?";
}

size_t type_size(ncclDataType_t t) { return t == ncclFloat32 ? 4 : t == ncclBfloat16 ? 2 : 1; }

float load(const unsigned char *p, ncclDataType_t t) {
  if (t == ncclFloat32) {
    float f;
    memcpy(&f, p, 4);
    return f;
  }
  uint16_t h;
  memcpy(&h, p, 2);
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

void store(unsigned char *p, ncclDataType_t t, float f) {
  if (t == ncclFloat32) {
    memcpy(p, &f, 4);
    return;
  }
  uint32_t u;
  memcpy(&u, &f, 4);
  uint16_t h = (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((u >> 16) | 0x40)                // NaN stays NaN
                                                : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);  // to nearest, even
  memcpy(p, &h, 2);
}

// dst[i] = the sum over ranks q (in order) of slot q's element at byte offset `off` + i
void sum_slots(comm_state *s, unsigned char *dst, size_t off, size_t n, ncclDataType_t t) {
  const size_t es = type_size(t);
  for (size_t i = 0; i < n; i++) {
    float acc = 0.0f;
    for (int q = 0; q < s->nranks; q++) acc += load(s->slots + (size_t)q * SLOT + off + i * es, t);
    store(dst + i * es, t, acc);
  }
}

// One collective, on the stream's worker. The first barrier of the first piece is where the ranks'
// descriptions are compared.
void run_collective(comm_state *s, op_desc d, const unsigned char *send, unsigned char *recv) {
  const ncclDataType_t t = (ncclDataType_t)d.dt;
  const size_t es = type_size(t), n = (size_t)s->nranks, me = (size_t)s->rank;
  unsigned char *mine = s->slots + me * SLOT;
  s->hdr->desc[me] = d;
  bool first = true;
  auto meet = [&]() {
    if (!barrier(s)) return false;
    if (first) {
      first = false;
      for (size_t q = 0; q < n; q++) {
        const op_desc &o = s->hdr->desc[q];
        if (o.op != d.op || o.dt != d.dt || o.count != d.count || o.root != d.root || o.seq != d.seq)
          fy_emu_fail("nccl: rank %zu's collective %llu is %s of %llu elements (type %u, root %u), rank %zu's %s of "
                      "%llu (type %u, root %u): on GPUs a hang or garbage",
                      me, (unsigned long long)d.seq, op_name(d.op), (unsigned long long)d.count, d.dt, d.root, q,
                      op_name(o.op), (unsigned long long)o.count, o.dt, o.root);
      }
    }
    return true;
  };
  const size_t count = (size_t)d.count;
  size_t per = SLOT / es;  // elements per piece
  if (d.op == OP_REDUCE_SCATTER) per = SLOT / (es * n);
  for (size_t o = 0; o < count; o += per) {
    const size_t p = count - o < per ? count - o : per;
    switch (d.op) {
      case OP_ALL_REDUCE:
        memcpy(mine, send + o * es, p * es);
        if (!meet()) return;
        sum_slots(s, recv + o * es, 0, p, t);
        break;
      case OP_REDUCE_SCATTER:  // send (n, count): piece [o, o+p) of every rank's part
        for (size_t q = 0; q < n; q++) memcpy(mine + q * p * es, send + (q * count + o) * es, p * es);
        if (!meet()) return;
        sum_slots(s, recv + o * es, me * p * es, p, t);
        break;
      case OP_ALL_GATHER:  // recv (n, count)
        memcpy(mine, send + o * es, p * es);
        if (!meet()) return;
        for (size_t q = 0; q < n; q++) memcpy(recv + (q * count + o) * es, s->slots + q * SLOT, p * es);
        break;
      case OP_BROADCAST:
        if (me == d.root) memcpy(mine, send + o * es, p * es);
        if (!meet()) return;
        if (me != d.root || send != recv) memcpy(recv + o * es, s->slots + (size_t)d.root * SLOT, p * es);
        break;
    }
    if (!barrier(s)) return;  // the slots are free again
  }
}

// Whether this collective is the one FY_EMU_NCCL_FAIL names.
bool injected_failure(uint32_t op) {
  static const char *want = getenv("FY_EMU_NCCL_FAIL");
  static std::atomic<long> counts[OP_BROADCAST + 1];
  if (!want || !*want) return false;
  const char *colon = strchr(want, ':');
  const size_t len = strlen(op_name(op));
  if (!colon || (size_t)(colon - want) != len || strncmp(want, op_name(op), len) != 0) return false;
  return counts[op].fetch_add(1) + 1 == atol(colon + 1);
}

// Checks and queues a collective; send_bytes / recv_bytes: what it reads and writes.
ncclResult_t enqueue(ncclComm *c, uint32_t op, const void *send, void *recv, size_t count, ncclDataType_t t,
                     ncclRedOp_t red, int root, size_t send_bytes, size_t recv_bytes, cudaStream_t stream) {
  if (!c) return set_error(NULL, ncclInvalidArgument, "%s: no communicator", op_name(op));
  comm_state *s = c->st.get();
  if (s->aborted.load()) return set_error(s, ncclInvalidUsage, "%s on an aborted communicator", op_name(op));
  if (!s->ready.load()) return set_error(s, ncclInvalidUsage, "%s before the communicator was set up", op_name(op));
  if (group_depth > 0)
    return set_error(s, ncclInvalidUsage, "%s inside ncclGroupStart/End is not emulated", op_name(op));
  const bool bytes = t == ncclUint8 || t == ncclInt8;
  if (t != ncclFloat32 && t != ncclBfloat16 && !(bytes && (op == OP_BROADCAST || op == OP_ALL_GATHER)))
    return set_error(s, ncclInvalidArgument, "%s: type %d is not emulated", op_name(op), (int)t);
  if (red != ncclSum) return set_error(s, ncclInvalidArgument, "%s: only ncclSum is emulated", op_name(op));
  if (root < 0 || root >= s->nranks) return set_error(s, ncclInvalidArgument, "%s: root %d", op_name(op), root);
  const int sd = fy_emu_stream_device(stream);  // (the legacy stream: the communicator's GPU's)
  if (sd >= 0 && sd != s->device)
    fy_emu_fail("nccl: %s on a stream of GPU %d, the communicator is on GPU %d", op_name(op), sd, s->device);
  if (count > 0) {
    if (send_bytes && fy_emu_device_of(send, send_bytes) != s->device)
      fy_emu_fail("nccl: %s's send buffer (%zu bytes at %p) is not device memory of GPU %d: a fault on a GPU",
                  op_name(op), send_bytes, send, s->device);
    if (recv_bytes && fy_emu_device_of(recv, recv_bytes) != s->device)
      fy_emu_fail("nccl: %s's receive buffer (%zu bytes at %p) is not device memory of GPU %d: a fault on a GPU",
                  op_name(op), recv_bytes, recv, s->device);
  }
  op_desc d = {op, (uint32_t)t, (uint32_t)root, 0, count, 0};
  {
    std::lock_guard<std::mutex> lk(s->mu);
    d.seq = s->seq++;
  }
  // (counted only where there is something to exchange, as the injection's N counts)
  const bool lost = count > 0 && s->nranks > 1 && injected_failure(op);
  if (count == 0 || (s->nranks == 1 && send == recv)) return ncclSuccess;  // nothing to do
  std::shared_ptr<comm_state> keep = c->st;
  keep->pending++;
  fy_emu_enqueue(stream, [keep, d, send, recv, recv_bytes, lost] {
    if (lost) {  // a peer that never sends: the error, then the wait for the abort
      set_error(keep.get(), ncclRemoteError, "%s %llu: a failure injected by FY_EMU_NCCL_FAIL", op_name(d.op),
                (unsigned long long)d.seq);
      keep->error = ncclRemoteError;
      while (!keep->aborted.load()) nap(1000000);
    } else if (keep->nranks == 1) {  // one rank: a copy
      memmove(recv, send, recv_bytes);
    } else if (!keep->aborted.load()) {
      run_collective(keep.get(), d, (const unsigned char *)send, (unsigned char *)recv);
    }
    keep->pending--;
  });
  return ncclSuccess;
}

// The channel from rank `from` to rank `to` of s, mapped on first use (under s->mu); NULL with
// *why set when the segment cannot be made.
p2p_channel *channel(comm_state *s, int from, int to, std::string *why) {
  std::lock_guard<std::mutex> lk(s->mu);
  auto it = s->channels.find({from, to});
  if (it != s->channels.end()) return it->second;
  const std::string name = s->name + "-p" + std::to_string(from) + "-" + std::to_string(to);
  int fd = shm_open(name.c_str(), O_RDWR | O_CREAT, 0600);
  if (fd < 0) {
    *why = "shm_open " + name + ": " + strerror(errno);
    return NULL;
  }
  int e = posix_fallocate(fd, 0, (off_t)(P2P_HEADER + SLOT));
  void *m = e == 0 ? mmap(NULL, P2P_HEADER + SLOT, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  close(fd);
  if (m == MAP_FAILED) {
    *why = "mapping " + name + " (/dev/shm): " + strerror(e ? e : errno);
    return NULL;
  }
  p2p_channel *c = (p2p_channel *)m;
  if (c->attached.fetch_add(1) + 1 == 2) shm_unlink(name.c_str());  // both ends have it
  s->channels[{from, to}] = c;
  return c;
}


// One step of op k of ops (false: it cannot move now). An op waits for the earlier ones of its
// channel, so that messages between two ranks keep their order.
bool p2p_step(comm_state *s, std::vector<p2p_op> &ops, size_t k) {
  p2p_op &o = ops[k];
  for (size_t j = 0; j < k; j++)
    if (!ops[j].done && ops[j].ch == o.ch) return false;
  p2p_channel *c = o.ch;
  const uint32_t f = c->filled.load(std::memory_order_acquire), d = c->drained.load(std::memory_order_acquire);
  unsigned char *piece = (unsigned char *)c + P2P_HEADER;
  if (o.send) {
    if (f != d) return false;  // the peer has not taken the last piece yet
    if (o.off == o.bytes) {    // taken: the send is done (blocking for the stream until then, as NCCL's)
      o.done = true;
      return true;
    }
    const size_t p = o.bytes - o.off < SLOT ? o.bytes - o.off : SLOT;
    memcpy(piece, o.buf + o.off, p);
    c->piece_bytes = p;
    c->msg_bytes = o.bytes;
    o.off += p;
    c->filled.store(f + 1, std::memory_order_release);
    futex_wake(&c->filled);
    return true;
  }
  if (f == d) return false;  // nothing there yet
  if (c->msg_bytes != o.bytes)
    fy_emu_fail("nccl: rank %d receives %zu bytes from rank %d, which sends %llu: on GPUs a hang or garbage", s->rank,
                o.bytes, o.peer, (unsigned long long)c->msg_bytes);
  memcpy(o.buf + o.off, piece, c->piece_bytes);
  o.off += c->piece_bytes;
  c->drained.store(d + 1, std::memory_order_release);
  futex_wake(&c->drained);
  o.done = o.off == o.bytes;
  return true;
}

// Runs a group's sends and receives to completion on the stream's worker (or until an abort).
void run_p2p(comm_state *s, std::vector<p2p_op> ops) {
  size_t left = ops.size(), idle = 0;
  while (left > 0) {
    bool moved = false;
    for (size_t k = 0; k < ops.size(); k++)
      if (!ops[k].done && p2p_step(s, ops, k)) {
        moved = true;
        if (ops[k].done) left--;
      }
    if (moved) {
      idle = 0;
      continue;
    }
    if (s->aborted.load()) return;
    if (++idle > 200) nap(20000);  // spin a little, then poll every 20 us
  }
}

// Queues a group's ops (one send or receive alone, outside a group) on the stream.
void p2p_enqueue(const std::shared_ptr<comm_state> &keep, std::vector<p2p_op> ops, cudaStream_t stream) {
  keep->pending++;
  fy_emu_enqueue(stream, [keep, ops] {
    if (!keep->aborted.load()) run_p2p(keep.get(), ops);
    keep->pending--;
  });
}

// Checks a send or a receive and queues it (or, in a group, adds it to the group's).
ncclResult_t p2p(ncclComm *c, bool send, void *buf, size_t count, ncclDataType_t t, int peer, cudaStream_t stream) {
  const char *fn = send ? "ncclSend" : "ncclRecv";
  if (!c) return set_error(NULL, ncclInvalidArgument, "%s: no communicator", fn);
  comm_state *s = c->st.get();
  if (s->aborted.load()) return set_error(s, ncclInvalidUsage, "%s on an aborted communicator", fn);
  if (!s->ready.load()) return set_error(s, ncclInvalidUsage, "%s before the communicator was set up", fn);
  if (t != ncclFloat32 && t != ncclBfloat16 && t != ncclUint8 && t != ncclInt8)
    return set_error(s, ncclInvalidArgument, "%s: type %d is not emulated", fn, (int)t);
  if (peer < 0 || peer >= s->nranks || peer == s->rank)
    return set_error(s, ncclInvalidArgument, "%s: peer %d (rank %d of %d)", fn, peer, s->rank, s->nranks);
  const int sd = fy_emu_stream_device(stream);
  if (sd >= 0 && sd != s->device)
    fy_emu_fail("nccl: %s on a stream of GPU %d, the communicator is on GPU %d", fn, sd, s->device);
  const size_t bytes = count * type_size(t);
  if (bytes > 0 && fy_emu_device_of(buf, bytes) != s->device)
    fy_emu_fail("nccl: %s's buffer (%zu bytes at %p) is not device memory of GPU %d: a fault on a GPU", fn, bytes, buf,
                s->device);
  if (group_depth > 0 && group_comm && (group_comm.get() != s || group_stream != stream))
    return set_error(s, ncclInvalidUsage, "%s: the emulator takes one communicator and one stream a group", fn);
  std::string why;
  p2p_channel *ch = bytes == 0 ? NULL : channel(s, send ? s->rank : peer, send ? peer : s->rank, &why);
  if (bytes > 0 && !ch) return set_error(s, ncclSystemError, "%s: %s", fn, why.c_str());
  std::vector<p2p_op> one;
  std::vector<p2p_op> &ops = group_depth > 0 ? group_ops : one;
  if (bytes > 0) ops.push_back(p2p_op{send, peer, (unsigned char *)buf, bytes, 0, ch, false});
  if (group_depth > 0) {
    group_comm = c->st;
    group_stream = stream;
  } else if (!one.empty()) {
    p2p_enqueue(c->st, one, stream);
  }
  return ncclSuccess;
}

}  // namespace

extern "C" {

ncclResult_t ncclGroupStart(void) {
  if (group_depth++ == 0) {
    group_ops.clear();
    group_comm.reset();
  }
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd(void) {
  if (group_depth == 0) return set_error(NULL, ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
  if (--group_depth > 0) return ncclSuccess;
  if (group_comm && !group_ops.empty()) p2p_enqueue(group_comm, group_ops, group_stream);
  group_ops.clear();
  group_comm.reset();
  return ncclSuccess;
}

ncclResult_t ncclSend(const void *send, size_t count, ncclDataType_t t, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return p2p(comm, true, (void *)send, count, t, peer, stream);
}

ncclResult_t ncclRecv(void *recv, size_t count, ncclDataType_t t, int peer, ncclComm_t comm, cudaStream_t stream) {
  return p2p(comm, false, recv, count, t, peer, stream);
}

const char *ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
  }
}

const char *ncclGetLastError(ncclComm_t comm) {
  if (!comm) return last_error_text.c_str();
  std::lock_guard<std::mutex> lk(comm->st->mu);
  last_error_text = comm->st->last;  // a copy the caller may hold after the lock
  return last_error_text.c_str();
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
  static std::atomic<unsigned> made{0};
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  memset(id, 0, sizeof *id);
  snprintf(id->internal, sizeof id->internal, "/ferry-emu-nccl-%d-%u-%lx", (int)getpid(), made++,
           (unsigned long)(ts.tv_nsec ^ ts.tv_sec));
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t *out, int nranks, ncclUniqueId id, int rank, ncclConfig_t *config) {
  *out = NULL;
  if (nranks < 1 || nranks > MAX_RANKS || rank < 0 || rank >= nranks)
    return set_error(NULL, ncclInvalidArgument, "ncclCommInitRankConfig: rank %d of %d (the emulator takes up to %d)",
                     rank, nranks, MAX_RANKS);
  if (id.internal[0] != '/' || !memchr(id.internal, 0, sizeof id.internal))
    return set_error(NULL, ncclInvalidArgument, "ncclCommInitRankConfig: not an id from ncclGetUniqueId");
  ncclComm *c = new ncclComm;
  c->st = std::make_shared<comm_state>();
  comm_state *s = c->st.get();
  s->rank = rank;
  s->nranks = nranks;
  s->device = fy_emu_current_device();
  s->name = id.internal;
  s->blocking = !(config && config->blocking == 0);
  *out = c;
  std::shared_ptr<comm_state> keep = c->st;
  auto join = [keep] {
    std::string why;
    ncclResult_t r = attach(keep.get(), &why);
    if (r != ncclSuccess) {
      set_error(keep.get(), r, "ncclCommInitRankConfig: %s", why.c_str());
      keep->error = r;
      return r;
    }
    keep->ready = true;
    return ncclSuccess;
  };
  if (s->blocking) return join();
  std::thread(join).detach();  // the state says when it is done
  return ncclInProgress;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *state) {
  if (!comm) return set_error(NULL, ncclInvalidArgument, "ncclCommGetAsyncError: no communicator");
  comm_state *s = comm->st.get();
  ncclResult_t e = s->error.load();
  if (e != ncclSuccess) *state = e;
  else if (!s->ready.load()) *state = ncclInProgress;
  else if (s->finalizing.load() && s->pending.load() > 0) *state = ncclInProgress;
  else *state = ncclSuccess;
  return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  if (!comm) return set_error(NULL, ncclInvalidArgument, "ncclCommFinalize: no communicator");
  comm_state *s = comm->st.get();
  s->finalizing = true;
  if (!s->blocking) return s->pending.load() > 0 ? ncclInProgress : ncclSuccess;
  while (s->pending.load() > 0 && !s->aborted.load()) nap(200000);
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (!comm) return ncclSuccess;
  comm_state *s = comm->st.get();
  if (s->pending.load() > 0 && !s->aborted.load())
    fy_emu_fail("nccl: ncclCommDestroy with %lld collectives not finished (call ncclCommFinalize first)",
                (long long)s->pending.load());
  s->aborted = true;  // an init thread still waiting gives up
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (!comm) return ncclSuccess;
  comm->st->aborted = true;  // collectives waiting for peers return; queued ones do nothing
  shm_unlink(comm->st->name.c_str());  // still there when a rank never came
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, ncclDataType_t t, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t stream) {
  const size_t b = count * type_size(t);
  return enqueue(comm, OP_ALL_REDUCE, send, recv, count, t, op, 0, b, b, stream);
}

ncclResult_t ncclReduceScatter(const void *send, void *recv, size_t count, ncclDataType_t t, ncclRedOp_t op,
                               ncclComm_t comm, cudaStream_t stream) {
  const size_t b = count * type_size(t), n = comm ? (size_t)comm->st->nranks : 1;
  return enqueue(comm, OP_REDUCE_SCATTER, send, recv, count, t, op, 0, n * b, b, stream);
}

ncclResult_t ncclAllGather(const void *send, void *recv, size_t count, ncclDataType_t t, ncclComm_t comm,
                           cudaStream_t stream) {
  const size_t b = count * type_size(t), n = comm ? (size_t)comm->st->nranks : 1;
  return enqueue(comm, OP_ALL_GATHER, send, recv, count, t, ncclSum, 0, b, n * b, stream);
}

ncclResult_t ncclBroadcast(const void *send, void *recv, size_t count, ncclDataType_t t, int root, ncclComm_t comm,
                           cudaStream_t stream) {
  const size_t b = count * type_size(t);
  const bool is_root = comm && comm->st->rank == root;
  return enqueue(comm, OP_BROADCAST, is_root ? send : recv, recv, count, t, ncclSum, root, is_root ? b : 0, b, stream);
}

}  // extern "C"
