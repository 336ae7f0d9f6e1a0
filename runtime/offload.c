#include "runtime/offload.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "memory/cache.h"
#include "memory/device_cache.h"
#include "ops/cuda/parts.h"
#include "ops/ops.h"
#include "runtime/ep.h"


// One chunk's part of the optimizer, as a host function on the optimizer stream.
struct chunk_job {
  struct fy_offload *x;
  int chunk;
  int q;  // which step arguments
  // The update's gradients and, with 16-bit compute, the copy it writes the next weights to, taken
  // when the update is enqueued (with --optimizer-lag the buffers change roles every step).
  const void *grads;
  void *copy;
};

// A speculative update (spec_fn): its buffers taken when it is enqueued, because the host may swap
// the chunk's and its slot's (spec_settle) before it runs.
struct spec_job {
  struct fy_offload *x;
  int chunk, q;
  const float *w;
  const void *m, *v, *grads;
  float *w_out, *m_out, *v_out;
  void *c_out;
};

struct step_args {
  struct fy_adamw h;
  float lr, scale, grad_scale;
  int64_t t;
  double norm;
  bool skip;  // the norm is not finite: no chunk is updated
};

struct fy_offload {
  struct fy_model *m;
  struct fy_device *dev;
  fy_stream *compute, *copy_in, *copy_out, *optim;
  // Where the gradients' sums of squares and the norm run: the optimizer stream, or with the lag a
  // stream of their own (`sums`), so that step s's norm is known as soon as its gradients are home
  // instead of after step s-1's updates queued on the optimizer stream (which read and write the
  // other copies). The host waits for that norm before it enqueues step s+1.
  fy_stream *sums, *norm_stream;
  struct fy_device_cache *cache;
  struct fy_trace *trace;
  struct fy_action *actions;
  int n_actions, n_blocks, prefetch, max_micro;
  int64_t pos;
  // Per parity of the micro-batch: the op calls and the batch, reused every other pass.
  struct fy_op_call *calls[2];
  struct fy_dev_batch dbatch[2];
  int32_t *dbatch_mem[2], *staging[2];
  fy_event *batch_ready[2], *pass_done[2];
  int parity;
  double *loss_sums;  // per micro-batch of the step
  // Per chunk.
  const float **home;  // where the cache loads a chunk from: the master weights, or chome
  // 16-bit compute (m->compute_dtype): each chunk's weights in that dtype, esize bytes an element
  // (bf16 on a GPU, rounded floats on sim), written from the fp32 master by every AdamW update and
  // rebuilt whole after the master was set from outside (m->cparams_fresh false). The blocks hold
  // them, and the kernels write the gradients over them in that dtype. fp32: chome is NULL and
  // esize 4. With one micro-batch a step the gradients come home as they are, over the copy
  // (docs/design.md: gradients written over the compute payload), for the chunks whose state is in the
  // host tier; the update reads them there and writes the next weights in their place (a skipped
  // step rebuilds the copy from the master). Otherwise they are widened into fp32 gradients.
  void **chome;
  size_t esize;
  fy_event **home_ready, **grad_ready;
  float *wb_staging;
  int *param_first, *param_ids;  // params of chunk c: param_ids[param_first[c] .. param_first[c+1])
  int *grad_order;  // the chunks in the order a backward pass completes their gradients
  // Gradients and optimizer state: in the host tier, or for the last n_disk_chunks on disk.
  // m and v are stored in the format sf (ops/ops.h): one moment of a chunk is a buffer of
  // fy_state_moment_bytes(sf, n) bytes for its n = state_elems(x, c) elements (floats in
  // FY_STATE_F32), in a slot of mb bytes (n = S) wherever it lives: host tier, disk, the optimizer
  // stream's disk buffers; a device chunk's in one of fy_state_moment_bytes(sf, chunk_elems).
  enum fy_state_format sf;
  size_t mb;
  float **g_home, **m_home, **v_home;  // host tier, NULL for disk chunks (m, v: mb-byte slots)
  float *m_all, *v_all;  // m_home and v_home of the host tier's chunks, one after the other
  int64_t *disk_handle;           // disk chunks: (fp32 gradients, S floats,) m, v (mb bytes each; disk_off)
  // Compressed state: each chunk's parameters as ranges of its state buffer (sorted; the update
  // takes them all at once, so that a block two parameters share is quantised once), their
  // weight decay written by the update; a GPU's device chunks keep a copy in device memory.
  struct fy_adamw_range **ranges, **dev_ranges;
  int *n_ranges;
  bool dev_ranges_set;  // dev_ranges hold the weight decay dev_ranges_wd
  float dev_ranges_wd;
  struct fy_disk_tier *disk;
  // The optimizer stream's host buffers for disk chunks: fp32 gradients, and two sets of m and v
  // (disk chunk i uses set i % 2: the next one's are read while this one is updated and written).
  float *disk_g, *disk_m[2], *disk_v[2];
  float *wb_disk, *wb_disk_sum;     // host buffers for writing back one disk chunk (copy stream)
  struct fy_disk_req *req_g, *req_m[2], *req_v[2], *req_wb;
  // fy_offload_opts.disk_master: the disk chunks' fp32 master weights are in their slot after m and
  // v (disk_off 3, S floats), read into disk_w[set] with m and v and written back with them; the
  // host tier holds no master for them (w_home[c] NULL).
  bool disk_master;
  float *disk_w[2];
  struct fy_disk_req *req_w[2];
  int disk_read_ahead;              // the disk chunk whose m and v are being read ahead, or -1
  struct disk_wb { struct fy_offload *x; int chunk; bool accumulate; } *wb_jobs;  // per chunk
  int n_disk_chunks;
  // The first n_dev chunks live on the device for good: the fp32 master weights, with 16-bit
  // compute their copy in the compute dtype (dev_w16, esize bytes an element: what the kernels
  // read, rewritten by every update), this micro-batch's gradients (in the compute payload's
  // dtype, esize bytes an element), their fp32 sum over micro-batches (with accumulation), m and v.
  int n_dev;
  float **dev_w, **dev_g, **dev_acc, **dev_m, **dev_v, **dev_w16;
  int *dev_bwd_done;
  bool dev_uploaded;
  fy_event *dev_sumsq_done, *dev_updates_done[2];
  struct accumulate_job { float *dst; const float *src; int64_t n; } *dev_acc_jobs;  // per chunk
  // Their optimizer works on device memory, on the compute stream: the parameters' sums of squares
  // go to dev_sums and reach the norm through host_sums; each step's gradient scale and skip flag
  // come back from the norm through host_scale[2q..] to dev_scale[2q..] (both copies on the
  // compute stream, through the copy engine). On a GPU the work is the kernels' (m->kernels->
  // chunk_*, launched by this thread); elsewhere host functions on that stream do it.
  double *dev_sums, *host_sums;
  // On a GPU, with the gradients coming home over the 16-bit copies (one micro-batch a step, not
  // sharded), every chunk's sums of squares are taken from its block on the compute stream before
  // it goes home (a few microseconds a chunk at the device's memory rate) instead of on the host
  // after it arrived: the norm is known as soon as the last block is summed, not after the host
  // has read every gradient again. The same kernels as the device chunks', so the same bits.
  bool sums_on_device;
  float *dev_scale, *host_scale;
  double *sumsq;                  // per parameter
  struct chunk_job *jobs[2];
  struct step_args args[2];
  fy_event *norm_ready, *updates_done[2];
  int step_parity;
  // The one-step-delayed update (fy_offload_opts.optimizer_lag): the gradients of step s update the
  // weights while step s+1 runs on the weights before them. Each host or disk chunk has two 16-bit
  // copies that swap roles every step: the one step s read takes its gradients and becomes the
  // weights after them (AdamW on the optimizer stream, under step s+1), while step s+1 reads the
  // other, which the update of step s-1 wrote. chome_alt and home_ready_alt are the copies and
  // their events not in use this step. Device chunks keep their gradients of step s in dev_gl
  // (dev_pending) and are updated by the next fy_offload_update, after step s+1's passes, or by
  // fy_offload_drain.
  // Speculative updates (fy_offload_opts.spec_chunks): n_spec host-tier chunks, the first in
  // grad_order (spec_chunk[k], ascending in k by grad order; spec_slot[c] is k, or -1), are
  // updated as soon as their gradients are home, with an unclipped step's scale, out of place
  // into spare slot k (spare_w: master, spare_m/spare_v: m and v at the stored size, spare_c: the
  // 16-bit copy), spec_done[k] recorded after. The norm then settles them (spec_settle): kept, the
  // slot's buffers and the chunk's swap roles (and spec_done[k] becomes the chunk's home_ready);
  // else the chunk is updated again in place from its untouched buffers. The chunk's master
  // weights are its own (own_weights) so that they can swap. spare_m_all, spare_v_all: the
  // spare moments' allocations (m_home and spare_m point into it and into m_all, in any order).
  int n_spec;
  int *spec_chunk, *spec_slot;
  float **spare_w, **spare_m, **spare_v;
  void **spare_c;
  float *spare_m_all, *spare_v_all;
  fy_event **spec_done;
  struct spec_job *spec_jobs[2];     // per step parity, as jobs
  bool spec_off_next;                 // the last step clipped or skipped: the next does not speculate
  int64_t spec_steps, spec_redone;    // steps that speculated, and those whose norm had them redone
  // Device updates (fy_offload_opts.device_updates): n_dup host-tier chunks (dup_chunk[i], the
  // first in chunk order neither speculated nor on disk; dup_slot[c] is i, or -1) updated by the
  // device after the norm, in pieces of at most dup_piece_elems elements (fy_chunk_piece_elems of
  // S): dup_pieces[0 .. n_pieces), chunk by chunk in order. The step's piece p goes through staging
  // set p % 2 in device memory (dup_w: master, dup_m, dup_v: m and v at the stored size, dup_g: the
  // gradients as the host tier holds them, dup_w16: the next 16-bit copy; each of a piece): copied
  // in on dup_up, updated on dup_run (kernels, or host functions on sim, reading the step's scale
  // and skip flag from dup_scale), copied home on dup_down, where each of the set's buffers'
  // dup_free (master, m, v, 16-bit copy: the next piece of the set waits for each buffer alone)
  // and, after a chunk's last piece, the chunk's home_ready are recorded.
  int n_dup, n_pieces;
  int *dup_chunk, *dup_slot;
  int64_t dup_piece_elems;
  struct dup_piece {
    int chunk;
    int64_t off, n;  // the chunk's elements [lo + off, lo + off + n): of its part (span) from x->lo
    // Compressed state: the parameters' ranges in the piece (as chunk_ranges': weight decay 1
    // where it applies, then as many again for the step's decay), and on a GPU a copy there.
    int n_ranges;
    struct fy_adamw_range *ranges, *dev_ranges;
  } *dup_pieces;
  fy_stream *dup_up, *dup_run, *dup_down;
  float *dup_w[2], *dup_m[2], *dup_v[2];
  void *dup_g[2], *dup_w16[2];
  fy_event *dup_in[2], *dup_ran[2], *dup_free[2][4], *dup_done[2];  // dup_done: a step's (parity) last copy home
  float *dup_scale;
  struct dup_job { struct fy_offload *x; int piece, q; } *dup_jobs[2];  // per step parity, as jobs
  bool profiling;  // fy_offload_profile
  bool lag, dev_pending;
  int dev_pending_q;
  void **chome_alt;
  fy_event **home_ready_alt;
  float **dev_gl;
  // --profile: the compute stream's timed waits (core/wait_profile.h; NULL where the device has
  // no timers), and what a load's wait for home_ready is charged to: the disk's chunks, the disk.
  struct fy_wait_profile *wprof;
  enum fy_stall *home_cause;
  // Chunk sharding (fy_offload_opts.comm): this rank keeps elements [lo, lo + S) of every chunk;
  // without sharding lo = 0 and S = chunk_elems. slot: floats of each per-chunk state buffer.
  // own_weights (sharding, or disk_master): the engine keeps each chunk's master weights itself
  // (w_home, or on disk), taken from the model's whole buffer (taken) or set by set_shards.
  bool sharded, shards_on_device, taken, own_weights;
  bool forward_only;  // evaluation: forward passes alone, no gradients or AdamW state
  // Forward-only in 16 bits from a model without fp32 weights (unsharded): the 16-bit copies
  // (chome) are the weights, set by fy_offload_set_shards (2 bytes a parameter in host memory).
  bool weights16;
  int rank, world;
  int64_t lo, S;
  // One communicator per stream that runs collectives: the blocks' (copy_in, copy_out; of
  // block_comm) and the optimizer's (host memory; of comm, also for gathering the state).
  struct fy_comm *c_gather, *c_scatter, *c_optim;
  struct fy_comm *c_optim_tp;  // tensor parallelism: the optimizer stream's tensor-parallel group
  float **w_home;       // own_weights: this rank's weights of each chunk (S floats; NULL: on disk)
  float *gather_buf;    // sharded: chunk_elems floats for fy_offload_state_out
  int64_t device_state_bytes;  // device memory the shards took (the device's counter, before/after)
  // Mixtures of experts (FY_OP_MOE; "loading the experts that got tokens" below): per op, where
  // its experts' weights lie in its chunk and which are in the chunk's block; per chunk, its loads
  // from home so far; the experts' parts loaded and those a whole chunk's loads would have moved.
  struct moe_load *moe;
  int64_t *home_loads;
  int64_t expert_loads, expert_parts;
  float *route_host;      // the router's output of the op at hand, copied from the device
  fy_event *moe_routed;
  double *aux_sums;       // per micro-batch: the load-balancing terms (struct fy_loss's aux_sum)
  // Mixtures in sharded chunks ("expert parallelism over sharded chunks" below; ep_P 1 without
  // --ep): this rank holds experts [ep_rank E/ep_P, (ep_rank + 1) E/ep_P) of every mixture; per chunk,
  // its mixtures' expert ranges (ep_cut[c], ep_n[c] of them: start, end, the ep rank holding them),
  // and the ranged gather's and scatter's buffers (chunk_elems floats each).
  bool ep_ranged;
  int ep_P, ep_rank;
  int *ep_n, *ep_E;  // per chunk: its expert ranges, the experts of its mixtures
  int64_t (**ep_cut)[3];
  float *ep_buf[4];  // gather: send, receive; scatter: send, receive
  int64_t *ep_counts;  // 5 x world: the gather's floats sent and received a rank, the scatter's, its offsets
  struct fy_comm *c_mask;  // the host thread's: which experts each rank's tokens chose (ep_experts)
  float *ep_masks;         // world x the most experts of a mixture: those choices
  // A pipeline stage (fy_offload_opts.stage_hi): the actions are those of ops [stage_lo, stage_hi),
  // [0, n_fwd) the forward's and the rest the backward's; c_stage takes the norm's sum over the
  // stages and the tied embedding's gradient (tied: the parameter read by this stage and another,
  // or -1). norm_skip: the parameters another stage counts in the norm (the tied one on the last);
  // zero_first: those whose first gradient of a backward another stage writes, so this stage's
  // part starts from zero (the tied one on the first), zeroed[] this half-pass.
  // tied_sumsq: the tied gradient's sum of squares after sum_tied, where sums_on_device took it
  // of one end's part (tied_sumsq_set; the norm reads it instead).
  // boundary: recorded on the compute stream right after a half-pass's last action (the op that
  // writes the activation leaving the stage, or the gradient of the one entering it), before what
  // follows it there (its chunks' releases, a device chunk's sum over micro-batches): what a
  // stage's message waits for (fy_offload_stage_pass).
  bool staged;
  int stage_lo, stage_hi, n_fwd, tied;
  struct fy_comm *c_stage;
  fy_event *boundary;
  bool *norm_skip, *zero_first, *zeroed;
  bool tied_sumsq_set;
  double tied_sumsq;
  // The first error a host function met (its message: fy_error is per thread).
  pthread_mutex_t err_lock;
  fy_status async_st;
  char async_msg[512];
};

// The model's kernels launch on a stream (a GPU's: runtime/engine_cuda.c) instead of running as
// host functions on it.
static bool launches_kernels(const struct fy_model *m) { return m->kernels->set_stream != NULL; }

// Bytes of one element of a chunk's compute payload (the blocks, the 16-bit copies).
static size_t payload_bytes(const struct fy_model *m) { return m->compute_dtype == FY_F32 ? 4 : m->cparams_esize; }

// The dtype a chunk's payload is stored in: the compute dtype with 2-byte elements (a GPU's
// bf16), f32 otherwise (fp32 compute, or sim's 16-bit values as rounded floats).
static enum fy_dtype payload_dtype(const struct fy_offload *x) { return x->esize == 2 ? x->m->compute_dtype : FY_F32; }

// dst (n payload elements) <- master weights src (n) in the compute dtype.
static void to_payload(const struct fy_offload *x, void *dst, const float *src, int64_t n) {
  if (x->esize == 4)  // rounded floats (sim)
    fy_round_to_dtype(dst, src, x->m->compute_dtype, (size_t)n);
  else
    fy_convert_from_f32(dst, x->m->compute_dtype, src, (size_t)n);
}

// Elements of chunk c this rank keeps: its shard, or without sharding the chunk's used part.
static int64_t span(const struct fy_offload *x, int c) { return x->sharded ? x->S : x->m->layout->chunks[c].used; }

// Where chunk c's weights live at home: this rank's shard, or the chunk in the model's buffer.
static float *home_weights(const struct fy_offload *x, int c) {
  return x->own_weights ? x->w_home[c] : x->m->params + (int64_t)c * x->m->layout->chunk_elems;
}

// Chunk c's master weights live on disk (disk_master: a disk chunk's).
static bool master_on_disk(const struct fy_offload *x, int c) {
  return x->disk_master && c >= x->m->layout->n_chunks - x->n_disk_chunks;
}

// The 16-bit copy of chunk c's elements [lo, hi) <- the master weights there, in the compute dtype.
// Both hold this rank's part of the chunk, S elements from element x->lo: its shard, or without
// sharding the whole chunk (lo 0).
// copy is chunk c's 16-bit copy: chome[c], or with --optimizer-lag either of its two; master the
// chunk's master weights there (home_weights, or a disk chunk's as read into a buffer).
static void compute_copy(struct fy_offload *x, void *copy, const float *master, int64_t lo, int64_t hi) {
  to_payload(x, (char *)copy + (size_t)(lo - x->lo) * x->esize, master + (lo - x->lo), hi - lo);
}

static fy_status master_read(struct fy_offload *x, int c, float *dst);

// The whole copy of chunk c that this rank keeps (its shard, padding included, or the used part),
// from its master weights (read from disk into buf, S floats, where they live there).
static fy_status compute_copy_all(struct fy_offload *x, void *copy, int c, float *buf) {
  const float *w = home_weights(x, c);
  if (master_on_disk(x, c)) {
    FY_TRY(master_read(x, c, buf));
    w = buf;
  }
  compute_copy(x, copy, w, x->lo, x->lo + span(x, c));
  return FY_OK;
}

// The chunks whose gradients, m and v live in the host tier: n_dev .. nc - n_disk_chunks - 1.
static size_t host_chunks(const struct fy_offload *x) {
  return (size_t)(x->m->layout->n_chunks - x->n_dev - x->n_disk_chunks);
}

bool fy_offload_grads_in_copy(enum fy_dtype compute, int max_micro) { return compute != FY_F32 && max_micro <= 1; }

// Chunk c's gradients come home over its 16-bit copy, not into fp32 gradients (the chunks whose
// state is in the host tier or on disk).
static bool grads_in_copy(const struct fy_offload *x, int c) {
  return fy_offload_grads_in_copy(x->m->compute_dtype, x->max_micro) && c >= x->n_dev;
}

// A disk chunk's slot: its fp32 gradients (which 0, S floats; none when they come home over the
// 16-bit copy), m (1) and v (2), mb bytes each, and with disk_master its fp32 master weights (3, S
// floats), one after the other.
static size_t disk_off(const struct fy_offload *x, int c, int which) {
  size_t g = grads_in_copy(x, c) ? 0 : (size_t)x->S * 4;
  return which == 0 ? 0 : g + (size_t)(which - 1) * x->mb;
}

// The bytes of a disk chunk's slot.
static size_t disk_slot(const struct fy_offload *x, int c) {
  return disk_off(x, c, 3) + (x->disk_master ? (size_t)x->S * 4 : 0);
}

// The elements of chunk c's m and v buffers: a device chunk's used ones, else span (its shard, or
// the used part of the chunk).
static int64_t state_elems(const struct fy_offload *x, int c) {
  return c < x->n_dev ? x->m->layout->chunks[c].used : span(x, c);
}

// The bytes chunk c's m (or v) takes where it is stored.
static size_t state_bytes(const struct fy_offload *x, int c) { return fy_state_moment_bytes(x->sf, state_elems(x, c)); }

// Waits for the disk chunks' m and v requests in flight; the first error.
static fy_status disk_drain(struct fy_offload *x) {
  fy_status st = FY_OK;
  struct fy_disk_req *r[] = {x->req_m[0], x->req_v[0], x->req_m[1], x->req_v[1], x->req_w[0], x->req_w[1]};
  for (int i = 0; i < 6; i++) {
    fy_status w = r[i] ? fy_disk_wait(r[i]) : FY_OK;
    if (st == FY_OK) st = w;
  }
  return st;
}

// The dtype of the gradients the optimizer reads for chunk c (chunk_grads): the compute dtype
// where they stay as the kernels wrote them (bf16 on a GPU; sim's 16-bit values are rounded
// floats), fp32 once widened or summed over micro-batches.
static enum fy_dtype grads_dtype(const struct fy_offload *x, int c) {
  bool raw = c < x->n_dev ? x->max_micro <= 1 : grads_in_copy(x, c);
  return raw ? payload_dtype(x) : FY_F32;
}

// Chunk c's gradients come home over its copy in bf16 (read there by the host's norm and AdamW).
static bool grads_bf16(const struct fy_offload *x, int c) { return c >= x->n_dev && grads_dtype(x, c) == FY_BF16; }

// The bytes of a device chunk's buffer i (dev_bufs order: w, g, acc, m, v, w16).
static size_t dev_buf_bytes(const struct fy_offload *x, int i) {
  if (i == 3 || i == 4) return fy_state_moment_bytes(x->sf, x->m->layout->chunk_elems);
  size_t e = i == 1 || i == 5 ? x->esize : 4;
  return (size_t)x->m->layout->chunk_elems * e;
}

static void async_fail(struct fy_offload *x, fy_status st) {
  pthread_mutex_lock(&x->err_lock);
  if (x->async_st == FY_OK) {
    x->async_st = st;
    snprintf(x->async_msg, sizeof x->async_msg, "%s", fy_error_msg());
  }
  pthread_mutex_unlock(&x->err_lock);
}

static fy_status async_status(struct fy_offload *x) {
  pthread_mutex_lock(&x->err_lock);
  fy_status st = x->async_st;
  if (st != FY_OK) fy_error_set(st, "%s", x->async_msg);
  pthread_mutex_unlock(&x->err_lock);
  return st;
}

// ---- sharding ----

// Per-chunk state buffers: the host tier, or with shards_on_device the device (zeroed either way).
static fy_status state_alloc(struct fy_offload *x, size_t bytes, float **out) {
  if (!x->shards_on_device) return fy_host_alloc(x->m->host, bytes, (void **)out);
  FY_TRY(fy_device_alloc(x->dev, bytes, (void **)out));
  return x->dev->ops->memset_async(x->copy_in, *out, 0, bytes);
}

static void state_free(struct fy_offload *x, float *p, size_t bytes) {
  if (!p) return;
  if (x->shards_on_device) fy_device_dealloc(x->dev, p, bytes);
  else fy_host_dealloc(x->m->host, p, bytes);
}

// The cache's hooks: on copy_in, the other ranks' shards of a chunk into the block (this rank's
// is there); on copy_out, the ranks' gradients summed into this rank's shard of the block.
// The blocks travel in the payload's dtype: fp32 (also sim's rounded 16-bit values) or a GPU's
// bf16, whose gradients the ranks then sum in bf16 (comm.h: in fp32, rounded once, for mpi).
static enum fy_reduce_dtype block_comm_dtype(const struct fy_offload *x) {
  return x->esize == 2 ? FY_COMM_BF16 : FY_COMM_F32;
}

