// The CUDA emulator's runtime: the part of the CUDA runtime API that ferry calls, on the CPU.
//
// One emulated GPU (FY_EMU_GPUS for more), FY_EMU_DEVICE_MEM bytes of device memory (default
// 16 GiB; cudaMalloc refuses past it). A stream is a worker thread that runs its queue in order
// (kernels, copies, memsets, host functions, event records and waits), so streams overlap as on a
// GPU and a missing event wait shows up as a race. Copies from or to pageable host memory finish
// before the call returns, as CUDA's do; pinned (cudaMallocHost, cudaHostRegister) ones are
// queued. Device memory is host memory: a kernel's stray read or write is caught by the
// sanitizers when the emulator is built with them, and copies are checked against the
// allocations.
#include <stdio.h>
#include <stdlib.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "test/cudaemu/emu_internal.h"

struct CUstream_st {
  std::thread worker;
  uint64_t rng = 0;  // FY_EMU_JITTER_US: the worker's draws of how long to wait before a job
  std::deque<std::function<void()>> queue;
  bool busy = false, stop = false;
  bool blocking = false;  // made without cudaStreamNonBlocking: the legacy stream's calls wait for it
  int device = -1;        // the device current when it was made (-1: the legacy stream, any device's)
  uint64_t launches = 0;
};

void fy_emu_sync_all(bool blocking_only);  // waits for the legacy stream and every (blocking) stream
void fy_emu_track(struct CUstream_st *s, bool add);

struct CUevent_st {
  unsigned flags = 0;
  int device = 0;  // the device current when it was made
  uint64_t recorded = 0, done = 0;  // records made, records reached
  double time_ms = 0;
};

