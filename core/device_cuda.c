// The cuda device: core/device.h's table over the CUDA runtime.
//
// Every entry point first makes the device's GPU current on the calling thread (cudaSetDevice),
// because the engine calls from several threads and the runtime's current device is per thread.
// The counters in struct fy_device and the copy statistics are shared between threads, so one
// mutex guards them; the CUDA calls themselves run outside it.
#include <omp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include <cuda_runtime.h>

#include "core/device.h"
#include "core/device_cuda.h"

enum { TO_DEVICE = 0, TO_HOST = 1 };

struct cuda_dev {
  int ordinal;
  char name[32];
  pthread_mutex_t mu;  // bytes_in_use / bytes_peak of the device, and the copy statistics
  double bytes[2];
};

struct cuda_stream {
  struct fy_stream base;
  cudaStream_t s;
  int omp_threads;  // the creating thread's omp_get_max_threads()
};

// A host function on CUDA's callback thread, with the OpenMP thread count of the thread that
// created its stream (omp_set_num_threads is per thread: CUDA's thread would otherwise take
// OMP_NUM_THREADS or every core, whatever --threads said; the host AdamW runs there).
struct host_call {
  fy_host_fn fn;
  void *arg;
  int omp_threads;
};

static void CUDART_CB host_call_run(void *p) {
  struct host_call c = *(struct host_call *)p;
  free(p);
  omp_set_num_threads(c.omp_threads);
  c.fn(c.arg);
}

struct cuda_event {
  struct fy_event base;
  cudaEvent_t e;
};

static struct cuda_dev *impl(const struct fy_device *dev) { return dev->impl; }

// Turns a failed CUDA call into a fy_status; the error is also cleared from the runtime's
// per-thread "last error" so that a later, unrelated check does not report it again.
static fy_status cuda_fail(fy_status st, cudaError_t e, const char *what) {
  (void)cudaGetLastError();
  return fy_error_set(st, "cuda: %s: %s", what, cudaGetErrorString(e));
}

#define CU_TRY(call, what)                              \
  do {                                                  \
    cudaError_t cu_e_ = (call);                         \
    if (cu_e_ != cudaSuccess) return cuda_fail(FY_ERR_INTERNAL, cu_e_, what); \
  } while (0)

static fy_status set_device(const struct fy_device *dev) {
  CU_TRY(cudaSetDevice(impl(dev)->ordinal), "cudaSetDevice");
  return FY_OK;
}

int fy_cuda_device_count(void) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

fy_status fy_cuda_find_gpu(int ordinal, const char *who) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e == cudaSuccess && ordinal >= 0 && ordinal < n) return FY_OK;
  (void)cudaGetLastError();
  const char *vis = getenv("CUDA_VISIBLE_DEVICES");
  int driver = 0;
  if (cudaDriverGetVersion(&driver) != cudaSuccess) driver = 0;  // 0: no driver installed
  (void)cudaGetLastError();
  if (e == cudaErrorInsufficientDriver && driver == 0)
    return fy_error_set(FY_ERR_NOT_FOUND, "%s: no NVIDIA driver here (no GPU, or its driver is not installed)", who);
  if (e == cudaErrorInsufficientDriver)
    return fy_error_set(FY_ERR_NOT_FOUND,
                        "%s: the NVIDIA driver supports CUDA %d.%d, older than this build's CUDA %d.%d runtime: update "
                        "the driver, or build ferry with a CUDA toolkit the driver supports",
                        who, driver / 1000, driver % 1000 / 10, CUDART_VERSION / 1000, CUDART_VERSION % 1000 / 10);
  if (e == cudaSuccess || e == cudaErrorNoDevice) {
    if (n == 0 && vis)
      return fy_error_set(FY_ERR_NOT_FOUND, "%s: no GPU: CUDA_VISIBLE_DEVICES='%s' hides every GPU (unset it, or "
                          "name the GPUs to use)", who, vis);
    if (n == 0) return fy_error_set(FY_ERR_NOT_FOUND, "%s: no GPU here (nvidia-smi lists what the driver sees)", who);
    return fy_error_set(FY_ERR_NOT_FOUND, "%s: no GPU %d (CUDA sees %d%s)", who, ordinal, n,
                        vis ? ", as CUDA_VISIBLE_DEVICES allows" : "");
  }
  return fy_error_set(FY_ERR_NOT_FOUND, "%s: CUDA cannot list the GPUs: %s (is the NVIDIA driver loaded? nvidia-smi "
                      "says)", who, cudaGetErrorString(e));
}