static fy_status ep_enqueue(struct fy_offload *x, int chunk, float *block, fy_stream *s, bool scatter);

static fy_status gather_hook(void *ctx, int chunk, float *block, fy_stream *s) {
  struct fy_offload *x = ctx;
  if (x->ep_ranged && x->ep_n[chunk] > 0) return ep_enqueue(x, chunk, block, s, false);  // (ep_gather)
  char *b = (char *)block;
  return fy_comm_all_gather(x->c_gather, b + (size_t)x->lo * x->esize, b, (size_t)x->S, block_comm_dtype(x), s);
}

static fy_status scatter_hook(void *ctx, int chunk, float *block, fy_stream *s) {
  struct fy_offload *x = ctx;
  if (x->ep_ranged && x->ep_P > 1 && x->ep_n[chunk] > 0) return ep_enqueue(x, chunk, block, s, true);  // (ep_scatter)
  char *b = (char *)block;
  return fy_comm_reduce_scatter(x->c_scatter, b, b + (size_t)x->lo * x->esize, (size_t)x->S, block_comm_dtype(x), s);
}

// ---- the pass: actions and their chunk accesses ----


int fy_offload_min_blocks(const struct fy_model *m) { return fy_chunk_min_blocks(m->layout, m->graph->n_ops); }

// The device memory besides the cache's blocks, as the model and the engine allocate it
// (fy_graph_offload_buffers), each buffer counted as a device of that granule counts it, and on a
// GPU the kernels' scratch (cuBLASLt's workspace ...).
static size_t device_fixed_bytes(const struct fy_graph *g, const struct fy_opt_config *cfg, bool gpu) {
  const size_t gr = gpu ? FY_CUDA_ALLOC_GRANULE : FY_HOST_ALLOC_GRANULE;
  size_t bytes[FY_GRAPH_OFFLOAD_BUFS], sum = gpu ? fy_cuda_scratch_bytes(g->n_params, fy_graph_max_channels(g)) : 0;
  int n = fy_graph_offload_buffers(g, cfg->hidden_size, gpu, bytes);
  for (int i = 0; i < n; i++) sum += fy_device_round(bytes[i], gr);
  return sum;
}

static size_t min_device_bytes(const struct fy_model *m, bool gpu, size_t esize) {
  const size_t gr = gpu ? FY_CUDA_ALLOC_GRANULE : FY_HOST_ALLOC_GRANULE;
  return device_fixed_bytes(m->graph, &m->cfg, gpu) +
         (size_t)fy_offload_min_blocks(m) * fy_device_round((size_t)m->layout->chunk_elems * esize, gr);
}

size_t fy_offload_min_device_bytes(const struct fy_model *m) {
  return min_device_bytes(m, m->dev->kind == FY_DEVICE_CUDA, payload_bytes(m));
}

fy_status fy_offload_plan_min_bytes(const struct fy_opt_config *cfg, int64_t B, int64_t T, int tp, bool recompute,
                                    bool forward_only, bool gpu, size_t elem_bytes, int64_t chunk_elems,
                                    size_t *min_bytes, int64_t *chunk_elems_out) {
  struct fy_model m = {.cfg = *cfg};
  FY_TRY(fy_opt_build_graph_tp(cfg, B, T, tp > 1 ? tp : 1, 0, &m.graph));
  if (gpu) fy_graph_set_flash_attention(m.graph, true);
  if (recompute) fy_graph_set_recompute(m.graph, true);
  if (forward_only) fy_graph_set_forward_only(m.graph);
  fy_status st16 = elem_bytes == 2 ? fy_graph_set_act16(m.graph, true) : FY_OK;  // a GPU's bf16 activations
  if (st16 != FY_OK) {
    fy_graph_free(m.graph);
    return st16;
  }
  if (chunk_elems <= 0) chunk_elems = fy_chunk_min_elems(m.graph);
  fy_status st = fy_chunk_layout_create(m.graph, chunk_elems, &m.layout);
  if (st == FY_OK) {
    *min_bytes = min_device_bytes(&m, gpu, elem_bytes);
    *chunk_elems_out = m.layout->chunk_elems;
  }
  fy_chunk_layout_free(m.layout);
  fy_graph_free(m.graph);
  return st;
}

// ---- mixture of experts: loading the experts that got tokens ----
//
// A mixture's experts are stacked in four parameters (fc1's and fc2's weights and biases, expert e
// at rows e of each), which the layout packs in one chunk with its router. Expert e's weights are
// four ranges of that chunk, its "expert chunk": a load of the chunk from home copies everything
// but the experts' ranges (moe_load_home); before the op's kernel runs, its router runs alone on
// the compute stream, the host reads which experts got tokens, and only their ranges are copied
// into the block (moe_experts). The other experts' ranges of the block hold whatever was there:
// their kernels read no weight of an expert without tokens and write its gradient, zero, over it,
// so the write-back brings every expert's gradient home and AdamW updates every expert as the
// cpu does. Backward (and recomputation) reuses its micro-batch's forward's choice (kept per
// micro-batch: a pipeline stage runs other micro-batches' forwards between one's forward and its
// backward): the experts loaded are still in the block unless the chunk was loaded again from home
// since (home_loads), and then they are loaded again. On a GPU the router is the kernels'
// (kernels->moe_route, launched on the compute stream; ops/cuda/moe.cu), the rest is the same: its
// choices come down, the used experts' ranges go up. An unsharded cache: sharded chunks (on sim)
// load their experts by need through ep_experts ("expert parallelism over sharded chunks" below).
struct moe_load {
  bool on;
  bool ep;  // sharded chunks: valid and used are per group of ep ranks (ep_experts)
  int chunk;
  int E;
  int64_t off[4], len[4];  // per stacked parameter: its offset in the chunk, an expert's elements
  int64_t gen;             // home_loads[chunk] when `valid` was last true of the block
  bool *valid, *used;      // per expert: its weights are in the block; (E per micro-batch) it got
                           // tokens in that micro-batch's forward
  struct moe_route_job {
    float *route;
    const float *inp, *gate;
    struct fy_moe_dims d;
    fy_status st;
  } job;
};

static void moe_route_fn(void *arg) {
  struct moe_route_job *j = arg;
  j->st = fy_moe_route(j->route, j->inp, j->gate, &j->d);
}

// The cache's hook: chunk c's load from home, leaving out the ranges of its mixtures' experts.
static fy_status ep_load_home(struct fy_offload *x, int c, void *block, fy_stream *s, bool *done);
static fy_status moe_load_home(void *ctx, int chunk, void *block, fy_stream *s, bool *done) {
  struct fy_offload *x = ctx;
  if (x->ep_ranged) return ep_load_home(x, chunk, block, s, done);  // (sharded: the dense elements)
  const struct fy_graph *g = x->m->graph;
  int64_t cut[4 * g->n_ops + 1][2];  // [start, end) of the stacked parameters in the chunk, sorted
  int n = 0;
  x->home_loads[chunk]++;
  for (int o = 0; o < g->n_ops; o++) {
    const struct moe_load *ml = &x->moe[o];
    if (!ml->on || ml->chunk != chunk) continue;
    x->expert_parts += ml->E;
    for (int k = 0; k < 4; k++)
      if (ml->len[k] > 0) cut[n][0] = ml->off[k], cut[n][1] = ml->off[k] + ml->len[k] * ml->E, n++;
  }
  if (n == 0) return FY_OK;
  for (int i = 1; i < n; i++)  // (insertion sort: a few ranges, 4 a mixture in the chunk)
    for (int j = i; j > 0 && cut[j][0] < cut[j - 1][0]; j--) {
      int64_t t0 = cut[j][0], t1 = cut[j][1];
      cut[j][0] = cut[j - 1][0], cut[j][1] = cut[j - 1][1];
      cut[j - 1][0] = t0, cut[j - 1][1] = t1;
    }
  const char *home = (const char *)x->home[chunk];
  int64_t at = 0;
  for (int i = 0; i <= n; i++) {
    int64_t end = i < n ? cut[i][0] : x->m->layout->chunks[chunk].used;
    if (end > at) FY_TRY(fy_copy_async(s, (char *)block + at * x->esize, home + at * x->esize, (size_t)(end - at) * x->esize));
    if (i < n && cut[i][1] > at) at = cut[i][1];
  }
  *done = true;
  return FY_OK;
}

// Which ops are mixtures whose experts load by need, and where their experts lie.
static fy_status moe_setup(struct fy_offload *x) {
  const struct fy_graph *g = x->m->graph;
  bool any = false;
  if (!(x->aux_sums = calloc((size_t)x->max_micro, sizeof *x->aux_sums)) ||
      !(x->moe = calloc((size_t)g->n_ops, sizeof *x->moe)) ||
      !(x->home_loads = calloc((size_t)x->m->layout->n_chunks, sizeof *x->home_loads)))
    return fy_error_set(FY_ERR_NOMEM, "out of memory");
  int64_t route_max = 0;
  for (int o = 0; o < g->n_ops; o++) {
    const struct fy_op *op = &g->ops[o];
    if (op->kind != FY_OP_MOE || x->sharded || (launches_kernels(x->m) && !x->m->kernels->moe_route)) continue;
    struct moe_load *ml = &x->moe[o];
    const int b = op->has_bias;
    const int ids[4] = {op->params[1], b ? op->params[2] : -1, op->params[2 + b], b ? op->params[4] : -1};
    ml->chunk = g->params[op->params[0]].chunk;
    if (ml->chunk < x->n_dev) continue;  // (kept on the device with all its experts)
    ml->E = op->experts;
    for (int k = 0; k < 4; k++) {
      if (ids[k] < 0) continue;
      const struct fy_param *p = &g->params[ids[k]];
      FY_ASSERT(p->chunk == ml->chunk);  // (an op's first-use group is one chunk)
      ml->off[k] = p->chunk_offset;
      ml->len[k] = p->numel / ml->E;
    }
    ml->gen = -1;
    if (!(ml->valid = calloc((size_t)ml->E, sizeof *ml->valid)) ||
        !(ml->used = calloc((size_t)ml->E * (size_t)x->max_micro, sizeof *ml->used)))
      return fy_error_set(FY_ERR_NOMEM, "out of memory");
    ml->on = any = true;
    const int64_t r = g->B * g->T * (op->experts + 3 * op->top_k);
    if (r > route_max) route_max = r;
  }
  if (!any) return FY_OK;
  FY_TRY(fy_event_create(x->dev, &x->moe_routed));
  if (!(x->route_host = malloc((size_t)route_max * 4))) return fy_error_set(FY_ERR_NOMEM, "out of memory");
  return FY_OK;
}

static void moe_free(struct fy_offload *x) {
  for (int o = 0; x->moe && o < x->m->graph->n_ops; o++) {
    free(x->moe[o].valid);
    free(x->moe[o].used);
  }
  free(x->moe);
  free(x->home_loads);
  free(x->route_host);
  free(x->aux_sums);
  fy_event_free(x->moe_routed);
}

// Mixture op act->op's router alone on the compute stream, its routing record copied to the host
// (route_host) and waited for.
static fy_status moe_route_host(struct fy_offload *x, const struct fy_action *act, const struct fy_op_call *call) {
  struct moe_load *ml = &x->moe[act->op];
  struct fy_model *m = x->m;
  const struct fy_graph *g = m->graph;
  const struct fy_op *op = &g->ops[act->op];
  const int64_t BT = g->B * g->T, S = op->experts + 3 * op->top_k;
  ml->job = (struct moe_route_job){.route = fy_engine_act(m, op->aux[0]), .inp = fy_engine_act(m, op->in[0]),
                                   .gate = call->w[0],
                                   .d = {.BT = BT, .C = op->C, .F = op->OC, .E = op->experts, .K = op->top_k}};
  if (launches_kernels(m)) {  // the GPU's router, its routing record copied down after it
    ml->job.d.BT = fy_op_call_rows(call);
    FY_TRY(m->kernels->moe_route(m, act->op, call->w[0], ml->job.d.BT));
  } else {
    FY_TRY(fy_stream_enqueue(x->compute, moe_route_fn, &ml->job));
  }
  FY_TRY(fy_copy_async(x->compute, x->route_host, ml->job.route, (size_t)(ml->job.d.BT * S) * 4));
  FY_TRY(fy_event_record(x->moe_routed, x->compute));
  FY_TRY(fy_event_sync(x->moe_routed));
  return ml->job.st;
}

// The experts the routing record in route_host chose for some token: chosen[e] set (not cleared).
static void moe_chosen(const struct fy_offload *x, int o, bool *chosen) {
  const struct fy_op *op = &x->m->graph->ops[o];
  const int64_t S = op->experts + 3 * op->top_k;
  for (int64_t t = 0; t < x->moe[o].job.d.BT; t++)
    for (int j = 0; j < op->top_k; j++) chosen[(int)x->route_host[t * S + op->experts + j]] = true;
}

// Before mixture op act->op's kernel, its block at `block` (acquired): in forward (and when
// recomputed), its router alone, then the host reads which experts got tokens; the weights of
// those not in the block yet are loaded into it, and the compute stream waits for them.
static fy_status ep_experts(struct fy_offload *x, const struct fy_action *act, const struct fy_op_call *call,
                            int micro, float *block);
static fy_status moe_experts(struct fy_offload *x, const struct fy_action *act, const struct fy_op_call *call,
                             int micro, float *block) {
  struct moe_load *ml = &x->moe[act->op];
  if (ml->ep) return ep_experts(x, act, call, micro, block);
  if (!ml->on) return FY_OK;
  bool *used = ml->used + (size_t)micro * (size_t)ml->E;
  if (act->kind != FY_ACT_BACKWARD) {
    FY_TRY(moe_route_host(x, act, call));
    memset(used, 0, (size_t)ml->E * sizeof *used);
    moe_chosen(x, act->op, used);
  }
  if (ml->gen != x->home_loads[ml->chunk]) {  // loaded again from home: no expert is in the block
    memset(ml->valid, 0, (size_t)ml->E * sizeof *ml->valid);
    ml->gen = x->home_loads[ml->chunk];
  }
  const char *home = (const char *)x->home[ml->chunk];
  int n = 0;
  for (int e = 0; e < ml->E; e++) {
    if (!used[e] || ml->valid[e]) continue;
    for (int k = 0; k < 4; k++) {
      if (ml->len[k] == 0) continue;
      size_t at = (size_t)(ml->off[k] + e * ml->len[k]) * x->esize;
      FY_TRY(fy_copy_async(x->copy_in, (char *)block + at, home + at, (size_t)ml->len[k] * x->esize));
    }
    ml->valid[e] = true;
    n++;
  }
  if (n == 0) return FY_OK;
  x->expert_loads += n;
  FY_TRY(fy_event_record(x->moe_routed, x->copy_in));
  return fy_wait_timed(x->wprof, x->compute, x->moe_routed, FY_STALL_LOAD, -1, NULL);
}

// ---- expert parallelism over sharded chunks: each rank's experts ----
//
// Under --ep on sim every rank's graph keeps every expert (runtime/ep.c, "whole"), and a rank's
// mixture op reads and writes only its own experts' rows of the stacked parameters besides the
// router and the dense weights: experts [ep_rank El, (ep_rank + 1) El), El = E / ep_P, and of
// those only the ones that got rows from some rank of its group. So a load of a chunk with
// mixtures brings its dense elements alone: this rank's shard of them from home (ep_load_home),
// and instead of the all-gather an all-to-all in which every rank sends each other rank the dense
// parts of its shard (ep_gather); the experts come before the op, by need ("the experts that got
// tokens" below). The block's ranges of experts not loaded keep whatever was there; nothing reads
// them. The write-back's reduce-scatter is ranged (ep_scatter): each rank sends each shard's owner
// the parts it computed (the dense elements, its experts', zeros for those without rows), and the
// owner sums them in rank order as the reduce-scatter does, adding 0 to an expert's sum where the
// ranks that did not compute it added their zeros (x + 0 turns -0 into +0 and changes nothing
// else): the bits of the whole chunk's collectives, with 1/ep_P of the experts' gradients on the
// wire. Data-parallel rank q holds ep rank q % ep_P's experts (runtime/run.c: groups of ep_P
// consecutive ranks). Chunks without mixtures keep the whole-chunk collectives. Sharded ranks
// without --ep are the case ep_P 1: every rank one ep rank holding every expert, in a group of its
// own (it loads the experts its own tokens chose), with the whole reduce-scatter (every rank
// computes every expert its tokens chose).

// What is left of chunk c's elements [lo, hi) without the ranges of the experts that ep ranks
// other than j hold (EP_DENSE: without every expert's), in order, into out (ep_n[c] + 1 pieces at
// most); the number of pieces.
#define EP_DENSE (-2)
static int ep_pieces(const struct fy_offload *x, int c, int j, int64_t lo, int64_t hi, int64_t (*out)[2]) {
  int n = 0;
  int64_t at = lo;
  for (int i = 0; i < x->ep_n[c] && at < hi; i++) {
    const int64_t *k = x->ep_cut[c][i];
    if (k[2] == j || k[1] <= at) continue;
    if (k[0] >= hi) break;
    if (k[0] > at) out[n][0] = at, out[n][1] = k[0], n++;
    at = k[1];
  }
  if (at < hi) out[n][0] = at, out[n][1] = hi, n++;
  return n;
}

// Chunk c's elements [lo, hi) as runs of one kind, into out (start, end, and -1 for dense elements
// or the ep rank whose experts they are; 2 ep_n[c] + 1 runs at most); the number of runs.
static int ep_runs(const struct fy_offload *x, int c, int64_t lo, int64_t hi, int64_t (*out)[3]) {
  int n = 0;
  int64_t at = lo;
  for (int i = 0; i < x->ep_n[c] && at < hi; i++) {
    const int64_t *k = x->ep_cut[c][i];
    if (k[1] <= at) continue;
    if (k[0] >= hi) break;
    if (k[0] > at) out[n][0] = at, out[n][1] = k[0], out[n][2] = -1, n++;
    const int64_t end = k[1] < hi ? k[1] : hi;
    out[n][0] = k[0] > at ? k[0] : at, out[n][1] = end, out[n][2] = k[2], n++;
    at = end;
  }
  if (at < hi) out[n][0] = at, out[n][1] = hi, out[n][2] = -1, n++;
  return n;
}

// Copies the pieces (elements of the chunk) of src, which holds the chunk's elements from `base` on,
// to dst one after the other; the floats copied.
static int64_t ep_pack(float *dst, const float *src, int64_t base, const int64_t (*pc)[2], int n) {
  int64_t at = 0;
  for (int i = 0; i < n; i++) {
    memcpy(dst + at, src + (pc[i][0] - base), (size_t)(pc[i][1] - pc[i][0]) * 4);
    at += pc[i][1] - pc[i][0];
  }
  return at;
}

static int64_t ep_unpack(float *block, const float *src, const int64_t (*pc)[2], int n) {
  int64_t at = 0;
  for (int i = 0; i < n; i++) {
    memcpy(block + pc[i][0], src + at, (size_t)(pc[i][1] - pc[i][0]) * 4);
    at += pc[i][1] - pc[i][0];
  }
  return at;
}

static int64_t ep_count(const int64_t (*pc)[2], int n) {
  int64_t len = 0;
  for (int i = 0; i < n; i++) len += pc[i][1] - pc[i][0];
  return len;
}

// The load of chunk c's block, after the dense parts of this rank's shard came from home: the dense
// parts of the other ranks' shards (what it sends, from its shard at home).
static fy_status ep_gather(struct fy_offload *x, int c, float *block, const float *home) {
  const int W = x->world;
  int64_t pc[x->ep_n[c] + 1][2], *sc = x->ep_counts, *rc = sc + W;
  float *send = x->ep_buf[0], *recv = x->ep_buf[1];
  int64_t at = 0;
  for (int q = 0; q < W; q++) {  // this rank's shard: the parts rank q needs
    sc[q] = rc[q] = 0;
    if (q == x->rank) continue;
    sc[q] = ep_pack(send + at, home, x->lo, pc, ep_pieces(x, c, EP_DENSE, x->lo, x->lo + x->S, pc));
    at += sc[q];
    rc[q] = ep_count(pc, ep_pieces(x, c, EP_DENSE, (int64_t)q * x->S, (int64_t)(q + 1) * x->S, pc));
  }
  FY_TRY(fy_comm_all_to_all_v(x->c_gather, send, sc, recv, rc));
  at = 0;
  for (int q = 0; q < W; q++)
    if (q != x->rank)
      at += ep_unpack(block, recv + at, pc, ep_pieces(x, c, EP_DENSE, (int64_t)q * x->S, (int64_t)(q + 1) * x->S, pc));
  return FY_OK;
}

// The write-back of chunk c's block: this rank's shard <- the ranks' gradients summed, each element
// over the ranks that computed it, in rank order (comm.c's sum_f32: ((x0 + x1) + x2) ...).
static fy_status ep_scatter(struct fy_offload *x, int c, float *block) {
  const int W = x->world, P = x->ep_P;
  int64_t pc[x->ep_n[c] + 1][2], run[2 * x->ep_n[c] + 1][3];
  int64_t *sc = x->ep_counts + 2 * W, *rc = sc + W, *off = rc + W;
  float *send = x->ep_buf[2], *recv = x->ep_buf[3];
  int64_t at = 0, rat = 0;
  for (int q = 0; q < W; q++) {  // rank q's shard: the parts this rank computed; this rank's: those q did
    sc[q] = ep_pack(send + at, block, 0, pc, ep_pieces(x, c, x->ep_rank, (int64_t)q * x->S, (int64_t)(q + 1) * x->S, pc));
    at += sc[q];
    rc[q] = ep_count(pc, ep_pieces(x, c, q % P, x->lo, x->lo + x->S, pc));
    off[q] = rat;
    rat += rc[q];
  }
  FY_TRY(fy_comm_all_to_all_v(x->c_scatter, send, sc, recv, rc));
  const int n = ep_runs(x, c, x->lo, x->lo + x->S, run);
  for (int i = 0; i < n; i++) {
    const int64_t len = run[i][1] - run[i][0];
    const int j = (int)run[i][2];
    float *dst = block + run[i][0];
    bool first = true;
    for (int q = 0; q < W; q++) {
      if (j >= 0 && q % P != j) continue;  // (an expert's gradient: from the ranks holding it)
      const float *v = recv + off[q];
      off[q] += len;
      if (first) memcpy(dst, v, (size_t)len * 4);
      else
        for (int64_t e = 0; e < len; e++) dst[e] += v[e];
      first = false;
    }
    if (j >= 0)  // (the other ranks' zeros)
      for (int64_t e = 0; e < len; e++) dst[e] += 0.0f;
  }
  return FY_OK;
}

struct ep_job {
  struct fy_offload *x;
  int chunk;
  float *block;
  const float *home;  // (the gather's: home[chunk] when it was enqueued, as the cache's own copy reads it)
  bool scatter;
};

static void ep_fn(void *arg) {
  struct ep_job *j = arg;
  fy_status st = j->scatter ? ep_scatter(j->x, j->chunk, j->block) : ep_gather(j->x, j->chunk, j->block, j->home);
  if (st != FY_OK) async_fail(j->x, st);
  free(j);
}

// The gather or scatter hook of a chunk with mixtures: its host function on stream s (a job of its
// own: a chunk may be loaded again, or its block reused, before an earlier one ran).
static fy_status ep_enqueue(struct fy_offload *x, int chunk, float *block, fy_stream *s, bool scatter) {
  struct ep_job *j = malloc(sizeof *j);
  if (!j) return fy_error_set(FY_ERR_NOMEM, "out of memory");
  *j = (struct ep_job){.x = x, .chunk = chunk, .block = block, .home = x->home[chunk], .scatter = scatter};
  fy_status st = fy_stream_enqueue(s, ep_fn, j);
  if (st != FY_OK) free(j);
  return st;
}

