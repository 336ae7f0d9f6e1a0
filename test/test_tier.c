// Host tier: alloc/free, zeroing, alignment, cap and peak, pages mapped up front, pin hooks, NUMA
// arguments, threads.
// Disk tier: many requests in flight with jitter, bad directories, caps, and a full disk two ways
// (always RLIMIT_FSIZE, and a 1 MiB tmpfs): the failed write reports FY_ERR_IO with the errno text
// and the data written before stays intact.
// usage: test_tier                     (the plain run)
//        test_tier --part numa         (a tier's pages bound to its NUMA node; exits 77 where this
//                                       kernel or container cannot say)
//        test_tier --part full-tmpfs   (a full 1 MiB tmpfs; exits 77 where mounting is not permitted)
#include <dirent.h>
#include <errno.h>
#include <hwloc.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check.h"
#include "core/status.h"
#include "memory/tier.h"

static uint64_t rng_state = 0x1234567;
static uint64_t rnd(void) {
  uint64_t x = rng_state;
  x ^= x << 13;
  x ^= x >> 7;
  x ^= x << 17;
  return rng_state = x;
}
static void fill_random(void *p, size_t n) {
  unsigned char *b = p;
  for (size_t i = 0; i < n; i++) b[i] = (unsigned char)(rnd() >> 24);
}
static int all_zero(const void *p, size_t n) {
  const unsigned char *b = p;
  for (size_t i = 0; i < n; i++)
    if (b[i]) return 0;
  return 1;
}
static int msg_has(const char *s) { return strstr(fy_error_msg(), s) != NULL; }

// ---------------- host tier ----------------

static void test_host_basic(void) {
  struct fy_host_tier *t;
  CHECK_OK(fy_host_tier_create(1 << 20, -1, NULL, NULL, &t));
  CHECK(fy_host_in_use(t) == 0 && fy_host_peak(t) == 0);

  // Odd sizes, small and large: each 64-byte aligned and zeroed, even when a block is reused.
  size_t sizes[] = {1, 7, 63, 64, 65, 1000, 4096, 4097, 65536, 300001};
  for (int round = 0; round < 2; round++) {
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
      void *p = NULL;
      CHECK_OK(fy_host_alloc(t, sizes[i], &p));
      CHECK(p && ((uintptr_t)p & 63) == 0);
      CHECK(all_zero(p, sizes[i]));
      memset(p, 0xab, sizes[i]);  // dirty it so that the next round sees a reused block zeroed
      fy_host_dealloc(t, p, sizes[i]);
    }
  }
  CHECK(fy_host_in_use(t) == 0);
  CHECK(fy_host_peak(t) == 300001);

  // Cap and peak.
  void *a, *b, *c = NULL;
  CHECK_OK(fy_host_alloc(t, 300 << 10, &a));
  CHECK_OK(fy_host_alloc(t, 400 << 10, &b));
  CHECK(fy_host_in_use(t) == 700 << 10 && fy_host_peak(t) == 700 << 10);
  CHECK_ERR(fy_host_alloc(t, 400 << 10, &c), FY_ERR_NOMEM);
  CHECK(c == NULL);
  CHECKF(msg_has("409600") && msg_has("716800") && msg_has("1048576"), "%s", fy_error_msg());
  CHECK(fy_host_in_use(t) == 700 << 10);  // the failed request left nothing behind
  fy_host_dealloc(t, a, 300 << 10);
  CHECK(fy_host_in_use(t) == 400 << 10 && fy_host_peak(t) == 700 << 10);
  CHECK_OK(fy_host_alloc(t, 400 << 10, &c));
  CHECK(fy_host_in_use(t) == 800 << 10 && fy_host_peak(t) == 800 << 10);
  CHECK_ERR(fy_host_alloc(t, (size_t)-1, &a), FY_ERR_NOMEM);  // no overflow in the cap check
  fy_host_dealloc(t, b, 400 << 10);
  fy_host_dealloc(t, c, 400 << 10);
  fy_host_dealloc(t, NULL, 0);
  CHECK(fy_host_in_use(t) == 0);
  fy_host_tier_free(t);

  // Unlimited; a large block; tiers created and freed repeatedly (arenas are destroyed and reused).
  for (int i = 0; i < 20; i++) {
    CHECK_OK(fy_host_tier_create(0, -1, NULL, NULL, &t));
    void *p;
    size_t n = (size_t)(8 << 20) + 123;
    CHECK_OK(fy_host_alloc(t, n, &p));
    CHECK(((uintptr_t)p & 63) == 0 && all_zero(p, n));
    memset(p, i, n);
    fy_host_dealloc(t, p, n);
    fy_host_tier_free(t);
  }
}