// cudaMalloc hands out 256-byte aligned blocks; counting the rounded size keeps the cap honest
// for many small allocations and makes free's count match alloc's exactly.
static size_t cuda_round(size_t n) { return fy_device_round(n, FY_CUDA_ALLOC_GRANULE); }

static fy_status cuda_alloc(struct fy_device *dev, size_t n, void **out) {
  struct cuda_dev *c = impl(dev);
  size_t r = cuda_round(n);
  // Reserve first, allocate second: two threads cannot both pass the cap check with the same
  // headroom.
  pthread_mutex_lock(&c->mu);
  if (dev->cap && dev->bytes_in_use + r > dev->cap) {
    size_t used = dev->bytes_in_use;
    pthread_mutex_unlock(&c->mu);
    return fy_error_set(FY_ERR_NOMEM, "%s device: %zu bytes requested with %zu of %zu in use",
                        dev->name, n, used, dev->cap);
  }
  dev->bytes_in_use += r;
  if (dev->bytes_in_use > dev->bytes_peak) dev->bytes_peak = dev->bytes_in_use;
  pthread_mutex_unlock(&c->mu);

  void *p = NULL;
  fy_status st = set_device(dev);
  cudaError_t e = st == FY_OK ? cudaMalloc(&p, r) : cudaSuccess;
  if (st != FY_OK || e != cudaSuccess) {
    pthread_mutex_lock(&c->mu);
    dev->bytes_in_use -= r;
    pthread_mutex_unlock(&c->mu);
    if (st != FY_OK) return st;
    return cuda_fail(e == cudaErrorMemoryAllocation ? FY_ERR_NOMEM : FY_ERR_INTERNAL, e,
                     "cudaMalloc");
  }
  *out = p;
  return FY_OK;
}

static void cuda_free(struct fy_device *dev, void *p, size_t n) {
  if (!p) return;
  struct cuda_dev *c = impl(dev);
  if (set_device(dev) == FY_OK) {
    // cudaFree synchronises with the device: memory is never reused under a running kernel.
    cudaError_t e = cudaFree(p);
    if (e != cudaSuccess) (void)cudaGetLastError();
  }
  pthread_mutex_lock(&c->mu);
  dev->bytes_in_use -= cuda_round(n);
  pthread_mutex_unlock(&c->mu);
}

static fy_status cuda_stream_create(struct fy_device *dev, fy_stream **out) {
  FY_TRY(set_device(dev));
  struct cuda_stream *s = calloc(1, sizeof *s);
  if (!s) return fy_error_set(FY_ERR_NOMEM, "cannot allocate a stream");
  cudaError_t e = cudaStreamCreateWithFlags(&s->s, cudaStreamNonBlocking);
  if (e != cudaSuccess) {
    free(s);
    return cuda_fail(FY_ERR_INTERNAL, e, "cudaStreamCreate");
  }
  s->base.dev = dev;
  s->omp_threads = omp_get_max_threads();
  *out = &s->base;
  return FY_OK;
}

static void cuda_stream_free(struct fy_device *dev, fy_stream *fs) {
  struct cuda_stream *s = (struct cuda_stream *)fs;
  if (!s) return;
  // Destroying a stream with work in flight is legal in CUDA (the work completes), but a caller
  // freeing a stream expects its work done, as on sim: finish it first.
  if (set_device(dev) == FY_OK) {
    (void)cudaStreamSynchronize(s->s);
    (void)cudaStreamDestroy(s->s);
    (void)cudaGetLastError();
  }
  free(s);
}

static bool is_device_ptr(const void *p) {
  struct cudaPointerAttributes a;
  cudaError_t e = cudaPointerGetAttributes(&a, p);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // an unknown pointer is host memory, not an error
    return false;
  }
  return a.type == cudaMemoryTypeDevice;
}

static fy_status cuda_copy(fy_stream *fs, void *dst, const void *src, size_t n) {
  struct cuda_stream *s = (struct cuda_stream *)fs;
  if (n == 0) return FY_OK;
  FY_TRY(set_device(fs->dev));
  // cudaMemcpyDefault lets unified addressing find each side's kind, so one call covers host to
  // device, device to host, device to device and host to host.
  CU_TRY(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, s->s), "cudaMemcpyAsync");
  bool dd = is_device_ptr(dst), sd = is_device_ptr(src);
  if (dd != sd) {
    struct cuda_dev *c = impl(fs->dev);
    pthread_mutex_lock(&c->mu);
    c->bytes[dd ? TO_DEVICE : TO_HOST] += (double)n;
    pthread_mutex_unlock(&c->mu);
  }
  return FY_OK;
}