// The cache's hook for a sharded load: this rank's shard from home, less every expert.
static fy_status ep_load_home(struct fy_offload *x, int c, void *block, fy_stream *s, bool *done) {
  if (x->ep_n[c] == 0) return FY_OK;
  int64_t pc[x->ep_n[c] + 1][2];
  const int n = ep_pieces(x, c, EP_DENSE, x->lo, x->lo + x->S, pc);
  x->home_loads[c]++;  // (no expert is in the block: ep_experts loads them)
  const char *home = (const char *)x->home[c];
  for (int i = 0; i < n; i++)
    FY_TRY(fy_copy_async(s, (char *)block + (size_t)pc[i][0] * x->esize, home + (size_t)(pc[i][0] - x->lo) * x->esize,
                         (size_t)(pc[i][1] - pc[i][0]) * x->esize));
  x->expert_parts += x->ep_E[c];
  *done = true;
  return FY_OK;
}

// ---- expert parallelism over sharded chunks: the experts that got tokens ----
//
// A load of a mixture's chunk brings its dense elements alone (ep_load_home, ep_gather). Before the
// op's kernel in forward (and when recomputed) its router runs alone (moe_route_host), and the ranks
// tell each other which experts their tokens chose (an all-gather of one flag an expert, on the host
// thread's communicator c_mask): an expert got rows if a rank of its group chose it. Each rank then
// needs its own experts that got rows and are not in its block yet, and every rank knows what every
// rank needs (the groups' `used` and `valid`, one flag an expert of each group: expert e of group g
// is one rank's), so one all-to-all on copy_in (ep_fetch) moves each needed expert's parts from the
// shards' owners; the rank's own part comes from its home over the link. Backward (and a chunk
// loaded again from home since the forward: every rank's cache loads alike) reuses the forward's
// choice, as one rank's loads by need do. An expert of this rank without rows is never read; its
// gradient, zero, is written by the kernels and summed by the ranged scatter as before.

// A needed expert e's ranges within [a, b) of op ml's chunk, in order (k = 0..3).
static int ep_expert_pieces(const struct moe_load *ml, int e, int64_t a, int64_t b, int64_t (*out)[2]) {
  int n = 0;
  for (int k = 0; k < 4; k++) {
    if (ml->len[k] == 0) continue;
    int64_t r0 = ml->off[k] + e * ml->len[k], r1 = r0 + ml->len[k];
    if (r0 < a) r0 = a;
    if (r1 > b) r1 = b;
    if (r0 < r1) out[n][0] = r0, out[n][1] = r1, n++;
  }
  return n;
}

struct ep_fetch_job {
  struct fy_offload *x;
  int op;
  float *block;
  const float *home;
  bool *need;  // world x E: rank q needs expert e
};

static fy_status ep_fetch(struct ep_fetch_job *j) {
  struct fy_offload *x = j->x;
  const struct moe_load *ml = &x->moe[j->op];
  const int W = x->world, E = ml->E, me = x->rank;
  int64_t pc[4][2], *sc = x->ep_counts, *rc = sc + W;
  float *send = x->ep_buf[0], *recv = x->ep_buf[1];
  int64_t at = 0;
  for (int q = 0; q < W; q++) {  // what rank q needs of this rank's shard; what this rank needs of q's
    sc[q] = rc[q] = 0;
    if (q == me) continue;
    for (int e = 0; e < E; e++) {
      if (j->need[q * E + e]) {
        const int64_t n = ep_pack(send + at, j->home, x->lo, pc, ep_expert_pieces(ml, e, x->lo, x->lo + x->S, pc));
        sc[q] += n, at += n;
      }
      if (j->need[me * E + e])
        rc[q] += ep_count(pc, ep_expert_pieces(ml, e, (int64_t)q * x->S, (int64_t)(q + 1) * x->S, pc));
    }
  }
  FY_TRY(fy_comm_all_to_all_v(x->c_gather, send, sc, recv, rc));
  at = 0;
  for (int q = 0; q < W; q++)
    for (int e = 0; q != me && e < E; e++)
      if (j->need[me * E + e])
        at += ep_unpack(j->block, recv + at, pc, ep_expert_pieces(ml, e, (int64_t)q * x->S, (int64_t)(q + 1) * x->S, pc));
  return FY_OK;
}

static void ep_fetch_fn(void *arg) {
  struct ep_fetch_job *j = arg;
  fy_status st = ep_fetch(j);
  if (st != FY_OK) async_fail(j->x, st);
  free(j->need);
  free(j);
}

static fy_status ep_experts(struct fy_offload *x, const struct fy_action *act, const struct fy_op_call *call,
                            int micro, float *block) {
  struct moe_load *ml = &x->moe[act->op];
  const int W = x->world, P = x->ep_P, G = W / P, E = ml->E, El = E / P;
  bool *used = ml->used + (size_t)micro * (size_t)(G * E);  // (per micro-batch, as moe_experts' choices)
  if (ml->gen != x->home_loads[ml->chunk]) {  // loaded again from home: no expert is in any rank's block
    memset(ml->valid, 0, (size_t)(G * E) * sizeof *ml->valid);
    ml->gen = x->home_loads[ml->chunk];
  }
  if (act->kind != FY_ACT_BACKWARD) {  // which experts each group's tokens chose
    FY_TRY(moe_route_host(x, act, call));
    bool *mine = used + (size_t)(x->rank / P) * E;  // (scratch until the all-gather's flags are read)
    memset(mine, 0, (size_t)E * sizeof *mine);
    moe_chosen(x, act->op, mine);
    float *flags = x->ep_masks + (size_t)x->rank * E;
    for (int e = 0; e < E; e++) flags[e] = mine[e] ? 1.0f : 0.0f;
    FY_TRY(fy_comm_all_gather(x->c_mask, flags, x->ep_masks, (size_t)E, FY_COMM_F32, NULL));
    memset(used, 0, (size_t)(G * E) * sizeof *used);
    for (int q = 0; q < W; q++)
      for (int e = 0; e < E; e++)
        if (x->ep_masks[(size_t)q * E + e] != 0.0f) used[(q / P) * E + e] = true;
  }
  bool *need = calloc((size_t)(W * E), sizeof *need);
  if (!need) return fy_error_set(FY_ERR_NOMEM, "out of memory");
  int any = 0, mine = 0;
  for (int q = 0; q < W; q++)
    for (int e = (q % P) * El; e < (q % P + 1) * El; e++) {
      const int ge = (q / P) * E + e;
      if (!used[ge] || ml->valid[ge]) continue;
      need[q * E + e] = true;
      any++;
      if (q == x->rank) mine++;
    }
  for (int q = 0; q < W; q++)
    for (int e = 0; e < E; e++)
      if (need[q * E + e]) ml->valid[(q / P) * E + e] = true;
  if (!any) {  // (every rank sees the same: no rank needs anything)
    free(need);
    return FY_OK;
  }
  // This rank's own parts of its needed experts from its shard at home, over the link; the rest
  // from the other ranks' shards.
  const float *home = x->home[ml->chunk];
  int64_t pc[4][2];
  for (int e = 0; e < E; e++) {
    if (!need[x->rank * E + e]) continue;
    const int n = ep_expert_pieces(ml, e, x->lo, x->lo + x->S, pc);
    for (int i = 0; i < n; i++) {
      fy_status st = fy_copy_async(x->copy_in, block + pc[i][0], home + (pc[i][0] - x->lo),
                                   (size_t)(pc[i][1] - pc[i][0]) * 4);
      if (st != FY_OK) {
        free(need);
        return st;
      }
    }
  }
  x->expert_loads += mine;
  struct ep_fetch_job *j = malloc(sizeof *j);
  if (!j) {
    free(need);
    return fy_error_set(FY_ERR_NOMEM, "out of memory");
  }
  *j = (struct ep_fetch_job){.x = x, .op = act->op, .block = block, .home = home, .need = need};
  fy_status st = fy_stream_enqueue(x->copy_in, ep_fetch_fn, j);
  if (st != FY_OK) {
    free(need);
    free(j);
    return st;
  }
  FY_TRY(fy_event_record(x->moe_routed, x->copy_in));
  return fy_wait_timed(x->wprof, x->compute, x->moe_routed, FY_STALL_LOAD, -1, NULL);
}

static int cut_cmp(const void *a, const void *b) {
  const int64_t x = ((const int64_t *)a)[0], y = ((const int64_t *)b)[0];
  return (x > y) - (x < y);
}

// Whether this engine's loads and write-backs are ranged (mixtures in chunks sharded on a
// host-memory device, the mpi communicator's all-to-all; with expert parallelism, or without it as
// one ep rank holding every expert, whose scatters stay whole), and each chunk's expert ranges.
static fy_status ep_setup(struct fy_offload *x) {
  struct fy_model *m = x->m;
  const struct fy_graph *g = m->graph;
  if (!x->sharded || launches_kernels(m) || x->esize != 4 || fy_comm_kind(x->c_gather) != FY_COMM_MPI) return FY_OK;
  int P = 1, r = 0;  // (without --ep every rank holds every expert: one ep rank, P 1)
  if (m->ep) {
    if (!m->ep_comm || g->ep > 1) return FY_OK;
    P = fy_comm_size(m->ep_comm), r = fy_comm_rank(m->ep_comm);
    if (P < 2 || x->world % P != 0 || x->rank % P != r) return FY_OK;  // (whole chunks)
  }
  const int nc = m->layout->n_chunks;
  x->ep_P = P;
  x->ep_rank = r;
  if (!(x->ep_n = calloc((size_t)nc, sizeof *x->ep_n)) || !(x->ep_E = calloc((size_t)nc, sizeof *x->ep_E)) ||
      !(x->ep_cut = calloc((size_t)nc, sizeof *x->ep_cut)))
    return fy_error_set(FY_ERR_NOMEM, "out of memory");
  for (int pass = 0; pass < 2; pass++) {  // count the ranges, then fill them in
    for (int o = 0; o < g->n_ops; o++) {
      const struct fy_op *op = &g->ops[o];
      // (a pipeline stage's engine: another stage's mixtures have no chunk here, -1)
      if (op->kind != FY_OP_MOE || g->params[op->params[0]].chunk < 0) continue;
      const int b = op->has_bias, El = op->experts / P, c = g->params[op->params[0]].chunk;
      const int ids[4] = {op->params[1], b ? op->params[2] : -1, op->params[2 + b], b ? op->params[4] : -1};
      if (pass == 0) x->ep_E[c] += op->experts;
      for (int k = 0; k < 4; k++) {
        if (ids[k] < 0) continue;
        const struct fy_param *p = &g->params[ids[k]];
        FY_ASSERT(p->chunk == c);  // (an op's first-use group is one chunk)
        const int64_t len = p->numel / op->experts * El;  // (ep rank j's experts' elements)
        for (int j = 0; j < P; j++, x->ep_n[c]++)
          if (pass == 1) {
            int64_t *k3 = x->ep_cut[c][x->ep_n[c]];
            k3[0] = p->chunk_offset + j * len, k3[1] = k3[0] + len, k3[2] = j;
          }
      }
    }
    for (int c = 0; c < nc; c++) {
      if (pass == 0 && x->ep_n[c] > 0 && !(x->ep_cut[c] = malloc((size_t)x->ep_n[c] * sizeof *x->ep_cut[c])))
        return fy_error_set(FY_ERR_NOMEM, "out of memory");
      if (pass == 0) x->ep_n[c] = 0;
      if (pass == 1 && x->ep_n[c] > 0) {
        qsort(x->ep_cut[c], (size_t)x->ep_n[c], sizeof *x->ep_cut[c], cut_cmp);
        x->ep_ranged = true;
      }
    }
  }
  if (!x->ep_ranged) return FY_OK;
  if (m->ep && P > 1) fy_ep_others_unread(m->ep);  // (ep_scatter sends this rank's experts' gradients alone)
  // The mixtures' experts, loaded by need (ep_experts).
  const int G = x->world / P;
  int E_max = 0;
  int64_t route_max = 0;
  for (int o = 0; o < g->n_ops; o++) {
    const struct fy_op *op = &g->ops[o];
    if (op->kind != FY_OP_MOE || g->params[op->params[0]].chunk < 0) continue;
    struct moe_load *ml = &x->moe[o];
    const int b = op->has_bias;
    const int ids[4] = {op->params[1], b ? op->params[2] : -1, op->params[2 + b], b ? op->params[4] : -1};
    ml->chunk = g->params[op->params[0]].chunk;
    ml->E = op->experts;
    for (int k = 0; k < 4; k++)
      if (ids[k] >= 0) ml->off[k] = g->params[ids[k]].chunk_offset, ml->len[k] = g->params[ids[k]].numel / ml->E;
    ml->gen = -1;
    if (!(ml->valid = calloc((size_t)(G * ml->E), sizeof *ml->valid)) ||
        !(ml->used = calloc((size_t)(G * ml->E) * (size_t)x->max_micro, sizeof *ml->used)))
      return fy_error_set(FY_ERR_NOMEM, "out of memory");
    ml->ep = true;
    if (op->experts > E_max) E_max = op->experts;
    const int64_t r = g->B * g->T * (op->experts + 3 * op->top_k);
    if (r > route_max) route_max = r;
  }
  FY_TRY(fy_comm_split(x->c_gather, 0, x->rank, &x->c_mask));
  if (!(x->ep_masks = calloc((size_t)x->world * (size_t)E_max, sizeof *x->ep_masks)))
    return fy_error_set(FY_ERR_NOMEM, "out of memory");
  if (!x->moe_routed) FY_TRY(fy_event_create(x->dev, &x->moe_routed));
  if (!x->route_host && !(x->route_host = malloc((size_t)route_max * 4))) return fy_error_set(FY_ERR_NOMEM, "out of memory");
  for (int i = 0; i < 4 && x->ep_ranged; i++)
    if (!(x->ep_buf[i] = malloc((size_t)m->layout->chunk_elems * 4))) return fy_error_set(FY_ERR_NOMEM, "out of memory");
  if (x->ep_ranged && !(x->ep_counts = calloc(5 * (size_t)x->world, sizeof *x->ep_counts)))
    return fy_error_set(FY_ERR_NOMEM, "out of memory");
  return FY_OK;
}

static void ep_free(struct fy_offload *x) {
  for (int c = 0; x->ep_cut && c < x->m->layout->n_chunks; c++) free(x->ep_cut[c]);
  free(x->ep_cut);
  free(x->ep_n);
  free(x->ep_E);
  for (int i = 0; i < 4; i++) free(x->ep_buf[i]);
  free(x->ep_counts);
  free(x->ep_masks);
  fy_comm_free(x->c_mask);
}

void fy_offload_experts(const struct fy_offload *x, int64_t *loaded, int64_t *total) {
  *loaded = x->expert_loads;
  *total = x->expert_parts;
}

double fy_offload_aux_sum(const struct fy_offload *x, int micro) {
  return micro >= 0 && micro < x->max_micro && x->aux_sums ? x->aux_sums[micro] : 0.0;
}

// ---- creation ----

static fy_status create_streams(struct fy_offload *x) {
  FY_TRY(fy_stream_create(x->dev, &x->compute));
  FY_TRY(fy_stream_create(x->dev, &x->copy_in));
  FY_TRY(fy_stream_create(x->dev, &x->copy_out));
  FY_TRY(fy_stream_create(x->dev, &x->optim));
  for (int p = 0; p < 2; p++) {
    FY_TRY(fy_event_create(x->dev, &x->batch_ready[p]));
    FY_TRY(fy_event_create(x->dev, &x->pass_done[p]));
    FY_TRY(fy_event_create(x->dev, &x->updates_done[p]));
  }
  FY_TRY(fy_event_create(x->dev, &x->dev_sumsq_done));
  FY_TRY(fy_event_create(x->dev, &x->dev_updates_done[0]));
  FY_TRY(fy_event_create(x->dev, &x->dev_updates_done[1]));
  return fy_event_create(x->dev, &x->norm_ready);
}

static fy_status create_lag(struct fy_offload *x);
static fy_status chunk_ranges(struct fy_offload *x, int c);

static fy_status create_chunks(struct fy_offload *x, const struct fy_offload_opts *o) {
  struct fy_model *m = x->m;
  const struct fy_graph *g = m->graph;
  int nc = m->layout->n_chunks;
  int64_t ce = m->layout->chunk_elems;
  x->home = calloc((size_t)nc, sizeof *x->home);
  x->home_ready = calloc((size_t)nc, sizeof *x->home_ready);
  x->grad_ready = calloc((size_t)nc, sizeof *x->grad_ready);
  x->g_home = calloc((size_t)nc, sizeof *x->g_home);
  x->wb_jobs = calloc((size_t)nc, sizeof *x->wb_jobs);
  x->m_home = calloc((size_t)nc, sizeof *x->m_home);
  x->v_home = calloc((size_t)nc, sizeof *x->v_home);
  x->disk_handle = calloc((size_t)nc, sizeof *x->disk_handle);
  x->param_first = calloc((size_t)nc + 1, sizeof *x->param_first);
  x->param_ids = calloc((size_t)g->n_params, sizeof *x->param_ids);
  x->sumsq = calloc((size_t)g->n_params, sizeof *x->sumsq);
  // (From the host tier: on a GPU that memory is pinned, so the write-backs through it are DMA.)
  if (fy_host_alloc(m->host, (size_t)ce * 4, (void **)&x->wb_staging) != FY_OK) x->wb_staging = NULL;
  if (x->own_weights && (!(x->w_home = calloc((size_t)nc, sizeof *x->w_home)) || !(x->gather_buf = malloc((size_t)ce * 4))))
    return fy_error_set(FY_ERR_NOMEM, "cannot allocate the chunk tables");
  for (int q = 0; q < 2; q++) x->jobs[q] = calloc((size_t)nc, sizeof *x->jobs[q]);
  if (!x->home || !x->home_ready || !x->grad_ready || !x->m_home || !x->g_home || !x->wb_jobs || !x->v_home || !x->disk_handle ||
      !x->param_first || !x->param_ids || !x->sumsq || !x->wb_staging || !x->jobs[0] || !x->jobs[1])
    return fy_error_set(FY_ERR_NOMEM, "cannot allocate the chunk tables");
  int k = 0;
  for (int c = 0; c < nc; c++) {
    x->param_first[c] = k;
    for (int i = 0; i < g->n_params; i++)
      if (g->params[i].chunk == c) x->param_ids[k++] = i;
    FY_TRY(fy_event_create(x->dev, &x->home_ready[c]));
    FY_TRY(fy_event_create(x->dev, &x->grad_ready[c]));
    for (int q = 0; q < 2; q++) x->jobs[q][c] = (struct chunk_job){.x = x, .chunk = c, .q = q};
  }
  x->param_first[nc] = k;
  // The first n_dev chunks: on the device with all their state.
  x->n_dev = o->n_device_chunks < nc ? o->n_device_chunks : nc;
  const struct fy_model_kernels *kt = m->kernels;
  if (launches_kernels(m) && x->n_dev > 0 && !(kt->chunk_sumsq && kt->chunk_adamw && kt->chunk_add))
    return fy_error_set(FY_ERR_UNSUPPORTED, "chunks kept on the %s device (--device-chunks): its kernels cannot "
                        "update them", x->dev->name);
  if (launches_kernels(m) && x->n_dev > 0 && x->sf != FY_STATE_F32 && !kt->chunk_adamw_state)
    return fy_error_set(FY_ERR_UNSUPPORTED, "chunks kept on the %s device (--device-chunks) with --optimizer-state %s: "
                        "its kernels cannot update that state", x->dev->name, fy_state_format_name(x->sf));
  if (x->sharded && x->n_dev > 0)
    return fy_error_set(FY_ERR_UNSUPPORTED, "chunks kept whole on the device do not combine with sharding across %d ranks "
                        "(shards_on_device keeps every rank's shards there)", x->world);
  if (x->sharded && x->esize == 2 && m->compute_dtype != FY_BF16)
    return fy_error_set(FY_ERR_UNSUPPORTED, "%s chunks sharded across %d ranks: the ranks' collectives carry fp32 "
                        "or bf16 (train this with --precision bf16)", fy_dtype_name(m->compute_dtype), x->world);
  size_t dev_before = x->dev->bytes_in_use;
  if (x->n_dev + (o->n_disk_chunks > 0 ? o->n_disk_chunks : 0) > nc)
    return fy_error_set(FY_ERR_INVALID, "--device-chunks %d and --disk-chunks %d ask for more than the model's %d chunks "
                        "(a chunk's gradients and AdamW state are on the device, in host memory or on disk)",
                        x->n_dev, o->n_disk_chunks, nc);
  float ***dev_bufs[] = {&x->dev_w, &x->dev_g, &x->dev_acc, &x->dev_m, &x->dev_v, &x->dev_w16};
  for (int i = 0; i < 6; i++)
    if (!(*dev_bufs[i] = calloc((size_t)nc, sizeof **dev_bufs[i]))) return fy_error_set(FY_ERR_NOMEM, "out of memory");
  if (!(x->dev_bwd_done = calloc((size_t)nc, sizeof *x->dev_bwd_done)) ||
      !(x->dev_acc_jobs = calloc((size_t)nc, sizeof *x->dev_acc_jobs)))
    return fy_error_set(FY_ERR_NOMEM, "out of memory");
  for (int c = 0; c < x->n_dev; c++) {
    for (int i = 0; i < 6; i++) {
      if (i == 2 && x->max_micro == 1) continue;  // no sum over micro-batches to keep
      if (i == 5 && m->compute_dtype == FY_F32) continue;  // the kernels read the master weights
      fy_status st = fy_device_alloc(x->dev, dev_buf_bytes(x, i), (void **)&(*dev_bufs[i])[c]);
      if (st != FY_OK) return fy_error_wrap(st, "keeping chunk %d and its optimizer state on the device", c);
    }
    FY_TRY(x->dev->ops->memset_async(x->copy_in, x->dev_m[c], 0, dev_buf_bytes(x, 3)));  // (zero in every format)
    FY_TRY(x->dev->ops->memset_async(x->copy_in, x->dev_v[c], 0, dev_buf_bytes(x, 4)));
  }
  x->sums_on_device = launches_kernels(m) && kt->chunk_sumsq && !x->sharded && !x->forward_only &&
                      fy_offload_grads_in_copy(m->compute_dtype, x->max_micro);
  if (x->n_dev > 0 || x->sums_on_device) {
    size_t sums = (size_t)g->n_params * sizeof(double);
    fy_status st = fy_device_alloc(x->dev, sums, (void **)&x->dev_sums);
    if (st == FY_OK) st = fy_device_alloc(x->dev, 4 * sizeof(float), (void **)&x->dev_scale);
    if (st != FY_OK) return fy_error_wrap(st, "keeping the device chunks' sums of squares on the device");
    FY_TRY(fy_host_alloc(m->host, sums, (void **)&x->host_sums));
    FY_TRY(fy_host_alloc(m->host, 4 * sizeof(float), (void **)&x->host_scale));
    memset(x->host_sums, 0, sums);
    memset(x->host_scale, 0, 4 * sizeof(float));
  }
  FY_TRY(fy_stream_sync(x->copy_in));
  // Gradients and AdamW state: the next chunks in the host tier, the last n_disk_chunks on disk.
  x->n_disk_chunks = o->n_disk_chunks < 0 ? 0 : o->n_disk_chunks < nc ? o->n_disk_chunks : nc;
  x->disk = o->disk;
  if (x->n_disk_chunks > 0 && !x->disk)
    return fy_error_set(FY_ERR_INVALID, "optimizer state on disk needs a disk tier (--disk-dir)");
  if (x->n_disk_chunks > 0 && x->shards_on_device)
    return fy_error_set(FY_ERR_INVALID, "shards on the device and optimizer state on disk do not combine");
  if (x->disk_master && m->compute_dtype == FY_F32)
    return fy_error_set(FY_ERR_UNSUPPORTED, "--disk-master needs 16-bit compute (--precision bf16 or fp16): the host "
                        "then keeps the 16-bit copy the device reads while the fp32 master is on disk; in fp32 the "
                        "master is what the device reads");
  if (x->disk_master && (x->n_disk_chunks == 0 || x->forward_only))
    return fy_error_set(FY_ERR_INVALID, "--disk-master puts the disk chunks' master weights on disk, and there are no "
                        "disk chunks%s (give --disk-chunks N with a --disk-dir, or drop --disk-master)",
                        x->forward_only ? " when evaluating" : "");
  size_t bytes = (size_t)x->S * 4;  // a chunk's, or with sharding this rank's shard of it
  if (x->forward_only && (x->n_dev > 0 || x->n_disk_chunks > 0))
    return fy_error_set(FY_ERR_INVALID, "a forward-only engine keeps no chunks on the device or disk");
  if (host_chunks(x) > 0 && !x->forward_only) {
    FY_TRY(state_alloc(x, host_chunks(x) * x->mb, &x->m_all));
    FY_TRY(state_alloc(x, host_chunks(x) * x->mb, &x->v_all));
  }
  for (int c = 0; c < nc; c++) {
    x->wb_jobs[c] = (struct disk_wb){x, c, false};
    // (the master of a device chunk too when not sharded: the host's copy of it, for checkpoints)
    if (x->own_weights && !master_on_disk(x, c) && (c >= x->n_dev || !x->sharded))
      FY_TRY(state_alloc(x, bytes, &x->w_home[c]));
    if (c < x->n_dev) continue;
    if (x->forward_only) continue;  // (no gradients, m or v)
    if (c >= nc - x->n_disk_chunks) {
      FY_TRY(fy_disk_alloc(x->disk, disk_slot(x, c), &x->disk_handle[c]));
    } else {
      if (!grads_in_copy(x, c)) FY_TRY(state_alloc(x, bytes, &x->g_home[c]));
      x->m_home[c] = (float *)((char *)x->m_all + (size_t)(c - x->n_dev) * x->mb);
      x->v_home[c] = (float *)((char *)x->v_all + (size_t)(c - x->n_dev) * x->mb);
    }
  }
  if ((x->sf != FY_STATE_F32 || x->n_spec > 0) && !x->forward_only) {  // (the speculative kernel takes ranges)
    if (!(x->ranges = calloc((size_t)nc, sizeof *x->ranges)) || !(x->dev_ranges = calloc((size_t)nc, sizeof *x->dev_ranges)) ||
        !(x->n_ranges = calloc((size_t)nc, sizeof *x->n_ranges)))
      return fy_error_set(FY_ERR_NOMEM, "out of memory");
    for (int c = 0; c < nc; c++) FY_TRY(chunk_ranges(x, c));
  }
  FY_TRY(fy_stream_sync(x->copy_in));
  x->device_state_bytes = (int64_t)(x->dev->bytes_in_use - dev_before);
  if (m->compute_dtype != FY_F32) {
    if (!(x->chome = calloc((size_t)nc, sizeof *x->chome))) return fy_error_set(FY_ERR_NOMEM, "out of memory");
    for (int c = 0; c < nc; c++)  // (zeroed: a shard's padding travels with it)
      FY_TRY(fy_host_alloc(m->host, (size_t)x->S * x->esize, &x->chome[c]));
  }
  for (int c = 0; c < nc; c++) x->home[c] = x->chome ? (const float *)x->chome[c] : home_weights(x, c);
  if (x->lag) FY_TRY(create_lag(x));
  x->norm_stream = x->optim;
  if (x->lag || x->n_spec > 0) {  // (the optimizer stream runs updates before the norm is known)
    FY_TRY(fy_stream_create(x->dev, &x->sums));
    x->norm_stream = x->sums;
  }
  x->disk_read_ahead = -1;
  if (x->n_disk_chunks > 0) {  // (m and v; the gradients' too unless they come home over the copy)
    const bool grads = !fy_offload_grads_in_copy(m->compute_dtype, x->max_micro);
    float **bufs[] = {&x->disk_m[0], &x->disk_v[0], &x->disk_m[1], &x->disk_v[1], &x->disk_g, &x->wb_disk,
                      &x->wb_disk_sum};
    for (int i = 0; i < (grads ? 7 : 4); i++) FY_TRY(fy_host_alloc(m->host, i < 4 ? x->mb : bytes, (void **)bufs[i]));
    for (int i = 0; x->disk_master && i < 2; i++) FY_TRY(fy_host_alloc(m->host, bytes, (void **)&x->disk_w[i]));
    struct fy_disk_req **reqs[] = {&x->req_g, &x->req_m[0], &x->req_v[0], &x->req_m[1], &x->req_v[1], &x->req_wb,
                                   &x->req_w[0], &x->req_w[1]};
    for (int i = 0; i < 8; i++) FY_TRY(fy_disk_req_create(reqs[i]));
  }
  return FY_OK;
}