// A large block's pages are mapped when it is handed out (the first step would fault them in
// otherwise), where the kernel can (MADV_POPULATE_WRITE, Linux 5.14): counted with mincore.
static void test_host_populated(void) {
  struct fy_host_tier *t;
  CHECK_OK(fy_host_tier_create(0, -1, NULL, NULL, &t));
  long page = sysconf(_SC_PAGESIZE);
  size_t n = (size_t)(32 << 20) + 4321;
  void *p;
  CHECK_OK(fy_host_alloc(t, n, &p));
  uintptr_t lo = ((uintptr_t)p + (uintptr_t)page - 1) / (uintptr_t)page * (uintptr_t)page;
  uintptr_t hi = ((uintptr_t)p + n) / (uintptr_t)page * (uintptr_t)page;
  size_t pages = (hi - lo) / (size_t)page, resident = 0;
  unsigned char *vec = malloc(pages);
  CHECK(vec && mincore((void *)lo, hi - lo, vec) == 0);
  for (size_t i = 0; vec && i < pages; i++) resident += vec[i] & 1;
  // (probe whether this kernel populates at all, on a mapping of its own)
  char *probe = mmap(NULL, (size_t)page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  bool can = probe != MAP_FAILED && madvise(probe, (size_t)page, MADV_POPULATE_WRITE) == 0;
  if (probe != MAP_FAILED) munmap(probe, (size_t)page);
  if (can) CHECKF(resident == pages, "%zu of %zu pages mapped after fy_host_alloc", resident, pages);
  else printf("tier: MADV_POPULATE_WRITE not available here, %zu of %zu pages mapped\n", resident, pages);
  CHECK(all_zero(p, n));
  free(vec);
  fy_host_dealloc(t, p, n);
  fy_host_tier_free(t);
}

static int pin_calls, pin_tries, unpin_calls, pin_fail;
static size_t pin_bytes;
static void *pinned_last;
static fy_status test_pin(void *p, size_t n) {
  pin_tries++;
  if (pin_fail) return fy_error_set(FY_ERR_IO, "pin refused");
  pin_calls++;
  pin_bytes += n;
  pinned_last = p;
  return FY_OK;
}
static void test_unpin(void *p) {
  unpin_calls++;
  pinned_last = p;
}

// The pages of a block from a tier placed on `node` are bound to it: hwloc reads the policy back
// with get_mempolicy. Its own part (`--part numa`), skipped where this kernel or container does not
// do memory binding.
static void test_numa_binding(void) {
  int node = fy_numa_node_of_cpuset_default();
  int nodes[] = {node, 0};
  for (int i = 0; i < 2; i++) {
    if (nodes[i] < 0) continue;  // (no node for this thread: node 0 alone)
    struct fy_host_tier *t;
    CHECK_OK(fy_host_tier_create(1 << 24, nodes[i], NULL, NULL, &t));
    void *a;
    const size_t n = 4 << 20;
    CHECK_OK(fy_host_alloc(t, n, &a));
    memset(a, 1, n);
    hwloc_topology_t tp;
    CHECK(hwloc_topology_init(&tp) == 0);
    hwloc_nodeset_t ns = hwloc_bitmap_alloc();
    hwloc_membind_policy_t pol;
    if (hwloc_topology_load(tp) != 0 || hwloc_get_area_membind(tp, a, n, ns, &pol, HWLOC_MEMBIND_BYNODESET) != 0) {
      CHECK_SKIP("reading a block's NUMA binding back is not supported here (%s)", strerror(errno));
    } else {
      CHECKF(pol == HWLOC_MEMBIND_BIND && hwloc_bitmap_isset(ns, (unsigned)nodes[i]) && hwloc_bitmap_weight(ns) == 1,
             "node %d: policy %d, first node %d, %d nodes", nodes[i], (int)pol, hwloc_bitmap_first(ns),
             hwloc_bitmap_weight(ns));
    }
    hwloc_bitmap_free(ns);
    hwloc_topology_destroy(tp);
    fy_host_dealloc(t, a, n);
    fy_host_tier_free(t);
  }
}

static void test_host_pin_numa(void) {
  struct fy_host_tier *t;
  CHECK_OK(fy_host_tier_create(0, -1, test_pin, test_unpin, &t));
  void *p[8];
  long page = sysconf(_SC_PAGESIZE);
  for (int i = 0; i < 8; i++) {
    CHECK_OK(fy_host_alloc(t, 100 + 1000 * i, &p[i]));
    CHECK(pinned_last == p[i]);
    CHECK(((uintptr_t)p[i] & (page - 1)) == 0);  // pinned blocks never share a page
    CHECK(all_zero(p[i], 100 + 1000 * i));
  }
  CHECK(pin_calls == 8 && unpin_calls == 0 && pin_bytes == 800 + 1000 * 28);
  for (int i = 0; i < 8; i++) {
    fy_host_dealloc(t, p[i], 100 + 1000 * i);
    CHECK(pinned_last == p[i]);
  }
  CHECK(unpin_calls == 8 && pin_tries == 8);
  // A system that refuses to pin (a limit on pinned memory): the block is kept pageable, with a
  // warning, and so is every later one without trying again; unpin never sees them.
  pin_fail = 1;
  void *q = NULL, *r = NULL;
  CHECK_OK(fy_host_alloc(t, 5000, &q));
  CHECK(q != NULL && all_zero(q, 5000) && fy_host_in_use(t) == 5000 && pin_tries == 9);
  pin_fail = 0;
  CHECK_OK(fy_host_alloc(t, 3000, &r));
  CHECK(r != NULL && all_zero(r, 3000) && pin_tries == 9 && pin_calls == 8);
  memset(q, 1, 5000), memset(r, 2, 3000);
  fy_host_dealloc(t, q, 5000);
  fy_host_dealloc(t, r, 3000);
  CHECK(unpin_calls == 8 && fy_host_in_use(t) == 0);
  fy_host_tier_free(t);

  // NUMA: the calling thread's node (or -1) and node 0 always work (that their pages are bound
  // there: test_numa_binding); a node that does not exist is refused. A PCI address that is not
  // there has no node.
  int node = fy_numa_node_of_cpuset_default();
  fprintf(stderr, "  numa node of this thread: %d\n", node);
  CHECK(node >= -1);
  CHECK(fy_numa_node_of_pci("ffff:ff:1f.7") == -1);
  CHECK(fy_numa_node_of_pci(NULL) == -1);
  int nodes[] = {node, 0};
  for (int i = 0; i < 2; i++) {
    CHECK_OK(fy_host_tier_create(1 << 24, nodes[i], NULL, NULL, &t));
    void *a;
    CHECK_OK(fy_host_alloc(t, 4 << 20, &a));
    memset(a, 1, 4 << 20);
    fy_host_dealloc(t, a, 4 << 20);
    fy_host_tier_free(t);
  }
  t = NULL;
  CHECK_ERR(fy_host_tier_create(0, 4000, NULL, NULL, &t), FY_ERR_INVALID);
  CHECK(t == NULL);
}

struct host_thread {
  struct fy_host_tier *t;
  int seed, failures;
};
static void *host_worker(void *arg) {
  struct host_thread *h = arg;
  uint64_t s = (uint64_t)h->seed * 2654435761u + 1;
  void *held[16] = {0};
  size_t size[16] = {0};
  for (int it = 0; it < 4000; it++) {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    int k = (int)(s % 16);
    if (held[k]) {
      unsigned char *b = held[k];
      if (b[0] != (unsigned char)k || b[size[k] - 1] != (unsigned char)k) h->failures++;
      fy_host_dealloc(h->t, held[k], size[k]);
      held[k] = NULL;
    } else {
      size[k] = 1 + (size_t)(s >> 20) % 20000;
      fy_status st = fy_host_alloc(h->t, size[k], &held[k]);
      if (st == FY_OK) {
        if (!all_zero(held[k], size[k])) h->failures++;
        memset(held[k], k, size[k]);
      } else if (st != FY_ERR_NOMEM) {
        h->failures++;
      }
    }
  }
  for (int k = 0; k < 16; k++) fy_host_dealloc(h->t, held[k], size[k]);
  return NULL;
}

static void test_host_threads(void) {
  struct fy_host_tier *t;
  size_t cap = 200000;  // small enough that the threads run into it
  CHECK_OK(fy_host_tier_create(cap, -1, NULL, NULL, &t));
  pthread_t th[4];
  struct host_thread h[4];
  for (int i = 0; i < 4; i++) {
    h[i] = (struct host_thread){t, i + 1, 0};
    pthread_create(&th[i], NULL, host_worker, &h[i]);
  }
  for (int i = 0; i < 4; i++) {
    pthread_join(th[i], NULL);
    CHECK(h[i].failures == 0);
  }
  CHECK(fy_host_in_use(t) == 0);
  CHECK(fy_host_peak(t) <= cap && fy_host_peak(t) > 0);
  fy_host_tier_free(t);
  fy_error_clear();
}

// ---------------- disk tier ----------------

static char tmpdir[256];

static int count_tier_files(const char *dir) {
  char prefix[64];
  snprintf(prefix, sizeof prefix, "ferry-%ld-", (long)getpid());
  DIR *d = opendir(dir);
  if (!d) return -1;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)))
    if (strncmp(e->d_name, prefix, strlen(prefix)) == 0 || strstr(e->d_name, "probe")) n++;
  closedir(d);
  return n;
}

