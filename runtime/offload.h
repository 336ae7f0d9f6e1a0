// Training with the model state off the device (docs/design.md, "One training step"): parameters live
// in chunks in the host tier; the device holds only a cache of chunk-sized blocks (memory/
// device_cache.h) plus the activations. Each op makes its chunks resident (a prefetch for the next
// ones already in flight on the copy stream), runs on the compute stream and releases them; in
// backward its gradients land over the weights in the block, and a chunk whose gradients are all
// in goes back to the host. The optimizer runs per chunk on a host stream, after the global norm,
// in first-use order, so that the next step's forward can start on the first chunks while later
// ones are still being updated. Each chunk's gradients and AdamW m and v live in the host tier or,
// for the last chunks when the host cannot hold them, on disk (with disk_master their fp32 master
// weights too, the host keeping only the 16-bit copy). With 16-bit compute (bf16 on a GPU)
// a chunk's compute payload is its weights in that dtype (docs/design.md, "Chunks"): a host copy that
// every update refreshes from the fp32 master is what crosses the link, and the kernels write the
// gradients over it in the block. With one micro-batch a step they come home as they are, over
// that copy, and AdamW turns them into the next weights there; with accumulation (or state on
// disk) they are widened to fp32 and summed.
//
// The kernels and the order of every floating-point operation are those of the resident path
// (runtime/engine.c, runtime/optimizer.c), so the placement changes speed and memory, never the
// numbers.
#ifndef FY_OFFLOAD_H
#define FY_OFFLOAD_H

#include <stdbool.h>

#include "memory/device_cache.h"
#include "memory/tier.h"
#include "runtime/comm.h"
#include "runtime/engine.h"
#include "runtime/optimizer.h"

