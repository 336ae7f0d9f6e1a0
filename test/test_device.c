// core/device_cpu.c and core/device_sim.c: memory accounting, the cap, the sim pool's first fit and
// coalescing, stream order, events across streams (with injected delays), event reuse and CUDA's
// rules for waits, host syncs, the copy engines' throttling and overlap, copy stats, ownership.
//
// Some tests hold a stream on a gate (a host function that blocks until the test opens it), so the
// ordering they check cannot be met by luck. The few sleeps in here only widen a race window; no
// check depends on how long they are.
// usage: test_device                 (the plain run)
//        test_device --part timing   (the throttled link's copies against their wire time, and
//                                     overlapping each way, on a machine that is not loaded)
#include <omp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>

#include "core/device.h"
#include "core/clock.h"
#include "core/log.h"
#include "core/status.h"
#include "test/check.h"

#define MB (1000 * 1000)

static void sleep_ms(int ms) {
  struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

static fy_stream *stream_new(struct fy_device *dev) {
  fy_stream *s = NULL;
  CHECK_OK(dev->ops->stream_create(dev, &s));
  return s;
}

static fy_event *event_new(struct fy_device *dev) {
  fy_event *e = NULL;
  CHECK_OK(dev->ops->event_create(dev, &e));
  return e;
}

// ---- a gate: a host function that holds its stream until the test opens it ----

struct gate {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  bool open;
};

static void gate_init(struct gate *g) {
  pthread_mutex_init(&g->mu, NULL);
  pthread_cond_init(&g->cv, NULL);
  g->open = false;
}

static void gate_pass(void *arg) {
  struct gate *g = arg;
  pthread_mutex_lock(&g->mu);
  while (!g->open) pthread_cond_wait(&g->cv, &g->mu);
  pthread_mutex_unlock(&g->mu);
}

static void gate_open(struct gate *g) {
  pthread_mutex_lock(&g->mu);
  g->open = true;
  pthread_cond_broadcast(&g->cv);
  pthread_mutex_unlock(&g->mu);
}

static void gate_destroy(struct gate *g) {
  pthread_cond_destroy(&g->cv);
  pthread_mutex_destroy(&g->mu);
}

// Opens a gate from another thread after a delay, so the main thread can block in a sync.
static void *gate_open_later(void *arg) {
  sleep_ms(20);
  gate_open(arg);
  return NULL;
}

// A flag set by a host function and read by the test after a sync; atomic so that a missing
// happens-before shows up as a wrong value, not as a data race in the test itself.
static void flag_set(void *arg) { atomic_store((atomic_int *)arg, 1); }

// ---- memory ----

static void test_accounting(struct fy_device *dev) {
  void *a = NULL, *b = NULL;
  size_t base = dev->bytes_in_use, peak0 = dev->bytes_peak;
  CHECK_OK(fy_device_alloc(dev, 1000, &a));
  CHECK(((uintptr_t)a & 63) == 0);
  CHECK(dev->bytes_in_use == base + 1024);
  CHECK_OK(fy_device_alloc(dev, 64, &b));
  CHECK(((uintptr_t)b & 63) == 0);
  CHECK(dev->bytes_in_use == base + 1088);
  memset(a, 1, 1000);
  memset(b, 2, 64);
  fy_device_dealloc(dev, a, 1000);
  CHECK(dev->bytes_in_use == base + 64);
  fy_device_dealloc(dev, b, 64);
  CHECK(dev->bytes_in_use == base);
  CHECK(dev->bytes_peak == (peak0 > base + 1088 ? peak0 : base + 1088));
  void *z = NULL;
  CHECK_OK(fy_device_alloc(dev, 0, &z));  // a zero-byte buffer is still a distinct pointer
  CHECK(z && dev->bytes_in_use == base + 64);
  fy_device_dealloc(dev, z, 0);
  CHECK(dev->bytes_in_use == base);
}

// The device's cap is 1 MB: allocating past it fails and changes nothing.
static void test_cap(struct fy_device *dev) {
  void *a = NULL, *b = NULL;
  CHECK_OK(fy_device_alloc(dev, 700 * 1000, &a));
  size_t used = dev->bytes_in_use;
  CHECK_ERR(fy_device_alloc(dev, 400 * 1000, &b), FY_ERR_NOMEM);
  CHECK(strstr(fy_error_msg(), "400000") != NULL);
  CHECK(dev->bytes_in_use == used);
  CHECK_ERR(fy_device_alloc(dev, (size_t)1 << 62, &b), FY_ERR_NOMEM);
  CHECK(dev->bytes_in_use == used);
  CHECK_OK(fy_device_alloc(dev, 200 * 1000, &b));
  fy_device_dealloc(dev, b, 200 * 1000);
  fy_device_dealloc(dev, a, 700 * 1000);
  CHECK(dev->bytes_in_use == 0);
}

// Four quarters fill a 1 MiB pool; freeing the first and third leaves half free but no hole big
// enough for half; freeing the second joins the three into one block at the base.
static void test_fragmentation(void) {
  struct fy_device *dev;
  const size_t q = 256 * 1024;
  CHECK_OK(fy_device_sim_create(4 * q, 0, &dev));
  char *p[4];
  for (int i = 0; i < 4; i++) CHECK_OK(fy_device_alloc(dev, q, (void **)&p[i]));
  for (int i = 1; i < 4; i++) CHECK(p[i] == p[i - 1] + q);  // first fit from an empty pool
  void *x = NULL;
  CHECK_ERR(fy_device_alloc(dev, 64, &x), FY_ERR_NOMEM);
  fy_device_dealloc(dev, p[0], q);
  fy_device_dealloc(dev, p[2], q);
  CHECK(dev->bytes_in_use == 2 * q);
  CHECK_ERR(fy_device_alloc(dev, 2 * q, &x), FY_ERR_NOMEM);
  CHECK(dev->bytes_in_use == 2 * q);
  void *small = NULL;
  CHECK_OK(fy_device_alloc(dev, 100, &small));  // first fit: the lowest hole
  CHECK(small == p[0]);
  fy_device_dealloc(dev, small, 100);
  fy_device_dealloc(dev, p[1], q);  // joins with both neighbours
  CHECK_OK(fy_device_alloc(dev, 3 * q, &x));
  CHECK(x == p[0]);
  fy_device_dealloc(dev, x, 3 * q);
  fy_device_dealloc(dev, p[3], q);  // joins with the block before it
  CHECK_OK(fy_device_alloc(dev, 4 * q, &x));
  CHECK(x == p[0] && dev->bytes_in_use == 4 * q && dev->bytes_peak == 4 * q);
  fy_device_dealloc(dev, x, 4 * q);
  CHECK(dev->bytes_in_use == 0);

  // Many small blocks freed in a scattered order coalesce back into the whole pool.
  enum { N = 256 };
  char *blk[N];
  for (int i = 0; i < N; i++) CHECK_OK(fy_device_alloc(dev, 4 * q / N, (void **)&blk[i]));
  for (int i = 0; i < N; i++) {
    int j = (i * 97) % N;  // 97 is prime to 256: a permutation
    fy_device_dealloc(dev, blk[j], 4 * q / N);
  }
  CHECK_OK(fy_device_alloc(dev, 4 * q, &x));
  fy_device_dealloc(dev, x, 4 * q);
  fy_device_free(dev);
}

static void test_owns(void) {
  struct fy_device *cpu, *sim;
  CHECK_OK(fy_device_cpu_create(0, &cpu));
  CHECK_OK(fy_device_sim_create(MB, 0, &sim));
  void *c = NULL, *s = NULL;
  int local = 0;
  CHECK_OK(fy_device_alloc(cpu, 100, &c));
  CHECK_OK(fy_device_alloc(sim, 100, &s));
  CHECK(!fy_device_owns(cpu, c) && !fy_device_owns(cpu, s));
  CHECK(fy_device_owns(sim, s) && fy_device_owns(sim, (char *)s + 99));
  CHECK(!fy_device_owns(sim, c) && !fy_device_owns(sim, &local) && !fy_device_owns(sim, NULL));
  struct fy_copy_stats st;
  fy_device_copy_stats(cpu, &st);
  CHECK(st.bytes[0] == 0 && st.bytes[1] == 0 && st.busy_s[0] == 0 && st.busy_s[1] == 0);
  fy_device_dealloc(cpu, c, 100);
  fy_device_dealloc(sim, s, 100);
  fy_device_free(cpu);
  fy_device_free(sim);
}

// ---- streams ----

struct order_log {
  int n, bad;
  int want;
};
struct order_item {
  struct order_log *log;
  int i;
};

static void order_append(void *arg) {
  struct order_item *it = arg;
  if (it->i != it->log->want) it->log->bad++;
  it->log->want++;
  it->log->n++;
}

static void test_stream_order(struct fy_device *dev) {
  enum { N = 1000 };
  static struct order_item items[N];
  struct order_log log = {0};
  fy_stream *s = stream_new(dev);
  for (int i = 0; i < N; i++) {
    items[i] = (struct order_item){.log = &log, .i = i};
    CHECK_OK(fy_stream_enqueue(s, order_append, &items[i]));
  }
  CHECK_OK(fy_stream_sync(s));
  CHECK(log.n == N && log.bad == 0);
  dev->ops->stream_free(dev, s);
}

// Copies and memsets keep stream order with host functions, in every direction.
static void test_copy_kinds(struct fy_device *dev) {
  enum { N = 4096 };
  unsigned char *h1 = malloc(N), *h2 = malloc(N);
  unsigned char *d1 = NULL, *d2 = NULL;
  CHECK_OK(fy_device_alloc(dev, N, (void **)&d1));
  CHECK_OK(fy_device_alloc(dev, N, (void **)&d2));
  for (int i = 0; i < N; i++) h1[i] = (unsigned char)(i * 7);
  fy_stream *s = stream_new(dev);
  CHECK_OK(fy_copy_async(s, d1, h1, N));  // to device
  CHECK_OK(fy_copy_async(s, d2, d1, N));  // within the device
  CHECK_OK(dev->ops->memset_async(s, d1, 0xAB, N));
  CHECK_OK(fy_copy_async(s, h2, d2, N));  // to host
  CHECK_OK(fy_stream_sync(s));
  CHECK(memcmp(h1, h2, N) == 0);
  CHECK_OK(fy_copy_async(s, h2, d1, N));
  CHECK_OK(fy_copy_async(s, h1, h2, N));  // within the host
  CHECK_OK(fy_stream_sync(s));
  int ok = 1;
  for (int i = 0; i < N; i++) ok &= h1[i] == 0xAB;
  CHECK(ok);
  dev->ops->stream_free(dev, s);
  fy_device_dealloc(dev, d1, N);
  fy_device_dealloc(dev, d2, N);
  free(h1);
  free(h2);
}

static void test_copy_stats(void) {
  struct fy_device *dev;
  CHECK_OK(fy_device_sim_create(MB, 0, &dev));
  test_copy_kinds(dev);  // 4096 bytes each way, plus one within the device and one on the host
  struct fy_copy_stats st;
  fy_device_copy_stats(dev, &st);
  CHECK(st.bytes[0] == 4096 && st.bytes[1] == 2 * 4096);
  CHECK(st.busy_s[0] >= 0 && st.busy_s[1] > 0);
  fy_device_free(dev);
}

// ---- events ----

// Stream A copies a pattern to the device and records e; stream B waits for e and checks the data,
// then copies it back. Jitter shuffles the streams' timing; without the wait, B would see stale
// bytes in some rounds.
struct arrival {
  const unsigned char *dev_buf;
  size_t n;
  unsigned char want;
  int bad;
};

static void arrival_check(void *arg) {
  struct arrival *a = arg;
  for (size_t i = 0; i < a->n; i++)
    if (a->dev_buf[i] != (unsigned char)(a->want + i)) {
      a->bad++;
      return;
    }
}

static void test_cross_stream(struct fy_device *dev, int rounds) {
  enum { N = 64 * 1024 };
  unsigned char *h = malloc(N), *d = NULL;
  CHECK_OK(fy_device_alloc(dev, N, (void **)&d));
  fy_stream *a = stream_new(dev), *b = stream_new(dev);
  fy_event *e = event_new(dev);
  struct arrival arr = {.dev_buf = d, .n = N};
  int bad = 0;
  for (int r = 0; r < rounds; r++) {
    unsigned char v = (unsigned char)(r * 31 + 1);
    for (int i = 0; i < N; i++) h[i] = (unsigned char)(v + i);
    arr.want = v;
    CHECK_OK(fy_copy_async(a, d, h, N));
    CHECK_OK(fy_event_record(e, a));
    CHECK_OK(fy_stream_wait(b, e));
    CHECK_OK(fy_stream_enqueue(b, arrival_check, &arr));
    // B's check must finish before the next round overwrites h (A) and arr (here); a wait on an
    // event recorded on B orders A, and a host sync orders the test.
    fy_event *done = e;  // reuse: the same event now marks B's progress
    CHECK_OK(fy_event_record(done, b));
    CHECK_OK(fy_stream_wait(a, done));
    CHECK_OK(fy_event_sync(done));
    bad += arr.bad;
    arr.bad = 0;
  }
  CHECK(bad == 0);
  CHECK_OK(fy_stream_sync(a));
  dev->ops->event_free(dev, e);
  dev->ops->stream_free(dev, a);
  dev->ops->stream_free(dev, b);
  fy_device_dealloc(dev, d, N);
  free(h);
}

struct observe {
  atomic_int *x;
  int seen[4];
  int n;
};

static void observe_x(void *arg) {
  struct observe *o = arg;
  o->seen[o->n++] = atomic_load(o->x);
}

static void set_x1(void *arg) { atomic_store((atomic_int *)arg, 1); }
static void set_x2(void *arg) { atomic_store((atomic_int *)arg, 2); }

// Record, wait, record again, wait again: the second wait must hold B until the second record,
// although the event was already reached once. A is held on a gate so B cannot pass by luck.
static void test_event_reuse(struct fy_device *dev) {
  fy_stream *a = stream_new(dev), *b = stream_new(dev);
  fy_event *e = event_new(dev);
  atomic_int x = 0;
  struct observe o = {.x = &x};
  struct gate g;
  gate_init(&g);
  CHECK_OK(fy_stream_enqueue(a, set_x1, &x));
  CHECK_OK(fy_event_record(e, a));
  CHECK_OK(fy_stream_wait(b, e));
  CHECK_OK(fy_stream_enqueue(b, observe_x, &o));
  fy_event *first = event_new(dev);
  CHECK_OK(fy_event_record(first, b));
  CHECK_OK(fy_stream_enqueue(a, gate_pass, &g));
  CHECK_OK(fy_stream_enqueue(a, set_x2, &x));
  CHECK_OK(fy_event_record(e, a));
  CHECK_OK(fy_stream_wait(b, e));
  CHECK_OK(fy_stream_enqueue(b, observe_x, &o));
  // B has made its first observation before A may go on (no timing assumption), then a little
  // time for B to pass its second wait early if the wait were broken.
  CHECK_OK(fy_event_sync(first));
  sleep_ms(5);
  gate_open(&g);
  CHECK_OK(fy_stream_sync(b));
  CHECK(o.n == 2 && o.seen[0] == 1 && o.seen[1] == 2);
  CHECK_OK(fy_stream_sync(a));
  dev->ops->event_free(dev, first);
  dev->ops->event_free(dev, e);
  dev->ops->stream_free(dev, a);
  dev->ops->stream_free(dev, b);
  gate_destroy(&g);
}

// CUDA's rule: a wait captures the record that is latest when the wait is enqueued. B waits for
// the first record; the second one, still held on a gate, must not hold B.
static void test_wait_captures(struct fy_device *dev) {
  fy_stream *a = stream_new(dev), *a2 = stream_new(dev), *b = stream_new(dev);
  fy_event *e = event_new(dev);
  atomic_int x = 0;
  struct gate g1, g2;
  gate_init(&g1);
  gate_init(&g2);
  CHECK_OK(fy_stream_enqueue(a, gate_pass, &g1));
  CHECK_OK(fy_stream_enqueue(a, set_x1, &x));
  CHECK_OK(fy_event_record(e, a));
  CHECK_OK(fy_stream_wait(b, e));
  atomic_int b_done = 0;
  CHECK_OK(fy_stream_enqueue(b, flag_set, &b_done));
  // The same event recorded again on another stream that is stuck: B must not care.
  CHECK_OK(fy_stream_enqueue(a2, gate_pass, &g2));
  CHECK_OK(fy_event_record(e, a2));
  sleep_ms(5);
  CHECK(atomic_load(&b_done) == 0);  // still held by the first record
  gate_open(&g1);
  CHECK_OK(fy_stream_sync(b));
  CHECK(atomic_load(&b_done) == 1 && atomic_load(&x) == 1);
  gate_open(&g2);
  CHECK_OK(fy_event_sync(e));
  dev->ops->event_free(dev, e);
  dev->ops->stream_free(dev, a);
  dev->ops->stream_free(dev, a2);
  dev->ops->stream_free(dev, b);
  gate_destroy(&g1);
  gate_destroy(&g2);
}

static void test_never_recorded(struct fy_device *dev) {
  fy_stream *s = stream_new(dev);
  fy_event *e = event_new(dev);
  atomic_int done = 0;
  CHECK_OK(fy_stream_wait(s, e));
  CHECK_OK(fy_stream_enqueue(s, flag_set, &done));
  CHECK_OK(fy_stream_sync(s));
  CHECK(atomic_load(&done) == 1);
  CHECK_OK(fy_event_sync(e));  // the host does not block either
  dev->ops->event_free(dev, e);
  dev->ops->stream_free(dev, s);
}

// The host blocks in event_sync and stream_sync until the gated work has run.
static void test_host_sync(struct fy_device *dev) {
  fy_stream *s = stream_new(dev);
  fy_event *e = event_new(dev);
  for (int which = 0; which < 2; which++) {
    struct gate g;
    gate_init(&g);
    atomic_int x = 0, later = 0;
    CHECK_OK(fy_stream_enqueue(s, gate_pass, &g));
    CHECK_OK(fy_stream_enqueue(s, set_x1, &x));
    CHECK_OK(fy_event_record(e, s));
    CHECK_OK(fy_stream_enqueue(s, gate_pass, &g));
    CHECK_OK(fy_stream_enqueue(s, flag_set, &later));
    pthread_t t;
    pthread_create(&t, NULL, gate_open_later, &g);
    if (which == 0) {
      CHECK_OK(fy_event_sync(e));
      CHECK(atomic_load(&x) == 1);
      CHECK_OK(fy_stream_sync(s));
    } else {
      CHECK_OK(fy_stream_sync(s));
    }
    CHECK(atomic_load(&x) == 1 && atomic_load(&later) == 1);
    pthread_join(t, NULL);
    gate_destroy(&g);
  }
  dev->ops->event_free(dev, e);
  dev->ops->stream_free(dev, s);
}

// stream_free lets queued work finish before the worker is joined.
static void test_stream_free_drains(struct fy_device *dev) {
  fy_stream *s = stream_new(dev);
  atomic_int done = 0;
  struct gate g;
  gate_init(&g);
  CHECK_OK(fy_stream_enqueue(s, gate_pass, &g));
  CHECK_OK(fy_stream_enqueue(s, flag_set, &done));
  pthread_t t;
  pthread_create(&t, NULL, gate_open_later, &g);
  dev->ops->stream_free(dev, s);
  CHECK(atomic_load(&done) == 1);
  pthread_join(t, NULL);
  gate_destroy(&g);
}

// ---- throttled copies ----

struct timed_copy {
  fy_stream *s;
  void *dst;
  const void *src;
  size_t n;
};

// Enqueues every copy on its stream, then syncs them all; returns the wall time.
static double time_copies(struct timed_copy *c, int n) {
  double t0 = fy_now();
  for (int i = 0; i < n; i++) CHECK_OK(fy_copy_async(c[i].s, c[i].dst, c[i].src, c[i].n));
  for (int i = 0; i < n; i++) CHECK_OK(fy_stream_sync(c[i].s));
  return fy_now() - t0;
}

// A throttled device with two device buffers and two host buffers of n bytes, and two streams.
struct link {
  struct fy_device *dev;
  fy_stream *a, *b;
  char *h1, *h2, *d1, *d2;
  size_t n;
};

static void link_open(struct link *l, size_t n, double gbps) {
  *l = (struct link){.n = n, .h1 = malloc(n), .h2 = malloc(n)};
  CHECK_OK(fy_device_sim_create(2 * n, gbps, &l->dev));
  CHECK_OK(fy_device_alloc(l->dev, n, (void **)&l->d1));
  CHECK_OK(fy_device_alloc(l->dev, n, (void **)&l->d2));
  // Touch every page first, so that page faults are not timed as link time.
  memset(l->h1, 1, n);
  memset(l->h2, 2, n);
  memset(l->d1, 3, n);
  memset(l->d2, 4, n);
  l->a = stream_new(l->dev);
  l->b = stream_new(l->dev);
}

static void link_close(struct link *l) {
  l->dev->ops->stream_free(l->dev, l->a);
  l->dev->ops->stream_free(l->dev, l->b);
  fy_device_dealloc(l->dev, l->d1, l->n);
  fy_device_dealloc(l->dev, l->d2, l->n);
  fy_device_free(l->dev);
  free(l->h1);
  free(l->h2);
}

// The throttled link: its floors hold on any machine (a copy never beats its wire time: plain run);
// that a copy is not much slower than its wire time, and that two copies each way overlap, hold
// where the machine is not loaded (the timing part, `--part timing`, meson suite "timing").

// 50 MB at 1 GB/s is 50 ms of wire time; two copies the same way share one engine.
static void test_throttle_serialises(bool timing) {
  const double wire = 0.050;
  struct link l;
  link_open(&l, 50 * (size_t)MB, 1.0);
  struct timed_copy one[] = {{l.a, l.d1, l.h1, l.n}};
  double t_one = time_copies(one, 1);
  struct timed_copy same[] = {{l.a, l.d1, l.h1, l.n}, {l.b, l.d2, l.h2, l.n}};  // both H2D
  double t_same = time_copies(same, 2);
  struct timed_copy back[] = {{l.b, l.h2, l.d2, l.n}};
  double t_back = time_copies(back, 1);
  if (timing) {
    CHECKF(t_one < 20 * wire, "one copy took %.3f s", t_one);
    CHECKF(t_same < 40 * wire, "two H2D took %.3f s", t_same);
  } else {
    CHECKF(t_one >= 0.9 * wire, "one copy took %.3f s", t_one);
    CHECKF(t_same >= 2 * 0.9 * wire, "two H2D took %.3f s", t_same);
    CHECKF(t_back >= 0.9 * wire, "one D2H took %.3f s", t_back);
  }
  CHECK(memcmp(l.d1, l.h1, l.n) == 0 && memcmp(l.h2, l.d2, l.n) == 0);
  struct fy_copy_stats st;
  fy_device_copy_stats(l.dev, &st);
  CHECK(st.bytes[0] == 3.0 * l.n && st.bytes[1] == 1.0 * l.n);
  CHECKF(st.busy_s[0] >= 3 * 0.9 * wire && st.busy_s[1] >= 0.9 * wire, "busy %.3f %.3f s",
         st.busy_s[0], st.busy_s[1]);
  fprintf(stderr, "  1 GB/s, 50 MB: one copy %.1f ms, two the same way %.1f ms\n", 1e3 * t_one,
          1e3 * t_same);
  link_close(&l);
}

// One copy each way runs on both engines at once. The link is slow enough (5 MB at 0.1 GB/s, 50
// ms) that wire time, not memcpy, dominates even under ThreadSanitizer, whose memcpy is slower
// than 1 GB/s: the check is about the engines, not about how fast two CPUs copy.
static void test_throttle_overlaps(bool timing) {
  const double wire = 0.050;
  struct link l;
  link_open(&l, 5 * (size_t)MB, 0.1);
  struct timed_copy h2d[] = {{l.a, l.d1, l.h1, l.n}}, d2h[] = {{l.b, l.h2, l.d2, l.n}};
  double t_h2d = time_copies(h2d, 1), t_d2h = time_copies(d2h, 1);
  struct timed_copy both[] = {{l.a, l.d1, l.h1, l.n}, {l.b, l.h2, l.d2, l.n}};
  double t_both = time_copies(both, 2);
  if (timing)
    CHECKF(t_both < 0.75 * (t_h2d + t_d2h), "H2D + D2H took %.3f s, alone %.3f + %.3f s", t_both, t_h2d, t_d2h);
  else
    CHECKF(t_both >= 0.9 * wire && t_h2d >= 0.9 * wire && t_d2h >= 0.9 * wire,
           "H2D + D2H took %.3f s, alone %.3f + %.3f s", t_both, t_h2d, t_d2h);
  fprintf(stderr, "  0.1 GB/s, 5 MB: H2D %.1f ms, D2H %.1f ms, both at once %.1f ms\n",
          1e3 * t_h2d, 1e3 * t_d2h, 1e3 * t_both);
  link_close(&l);
}

// A stream's work runs with the OpenMP thread count of the thread that created the stream
// (--threads), not OpenMP's default for a new thread.
static void read_threads(void *arg) { *(int *)arg = omp_get_max_threads(); }

static void test_stream_threads(struct fy_device *dev) {
  int before = omp_get_max_threads();
  for (int want = 1; want <= 3; want++) {
    omp_set_num_threads(want);
    fy_stream *s = NULL;
    CHECK_OK(fy_stream_create(dev, &s));
    omp_set_num_threads(want == 1 ? 3 : 1);  // later changes on the creator do not reach it
    int seen = 0;
    CHECK_OK(fy_stream_enqueue(s, read_threads, &seen));
    CHECK_OK(fy_stream_sync(s));
    CHECKF(seen == want, "a stream created with %d OpenMP threads runs its work with %d", want, seen);
    fy_stream_free(s);
  }
  omp_set_num_threads(before);
}

// Destroying a device with memory still allocated warns instead of failing.
static void test_leak_warning(void) {
  struct fy_device *dev;
  CHECK_OK(fy_device_sim_create(MB, 0, &dev));
  void *p = NULL;
  CHECK_OK(fy_device_alloc(dev, 128, &p));
  fprintf(stderr, "  a warning about 128 leaked bytes is expected:\n");
  fy_device_free(dev);
}

static void test_create_errors(void) {
  struct fy_device *dev = NULL;
  CHECK_ERR(fy_device_sim_create(0, 0, &dev), FY_ERR_INVALID);
  CHECK_ERR(fy_device_sim_create(MB, -1, &dev), FY_ERR_INVALID);
}

static void test_both(struct fy_device *dev) {
  test_accounting(dev);
  test_cap(dev);
  test_stream_order(dev);
  test_copy_kinds(dev);
  test_cross_stream(dev, 20);
  test_never_recorded(dev);
  CHECK(dev->bytes_in_use == 0);
}

int main(int argc, char **argv) {
  check_args(argc, argv);
  if (check_part("timing")) {
    test_throttle_serialises(true);
    test_throttle_overlaps(true);
  }
  if (!check_plain()) return check_summary("device");
  struct fy_device *cpu, *sim;
  CHECK_OK(fy_device_cpu_create(MB, &cpu));
  test_both(cpu);
  fy_device_free(cpu);

  CHECK_OK(fy_device_sim_create(MB, 0, &sim));
  test_both(sim);
  test_event_reuse(sim);
  test_wait_captures(sim);
  test_host_sync(sim);
  test_stream_free_drains(sim);
  test_stream_threads(sim);
  fy_device_free(sim);

  // The same cross-stream protocol under injected delays, many times.
  CHECK_OK(fy_device_sim_create(MB, 0, &sim));
  fy_device_sim_set_jitter(sim, 200, 42);
  test_cross_stream(sim, 200);
  test_event_reuse(sim);
  test_wait_captures(sim);
  fy_device_free(sim);

  test_fragmentation();
  test_owns();
  test_copy_stats();
  test_throttle_serialises(false);
  test_throttle_overlaps(false);
  test_leak_warning();
  test_create_errors();
  return check_summary("device");
}
