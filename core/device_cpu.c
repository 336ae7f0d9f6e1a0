// The cpu device: host memory, and streams that run their work at once on the caller (there is
// nothing to overlap with), so every recorded event has been reached.
#include <stdlib.h>
#include <string.h>

#include "core/device.h"

static size_t cpu_round(size_t n) { return fy_device_round(n, FY_HOST_ALLOC_GRANULE); }

static fy_status cpu_alloc(struct fy_device *dev, size_t n, void **out) {
  size_t r = cpu_round(n);
  if (dev->cap && dev->bytes_in_use + r > dev->cap)
    return fy_error_set(FY_ERR_NOMEM, "%s device: %zu bytes requested with %zu of %zu in use",
                        dev->name, n, dev->bytes_in_use, dev->cap);
  void *p = aligned_alloc(64, r);
  if (!p) return fy_error_set(FY_ERR_NOMEM, "%s device: cannot allocate %zu bytes", dev->name, n);
  *out = p;
  dev->bytes_in_use += r;
  if (dev->bytes_in_use > dev->bytes_peak) dev->bytes_peak = dev->bytes_in_use;
  return FY_OK;
}

static void cpu_free(struct fy_device *dev, void *p, size_t n) {
  if (!p) return;
  dev->bytes_in_use -= cpu_round(n);
  free(p);
}

static fy_status cpu_stream_create(struct fy_device *dev, fy_stream **out) {
  fy_stream *s = malloc(sizeof *s);
  if (!s) return fy_error_set(FY_ERR_NOMEM, "cannot allocate a stream");
  s->dev = dev;
  *out = s;
  return FY_OK;
}

static void cpu_stream_free(struct fy_device *dev, fy_stream *s) { (void)dev; free(s); }

static fy_status cpu_copy(fy_stream *s, void *dst, const void *src, size_t n) {
  (void)s;
  memmove(dst, src, n);
  return FY_OK;
}

static fy_status cpu_memset(fy_stream *s, void *dst, int v, size_t n) {
  (void)s;
  memset(dst, v, n);
  return FY_OK;
}

static fy_status cpu_enqueue(fy_stream *s, fy_host_fn fn, void *arg) {
  (void)s;
  fn(arg);
  return FY_OK;
}

static fy_status cpu_nop_stream(fy_stream *s) { (void)s; return FY_OK; }

static fy_status cpu_event_create(struct fy_device *dev, fy_event **out) {
  fy_event *e = malloc(sizeof *e);
  if (!e) return fy_error_set(FY_ERR_NOMEM, "cannot allocate an event");
  e->dev = dev;
  *out = e;
  return FY_OK;
}

static void cpu_event_free(struct fy_device *dev, fy_event *e) { (void)dev; free(e); }
static fy_status cpu_event_record(fy_event *e, fy_stream *s) { (void)e; (void)s; return FY_OK; }
static fy_status cpu_stream_wait(fy_stream *s, fy_event *e) { (void)e; (void)s; return FY_OK; }
static fy_status cpu_event_sync(fy_event *e) { (void)e; return FY_OK; }
static void cpu_destroy(struct fy_device *dev) { free(dev); }

static const struct fy_device_ops fy_cpu_ops = {
    .alloc = cpu_alloc,
    .free = cpu_free,
    .stream_create = cpu_stream_create,
    .stream_free = cpu_stream_free,
    .copy_async = cpu_copy,
    .memset_async = cpu_memset,
    .enqueue = cpu_enqueue,
    .stream_sync = cpu_nop_stream,
    .event_create = cpu_event_create,
    .event_free = cpu_event_free,
    .event_record = cpu_event_record,
    .stream_wait = cpu_stream_wait,
    .event_sync = cpu_event_sync,
    .destroy = cpu_destroy,
};

fy_status fy_device_cpu_create(size_t cap, struct fy_device **out) {
  struct fy_device *d = calloc(1, sizeof *d);
  if (!d) return fy_error_set(FY_ERR_NOMEM, "cannot allocate the cpu device");
  d->kind = FY_DEVICE_CPU;
  d->name = "cpu";
  d->ops = &fy_cpu_ops;
  d->cap = cap;
  *out = d;
  return FY_OK;
}

void fy_device_free(struct fy_device *dev) {
  if (dev) dev->ops->destroy(dev);
}