static int range_cmp(const void *a, const void *b) {
  int64_t x = ((const struct fy_adamw_range *)a)->off, y = ((const struct fy_adamw_range *)b)->off;
  return (x > y) - (x < y);
}

// Compressed state: chunk c's parameters as ranges of its state buffer (the part of each in this
// rank's [lo, lo + state_elems)), sorted, weight decay 1 where it applies; then as many again for
// the update to fill in with the step's decay.
static fy_status chunk_ranges(struct fy_offload *x, int c) {
  const struct fy_graph *g = x->m->graph;
  const int64_t lo = c < x->n_dev ? 0 : x->lo, hi = lo + state_elems(x, c);
  const int np = x->param_first[c + 1] - x->param_first[c];
  struct fy_adamw_range *r = calloc((size_t)(2 * np + 1), sizeof *r);
  if (!r) return fy_error_set(FY_ERR_NOMEM, "out of memory");
  int n = 0;
  for (int k = x->param_first[c]; k < x->param_first[c + 1]; k++) {
    const struct fy_param *p = &g->params[x->param_ids[k]];
    int64_t a = p->chunk_offset > lo ? p->chunk_offset : lo;
    int64_t b = p->chunk_offset + p->numel < hi ? p->chunk_offset + p->numel : hi;
    if (a < b) r[n++] = (struct fy_adamw_range){a - lo, b - a, p->decay ? 1.0f : 0.0f};
  }
  qsort(r, (size_t)n, sizeof *r, range_cmp);
  x->ranges[c] = r;
  x->n_ranges[c] = n;
  FY_TRY(fy_adamw_ranges_check(hi - lo, r, n));
  if (c < x->n_dev && launches_kernels(x->m) && n > 0 && x->sf != FY_STATE_F32) {  // the kernels read them there
    fy_status st = fy_device_alloc(x->dev, (size_t)n * sizeof *r, (void **)&x->dev_ranges[c]);
    if (st != FY_OK) return fy_error_wrap(st, "keeping device chunk %d's parameter ranges on the device", c);
  }
  return FY_OK;
}

// --optimizer-lag: a second 16-bit copy and its event for every host or disk chunk, and the
// device chunks' kept gradients. The update runs under the next step only where the gradients
// come home over the chunk's 16-bit copy (16-bit compute, one micro-batch a step), so that
// two copies a chunk are all it takes.
static fy_status create_lag(struct fy_offload *x) {
  struct fy_model *m = x->m;
  const int nc = m->layout->n_chunks;
  if (!fy_offload_grads_in_copy(m->compute_dtype, x->max_micro))
    return fy_error_set(FY_ERR_UNSUPPORTED, "--optimizer-lag 1 needs 16-bit compute (--precision bf16 or fp16) and one "
                        "micro-batch a step (no --grad-accum): the gradients then come home over the weights' "
                        "16-bit copy, and two copies a chunk let the update run under the next step (got %s, %d "
                        "micro-batches a step)", fy_dtype_name(m->compute_dtype), x->max_micro);
  if (x->shards_on_device)
    return fy_error_set(FY_ERR_UNSUPPORTED, "--optimizer-lag does not combine with shards kept on the device");
  if (!(x->chome_alt = calloc((size_t)nc, sizeof *x->chome_alt)) ||
      !(x->home_ready_alt = calloc((size_t)nc, sizeof *x->home_ready_alt)) ||
      !(x->dev_gl = calloc((size_t)nc, sizeof *x->dev_gl)))
    return fy_error_set(FY_ERR_NOMEM, "out of memory");
  for (int c = x->n_dev; c < nc; c++) {
    FY_TRY(fy_host_alloc(m->host, (size_t)x->S * x->esize, &x->chome_alt[c]));
    FY_TRY(fy_event_create(x->dev, &x->home_ready_alt[c]));
  }
  for (int c = 0; c < x->n_dev; c++) {
    fy_status st = fy_device_alloc(x->dev, dev_buf_bytes(x, 1), (void **)&x->dev_gl[c]);
    if (st != FY_OK) return fy_error_wrap(st, "keeping device chunk %d's gradients for --optimizer-lag", c);
  }
  x->device_state_bytes += (int64_t)x->n_dev * (int64_t)dev_buf_bytes(x, 1);
  return FY_OK;
}

// The order in which a pass completes the chunks' gradients (a chunk's last backward use), which
// the optimizer stream's sums of squares follow: each waits for its chunk's gradients, so in chunk
// order all of them would wait for the last one home (chunk 0, whose tied embedding's gradient is
// finished last) and run after the backward instead of beside it.
static fy_status make_grad_order(struct fy_offload *x) {
  const struct fy_chunk_layout *l = x->m->layout;
  int nc = l->n_chunks, n = 0;
  x->grad_order = malloc((size_t)nc * sizeof *x->grad_order);
  int *uses = calloc((size_t)nc, sizeof *uses);  // backward uses so far
  fy_status st = x->grad_order && uses ? FY_OK : fy_error_set(FY_ERR_NOMEM, "cannot allocate the pass");
  for (int a = 0; st == FY_OK && a < x->n_actions; a++) {
    if (x->actions[a].kind != FY_ACT_BACKWARD) continue;
    int o = x->actions[a].op;
    for (int k = l->op_first[o]; k < l->op_first[o + 1]; k++)
      if (++uses[l->op_chunks[k]] == l->chunks[l->op_chunks[k]].n_users_bwd) x->grad_order[n++] = l->op_chunks[k];
  }
  for (int c = 0; st == FY_OK && c < nc; c++)  // the rest (evaluation: every chunk) in chunk order
    if (l->chunks[c].n_users_bwd == 0 || uses[c] < l->chunks[c].n_users_bwd) x->grad_order[n++] = c;
  free(uses);
  return st;
}

static fy_status create_pass(struct fy_offload *x, const struct fy_offload_opts *o) {
  struct fy_model *m = x->m;
  const struct fy_graph *g = m->graph;
  const struct fy_chunk_layout *l = m->layout;
  x->actions = calloc((size_t)fy_graph_max_actions(g), sizeof *x->actions);
  if (!x->actions) return fy_error_set(FY_ERR_NOMEM, "cannot allocate the pass");
  if (x->forward_only) {  // evaluation: the forward's actions alone
    for (int o = 0; o < g->n_ops; o++) x->actions[o] = (struct fy_action){o, FY_ACT_FORWARD};
    x->n_actions = g->n_ops;
  } else {
    x->n_actions = fy_graph_pass_actions(g, x->actions);
  }
  x->n_fwd = x->n_actions;
  if (x->staged) {  // the stage's ops' actions: their forward, then their backward (recomputation's too)
    int n = 0;
    for (int a = 0; a < x->n_actions; a++)
      if (x->actions[a].op >= x->stage_lo && x->actions[a].op < x->stage_hi) x->actions[n++] = x->actions[a];
    x->n_actions = n;
    for (x->n_fwd = 0; x->n_fwd < n && x->actions[x->n_fwd].kind == FY_ACT_FORWARD;) x->n_fwd++;
  }
  // The cache's trace: the accesses of chunks it manages (not those kept on the device), of a
  // pass, or of a pipeline stage's step: its half-passes in the schedule's order.
  const int n_parts = x->staged ? o->n_schedule : 1;
  int64_t n = 0;
  for (int a = 0; a < x->n_actions; a++) n += l->op_first[x->actions[a].op + 1] - l->op_first[x->actions[a].op];
  int32_t *trace = calloc((size_t)n * (size_t)n_parts + 1, sizeof *trace);
  if (!trace) return fy_error_set(FY_ERR_NOMEM, "cannot allocate the trace");
  n = 0;
  for (int part = 0; part < n_parts; part++) {
    const bool fwd = x->staged && o->schedule[part];
    const int a0 = x->staged && !fwd ? x->n_fwd : 0, a1 = fwd ? x->n_fwd : x->n_actions;
    for (int a = a0; a < a1; a++) {
      int op = x->actions[a].op;
      for (int k = l->op_first[op]; k < l->op_first[op + 1]; k++)
        if (l->op_chunks[k] >= x->n_dev) trace[n++] = l->op_chunks[k];
    }
  }
  fy_status st = fy_trace_create(trace, n, l->n_chunks, &x->trace);
  free(trace);
  FY_TRY(st);
  FY_TRY(make_grad_order(x));
  size_t bt = (size_t)(g->B * g->T);
  for (int p = 0; p < 2; p++) {
    x->calls[p] = calloc((size_t)x->n_actions, sizeof *x->calls[p]);
    x->staging[p] = malloc(4 * bt * sizeof(int32_t));
    if (!x->calls[p] || !x->staging[p]) return fy_error_set(FY_ERR_NOMEM, "cannot allocate the pass");
    FY_TRY(fy_device_alloc(x->dev, 4 * bt * sizeof(int32_t), (void **)&x->dbatch_mem[p]));
    int32_t *d = x->dbatch_mem[p];
    x->dbatch[p] = (struct fy_dev_batch){.inputs = d, .targets = d + bt, .mask = d + 2 * bt, .positions = d + 3 * bt};
  }
  x->loss_sums = calloc((size_t)x->max_micro, sizeof *x->loss_sums);
  if (!x->loss_sums) return fy_error_set(FY_ERR_NOMEM, "cannot allocate the pass");
  return FY_OK;
}

// A pipeline stage: which of its parameters another stage also reads (a tied embedding), and the
// communicator over the stages.
static fy_status create_stage(struct fy_offload *x, const struct fy_offload_opts *o) {
  const struct fy_graph *g = x->m->graph;
  x->staged = true;
  x->stage_lo = o->stage_lo;
  x->stage_hi = o->stage_hi;
  x->tied = -1;
  // (A forward-only stage, ferry eval's, runs one forward a step: a schedule of one half-pass.)
  if (!o->stage_comm || !o->schedule || o->n_schedule < (x->forward_only ? 1 : 2))
    return fy_error_set(FY_ERR_INVALID, "a pipeline stage's engine needs its stages' communicator and schedule");
  FY_TRY(fy_comm_split(o->stage_comm, 0, fy_comm_rank(o->stage_comm), &x->c_stage));
  FY_TRY(fy_event_create(x->dev, &x->boundary));
  x->norm_skip = calloc((size_t)g->n_params + 1, sizeof *x->norm_skip);
  x->zero_first = calloc((size_t)g->n_params + 1, sizeof *x->zero_first);
  x->zeroed = calloc((size_t)g->n_params + 1, sizeof *x->zeroed);
  if (!x->norm_skip || !x->zero_first || !x->zeroed) return fy_error_set(FY_ERR_NOMEM, "out of memory");
  for (int i = 0; i < g->n_params; i++) {
    const struct fy_param *p = &g->params[i];
    if (p->absent) continue;
    const bool first_here = p->first_use >= x->stage_lo && p->first_use < x->stage_hi,
               last_here = p->last_use >= x->stage_lo && p->last_use < x->stage_hi;
    x->norm_skip[i] = !first_here;
    x->zero_first[i] = !last_here;
    if (first_here != last_here) x->tied = i;
  }
  return FY_OK;
}

// Speculative updates: the chunks that take them (the first host-tier chunks whose gradients a
// backward completes) and a spare slot each, in the same memory as the chunk's own buffers.
static fy_status create_spec(struct fy_offload *x) {
  struct fy_model *m = x->m;
  const int nc = m->layout->n_chunks, first_disk = nc - x->n_disk_chunks;
  if (!(x->spec_slot = malloc((size_t)nc * sizeof *x->spec_slot)) ||
      !(x->spec_chunk = malloc((size_t)x->n_spec * sizeof *x->spec_chunk)))
    return fy_error_set(FY_ERR_NOMEM, "out of memory");
  for (int c = 0; c < nc; c++) x->spec_slot[c] = -1;
  int n = 0;
  for (int i = 0; i < nc && n < x->n_spec; i++) {
    const int c = x->grad_order[i];
    if (c < x->n_dev || c >= first_disk) continue;
    x->spec_slot[c] = n;
    x->spec_chunk[n++] = c;
  }
  x->n_spec = n;  // (at most the host tier's chunks)
  if (n == 0) return FY_OK;
  if (!(x->spare_w = calloc((size_t)n, sizeof *x->spare_w)) || !(x->spare_m = calloc((size_t)n, sizeof *x->spare_m)) ||
      !(x->spare_v = calloc((size_t)n, sizeof *x->spare_v)) || !(x->spare_c = calloc((size_t)n, sizeof *x->spare_c)) ||
      !(x->spec_done = calloc((size_t)n, sizeof *x->spec_done)) ||
      !(x->spec_jobs[0] = calloc((size_t)n, sizeof *x->spec_jobs[0])) ||
      !(x->spec_jobs[1] = calloc((size_t)n, sizeof *x->spec_jobs[1])))
    return fy_error_set(FY_ERR_NOMEM, "out of memory");
  FY_TRY(state_alloc(x, (size_t)n * x->mb, &x->spare_m_all));
  FY_TRY(state_alloc(x, (size_t)n * x->mb, &x->spare_v_all));
  for (int k = 0; k < n; k++) {
    fy_status st = state_alloc(x, (size_t)x->S * 4, &x->spare_w[k]);
    if (st == FY_OK && x->chome) st = fy_host_alloc(m->host, (size_t)x->S * x->esize, &x->spare_c[k]);
    if (st != FY_OK) return fy_error_wrap(st, "the spare slots of %d speculative updates (--spec-chunks)", n);
    x->spare_m[k] = (float *)((char *)x->spare_m_all + (size_t)k * x->mb);
    x->spare_v[k] = (float *)((char *)x->spare_v_all + (size_t)k * x->mb);
    FY_TRY(fy_event_create(x->dev, &x->spec_done[k]));
  }
  return FY_OK;
}

static void free_spec(struct fy_offload *x) {
  for (int k = 0; k < x->n_spec; k++) {
    if (x->spare_w && x->spare_w[k]) state_free(x, x->spare_w[k], (size_t)x->S * 4);
    if (x->spare_c && x->spare_c[k]) fy_host_dealloc(x->m->host, x->spare_c[k], (size_t)x->S * x->esize);
    if (x->spec_done && x->spec_done[k]) fy_event_free(x->spec_done[k]);
  }
  state_free(x, x->spare_m_all, (size_t)x->n_spec * x->mb);
  state_free(x, x->spare_v_all, (size_t)x->n_spec * x->mb);
  free(x->spare_w);
  free(x->spare_m);
  free(x->spare_v);
  free(x->spare_c);
  free(x->spec_done);
  free(x->spec_jobs[0]);
  free(x->spec_jobs[1]);
  free(x->spec_slot);
  free(x->spec_chunk);
}

// Device update pieces (dup_pieces) of the chunks dup_chunk: each chunk's part in pieces of
// dup_piece_elems, and with compressed state each piece's parameter ranges (on a GPU in device
// memory too, where the kernels read them).
static fy_status dup_cut_pieces(struct fy_offload *x) {
  const int64_t pe = x->dup_piece_elems;
  int n = 0;
  for (int i = 0; i < x->n_dup; i++) n += (int)((span(x, x->dup_chunk[i]) + pe - 1) / pe);
  if (!(x->dup_pieces = calloc((size_t)n, sizeof *x->dup_pieces))) return fy_error_set(FY_ERR_NOMEM, "out of memory");
  x->n_pieces = n;
  struct dup_piece *p = x->dup_pieces;
  for (int i = 0; i < x->n_dup; i++) {
    const int c = x->dup_chunk[i];
    for (int64_t off = 0; off < span(x, c); off += pe, p++) {
      *p = (struct dup_piece){.chunk = c, .off = off, .n = span(x, c) - off < pe ? span(x, c) - off : pe};
      if (x->sf == FY_STATE_F32) continue;
      if (!(p->ranges = calloc((size_t)(2 * x->n_ranges[c] + 1), sizeof *p->ranges)))
        return fy_error_set(FY_ERR_NOMEM, "out of memory");
      for (int k = 0; k < x->n_ranges[c]; k++) {  // (the chunk's ranges, of its part from x->lo)
        const struct fy_adamw_range *r = &x->ranges[c][k];
        const int64_t a = r->off > off ? r->off : off, b = r->off + r->n < off + p->n ? r->off + r->n : off + p->n;
        if (a < b) p->ranges[p->n_ranges++] = (struct fy_adamw_range){a - off, b - a, r->weight_decay};
      }
      if (!launches_kernels(x->m) || p->n_ranges == 0) continue;
      fy_status st = fy_device_alloc(x->dev, (size_t)p->n_ranges * sizeof *p->ranges, (void **)&p->dev_ranges);
      if (st != FY_OK) return fy_error_wrap(st, "keeping chunk %d's parameter ranges on the device", c);
    }
  }
  return FY_OK;
}

// Device updates (fy_offload_opts.device_updates): the chunks (up to `want`, the first host-tier
// ones in chunk order that are not speculated), their pieces, streams, events and the two staging
// sets in device memory (before the cache takes what is left).
static fy_status create_dup(struct fy_offload *x, int want) {
  struct fy_model *m = x->m;
  const int nc = m->layout->n_chunks, first_disk = nc - x->n_disk_chunks;
  if (!(x->dup_slot = malloc((size_t)nc * sizeof *x->dup_slot)) ||
      !(x->dup_chunk = malloc((size_t)want * sizeof *x->dup_chunk)))
    return fy_error_set(FY_ERR_NOMEM, "out of memory");
  for (int c = 0; c < nc; c++) x->dup_slot[c] = -1;
  int n = 0;
  for (int c = x->n_dev; c < first_disk && n < want; c++) {
    if (x->spec_slot && x->spec_slot[c] >= 0) continue;
    x->dup_slot[c] = n;
    x->dup_chunk[n++] = c;
  }
  x->n_dup = n;
  if (n == 0) return FY_OK;
  const struct fy_model_kernels *kt = m->kernels;
  if (launches_kernels(m) && !(kt->launch_on && kt->chunk_adamw && kt->chunk_to16 &&
                               (x->sf == FY_STATE_F32 || kt->chunk_adamw_state)))
    return fy_error_set(FY_ERR_UNSUPPORTED, "device updates (--device-updates): the %s device's kernels cannot update "
                        "a chunk%s", x->dev->name, x->sf == FY_STATE_F32 ? "" : " in this state format");
  fy_stream **streams[] = {&x->dup_up, &x->dup_run, &x->dup_down};
  for (int i = 0; i < 3; i++) FY_TRY(fy_stream_create(x->dev, streams[i]));
  for (int s = 0; s < 2; s++) {
    fy_event **ev[] = {&x->dup_in[s],      &x->dup_ran[s],     &x->dup_free[s][0], &x->dup_free[s][1],
                       &x->dup_free[s][2], &x->dup_free[s][3], &x->dup_done[s]};
    for (size_t i = 0; i < sizeof ev / sizeof *ev; i++) FY_TRY(fy_event_create(x->dev, ev[i]));
  }
  x->dup_piece_elems = fy_chunk_piece_elems(x->S);
  FY_TRY(dup_cut_pieces(x));
  const size_t pe = (size_t)x->dup_piece_elems, gb = pe * fy_dtype_size(grads_dtype(x, x->dup_chunk[0]));
  const size_t mb = fy_state_moment_bytes(x->sf, (int64_t)pe);
  for (int s = 0; s < 2; s++) {
    fy_status st = fy_device_alloc(x->dev, pe * 4, (void **)&x->dup_w[s]);
    if (st == FY_OK) st = fy_device_alloc(x->dev, mb, (void **)&x->dup_m[s]);
    if (st == FY_OK) st = fy_device_alloc(x->dev, mb, (void **)&x->dup_v[s]);
    if (st == FY_OK) st = fy_device_alloc(x->dev, gb, &x->dup_g[s]);
    if (st == FY_OK && x->chome) st = fy_device_alloc(x->dev, pe * x->esize, &x->dup_w16[s]);
    if (st != FY_OK)
      return fy_error_wrap(st, "device updates of %d chunks (--device-updates) need two staging sets of %.1f MiB in "
                           "device memory, whatever the number of chunks (give a larger --device-mem, or "
                           "--device-updates 0)", n, (pe * 4 + 2.0 * mb + gb + (x->chome ? pe * x->esize : 0)) / 1048576.0);
  }
  FY_TRY(fy_device_alloc(x->dev, 4 * sizeof(float), (void **)&x->dup_scale));
  if (!x->host_scale) {
    FY_TRY(fy_host_alloc(m->host, 4 * sizeof(float), (void **)&x->host_scale));
    memset(x->host_scale, 0, 4 * sizeof(float));
  }
  for (int q = 0; q < 2; q++) {
    if (!(x->dup_jobs[q] = calloc((size_t)x->n_pieces, sizeof *x->dup_jobs[q])))
      return fy_error_set(FY_ERR_NOMEM, "out of memory");
    for (int j = 0; j < x->n_pieces; j++) x->dup_jobs[q][j] = (struct dup_job){.x = x, .piece = j, .q = q};
  }
  return FY_OK;
}

