#include "memory/device_cache.h"

#include <stdlib.h>
#include <string.h>

#include "core/dtype.h"

struct block {
  float *ptr;
  int chunk;                 // -1 when free
  fy_event *loaded;          // copy_in: the chunk's weights are in
  fy_event *used;            // compute: the last op reading the block is done
  fy_event *saved;           // copy_out: the block's gradients have left
  int held;                  // profiling: the load's timed wait for home_ready (-1: none)
};

struct spill_buf {
  float *ptr;
  int owner;            // chunk whose content it holds, -1 when free
  fy_event *written;    // copy_out: the spill is in
  fy_event *read;       // copy_in: the reload has read it (the buffer may be reused)
};

struct accumulate {
  float *dst;
  const void *src;   // staging: the payload's elements
  enum fy_dtype st;  // their dtype: f32, or bf16 for a bf16 payload
  int64_t n;
  bool add;          // dst += src, else dst = src (widened)
};

struct fy_device_cache {
  struct fy_device_cache_opts o;
  struct fy_chunk_layout *layout;
  struct block *blocks;
  int *bwd_done;             // per chunk: backward uses so far in this pass
  bool *prefetched;          // per chunk: loaded ahead and not used yet
  int64_t *looked_at;        // per chunk: the prefetch call that last met it ahead (0: none yet)
  int64_t prefetch_calls;
  bool *pinned;              // scratch for victim choice
  int32_t *resident;         // scratch
  // Per chunk, for the first micro-batch [2c] and the later ones [2c + 1]: the write-back's host
  // add (or bf16 widening). The copy stream may run passes behind the host, so the argument must
  // stay as it was enqueued: it is written only when it changes (the destination of a chunk's
  // gradients never does in practice).
  struct accumulate *acc;
  // Spilled chunks' blocks in host memory: a small pool, a buffer per chunk spilled at once.
  struct spill_buf *spills;
  int n_spills;
  int *spilled;              // per chunk: the spill buffer holding its content, or -1
  struct fy_device_cache_stats stats;
};

// Bytes of one element of a chunk's payload (fp32 unless the cache was told otherwise).
static size_t elem(const struct fy_device_cache *c) { return c->o.elem_bytes ? c->o.elem_bytes : 4; }

// dst = or += src widened (exact), with the same float adds the resident path makes when summing
// micro-batches. A chunk is millions of elements and the GPU waits for none of this, but the next
// write-back does: core's conversions run on the OpenMP threads.
static void accumulate_fn(void *arg) {
  struct accumulate *a = arg;
  if (a->add) fy_add_to_f32(a->dst, a->src, a->st, (size_t)a->n);
  else fy_convert_to_f32(a->dst, a->src, a->st, (size_t)a->n);
}

