// The device chunk cache (docs/design.md, "Chunks"): a fixed number of chunk-sized blocks on the
// device; chunks are loaded into them on a copy stream ahead of use and evicted by Belady's rule
// over the recorded access trace. Everything is ordered with events, in CUDA's model: the host
// only decides (deterministically, following the trace) and enqueues; it never waits here.
//
// Streams: loads run on `copy_in`, write-backs on `copy_out`, ops on `compute`. A block is reused
// only after the compute work that read its previous chunk and any write-back of it are done.
//
// A chunk's life in one pass (memory/chunk.h states): FREE -> (load) -> HOLD or COMPUTE; an op
// acquires it (COMPUTE) and releases it: HOLD in forward (clean, evictable), HOLD_AFTER_BWD while
// backward has written some gradients over its weights, READY_FOR_REDUCE after its last
// backward use, when the caller writes its gradients back and the block is freed. A chunk in
// HOLD_AFTER_BWD may still be evicted when a demand load needs its block: its block (gradients
// and weights mixed) is spilled to host memory and loaded back from there on its next use. So
// the tied embedding, used at both ends of backward, need not sit on the device in between.
#ifndef FY_DEVICE_CACHE_H
#define FY_DEVICE_CACHE_H

#include <stdbool.h>
#include <stdint.h>

#include "core/device.h"
#include "core/wait_profile.h"
#include "memory/cache.h"
#include "memory/chunk.h"
#include "memory/tier.h"

struct fy_device_cache_opts {
  struct fy_device *dev;
  fy_stream *compute, *copy_in, *copy_out;
  int n_blocks;
  int prefetch;                 // distinct chunks to load ahead of use (0: on demand only)
  const struct fy_trace *trace; // chunk accesses of one pass (a micro-batch), repeating
  const float *const *home;     // home[c]: host memory a chunk's weights are loaded from
  fy_event *const *home_ready;  // home_ready[c]: recorded when home[c] may be read (or NULL)
  float *staging;               // host memory of chunk_elems floats for accumulating write-backs
  // Payload bytes per element: 4 (fp32, the default) or 2 (bf16: the blocks hold the weights in
  // bf16, home[c] is a bf16 copy of them, and the gradients the kernels write over them in bf16
  // are widened to fp32 on their way home, in a host function after the copy to `staging`).
  size_t elem_bytes;
  // Host memory for spilled chunks (NULL spill_alloc: HOLD_AFTER_BWD chunks are pinned instead).
  fy_status (*spill_alloc)(void *ctx, size_t nbytes, void **out);
  void (*spill_free)(void *ctx, void *p, size_t nbytes);
  void *spill_ctx;
  // Chunk sharding across ranks (the `zero` pattern): this rank keeps elements [shard_off,
  // shard_off + shard_elems) of every chunk at home. A load copies home[c] (shard_elems elements)
  // to that place in the block and then enqueues gather(ctx, c, block, copy_in), which fills in
  // the other ranks' shards; a write-back first enqueues scatter(ctx, c, block, copy_out), which
  // sums the ranks' gradients into this rank's shard of the block, and moves only that shard
  // home. shard_elems 0: no sharding (home[c] holds the whole chunk).
  int64_t shard_off, shard_elems;
  fy_status (*gather)(void *ctx, int chunk, float *block, fy_stream *s);
  fy_status (*scatter)(void *ctx, int chunk, float *block, fy_stream *s);
  void *shard_ctx;
  // A load from home (not a spilled chunk's) through the caller (NULL: none): load_home may enqueue
  // the copies itself on s, from home[chunk] into block, and set *done; otherwise the whole chunk
  // (sharded: this rank's shard, before the gather) is copied. (runtime/offload.c: a mixture of
  // experts' chunk without its experts' weights, which are loaded after the router ran, only for
  // the experts that got tokens; sharded, under expert parallelism, the shard less the other ranks'
  // experts.)
  fy_status (*load_home)(void *ctx, int chunk, void *block, fy_stream *s, bool *done);
  void *load_ctx;
  // Profiling (NULL: none): the compute stream's waits for loads are timed, charged to chunk
  // loads, less the part spent while the load itself waited for home_ready, charged to
  // home_cause[chunk] (NULL: all FY_STALL_OPTIMIZER; the disk's chunks FY_STALL_DISK, say).
  struct fy_wait_profile *profile;
  const enum fy_stall *home_cause;
};

struct fy_device_cache;

fy_status fy_device_cache_create(struct fy_chunk_layout *layout, const struct fy_device_cache_opts *o,
                                 struct fy_device_cache **out);
void fy_device_cache_free(struct fy_device_cache *c);

// Access `pos` of the trace: makes `chunk` resident (loading it if needed), makes the compute
// stream wait for it, and marks it COMPUTE. Returns the address of its block.
fy_status fy_device_cache_acquire(struct fy_device_cache *c, int64_t pos, int chunk, float **block);
// The op that acquired `chunk` has been enqueued on compute. backward: it was one of the chunk's
// backward uses. Returns the chunk's new state; READY_FOR_REDUCE asks for fy_device_cache_write_back.
enum fy_chunk_state fy_device_cache_release(struct fy_device_cache *c, int chunk, bool backward);
// Moves a READY_FOR_REDUCE chunk's block (its gradients; with sharding, this rank's shard of their
// sum over ranks) to host memory dst (fp32) on copy_out, after the work enqueued on compute so far: dst = block, or dst += block with
// accumulate (through the staging buffer, as is every bf16 block); records `done` on copy_out
// when dst holds the result. The chunk becomes FREE.
fy_status fy_device_cache_write_back(struct fy_device_cache *c, int chunk, float *dst, bool accumulate,
                                     fy_event *done);
// The same, moving the payload as it is (elem_bytes an element, no widening) to dst: bf16
// gradients over the chunk's bf16 copy at home, for example.
fy_status fy_device_cache_write_back_payload(struct fy_device_cache *c, int chunk, void *dst, fy_event *done);
// Loads up to `prefetch` chunks used after access pos that are not resident, while a block is free
// or Belady's victim is next used later than the chunk to load.
fy_status fy_device_cache_prefetch(struct fy_device_cache *c, int64_t pos);
// A new pass begins (the next micro-batch): backward use counts restart.
void fy_device_cache_begin_pass(struct fy_device_cache *c);

struct fy_device_cache_stats { int64_t loads, prefetches, evictions, write_backs, spills; };
void fy_device_cache_stats(const struct fy_device_cache *c, struct fy_device_cache_stats *out);

#endif