static void free_dup(struct fy_offload *x) {
  fy_stream_free(x->dup_up);
  fy_stream_free(x->dup_run);
  fy_stream_free(x->dup_down);
  const size_t pe = (size_t)x->dup_piece_elems, mb = fy_state_moment_bytes(x->sf, (int64_t)pe);
  for (int s = 0; s < 2; s++) {
    fy_event_free(x->dup_in[s]);
    fy_event_free(x->dup_ran[s]);
    for (int b = 0; b < 4; b++) fy_event_free(x->dup_free[s][b]);
    fy_event_free(x->dup_done[s]);
    free(x->dup_jobs[s]);
    if (x->dup_w[s]) fy_device_dealloc(x->dev, x->dup_w[s], pe * 4);
    if (x->dup_m[s]) fy_device_dealloc(x->dev, x->dup_m[s], mb);
    if (x->dup_v[s]) fy_device_dealloc(x->dev, x->dup_v[s], mb);
    if (x->dup_g[s]) fy_device_dealloc(x->dev, x->dup_g[s], pe * fy_dtype_size(grads_dtype(x, x->dup_chunk[0])));
    if (x->dup_w16[s]) fy_device_dealloc(x->dev, x->dup_w16[s], pe * x->esize);
  }
  if (x->dup_scale) fy_device_dealloc(x->dev, x->dup_scale, 4 * sizeof(float));
  for (int j = 0; x->dup_pieces && j < x->n_pieces; j++) {
    struct dup_piece *p = &x->dup_pieces[j];
    if (p->dev_ranges) fy_device_dealloc(x->dev, p->dev_ranges, (size_t)p->n_ranges * sizeof *p->dev_ranges);
    free(p->ranges);
  }
  free(x->dup_pieces);
  free(x->dup_slot);
  free(x->dup_chunk);
}

static fy_status spill_alloc(void *host, size_t n, void **out) { return fy_host_alloc(host, n, out); }
static void spill_free(void *host, void *p, size_t n) { fy_host_dealloc(host, p, n); }

fy_status fy_offload_create(struct fy_model *m, const struct fy_offload_opts *o, struct fy_offload **out) {
  if (!m->host) return fy_error_set(FY_ERR_INVALID, "offloading needs the model state in a host tier");
  struct fy_offload *x = calloc(1, sizeof *x);
  if (!x) return fy_error_set(FY_ERR_NOMEM, "cannot allocate the offload engine");
  x->m = m;
  x->dev = m->dev;
  x->prefetch = o->prefetch;
  x->max_micro = o->max_micro > 0 ? o->max_micro : 1;
  x->forward_only = o->forward_only;
  x->lag = o->optimizer_lag > 0 && !o->forward_only;  // (evaluation makes no updates to delay)
  x->esize = payload_bytes(m);
  pthread_mutex_init(&x->err_lock, NULL);
  int64_t ce = m->layout->chunk_elems;
  x->world = o->comm ? fy_comm_size(o->comm) : 1;
  x->rank = o->comm ? fy_comm_rank(o->comm) : 0;
  x->sharded = x->world > 1;
  x->shards_on_device = x->sharded && o->shards_on_device;
  x->disk_master = o->disk_master;
  // Speculative updates: each chunk's master weights its own, so that a chunk's and its spare
  // slot's can swap (spec_settle).
  const char *no_spec = x->lag ? "--optimizer-lag (whose updates run under the next step already)"
                        : x->shards_on_device ? "shards kept on the device"
                                              : NULL;
  if (o->spec_chunks > 0 && !x->forward_only && !no_spec) x->n_spec = o->spec_chunks;
  x->own_weights = x->sharded || x->disk_master || x->n_spec > 0;
  x->S = ce / x->world;
  x->lo = (int64_t)x->rank * x->S;
  x->sf = m->state_format;
  x->mb = fy_state_moment_bytes(x->sf, x->S);
  fy_status st = FY_OK;
  if (o->spec_chunks > 0 && !x->forward_only && no_spec)
    st = fy_error_set(FY_ERR_UNSUPPORTED, "speculative updates (--spec-chunks %d) do not combine with %s", o->spec_chunks,
                      no_spec);
  if (st == FY_OK && x->sharded && ce % (16 * x->world) != 0)
    st = fy_error_set(FY_ERR_INVALID, "chunks of %lld elements do not split into %d shards of whole 64-byte lines",
                      (long long)ce, x->world);
  // 8-bit state quantises blocks of FY_Q8_BLOCK elements from each buffer's start: a chunk, and a
  // rank's shard of it, must start on a block of the unsharded run's for the same bits.
  if (st == FY_OK && x->sf == FY_STATE_Q8 && !o->forward_only && (ce % FY_Q8_BLOCK != 0 || x->S % FY_Q8_BLOCK != 0))
    st = fy_error_set(FY_ERR_INVALID, "--optimizer-state 8bit: chunks of %lld elements%s do not start every %s on a "
                      "block of %d elements; give a chunk size that is a multiple of %d elements (%.4f MiB)",
                      (long long)ce, x->sharded ? " split over the ranks" : "", x->sharded ? "shard" : "chunk",
                      FY_Q8_BLOCK, FY_Q8_BLOCK * x->world, FY_Q8_BLOCK * x->world * 4.0 / 1048576.0);
  // A communicator per stream that runs collectives: each keeps the order of its own stream.
  struct fy_comm *blocks = o->block_comm ? o->block_comm : o->comm;
  if (st == FY_OK && x->sharded && (fy_comm_size(blocks) != x->world || fy_comm_rank(blocks) != x->rank))
    st = fy_error_set(FY_ERR_INVALID, "the blocks' communicator is rank %d of %d, the ranks' rank %d of %d",
                      fy_comm_rank(blocks), fy_comm_size(blocks), x->rank, x->world);
  struct fy_comm **dup[] = {&x->c_gather, &x->c_scatter, &x->c_optim};
  for (int i = 0; i < 3 && st == FY_OK && x->sharded; i++) st = fy_comm_split(i < 2 ? blocks : o->comm, 0, x->rank, dup[i]);
  if (st == FY_OK && m->graph->tp > 1) {
    if (!o->tp_comm) st = fy_error_set(FY_ERR_INVALID, "tensor parallelism needs the tensor-parallel group");
    else st = fy_comm_split(o->tp_comm, 0, fy_comm_rank(o->tp_comm), &x->c_optim_tp);
  }
  x->weights16 = !x->own_weights && !m->params;
  if (st == FY_OK && x->weights16 && (!x->forward_only || m->compute_dtype == FY_F32))
    st = fy_error_set(FY_ERR_INVALID, "a model without its weights offloads unsharded only to evaluate in 16 bits");
  if (st == FY_OK && o->stage_hi > 0) st = create_stage(x, o);
  if (st == FY_OK) st = create_streams(x);
  if (st == FY_OK) st = create_chunks(x, o);
  if (st == FY_OK) st = fy_wait_profile_create(x->compute, &x->wprof);
  if (st == FY_OK && !(x->home_cause = calloc((size_t)m->layout->n_chunks, sizeof *x->home_cause)))
    st = fy_error_set(FY_ERR_NOMEM, "out of memory");
  for (int c = 0; st == FY_OK && c < m->layout->n_chunks; c++)
    x->home_cause[c] = c >= m->layout->n_chunks - x->n_disk_chunks ? FY_STALL_DISK : FY_STALL_OPTIMIZER;
  if (st == FY_OK) st = create_pass(x, o);
  if (st == FY_OK && x->n_spec > 0) st = create_spec(x);
  if (st == FY_OK && o->device_updates > 0 && !x->forward_only) {
    const char *no = x->shards_on_device ? "shards kept on the device"
                     : x->lag   ? "--optimizer-lag (whose updates run under the next step already)"
                                 : NULL;
    st = no ? fy_error_set(FY_ERR_UNSUPPORTED, "device updates (--device-updates %d) do not combine with %s yet",
                           o->device_updates, no)
            : create_dup(x, o->device_updates);
  }
  if (st == FY_OK) st = moe_setup(x);
  if (st == FY_OK) st = ep_setup(x);
  if (st != FY_OK) {
    fy_offload_free(x);
    return st;
  }
  // The cache gets what is left of the device.
  size_t block = (size_t)m->layout->chunk_elems * x->esize;
  int min_blocks = fy_offload_min_blocks(m), n_blocks = o->n_blocks;
  struct fy_device *dev = x->dev;
  if (n_blocks <= 0) {  // as many as fit, up to one per chunk the cache manages (not the device's own)
    size_t used = dev->bytes_in_use + o->device_reserve;
    size_t left = dev->cap > used ? dev->cap - used : 0;
    n_blocks = (int)(left / fy_device_round(block, fy_device_granule(dev)));
    int most = m->layout->n_chunks - x->n_dev > min_blocks ? m->layout->n_chunks - x->n_dev : min_blocks;
    if (n_blocks > most) n_blocks = most;
  }
  if (n_blocks < min_blocks) {
    fy_offload_free(x);
    return fy_error_set(FY_ERR_NOMEM,
                        "the %s device memory (%.1f MiB) cannot hold the smallest working set: %d "
                        "blocks of %.1f MiB (the chunks one operator needs at once) plus %.1f MiB of "
                        "activations%s; it needs at least %.1f MiB (try --recompute, a smaller batch "
                        "or sequence, or smaller chunks)",
                        dev->name, dev->cap / 1048576.0, min_blocks, block / 1048576.0,
                        device_fixed_bytes(m->graph, &m->cfg, dev->kind == FY_DEVICE_CUDA) / 1048576.0,
                        o->device_reserve ? " and the key/value cache" : "",
                        (fy_offload_min_device_bytes(m) + (double)o->device_reserve) / 1048576.0);
  }
  x->n_blocks = n_blocks;
  struct fy_device_cache_opts co = {.dev = dev, .compute = x->compute, .copy_in = x->copy_in,
                                    .copy_out = x->copy_out, .n_blocks = n_blocks, .prefetch = o->prefetch,
                                    .trace = x->trace, .home = x->home, .home_ready = x->home_ready,
                                    .staging = x->wb_staging, .elem_bytes = x->esize, .spill_alloc = spill_alloc,
                                    .spill_free = spill_free, .spill_ctx = m->host, .profile = x->wprof,
                                    .home_cause = x->home_cause};
  if (x->moe_routed || x->ep_ranged) {  // (a mixture whose experts load by need, or this rank's alone)
    co.load_home = moe_load_home;
    co.load_ctx = x;
  }
  if (x->sharded) {
    co.shard_off = x->lo;
    co.shard_elems = x->S;
    co.gather = gather_hook;
    co.scatter = scatter_hook;
    co.shard_ctx = x;
  }
  st = fy_device_cache_create(m->layout, &co, &x->cache);
  if (st != FY_OK) {
    fy_offload_free(x);
    return st;
  }
  if (m->kernels->set_stream) m->kernels->set_stream(m, x->compute);
  *out = x;
  return FY_OK;
}

void fy_offload_free(struct fy_offload *x) {
  if (!x) return;
  fy_offload_sync(x);
  struct fy_model *m = x->m;
  fy_device_cache_free(x->cache);
  fy_stream_free(x->compute);
  fy_stream_free(x->copy_in);
  fy_stream_free(x->copy_out);
  fy_stream_free(x->optim);
  fy_stream_free(x->sums);
  free_spec(x);  // (the spare slots, whichever chunk's buffers they hold now)
  free_dup(x);
  int nc = m->layout->n_chunks;
  size_t bytes = (size_t)m->layout->chunk_elems * 4, bt = (size_t)(m->graph->B * m->graph->T);
  size_t sbytes = (size_t)x->S * 4;
  for (int c = 0; c < nc; c++) {
    if (x->home_ready) fy_event_free(x->home_ready[c]);
    if (x->home_ready_alt) fy_event_free(x->home_ready_alt[c]);
    if (x->chome_alt && x->chome_alt[c]) fy_host_dealloc(m->host, x->chome_alt[c], (size_t)x->S * x->esize);
    if (x->dev_gl && x->dev_gl[c]) fy_device_dealloc(x->dev, x->dev_gl[c], dev_buf_bytes(x, 1));
    if (x->grad_ready) fy_event_free(x->grad_ready[c]);
    if (x->g_home) state_free(x, x->g_home[c], sbytes);
    if (x->w_home) state_free(x, x->w_home[c], sbytes);
    if (x->chome && x->chome[c]) fy_host_dealloc(m->host, x->chome[c], (size_t)x->S * x->esize);
  }
  free(x->chome);
  free(x->chome_alt);
  free(x->home_ready_alt);
  fy_wait_profile_free(x->wprof);
  free(x->home_cause);
  free(x->dev_gl);
  free(x->w_home);
  free(x->gather_buf);
  fy_comm_free(x->c_gather);
  fy_comm_free(x->c_scatter);
  fy_comm_free(x->c_optim);
  fy_comm_free(x->c_optim_tp);
  fy_comm_free(x->c_stage);
  free(x->norm_skip);
  free(x->zero_first);
  free(x->zeroed);
  disk_drain(x);
  float *bufs[] = {x->disk_g, x->disk_m[0], x->disk_v[0], x->disk_m[1], x->disk_v[1], x->wb_disk, x->wb_disk_sum};
  for (int i = 0; i < 7; i++)
    if (bufs[i]) fy_host_dealloc(m->host, bufs[i], i >= 1 && i <= 4 ? x->mb : sbytes);
  for (int i = 0; i < 2; i++)
    if (x->disk_w[i]) fy_host_dealloc(m->host, x->disk_w[i], sbytes);
  for (int c = 0; c < nc; c++) {
    if (x->ranges) free(x->ranges[c]);
    if (x->dev_ranges && x->dev_ranges[c])
      fy_device_dealloc(x->dev, x->dev_ranges[c], (size_t)x->n_ranges[c] * sizeof **x->dev_ranges);
  }
  free(x->ranges);
  free(x->dev_ranges);
  free(x->n_ranges);
  struct fy_disk_req *reqs[] = {x->req_g, x->req_m[0], x->req_v[0], x->req_m[1], x->req_v[1], x->req_wb, x->req_w[0],
                                x->req_w[1]};
  for (int i = 0; i < 8; i++) fy_disk_req_free(reqs[i]);
  for (int p = 0; p < 2; p++) {
    fy_event_free(x->batch_ready[p]);
    fy_event_free(x->pass_done[p]);
    fy_event_free(x->updates_done[p]);
    if (x->dbatch_mem[p]) fy_device_dealloc(x->dev, x->dbatch_mem[p], 4 * bt * sizeof(int32_t));
    free(x->calls[p]);
    free(x->staging[p]);
    free(x->jobs[p]);
  }
  fy_event_free(x->norm_ready);
  fy_event_free(x->boundary);
  fy_event_free(x->dev_sumsq_done);
  fy_event_free(x->dev_updates_done[0]);
  fy_event_free(x->dev_updates_done[1]);
  float **devb[] = {x->dev_w, x->dev_g, x->dev_acc, x->dev_m, x->dev_v, x->dev_w16};
  for (int i = 0; i < 6; i++) {
    for (int c = 0; devb[i] && c < nc; c++)
      if (devb[i][c]) fy_device_dealloc(x->dev, devb[i][c], dev_buf_bytes(x, i));
    free(devb[i]);
  }
  free(x->dev_bwd_done);
  free(x->dev_acc_jobs);
  size_t sums = (size_t)m->graph->n_params * sizeof(double);
  if (x->dev_sums) fy_device_dealloc(x->dev, x->dev_sums, sums);
  if (x->dev_scale) fy_device_dealloc(x->dev, x->dev_scale, 4 * sizeof(float));
  if (x->host_sums) fy_host_dealloc(m->host, x->host_sums, sums);
  if (x->host_scale) fy_host_dealloc(m->host, x->host_scale, 4 * sizeof(float));
  fy_trace_free(x->trace);
  free(x->actions);
  free(x->grad_order);
  free(x->home);
  free(x->home_ready);
  free(x->grad_ready);
  free(x->g_home);
  free(x->wb_jobs);
  state_free(x, x->m_all, host_chunks(x) * x->mb);
  state_free(x, x->v_all, host_chunks(x) * x->mb);
  free(x->m_home);
  free(x->v_home);
  free(x->disk_handle);
  free(x->param_first);
  free(x->param_ids);
  free(x->sumsq);
  if (x->wb_staging) fy_host_dealloc(m->host, x->wb_staging, bytes);
  free(x->loss_sums);
  moe_free(x);
  ep_free(x);
  pthread_mutex_destroy(&x->err_lock);
  free(x);
}

// ---- gradients back to their home ----

// Reads n bytes at off of a disk chunk's slot into buf, or writes them; waits.
static fy_status disk_io(struct fy_offload *x, bool write, int c, size_t off, float *buf, size_t n,
                         struct fy_disk_req *r) {
  fy_status st = write ? fy_disk_write_async(x->disk, x->disk_handle[c], off, buf, n, r)
                       : fy_disk_read_async(x->disk, x->disk_handle[c], off, buf, n, r);
  fy_status st2 = fy_disk_wait(r);
  return st != FY_OK ? st : st2;
}

// disk_master: a disk chunk's master weights (this rank's part: span elements) into dst; waits.
// Only while no request of the optimizer's is in flight (between steps, or a skipped step's).
static fy_status master_read(struct fy_offload *x, int c, float *dst) {
  return disk_io(x, false, c, disk_off(x, c, 3), dst, (size_t)span(x, c) * 4, x->req_w[0]);
}

// On the copy stream, after the block reached wb_disk: the gradients go to the chunk's disk slot,
// added to what is there for later micro-batches (the same float adds as in the host tier).
static void disk_write_back_fn(void *arg) {
  struct disk_wb *j = arg;
  struct fy_offload *x = j->x;
  size_t n = (size_t)span(x, j->chunk);
  fy_status st;
  if (j->accumulate) {
    st = disk_io(x, false, j->chunk, 0, x->wb_disk_sum, n * 4, x->req_wb);
    for (size_t i = 0; st == FY_OK && i < n; i++) x->wb_disk_sum[i] = x->wb_disk_sum[i] + x->wb_disk[i];
    if (st == FY_OK) st = disk_io(x, true, j->chunk, 0, x->wb_disk_sum, n * 4, x->req_wb);
  } else {
    st = disk_io(x, true, j->chunk, 0, x->wb_disk, n * 4, x->req_wb);
  }
  if (st != FY_OK) async_fail(x, st);
}

static fy_status write_back(struct fy_offload *x, int c, bool accumulate) {
  if (grads_in_copy(x, c)) return fy_device_cache_write_back_payload(x->cache, c, x->chome[c], x->grad_ready[c]);
  if (x->g_home[c]) return fy_device_cache_write_back(x->cache, c, x->g_home[c], accumulate, x->grad_ready[c]);
  FY_TRY(fy_device_cache_write_back(x->cache, c, x->wb_disk, false, NULL));
  struct disk_wb *j = &x->wb_jobs[c];
  if (j->accumulate != accumulate) {
    FY_TRY(fy_stream_sync(x->copy_out));  // no queued work may still read the old argument
    j->accumulate = accumulate;
  }
  FY_TRY(fy_stream_enqueue(x->copy_out, disk_write_back_fn, j));
  return fy_event_record(x->grad_ready[c], x->copy_out);
}

// ---- chunks kept on the device ----

static void dev_add_fn(void *arg) {
  struct accumulate_job *a = arg;
  fy_add_to_f32(a->dst, a->src, FY_F32, (size_t)a->n);
}

// A device chunk's gradients of this micro-batch are complete: summed over micro-batches in fp32
// (the same copy and adds as elsewhere; a GPU's bf16 gradients widened on the way), then ready for
// the optimizer.
static fy_status device_grads_done(struct fy_offload *x, int c, int micro) {
  int64_t used = x->m->layout->chunks[c].used;
  if (x->max_micro > 1) {
    if (launches_kernels(x->m)) {
      FY_TRY(x->m->kernels->chunk_add(x->m, x->dev_acc[c], x->dev_g[c], payload_dtype(x), used, micro == 0));
    } else if (micro == 0) {
      FY_TRY(fy_copy_async(x->compute, x->dev_acc[c], x->dev_g[c], (size_t)used * 4));
    } else {
      x->dev_acc_jobs[c] = (struct accumulate_job){x->dev_acc[c], x->dev_g[c], used};  // same values every time
      FY_TRY(fy_stream_enqueue(x->compute, dev_add_fn, &x->dev_acc_jobs[c]));
    }
  }
  return fy_event_record(x->grad_ready[c], x->compute);
}

// The gradients the optimizer reads for chunk c, wherever they are (NULL: on disk), of dtype
// grads_dtype(x, c).
static const float *chunk_grads(struct fy_offload *x, int c) {
  if (c < x->n_dev) return x->max_micro > 1 ? x->dev_acc[c] : x->dev_g[c];
  if (grads_in_copy(x, c)) return (const float *)x->chome[c];
  return x->g_home[c];
}

// ---- one micro-batch ----

