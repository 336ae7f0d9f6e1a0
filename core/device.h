// fy_device: one backend behind a table of functions (docs/design.md, "The objects", "Streams and events").
//
// The engine, the memory manager and the communication layer are written once against this table,
// in CUDA's model: work in a stream runs in order; an event marks a point in a stream; another
// stream may wait for it; the host may block on it. On `cpu`, streams run work at once on the
// caller. Every byte a device hands out is counted (current and peak).
#ifndef FY_DEVICE_H
#define FY_DEVICE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/status.h"

enum fy_device_kind { FY_DEVICE_CPU, FY_DEVICE_SIM, FY_DEVICE_CUDA };
// How a device counts an allocation against its cap: rounded up to whole blocks of its granule
// (one block for 0 bytes) — 64 bytes on the cpu and sim devices (their alignment), cudaMalloc's
// 256 on cuda (core/device_cuda.h).
#define FY_HOST_ALLOC_GRANULE 64
#define FY_CUDA_ALLOC_GRANULE 256
static inline size_t fy_device_round(size_t n, size_t granule) {
  return n ? (n + granule - 1) / granule * granule : granule;
}

struct fy_device;
typedef struct fy_stream fy_stream;
typedef struct fy_event fy_event;
typedef void (*fy_host_fn)(void *arg);

// Bytes moved and seconds the copy engines were busy, per direction (0 = to device, 1 = to host).
struct fy_copy_stats { double bytes[2], busy_s[2]; };

struct fy_device_ops {
  fy_status (*alloc)(struct fy_device *dev, size_t nbytes, void **out);
  void (*free)(struct fy_device *dev, void *ptr, size_t nbytes);  // nbytes as given to alloc
  fy_status (*stream_create)(struct fy_device *dev, fy_stream **out);
  void (*stream_free)(struct fy_device *dev, fy_stream *s);
  // Copies and host functions run in stream order; memory on either side may be host or device.
  fy_status (*copy_async)(fy_stream *s, void *dst, const void *src, size_t nbytes);
  fy_status (*memset_async)(fy_stream *s, void *dst, int value, size_t nbytes);
  fy_status (*enqueue)(fy_stream *s, fy_host_fn fn, void *arg);
  fy_status (*stream_sync)(fy_stream *s);
  fy_status (*event_create)(struct fy_device *dev, fy_event **out);
  void (*event_free)(struct fy_device *dev, fy_event *e);
  fy_status (*event_record)(fy_event *e, fy_stream *s);
  fy_status (*stream_wait)(fy_stream *s, fy_event *e);
  fy_status (*event_sync)(fy_event *e);
  void (*destroy)(struct fy_device *dev);
  // Optional: NULL means the device has no memory of its own that a pointer could point into
  // (cpu: device memory is host memory), and no copy engines to count.
  bool (*owns)(const struct fy_device *dev, const void *p);
  void (*copy_stats)(const struct fy_device *dev, struct fy_copy_stats *out);
  // Optional (profiling; NULL: the device does not time its streams): an event that also keeps
  // when its stream reached it, and the seconds from one such event to another once both have
  // been reached (any streams of the device): FY_ERR_NOT_FOUND, with no message, while either has
  // not been reached yet. A timer is freed with event_free.
  fy_status (*timer_create)(struct fy_device *dev, fy_event **out);
  fy_status (*timer_elapsed)(fy_event *from, fy_event *to, double *seconds);
};

struct fy_device {
  enum fy_device_kind kind;
  const char *name;
  const struct fy_device_ops *ops;
  size_t cap;          // bytes the device may hand out; 0 = unlimited
  size_t bytes_in_use; // counted by alloc/free
  size_t bytes_peak;
  void *impl;          // backend state
};

// The granule dev counts its allocations in (fy_device_round).
static inline size_t fy_device_granule(const struct fy_device *dev) {
  return dev->kind == FY_DEVICE_CUDA ? FY_CUDA_ALLOC_GRANULE : FY_HOST_ALLOC_GRANULE;
}