static fy_status cuda_memset(fy_stream *fs, void *dst, int v, size_t n) {
  struct cuda_stream *s = (struct cuda_stream *)fs;
  if (n == 0) return FY_OK;
  FY_TRY(set_device(fs->dev));
  CU_TRY(cudaMemsetAsync(dst, v, n, s->s), "cudaMemsetAsync");
  return FY_OK;
}

static fy_status cuda_enqueue(fy_stream *fs, fy_host_fn fn, void *arg) {
  struct cuda_stream *s = (struct cuda_stream *)fs;
  FY_TRY(set_device(fs->dev));
  struct host_call *c = malloc(sizeof *c);
  if (!c) return fy_error_set(FY_ERR_NOMEM, "cannot allocate a host function's call");
  *c = (struct host_call){.fn = fn, .arg = arg, .omp_threads = s->omp_threads};
  cudaError_t e = cudaLaunchHostFunc(s->s, host_call_run, c);
  if (e != cudaSuccess) {
    free(c);
    return cuda_fail(FY_ERR_INTERNAL, e, "cudaLaunchHostFunc");
  }
  return FY_OK;
}

static fy_status cuda_stream_sync(fy_stream *fs) {
  struct cuda_stream *s = (struct cuda_stream *)fs;
  FY_TRY(set_device(fs->dev));
  CU_TRY(cudaStreamSynchronize(s->s), "cudaStreamSynchronize");
  return FY_OK;
}

static fy_status cuda_event_create(struct fy_device *dev, fy_event **out) {
  FY_TRY(set_device(dev));
  struct cuda_event *e = calloc(1, sizeof *e);
  if (!e) return fy_error_set(FY_ERR_NOMEM, "cannot allocate an event");
  // Timing makes record and wait slower; ordering is all the engine asks of an event.
  cudaError_t ce = cudaEventCreateWithFlags(&e->e, cudaEventDisableTiming);
  if (ce != cudaSuccess) {
    free(e);
    return cuda_fail(FY_ERR_INTERNAL, ce, "cudaEventCreate");
  }
  e->base.dev = dev;
  *out = &e->base;
  return FY_OK;
}

// A timer: an event with CUDA's timing (record and wait cost more), for profiling.
static fy_status cuda_timer_create(struct fy_device *dev, fy_event **out) {
  FY_TRY(set_device(dev));
  struct cuda_event *e = calloc(1, sizeof *e);
  if (!e) return fy_error_set(FY_ERR_NOMEM, "cannot allocate an event");
  cudaError_t ce = cudaEventCreateWithFlags(&e->e, cudaEventDefault);
  if (ce != cudaSuccess) {
    free(e);
    return cuda_fail(FY_ERR_INTERNAL, ce, "cudaEventCreate");
  }
  e->base.dev = dev;
  *out = &e->base;
  return FY_OK;
}

static fy_status cuda_timer_elapsed(fy_event *from, fy_event *to, double *seconds) {
  float ms = 0;
  FY_TRY(set_device(from->dev));
  cudaError_t ce = cudaEventElapsedTime(&ms, ((struct cuda_event *)from)->e, ((struct cuda_event *)to)->e);
  if (ce == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return FY_ERR_NOT_FOUND;
  }
  CU_TRY(ce, "cudaEventElapsedTime");
  *seconds = ms * 1e-3;
  return FY_OK;
}

static void cuda_event_free(struct fy_device *dev, fy_event *fe) {
  struct cuda_event *e = (struct cuda_event *)fe;
  if (!e) return;
  // CUDA defers the release of an event that queued work still refers to, as sim does.
  if (set_device(dev) == FY_OK) {
    (void)cudaEventDestroy(e->e);
    (void)cudaGetLastError();
  }
  free(e);
}

static fy_status cuda_event_record(fy_event *fe, fy_stream *fs) {
  struct cuda_event *e = (struct cuda_event *)fe;
  struct cuda_stream *s = (struct cuda_stream *)fs;
  FY_TRY(set_device(fs->dev));
  CU_TRY(cudaEventRecord(e->e, s->s), "cudaEventRecord");
  return FY_OK;
}