#define NSLOT 64

struct slots {
  struct fy_disk_tier *t;
  int64_t h[NSLOT];
  size_t n[NSLOT];
  unsigned char *src[NSLOT], *dst[NSLOT];
  struct fy_disk_req *r[NSLOT];
  int lo, hi;  // the slots a submitting thread owns
  int failures;
};

// Writes every owned slot at once, waits for all, then reads every slot back at once (half of
// them in two pieces, the second at an offset) and compares.
static void *disk_worker(void *arg) {
  struct slots *s = arg;
  for (int i = s->lo; i < s->hi; i++)
    if (fy_disk_write_async(s->t, s->h[i], 0, s->src[i], s->n[i], s->r[i]) != FY_OK) s->failures++;
  for (int i = s->lo; i < s->hi; i++)
    if (fy_disk_wait(s->r[i]) != FY_OK) s->failures++;
  for (int i = s->lo; i < s->hi; i++) {
    if (i % 2 == 0 || s->n[i] < 2) {
      if (fy_disk_read_async(s->t, s->h[i], 0, s->dst[i], s->n[i], s->r[i]) != FY_OK) s->failures++;
    } else {
      size_t half = s->n[i] / 2;
      if (fy_disk_read_async(s->t, s->h[i], half, s->dst[i] + half, s->n[i] - half, s->r[i]) != FY_OK)
        s->failures++;
      if (fy_disk_wait(s->r[i]) != FY_OK) s->failures++;
      if (fy_disk_read_async(s->t, s->h[i], 0, s->dst[i], half, s->r[i]) != FY_OK) s->failures++;
    }
  }
  for (int i = s->lo; i < s->hi; i++)
    if (fy_disk_wait(s->r[i]) != FY_OK) s->failures++;
  for (int i = s->lo; i < s->hi; i++)
    if (memcmp(s->src[i], s->dst[i], s->n[i]) != 0) s->failures++;
  return NULL;
}