namespace {

// Never destroyed: the workers may still wait on them while the process exits.
std::mutex &mu = *new std::mutex;  // guards every stream, event and allocation table below
std::condition_variable &changed = *new std::condition_variable;

struct allocation {
  size_t bytes;
  int kind;    // 0 device, 1 pinned host (cudaMallocHost), 2 registered host
  int device;  // the device current when it was made (of device memory: the GPU it is on)
};
std::map<uintptr_t, allocation> allocations;
const int MAX_GPUS = 16;
size_t device_used[MAX_GPUS];
thread_local cudaError_t last_error = cudaSuccess;
thread_local int current_device;
std::map<const void *, int> max_dynamic_smem;  // cudaFuncSetAttribute

const size_t DEFAULT_SMEM = 48 << 10;

// An FY_EMU_* switch: set, and neither empty nor "0".
bool env_on(const char *name) {
  const char *v = getenv(name);
  return v && *v && strcmp(v, "0") != 0;
}

// The emulated GPU: sm_90 with 227 KiB of shared memory a block unless FY_EMU_CC ("8.9") and
// FY_EMU_OPTIN_SMEM (bytes) say otherwise, to try ferry's checks on other GPUs.
struct emu_arch {
  int major = 9, minor = 0;
  size_t optin_smem = 227 << 10;
};
const emu_arch &arch() {
  static emu_arch a = [] {
    emu_arch r;
    const char *cc = getenv("FY_EMU_CC"), *sm = getenv("FY_EMU_OPTIN_SMEM");
    if (cc && *cc && sscanf(cc, "%d.%d", &r.major, &r.minor) != 2)
      fy_emu_fail("FY_EMU_CC=%s: a compute capability such as 8.9", cc);
    if (sm && *sm) r.optin_smem = (size_t)strtoull(sm, NULL, 10);
    return r;
  }();
  return a;
}

// FY_EMU_PIN_LIMIT (bytes): cudaHostRegister refuses to take the registered total past it, as a
// system that limits pinned memory does (unset: no limit).
size_t pin_limit() {
  static size_t cap = [] {
    const char *s = getenv("FY_EMU_PIN_LIMIT");
    return s && *s ? (size_t)strtoull(s, NULL, 10) : SIZE_MAX;
  }();
  return cap;
}
size_t pinned_total;  // bytes registered now (under mu)

size_t device_capacity() {
  static size_t cap = [] {
    const char *s = getenv("FY_EMU_DEVICE_MEM");
    return s && *s ? (size_t)strtoull(s, NULL, 10) : (size_t)16 << 30;
  }();
  return cap;
}

// CUDA_VISIBLE_DEVICES's entries, in order (unset: none; set and empty: one empty entry, no GPU)
const std::vector<std::string> &visible_list() {
  static const std::vector<std::string> list = [] {
    std::vector<std::string> l;
    const char *v = getenv("CUDA_VISIBLE_DEVICES");
    if (!v) return l;
    std::string all = v;
    for (size_t from = 0;;) {
      size_t comma = all.find(',', from);
      l.push_back(all.substr(from, comma == std::string::npos ? std::string::npos : comma - from));
      if (comma == std::string::npos) break;
      from = comma + 1;
    }
    return l;
  }();
  return list;
}

// FY_EMU_GPUS (the machine's), or as many as CUDA_VISIBLE_DEVICES lists, as CUDA counts them
int device_count() {
  static int n = [] {
    const char *s = getenv("FY_EMU_GPUS");
    int g = s && *s ? atoi(s) : 1;
    g = g < 1 ? 1 : g > MAX_GPUS ? MAX_GPUS : g;
    const std::vector<std::string> &l = visible_list();
    if (getenv("CUDA_VISIBLE_DEVICES")) {
      int listed = l.size() == 1 && l[0].empty() ? 0 : (int)l.size();
      g = listed < g ? listed : g;
    }
    return g;
  }();
  return n;
}

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

cudaError_t fail(cudaError_t e) {
  last_error = e;
  return e;
}

// FY_EMU_JITTER_US (default 0): a stream waits up to this long, drawn at random, before each job,
// so that streams interleave in ever other ways and a missing wait between them shows sooner.
unsigned jitter_us() {
  static unsigned j = [] {
    const char *s = getenv("FY_EMU_JITTER_US");
    return s && *s ? (unsigned)strtoul(s, NULL, 10) : 0u;
  }();
  return j;
}

void worker_loop(CUstream_st *s) {
  std::unique_lock<std::mutex> lk(mu);
  for (;;) {
    changed.wait(lk, [s] { return s->stop || !s->queue.empty(); });
    if (s->queue.empty()) return;
    std::function<void()> job = std::move(s->queue.front());
    s->queue.pop_front();
    s->busy = true;
    lk.unlock();
    if (jitter_us()) {
      s->rng ^= s->rng << 13, s->rng ^= s->rng >> 7, s->rng ^= s->rng << 17;  // xorshift64
      std::this_thread::sleep_for(std::chrono::microseconds(s->rng % (jitter_us() + 1)));
    }
    job();
    lk.lock();
    s->busy = false;
    changed.notify_all();
  }
}

CUstream_st *stream_new() {
  static std::atomic<uint64_t> made{0};
  CUstream_st *s = new CUstream_st;
  s->rng = ((fy_emu_seed() * 0x9e3779b97f4a7c15ull) ^ (++made * 0xbf58476d1ce4e5b9ull)) | 1;
  s->worker = std::thread(worker_loop, s);
  return s;
}

CUstream_st *stream_of(cudaStream_t st) {
  static CUstream_st *legacy = stream_new();  // stream 0
  return st ? (CUstream_st *)st : legacy;
}

void enqueue(cudaStream_t st, std::function<void()> job) {
  CUstream_st *s = stream_of(st);
  std::lock_guard<std::mutex> lk(mu);
  s->queue.push_back(std::move(job));
  changed.notify_all();
}

void wait_idle(CUstream_st *s) {
  std::unique_lock<std::mutex> lk(mu);
  changed.wait(lk, [s] { return s->queue.empty() && !s->busy; });
}

// The allocation holding p (mu held), or NULL
const std::pair<const uintptr_t, allocation> *find(const void *p) {
  auto it = allocations.upper_bound((uintptr_t)p);
  if (it == allocations.begin()) return NULL;
  --it;
  if ((uintptr_t)p >= it->first + it->second.bytes) return NULL;
  return &*it;
}

}  // namespace