fy_status fy_device_cache_create(struct fy_chunk_layout *layout, const struct fy_device_cache_opts *o,
                                 struct fy_device_cache **out) {
  if (o->n_blocks < 1) return fy_error_set(FY_ERR_INVALID, "the device cache needs at least one block");
  struct fy_device_cache *c = calloc(1, sizeof *c);
  if (!c) return fy_error_set(FY_ERR_NOMEM, "cannot allocate the device cache");
  c->o = *o;
  c->layout = layout;
  int nc = layout->n_chunks;
  c->blocks = calloc((size_t)o->n_blocks, sizeof *c->blocks);
  c->bwd_done = calloc((size_t)nc, sizeof *c->bwd_done);
  c->prefetched = calloc((size_t)nc, sizeof *c->prefetched);
  c->looked_at = calloc((size_t)nc, sizeof *c->looked_at);
  c->pinned = calloc((size_t)nc, sizeof *c->pinned);
  c->resident = calloc((size_t)o->n_blocks, sizeof *c->resident);
  c->acc = calloc(2 * (size_t)nc, sizeof *c->acc);
  c->spilled = calloc((size_t)nc, sizeof *c->spilled);
  c->spills = calloc((size_t)nc, sizeof *c->spills);
  if (!c->blocks || !c->bwd_done || !c->prefetched || !c->looked_at || !c->pinned || !c->resident || !c->acc ||
      !c->spilled || !c->spills) {
    fy_device_cache_free(c);
    return fy_error_set(FY_ERR_NOMEM, "cannot allocate the device cache");
  }
  for (int i = 0; i < nc; i++) c->spilled[i] = -1;
  size_t bytes = (size_t)layout->chunk_elems * elem(c);
  for (int b = 0; b < o->n_blocks; b++) {
    struct block *bl = &c->blocks[b];
    bl->chunk = -1;
    bl->held = -1;
    fy_status st = fy_device_alloc(o->dev, bytes, (void **)&bl->ptr);
    if (st == FY_OK) st = o->dev->ops->event_create(o->dev, &bl->loaded);
    if (st == FY_OK) st = o->dev->ops->event_create(o->dev, &bl->used);
    if (st == FY_OK) st = o->dev->ops->event_create(o->dev, &bl->saved);
    if (st != FY_OK) {
      fy_device_cache_free(c);
      return fy_error_wrap(st, "allocating block %d of %d of the device cache (%.1f MiB each)", b,
                           o->n_blocks, bytes / 1048576.0);
    }
  }
  *out = c;
  return FY_OK;
}

void fy_device_cache_free(struct fy_device_cache *c) {
  if (!c) return;
  struct fy_device *dev = c->o.dev;
  for (int b = 0; c->blocks && b < c->o.n_blocks; b++) {
    struct block *bl = &c->blocks[b];
    if (bl->ptr) fy_device_dealloc(dev, bl->ptr, (size_t)c->layout->chunk_elems * elem(c));
    if (bl->loaded) dev->ops->event_free(dev, bl->loaded);
    if (bl->used) dev->ops->event_free(dev, bl->used);
    if (bl->saved) dev->ops->event_free(dev, bl->saved);
  }
  free(c->acc);
  for (int i = 0; i < c->n_spills; i++) {
    c->o.spill_free(c->o.spill_ctx, c->spills[i].ptr, (size_t)c->layout->chunk_elems * elem(c));
    if (c->spills[i].written) dev->ops->event_free(dev, c->spills[i].written);
    if (c->spills[i].read) dev->ops->event_free(dev, c->spills[i].read);
  }
  free(c->spills);
  free(c->spilled);
  free(c->blocks);
  free(c->bwd_done);
  free(c->prefetched);
  free(c->looked_at);
  free(c->pinned);
  free(c->resident);
  free(c);
}

static bool is_pinned(const struct fy_device_cache *c, int chunk, bool for_prefetch) {
  enum fy_chunk_state s = c->layout->chunks[chunk].state;
  if (s == FY_CHUNK_HOLD_AFTER_BWD) return for_prefetch || !c->o.spill_alloc;  // spilled only on demand
  if (s != FY_CHUNK_HOLD) return true;  // in use, or all its gradients are in
  return for_prefetch && c->prefetched[chunk];
}

// Evicts a HOLD_AFTER_BWD chunk by copying its block to a host spill buffer (a free one of the
// pool, or a new one).
static fy_status spill(struct fy_device_cache *c, int chunk) {
  struct fy_chunk *ch = &c->layout->chunks[chunk];
  struct block *bl = &c->blocks[ch->block];
  struct fy_device *dev = c->o.dev;
  int k = 0;
  while (k < c->n_spills && c->spills[k].owner >= 0) k++;
  if (k == c->n_spills) {
    struct spill_buf *sb = &c->spills[k];
    FY_TRY(c->o.spill_alloc(c->o.spill_ctx, (size_t)c->layout->chunk_elems * elem(c), (void **)&sb->ptr));
    c->n_spills++;
    FY_TRY(dev->ops->event_create(dev, &sb->written));
    FY_TRY(dev->ops->event_create(dev, &sb->read));
  }
  struct spill_buf *sb = &c->spills[k];
  fy_stream *s = c->o.copy_out;
  FY_TRY(fy_stream_wait(s, sb->read));  // its previous content has been loaded back
  FY_TRY(fy_stream_wait(s, bl->used));
  FY_TRY(fy_copy_async(s, sb->ptr, bl->ptr, (size_t)ch->used * elem(c)));
  FY_TRY(fy_event_record(bl->saved, s));
  FY_TRY(fy_event_record(sb->written, s));
  sb->owner = chunk;
  c->spilled[chunk] = k;
  c->stats.spills++;
  return FY_OK;
}