static void test_disk_roundtrip(void) {
  struct slots s = {0};
  CHECK_OK(fy_disk_tier_open(tmpdir, 0, &s.t));
  if (!s.t) return;
  CHECK(count_tier_files(tmpdir) == 1);  // the tier's file, and no probe file left behind
  fy_disk_set_jitter(s.t, 2000, 42);
  size_t total = 0, reserved = 0;
  for (int i = 0; i < NSLOT; i++) {
    s.n[i] = 1 + rnd() % 100000;
    total += s.n[i];
    reserved += (s.n[i] + 4095) / 4096 * 4096;
    CHECK_OK(fy_disk_alloc(s.t, s.n[i], &s.h[i]));
    s.src[i] = malloc(s.n[i]);
    s.dst[i] = malloc(s.n[i]);
    fill_random(s.src[i], s.n[i]);
    CHECK_OK(fy_disk_req_create(&s.r[i]));
  }
  CHECK(fy_disk_in_use(s.t) == reserved);
  // A slot never written reads as zeros.
  CHECK_OK(fy_disk_read_async(s.t, s.h[3], 0, s.dst[3], s.n[3], s.r[3]));
  CHECK_OK(fy_disk_wait(s.r[3]));
  CHECK(all_zero(s.dst[3], s.n[3]));

  // Two submitting threads, 32 requests each in flight at once.
  struct slots a = s, b = s;
  a.lo = 0, a.hi = NSLOT / 2, b.lo = NSLOT / 2, b.hi = NSLOT;
  pthread_t ta, tb;
  pthread_create(&ta, NULL, disk_worker, &a);
  pthread_create(&tb, NULL, disk_worker, &b);
  pthread_join(ta, NULL);
  pthread_join(tb, NULL);
  CHECK(a.failures == 0 && b.failures == 0);

  struct fy_disk_stats st;
  fy_disk_stats(s.t, &st);
  CHECKF(st.write_bytes == (double)total && st.read_bytes == (double)(total + s.n[3]),
         "write %.0f read %.0f total %zu", st.write_bytes, st.read_bytes, total);
  CHECK(st.read_s >= 0 && st.write_s > 0);

  // Out of range and an unreserved handle are refused at submission.
  CHECK_ERR(fy_disk_read_async(s.t, s.h[NSLOT - 1], 0, s.dst[0], (size_t)1 << 30, s.r[0]),
            FY_ERR_INVALID);
  CHECK_ERR(fy_disk_write_async(s.t, -4096, 0, s.src[0], 1, s.r[0]), FY_ERR_INVALID);
  CHECK_ERR(fy_disk_write_async(s.t, s.h[0], (size_t)-1, s.src[0], 2, s.r[0]), FY_ERR_INVALID);
  CHECK_OK(fy_disk_wait(s.r[0]));  // a refused submission leaves the request as it was

  // Close with requests in flight: it waits for them; the requests then report success.
  for (int i = 0; i < NSLOT; i++)
    CHECK_OK(fy_disk_write_async(s.t, s.h[i], 0, s.dst[i], s.n[i], s.r[i]));
  fy_disk_tier_close(s.t);
  CHECK(count_tier_files(tmpdir) == 0);
  for (int i = 0; i < NSLOT; i++) {
    CHECK_OK(fy_disk_wait(s.r[i]));
    fy_disk_req_free(s.r[i]);
    free(s.src[i]);
    free(s.dst[i]);
  }
}