fy_status fy_offload_set_shards(struct fy_offload *x, fy_status (*fill)(void *ctx, int64_t lo, int64_t hi, float *dst),
                                void *ctx) {
  if (!x->own_weights && !x->weights16)
    return fy_error_set(FY_ERR_INVALID, "setting shards of chunks that are not sharded");
  FY_TRY(fy_offload_sync(x));
  const struct fy_chunk_layout *l = x->m->layout;
  if (x->weights16) {  // each chunk through an fp32 buffer into its 16-bit copy, the weights now
    float *tmp = malloc((size_t)l->chunk_elems * 4);
    fy_status st = tmp ? FY_OK : fy_error_set(FY_ERR_NOMEM, "cannot allocate a chunk");
    for (int c = 0; st == FY_OK && c < l->n_chunks; c++) {
      int64_t lo = (int64_t)c * l->chunk_elems;
      st = fill(ctx, lo, lo + l->chunks[c].used, tmp);
      if (st == FY_OK) to_payload(x, x->chome[c], tmp, l->chunks[c].used);
    }
    free(tmp);
    FY_TRY(st);
    x->m->cparams_fresh = true;  // (nothing to copy them from)
    return FY_OK;
  }
  // Shards in device memory are written through the copy engine, master weights on disk (this
  // rank's part of a disk chunk with disk_master) through a host buffer.
  float *tmp = NULL;
  if ((x->shards_on_device || x->disk_master) && !(tmp = malloc((size_t)x->S * 4)))
    return fy_error_set(FY_ERR_NOMEM, "cannot allocate a shard");
  fy_status st = FY_OK;
  for (int c = 0; st == FY_OK && c < l->n_chunks; c++) {
    int64_t lo = (int64_t)c * l->chunk_elems + x->lo;
    const bool staged = x->shards_on_device || master_on_disk(x, c);
    st = fill(ctx, lo, lo + span(x, c), staged ? tmp : x->w_home[c]);
    if (st == FY_OK && master_on_disk(x, c))
      st = disk_io(x, true, c, disk_off(x, c, 3), tmp, (size_t)span(x, c) * 4, x->req_w[0]);
    else if (st == FY_OK && staged)
      st = fy_copy_async(x->copy_in, x->w_home[c], tmp, (size_t)x->S * 4);
    if (st == FY_OK && staged && !master_on_disk(x, c)) st = fy_stream_sync(x->copy_in);
  }
  free(tmp);
  FY_TRY(st);
  if (x->m->params) {  // the whole buffer (if any) is not needed any more
    fy_host_dealloc(x->m->host, x->m->params, (size_t)x->m->graph->n_param_elems * 4);
    x->m->params = NULL;
  }
  x->taken = true;
  x->m->cparams_fresh = false;  // the 16-bit copies are made from the new shards
  return FY_OK;
}

// Sharding: the shards from the model's whole buffer (initialised, loaded or resumed whole, the same
// on every rank), which set_shards then gives back to the host tier.
static fy_status from_whole_buffer(void *ctx, int64_t lo, int64_t hi, float *dst) {
  memcpy(dst, ((const struct fy_offload *)ctx)->m->params + lo, (size_t)(hi - lo) * 4);
  return FY_OK;
}

static fy_status kernels_sumsq(struct fy_offload *x, int c, const void *grad);

// A pass of micro-batch `micro`: every action, or (forward_alone) the forward's, which come first,
// without dropout; the trace's positions then skip the backward's accesses, so that the next pass
// starts where the trace does.
// Decoding (kv set): a forward pass over the batch's first n tokens at the cache's positions, their
// attention against the cache, no loss.
// A pipeline stage's half-pass is the actions [a0, a1) alone (its forward's or its backward's).
static fy_status run_actions(struct fy_offload *x, const struct fy_batch *batch, int micro, float loss_scale,
                             bool forward_alone, struct fy_kv_cache *kv, int64_t n, int a0, int a1) {
  struct fy_model *m = x->m;
  const struct fy_graph *g = m->graph;
  const struct fy_chunk_layout *l = m->layout;
  if (!kv) FY_TRY(fy_engine_check_batch(m, batch));
  if (x->own_weights && !x->taken) FY_TRY(fy_offload_set_shards(x, from_whole_buffer, x));
  if (micro >= x->max_micro) return fy_error_set(FY_ERR_INVALID, "micro-batch %d of at most %d", micro, x->max_micro);
  int p = x->parity;
  x->parity ^= 1;
  // The op calls, batch and staging of this parity were used two passes ago.
  FY_TRY(fy_event_sync(x->pass_done[p]));
  FY_TRY(async_status(x));
  int64_t bt = g->B * g->T, rows = kv ? n : bt;
  int32_t *s = x->staging[p];
  memcpy(s, batch->inputs, (size_t)rows * 4);
  memcpy(s + bt, batch->targets, (size_t)rows * 4);
  if (batch->mask) memcpy(s + 2 * bt, batch->mask, (size_t)rows * 4);
  if (kv) {  // OPT's learned positions start at 2 (fy_engine_positions)
    for (int64_t i = 0; i < n; i++) s[3 * bt + i] = (int32_t)(fy_kv_cache_len(kv) + i + 2);
  } else {
    fy_engine_positions(s + 3 * bt, batch->mask, g->B, g->T);
  }
  // (profiling: the compute stream was idle since the last step's end, the host waiting for its
  // norm; evaluation's passes are no step's)
  FY_TRY(fy_wait_profile_gap_end(x->wprof, FY_STALL_NORM));
  fy_wait_profile_enable(x->wprof, x->profiling && !forward_alone);
  FY_TRY(fy_copy_async(x->copy_in, x->dbatch_mem[p], s, (size_t)(4 * bt) * 4));
  FY_TRY(fy_event_record(x->batch_ready[p], x->copy_in));
  FY_TRY(fy_wait_timed(x->wprof, x->compute, x->batch_ready[p], FY_STALL_LOAD, -1, NULL));
  struct fy_dev_batch *db = &x->dbatch[p];
  db->mask = batch->mask ? x->dbatch_mem[p] + 2 * bt : NULL;
  db->row0 = batch->row0;
  db->no_dropout = forward_alone;
  const int64_t pass_start = x->pos;
  if (a0 == 0) {
    x->loss_sums[micro] = 0;
    if (x->aux_sums) x->aux_sums[micro] = 0;
  }
  if (x->zeroed) memset(x->zeroed, 0, (size_t)g->n_params * sizeof *x->zeroed);
  fy_device_cache_begin_pass(x->cache);
  memset(x->dev_bwd_done, 0, (size_t)l->n_chunks * sizeof *x->dev_bwd_done);
  if (x->chome && !m->cparams_fresh) {  // the master weights were set (initialised, loaded, resumed)
    FY_TRY(fy_stream_sync(x->optim));
    if (x->dup_down) FY_TRY(fy_stream_sync(x->dup_down));  // (a device update's copies home)
    FY_TRY(fy_stream_sync(x->copy_in));
    for (int c = 0; c < l->n_chunks; c++) {
      FY_TRY(compute_copy_all(x, x->chome[c], c, x->gather_buf));
      if (x->chome_alt && x->chome_alt[c])  // both hold the weights
        FY_TRY(compute_copy_all(x, x->chome_alt[c], c, x->gather_buf));
    }
    m->cparams_fresh = true;
  }
  if (!x->dev_uploaded) {  // the device's chunks take the host's weights (initialised or loaded)
    for (int c = 0; c < x->n_dev; c++) {
      FY_TRY(fy_copy_async(x->copy_in, x->dev_w[c], home_weights(x, c), (size_t)l->chunks[c].used * 4));
      if (x->dev_w16[c]) FY_TRY(fy_copy_async(x->copy_in, x->dev_w16[c], x->chome[c], (size_t)l->chunks[c].used * x->esize));
    }
    FY_TRY(fy_event_record(x->batch_ready[p], x->copy_in));
    FY_TRY(fy_stream_wait(x->compute, x->batch_ready[p]));
    x->dev_uploaded = true;
  }

  float *base[FY_OP_MAX_PARAMS];
  int chunk_of[FY_OP_MAX_PARAMS];
  for (int a = a0; a < a1; a++) {
    const struct fy_action *act = &x->actions[a];
    const struct fy_op *op = &g->ops[act->op];
    struct fy_op_call *c = &x->calls[p][a];
    *c = (struct fy_op_call){.m = m, .op = act->op, .batch = db, .loss_scale = loss_scale, .st = FY_OK};
    if (kv) fy_kv_cache_rows(m, act->op, n, c);
    if (kv && op->kind == FY_OP_CROSS_ENTROPY) continue;  // (decoding reads the logits; the loss has no chunks)
    int nk = 0;
    for (int k = l->op_first[act->op]; k < l->op_first[act->op + 1]; k++) {
      chunk_of[nk] = l->op_chunks[k];
      if (chunk_of[nk] < x->n_dev)  // the weights the kernels read: the master, or its 16-bit copy
        base[nk] = x->dev_w16[chunk_of[nk]] ? x->dev_w16[chunk_of[nk]] : x->dev_w[chunk_of[nk]];
      else
        FY_TRY(fy_device_cache_acquire(x->cache, x->pos++, chunk_of[nk], &base[nk]));
      nk++;
    }
    for (int k = 0; k < op->n_params; k++) {
      const struct fy_param *pp = &g->params[op->params[k]];
      for (int j = 0; j < nk; j++) {
        if (chunk_of[j] != pp->chunk) continue;
        c->w[k] = c->g[k] = (float *)((char *)base[j] + (size_t)pp->chunk_offset * x->esize);
        if (pp->chunk < x->n_dev)  // kept apart from the weights
          c->g[k] = (float *)((char *)x->dev_g[pp->chunk] + (size_t)pp->chunk_offset * x->esize);
      }
    }
    if (act->kind == FY_ACT_FORWARD) {
      c->loss_sum = &x->loss_sums[micro];
      c->aux_sum = x->aux_sums ? &x->aux_sums[micro] : NULL;
    }
    if (op->kind == FY_OP_MOE && x->moe && nk > 0) FY_TRY(moe_experts(x, act, c, micro, base[0]));
    // A pipeline stage's part of a gradient whose first write is another stage's (the tied
    // embedding on the first stage): from zero, as that stage's part starts (fy_offload_update sums them).
    for (int k = 0; x->zero_first && act->kind == FY_ACT_BACKWARD && k < op->n_params; k++) {
      const int i = op->params[k];
      if (!x->zero_first[i] || x->zeroed[i]) continue;
      x->zeroed[i] = true;
      FY_TRY(x->dev->ops->memset_async(x->compute, c->g[k], 0, (size_t)g->params[i].numel * x->esize));
    }
    if (kv && op->kind == FY_OP_ATTENTION) {  // against the cache (GPU kernels, on the compute stream)
      FY_TRY(fy_kv_cache_attend(kv, m, act->op, n));
    } else if (launches_kernels(m)) {  // GPU kernels: launched now, on the compute stream, in order
      (act->kind == FY_ACT_BACKWARD ? m->kernels->op_backward : m->kernels->op_forward)(c);
      if (c->st != FY_OK) return c->st;
    } else {  // CPU kernels: host functions on the compute stream's thread
      FY_TRY(fy_stream_enqueue(x->compute, act->kind == FY_ACT_BACKWARD ? fy_op_call_backward : fy_op_call_forward, c));
    }
    if (x->staged && a == a1 - 1) FY_TRY(fy_event_record(x->boundary, x->compute));
    for (int j = 0; j < nk; j++) {
      if (chunk_of[j] < x->n_dev) {
        if (act->kind == FY_ACT_BACKWARD && ++x->dev_bwd_done[chunk_of[j]] == l->chunks[chunk_of[j]].n_users_bwd)
          FY_TRY(device_grads_done(x, chunk_of[j], micro));
        continue;
      }
      enum fy_chunk_state st = fy_device_cache_release(x->cache, chunk_of[j], act->kind == FY_ACT_BACKWARD);
      if (st != FY_CHUNK_READY_FOR_REDUCE) continue;
      if (x->sums_on_device) FY_TRY(kernels_sumsq(x, chunk_of[j], base[j]));
      FY_TRY(write_back(x, chunk_of[j], micro > 0));
    }
    FY_TRY(fy_device_cache_prefetch(x->cache, x->pos - 1));
  }
  if (forward_alone) x->pos = pass_start + fy_trace_length(x->trace);
  FY_TRY(fy_event_record(x->pass_done[p], x->compute));
  return FY_OK;
}

static fy_status run_pass(struct fy_offload *x, const struct fy_batch *batch, int micro, float loss_scale,
                          bool forward_alone, struct fy_kv_cache *kv, int64_t n) {
  if (x->staged)
    return fy_error_set(FY_ERR_INVALID, "a pipeline stage's engine runs half-passes (fy_offload_stage_pass)");
  const int a1 = forward_alone ? x->m->graph->n_ops : x->n_actions;
  return run_actions(x, batch, micro, loss_scale, forward_alone, kv, n, 0, a1);
}

fy_status fy_offload_micro(struct fy_offload *x, const struct fy_batch *batch, int micro, float loss_scale) {
  return run_pass(x, batch, micro, loss_scale, false, NULL, 0);
}

fy_status fy_offload_stage_pass(struct fy_offload *x, const struct fy_batch *batch, int micro, bool forward,
                                float loss_scale) {
  if (!x->staged) return fy_error_set(FY_ERR_INVALID, "fy_offload_stage_pass: not a pipeline stage's engine");
  // A step's first half-pass starts the trace's step again (a step of fewer micro-batches than the
  // schedule's left the rest of the last one unread).
  const int64_t len = fy_trace_length(x->trace);
  if (forward && micro == 0 && len > 0 && x->pos % len != 0) x->pos += len - x->pos % len;
  const int p = x->parity, a0 = forward ? 0 : x->n_fwd, a1 = forward ? x->n_fwd : x->n_actions;
  FY_TRY(run_actions(x, batch, micro, loss_scale, false, NULL, 0, a0, a1));
  // A GPU's messages are ordered on its streams after the kernels (runtime/pipeline_cuda.h): the
  // host goes on at once, as a resident stage's does (its launches report their errors; the host
  // functions' come with the next half-pass or fy_offload_stage_losses).
  if (launches_kernels(x->m)) return FY_OK;
  // The host sends: it waits for the last op's result alone, not for what follows it on the
  // compute stream, nor for the write-backs, loads and updates on the other streams.
  FY_TRY(fy_event_sync(x->boundary));
  FY_TRY(async_status(x));
  for (int a = a0; a < a1; a++)
    if (x->calls[p][a].st != FY_OK) return x->calls[p][a].st;
  return FY_OK;
}

fy_status fy_offload_stage_losses(struct fy_offload *x, int n, double *loss_sums) {
  if (!x->staged) return fy_error_set(FY_ERR_INVALID, "fy_offload_stage_losses: not a pipeline stage's engine");
  if (n > x->max_micro) return fy_error_set(FY_ERR_INVALID, "%d micro-batches of at most %d", n, x->max_micro);
  FY_TRY(fy_stream_sync(x->compute));  // (the losses are summed in stream order: a GPU's by a host function)
  FY_TRY(async_status(x));
  for (int i = 0; i < n; i++) loss_sums[i] = x->loss_sums[i];
  return FY_OK;
}

fy_status fy_offload_stage_forward(struct fy_offload *x, const struct fy_batch *batch, double *loss_sum) {
  if (!x->staged) return fy_error_set(FY_ERR_INVALID, "fy_offload_stage_forward: not a pipeline stage's engine");
  // From a step's start in the trace (its first half-pass is a forward on every stage), which the
  // pass's end skips to the next step's start (run_actions, forward_alone).
  const int64_t len = fy_trace_length(x->trace);
  if (len > 0 && x->pos % len != 0) x->pos += len - x->pos % len;
  const int p = x->parity;
  FY_TRY(run_actions(x, batch, 0, 1.0f, true, NULL, 0, 0, x->n_fwd));
  FY_TRY(fy_event_sync(x->pass_done[p]));
  FY_TRY(async_status(x));
  for (int a = 0; a < x->n_fwd; a++)
    if (x->calls[p][a].st != FY_OK) return x->calls[p][a].st;
  *loss_sum = x->loss_sums[0];
  return FY_OK;
}

// ---- the optimizer, per chunk on the optimizer stream ----

static void sumsq_fn(void *arg) {
  struct chunk_job *j = arg;
  struct fy_offload *x = j->x;
  const struct fy_graph *g = x->m->graph;
  int c = j->chunk;
  const float *grad = j->grads;
  if (!grad) {
    fy_status st = disk_io(x, false, c, 0, x->disk_g, (size_t)span(x, c) * 4, x->req_g);
    if (st != FY_OK) {
      async_fail(x, st);
      return;
    }
    grad = x->disk_g;
  }
  // Each parameter's part in [lo, lo + span): all of it without sharding.
  int64_t lo = c < x->n_dev ? 0 : x->lo, hi = lo + (c < x->n_dev ? x->m->layout->chunks[c].used : span(x, c));
  for (int k = x->param_first[c]; k < x->param_first[c + 1]; k++) {
    const struct fy_param *p = &g->params[x->param_ids[k]];
    int64_t a = p->chunk_offset > lo ? p->chunk_offset : lo;
    int64_t b = p->chunk_offset + p->numel < hi ? p->chunk_offset + p->numel : hi;
    double *out = c < x->n_dev ? &x->dev_sums[x->param_ids[k]] : &x->sumsq[x->param_ids[k]];
    if (a >= b) *out = 0.0;
    else if (grads_bf16(x, c)) *out = fy_sumsq_bf16((const uint16_t *)grad + (a - lo), b - a);
    else *out = fy_sumsq(grad + (a - lo), b - a);
  }
}

// The same sum, order and clipping rule as fy_optimizer_grad_norm and fy_optimizer_step.
static void norm_fn(void *arg) {
  struct chunk_job *j = arg;
  struct fy_offload *x = j->x;
  struct step_args *a = &x->args[j->q];
  const struct fy_graph *g = x->m->graph;
  double s[2] = {0, 0};  // whole parameters, tensor-parallel slices
  for (int i = 0; i < g->n_params; i++) {
    if (g->params[i].absent || (x->norm_skip && x->norm_skip[i])) continue;  // (another stage's)
    s[g->params[i].split_dim >= 0] += i == x->tied && x->tied_sumsq_set                    ? x->tied_sumsq
                                      : g->params[i].chunk < x->n_dev || x->sums_on_device ? x->host_sums[i]
                                                                                           : x->sumsq[i];
  }
  // Every rank's sums, added in rank order (the same bits on every rank): the shards over the
  // data-parallel ranks, then the slices over the tensor-parallel ones. Doubles travel as words.
  fy_status st = FY_OK;
  // The blocks' gathers and reduce-scatters of this step ran before this (grad_ready). One that
  // failed on its stream is only recorded on its communicator (NCCL's abort lets the stream go on),
  // and left gradients that were never summed: no update may use them, and the step fails.
  // So may the ops' tensor-parallel sums on the compute stream (a GPU's), whose passes are done.
  if (x->sharded && x->c_gather) st = fy_comm_status(x->c_gather);
  if (st == FY_OK && x->sharded && x->c_scatter) st = fy_comm_status(x->c_scatter);
  if (st == FY_OK && x->m->tp_comm) st = fy_comm_status(x->m->tp_comm);
  if (st == FY_OK && x->sharded) {
    double all[2 * x->world];
    if ((st = fy_comm_all_gather(x->c_optim, s, all, 4, FY_COMM_F32, NULL)) == FY_OK) {
      s[0] = s[1] = 0;
      for (int r = 0; r < x->world; r++) s[0] += all[2 * r], s[1] += all[2 * r + 1];
    }
  }
  if (st == FY_OK && g->tp > 1) {
    double all[g->tp];
    if ((st = fy_comm_all_gather(x->c_optim_tp, &s[1], all, 2, FY_COMM_F32, NULL)) == FY_OK) {
      s[1] = 0;
      for (int r = 0; r < g->tp; r++) s[1] += all[r];
    }
  }
  if (st == FY_OK && x->c_stage) {  // a pipeline's stages, added in stage order (the same bits on each)
    const int n = fy_comm_size(x->c_stage);
    double mine = s[0] + s[1], all[n];
    if ((st = fy_comm_all_gather(x->c_stage, &mine, all, 2, FY_COMM_F32, NULL)) == FY_OK) {
      s[0] = s[1] = 0;
      for (int r = 0; r < n; r++) s[0] += all[r];
    }
  }
  if (st != FY_OK) {
    async_fail(x, st);
    a->norm = NAN;
    a->skip = true;
    if (x->host_scale) x->host_scale[2 * j->q + 1] = 1.0f;  // the device chunks skip too
    return;
  }
  a->norm = sqrt(s[0] + s[1]) * fabs((double)a->grad_scale);
  a->skip = !isfinite(a->norm);
  a->scale = a->grad_scale;
  if (!a->skip && a->h.clip > 0) {
    double coef = a->h.clip / (a->norm + 1e-6);
    if (coef < 1.0) a->scale = (float)((double)a->grad_scale * coef);
  }
  if (x->host_scale) {  // for the device chunks' updates
    x->host_scale[2 * j->q] = a->scale;
    x->host_scale[2 * j->q + 1] = a->skip ? 1.0f : 0.0f;
  }
}

// Disk chunk c's set of m and v buffers (disk_m, disk_v, req_m, req_v).
static int disk_set(const struct fy_offload *x, int c) {
  return (c - (x->m->layout->n_chunks - x->n_disk_chunks)) & 1;
}

// Starts reading disk chunk c's m and v (and with disk_master its master weights) into its set
// (whose requests are idle).
static fy_status disk_read_mv(struct fy_offload *x, int c) {
  const int b = disk_set(x, c);
  const size_t used = state_bytes(x, c);
  fy_status st = fy_disk_read_async(x->disk, x->disk_handle[c], disk_off(x, c, 1), x->disk_m[b], used, x->req_m[b]);
  if (st == FY_OK) st = fy_disk_read_async(x->disk, x->disk_handle[c], disk_off(x, c, 2), x->disk_v[b], used, x->req_v[b]);
  if (st == FY_OK && x->disk_master)
    st = fy_disk_read_async(x->disk, x->disk_handle[c], disk_off(x, c, 3), x->disk_w[b], (size_t)span(x, c) * 4,
                            x->req_w[b]);
  return st;
}

// Waits for set b's requests (m, v, and with disk_master the master's); the first error.
static fy_status disk_wait_set(struct fy_offload *x, int b) {
  fy_status s1 = fy_disk_wait(x->req_m[b]), s2 = fy_disk_wait(x->req_v[b]);
  fy_status s3 = x->disk_master ? fy_disk_wait(x->req_w[b]) : FY_OK;
  return s1 != FY_OK ? s1 : s2 != FY_OK ? s2 : s3;
}

// Parameter ranges (n, saying which decay with 1: chunk_ranges, a device update's piece) with weight
// decay wd where a parameter decays, written to the scratch after them (n more).
static struct fy_adamw_range *with_decay(struct fy_adamw_range *ranges, int n, float wd) {
  struct fy_adamw_range *r = ranges + n;
  for (int i = 0; i < n; i++) {
    r[i] = ranges[i];
    r[i].weight_decay = r[i].weight_decay != 0.0f ? wd : 0.0f;
  }
  return r;
}

// Chunk c's parameter ranges (x->ranges[c]) with weight decay wd.
static struct fy_adamw_range *decayed_ranges(struct fy_offload *x, int c, float wd) {
  return with_decay(x->ranges[c], x->n_ranges[c], wd);
}

// The host's AdamW of chunk c's elements [lo, hi) (its part, or a piece of it; the buffers hold
// [lo, hi)): master params, m and v mm, vv in the state format, from the fp32 gradients gg, or
// with copy16 from the bf16 gradients there, which receive the next bf16 weights in the same pass;
// step a's arguments with the gradient scale `scale`. Compressed state updates the buffers at
// once, a range a parameter: ranges (n_ranges, flagged as chunk_ranges', of [lo, hi)).
static fy_status host_update(struct fy_offload *x, const struct step_args *a, int c, float *params, float *mm, float *vv,
                             const float *gg, void *copy16, int64_t lo, int64_t hi, float scale,
                             struct fy_adamw_range *ranges, int n_ranges) {
  const struct fy_graph *g = x->m->graph;
  if (x->sf != FY_STATE_F32) {
    const struct fy_adamw_range *r = with_decay(ranges, n_ranges, a->h.weight_decay);
    return copy16 ? fy_adamw_state_update_bf16(x->sf, params, mm, vv, copy16, hi - lo, r, n_ranges, a->lr,
                                               a->h.beta1, a->h.beta2, a->h.eps, a->t, scale)
                  : fy_adamw_state_update(x->sf, params, mm, vv, gg, hi - lo, r, n_ranges, a->lr, a->h.beta1,
                                          a->h.beta2, a->h.eps, a->t, scale);
  }
  // AdamW is elementwise: a parameter's part in [lo, hi) is updated as the whole would be.
  for (int k = x->param_first[c]; k < x->param_first[c + 1]; k++) {
    const struct fy_param *p = &g->params[x->param_ids[k]];
    int64_t b0 = p->chunk_offset > lo ? p->chunk_offset : lo;
    int64_t b1 = p->chunk_offset + p->numel < hi ? p->chunk_offset + p->numel : hi;
    if (b0 >= b1) continue;
    int64_t o = b0 - lo;
    float wd = p->decay ? a->h.weight_decay : 0.0f;
    if (copy16)  // the bf16 gradients in, the next bf16 weights out, in one pass
      fy_adamw_update_bf16(params + o, mm + o, vv + o, (uint16_t *)copy16 + o, b1 - b0, a->lr, a->h.beta1, a->h.beta2,
                           a->h.eps, wd, a->t, scale);
    else
      fy_adamw_update(params + o, mm + o, vv + o, gg + o, b1 - b0, a->lr, a->h.beta1, a->h.beta2, a->h.eps, wd, a->t,
                      scale);
  }
  return FY_OK;
}