// A block for a chunk needed `dist` accesses after pos: a free one, else Belady's victim (for a
// prefetch only when the victim is needed later than the chunk to load). -1 when none.
static int find_block(struct fy_device_cache *c, int64_t pos, int64_t dist, bool for_prefetch) {
  int n = 0;
  for (int b = 0; b < c->o.n_blocks; b++) {
    if (c->blocks[b].chunk < 0) return b;
    int ch = c->blocks[b].chunk;
    c->resident[n++] = ch;
    c->pinned[ch] = is_pinned(c, ch, for_prefetch);
  }
  int victim = fy_cache_victim(c->o.trace, pos, c->resident, n, c->pinned);
  for (int i = 0; i < n; i++) c->pinned[c->resident[i]] = false;
  if (victim < 0) return -1;
  if (for_prefetch && fy_trace_next_use(c->o.trace, pos, victim) <= dist) return -1;
  struct fy_chunk *v = &c->layout->chunks[victim];
  int b = v->block;
  if (v->state == FY_CHUNK_HOLD_AFTER_BWD && spill(c, victim) != FY_OK) return -2;
  fy_chunk_set_state(v, FY_CHUNK_FREE);  // clean (its weights are at home) or spilled
  v->block = -1;
  c->blocks[b].chunk = -1;
  c->prefetched[victim] = false;
  c->stats.evictions++;
  return b;
}

// The load of chunk into block bl waits (on copy_in) until its home may be read: timed when
// profiling, so that the compute stream's wait for the load can be split (fy_device_cache_acquire).
static fy_status wait_home(struct fy_device_cache *c, int chunk, struct block *bl) {
  bl->held = -1;
  if (!c->o.home_ready || !c->o.home_ready[chunk]) return FY_OK;
  enum fy_stall why = c->o.home_cause ? c->o.home_cause[chunk] : FY_STALL_OPTIMIZER;
  return fy_wait_timed(c->o.profile, c->o.copy_in, c->o.home_ready[chunk], why, -1, &bl->held);
}

static fy_status load(struct fy_device_cache *c, int chunk, int b, enum fy_chunk_state to) {
  struct block *bl = &c->blocks[b];
  bl->held = -1;
  struct fy_chunk *ch = &c->layout->chunks[chunk];
  fy_stream *s = c->o.copy_in;
  // The block's previous occupant must be done with: its readers and its write-back.
  FY_TRY(fy_stream_wait(s, bl->used));
  FY_TRY(fy_stream_wait(s, bl->saved));
  if (c->spilled[chunk] >= 0) {  // its partial gradients come back from where they were spilled
    struct spill_buf *sb = &c->spills[c->spilled[chunk]];
    FY_TRY(fy_stream_wait(s, sb->written));
    FY_TRY(fy_copy_async(s, bl->ptr, sb->ptr, (size_t)ch->used * elem(c)));
    FY_TRY(fy_event_record(sb->read, s));
    sb->owner = -1;
    c->spilled[chunk] = -1;
  } else if (c->o.shard_elems > 0) {  // this rank's shard from home, the others' from theirs
    FY_TRY(wait_home(c, chunk, bl));
    bool done = false;  // (load_home may copy parts of the shard alone: an expert-parallel rank's experts)
    if (c->o.load_home) FY_TRY(c->o.load_home(c->o.load_ctx, chunk, bl->ptr, s, &done));
    if (!done)
      FY_TRY(fy_copy_async(s, (char *)bl->ptr + c->o.shard_off * elem(c), c->o.home[chunk],
                           (size_t)c->o.shard_elems * elem(c)));
    FY_TRY(c->o.gather(c->o.shard_ctx, chunk, bl->ptr, s));
  } else {
    FY_TRY(wait_home(c, chunk, bl));
    bool done = false;
    if (c->o.load_home) FY_TRY(c->o.load_home(c->o.load_ctx, chunk, bl->ptr, s, &done));
    if (!done) FY_TRY(fy_copy_async(s, bl->ptr, c->o.home[chunk], (size_t)ch->used * elem(c)));
  }
  FY_TRY(fy_event_record(bl->loaded, s));
  bl->chunk = chunk;
  ch->block = b;
  fy_chunk_set_state(ch, to);
  c->stats.loads++;
  return FY_OK;
}

