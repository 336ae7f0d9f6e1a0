// Host tier: a jemalloc arena of its own, capped and counted, optionally pinned and NUMA-placed.
//
// NUMA placement is done in the arena's extent hooks: the arena is created with a copy of
// jemalloc's default hooks whose `alloc` also calls hwloc_set_area_membind(BIND) on every extent
// jemalloc maps for it, before any page of it is touched. The pages are then mapped on the chosen
// node when a block is populated (fy_host_alloc, below) or first used, and jemalloc's later purges
// (madvise) keep the policy, so nothing is migrated and no binding call is made per allocation.
// A failed bind (a kernel or sandbox without mbind) is ignored: the memory is still good, only
// placed by the kernel's default policy; it is logged once when the machine has several nodes,
// and silently ignored on a single-node machine, where binding changes nothing (it is still done
// there, so that the path is exercised everywhere).
//
// Every call passes MALLOCX_TCACHE_NONE: thread caches would keep freed blocks of this arena in
// other threads' caches, and destroying the arena would leave them dangling.
//
// AddressSanitizer: Debian's jemalloc is built without a prefix, so in a normal build it is the
// process's malloc; in a sanitized build ASan's malloc comes first in symbol lookup and wins, and
// mallocx/dallocx still reach jemalloc (no conflict, tested). ASan knows nothing of jemalloc's
// blocks, so under ASan this file poisons them by hand: a block is unpoisoned for exactly the bytes
// asked for (the tail up to jemalloc's size class stays poisoned), and poisoned again when freed,
// which catches overruns past n and uses after free. jemalloc itself is not instrumented and never
// trips on the poison, except through intercepted libc calls: so under ASan the block is zeroed
// here rather than with MALLOCX_ZERO (jemalloc's memset would hit the poison), and the extent hooks
// unpoison every extent that jemalloc unmaps, so that a later mapping at the same address starts
// clean. LeakSanitizer does not scan these blocks: do not keep the only pointer to malloc'd memory
// in host-tier memory.
#include "memory/tier.h"

#include <errno.h>
#include <hwloc.h>
#include <jemalloc/jemalloc.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "core/log.h"
#include "core/status.h"

#if defined(__SANITIZE_ADDRESS__)
#define FY_TIER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FY_TIER_ASAN 1
#endif
#endif

#ifdef FY_TIER_ASAN
#include <sanitizer/asan_interface.h>
#define TIER_POISON(p, n) ASAN_POISON_MEMORY_REGION(p, n)
#define TIER_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION(p, n)
#else
#define TIER_POISON(p, n) ((void)(p), (void)(n))
#define TIER_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

struct fy_host_tier {
  extent_hooks_t hooks;  // first: the hooks receive a pointer to it and find the tier from it
  extent_hooks_t *dflt;  // jemalloc's own hooks, which ours forward to
  unsigned arena;
  size_t cap, in_use, peak;
  pthread_mutex_t mu;
  hwloc_nodeset_t nodeset;  // NULL: no placement
  bool multi_node;          // a failed bind matters (and is reported) only with several nodes
  size_t page;
  fy_status (*pin)(void *p, size_t n);
  void (*unpin)(void *p);
  // Pinning failed once (a system that limits pinned memory): blocks from then on stay pageable,
  // and those of them still held are listed here, so that unpin sees only the pinned ones.
  bool pin_off;
  void **pageable;
  size_t n_pageable, cap_pageable;
};

// One topology for the process, loaded on first use (loading takes milliseconds) and kept; hwloc
// allows concurrent queries and binding calls on a loaded topology.
static pthread_once_t topo_once = PTHREAD_ONCE_INIT;
static hwloc_topology_t topo;
static bool topo_ok;