struct fy_offload_opts {
  bool forward_only;            // evaluation: passes of forward only (fy_offload_forward); no
                                // gradients or AdamW state (n_device_chunks, n_disk_chunks 0)
  int prefetch;                 // distinct chunks to load ahead of use (0: on demand)
  int n_blocks;                 // device cache blocks; 0: as many as the device memory holds
  size_t device_reserve;        // device bytes the blocks leave free for the caller (ferry sample's
                                // key/value cache)
  int max_micro;                // micro-batches per step (gradient accumulation)
  struct fy_disk_tier *disk;    // where state goes that the host tier cannot hold
  int n_disk_chunks;            // the last n chunks keep gradients, m and v on disk (needs disk)
  // With 16-bit compute: the disk chunks' fp32 master weights live on disk too, in their slot
  // after m and v (this rank's shard with sharding), read and written with them in the optimizer's
  // double-buffered pass; the host keeps only their 16-bit copy (copies, with optimizer_lag), which
  // the device reads. The engine then keeps every chunk's master itself (as with sharding: the
  // model's whole buffer is taken by fy_offload_set_shards, or the model has none), and the
  // weights are read back through fy_offload_chunk_weights_out. Needs n_disk_chunks > 0.
  bool disk_master;
  int n_device_chunks;          // the first n chunks stay on the device with their gradients and
                                // AdamW state, and are updated there (on the compute stream); with
                                // 16-bit compute the kernels read a copy of their weights in it
  // Chunk sharding across the ranks of `comm` (the `zero` pattern, as ZeRO-3): with more than one
  // rank, every rank keeps 1/N of each chunk (weights and their 16-bit copy, gradients, m and v:
  // elements [rank*S, (rank+1)*S), S = chunk_elems / N, so chunk_elems must divide by 16 N); a load copies
  // the rank's shard to the block and all-gathers the rest from the other ranks; a write-back
  // reduce-scatters the gradients and moves only the rank's shard home; each rank updates its
  // shards. The shards live in the host tier (or on disk, as above), or with `shards_on_device`
  // in device memory (sharding without offloading). Not combinable with n_device_chunks.
  // NULL or one rank: no sharding. Not owned; the engine makes its own duplicates of it.
  // comm takes the host-side collectives (the gradient norm's sums, gathering the state for
  // checkpoints); block_comm, the same ranks in the same order, those on the blocks in device
  // memory, enqueued on the copy streams: an nccl communicator on a GPU. NULL: comm does both.
  struct fy_comm *comm, *block_comm;
  bool shards_on_device;
  // With tensor parallelism (m->graph->tp > 1): the tensor-parallel group, for the gradient norm's
  // sum over the slices (duplicated; m->tp_comm is the compute stream's). comm is then the
  // data-parallel group.
  struct fy_comm *tp_comm;
  // 1: the one-step-delayed update (as ZeRO-Offload's delayed parameter update): the update from
  // step s's gradients runs on the host while step s+1's passes run on the weights before it, so
  // the host optimizer hides under a whole step. Needs 16-bit compute and max_micro 1 (the
  // gradients come home over the weights' 16-bit copy; each host or disk chunk then has two, 2
  // bytes a parameter more; each device chunk keeps its gradients a step, esize bytes a parameter
  // of device memory). fy_offload_drain applies what is pending. 0: the exact step.
  int optimizer_lag;
  // Speculative updates: up to spec_chunks host-tier chunks (the first in the order the backward
  // completes their gradients; neither device nor disk chunks) are updated by the host optimizer
  // as soon as their gradients are home, before the norm is known, with the scale an unclipped
  // step has, out of place into a spare slot each (master, m, v, 16-bit copy). When the norm
  // shows the step neither clips nor skips, the slots swap roles and the update stands; else
  // those chunks are updated again from their untouched slots with the norm's scale. The bits are
  // the exact step's either way. After a step that clipped or skipped, the next step does not
  // speculate. Sharded ranks speculate on their shards (the norm, the same on every rank, settles
  // every rank's alike); so do pipeline stages (the norm is every stage's). Not with
  // optimizer_lag or shards on the device.
  int spec_chunks;
  // Device updates: up to device_updates host-tier chunks (the first in chunk order that are
  // neither speculated nor on disk) are updated by the device's kernels instead of the host's
  // optimizer: once the gradient norm is known, their fp32 master, m, v and gradients cross the
  // link in pieces (fy_chunk_piece_elems: a quarter of a chunk's part) to a staging set in device
  // memory (two sets, 4 + 2 x the moment's + the gradients' + the 16-bit copy's bytes an element
  // of a piece each), the device's AdamW (the device chunks' kernels, the
  // same bits) updates them, and master, m, v and the next 16-bit copy go home, on three streams
  // of their own. The host optimizer updates the other chunks meanwhile: the link's idle time
  // takes a share of the host's work. Sharded ranks update their shards so, pipeline stages their
  // chunks. Not with shards on the device or optimizer_lag. 0: none.
  int device_updates;
  // A pipeline stage (runtime/pipeline.h; the model made for it, fy_model_opts.pp): the engine runs
  // the graph's ops [stage_lo, stage_hi) alone, a micro-batch's forward and backward as two
  // half-passes (fy_offload_stage_pass), in the order schedule[0 .. n_schedule) gives for a step
  // (true: a forward; the cache's trace follows it). stage_comm, the pipeline's ranks in stage
  // order (duplicated), takes the gradient norm's sum over the stages and a tied embedding's
  // gradient, summed between the first and the last stage by fy_offload_update. stage_hi 0: none.
  int stage_lo, stage_hi;
  const bool *schedule;
  int n_schedule;
  struct fy_comm *stage_comm;
};

struct fy_offload;

// m must have been created on an offloading device with its state in a host tier
// (fy_model_opts.host); m->layout gives the chunks. Errors when the device cannot hold the
// smallest working set, with the minimum it would need.
fy_status fy_offload_create(struct fy_model *m, const struct fy_offload_opts *o, struct fy_offload **out);
void fy_offload_free(struct fy_offload *x);

// The device memory (bytes) the smallest working set needs: the blocks every op needs at once
// plus the activations and batch buffers.
size_t fy_offload_min_device_bytes(const struct fy_model *m);
int fy_offload_min_blocks(const struct fy_model *m);
// The same before anything is allocated, for a config and micro-batch (a rank's part of it with
// tensor parallelism over tp ranks, 1: none); elem_bytes is a block's
// bytes per element (4, or 2 for bf16 on a GPU, whose activations are then 16-bit too);
// chunk_elems 0 means the smallest chunk that holds
// the largest parameter group (the default when offloading), and *chunk_elems_out is the chunk
// size used; forward_only for evaluation; gpu for a GPU's kernels (flash attention, core/graph.h),
// their scratch, and its allocation granule.
fy_status fy_offload_plan_min_bytes(const struct fy_opt_config *cfg, int64_t B, int64_t T, int tp, bool recompute,
                                    bool forward_only, bool gpu, size_t elem_bytes, int64_t chunk_elems,
                                    size_t *min_bytes, int64_t *chunk_elems_out);