fy_status fy_device_cache_acquire(struct fy_device_cache *c, int64_t pos, int chunk, float **block) {
  struct fy_chunk *ch = &c->layout->chunks[chunk];
  if (ch->block < 0) {
    int b = find_block(c, pos, 0, false);
    if (b == -2) return fy_error_wrap(FY_ERR_NOMEM, "spilling a chunk to the host");
    if (b < 0)
      return fy_error_set(FY_ERR_NOMEM,
                          "the device cache's %d blocks are all in use at access %lld (chunk %d); "
                          "give the device more memory or use smaller chunks",
                          c->o.n_blocks, (long long)pos, chunk);
    FY_TRY(load(c, chunk, b, FY_CHUNK_COMPUTE));
  } else {
    fy_chunk_set_state(ch, FY_CHUNK_COMPUTE);
  }
  c->prefetched[chunk] = false;
  struct block *bl = &c->blocks[ch->block];
  FY_TRY(fy_wait_timed(c->o.profile, c->o.compute, bl->loaded, FY_STALL_LOAD, bl->held, NULL));
  bl->held = -1;  // (later waits for the same load find it done)
  *block = bl->ptr;
  return FY_OK;
}

enum fy_chunk_state fy_device_cache_release(struct fy_device_cache *c, int chunk, bool backward) {
  struct fy_chunk *ch = &c->layout->chunks[chunk];
  FY_ASSERT(ch->state == FY_CHUNK_COMPUTE && ch->block >= 0);
  fy_event_record(c->blocks[ch->block].used, c->o.compute);
  enum fy_chunk_state to;
  if (backward) {
    c->bwd_done[chunk]++;
    to = c->bwd_done[chunk] == ch->n_users_bwd ? FY_CHUNK_READY_FOR_REDUCE : FY_CHUNK_HOLD_AFTER_BWD;
  } else {
    to = c->bwd_done[chunk] > 0 ? FY_CHUNK_HOLD_AFTER_BWD : FY_CHUNK_HOLD;
  }
  fy_chunk_set_state(ch, to);
  return to;
}

