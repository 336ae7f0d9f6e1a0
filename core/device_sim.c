// The sim device: CUDA's execution model on the CPU, so that caching, eviction, prefetch and
// overlap run and are tested without a GPU (docs/design.md, "Streams and events").
//
// - Memory: one anonymous mapping of `cap` bytes, handed out first-fit in 64-byte units. The free
//   extents live outside the pool in an array sorted by offset, so every pool byte is usable and
//   counted, and freeing coalesces with both neighbours.
// - Streams: one worker thread each, running a FIFO queue of work items, with the OpenMP thread
//   count of the thread that created the stream (omp_set_num_threads is per thread: a new thread
//   would otherwise take OMP_NUM_THREADS or every core, whatever --threads said).
// - Copy engines: one per direction, taken in ticket order (FIFO, as a DMA engine's queue), so two
//   copies in one direction serialise while opposite directions overlap. A throttled copy holds its
//   engine for its modelled wire time: the sleep models the link, never ordering.
// - Events: a record takes a new generation and enqueues a marker; a wait captures the latest
//   generation at enqueue time and blocks until that generation is reached. Generations not yet
//   reached are kept as a set, so an event recorded on two streams behaves as on CUDA (a waiter
//   waits for the record it captured, not for whichever came last). Ordering uses condition
//   variables only.
#include <errno.h>
#include <omp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "core/device.h"
#include "core/clock.h"
#include "core/log.h"
#include "core/rand.h"

enum { TO_DEVICE = 0, TO_HOST = 1, NO_ENGINE = -1 };

struct extent { size_t off, len; };

struct engine {
  pthread_mutex_t mu;
  pthread_cond_t turn;
  uint64_t next, serving;  // tickets: a copy runs when serving reaches its ticket
  double bytes, busy_s;
};

struct sim {
  char *base;
  size_t pool_len;  // cap rounded down to the 64-byte unit
  double link_gbps;
  pthread_mutex_t pool_mu;
  struct extent *free_ext;  // sorted by offset, never adjacent (they are coalesced)
  size_t nfree, free_cap, nlive;
  struct engine eng[2];
  atomic_int jitter_us;
  atomic_uint_fast64_t jitter_seed;
  atomic_uint_fast64_t nstreams;  // gives each stream its own jitter sequence
};

struct sim_event {
  struct fy_event base;
  pthread_mutex_t mu;
  pthread_cond_t cv;        // a generation reached, or a queued reference dropped
  uint64_t recorded;        // latest generation; 0 = never recorded
  uint64_t *pending;        // generations recorded and not yet reached
  size_t npending, pending_cap;
  size_t refs;              // queued items pointing at this event
  double reached_at;        // when its latest record was reached (monotonic seconds; timers)
};

enum item_kind { ITEM_COPY, ITEM_MEMSET, ITEM_HOST, ITEM_RECORD, ITEM_WAIT };

struct item {
  struct item *next;
  enum item_kind kind;
  union {
    struct { void *dst; const void *src; size_t n; int dir; } copy;
    struct { void *dst; int value; size_t n; } set;
    struct { fy_host_fn fn; void *arg; } host;
    struct { struct sim_event *e; uint64_t gen; } mark;  // record and wait
  };
};

struct sim_stream {
  struct fy_stream base;
  pthread_t thread;
  pthread_mutex_t mu;
  pthread_cond_t work;  // an item arrived, or the stream is stopping
  pthread_cond_t idle;  // an item finished
  struct item *head, *tail;
  uint64_t enqueued, done;  // stream_sync waits for done to reach enqueued as it was
  bool stopping;
  uint64_t rng;
  int omp_threads;  // the creating thread's omp_get_max_threads()
};

static struct sim *sim_of(const struct fy_device *dev) { return dev->impl; }
static size_t round64(size_t n) { return fy_device_round(n, FY_HOST_ALLOC_GRANULE); }

static void sleep_until(double t) {
  struct timespec ts = {.tv_sec = (time_t)t, .tv_nsec = (long)((t - (double)(time_t)t) * 1e9)};
  if (ts.tv_nsec >= 1000000000L) ts.tv_nsec = 999999999L;
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {}
}

// ---- the pool ----