// With a 16-bit compute dtype and one micro-batch a step the chunks' gradients come home over
// their 16-bit weights (no fp32 gradients in the host tier); otherwise into fp32 gradients.
bool fy_offload_grads_in_copy(enum fy_dtype compute, int max_micro);

// Enqueues forward and backward of micro-batch `micro` (0-based within the step); its gradients
// are written (micro 0) or added to the host gradients. loss_scale as in fy_engine_backward.
fy_status fy_offload_micro(struct fy_offload *x, const struct fy_batch *batch, int micro, float loss_scale);
// A pipeline stage's half-pass of micro-batch `micro` (0-based within the step): its ops' forward
// (forward true) or their backward, whose gradients are written (micro 0) or added to the host
// gradients. Reads and writes the activations at m->acts and m->dacts. Where the host sends the
// messages (sim) it returns once the half-pass's last op is done (the activation leaving the
// stage, or the gradient of the one entering it, may then be sent), while the rest of the
// half-pass goes on: its chunks' gradients going home, the next chunks' loads. On a GPU it returns
// once the half-pass is enqueued: the messages go on streams ordered after its kernels
// (runtime/pipeline_cuda.h), and m->acts and m->dacts may then point elsewhere (its kernels took
// their addresses).
fy_status fy_offload_stage_pass(struct fy_offload *x, const struct fy_batch *batch, int micro, bool forward,
                                float loss_scale);
// After a step's half-passes: waits until they are computed (not for their write-backs) and
// copies micro-batches [0, n)'s sums of token losses to loss_sums (0 but on the last stage).
fy_status fy_offload_stage_losses(struct fy_offload *x, int n, double *loss_sums);
// A pipeline stage's forward half-pass as evaluation runs it (no dropout; validation between
// steps on a training stage, or ferry eval's forward-only stage): *loss_sum the batch's sum of
// token losses (0 but on the last stage). The trace's positions go on at the next step's start, as
// fy_offload_forward's do; the weights, gradients and AdamW state stay as they were.
fy_status fy_offload_stage_forward(struct fy_offload *x, const struct fy_batch *batch, double *loss_sum);
// Enqueues the optimizer for the step (global norm, clipping, AdamW per chunk) on gradients
// multiplied by grad_scale (1/loss scale), and waits until the norm is known. A norm that is not
// finite updates nothing and sets *skipped. loss_sum[i] receives micro-batch i's sum of token
// losses.
fy_status fy_offload_update(struct fy_offload *x, const struct fy_adamw *h, float lr, int64_t t,
                            float grad_scale, double *norm, double *loss_sum, bool *skipped);
// The forward of a batch through the same cache, prefetch and shards as training's, then waits
// for it; *loss_sum receives its sum of token losses. An evaluation engine (opts.forward_only)
// runs its passes so; a training engine runs the forward part of its pass without dropout
// (validation between steps: after fy_offload_update, before the next step's micro-batches), and
// its weights, gradients and AdamW state stay as they were.
fy_status fy_offload_forward(struct fy_offload *x, const struct fy_batch *batch, double *loss_sum);
// Incremental decoding through the chunk cache (ferry sample --offload), as fy_engine_decode does
// it resident: a forward pass of n tokens (the chunks loaded as fy_offload_forward loads them),
// their attention against kv, *logits the last one's. A forward-only engine on a GPU.
fy_status fy_offload_decode(struct fy_offload *x, struct fy_kv_cache *kv, const int32_t *tokens, int64_t n,
                            const float **logits);
