#include "core/wait_profile.h"

#include <stdlib.h>
#include <string.h>

// Records live in a ring of slots, each with its two timers (made on first use and reused). A
// record's id counts every record made, so a slot's record is id % RING_SLOTS and an id whose slot
// has been taken again is stale (its overlap is then not split off). Counted records are resolved
// in order by collect; a helper record (another stream's wait) is only read by the counted record
// that names it, after which its slot may go.
#define RING_SLOTS 4096

struct record {
  int64_t id;           // -1: free
  fy_event *t0, *t1;    // on the waiting stream, before and after the wait
  enum fy_stall cause;
  int64_t held_by;      // a helper record's id, or -1
  bool counted;
};

struct fy_wait_profile {
  fy_stream *counted;
  bool on;
  struct record *ring;
  int64_t next_id;      // the next record's id
  int64_t oldest;       // the oldest counted record not yet collected (or next_id)
  int64_t gap;          // the open gap's record, or -1
  double seconds[FY_STALL_COUNT];
};

fy_status fy_wait_profile_create(fy_stream *counted, struct fy_wait_profile **out) {
  *out = NULL;
  if (!fy_device_has_timers(counted->dev)) return FY_OK;
  struct fy_wait_profile *p = calloc(1, sizeof *p);
  if (p) p->ring = calloc(RING_SLOTS, sizeof *p->ring);
  if (!p || !p->ring) {
    free(p);
    return fy_error_set(FY_ERR_NOMEM, "cannot allocate the wait profile");
  }
  for (int i = 0; i < RING_SLOTS; i++) p->ring[i].id = -1;
  p->counted = counted;
  p->gap = -1;
  *out = p;
  return FY_OK;
}

void fy_wait_profile_free(struct fy_wait_profile *p) {
  if (!p) return;
  for (int i = 0; i < RING_SLOTS; i++) {
    fy_event_free(p->ring[i].t0);
    fy_event_free(p->ring[i].t1);
  }
  free(p->ring);
  free(p);
}

void fy_wait_profile_enable(struct fy_wait_profile *p, bool on) {
  if (p) p->on = on;
}

static struct record *slot(struct fy_wait_profile *p, int64_t id) { return &p->ring[id % RING_SLOTS]; }

// The record with this id (or an int id: its low 30 bits), or NULL when its slot has been taken
// again.
static struct record *find(struct fy_wait_profile *p, int64_t id) {
  if (id < 0) return NULL;
  struct record *r = slot(p, id);
  return r->id >= 0 && (r->id & 0x3fffffff) == (id & 0x3fffffff) ? r : NULL;
}

// A new record's slot, with its timers: the ring's next (a counted record still there is collected
// first, waiting for its timers: the ring is sized so that this does not happen in a step).
static fy_status new_record(struct fy_wait_profile *p, struct record **out) {
  struct record *r = slot(p, p->next_id);
  if (r->id >= 0 && r->counted && r->id >= p->oldest) FY_TRY(fy_wait_profile_collect(p, true));
  struct fy_device *dev = p->counted->dev;
  if (!r->t0) FY_TRY(fy_timer_create(dev, &r->t0));
  if (!r->t1) FY_TRY(fy_timer_create(dev, &r->t1));
  r->id = p->next_id++;
  r->held_by = -1;
  *out = r;
  return FY_OK;
}

fy_status fy_wait_timed(struct fy_wait_profile *p, fy_stream *s, fy_event *e, enum fy_stall cause, int held_by,
                        int *id) {
  if (id) *id = -1;
  if (!p || !p->on) return fy_stream_wait(s, e);
  struct record *r;
  FY_TRY(new_record(p, &r));
  r->cause = cause;
  r->counted = s == p->counted;
  r->held_by = held_by;
  FY_TRY(fy_event_record(r->t0, s));
  FY_TRY(fy_stream_wait(s, e));
  FY_TRY(fy_event_record(r->t1, s));
  if (id) *id = (int)(r->id & 0x3fffffff);  // (ids as ints: find() then checks the slot's own)
  return FY_OK;
}

fy_status fy_wait_profile_gap_begin(struct fy_wait_profile *p) {
  if (!p || !p->on) return FY_OK;
  struct record *r;
  FY_TRY(new_record(p, &r));
  r->counted = false;  // (counted once its end is marked)
  r->cause = FY_STALL_NORM;
  p->gap = r->id;
  return fy_event_record(r->t0, p->counted);
}

fy_status fy_wait_profile_gap_end(struct fy_wait_profile *p, enum fy_stall cause) {
  if (!p || !p->on) return FY_OK;
  struct record *r = find(p, p->gap);
  p->gap = -1;
  if (!r) return FY_OK;
  r->cause = cause;
  r->counted = true;
  if (p->oldest > r->id) p->oldest = r->id;
  return fy_event_record(r->t1, p->counted);
}

// Seconds from a to b; FY_ERR_NOT_FOUND while either has not been reached.
static fy_status span(fy_event *a, fy_event *b, bool all, double *out) {
  if (all) {
    FY_TRY(fy_event_sync(a));
    FY_TRY(fy_event_sync(b));
  }
  return fy_timer_elapsed(a, b, out);
}

fy_status fy_wait_profile_collect(struct fy_wait_profile *p, bool all) {
  if (!p) return FY_OK;
  for (; p->oldest < p->next_id; p->oldest++) {
    struct record *r = find(p, p->oldest);
    if (!r || !r->counted || r->id == p->gap) {
      if (r && r->id == p->gap) break;  // (an open gap ends later)
      continue;
    }
    double d;
    fy_status st = span(r->t0, r->t1, all, &d);
    if (st == FY_ERR_NOT_FOUND) break;  // (not reached yet: the rest later)
    FY_TRY(st);
    if (d < 0) d = 0;
    double held = 0;
    struct record *h = find(p, r->held_by);
    double h0, h1;  // the helper wait's bounds, from r's start
    if (h && span(r->t0, h->t0, all, &h0) == FY_OK && span(r->t0, h->t1, all, &h1) == FY_OK) {
      double a = h0 > 0 ? h0 : 0, b = h1 < d ? h1 : d;
      held = b > a ? b - a : 0;
      p->seconds[h->cause] += held;
    }
    p->seconds[r->cause] += d - held;
    r->counted = false;  // (collected)
  }
  return FY_OK;
}

void fy_wait_profile_seconds(const struct fy_wait_profile *p, double out[FY_STALL_COUNT]) {
  for (int i = 0; i < FY_STALL_COUNT; i++) out[i] = p ? p->seconds[i] : 0;
}