static fy_status cuda_stream_wait(fy_stream *fs, fy_event *fe) {
  struct cuda_event *e = (struct cuda_event *)fe;
  struct cuda_stream *s = (struct cuda_stream *)fs;
  FY_TRY(set_device(fs->dev));
  CU_TRY(cudaStreamWaitEvent(s->s, e->e, 0), "cudaStreamWaitEvent");
  return FY_OK;
}

static fy_status cuda_event_sync(fy_event *fe) {
  struct cuda_event *e = (struct cuda_event *)fe;
  FY_TRY(set_device(fe->dev));
  CU_TRY(cudaEventSynchronize(e->e), "cudaEventSynchronize");
  return FY_OK;
}

static void cuda_destroy(struct fy_device *dev) {
  struct cuda_dev *c = impl(dev);
  pthread_mutex_destroy(&c->mu);
  free(c);
  free(dev);
}

static bool cuda_owns(const struct fy_device *dev, const void *p) {
  struct cudaPointerAttributes a;
  cudaError_t e = cudaPointerGetAttributes(&a, p);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return a.type == cudaMemoryTypeDevice && a.device == impl(dev)->ordinal;
}

static void cuda_copy_stats(const struct fy_device *dev, struct fy_copy_stats *out) {
  struct cuda_dev *c = impl(dev);
  pthread_mutex_lock(&c->mu);
  *out = (struct fy_copy_stats){{c->bytes[TO_DEVICE], c->bytes[TO_HOST]}, {0, 0}};
  pthread_mutex_unlock(&c->mu);
}

static const struct fy_device_ops fy_cuda_ops = {
    .alloc = cuda_alloc,
    .free = cuda_free,
    .stream_create = cuda_stream_create,
    .stream_free = cuda_stream_free,
    .copy_async = cuda_copy,
    .memset_async = cuda_memset,
    .enqueue = cuda_enqueue,
    .stream_sync = cuda_stream_sync,
    .event_create = cuda_event_create,
    .event_free = cuda_event_free,
    .event_record = cuda_event_record,
    .stream_wait = cuda_stream_wait,
    .event_sync = cuda_event_sync,
    .destroy = cuda_destroy,
    .owns = cuda_owns,
    .copy_stats = cuda_copy_stats,
    .timer_create = cuda_timer_create,
    .timer_elapsed = cuda_timer_elapsed,
};

fy_status fy_device_cuda_create(int ordinal, size_t cap, struct fy_device **out) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) return cuda_fail(FY_ERR_UNSUPPORTED, e, "no usable GPU");
  if (ordinal < 0 || ordinal >= n)
    return fy_error_set(FY_ERR_INVALID, "cuda: GPU %d requested, %d present", ordinal, n);
  CU_TRY(cudaSetDevice(ordinal), "cudaSetDevice");
  // Creates the primary context now, so the first timed operation does not pay for it.
  CU_TRY(cudaFree(0), "initialising the CUDA context");
  struct fy_device *d = calloc(1, sizeof *d);
  struct cuda_dev *c = calloc(1, sizeof *c);
  if (!d || !c) {
    free(d);
    free(c);
    return fy_error_set(FY_ERR_NOMEM, "cannot allocate the cuda device");
  }
  c->ordinal = ordinal;
  snprintf(c->name, sizeof c->name, "cuda:%d", ordinal);
  pthread_mutex_init(&c->mu, NULL);
  d->kind = FY_DEVICE_CUDA;
  d->name = c->name;
  d->ops = &fy_cuda_ops;
  d->cap = cap;
  d->impl = c;
  *out = d;
  return FY_OK;
}

cudaStream_t fy_cuda_stream(fy_stream *s) {
  FY_ASSERT(s && s->dev->kind == FY_DEVICE_CUDA);
  return ((struct cuda_stream *)s)->s;
}

int fy_cuda_ordinal(const struct fy_device *dev) {
  FY_ASSERT(dev->kind == FY_DEVICE_CUDA);
  return impl(dev)->ordinal;
}

fy_status fy_cuda_host_pin(void *p, size_t n) {
  if (!p || n == 0) return FY_OK;
  cudaError_t e = cudaHostRegister(p, n, cudaHostRegisterPortable);
  if (e != cudaSuccess) return cuda_fail(FY_ERR_NOMEM, e, "cudaHostRegister (pinning host memory)");
  return FY_OK;
}

void fy_cuda_host_unpin(void *p) {
  if (!p) return;
  if (cudaHostUnregister(p) != cudaSuccess) (void)cudaGetLastError();
}