// Index of the first free extent ending after `off`: the only one that can contain or follow it.
static size_t extent_after(const struct sim *sm, size_t off) {
  size_t lo = 0, hi = sm->nfree;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (sm->free_ext[mid].off + sm->free_ext[mid].len <= off) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// Free extents are separated by live blocks, so there are at most nlive + 1 of them. Growing the
// array here, where failure can be reported, means pool_give never needs memory.
static fy_status pool_reserve(struct sim *sm) {
  size_t need = sm->nlive + 2;
  if (sm->free_cap >= need) return FY_OK;
  size_t cap = sm->free_cap * 2 > need ? sm->free_cap * 2 : need;
  struct extent *e = realloc(sm->free_ext, cap * sizeof *e);
  if (!e) return fy_error_set(FY_ERR_NOMEM, "sim device: cannot grow the free list");
  sm->free_ext = e;
  sm->free_cap = cap;
  return FY_OK;
}

static void extent_remove(struct sim *sm, size_t i) {
  memmove(&sm->free_ext[i], &sm->free_ext[i + 1], (sm->nfree - i - 1) * sizeof *sm->free_ext);
  sm->nfree--;
}

static size_t largest_free(const struct sim *sm) {
  size_t m = 0;
  for (size_t i = 0; i < sm->nfree; i++)
    if (sm->free_ext[i].len > m) m = sm->free_ext[i].len;
  return m;
}

// First fit: the lowest-addressed extent that is big enough, cut from its front.
static bool pool_take(struct sim *sm, size_t r, size_t *off) {
  for (size_t i = 0; i < sm->nfree; i++) {
    struct extent *e = &sm->free_ext[i];
    if (e->len < r) continue;
    *off = e->off;
    e->off += r;
    e->len -= r;
    if (!e->len) extent_remove(sm, i);
    sm->nlive++;
    return true;
  }
  return false;
}

static void pool_give(struct sim *sm, size_t off, size_t r) {
  FY_ASSERT(off % 64 == 0 && off + r <= sm->pool_len && sm->nlive > 0);
  size_t i = extent_after(sm, off);  // the extent that would follow the block
  struct extent *ext = sm->free_ext;
  FY_ASSERT(i == sm->nfree || off + r <= ext[i].off);  // freeing free memory: a double free
  bool join_prev = i > 0 && ext[i - 1].off + ext[i - 1].len == off;
  bool join_next = i < sm->nfree && off + r == ext[i].off;
  if (join_prev && join_next) {
    ext[i - 1].len += r + ext[i].len;
    extent_remove(sm, i);
  } else if (join_prev) {
    ext[i - 1].len += r;
  } else if (join_next) {
    ext[i].off = off;
    ext[i].len += r;
  } else {
    FY_ASSERT(sm->nfree < sm->free_cap);  // pool_reserve guarantees it
    memmove(&ext[i + 1], &ext[i], (sm->nfree - i) * sizeof *ext);
    ext[i] = (struct extent){.off = off, .len = r};
    sm->nfree++;
  }
  sm->nlive--;
}

static fy_status sim_alloc(struct fy_device *dev, size_t n, void **out) {
  struct sim *sm = sim_of(dev);
  size_t r = round64(n);
  pthread_mutex_lock(&sm->pool_mu);
  fy_status st = pool_reserve(sm);
  size_t off = 0;
  if (st == FY_OK && (n > sm->pool_len || !pool_take(sm, r, &off)))
    st = fy_error_set(FY_ERR_NOMEM,
                      "%s device: %zu bytes requested with %zu of %zu in use "
                      "(largest free block %zu)",
                      dev->name, n, dev->bytes_in_use, dev->cap, largest_free(sm));
  if (st == FY_OK) {
    *out = sm->base + off;
    dev->bytes_in_use += r;
    if (dev->bytes_in_use > dev->bytes_peak) dev->bytes_peak = dev->bytes_in_use;
  }
  pthread_mutex_unlock(&sm->pool_mu);
  return st;
}

static bool sim_owns(const struct fy_device *dev, const void *p) {
  const struct sim *sm = sim_of(dev);
  return (const char *)p >= sm->base && (const char *)p < sm->base + sm->pool_len;
}

static void sim_free(struct fy_device *dev, void *p, size_t n) {
  if (!p) return;
  struct sim *sm = sim_of(dev);
  FY_ASSERT(sim_owns(dev, p));
  size_t r = round64(n);
  pthread_mutex_lock(&sm->pool_mu);
  pool_give(sm, (size_t)((char *)p - sm->base), r);
  dev->bytes_in_use -= r;
  pthread_mutex_unlock(&sm->pool_mu);
}

// A range that starts in the pool must lie in allocated memory: touching a free extent or running
// off the end is a caller bug that a GPU would punish with a fault or silent corruption.
static void assert_allocated(struct fy_device *dev, const void *p, size_t n) {
  struct sim *sm = sim_of(dev);
  size_t off = (size_t)((const char *)p - sm->base);
  FY_ASSERT(n <= sm->pool_len - off);
  pthread_mutex_lock(&sm->pool_mu);
  size_t i = extent_after(sm, off);
  bool overlaps_free = i < sm->nfree && sm->free_ext[i].off < off + n;
  pthread_mutex_unlock(&sm->pool_mu);
  FY_ASSERT(!overlaps_free);
}

// ---- copy engines ----

static void engine_take(struct engine *en) {
  pthread_mutex_lock(&en->mu);
  uint64_t ticket = en->next++;
  while (en->serving != ticket) pthread_cond_wait(&en->turn, &en->mu);
  pthread_mutex_unlock(&en->mu);
}

static void engine_give(struct engine *en, size_t n, double busy_s) {
  pthread_mutex_lock(&en->mu);
  en->serving++;
  en->bytes += (double)n;
  en->busy_s += busy_s;
  pthread_cond_broadcast(&en->turn);
  pthread_mutex_unlock(&en->mu);
}

static void copy_run(struct sim *sm, void *dst, const void *src, size_t n, int dir) {
  if (dir == NO_ENGINE) {
    memmove(dst, src, n);
    return;
  }
  struct engine *en = &sm->eng[dir];
  engine_take(en);
  double t0 = fy_now();
  memmove(dst, src, n);
  if (sm->link_gbps > 0) sleep_until(t0 + (double)n / (sm->link_gbps * 1e9));
  engine_give(en, n, fy_now() - t0);
}

static void sim_copy_stats(const struct fy_device *dev, struct fy_copy_stats *out) {
  struct sim *sm = sim_of(dev);
  for (int d = 0; d < 2; d++) {
    pthread_mutex_lock(&sm->eng[d].mu);
    out->bytes[d] = sm->eng[d].bytes;
    out->busy_s[d] = sm->eng[d].busy_s;
    pthread_mutex_unlock(&sm->eng[d].mu);
  }
}

// ---- events ----

static bool event_pending(const struct sim_event *e, uint64_t gen) {
  for (size_t i = 0; i < e->npending; i++)
    if (e->pending[i] == gen) return true;
  return false;
}

static void event_reach(struct sim_event *e, uint64_t gen) {
  const double now = fy_now();
  pthread_mutex_lock(&e->mu);
  e->reached_at = now;
  for (size_t i = 0; i < e->npending; i++)
    if (e->pending[i] == gen) {
      e->pending[i] = e->pending[--e->npending];
      break;
    }
  e->refs--;
  pthread_cond_broadcast(&e->cv);
  pthread_mutex_unlock(&e->mu);
}

static void event_await(struct sim_event *e, uint64_t gen, bool queued) {
  pthread_mutex_lock(&e->mu);
  while (event_pending(e, gen)) pthread_cond_wait(&e->cv, &e->mu);
  if (queued) {
    e->refs--;
    pthread_cond_broadcast(&e->cv);
  }
  pthread_mutex_unlock(&e->mu);
}

static fy_status sim_event_create(struct fy_device *dev, fy_event **out) {
  struct sim_event *e = calloc(1, sizeof *e);
  if (!e) return fy_error_set(FY_ERR_NOMEM, "cannot allocate an event");
  e->base.dev = dev;
  pthread_mutex_init(&e->mu, NULL);
  pthread_cond_init(&e->cv, NULL);
  *out = &e->base;
  return FY_OK;
}

// Queued markers and waits point at the event, so it lives until they have run.
static void sim_event_free(struct fy_device *dev, fy_event *ev) {
  if (!ev) return;
  struct sim_event *e = (struct sim_event *)ev;
  pthread_mutex_lock(&e->mu);
  while (e->refs) pthread_cond_wait(&e->cv, &e->mu);
  pthread_mutex_unlock(&e->mu);
  pthread_cond_destroy(&e->cv);
  pthread_mutex_destroy(&e->mu);
  free(e->pending);
  free(e);
}

// A sim event keeps when it was reached: every event is a timer.
static fy_status sim_timer_elapsed(fy_event *from, fy_event *to, double *seconds) {
  struct sim_event *a = (struct sim_event *)from, *b = (struct sim_event *)to;
  bool reached = true;
  double t[2];
  struct sim_event *e[2] = {a, b};
  for (int i = 0; i < 2; i++) {
    pthread_mutex_lock(&e[i]->mu);
    reached = reached && e[i]->recorded > 0 && e[i]->npending == 0;
    t[i] = e[i]->reached_at;
    pthread_mutex_unlock(&e[i]->mu);
  }
  if (!reached) return FY_ERR_NOT_FOUND;
  *seconds = t[1] - t[0];
  return FY_OK;
}

static fy_status sim_event_sync(fy_event *ev) {
  struct sim_event *e = (struct sim_event *)ev;
  pthread_mutex_lock(&e->mu);
  uint64_t gen = e->recorded;
  pthread_mutex_unlock(&e->mu);
  event_await(e, gen, false);
  return FY_OK;
}

// ---- streams ----

static void jitter(struct sim_stream *s) {
  int max_us = atomic_load(&sim_of(s->base.dev)->jitter_us);
  if (max_us <= 0) return;
  long us = (long)(fy_splitmix64(&s->rng) % (uint64_t)(max_us + 1));
  struct timespec ts = {.tv_sec = us / 1000000, .tv_nsec = (us % 1000000) * 1000};
  while (nanosleep(&ts, &ts) == EINTR) {}
}

static void item_run(struct sim_stream *s, struct item *it) {
  switch (it->kind) {
  case ITEM_COPY:
    copy_run(sim_of(s->base.dev), it->copy.dst, it->copy.src, it->copy.n, it->copy.dir);
    break;
  case ITEM_MEMSET: memset(it->set.dst, it->set.value, it->set.n); break;
  case ITEM_HOST: it->host.fn(it->host.arg); break;
  case ITEM_RECORD: event_reach(it->mark.e, it->mark.gen); break;
  case ITEM_WAIT: event_await(it->mark.e, it->mark.gen, true); break;
  }
}

// Blocks until there is an item or the stream stops; NULL once stopping and drained.
static struct item *stream_pop(struct sim_stream *s) {
  pthread_mutex_lock(&s->mu);
  while (!s->head && !s->stopping) pthread_cond_wait(&s->work, &s->mu);
  struct item *it = s->head;
  if (it) {
    s->head = it->next;
    if (!s->head) s->tail = NULL;
  }
  pthread_mutex_unlock(&s->mu);
  return it;
}

static void *stream_main(void *arg) {
  struct sim_stream *s = arg;
  struct item *it = NULL;
  omp_set_num_threads(s->omp_threads);
  while ((it = stream_pop(s))) {
    jitter(s);
    item_run(s, it);
    free(it);
    pthread_mutex_lock(&s->mu);
    s->done++;
    pthread_cond_broadcast(&s->idle);
    pthread_mutex_unlock(&s->mu);
  }
  return NULL;
}

static void stream_push(struct sim_stream *s, struct item *it) {
  it->next = NULL;
  pthread_mutex_lock(&s->mu);
  if (s->tail) s->tail->next = it;
  else s->head = it;
  s->tail = it;
  s->enqueued++;
  pthread_cond_signal(&s->work);
  pthread_mutex_unlock(&s->mu);
}

static fy_status item_new(enum item_kind kind, struct item **out) {
  struct item *it = calloc(1, sizeof *it);
  if (!it) return fy_error_set(FY_ERR_NOMEM, "sim device: cannot allocate a work item");
  it->kind = kind;
  *out = it;
  return FY_OK;
}

static fy_status sim_stream_create(struct fy_device *dev, fy_stream **out) {
  struct sim *sm = sim_of(dev);
  struct sim_stream *s = calloc(1, sizeof *s);
  if (!s) return fy_error_set(FY_ERR_NOMEM, "cannot allocate a stream");
  s->base.dev = dev;
  uint64_t index = atomic_fetch_add(&sm->nstreams, 1) + 1;
  s->rng = atomic_load(&sm->jitter_seed) ^ (0x2545F4914F6CDD1Dull * index);
  s->omp_threads = omp_get_max_threads();
  pthread_mutex_init(&s->mu, NULL);
  pthread_cond_init(&s->work, NULL);
  pthread_cond_init(&s->idle, NULL);
  int rc = pthread_create(&s->thread, NULL, stream_main, s);
  if (rc) {
    pthread_cond_destroy(&s->idle);
    pthread_cond_destroy(&s->work);
    pthread_mutex_destroy(&s->mu);
    free(s);
    return fy_error_set(FY_ERR_NOMEM, "sim device: cannot start a stream thread: %s", strerror(rc));
  }
  *out = &s->base;
  return FY_OK;
}

// Drains the queue (as cudaStreamDestroy lets pending work finish), then joins the worker.
static void sim_stream_free(struct fy_device *dev, fy_stream *st) {
  if (!st) return;
  struct sim_stream *s = (struct sim_stream *)st;
  pthread_mutex_lock(&s->mu);
  s->stopping = true;
  pthread_cond_signal(&s->work);
  pthread_mutex_unlock(&s->mu);
  pthread_join(s->thread, NULL);
  pthread_cond_destroy(&s->idle);
  pthread_cond_destroy(&s->work);
  pthread_mutex_destroy(&s->mu);
  free(s);
}

static fy_status sim_stream_sync(fy_stream *st) {
  struct sim_stream *s = (struct sim_stream *)st;
  pthread_mutex_lock(&s->mu);
  uint64_t target = s->enqueued;
  while (s->done < target) pthread_cond_wait(&s->idle, &s->mu);
  pthread_mutex_unlock(&s->mu);
  return FY_OK;
}

static int copy_direction(struct fy_device *dev, void *dst, const void *src) {
  bool d = sim_owns(dev, dst), s = sim_owns(dev, src);
  if (d == s) return NO_ENGINE;
  return d ? TO_DEVICE : TO_HOST;
}

static fy_status sim_copy(fy_stream *st, void *dst, const void *src, size_t n) {
  if (!n) return FY_OK;
  struct fy_device *dev = st->dev;
  FY_ASSERT(dst && src);
  if (sim_owns(dev, dst)) assert_allocated(dev, dst, n);
  if (sim_owns(dev, src)) assert_allocated(dev, src, n);
  struct item *it = NULL;
  FY_TRY(item_new(ITEM_COPY, &it));
  it->copy.dst = dst;
  it->copy.src = src;
  it->copy.n = n;
  it->copy.dir = copy_direction(dev, dst, src);
  stream_push((struct sim_stream *)st, it);
  return FY_OK;
}

static fy_status sim_memset(fy_stream *st, void *dst, int value, size_t n) {
  if (!n) return FY_OK;
  FY_ASSERT(dst);
  if (sim_owns(st->dev, dst)) assert_allocated(st->dev, dst, n);
  struct item *it = NULL;
  FY_TRY(item_new(ITEM_MEMSET, &it));
  it->set.dst = dst;
  it->set.value = value;
  it->set.n = n;
  stream_push((struct sim_stream *)st, it);
  return FY_OK;
}

static fy_status sim_enqueue(fy_stream *st, fy_host_fn fn, void *arg) {
  FY_ASSERT(fn);
  struct item *it = NULL;
  FY_TRY(item_new(ITEM_HOST, &it));
  it->host.fn = fn;
  it->host.arg = arg;
  stream_push((struct sim_stream *)st, it);
  return FY_OK;
}

static fy_status pending_add(struct sim_event *e, uint64_t gen) {
  if (e->npending == e->pending_cap) {
    size_t cap = e->pending_cap ? 2 * e->pending_cap : 4;
    uint64_t *p = realloc(e->pending, cap * sizeof *p);
    if (!p) return fy_error_set(FY_ERR_NOMEM, "sim device: cannot record an event");
    e->pending = p;
    e->pending_cap = cap;
  }
  e->pending[e->npending++] = gen;
  return FY_OK;
}

static fy_status sim_event_record(fy_event *ev, fy_stream *st) {
  struct sim_event *e = (struct sim_event *)ev;
  FY_ASSERT(ev->dev == st->dev);
  struct item *it = NULL;
  FY_TRY(item_new(ITEM_RECORD, &it));
  pthread_mutex_lock(&e->mu);
  fy_status rc = pending_add(e, e->recorded + 1);
  if (rc == FY_OK) {
    it->mark.e = e;
    it->mark.gen = ++e->recorded;
    e->refs++;
  }
  pthread_mutex_unlock(&e->mu);
  if (rc != FY_OK) {
    free(it);
    return rc;
  }
  stream_push((struct sim_stream *)st, it);
  return FY_OK;
}

// Captures the latest record now (CUDA's rule); a generation already reached, or an event never
// recorded, needs no item at all.
static fy_status sim_stream_wait(fy_stream *st, fy_event *ev) {
  struct sim_event *e = (struct sim_event *)ev;
  FY_ASSERT(ev->dev == st->dev);
  struct item *it = NULL;
  FY_TRY(item_new(ITEM_WAIT, &it));
  pthread_mutex_lock(&e->mu);
  bool needed = event_pending(e, e->recorded);
  if (needed) {
    it->mark.e = e;
    it->mark.gen = e->recorded;
    e->refs++;
  }
  pthread_mutex_unlock(&e->mu);
  if (needed) stream_push((struct sim_stream *)st, it);
  else free(it);
  return FY_OK;
}

// ---- the device ----

static void engine_init(struct engine *en) {
  *en = (struct engine){0};
  pthread_mutex_init(&en->mu, NULL);
  pthread_cond_init(&en->turn, NULL);
}

static void sim_destroy(struct fy_device *dev) {
  struct sim *sm = sim_of(dev);
  if (dev->bytes_in_use)
    fy_log_warn("%s device destroyed with %zu bytes still allocated", dev->name, dev->bytes_in_use);
  munmap(sm->base, dev->cap);
  for (int d = 0; d < 2; d++) {
    pthread_cond_destroy(&sm->eng[d].turn);
    pthread_mutex_destroy(&sm->eng[d].mu);
  }
  pthread_mutex_destroy(&sm->pool_mu);
  free(sm->free_ext);
  free(sm);
  free(dev);
}

static const struct fy_device_ops fy_sim_ops = {
    .alloc = sim_alloc,
    .free = sim_free,
    .stream_create = sim_stream_create,
    .stream_free = sim_stream_free,
    .copy_async = sim_copy,
    .memset_async = sim_memset,
    .enqueue = sim_enqueue,
    .stream_sync = sim_stream_sync,
    .event_create = sim_event_create,
    .event_free = sim_event_free,
    .event_record = sim_event_record,
    .stream_wait = sim_stream_wait,
    .event_sync = sim_event_sync,
    .destroy = sim_destroy,
    .owns = sim_owns,
    .copy_stats = sim_copy_stats,
    .timer_create = sim_event_create,
    .timer_elapsed = sim_timer_elapsed,
};

static fy_status pool_init(struct sim *sm, size_t cap) {
  // MAP_NORESERVE: a large pool costs only the pages that are touched, like a GPU's unused memory.
  void *p = mmap(NULL, cap, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
  if (p == MAP_FAILED)
    return fy_error_set(FY_ERR_NOMEM, "sim device: cannot map a pool of %zu bytes: %s", cap,
                        strerror(errno));
  sm->base = p;
  sm->pool_len = cap & ~(size_t)63;
  sm->free_ext = malloc(4 * sizeof *sm->free_ext);
  if (!sm->free_ext) {
    munmap(p, cap);
    return fy_error_set(FY_ERR_NOMEM, "sim device: cannot allocate the free list");
  }
  sm->free_cap = 4;
  sm->nfree = sm->pool_len ? 1 : 0;
  sm->free_ext[0] = (struct extent){.off = 0, .len = sm->pool_len};
  pthread_mutex_init(&sm->pool_mu, NULL);
  return FY_OK;
}

fy_status fy_device_sim_create(size_t cap, double link_gbps, struct fy_device **out) {
  if (!cap) return fy_error_set(FY_ERR_INVALID, "sim device: the pool size must be positive");
  if (!(link_gbps >= 0))
    return fy_error_set(FY_ERR_INVALID, "sim device: link bandwidth %g GB/s is not >= 0",
                        link_gbps);
  struct fy_device *d = calloc(1, sizeof *d);
  struct sim *sm = calloc(1, sizeof *sm);
  if (!d || !sm) {
    free(d);
    free(sm);
    return fy_error_set(FY_ERR_NOMEM, "cannot allocate the sim device");
  }
  fy_status st = pool_init(sm, cap);
  if (st != FY_OK) {
    free(d);
    free(sm);
    return st;
  }
  sm->link_gbps = link_gbps;
  for (int dir = 0; dir < 2; dir++) engine_init(&sm->eng[dir]);
  atomic_init(&sm->jitter_us, 0);
  atomic_init(&sm->jitter_seed, 0);
  atomic_init(&sm->nstreams, 0);
  d->kind = FY_DEVICE_SIM;
  d->name = "sim";
  d->ops = &fy_sim_ops;
  d->cap = cap;
  d->impl = sm;
  *out = d;
  return FY_OK;
}

void fy_device_sim_set_jitter(struct fy_device *dev, int max_us, uint64_t seed) {
  FY_ASSERT(dev->kind == FY_DEVICE_SIM);
  struct sim *sm = sim_of(dev);
  atomic_store(&sm->jitter_seed, seed);
  atomic_store(&sm->jitter_us, max_us > 0 ? max_us : 0);
}