void fy_emu_enqueue(cudaStream_t st, std::function<void()> job) { enqueue(st, std::move(job)); }

void fy_emu_check_range(const void *p, size_t n, const char *what) {
  std::lock_guard<std::mutex> lk(mu);
  auto a = find(p);
  if (!a || (uintptr_t)p + n > a->first + a->second.bytes)
    fy_emu_fail("%s: %zu bytes at %p are not in device, pinned or registered memory", what, n, p);
}

int fy_emu_current_device(void) { return current_device; }

int fy_emu_physical_gpu(int ordinal) {
  const std::vector<std::string> &l = visible_list();
  if (l.empty()) return ordinal;
  if (ordinal < 0 || ordinal >= (int)l.size()) return -1 - ordinal;  // (not one of the machine's)
  char *end;
  long g = strtol(l[ordinal].c_str(), &end, 10);
  if (!l[ordinal].empty() && *end == 0) return (int)g;
  return (int)(1000 + std::hash<std::string>()(l[ordinal]) % 1000000);  // a UUID or the like: its own GPU
}

int fy_emu_stream_device(cudaStream_t st) { return stream_of(st)->device; }

int fy_emu_device_of(const void *p, size_t n) {
  std::lock_guard<std::mutex> lk(mu);
  auto a = find(p);
  if (!a || a->second.kind != 0 || (uintptr_t)p + n > a->first + a->second.bytes) return -1;
  return a->second.device;
}

void fy_emu_check_arg(const char *name, int i, const void *p) {
  if (!p) return;
  std::lock_guard<std::mutex> lk(mu);
  auto a = find(p);
  if (!a && (uintptr_t)p > 0) a = find((const char *)p - 1);  // just past an allocation (an end pointer)
  if (!a)
    fy_emu_fail("launch of %s: argument %d (%p) is neither device memory nor pinned or registered host memory: "
                "an illegal address on a GPU", name, i, p);
  if (a->second.kind == 0 && a->second.device != current_device)
    fy_emu_fail("launch of %s on GPU %d: argument %d (%p) is GPU %d's memory", name, current_device, i, p,
                a->second.device);
}

void fy_emu_submit(const char *name, const void *fn, dim3 grid, dim3 block, size_t smem, cudaStream_t st,
                   std::function<void()> body) {
  const uint64_t threads = (uint64_t)block.x * block.y * block.z;
  size_t smem_max = DEFAULT_SMEM;
  {
    std::lock_guard<std::mutex> lk(mu);
    auto it = max_dynamic_smem.find(fn);
    if (it != max_dynamic_smem.end()) smem_max = (size_t)it->second;
  }
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || threads == 0 || threads > 1024 || block.z > 64 ||
      grid.y > 65535 || grid.z > 65535 || grid.x > 2147483647u) {
    fprintf(stderr, "cudaemu: launch of %s with grid (%u,%u,%u) and block (%u,%u,%u): invalid configuration\n", name,
            grid.x, grid.y, grid.z, block.x, block.y, block.z);
    last_error = cudaErrorInvalidConfiguration;
    return;
  }
  if (smem > smem_max) {
    fprintf(stderr, "cudaemu: launch of %s with %zu bytes of dynamic shared memory (at most %zu%s)\n", name, smem,
            smem_max, smem_max == DEFAULT_SMEM ? " without cudaFuncSetAttribute" : "");
    last_error = cudaErrorInvalidValue;
    return;
  }
  CUstream_st *s = stream_of(st);
  if (s->device >= 0 && s->device != current_device) {  // CUDA refuses a launch on another GPU's stream
    fprintf(stderr, "cudaemu: launch of %s on a stream of GPU %d while GPU %d is current\n", name, s->device,
            current_device);
    last_error = cudaErrorInvalidResourceHandle;
    return;
  }
  uint64_t seed;
  {
    std::lock_guard<std::mutex> lk(mu);
    seed = fy_emu_seed() * 1000003u + s->launches++;
  }
  enqueue(st, [name, grid, block, smem, seed, body = std::move(body)] {
    fy_emu_run_grid(name, grid, block, smem, seed, body);
  });
}

