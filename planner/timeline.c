#include "planner/timeline.h"

#include <stdlib.h>
#include <string.h>

#define FAKE_BASE ((uintptr_t)1 << 46)  // device addresses: far from any real mapping
#define MAX_STREAMS 16

// A wait's cause (core/stall.h): each stream says what its work is; an event carries that, and
// what its stream last waited for and until when, so that a wait on it can be charged to what
// held it up first.
struct tl_stream {
  struct fy_stream base;
  double clock;
  int id;
  enum fy_stall cause, wait_cause;
  double wait_end;
  double stalls[FY_STALL_COUNT];
};

struct tl_event {
  struct fy_event base;
  double time;
  enum fy_stall cause, wait_cause;
  double wait_end;
};

struct tl {
  double rate[2];         // bytes/s: 0 host->device, 1 device->host
  double latency;         // seconds per copy, besides bytes / rate
  size_t granule;         // allocations count in whole blocks of this many bytes
  double link_free[2];    // when each direction's link is free
  uintptr_t next;         // bump allocator of fake addresses
  struct fy_copy_stats stats;
  struct fy_timeline_span *spans;
  int n_spans, cap_spans;
  bool record;
  int n_streams;
  char names[MAX_STREAMS][24];
};

static struct tl *TL(const struct fy_device *d) { return d->impl; }

static bool tl_owns(const struct fy_device *d, const void *p) {
  uintptr_t a = (uintptr_t)p;
  return a >= FAKE_BASE && a < TL(d)->next;
}

static void add_span(struct fy_device *d, int stream, double start, double end, const char *label) {
  struct tl *t = TL(d);
  if (!t->record || end <= start) return;
  if (t->n_spans == t->cap_spans) {
    int nc = t->cap_spans ? 2 * t->cap_spans : 1024;
    struct fy_timeline_span *s = realloc(t->spans, (size_t)nc * sizeof *s);
    if (!s) return;
    t->spans = s;
    t->cap_spans = nc;
  }
  struct fy_timeline_span *s = &t->spans[t->n_spans++];
  s->stream = stream;
  s->start = start;
  s->end = end;
  snprintf(s->label, sizeof s->label, "%s", label ? label : "");
}

static fy_status tl_alloc(struct fy_device *d, size_t n, void **out) {
  size_t r = fy_device_round(n, TL(d)->granule);
  if (d->cap && d->bytes_in_use + r > d->cap)
    return fy_error_set(FY_ERR_NOMEM, "%s device: %zu bytes requested with %zu of %zu in use", d->name, n,
                        d->bytes_in_use, d->cap);
  *out = (void *)TL(d)->next;
  TL(d)->next += r;
  d->bytes_in_use += r;
  if (d->bytes_in_use > d->bytes_peak) d->bytes_peak = d->bytes_in_use;
  return FY_OK;
}

static void tl_free(struct fy_device *d, void *p, size_t n) {
  if (p) d->bytes_in_use -= fy_device_round(n, TL(d)->granule);
}

static fy_status tl_stream_create(struct fy_device *d, fy_stream **out) {
  struct tl_stream *s = calloc(1, sizeof *s);
  if (!s) return fy_error_set(FY_ERR_NOMEM, "out of memory");
  s->base.dev = d;
  s->id = TL(d)->n_streams++;
  if (s->id < MAX_STREAMS) snprintf(TL(d)->names[s->id], sizeof TL(d)->names[0], "stream %d", s->id);
  *out = &s->base;
  return FY_OK;
}

static void tl_stream_free(struct fy_device *d, fy_stream *s) { free(s); }

static fy_status tl_copy(fy_stream *s, void *dst, const void *src, size_t n) {
  struct fy_device *d = s->dev;
  struct tl *t = TL(d);
  struct tl_stream *ts = (struct tl_stream *)s;
  bool to_dev = tl_owns(d, dst), from_dev = tl_owns(d, src);
  if (to_dev == from_dev) return FY_OK;  // within one side: negligible next to the link
  int dir = to_dev ? 0 : 1;
  double start = ts->clock > t->link_free[dir] ? ts->clock : t->link_free[dir];
  double dur = (double)n / t->rate[dir] + t->latency;
  add_span(d, ts->id, start, start + dur, dir ? "to host" : "to device");
  ts->clock = t->link_free[dir] = start + dur;
  t->stats.bytes[dir] += (double)n;
  t->stats.busy_s[dir] += dur;
  return FY_OK;
}

void fy_timeline_set_copy_latency(struct fy_device *dev, double seconds) { TL(dev)->latency = seconds > 0 ? seconds : 0; }
void fy_timeline_set_granule(struct fy_device *dev, size_t granule) { TL(dev)->granule = granule > 0 ? granule : 1; }

static fy_status tl_memset(fy_stream *s, void *dst, int v, size_t n) { return FY_OK; }
static fy_status tl_enqueue(fy_stream *s, fy_host_fn fn, void *arg) { return FY_OK; }  // not run
static fy_status tl_sync(fy_stream *s) { return FY_OK; }