// The cpu device: host memory (64-byte aligned), streams that run work at once.
fy_status fy_device_cpu_create(size_t cap, struct fy_device **out);
void fy_device_free(struct fy_device *dev);

// The sim device: a CPU device with its own memory pool of `cap` bytes (one mapping, handed out by
// a first-fit allocator, 64-byte aligned; every byte counted in bytes_in_use / bytes_peak), one
// worker thread per stream, and one copy engine per direction (host->device, device->host; a copy
// within the device or within the host uses neither). link_gbps > 0 throttles each engine to that
// many GB/s (1e9 bytes/s), so a copy of n bytes occupies its engine for n / (link_gbps*1e9) s, as
// on a PCIe link; 0 = unthrottled. Kernels are the CPU kernels: device memory is host-addressable.
// Events follow CUDA: a wait captures the event's latest record when it is enqueued; an event never
// recorded does not block. Freeing an event waits until no queued work refers to it.
fy_status fy_device_sim_create(size_t cap, double link_gbps, struct fy_device **out);
// For stress tests: before each work item a stream sleeps a random 0..max_us microseconds
// (seeded; each stream draws from its own sequence, fixed when the stream is created, so set this
// before creating streams); 0 turns it off.
void fy_device_sim_set_jitter(struct fy_device *dev, int max_us, uint64_t seed);

// True when p points into this device's memory (the pool for sim; never for cpu).
static inline bool fy_device_owns(const struct fy_device *dev, const void *p) {
  return dev->ops->owns ? dev->ops->owns(dev, p) : false;
}
static inline void fy_device_copy_stats(const struct fy_device *dev, struct fy_copy_stats *out) {
  if (dev->ops->copy_stats)
    dev->ops->copy_stats(dev, out);
  else
    *out = (struct fy_copy_stats){{0, 0}, {0, 0}};
}

static inline fy_status fy_device_alloc(struct fy_device *dev, size_t n, void **out) {
  return dev->ops->alloc(dev, n, out);
}
static inline void fy_device_dealloc(struct fy_device *dev, void *p, size_t n) {
  dev->ops->free(dev, p, n);
}
// Every backend's stream and event begin with these headers, so the forwarders below find the
// table; the backend extends them (struct sim_stream { struct fy_stream base; ... }).
struct fy_stream { struct fy_device *dev; };
struct fy_event { struct fy_device *dev; };
static inline fy_status fy_copy_async(fy_stream *s, void *dst, const void *src, size_t n) {
  return s->dev->ops->copy_async(s, dst, src, n);
}
static inline fy_status fy_stream_enqueue(fy_stream *s, fy_host_fn fn, void *arg) {
  return s->dev->ops->enqueue(s, fn, arg);
}
static inline fy_status fy_stream_sync(fy_stream *s) { return s->dev->ops->stream_sync(s); }
static inline fy_status fy_event_record(fy_event *e, fy_stream *s) {
  return s->dev->ops->event_record(e, s);
}
static inline fy_status fy_stream_wait(fy_stream *s, fy_event *e) {
  return s->dev->ops->stream_wait(s, e);
}
static inline fy_status fy_event_sync(fy_event *e) { return e->dev->ops->event_sync(e); }
static inline fy_status fy_stream_create(struct fy_device *dev, fy_stream **out) {
  return dev->ops->stream_create(dev, out);
}
static inline void fy_stream_free(fy_stream *s) {
  if (s) s->dev->ops->stream_free(s->dev, s);
}
static inline fy_status fy_event_create(struct fy_device *dev, fy_event **out) {
  return dev->ops->event_create(dev, out);
}
static inline void fy_event_free(fy_event *e) {
  if (e) e->dev->ops->event_free(e->dev, e);
}
static inline bool fy_device_has_timers(const struct fy_device *dev) {
  return dev->ops->timer_create && dev->ops->timer_elapsed;
}
static inline fy_status fy_timer_create(struct fy_device *dev, fy_event **out) {
  return dev->ops->timer_create(dev, out);
}
static inline fy_status fy_timer_elapsed(fy_event *from, fy_event *to, double *seconds) {
  return from->dev->ops->timer_elapsed(from, to, seconds);
}

#endif