static void adamw_fn(void *arg) {
  struct chunk_job *j = arg;
  struct fy_offload *x = j->x;
  const struct step_args *a = &x->args[j->q];
  int c = j->chunk;
  // A device chunk takes the scale and the skip flag from device memory, as the kernels do.
  const float *dscale = c < x->n_dev ? x->dev_scale + 2 * j->q : NULL;
  if (dscale ? dscale[1] != 0.0f : a->skip) {  // (no disk request is in flight: the step's updates all skip)
    fy_status st = grads_in_copy(x, c) ? compute_copy_all(x, j->copy, c, x->disk_w[0]) : FY_OK;  // weights again
    if (st != FY_OK) async_fail(x, st);
    return;
  }
  const float scale = dscale ? dscale[0] : a->scale;
  size_t used = (size_t)span(x, c) * 4, sbytes = state_bytes(x, c);
  float *gg = (float *)j->grads, *mm = x->m_home[c], *vv = x->v_home[c];
  float *params = home_weights(x, c);
  int64_t lo = x->lo, hi = x->lo + span(x, c);
  const bool bf16_in_copy = grads_bf16(x, c);
  if (c < x->n_dev) {  // on the device, with its weights
    mm = x->dev_m[c];
    vv = x->dev_v[c];
    params = x->dev_w[c];
    lo = 0;
    hi = x->m->layout->chunks[c].used;
  } else if (!mm) {  // state on disk: m and v read (ahead, but for the step's first disk chunk)
    const int b = disk_set(x, c);
    mm = x->disk_m[b];
    vv = x->disk_v[b];
    if (x->disk_master) params = x->disk_w[b];  // (the master weights read with them)
    fy_status st = x->disk_read_ahead == c ? FY_OK : disk_read_mv(x, c);
    x->disk_read_ahead = -1;
    fy_status s2 = disk_wait_set(x, b);
    if (st == FY_OK) st = s2;
    if (st == FY_OK && !gg) {  // (fp32 gradients on disk)
      gg = x->disk_g;
      st = disk_io(x, false, c, disk_off(x, c, 0), gg, used, x->req_g);
    }
    if (st != FY_OK) {
      disk_drain(x);
      async_fail(x, st);
      return;
    }
  }
  fy_status ust = host_update(x, a, c, params, mm, vv, gg, bf16_in_copy ? j->copy : NULL, lo, hi, scale,
                              x->ranges ? x->ranges[c] : NULL, x->ranges ? x->n_ranges[c] : 0);
  if (ust != FY_OK) async_fail(x, ust);
  if (c < x->n_dev && x->dev_w16[c])  // the device's 16-bit copy (lo is 0)
    to_payload(x, x->dev_w16[c], params, hi);
  else if (x->chome && !bf16_in_copy)
    compute_copy(x, j->copy, params, lo, hi);
  if (c >= x->n_dev && !x->m_home[c]) {
    // m and v (and with disk_master the master weights) go back to disk while the next disk
    // chunk's are read into the other set (once that set's writes, of the chunk before this one,
    // are done); the step's last one waits for all.
    const int b = disk_set(x, c);
    fy_status st = fy_disk_write_async(x->disk, x->disk_handle[c], disk_off(x, c, 1), mm, sbytes, x->req_m[b]);
    if (st == FY_OK) st = fy_disk_write_async(x->disk, x->disk_handle[c], disk_off(x, c, 2), vv, sbytes, x->req_v[b]);
    if (st == FY_OK && x->disk_master)
      st = fy_disk_write_async(x->disk, x->disk_handle[c], disk_off(x, c, 3), params, used, x->req_w[b]);
    fy_status w2 = disk_wait_set(x, b ^ 1);
    if (st == FY_OK) st = w2;
    if (st == FY_OK && c + 1 < x->m->layout->n_chunks && (st = disk_read_mv(x, c + 1)) == FY_OK)
      x->disk_read_ahead = c + 1;
    if (st != FY_OK || c + 1 == x->m->layout->n_chunks) {
      fy_status d = disk_drain(x);
      if (st == FY_OK) st = d;
    }
    if (st != FY_OK) async_fail(x, st);
  }
}

// A speculated chunk's update (spec_chunks) before the norm is known: the step's arguments with
// the scale of a step that neither clips nor skips, from the chunk's master, m, v and gradients
// into its spare slot k, which nothing reads until the norm has settled it (spec_settle). The
// out-of-place update writes byte for byte what adamw_fn's in-place one would (test_adamw_state),
// so the bits are the exact step's when the norm keeps it.
static void spec_fn(void *arg) {
  struct spec_job *j = arg;
  struct fy_offload *x = j->x;
  const struct step_args *a = &x->args[j->q];
  const int c = j->chunk, nr = x->n_ranges[c];
  const struct fy_adamw_range *r = decayed_ranges(x, c, a->h.weight_decay);
  const bool bf16_in_copy = grads_bf16(x, c);
  const int64_t n = span(x, c);
  fy_status st = fy_adamw_state_update_into(
      x->sf, j->w_out, j->m_out, j->v_out, bf16_in_copy ? (uint16_t *)j->c_out : NULL, j->w, j->m, j->v,
      bf16_in_copy ? NULL : (const float *)j->grads, bf16_in_copy ? (const uint16_t *)j->grads : NULL, n, r, nr, a->lr,
      a->h.beta1, a->h.beta2, a->h.eps, a->t, a->grad_scale);
  if (st != FY_OK) {
    async_fail(x, st);
    return;
  }
  if (j->c_out && !bf16_in_copy) compute_copy(x, j->c_out, j->w_out, x->lo, x->lo + n);
}

// After the norm of step q is known (the host waited for it): the speculated chunks' updates
// stand when the step neither clipped nor skipped (the scale they used is the step's), and each
// chunk's buffers swap with its slot's, the slot's event becoming the chunk's home_ready; else
// each is updated again in place, in chunk order, from its untouched master, m, v and gradients
// (the skip path rebuilds the copy over the gradients), after the step's other updates. The next
// step speculates only when this one's updates stood.
static fy_status spec_settle(struct fy_offload *x, int q) {
  const struct step_args *a = &x->args[q];
  const bool keep = !a->skip && a->scale == a->grad_scale;
  x->spec_steps++;
  x->spec_off_next = !keep;
  if (!keep) {
    x->spec_redone++;
    for (int c = 0; c < x->m->layout->n_chunks; c++) {
      if (x->spec_slot[c] < 0) continue;
      x->jobs[q][c].grads = chunk_grads(x, c);
      x->jobs[q][c].copy = x->chome ? x->chome[c] : NULL;
      FY_TRY(fy_stream_enqueue(x->optim, adamw_fn, &x->jobs[q][c]));
      FY_TRY(fy_event_record(x->home_ready[c], x->optim));
    }
    return FY_OK;
  }
  for (int k = 0; k < x->n_spec; k++) {
    const int c = x->spec_chunk[k];
    float *t = x->w_home[c];
    x->w_home[c] = x->spare_w[k];
    x->spare_w[k] = t;
    t = x->m_home[c];
    x->m_home[c] = x->spare_m[k];
    x->spare_m[k] = t;
    t = x->v_home[c];
    x->v_home[c] = x->spare_v[k];
    x->spare_v[k] = t;
    if (x->chome) {
      void *u = x->chome[c];
      x->chome[c] = x->spare_c[k];
      x->spare_c[k] = u;
    }
    x->home[c] = x->chome ? (const float *)x->chome[c] : x->w_home[c];
    fy_event *e = x->home_ready[c];
    x->home_ready[c] = x->spec_done[k];
    x->spec_done[k] = e;
  }
  return FY_OK;
}

// Chunk c's parameters' sums of squares into dev_sums, from its gradients at grad in device memory
// (dtype grads_dtype): kernels launched on the compute stream.
static fy_status kernels_sumsq(struct fy_offload *x, int c, const void *grad) {
  const struct fy_graph *g = x->m->graph;
  enum fy_dtype dt = grads_dtype(x, c);
  for (int k = x->param_first[c]; k < x->param_first[c + 1]; k++) {
    const struct fy_param *p = &g->params[x->param_ids[k]];
    FY_TRY(x->m->kernels->chunk_sumsq(x->m, &x->dev_sums[x->param_ids[k]],
                                      (const char *)grad + p->chunk_offset * fy_dtype_size(dt), dt, p->numel));
  }
  return FY_OK;
}

// A device chunk's sums of squares, into dev_sums: kernels launched on the compute stream (GPU), or
// sumsq_fn there.
static fy_status device_sumsq(struct fy_offload *x, int q, int c) {
  x->jobs[q][c].grads = chunk_grads(x, c);
  if (!launches_kernels(x->m)) return fy_stream_enqueue(x->compute, sumsq_fn, &x->jobs[q][c]);
  return kernels_sumsq(x, c, chunk_grads(x, c));
}

// The device ranges (dev_ranges: the device chunks', and the device updates' pieces', compressed
// state) with weight decay wd, copied there on the compute stream when it changed (once: the
// decay is the run's).
static fy_status dev_ranges_sync(struct fy_offload *x, float wd) {
  if (x->dev_ranges_set && x->dev_ranges_wd == wd) return FY_OK;
  for (int d = 0; d < x->m->layout->n_chunks; d++) {
    if (!x->dev_ranges[d]) continue;
    const struct fy_adamw_range *r = decayed_ranges(x, d, wd);
    FY_TRY(fy_copy_async(x->compute, x->dev_ranges[d], r, (size_t)x->n_ranges[d] * sizeof *r));
  }
  for (int j = 0; j < x->n_pieces; j++) {
    struct dup_piece *p = &x->dup_pieces[j];
    if (!p->dev_ranges) continue;
    const struct fy_adamw_range *r = with_decay(p->ranges, p->n_ranges, wd);
    FY_TRY(fy_copy_async(x->compute, p->dev_ranges, r, (size_t)p->n_ranges * sizeof *r));
  }
  FY_TRY(fy_stream_sync(x->compute));  // (the host's ranges may change again only after the copy)
  x->dev_ranges_set = true;
  x->dev_ranges_wd = wd;
  return FY_OK;
}

// AdamW of chunk c's elements [lo, hi) held in device memory (master w, m and v, gradients grads,
// the next 16-bit copy w16 or NULL; each buffer holds [lo, hi): a device chunk's used part, or a
// piece of a host-tier chunk's part as the host keeps it, this rank's shard with sharding), with
// step q's arguments and the scale and skip flag at scale_skip (device memory): the kernels,
// launched on the stream they launch on now. Compressed state updates the buffers at once, a
// range a parameter: dev_ranges (n_ranges, with the step's decay: dev_ranges_sync) in device memory.
static fy_status kernels_adamw(struct fy_offload *x, int q, int c, float *w, void *mo, void *v, const void *grads,
                               void *w16, int64_t lo, int64_t hi, const float *scale_skip,
                               const struct fy_adamw_range *dev_ranges, int n_ranges) {
  const struct fy_graph *g = x->m->graph;
  const struct step_args *a = &x->args[q];
  const char *gg = grads;
  const enum fy_dtype dt = grads_dtype(x, c);
  if (x->sf != FY_STATE_F32)
    return x->m->kernels->chunk_adamw_state(x->m, x->sf, w, mo, v, gg, dt, w16, hi - lo, dev_ranges, n_ranges, a->lr,
                                            a->h.beta1, a->h.beta2, a->h.eps, a->t, scale_skip);
  for (int k = x->param_first[c]; k < x->param_first[c + 1]; k++) {  // (elementwise: a part as the whole)
    const struct fy_param *p = &g->params[x->param_ids[k]];
    const int64_t b0 = p->chunk_offset > lo ? p->chunk_offset : lo;
    const int64_t b1 = p->chunk_offset + p->numel < hi ? p->chunk_offset + p->numel : hi;
    if (b0 >= b1) continue;
    const int64_t o = b0 - lo;
    void *p16 = w16 ? (char *)w16 + (size_t)o * x->esize : NULL;
    FY_TRY(x->m->kernels->chunk_adamw(x->m, w + o, (float *)mo + o, (float *)v + o, gg + (size_t)o * fy_dtype_size(dt),
                                      dt, p16, b1 - b0, a->lr, a->h.beta1, a->h.beta2, a->h.eps,
                                      p->decay ? a->h.weight_decay : 0.0f, a->t, scale_skip));
  }
  return FY_OK;
}

// A device chunk's AdamW from the gradients grads, with step q's scale and skip flag from
// dev_scale: kernels (GPU) or adamw_fn on the compute stream.
static fy_status device_adamw(struct fy_offload *x, int q, int c, const void *grads) {
  x->jobs[q][c].grads = grads;
  x->jobs[q][c].copy = NULL;
  if (!launches_kernels(x->m)) return fy_stream_enqueue(x->compute, adamw_fn, &x->jobs[q][c]);
  if (x->sf != FY_STATE_F32) FY_TRY(dev_ranges_sync(x, x->args[q].h.weight_decay));
  return kernels_adamw(x, q, c, x->dev_w[c], x->dev_m[c], x->dev_v[c], grads, x->dev_w16[c], 0,
                       x->m->layout->chunks[c].used, x->dev_scale + 2 * q, x->dev_ranges ? x->dev_ranges[c] : NULL,
                       x->ranges ? x->n_ranges[c] : 0);
}

// --optimizer-lag: the device chunks' update from the gradients kept by an earlier
// fy_offload_update (dev_gl), with that step's arguments (parity dev_pending_q, whose norm that
// call waited for), on the compute stream after everything enqueued there so far.
static fy_status device_pending_update(struct fy_offload *x) {
  if (!x->dev_pending) return FY_OK;
  const int q = x->dev_pending_q;
  FY_TRY(fy_copy_async(x->compute, x->dev_scale + 2 * q, x->host_scale + 2 * q, 2 * sizeof(float)));
  for (int c = 0; c < x->n_dev; c++) FY_TRY(device_adamw(x, q, c, x->dev_gl[c]));
  FY_TRY(fy_event_record(x->dev_updates_done[q], x->compute));
  x->dev_pending = false;
  return FY_OK;
}

// --optimizer-lag, after a step's updates are enqueued: the next step reads each host or disk
// chunk's other copy (written by the update of the step before) and its gradients land there.
static void swap_copies(struct fy_offload *x) {
  for (int c = x->n_dev; c < x->m->layout->n_chunks; c++) {
    void *t = x->chome[c];
    x->chome[c] = x->chome_alt[c];
    x->chome_alt[c] = t;
    fy_event *e = x->home_ready[c];
    x->home_ready[c] = x->home_ready_alt[c];
    x->home_ready_alt[c] = e;
    x->home[c] = (const float *)x->chome[c];
  }
}

// Waits for the forward pass of parity p and returns how its kernels went.
static fy_status forward_done(struct fy_offload *x, int p) {
  FY_TRY(fy_event_sync(x->pass_done[p]));
  FY_TRY(async_status(x));
  for (int a = 0; a < x->m->graph->n_ops; a++)
    if (x->calls[p][a].st != FY_OK) return x->calls[p][a].st;
  return FY_OK;
}

fy_status fy_offload_forward(struct fy_offload *x, const struct fy_batch *batch, double *loss_sum) {
  const int p = x->parity;  // the pass's calls, whose status tells how its kernels went
  FY_TRY(run_pass(x, batch, 0, 1.0f, true, NULL, 0));
  FY_TRY(forward_done(x, p));
  *loss_sum = x->loss_sums[0];
  return FY_OK;
}

fy_status fy_offload_decode(struct fy_offload *x, struct fy_kv_cache *kv, const int32_t *tokens, int64_t n,
                            const float **logits) {
  if (!x->forward_only || !launches_kernels(x->m))
    return fy_error_set(FY_ERR_UNSUPPORTED, "decoding offloaded: a forward-only engine on a GPU");
  FY_TRY(fy_kv_cache_check(kv, x->m, tokens, n));
  const int p = x->parity;
  const struct fy_batch batch = {.B = 1, .T = n, .inputs = (int32_t *)tokens, .targets = (int32_t *)tokens};  // (read)
  FY_TRY(run_pass(x, &batch, 0, 1.0f, true, kv, n));
  FY_TRY(forward_done(x, p));
  return fy_kv_cache_advance(kv, x->m, n, logits);
}

enum { TAG_TIED_GRAD = 1 << 22 };  // (the stages' point-to-point messages of the tied gradient)

// A pipeline's tied embedding: this rank's part of its gradient, summed between the first stage
// (the embedding's part) and the last (the lm_head's), the same bits on both: lm_head's + the
// embedding's, the order one rank adds them in (16-bit gradients, a GPU's coming home over the
// 16-bit copy: added in fp32, rounded once, as the resident GPU stages' sum). The stages' chunk
// layouts have the same chunk size and the tied weight at the start of chunk 0 (its first use is
// the first op), so both ends hold the same elements of it (with sharding, this data-parallel
// rank's). After the step's passes.
static fy_status sum_tied(struct fy_offload *x) {
  const int n_stages = fy_comm_size(x->c_stage), me = fy_comm_rank(x->c_stage);
  if (n_stages == 1 || (me != 0 && me != n_stages - 1)) return FY_OK;
  const struct fy_param *p = &x->m->graph->params[x->tied];
  const int c = p->chunk;
  const enum fy_dtype dt = grads_dtype(x, c);
  if (dt != FY_F32 && dt != FY_BF16)
    return fy_error_set(FY_ERR_UNSUPPORTED, "a pipeline's tied embedding with %s gradients: not supported yet",
                        fy_dtype_name(dt));
  const size_t es = fy_dtype_size(dt);
  const int64_t lo = c < x->n_dev ? 0 : x->lo, hi = lo + state_elems(x, c);
  const int64_t a = p->chunk_offset > lo ? p->chunk_offset : lo,
                b = p->chunk_offset + p->numel < hi ? p->chunk_offset + p->numel : hi;
  if (a >= b) return FY_OK;  // (none of it in this rank's shard, on either end)
  FY_TRY(fy_stream_sync(x->compute));
  FY_TRY(fy_stream_sync(x->copy_out));  // (its write-backs are home)
  FY_TRY(fy_stream_sync(x->optim));  // (the last step's updates done with the disk's requests)
  FY_TRY(async_status(x));
  const size_t bytes = (size_t)(b - a) * es;
  void *mine = malloc(bytes), *theirs = malloc(bytes);
  char *home = (char *)chunk_grads(x, c);
  fy_status st = mine && theirs ? FY_OK : fy_error_set(FY_ERR_NOMEM, "out of memory");
  // Wherever they live (host tier, device, disk): through the copy engine or the disk.
  if (st == FY_OK && home) st = fy_copy_async(x->copy_out, mine, home + (size_t)(a - lo) * es, bytes);
  if (st == FY_OK && home) st = fy_stream_sync(x->copy_out);
  if (st == FY_OK && !home) st = disk_io(x, false, c, disk_off(x, c, 0) + (size_t)(a - lo) * 4, mine, bytes, x->req_g);
  const bool last = me == n_stages - 1;
  const int peer = last ? 0 : n_stages - 1;
  struct fy_comm_req *req = NULL;
  if (st == FY_OK) st = fy_comm_isend(x->c_stage, mine, bytes, peer, TAG_TIED_GRAD, &req);
  if (st == FY_OK) st = fy_comm_recv(x->c_stage, theirs, bytes, peer, TAG_TIED_GRAD);
  fy_status w = fy_comm_wait(x->c_stage, req);
  if (st == FY_OK) st = w;
  // (mine may still be read by the send until it is waited for: done)
  const void *lm = last ? mine : theirs, *emb = last ? theirs : mine;
  if (st == FY_OK && dt == FY_F32)
    for (int64_t i = 0; i < b - a; i++) ((float *)theirs)[i] = ((const float *)lm)[i] + ((const float *)emb)[i];
  if (st == FY_OK && dt == FY_BF16)
    for (int64_t i = 0; i < b - a; i++)
      ((uint16_t *)theirs)[i] = fy_f32_to_bf16(fy_bf16_to_f32(((const uint16_t *)lm)[i]) +
                                               fy_bf16_to_f32(((const uint16_t *)emb)[i]));
  // The norm's sum of squares of it (the first stage counts it), where the kernels took it from
  // the block of one end's part alone (sums_on_device): taken again here, of the sum.
  if (st == FY_OK && x->sums_on_device && c >= x->n_dev && dt == FY_BF16) {
    x->tied_sumsq = fy_sumsq_bf16(theirs, b - a);
    x->tied_sumsq_set = true;
  }
  if (st == FY_OK && home) st = fy_copy_async(x->copy_out, home + (size_t)(a - lo) * es, theirs, bytes);
  if (st == FY_OK && home) st = fy_stream_sync(x->copy_out);
  if (st == FY_OK && !home) st = disk_io(x, true, c, disk_off(x, c, 0) + (size_t)(a - lo) * 4, theirs, bytes, x->req_g);
  free(mine);
  free(theirs);
  return st == FY_OK ? FY_OK : fy_error_wrap(st, "summing the tied embedding's gradient between the pipeline's ends");
}

// ---- device updates ----

// Sim: device update piece j's AdamW on its staging set as a host function on dup_run, the scale
// and skip flag read from dup_scale as the kernels read them; then the next 16-bit copy from the
// master (a skipped step's from the master as it was: the chunk's copy at home holds gradients).
static void dup_fn(void *arg) {
  struct dup_job *j = arg;
  struct fy_offload *x = j->x;
  struct dup_piece *p = &x->dup_pieces[j->piece];
  const int c = p->chunk, s = j->piece & 1;
  const float *ss = x->dup_scale + 2 * j->q;
  if (ss[1] == 0.0f) {
    const bool b16 = grads_bf16(x, c);
    fy_status st = host_update(x, &x->args[j->q], c, x->dup_w[s], x->dup_m[s], x->dup_v[s], x->dup_g[s],
                               b16 ? x->dup_g[s] : NULL, x->lo + p->off, x->lo + p->off + p->n, ss[0], p->ranges,
                               p->n_ranges);
    if (st != FY_OK) {
      async_fail(x, st);
      return;
    }
  }
  if (x->dup_w16[s]) to_payload(x, x->dup_w16[s], x->dup_w[s], p->n);
}

// Piece p's m or v between its chunk's buffer at home (state_elems of the chunk) and a staging
// buffer `staged` of the piece's elements, on stream st (to the device, or home): the stored
// values of its elements, and with 8-bit state its blocks' scales, where a buffer of the piece's
// size keeps them (the piece starts on a block: fy_chunk_piece_elems).
static fy_status dup_copy_moment(struct fy_offload *x, fy_stream *st, const struct dup_piece *p, void *home,
                                 void *staged, bool to_device) {
  const size_t es = x->sf == FY_STATE_F32 ? 4 : x->sf == FY_STATE_BF16 ? 2 : 1;
  char *h = (char *)home + (size_t)p->off * es, *d = staged;
  FY_TRY(to_device ? fy_copy_async(st, d, h, (size_t)p->n * es) : fy_copy_async(st, h, d, (size_t)p->n * es));
  if (x->sf != FY_STATE_Q8) return FY_OK;
  h = (char *)home + fy_q8_scales_offset(state_elems(x, p->chunk)) + (size_t)(p->off / FY_Q8_BLOCK) * 4;
  d = (char *)staged + fy_q8_scales_offset(p->n);
  const size_t sb = (size_t)fy_q8_blocks(p->n) * 4;
  return to_device ? fy_copy_async(st, d, h, sb) : fy_copy_async(st, h, d, sb);
}