static void test_disk_bad_dirs(void) {
  struct fy_disk_tier *t = NULL;
  CHECK_ERR(fy_disk_tier_open("/nonexistent-ferry-dir/scratch", 0, &t), FY_ERR_IO);
  CHECKF(msg_has("/nonexistent-ferry-dir/scratch") && msg_has("No such file or directory"), "%s",
         fy_error_msg());
  // Root ignores permission bits, so unwritable places are made of things that are not
  // directories, and of /proc.
  CHECK_ERR(fy_disk_tier_open("/etc/passwd/x", 0, &t), FY_ERR_IO);
  CHECKF(msg_has("/etc/passwd/x") && msg_has("Not a directory"), "%s", fy_error_msg());
  CHECK_ERR(fy_disk_tier_open("/etc/passwd", 0, &t), FY_ERR_IO);
  CHECK_ERR(fy_disk_tier_open("/proc", 0, &t), FY_ERR_IO);
  CHECKF(msg_has("disk tier /proc: the directory is not writable"), "%s", fy_error_msg());
  CHECK_ERR(fy_disk_tier_open("", 0, &t), FY_ERR_INVALID);
  CHECK(t == NULL);
  // The free space, and a slot's size in the file.
  double space = 0;
  CHECK_OK(fy_disk_space(tmpdir, &space));
  CHECK(space > 0);
  CHECK_ERR(fy_disk_space("/nonexistent-ferry-dir/scratch", &space), FY_ERR_IO);
  CHECKF(msg_has("/nonexistent-ferry-dir/scratch") && msg_has("free space"), "%s", fy_error_msg());
  CHECK(space == 0);
  CHECK(fy_disk_slot_bytes(0) == 4096 && fy_disk_slot_bytes(1) == 4096 && fy_disk_slot_bytes(4096) == 4096);
  CHECK(fy_disk_slot_bytes(4097) == 8192 && fy_disk_slot_bytes((size_t)3 << 30) == (size_t)3 << 30);
  // More than the file system holds.
  CHECK_ERR(fy_disk_tier_open(tmpdir, (size_t)1 << 62, &t), FY_ERR_IO);
  CHECKF(msg_has(tmpdir) && msg_has("bytes free"), "%s", fy_error_msg());
  CHECK(count_tier_files(tmpdir) == 0);

  // The cap on reservations.
  CHECK_OK(fy_disk_tier_open(tmpdir, 16384, &t));
  int64_t h1, h2, h3;
  CHECK_OK(fy_disk_alloc(t, 8192, &h1));
  CHECK_OK(fy_disk_alloc(t, 5000, &h2));
  CHECK(h1 == 0 && h2 == 8192 && fy_disk_in_use(t) == 16384);
  CHECK_ERR(fy_disk_alloc(t, 1, &h3), FY_ERR_NOMEM);
  CHECKF(msg_has("cap 16384"), "%s", fy_error_msg());
  CHECK(fy_disk_in_use(t) == 16384);
  fy_disk_tier_close(t);
}