extern "C" {

cudaError_t cudaGetLastError(void) {
  cudaError_t e = last_error;
  last_error = cudaSuccess;
  return e;
}

const char *cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorHostMemoryAlreadyRegistered: return "part or all of the requested memory range is already mapped";
    case cudaErrorHostMemoryNotRegistered: return "pointer does not correspond to a registered memory region";
    case cudaErrorNoKernelImageForDevice: return "no kernel image is available for execution on the device";
    case cudaErrorInsufficientDriver: return "CUDA driver version is insufficient for CUDA runtime version";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    default: return "unknown error (cuda emulator)";
  }
}

// FY_EMU_OLD_DRIVER=1: the driver supports CUDA 12.4 only; FY_EMU_NO_DRIVER=1: none is installed.
// Either way CUDA finds no GPU and says the driver is insufficient.
cudaError_t cudaDriverGetVersion(int *v) {
  *v = env_on("FY_EMU_NO_DRIVER") ? 0 : env_on("FY_EMU_OLD_DRIVER") ? 12040 : CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceCount(int *n) {
  if (env_on("FY_EMU_OLD_DRIVER") || env_on("FY_EMU_NO_DRIVER")) {
    *n = 0;
    return fail(cudaErrorInsufficientDriver);
  }
  *n = device_count();
  return *n > 0 ? cudaSuccess : fail(cudaErrorNoDevice);  // (as CUDA answers with no GPU)
}

cudaError_t cudaSetDevice(int d) {
  if (d < 0 || d >= device_count()) return fail(cudaErrorInvalidDevice);
  current_device = d;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int *d) {
  *d = current_device;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int *v, enum cudaDeviceAttr attr, int dev) {
  if (dev < 0 || dev >= device_count()) return fail(cudaErrorInvalidDevice);
  switch (attr) {
    case cudaDevAttrComputeCapabilityMajor: *v = arch().major; break;
    case cudaDevAttrComputeCapabilityMinor: *v = arch().minor; break;
    case cudaDevAttrMultiProcessorCount: *v = 132; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *v = (int)arch().optin_smem; break;
    case cudaDevAttrMaxThreadsPerBlock: *v = 1024; break;
    case cudaDevAttrWarpSize: *v = 32; break;
    default: return fail(cudaErrorInvalidValue);
  }
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *p, int dev) {
  if (dev < 0 || dev >= device_count()) return fail(cudaErrorInvalidDevice);
  memset(p, 0, sizeof *p);
  snprintf(p->name, sizeof p->name, "ferry CUDA emulator (sm_%d%d)", arch().major, arch().minor);
  p->totalGlobalMem = device_capacity();
  p->major = arch().major;
  p->minor = arch().minor;
  p->multiProcessorCount = 132;
  p->sharedMemPerBlock = DEFAULT_SMEM;
  p->sharedMemPerBlockOptin = arch().optin_smem;
  p->maxThreadsPerBlock = 1024;
  p->warpSize = 32;
  p->pciBusID = dev;
  return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total) {
  std::lock_guard<std::mutex> lk(mu);
  *total = device_capacity();
  *free_bytes = device_capacity() - device_used[current_device];
  return cudaSuccess;
}

cudaError_t cudaMalloc(void **p, size_t n) {
  std::lock_guard<std::mutex> lk(mu);
  const size_t bytes = (n + 255) / 256 * 256;
  if (device_used[current_device] + bytes > device_capacity()) {
    *p = NULL;
    last_error = cudaErrorMemoryAllocation;
    return cudaErrorMemoryAllocation;
  }
  // Exactly n bytes (256-aligned, as cudaMalloc's): a sanitizer sees a kernel read past them,
  // which a GPU's rounding of allocations would hide
  void *m = NULL;
  if (posix_memalign(&m, 256, n ? n : 1) != 0) return fail(cudaErrorMemoryAllocation);
  allocations[(uintptr_t)m] = allocation{n, 0, current_device};
  device_used[current_device] += bytes;
  *p = m;
  return cudaSuccess;
}

cudaError_t cudaFree(void *p) {
  if (!p) return cudaSuccess;
  fy_emu_sync_all(false);  // as cudaFree: the device is done with it
  std::lock_guard<std::mutex> lk(mu);
  auto it = allocations.find((uintptr_t)p);
  if (it == allocations.end() || it->second.kind != 0) return fail(cudaErrorInvalidValue);
  device_used[it->second.device] -= (it->second.bytes + 255) / 256 * 256;
  allocations.erase(it);
  free(p);
  return cudaSuccess;
}

cudaError_t cudaMallocHost(void **p, size_t n) {
  void *m = aligned_alloc(4096, (n + 4095) / 4096 * 4096 + (n == 0) * 4096);
  if (!m) return fail(cudaErrorMemoryAllocation);
  std::lock_guard<std::mutex> lk(mu);
  allocations[(uintptr_t)m] = allocation{n, 1, current_device};
  *p = m;
  return cudaSuccess;
}

cudaError_t cudaFreeHost(void *p) {
  if (!p) return cudaSuccess;
  fy_emu_sync_all(false);
  std::lock_guard<std::mutex> lk(mu);
  auto it = allocations.find((uintptr_t)p);
  if (it == allocations.end() || it->second.kind != 1) return fail(cudaErrorInvalidValue);
  allocations.erase(it);
  free(p);
  return cudaSuccess;
}

cudaError_t cudaHostRegister(void *p, size_t n, unsigned flags) {
  (void)flags;
  std::lock_guard<std::mutex> lk(mu);
  if (find(p) || find((char *)p + n - 1)) return fail(cudaErrorHostMemoryAlreadyRegistered);
  if (n > pin_limit() - pinned_total) return fail(cudaErrorMemoryAllocation);
  allocations[(uintptr_t)p] = allocation{n, 2, current_device};
  pinned_total += n;
  return cudaSuccess;
}

cudaError_t cudaHostUnregister(void *p) {
  std::lock_guard<std::mutex> lk(mu);
  auto it = allocations.find((uintptr_t)p);
  if (it == allocations.end() || it->second.kind != 2) return fail(cudaErrorHostMemoryNotRegistered);
  pinned_total -= it->second.bytes;
  allocations.erase(it);
  return cudaSuccess;
}

cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *a, const void *p) {
  std::lock_guard<std::mutex> lk(mu);
  memset(a, 0, sizeof *a);
  auto f = find(p);
  if (!f) {
    a->type = cudaMemoryTypeUnregistered;
    a->device = -2;
    a->hostPointer = (void *)p;
    return cudaSuccess;
  }
  a->device = f->second.device;
  if (f->second.kind == 0) {
    a->type = cudaMemoryTypeDevice;
    a->devicePointer = (void *)p;
  } else {
    a->type = cudaMemoryTypeHost;
    a->devicePointer = (void *)p;
    a->hostPointer = (void *)p;
  }
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *st, unsigned flags) {
  CUstream_st *s = stream_new();
  s->blocking = !(flags & cudaStreamNonBlocking);
  s->device = current_device;
  fy_emu_track(s, true);
  *st = (cudaStream_t)s;
  return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t st) {
  if (!st) return fail(cudaErrorInvalidResourceHandle);
  CUstream_st *s = (CUstream_st *)st;
  wait_idle(s);  // CUDA lets queued work finish
  {
    std::lock_guard<std::mutex> lk(mu);
    s->stop = true;
    changed.notify_all();
  }
  s->worker.join();
  fy_emu_track(s, false);
  delete s;
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t st) {
  wait_idle(stream_of(st));
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind, cudaStream_t st) {
  if (n == 0) return cudaSuccess;
  bool sync;  // pageable host memory on either side: done when the call returns
  {
    std::lock_guard<std::mutex> lk(mu);
    auto d = find(dst), s = find(src);
    const bool dd = d && d->second.kind == 0, sd = s && s->second.kind == 0;
    bool ok = true;
    switch (kind) {
      case cudaMemcpyHostToDevice: ok = dd && !sd; break;
      case cudaMemcpyDeviceToHost: ok = sd && !dd; break;
      case cudaMemcpyDeviceToDevice: ok = sd && dd; break;
      case cudaMemcpyHostToHost: ok = !sd && !dd; break;
      default: break;
    }
    if (!ok) return fail(cudaErrorInvalidValue);
    if ((d && (uintptr_t)dst + n > d->first + d->second.bytes) || (s && (uintptr_t)src + n > s->first + s->second.bytes))
      fy_emu_fail("cudaMemcpyAsync of %zu bytes %p -> %p runs past its allocation", n, src, dst);
    sync = !d || !s;
  }
  enqueue(st, [dst, src, n] { memmove(dst, src, n); });
  if (sync) wait_idle(stream_of(st));
  return cudaSuccess;
}