static fy_status tl_event_create(struct fy_device *d, fy_event **out) {
  struct tl_event *e = calloc(1, sizeof *e);
  if (!e) return fy_error_set(FY_ERR_NOMEM, "out of memory");
  e->base.dev = d;
  *out = &e->base;
  return FY_OK;
}

static void tl_event_free(struct fy_device *d, fy_event *e) { free(e); }

static fy_status tl_record(fy_event *e, fy_stream *s) {
  struct tl_event *te = (struct tl_event *)e;
  const struct tl_stream *ts = (const struct tl_stream *)s;
  te->time = ts->clock;
  te->cause = ts->cause;
  te->wait_cause = ts->wait_cause;
  te->wait_end = ts->wait_end;
  return FY_OK;
}

// s waits from its clock to t: the part until `held` (what the awaited stream itself waited for)
// is charged to held_cause, the rest to cause.
static void tl_stall(struct tl_stream *s, double t, enum fy_stall cause, double held, enum fy_stall held_cause) {
  if (t <= s->clock) return;
  double first = held > s->clock ? (held < t ? held : t) - s->clock : 0;
  if (TL(s->base.dev)->record) {
    s->stalls[held_cause] += first;
    s->stalls[cause] += t - s->clock - first;
  }
  s->wait_cause = t - s->clock - first >= first ? cause : held_cause;
  s->wait_end = t;
  s->clock = t;
}

static fy_status tl_wait(fy_stream *s, fy_event *e) {
  const struct tl_event *te = (const struct tl_event *)e;
  tl_stall((struct tl_stream *)s, te->time, te->cause, te->wait_end, te->wait_cause);
  return FY_OK;
}

static fy_status tl_event_sync(fy_event *e) { return FY_OK; }

static void tl_copy_stats(const struct fy_device *d, struct fy_copy_stats *out) { *out = TL(d)->stats; }

static void tl_destroy(struct fy_device *d) {
  free(TL(d)->spans);
  free(d->impl);
  free(d);
}

static const struct fy_device_ops fy_timeline_ops = {
    .alloc = tl_alloc,
    .free = tl_free,
    .stream_create = tl_stream_create,
    .stream_free = tl_stream_free,
    .copy_async = tl_copy,
    .memset_async = tl_memset,
    .enqueue = tl_enqueue,
    .stream_sync = tl_sync,
    .event_create = tl_event_create,
    .event_free = tl_event_free,
    .event_record = tl_record,
    .stream_wait = tl_wait,
    .event_sync = tl_event_sync,
    .destroy = tl_destroy,
    .owns = tl_owns,
    .copy_stats = tl_copy_stats,
};

fy_status fy_timeline_create(size_t cap, double h2d_gbps, double d2h_gbps, struct fy_device **out) {
  if (!(h2d_gbps > 0) || !(d2h_gbps > 0)) return fy_error_set(FY_ERR_INVALID, "timeline: link rates must be positive");
  struct fy_device *d = calloc(1, sizeof *d);
  struct tl *t = calloc(1, sizeof *t);
  if (!d || !t) {
    free(d);
    free(t);
    return fy_error_set(FY_ERR_NOMEM, "out of memory");
  }
  t->rate[0] = h2d_gbps * 1e9;
  t->rate[1] = d2h_gbps * 1e9;
  t->next = FAKE_BASE;
  t->granule = FY_HOST_ALLOC_GRANULE;
  d->kind = FY_DEVICE_SIM;
  d->name = "planned";
  d->ops = &fy_timeline_ops;
  d->cap = cap;
  d->impl = t;
  *out = d;
  return FY_OK;
}

void fy_timeline_run(fy_stream *s, double seconds, const char *label) {
  struct tl_stream *ts = (struct tl_stream *)s;
  add_span(s->dev, ts->id, ts->clock, ts->clock + seconds, label);
  ts->clock += seconds;
}

double fy_timeline_clock(const fy_stream *s) { return ((const struct tl_stream *)s)->clock; }

void fy_timeline_set_cause(fy_stream *s, enum fy_stall cause) { ((struct tl_stream *)s)->cause = cause; }

void fy_timeline_wait_until(fy_stream *s, double t, enum fy_stall cause) {
  tl_stall((struct tl_stream *)s, t, cause, 0, cause);
}

void fy_timeline_stalls(const fy_stream *s, double out[FY_STALL_COUNT]) {
  for (int i = 0; i < FY_STALL_COUNT; i++) out[i] = ((const struct tl_stream *)s)->stalls[i];
}

int fy_timeline_spans(const struct fy_device *dev, const struct fy_timeline_span **out) {
  *out = TL(dev)->spans;
  return TL(dev)->n_spans;
}

void fy_timeline_reset_spans(struct fy_device *dev) { TL(dev)->n_spans = 0; }
void fy_timeline_record(struct fy_device *dev, bool on) { TL(dev)->record = on; }

void fy_timeline_name_stream(fy_stream *s, const char *name) {
  int id = ((struct tl_stream *)s)->id;
  if (id < MAX_STREAMS) snprintf(TL(s->dev)->names[id], sizeof TL(s->dev)->names[0], "%s", name);
}

const char *fy_timeline_stream_name(const struct fy_device *dev, int stream) {
  return stream < MAX_STREAMS ? TL(dev)->names[stream] : "stream";
}