// Device update piece j's copies in, on dup_up, into staging set j % 2: its gradients once its
// chunk's are home and the update of piece j - 2 has read the set's, then its master, m and v,
// each once piece j - 2's copy of it is home (so that the copies in follow the copies home a
// buffer behind, not a piece). They need no norm, so the first two pieces' are enqueued before it
// is known.
static fy_status dup_upload(struct fy_offload *x, int j) {
  const struct dup_piece *p = &x->dup_pieces[j];
  const int c = p->chunk, s = j & 1;
  const size_t gs = fy_dtype_size(grads_dtype(x, c));
  FY_TRY(fy_stream_wait(x->dup_up, x->dup_ran[s]));
  FY_TRY(fy_stream_wait(x->dup_up, x->grad_ready[c]));
  FY_TRY(fy_copy_async(x->dup_up, x->dup_g[s], (const char *)chunk_grads(x, c) + (size_t)p->off * gs, (size_t)p->n * gs));
  FY_TRY(fy_stream_wait(x->dup_up, x->dup_free[s][0]));
  FY_TRY(fy_copy_async(x->dup_up, x->dup_w[s], home_weights(x, c) + p->off, (size_t)p->n * 4));
  FY_TRY(fy_stream_wait(x->dup_up, x->dup_free[s][1]));
  FY_TRY(dup_copy_moment(x, x->dup_up, p, x->m_home[c], x->dup_m[s], true));
  FY_TRY(fy_stream_wait(x->dup_up, x->dup_free[s][2]));
  FY_TRY(dup_copy_moment(x, x->dup_up, p, x->v_home[c], x->dup_v[s], true));
  return fy_event_record(x->dup_in[s], x->dup_up);
}

// Step q's device updates, once the host knows its norm (host_scale holds the scale and the skip
// flag): for each piece in order, AdamW on dup_run after its copies in and piece j - 2's 16-bit
// copy home (kernels with the 16-bit copy first taken from the master, which a skipped step leaves
// as it is), its master, m, v and 16-bit copy home on dup_down, each buffer's dup_free after its
// copy, and after a chunk's last piece the chunk's home_ready; the copies in of the piece two
// ahead after them (pieces 0 and 1 were enqueued before the norm).
static fy_status dup_updates(struct fy_offload *x, int q) {
  const bool kernels = launches_kernels(x->m);
  FY_TRY(fy_copy_async(x->dup_run, x->dup_scale + 2 * q, x->host_scale + 2 * q, 2 * sizeof(float)));
  if (kernels && x->sf != FY_STATE_F32) FY_TRY(dev_ranges_sync(x, x->args[q].h.weight_decay));
  for (int j = 0; j < x->n_pieces; j++) {
    const struct dup_piece *p = &x->dup_pieces[j];
    const int c = p->chunk, s = j & 1;
    const int64_t lo = x->lo + p->off;
    FY_TRY(fy_stream_wait(x->dup_run, x->dup_in[s]));
    FY_TRY(fy_stream_wait(x->dup_run, x->dup_free[s][3]));  // (piece j - 2's 16-bit copy home)
    if (kernels) {
      const struct fy_model_kernels *kt = x->m->kernels;
      kt->launch_on(x->m, x->dup_run);
      fy_status st = x->dup_w16[s] ? kt->chunk_to16(x->m, x->dup_w16[s], x->dup_w[s], p->n) : FY_OK;
      if (st == FY_OK)
        st = kernels_adamw(x, q, c, x->dup_w[s], x->dup_m[s], x->dup_v[s], x->dup_g[s], x->dup_w16[s], lo, lo + p->n,
                           x->dup_scale + 2 * q, p->dev_ranges, p->n_ranges);
      kt->launch_on(x->m, x->compute);
      FY_TRY(st);
    } else {
      FY_TRY(fy_stream_enqueue(x->dup_run, dup_fn, &x->dup_jobs[q][j]));
    }
    FY_TRY(fy_event_record(x->dup_ran[s], x->dup_run));
    FY_TRY(fy_stream_wait(x->dup_down, x->dup_ran[s]));
    FY_TRY(fy_copy_async(x->dup_down, home_weights(x, c) + p->off, x->dup_w[s], (size_t)p->n * 4));
    FY_TRY(fy_event_record(x->dup_free[s][0], x->dup_down));
    FY_TRY(dup_copy_moment(x, x->dup_down, p, x->m_home[c], x->dup_m[s], false));
    FY_TRY(fy_event_record(x->dup_free[s][1], x->dup_down));
    FY_TRY(dup_copy_moment(x, x->dup_down, p, x->v_home[c], x->dup_v[s], false));
    FY_TRY(fy_event_record(x->dup_free[s][2], x->dup_down));
    if (x->chome)
      FY_TRY(fy_copy_async(x->dup_down, (char *)x->chome[c] + (size_t)p->off * x->esize, x->dup_w16[s],
                           (size_t)p->n * x->esize));
    FY_TRY(fy_event_record(x->dup_free[s][3], x->dup_down));
    if (j + 1 == x->n_pieces || x->dup_pieces[j + 1].chunk != c) FY_TRY(fy_event_record(x->home_ready[c], x->dup_down));
    if (j + 2 < x->n_pieces) FY_TRY(dup_upload(x, j + 2));
  }
  return fy_event_record(x->dup_done[q], x->dup_down);
}

fy_status fy_offload_update(struct fy_offload *x, const struct fy_adamw *h, float lr, int64_t t,
                            float grad_scale, double *norm, double *loss_sum, bool *skipped) {
  if (x->forward_only) return fy_error_set(FY_ERR_INVALID, "fy_offload_update: a forward-only engine");
  if (x->staged && x->tied >= 0) FY_TRY(sum_tied(x));
  int q = x->step_parity;
  x->step_parity ^= 1;
  FY_TRY(fy_event_sync(x->updates_done[q]));  // the arguments of two steps ago are free
  FY_TRY(fy_event_sync(x->dev_updates_done[q]));
  if (x->n_dup > 0) FY_TRY(fy_event_sync(x->dup_done[q]));
  x->args[q] = (struct step_args){.h = *h, .lr = lr, .t = t, .grad_scale = grad_scale};
  int nc = x->m->layout->n_chunks;
  // Chunks on the device: their sums of squares and updates run there, on the compute stream.
  for (int c = 0; c < x->n_dev; c++) FY_TRY(device_sumsq(x, q, c));
  if (x->dev_sums)
    FY_TRY(fy_copy_async(x->compute, x->host_sums, x->dev_sums, (size_t)x->m->graph->n_params * sizeof(double)));
  FY_TRY(fy_event_record(x->dev_sumsq_done, x->compute));
  for (int i = 0; i < nc; i++) {  // as their gradients come home
    int c = x->grad_order[i];
    if (c < x->n_dev || x->sums_on_device) continue;
    x->jobs[q][c].grads = chunk_grads(x, c);
    FY_TRY(fy_stream_wait(x->norm_stream, x->grad_ready[c]));
    FY_TRY(fy_stream_enqueue(x->norm_stream, sumsq_fn, &x->jobs[q][c]));
  }
  FY_TRY(fy_stream_wait(x->norm_stream, x->dev_sumsq_done));
  FY_TRY(fy_stream_enqueue(x->norm_stream, norm_fn, &x->jobs[q][0]));
  FY_TRY(fy_event_record(x->norm_ready, x->norm_stream));
  // Speculative updates: the chunks' updates as their gradients come home, before the norm.
  const bool spec = x->n_spec > 0 && !x->spec_off_next;
  for (int k = 0; spec && k < x->n_spec; k++) {
    const int c = x->spec_chunk[k];
    x->spec_jobs[q][k] = (struct spec_job){.x = x, .chunk = c, .q = q, .w = x->w_home[c], .m = x->m_home[c],
                                           .v = x->v_home[c], .grads = chunk_grads(x, c), .w_out = x->spare_w[k],
                                           .m_out = x->spare_m[k], .v_out = x->spare_v[k],
                                           .c_out = x->chome ? x->spare_c[k] : NULL};
    FY_TRY(fy_stream_wait(x->optim, x->grad_ready[c]));
    FY_TRY(fy_stream_enqueue(x->optim, spec_fn, &x->spec_jobs[q][k]));
    FY_TRY(fy_event_record(x->spec_done[k], x->optim));
  }
  for (int j = 0; j < x->n_pieces && j < 2; j++) FY_TRY(dup_upload(x, j));  // (the device updates' first copies in)
  if (x->norm_stream != x->optim) FY_TRY(fy_stream_wait(x->optim, x->norm_ready));  // (the updates' scale)
  if (x->lag) {  // the device chunks' update of the step before (its scale is known), then this one's kept
    FY_TRY(device_pending_update(x));
    for (int c = 0; c < x->n_dev; c++) {
      float *t = x->dev_g[c];
      x->dev_g[c] = x->dev_gl[c];
      x->dev_gl[c] = t;
    }
    x->dev_pending = x->n_dev > 0;
    x->dev_pending_q = q;
  } else {
    FY_TRY(fy_wait_timed(x->wprof, x->compute, x->norm_ready, FY_STALL_NORM, -1, NULL));
    if (x->n_dev > 0) FY_TRY(fy_copy_async(x->compute, x->dev_scale + 2 * q, x->host_scale + 2 * q, 2 * sizeof(float)));
    for (int c = 0; c < x->n_dev; c++) FY_TRY(device_adamw(x, q, c, chunk_grads(x, c)));
    FY_TRY(fy_event_record(x->dev_updates_done[q], x->compute));
  }
  for (int c = x->n_dev; c < nc; c++) {
    if (spec && x->spec_slot[c] >= 0) continue;  // (updated already, or again by spec_settle)
    if (x->n_dup > 0 && x->dup_slot[c] >= 0) continue;  // (the device's: dup_updates)
    if (x->sums_on_device) FY_TRY(fy_stream_wait(x->optim, x->grad_ready[c]));  // (not waited for by a sum)
    x->jobs[q][c].grads = chunk_grads(x, c);
    x->jobs[q][c].copy = x->chome ? x->chome[c] : NULL;
    FY_TRY(fy_stream_enqueue(x->optim, adamw_fn, &x->jobs[q][c]));
    FY_TRY(fy_event_record(x->home_ready[c], x->optim));
  }
  if (x->lag) swap_copies(x);
  FY_TRY(fy_wait_profile_gap_begin(x->wprof));  // (the step's work on the compute stream is enqueued)
  FY_TRY(fy_event_sync(x->norm_ready));
  FY_TRY(async_status(x));
  if (spec)  // (the next pass's loads are enqueued after this: they see the settled buffers)
    FY_TRY(spec_settle(x, q));
  else if (x->n_spec > 0)  // a step that did not speculate: the next does if this one would have stood
    x->spec_off_next = x->args[q].skip || x->args[q].scale != x->args[q].grad_scale;
  if (x->n_dup > 0) FY_TRY(dup_updates(x, q));
  FY_TRY(fy_event_record(x->updates_done[q], x->optim));  // (after spec_settle's redone updates)
  FY_TRY(fy_wait_profile_collect(x->wprof, false));
  *norm = x->args[q].norm;
  for (int i = 0; i < x->max_micro; i++) loss_sum[i] = x->loss_sums[i];
  for (int a = 0; a < x->n_actions; a++)
    for (int p = 0; p < 2; p++)
      if (x->calls[p][a].st != FY_OK) return x->calls[p][a].st;
  *skipped = x->args[q].skip;
  return FY_OK;
}

fy_status fy_offload_drain(struct fy_offload *x) {
  if (!x->lag) return fy_offload_sync(x);
  FY_TRY(device_pending_update(x));
  FY_TRY(fy_offload_sync(x));
  x->m->cparams_fresh = false;  // both copies of every chunk from the master weights, before the next pass
  return FY_OK;
}

fy_status fy_offload_sync(struct fy_offload *x) {
  fy_stream *s[] = {x->compute, x->copy_in, x->copy_out, x->sums, x->optim, x->dup_up, x->dup_run, x->dup_down};
  for (int i = 0; i < 8; i++)
    if (s[i]) FY_TRY(fy_stream_sync(s[i]));
  // The host's copy of the device's chunks (for checkpoints and saving), and of their 16-bit copy.
  if (x->dev_uploaded && x->copy_out) {
    for (int c = 0; c < x->n_dev; c++) {
      size_t used = (size_t)x->m->layout->chunks[c].used;
      FY_TRY(fy_copy_async(x->copy_out, home_weights(x, c), x->dev_w[c], used * 4));
      if (x->dev_w16[c]) FY_TRY(fy_copy_async(x->copy_out, x->chome[c], x->dev_w16[c], used * x->esize));
    }
    FY_TRY(fy_stream_sync(x->copy_out));
  }
  return async_status(x);
}

void fy_offload_spec_counts(const struct fy_offload *x, int *chunks, int64_t *steps, int64_t *redone) {
  *chunks = x->n_spec;
  *steps = x->spec_steps;
  *redone = x->spec_redone;
}

int fy_offload_device_updates(const struct fy_offload *x) { return x->n_dup; }

bool fy_offload_profile(struct fy_offload *x, bool on) {
  x->profiling = on && x->wprof;
  return x->wprof != NULL;
}

fy_status fy_offload_stalls(struct fy_offload *x, double out[FY_STALL_COUNT]) {
  FY_TRY(fy_offload_sync(x));
  FY_TRY(fy_wait_profile_gap_end(x->wprof, FY_STALL_NORM));  // (a gap still open ends here: not counted)
  FY_TRY(fy_stream_sync(x->compute));
  FY_TRY(fy_wait_profile_collect(x->wprof, true));
  fy_wait_profile_seconds(x->wprof, out);
  return FY_OK;
}

void fy_offload_stats(const struct fy_offload *x, struct fy_offload_stats *out) {
  *out = (struct fy_offload_stats){.n_blocks = x->n_blocks, .n_chunks = x->m->layout->n_chunks,
                                   .n_disk_chunks = x->n_disk_chunks, .n_device_chunks = x->n_dev,
                                   .chunk_bytes = (double)x->m->layout->chunk_elems * x->esize};
  fy_device_cache_stats(x->cache, &out->cache);
}

// Compressed state: chunk c's m (k 0) or v (k 1), its whole buffer (state_elems elements), read
// and decoded into dst, or encoded from src and stored, wherever it lives (through a host buffer).
static fy_status state_io(struct fy_offload *x, int c, int k, float *dst, const float *src) {
  const int64_t n = state_elems(x, c);
  const size_t nb = state_bytes(x, c);
  void *home = c < x->n_dev ? (void *)(k ? x->dev_v[c] : x->dev_m[c]) : (void *)(k ? x->v_home[c] : x->m_home[c]);
  void *buf = malloc(nb ? nb : 1);
  if (!buf) return fy_error_set(FY_ERR_NOMEM, "cannot allocate a chunk's optimizer state");
  fy_status st = FY_OK;
  if (src) fy_state_encode(x->sf, k ? FY_MOMENT_V : FY_MOMENT_M, buf, src, n);
  if (home) {  // host tier or device memory: through the copy engine either way
    st = fy_copy_async(x->copy_out, src ? home : buf, src ? buf : home, nb);
    if (st == FY_OK) st = fy_stream_sync(x->copy_out);
  } else {
    st = disk_io(x, src != NULL, c, disk_off(x, c, 1 + k), buf, nb, k ? x->req_v[0] : x->req_m[0]);
  }
  if (st == FY_OK && !src) fy_state_decode(x->sf, k ? FY_MOMENT_V : FY_MOMENT_M, dst, buf, n);
  free(buf);
  return st;
}

// fy_offload_adam_state in a compressed format: this rank's elements of the chunk decoded into m
// and v, or encoded from them (the buffer's padding as zeros).
static fy_status adam_state_compressed(struct fy_offload *x, int c, float *m, float *v, bool store) {
  const int64_t n = state_elems(x, c), at = c < x->n_dev ? 0 : x->lo;
  int64_t keep = x->m->layout->chunks[c].used - at;  // the elements that hold parameters
  if (keep > n) keep = n;
  if (keep <= 0) return FY_OK;  // padding only
  float *tmp = calloc((size_t)n, sizeof *tmp);
  if (!tmp) return fy_error_set(FY_ERR_NOMEM, "cannot allocate a chunk's optimizer state");
  fy_status st = FY_OK;
  for (int k = 0; k < 2 && st == FY_OK; k++) {
    float *mine = (k ? v : m) + at;
    if (store) {
      memcpy(tmp, mine, (size_t)keep * 4);
      st = state_io(x, c, k, NULL, tmp);
    } else if ((st = state_io(x, c, k, tmp, NULL)) == FY_OK) {
      memcpy(mine, tmp, (size_t)keep * 4);
    }
  }
  free(tmp);
  return st;
}

fy_status fy_offload_adam_state(struct fy_offload *x, int c, float *m, float *v, bool store) {
  if (x->sf != FY_STATE_F32) return adam_state_compressed(x, c, m, v, store);
  if (c < x->n_dev) {  // through the copy engines, as for any device memory
    size_t used = (size_t)x->m->layout->chunks[c].used * 4;
    FY_TRY(fy_copy_async(x->copy_out, store ? x->dev_m[c] : m, store ? m : x->dev_m[c], used));
    FY_TRY(fy_copy_async(x->copy_out, store ? x->dev_v[c] : v, store ? v : x->dev_v[c], used));
    return fy_stream_sync(x->copy_out);
  }
  // This rank's part: the shard, or without sharding the chunk's used elements.
  int64_t n = span(x, c);
  if (x->sharded) {
    n = x->m->layout->chunks[c].used - x->lo;
    if (n > x->S) n = x->S;
    if (n <= 0) return FY_OK;  // padding only
    m += x->lo;
    v += x->lo;
  }
  size_t used = (size_t)n * 4;
  if (x->m_home[c]) {  // host tier or device memory: through the copy engine either way
    FY_TRY(fy_copy_async(x->copy_out, store ? x->m_home[c] : m, store ? m : x->m_home[c], used));
    FY_TRY(fy_copy_async(x->copy_out, store ? x->v_home[c] : v, store ? v : x->v_home[c], used));
    return fy_stream_sync(x->copy_out);
  }
  FY_TRY(disk_io(x, store, c, disk_off(x, c, 1), m, used, x->req_m[0]));
  return disk_io(x, store, c, disk_off(x, c, 2), v, used, x->req_v[0]);
}

void fy_offload_shard(const struct fy_offload *x, int64_t *lo, int64_t *n) {
  *lo = x->lo;
  *n = x->S;
}

// Sharding: this rank's shard of chunk c's weights (which 0), m (1) or v (2) into dst (S floats).
static fy_status shard_out(struct fy_offload *x, int c, int which, float *dst) {
  size_t bytes = (size_t)x->S * 4;
  if (which == 0 && master_on_disk(x, c)) return master_read(x, c, dst);
  if (which == 0) {  // (span: without sharding the chunk's used part, which dst may end with)
    FY_TRY(fy_copy_async(x->copy_out, dst, x->w_home[c], (size_t)span(x, c) * 4));
    return fy_stream_sync(x->copy_out);
  }
  if (x->sf != FY_STATE_F32) return state_io(x, c, which - 1, dst, NULL);  // (S elements)
  float *src = which == 1 ? x->m_home[c] : x->v_home[c];
  if (src) {
    FY_TRY(fy_copy_async(x->copy_out, dst, src, bytes));
    return fy_stream_sync(x->copy_out);
  }
  return disk_io(x, false, c, disk_off(x, c, which), dst, bytes, which == 1 ? x->req_m[0] : x->req_v[0]);
}

// Sharding: chunk c's weights (which 0), m (1) or v (2) from every rank's shard, through the
// gather buffer, into dst (its used elements; NULL: this rank only takes part). A collective, on
// the optimizer's communicator (host memory; every stream is idle).
static fy_status gather_chunk(struct fy_offload *x, int c, int which, float *dst) {
  const struct fy_chunk_layout *l = x->m->layout;
  FY_TRY(shard_out(x, c, which, x->gather_buf + x->lo));
  fy_status st = fy_comm_all_gather(x->c_optim, x->gather_buf + x->lo, x->gather_buf, (size_t)x->S, FY_COMM_F32, NULL);
  if (st != FY_OK) return fy_error_wrap(st, "gathering the shards of chunk %d", c);
  if (dst) memcpy(dst, x->gather_buf, (size_t)l->chunks[c].used * 4);
  return FY_OK;
}

fy_status fy_offload_chunk_weights_out(struct fy_offload *x, int c, float *dst) {
  const struct fy_chunk_layout *l = x->m->layout;
  if (x->weights16) {  // the 16-bit copy, widened
    if (dst) fy_convert_to_f32(dst, x->chome[c], x->m->compute_dtype, (size_t)l->chunks[c].used);
    return FY_OK;
  }
  // Before the first micro-batch (or kept by the model), the weights are whole in the model's buffer.
  if (!x->own_weights || !x->taken) {
    if (dst) memcpy(dst, x->m->params + c * l->chunk_elems, (size_t)l->chunks[c].used * 4);
    return FY_OK;
  }
  if (x->sharded) return gather_chunk(x, c, 0, dst);
  // disk_master, one rank: the chunk's master in the host tier or on disk (span: its used part)
  return dst ? shard_out(x, c, 0, dst) : FY_OK;
}

fy_status fy_offload_chunk_state_out(struct fy_offload *x, int c, float *params, float *m, float *v) {
  FY_TRY(fy_offload_chunk_weights_out(x, c, params));
  if (!x->sharded) return m && v ? fy_offload_adam_state(x, c, m, v, false) : FY_OK;
  FY_TRY(gather_chunk(x, c, 1, m));  // every rank takes part, those with a destination keep it
  return gather_chunk(x, c, 2, v);
}

fy_status fy_offload_state_out(struct fy_offload *x, float *params, float *m, float *v) {
  FY_TRY(fy_offload_sync(x));
  int64_t ce = x->m->layout->chunk_elems;
  for (int c = 0; c < x->m->layout->n_chunks; c++)
    FY_TRY(fy_offload_chunk_state_out(x, c, params ? params + c * ce : NULL, m ? m + c * ce : NULL, v ? v + c * ce : NULL));
  return FY_OK;
}

void fy_offload_set_step(struct fy_offload *x, int64_t step) {
  struct fy_comm *cs[] = {x->c_gather, x->c_scatter, x->c_optim, x->c_stage};
  for (int i = 0; i < 4; i++)
    if (cs[i]) fy_comm_set_step(cs[i], step);
}

int64_t fy_offload_device_state_bytes(const struct fy_offload *x) { return x->device_state_bytes; }

int64_t fy_offload_state_bytes(const struct fy_offload *x) {
  const struct fy_chunk_layout *l = x->m->layout;
  int64_t on_dev = 0;  // weights, gradients, their sum, m, v, the 16-bit weights
  for (int i = 0; i < 6; i++)
    if ((i != 2 || x->max_micro > 1) && (i != 5 || x->chome)) on_dev += (int64_t)x->n_dev * (int64_t)dev_buf_bytes(x, i);
  int64_t rest = (int64_t)(l->n_chunks - x->n_dev) * (x->S * 4 * 2 + 2 * (int64_t)x->mb);  // weights, gradients, m, v
  for (int c = x->n_dev; c < l->n_chunks; c++)
    if (grads_in_copy(x, c)) rest -= x->S * 4;  // the gradients come home over the 16-bit copy
  int64_t copies = x->chome ? (int64_t)l->n_chunks * x->S * (int64_t)x->esize : 0;  // 16-bit weights
  // speculation's spare slots: master, m, v, 16-bit copy
  int64_t spare = (int64_t)x->n_spec * (x->S * 4 + 2 * (int64_t)x->mb + (x->chome ? x->S * (int64_t)x->esize : 0));
  return on_dev + rest + copies + spare;
}