// The synchronous copy runs on the legacy stream: after the work queued on blocking
// streams, not on non-blocking ones (ferry's), whose results a caller must wait for itself.
cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind) {
  fy_emu_sync_all(true);
  cudaError_t e = cudaMemcpyAsync(dst, src, n, kind, 0);
  if (e == cudaSuccess) wait_idle(stream_of(0));
  return e;
}

cudaError_t cudaMemsetAsync(void *dst, int v, size_t n, cudaStream_t st) {
  if (n == 0) return cudaSuccess;
  fy_emu_check_range(dst, n, "cudaMemsetAsync");
  enqueue(st, [dst, v, n] { memset(dst, v, n); });
  return cudaSuccess;
}

// On the legacy stream, as cudaMemcpy (a GPU may return before it is done; here it is done).
cudaError_t cudaMemset(void *dst, int v, size_t n) {
  fy_emu_sync_all(true);
  cudaError_t e = cudaMemsetAsync(dst, v, n, 0);
  if (e == cudaSuccess) wait_idle(stream_of(0));
  return e;
}

cudaError_t cudaLaunchHostFunc(cudaStream_t st, cudaHostFn_t fn, void *data) {
  enqueue(st, [fn, data] { fn(data); });
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags) {
  CUevent_st *ev = new CUevent_st;
  ev->flags = flags;
  ev->device = current_device;
  *e = (cudaEvent_t)ev;
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t *e) { return cudaEventCreateWithFlags(e, 0); }