// Waits until every enqueued piece of work is done (before reading or saving the weights).
fy_status fy_offload_sync(struct fy_offload *x);
// With optimizer_lag: applies the update still pending (the last step's gradients), so that the
// weights everywhere are those after every step so far (for a checkpoint, the end of a run), and
// syncs as fy_offload_sync; the next step then starts the lag again, reading those weights.
// Without: fy_offload_sync.
fy_status fy_offload_drain(struct fy_offload *x);
// Speculative updates (fy_offload_opts.spec_chunks): the chunks that take them, the steps that
// speculated and those of them whose norm had the updates redone (clipped or skipped).
void fy_offload_spec_counts(const struct fy_offload *x, int *chunks, int64_t *steps, int64_t *redone);
// Device updates (fy_offload_opts.device_updates): the host-tier chunks the device updates.
int fy_offload_device_updates(const struct fy_offload *x);

// AdamW state of one chunk (m and v point at chunk_elems floats each), wherever it lives (host
// tier, disk, device): copies it out, or with `store`, in; with sharding only this rank's shard
// of it. Only between steps (after fy_offload_sync), and `store` only before the first step.
fy_status fy_offload_adam_state(struct fy_offload *x, int chunk, float *m, float *v, bool store);
// Sharding (or disk_master): sets this rank's shard of every chunk's weights from fill, which writes elements
// [lo, hi) of the flat parameter buffer into dst (fy_model_source_fill, in the trainer),
// instead of taking the shards from the model's whole buffer (which may be NULL: model opts'
// no_params; freed if not). Before the first micro-batch.
fy_status fy_offload_set_shards(struct fy_offload *x, fy_status (*fill)(void *ctx, int64_t lo, int64_t hi, float *dst),
                                void *ctx);
// The elements [*lo, *lo + *n) of every chunk that this rank keeps the state of: its shard, or
// without sharding the whole chunk.
void fy_offload_shard(const struct fy_offload *x, int64_t *lo, int64_t *n);
// The whole training state in the layout's order (chunk c at c * chunk_elems): weights, AdamW m
// and v. Without sharding a copy; with sharding a collective that every rank calls, gathering
// chunk by chunk through one chunk-sized buffer, so a rank that passes NULL (one not writing the
// checkpoint) needs no whole-model memory. Between steps.
fy_status fy_offload_state_out(struct fy_offload *x, float *params, float *m, float *v);
// The same for chunk c alone: its used elements into params, m and v (chunk_elems floats each;
// NULL: not kept). A collective with sharding, which every rank calls for the same chunks in the
// same order. Between steps, after fy_offload_sync.
fy_status fy_offload_chunk_state_out(struct fy_offload *x, int c, float *params, float *m, float *v);
// Chunk c's weights alone (the same rules).
fy_status fy_offload_chunk_weights_out(struct fy_offload *x, int c, float *dst);
// Labels the collectives enqueued from now on with the step (1-based) for error messages.
void fy_offload_set_step(struct fy_offload *x, int64_t step);
// Device memory the model state kept there took (chunks kept on the device, or shards with
// shards_on_device), measured on the device's counter.
int64_t fy_offload_device_state_bytes(const struct fy_offload *x);
// Bytes of model state this rank keeps (weights, gradients, m and v, wherever they live).
int64_t fy_offload_state_bytes(const struct fy_offload *x);

struct fy_offload_stats {
  int n_blocks, n_chunks, n_disk_chunks, n_device_chunks;
  double chunk_bytes;
  struct fy_device_cache_stats cache;
};
void fy_offload_stats(const struct fy_offload *x, struct fy_offload_stats *out);
// Mixtures of experts: the experts' weights loaded into the device cache so far, each expert of a
// mixture's chunk counted once a load (*loaded), and as many as loading whole chunks would have
// moved (*total: the mixtures' experts times their chunks' loads from home). Only the experts
// that got tokens in a pass are loaded (docs/offloading.md, "Mixtures of experts").
void fy_offload_experts(const struct fy_offload *x, int64_t *loaded, int64_t *total);
// Micro-batch `micro`'s load-balancing terms of the last step (struct fy_loss's aux_sum), after
// fy_offload_update.
double fy_offload_aux_sum(const struct fy_offload *x, int micro);
// ferry train --profile: the compute stream's waits in training passes are timed from now on (on
// devices with timers: sim and cuda; false where they cannot be), charged to their causes
// (core/stall.h) as ferry plan predicts them.
bool fy_offload_profile(struct fy_offload *x, bool on);
// The seconds the compute stream waited so far, by cause (syncs the engine first).
fy_status fy_offload_stalls(struct fy_offload *x, double out[FY_STALL_COUNT]);

#endif