// Slots A and B written and waited for; then the disk "fills up" (fill()), writing C fails with
// the expected errno text, then so does writing D, and A and B read back intact.
static void full_disk_case(const char *dir, size_t c_bytes, void (*fill)(void), void (*unfill)(void),
                           const char *want_errno) {
  struct fy_disk_tier *t;
  CHECK_OK(fy_disk_tier_open(dir, 0, &t));
  if (!t) return;
  fy_disk_set_jitter(t, 500, 7);
  size_t na = 256 << 10, nb = 200000;
  int64_t ha, hb, hc, hd;
  CHECK_OK(fy_disk_alloc(t, na, &ha));
  CHECK_OK(fy_disk_alloc(t, nb, &hb));
  CHECK_OK(fy_disk_alloc(t, c_bytes, &hc));
  CHECK_OK(fy_disk_alloc(t, 4096, &hd));
  unsigned char *a = malloc(na), *b = malloc(nb), *c = malloc(c_bytes), *back = malloc(na + nb);
  fill_random(a, na);
  fill_random(b, nb);
  fill_random(c, c_bytes);
  struct fy_disk_req *ra, *rb, *rc, *rd;
  CHECK_OK(fy_disk_req_create(&ra));
  CHECK_OK(fy_disk_req_create(&rb));
  CHECK_OK(fy_disk_req_create(&rc));
  CHECK_OK(fy_disk_req_create(&rd));
  CHECK_OK(fy_disk_write_async(t, ha, 0, a, na, ra));
  CHECK_OK(fy_disk_write_async(t, hb, 0, b, nb, rb));
  CHECK_OK(fy_disk_wait(ra));
  CHECK_OK(fy_disk_wait(rb));
  struct fy_disk_stats s0, s1;
  fy_disk_stats(t, &s0);

  fill();
  CHECK_OK(fy_disk_write_async(t, hc, 0, c, c_bytes, rc));
  CHECK_ERR(fy_disk_wait(rc), FY_ERR_IO);
  char want[256];
  snprintf(want, sizeof want, "disk tier %s: writing %zu bytes failed: %s", dir, c_bytes, want_errno);
  CHECKF(msg_has(want), "got \"%s\", wanted \"%s\"", fy_error_msg(), want);
  // After C: the limit is reached, or the file system is full to the last page.
  CHECK_OK(fy_disk_write_async(t, hd, 0, c, 4096, rd));
  CHECK_ERR(fy_disk_wait(rd), FY_ERR_IO);
  CHECK_ERR(fy_disk_wait(rd), FY_ERR_IO);  // the failure sticks to the request until reused
  fy_disk_stats(t, &s1);
  CHECK(s1.write_bytes == s0.write_bytes);  // failed writes are not counted as written

  // Earlier data is intact, read while the disk is still full.
  CHECK_OK(fy_disk_read_async(t, ha, 0, back, na, ra));
  CHECK_OK(fy_disk_read_async(t, hb, 0, back + na, nb, rb));
  CHECK_OK(fy_disk_wait(ra));
  CHECK_OK(fy_disk_wait(rb));
  CHECK(memcmp(back, a, na) == 0 && memcmp(back + na, b, nb) == 0);
  unfill();

  // With room again, the tier goes on working.
  CHECK_OK(fy_disk_write_async(t, hd, 0, c, 4096, rd));
  CHECK_OK(fy_disk_wait(rd));
  fy_disk_req_free(ra);
  fy_disk_req_free(rb);
  fy_disk_req_free(rc);
  fy_disk_req_free(rd);
  fy_disk_tier_close(t);
  free(a), free(b), free(c), free(back);
}