cudaError_t cudaEventDestroy(cudaEvent_t e) {
  if (!e) return fail(cudaErrorInvalidResourceHandle);
  CUevent_st *ev = (CUevent_st *)e;
  // CUDA defers the release until the event's work is done
  std::unique_lock<std::mutex> lk(mu);
  changed.wait(lk, [ev] { return ev->done >= ev->recorded; });
  delete ev;
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t st) {
  if (!e) return fail(cudaErrorInvalidResourceHandle);
  CUevent_st *ev = (CUevent_st *)e;
  if (stream_of(st)->device >= 0 && stream_of(st)->device != ev->device) {  // as CUDA: same GPU only
    fprintf(stderr, "cudaemu: cudaEventRecord of an event of GPU %d on a stream of GPU %d\n", ev->device,
            stream_of(st)->device);
    return fail(cudaErrorInvalidResourceHandle);
  }
  uint64_t seq;
  {
    std::lock_guard<std::mutex> lk(mu);
    seq = ++ev->recorded;
  }
  enqueue(st, [ev, seq] {
    std::lock_guard<std::mutex> lk(mu);
    if (seq > ev->done) {
      ev->done = seq;
      ev->time_ms = now_ms();
    }
    changed.notify_all();
  });
  return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t st, cudaEvent_t e, unsigned flags) {
  (void)flags;
  if (!e) return fail(cudaErrorInvalidResourceHandle);
  CUevent_st *ev = (CUevent_st *)e;
  uint64_t target;
  {
    std::lock_guard<std::mutex> lk(mu);
    target = ev->recorded;  // the record made last, at the time of the call
  }
  enqueue(st, [ev, target] {
    std::unique_lock<std::mutex> lk(mu);
    changed.wait(lk, [ev, target] { return ev->done >= target; });
  });
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t e) {
  if (!e) return fail(cudaErrorInvalidResourceHandle);
  CUevent_st *ev = (CUevent_st *)e;
  std::lock_guard<std::mutex> lk(mu);
  return ev->done >= ev->recorded ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  if (!e) return fail(cudaErrorInvalidResourceHandle);
  CUevent_st *ev = (CUevent_st *)e;
  std::unique_lock<std::mutex> lk(mu);
  const uint64_t target = ev->recorded;
  changed.wait(lk, [ev, target] { return ev->done >= target; });
  return cudaSuccess;
}

cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b) {
  if (!a || !b) return fail(cudaErrorInvalidResourceHandle);
  CUevent_st *ea = (CUevent_st *)a, *eb = (CUevent_st *)b;
  std::lock_guard<std::mutex> lk(mu);
  if ((ea->flags | eb->flags) & cudaEventDisableTiming) return fail(cudaErrorInvalidResourceHandle);
  if (ea->done < ea->recorded || eb->done < eb->recorded) return fail(cudaErrorNotReady);
  if (!ea->recorded || !eb->recorded) return fail(cudaErrorInvalidResourceHandle);
  *ms = (float)(eb->time_ms - ea->time_ms);
  return cudaSuccess;
}

cudaError_t cudaFuncSetAttribute(const void *fn, enum cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaSuccess;
  if (value < 0 || (size_t)value > arch().optin_smem) return fail(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lk(mu);
  max_dynamic_smem[fn] = value;
  return cudaSuccess;
}

// FY_EMU_NO_IMAGE=1: the GPU has no code in the build (what CUDA says of a kernel compiled for
// other architectures only)
cudaError_t cudaFuncGetAttributes(struct cudaFuncAttributes *a, const void *fn) {
  if (env_on("FY_EMU_NO_IMAGE")) return fail(cudaErrorNoKernelImageForDevice);
  if (!a || !fn) return fail(cudaErrorInvalidValue);
  memset(a, 0, sizeof *a);
  a->maxThreadsPerBlock = 1024;
  a->maxDynamicSharedSizeBytes = (int)DEFAULT_SMEM;
  a->ptxVersion = a->binaryVersion = 10 * arch().major + arch().minor;
  return cudaSuccess;
}

}  // extern "C"

// Every stream made and not destroyed, and the legacy one: cudaFree, cudaMemcpy
namespace {
std::vector<CUstream_st *> &live = *new std::vector<CUstream_st *>;  // (under mu)
}  // namespace

void fy_emu_track(CUstream_st *s, bool add) {
  std::lock_guard<std::mutex> lk(mu);
  if (add) {
    live.push_back(s);
  } else {
    for (size_t i = 0; i < live.size(); i++)
      if (live[i] == s) live.erase(live.begin() + i--);
  }
}

void fy_emu_sync_all(bool blocking_only) {
  std::vector<CUstream_st *> all;
  {
    std::lock_guard<std::mutex> lk(mu);
    all = live;
  }
  all.push_back(stream_of(0));
  for (CUstream_st *s : all)
    if (!blocking_only || s->blocking || s == stream_of(0)) wait_idle(s);
}