static void topo_load(void) {
  if (hwloc_topology_init(&topo) != 0) return;
  // PCI devices are needed to find a GPU's node; "important" keeps them and drops the rest.
  hwloc_topology_set_io_types_filter(topo, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
  if (hwloc_topology_load(topo) != 0) {
    hwloc_topology_destroy(topo);
    return;
  }
  topo_ok = true;
}

static hwloc_topology_t topo_get(void) {
  pthread_once(&topo_once, topo_load);
  return topo_ok ? topo : NULL;
}

static int node_of_nodeset(hwloc_const_nodeset_t ns) {
  if (!ns || hwloc_bitmap_iszero(ns)) return -1;
  return hwloc_bitmap_first(ns);  // nodesets hold OS indexes
}

int fy_numa_node_of_pci(const char *bus_id) {
  hwloc_topology_t tp = topo_get();
  if (!tp || !bus_id) return -1;
  hwloc_obj_t dev = hwloc_get_pcidev_by_busidstring(tp, bus_id);
  if (!dev) return -1;
  hwloc_obj_t anc = hwloc_get_non_io_ancestor_obj(tp, dev);
  return anc ? node_of_nodeset(anc->nodeset) : -1;
}

int fy_numa_node_of_cpuset_default(void) {
  hwloc_topology_t tp = topo_get();
  if (!tp) return -1;
  hwloc_cpuset_t cs = hwloc_bitmap_alloc();
  hwloc_nodeset_t ns = hwloc_bitmap_alloc();
  int node = -1;
  if (cs && ns) {
    // A thread bound to one node's CPUs belongs to that node; an unbound one to where it runs now.
    if (hwloc_get_cpubind(tp, cs, HWLOC_CPUBIND_THREAD) == 0) {
      hwloc_cpuset_to_nodeset(tp, cs, ns);
      if (hwloc_bitmap_weight(ns) == 1) node = hwloc_bitmap_first(ns);
    }
    if (node < 0 && hwloc_get_last_cpu_location(tp, cs, HWLOC_CPUBIND_THREAD) == 0) {
      hwloc_cpuset_to_nodeset(tp, cs, ns);
      node = node_of_nodeset(ns);
    }
  }
  hwloc_bitmap_free(cs);
  hwloc_bitmap_free(ns);
  return node;
}

// ---- extent hooks ----

static void *hook_alloc(extent_hooks_t *h, void *new_addr, size_t size, size_t alignment, bool *zero,
                        bool *commit, unsigned arena_ind) {
  struct fy_host_tier *t = (struct fy_host_tier *)h;
  void *p = t->dflt->alloc(t->dflt, new_addr, size, alignment, zero, commit, arena_ind);
  if (p && t->nodeset) {
    hwloc_topology_t tp = topo_get();
    if (tp && hwloc_set_area_membind(tp, p, size, t->nodeset, HWLOC_MEMBIND_BIND,
                                     HWLOC_MEMBIND_BYNODESET) != 0 && t->multi_node) {
      static int warned;
      if (!__atomic_exchange_n(&warned, 1, __ATOMIC_RELAXED))
        fy_log_warn("host tier: cannot bind memory to NUMA node %d (%s); using the default placement",
                    hwloc_bitmap_first(t->nodeset), strerror(errno));
    }
  }
  return p;
}

static bool hook_dalloc(extent_hooks_t *h, void *addr, size_t size, bool committed, unsigned arena_ind) {
  struct fy_host_tier *t = (struct fy_host_tier *)h;
  TIER_UNPOISON(addr, size);
  return t->dflt->dalloc(t->dflt, addr, size, committed, arena_ind);
}

static void hook_destroy(extent_hooks_t *h, void *addr, size_t size, bool committed, unsigned arena_ind) {
  struct fy_host_tier *t = (struct fy_host_tier *)h;
  TIER_UNPOISON(addr, size);
  t->dflt->destroy(t->dflt, addr, size, committed, arena_ind);
}

// The remaining hooks are jemalloc's defaults, which ignore their first argument. They are wrapped
// anyway so that they are always called with the pointer they belong to.
static bool hook_commit(extent_hooks_t *h, void *a, size_t s, size_t o, size_t l, unsigned i) {
  struct fy_host_tier *t = (struct fy_host_tier *)h;
  return t->dflt->commit ? t->dflt->commit(t->dflt, a, s, o, l, i) : true;
}
static bool hook_decommit(extent_hooks_t *h, void *a, size_t s, size_t o, size_t l, unsigned i) {
  struct fy_host_tier *t = (struct fy_host_tier *)h;
  return t->dflt->decommit ? t->dflt->decommit(t->dflt, a, s, o, l, i) : true;
}
static bool hook_purge_lazy(extent_hooks_t *h, void *a, size_t s, size_t o, size_t l, unsigned i) {
  struct fy_host_tier *t = (struct fy_host_tier *)h;
  return t->dflt->purge_lazy ? t->dflt->purge_lazy(t->dflt, a, s, o, l, i) : true;
}
static bool hook_purge_forced(extent_hooks_t *h, void *a, size_t s, size_t o, size_t l, unsigned i) {
  struct fy_host_tier *t = (struct fy_host_tier *)h;
  return t->dflt->purge_forced ? t->dflt->purge_forced(t->dflt, a, s, o, l, i) : true;
}
static bool hook_split(extent_hooks_t *h, void *a, size_t s, size_t sa, size_t sb, bool c, unsigned i) {
  struct fy_host_tier *t = (struct fy_host_tier *)h;
  return t->dflt->split ? t->dflt->split(t->dflt, a, s, sa, sb, c, i) : true;
}
static bool hook_merge(extent_hooks_t *h, void *a, size_t sa, void *b, size_t sb, bool c, unsigned i) {
  struct fy_host_tier *t = (struct fy_host_tier *)h;
  return t->dflt->merge ? t->dflt->merge(t->dflt, a, sa, b, sb, c, i) : true;
}

// ---- the tier ----

fy_status fy_host_tier_create(size_t cap, int numa_node, fy_status (*pin)(void *p, size_t n),
                              void (*unpin)(void *p), struct fy_host_tier **out) {
  *out = NULL;
  struct fy_host_tier *t = calloc(1, sizeof *t);
  if (!t) return fy_error_set(FY_ERR_NOMEM, "host tier: out of memory");
  t->cap = cap;
  t->pin = pin;
  t->unpin = unpin;
  long pg = sysconf(_SC_PAGESIZE);
  t->page = pg > 0 ? (size_t)pg : 4096;
  pthread_mutex_init(&t->mu, NULL);

  if (numa_node >= 0) {
    hwloc_topology_t tp = topo_get();
    int nodes = tp ? hwloc_get_nbobjs_by_type(tp, HWLOC_OBJ_NUMANODE) : 0;
    if (tp && !hwloc_get_numanode_obj_by_os_index(tp, (unsigned)numa_node)) {
      pthread_mutex_destroy(&t->mu);
      free(t);
      return fy_error_set(FY_ERR_INVALID, "host tier: there is no NUMA node %d (this machine has %d)",
                          numa_node, nodes);
    }
    if (tp) {
      t->nodeset = hwloc_bitmap_alloc();
      if (!t->nodeset) {
        pthread_mutex_destroy(&t->mu);
        free(t);
        return fy_error_set(FY_ERR_NOMEM, "host tier: out of memory");
      }
      hwloc_bitmap_only(t->nodeset, (unsigned)numa_node);
      t->multi_node = nodes > 1;
    }
  }

  size_t sz = sizeof t->dflt;
  int rc = mallctl("arena.0.extent_hooks", &t->dflt, &sz, NULL, 0);
  if (rc == 0) {
    t->hooks = (extent_hooks_t){
        .alloc = hook_alloc,
        .dalloc = hook_dalloc,
        .destroy = hook_destroy,
        .commit = hook_commit,
        .decommit = hook_decommit,
        .purge_lazy = hook_purge_lazy,
        .purge_forced = hook_purge_forced,
        .split = hook_split,
        .merge = hook_merge,
    };
    extent_hooks_t *hp = &t->hooks;
    sz = sizeof t->arena;
    rc = mallctl("arenas.create", &t->arena, &sz, &hp, sizeof hp);
  }
  if (rc != 0) {
    hwloc_bitmap_free(t->nodeset);
    pthread_mutex_destroy(&t->mu);
    free(t);
    return fy_error_set(FY_ERR_NOMEM, "host tier: cannot create a jemalloc arena: %s", strerror(rc));
  }
  *out = t;
  return FY_OK;
}

void fy_host_tier_free(struct fy_host_tier *t) {
  if (!t) return;
  if (t->in_use)
    fy_log_warn("host tier: freed with %zu bytes still allocated", t->in_use);
  char name[64];
  snprintf(name, sizeof name, "arena.%u.destroy", t->arena);
  int rc = mallctl(name, NULL, NULL, NULL, 0);
  FY_ASSERT(rc == 0);  // fails only if a thread cache holds the arena, which TCACHE_NONE prevents
  hwloc_bitmap_free(t->nodeset);
  pthread_mutex_destroy(&t->mu);
  free(t->pageable);
  free(t);
}

// Flags and size of the block behind an allocation of n bytes (the same for alloc and dealloc).
static size_t block_size(const struct fy_host_tier *t, size_t n, int *flags) {
  size_t align = 64, size = n ? n : 1;
  if (t->pin) {  // whole pages: no page is shared by two pinned blocks
    align = t->page;
    size = (size + t->page - 1) / t->page * t->page;
  }
  *flags = MALLOCX_ARENA(t->arena) | MALLOCX_TCACHE_NONE | MALLOCX_ALIGN(align);
  return size;
}

// Model state is used whole from the first step on: its pages are mapped now, writable, rather
// than by faults in that step, where the first read of an untouched page maps the zero page and
// the first write faults again (1.4 GB/s against 5 GB/s for MADV_POPULATE_WRITE here; the first
// offloaded AdamW ran ~10x slower than the next). Pinned blocks are mapped by pinning. A kernel
// without MADV_POPULATE_WRITE (before 5.14) leaves them to the faults, as before.
static void populate(const struct fy_host_tier *t, void *p, size_t n) {
#ifdef MADV_POPULATE_WRITE
  if (n < ((size_t)1 << 20)) return;  // (small blocks: not worth a system call)
  uintptr_t lo = ((uintptr_t)p + t->page - 1) / t->page * t->page, hi = ((uintptr_t)p + n) / t->page * t->page;
  if (hi > lo) (void)madvise((void *)lo, hi - lo, MADV_POPULATE_WRITE);
#else
  (void)t, (void)p, (void)n;
#endif
}

// Pinning a block of n bytes failed (the reason is the error the hook set): it and every later
// block stay pageable, and the first such failure says so.
static void pin_failed(struct fy_host_tier *t, size_t n) {
  pthread_mutex_lock(&t->mu);
  const bool first = !t->pin_off;
  t->pin_off = true;
  pthread_mutex_unlock(&t->mu);
  if (first)
    fy_log_warn("host tier: pinning %zu bytes failed (%s); this block and the later ones stay in pageable "
                "memory: copies between them and the GPU are slower and overlap less with its kernels",
                n, fy_error_msg());
}

// A pageable block of a tier that pins: listed, for fy_host_dealloc to leave it to be.
static fy_status list_pageable(struct fy_host_tier *t, void *p) {
  fy_status st = FY_OK;
  pthread_mutex_lock(&t->mu);
  if (t->n_pageable == t->cap_pageable) {
    size_t cap = t->cap_pageable ? 2 * t->cap_pageable : 64;
    void **grown = realloc(t->pageable, cap * sizeof *grown);
    if (grown) t->pageable = grown, t->cap_pageable = cap;
    else st = fy_error_set(FY_ERR_NOMEM, "host tier: out of memory");
  }
  if (st == FY_OK) t->pageable[t->n_pageable++] = p;
  pthread_mutex_unlock(&t->mu);
  return st;
}

fy_status fy_host_alloc(struct fy_host_tier *t, size_t n, void **out) {
  *out = NULL;
  pthread_mutex_lock(&t->mu);
  if (t->cap && (n > t->cap || t->in_use > t->cap - n)) {
    size_t in_use = t->in_use;
    pthread_mutex_unlock(&t->mu);
    return fy_error_set(FY_ERR_NOMEM,
                        "host tier: cannot allocate %zu bytes: %zu bytes in use, cap %zu bytes", n,
                        in_use, t->cap);
  }
  t->in_use += n;  // reserved before allocating, so that concurrent callers cannot overshoot
  if (t->in_use > t->peak) t->peak = t->in_use;
  const bool pin = t->pin && !t->pin_off;
  pthread_mutex_unlock(&t->mu);

  int flags;
  size_t size = block_size(t, n, &flags);
#ifdef FY_TIER_ASAN
  void *p = mallocx(size, flags);
#else
  void *p = mallocx(size, flags | MALLOCX_ZERO);
#endif
  fy_status st = FY_OK;
  if (!p) {
    st = fy_error_set(FY_ERR_NOMEM, "host tier: allocating %zu bytes failed: out of memory", n);
  } else {
#ifdef FY_TIER_ASAN
    TIER_POISON(p, sallocx(p, 0));
    TIER_UNPOISON(p, n);
    memset(p, 0, n);
#endif
    const bool pinned = pin && t->pin(p, n) == FY_OK;
    if (pin && !pinned) pin_failed(t, n);
    if (!pinned) {
      populate(t, p, n);
      if (t->pin && (st = list_pageable(t, p)) != FY_OK) {
        dallocx(p, MALLOCX_TCACHE_NONE);
        p = NULL;
      }
    }
  }
  if (st != FY_OK) {
    pthread_mutex_lock(&t->mu);
    t->in_use -= n;
    pthread_mutex_unlock(&t->mu);
    return st;
  }
  *out = p;
  return FY_OK;
}

void fy_host_dealloc(struct fy_host_tier *t, void *p, size_t n) {
  if (!p) return;
  bool pinned = t->pin != NULL;
  if (pinned) {  // (unless it is one of the pageable blocks)
    pthread_mutex_lock(&t->mu);
    for (size_t i = t->n_pageable; i-- > 0;)
      if (t->pageable[i] == p) {
        t->pageable[i] = t->pageable[--t->n_pageable];
        pinned = false;
        break;
      }
    pthread_mutex_unlock(&t->mu);
  }
  if (pinned && t->unpin) t->unpin(p);
  TIER_POISON(p, sallocx(p, 0));
  dallocx(p, MALLOCX_TCACHE_NONE);
  pthread_mutex_lock(&t->mu);
  FY_ASSERT(t->in_use >= n);
  t->in_use -= n;
  pthread_mutex_unlock(&t->mu);
}

size_t fy_host_in_use(const struct fy_host_tier *t) {
  struct fy_host_tier *m = (struct fy_host_tier *)t;
  pthread_mutex_lock(&m->mu);
  size_t v = m->in_use;
  pthread_mutex_unlock(&m->mu);
  return v;
}

size_t fy_host_peak(const struct fy_host_tier *t) {
  struct fy_host_tier *m = (struct fy_host_tier *)t;
  pthread_mutex_lock(&m->mu);
  size_t v = m->peak;
  pthread_mutex_unlock(&m->mu);
  return v;
}

size_t fy_host_cap(const struct fy_host_tier *t) { return t->cap; }