static struct rlimit old_fsize;
static void fsize_limit(void) {
  // 600 KiB: A and B (at 0 and 256 KiB) fit; C starts below the limit and ends past it (a short
  // write, then EFBIG); D starts past it.
  struct rlimit lim = old_fsize;
  lim.rlim_cur = 600 << 10;
  CHECK(setrlimit(RLIMIT_FSIZE, &lim) == 0);
}
static void fsize_unlimit(void) { CHECK(setrlimit(RLIMIT_FSIZE, &old_fsize) == 0); }
static void nothing(void) {}
static char tmpfs_dir[300];
static void tmpfs_unfill(void) {
  // Room again: the 1 MiB tmpfs is grown to 4 MiB.
  CHECK(mount("tmpfs", tmpfs_dir, "tmpfs", MS_REMOUNT, "size=4m") == 0);
}

static void test_disk_full(void) {
  // RLIMIT_FSIZE: always possible. SIGXFSZ would kill the process; ignored, the write fails
  // with EFBIG instead.
  signal(SIGXFSZ, SIG_IGN);
  CHECK(getrlimit(RLIMIT_FSIZE, &old_fsize) == 0);
  fprintf(stderr, "  full disk via RLIMIT_FSIZE\n");
  full_disk_case(tmpdir, 1 << 20, fsize_limit, fsize_unlimit, "File too large");
  signal(SIGXFSZ, SIG_DFL);
}

// A full disk on a 1 MiB tmpfs: its own part (`--part full-tmpfs`), skipped where mounting one is
// not permitted (it is for root in a container that allows it).
static void test_disk_full_tmpfs(void) {
  snprintf(tmpfs_dir, sizeof tmpfs_dir, "%s/tmpfs", tmpdir);
  CHECK(mkdir(tmpfs_dir, 0700) == 0);
  if (mount("tmpfs", tmpfs_dir, "tmpfs", 0, "size=1m") != 0) {
    CHECK_SKIP("a full tmpfs: mounting one is not permitted here (%s)", strerror(errno));
  } else {
    fprintf(stderr, "  full disk via a 1 MiB tmpfs\n");
    double space = 0;
    CHECK_OK(fy_disk_space(tmpfs_dir, &space));
    CHECKF(space > 0 && space <= 1 << 20, "%.0f bytes free on a 1 MiB tmpfs", space);
    struct fy_disk_tier *t = NULL;
    CHECK_ERR(fy_disk_tier_open(tmpfs_dir, 2 << 20, &t), FY_ERR_IO);  // cap over free space
    CHECK(t == NULL);
    full_disk_case(tmpfs_dir, 1 << 20, nothing, tmpfs_unfill, "No space left on device");
    CHECK(count_tier_files(tmpfs_dir) == 0);
    CHECK(umount2(tmpfs_dir, MNT_DETACH) == 0);
  }
  rmdir(tmpfs_dir);
}

int main(int argc, char **argv) {
  check_args(argc, argv);
  const char *base = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
  snprintf(tmpdir, sizeof tmpdir, "%s/ferry-tier-XXXXXX", base);
  CHECK(mkdtemp(tmpdir) != NULL);
  if (check_plain()) {
    test_host_basic();
    test_host_populated();
    test_host_pin_numa();
    test_host_threads();
    test_disk_roundtrip();
    test_disk_bad_dirs();
    test_disk_full();
  }
  if (check_part("numa")) test_numa_binding();
  if (check_part("full-tmpfs")) test_disk_full_tmpfs();
  CHECK(rmdir(tmpdir) == 0);
  return check_summary("tier");
}