// The write-backs: raw copies the payload as it is to dst (same dtype); otherwise dst is fp32 and
// takes the payload widened (bf16), added with accumulate.
static fy_status write_back(struct fy_device_cache *c, int chunk, void *dst, bool raw, bool accumulate,
                            fy_event *done) {
  struct fy_chunk *ch = &c->layout->chunks[chunk];
  FY_ASSERT(ch->state == FY_CHUNK_READY_FOR_REDUCE);
  struct block *bl = &c->blocks[ch->block];
  fy_stream *s = c->o.copy_out;
  int64_t n = ch->used;
  const char *src = (const char *)bl->ptr;
  // (recorded again at the write-back: what the caller enqueued on the block after its release,
  // a GPU's sums of squares of the gradients in it, comes before the copy and the block's reuse)
  FY_TRY(fy_event_record(bl->used, c->o.compute));
  FY_TRY(fy_stream_wait(s, bl->used));
  if (c->o.shard_elems > 0) {  // the ranks' sum, this rank's shard of it
    FY_TRY(c->o.scatter(c->o.shard_ctx, chunk, bl->ptr, s));
    n = c->o.shard_elems;
    src += c->o.shard_off * elem(c);
  }
  size_t bytes = (size_t)n * elem(c);
  bool widen = !raw && elem(c) == 2;
  if (accumulate || widen) {
    FY_TRY(fy_copy_async(s, c->o.staging, src, bytes));
    struct accumulate *a = &c->acc[2 * chunk + accumulate];
    if (a->dst != dst || a->src != c->o.staging || a->n != n) {
      FY_TRY(fy_stream_sync(s));  // nothing queued may still read the old argument
      *a = (struct accumulate){.dst = dst, .src = c->o.staging, .st = widen ? FY_BF16 : FY_F32, .n = n,
                               .add = accumulate};
    }
    FY_TRY(fy_stream_enqueue(s, accumulate_fn, a));
  } else {
    FY_TRY(fy_copy_async(s, dst, src, bytes));
  }
  FY_TRY(fy_event_record(bl->saved, s));
  if (done) FY_TRY(fy_event_record(done, s));
  fy_chunk_set_state(ch, FY_CHUNK_FREE);
  bl->chunk = -1;
  ch->block = -1;
  c->stats.write_backs++;
  return FY_OK;
}

fy_status fy_device_cache_write_back(struct fy_device_cache *c, int chunk, float *dst, bool accumulate,
                                     fy_event *done) {
  return write_back(c, chunk, dst, false, accumulate, done);
}

fy_status fy_device_cache_write_back_payload(struct fy_device_cache *c, int chunk, void *dst, fy_event *done) {
  return write_back(c, chunk, dst, true, false, done);
}

fy_status fy_device_cache_prefetch(struct fy_device_cache *c, int64_t pos) {
  int64_t n = fy_trace_length(c->o.trace);
  if (n == 0) return FY_OK;  // every chunk lives elsewhere (kept on the device)
  int64_t pass_end = (pos / n + 1) * n;
  int seen = 0;
  // A chunk met again ahead (a run of its ops, or its use again later in the window) counts once:
  // looked_at marks the chunks this call has met, so the walk stays linear in its length (a
  // rescan of the window for each access made a 30B model's 8-rank plan search take 24 s).
  const int64_t call = ++c->prefetch_calls;
  // Only within this pass: the next pass may read weights the optimizer has yet to update.
  // (A run of one chunk's accesses is met at its first: the rest are skipped.)
  for (int64_t j = pos + 1; j < pass_end && seen < c->o.prefetch; j = fy_trace_run_end(c->o.trace, j)) {
    int chunk = fy_trace_at(c->o.trace, j);
    if (c->looked_at[chunk] == call) continue;
    c->looked_at[chunk] = call;
    seen++;
    if (c->layout->chunks[chunk].block >= 0) continue;
    int b = find_block(c, pos, j - pos, true);
    if (b == -2) return fy_error_wrap(FY_ERR_NOMEM, "spilling a chunk to the host");
    if (b < 0) break;
    FY_TRY(load(c, chunk, b, FY_CHUNK_HOLD));
    c->prefetched[chunk] = true;
    c->stats.prefetches++;
  }
  return FY_OK;
}

void fy_device_cache_begin_pass(struct fy_device_cache *c) {
  memset(c->bwd_done, 0, (size_t)c->layout->n_chunks * sizeof *c->bwd_done);
}

void fy_device_cache_stats(const struct fy_device_cache *c, struct fy_device_cache_stats *out) {
  *out = c->stats;
}
