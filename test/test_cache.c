// The eviction policy over a recorded trace (memory/cache.h): next-use distances against a naive
// scan, Belady's miss count against an exhaustive search over every eviction choice, a training
// trace counted by hand, pinned chunks, and bad input. And the device cache's bf16 payload
// (memory/device_cache.h) on the sim device.
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "core/dtype.h"
#include "core/opt.h"
#include "memory/cache.h"
#include "memory/chunk.h"
#include "memory/device_cache.h"
#include "test/check.h"

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void) {  // xorshift64*
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return (uint32_t)((rng_state * 2685821657736338717ull) >> 32);
}
static int rnd_in(int lo, int hi) { return lo + (int)(rnd() % (uint32_t)(hi - lo + 1)); }

static int64_t naive_next_use(const int32_t *tr, int64_t n, int64_t i, int32_t c) {
  for (int64_t d = 1; d <= n; d++)
    if (tr[(i + d) % n] == c) return d;
  return INT64_MAX;
}

// (1) Next-use distances, including wrap-around, chunks used only once, absent chunks, ids out of
// range and access indices from later steps; and where each run of one chunk's accesses ends.
static void test_next_use(void) {
  int32_t tr[64];
  for (int rep = 0; rep < 300; rep++) {
    int n = rnd_in(1, 64), nc = rnd_in(1, 12);
    // Leave some chunks absent: draw from a subset of the ids.
    int used = rnd_in(1, nc);
    for (int i = 0; i < n; i++) tr[i] = (int32_t)(rnd() % (uint32_t)used) * (nc / used);
    struct fy_trace *t = NULL;
    CHECK_OK(fy_trace_create(tr, n, nc, &t));
    if (!t) continue;
    CHECK(fy_trace_length(t) == n);
    CHECK(fy_trace_chunks(t) == nc);
    int bad = 0;
    for (int i = 0; i < n; i++) {
      if (fy_trace_at(t, i) != tr[i] || fy_trace_at(t, i + 3 * n) != tr[i]) bad++;
      int64_t run = i + 1;  // the run of tr[i]'s chunk ends at the pass's end at the latest
      while (run < n && tr[run] == tr[i]) run++;
      if (fy_trace_run_end(t, i) != run || fy_trace_run_end(t, i + 5 * (int64_t)n) != run + 5 * (int64_t)n) {
        if (bad++ < 5)
          fprintf(stderr, "run_end(%d) = %lld, naive %lld\n", i, (long long)fy_trace_run_end(t, i), (long long)run);
      }
      for (int c = -1; c <= nc; c++) {
        int64_t want = (c < 0 || c >= nc) ? INT64_MAX : naive_next_use(tr, n, i, c);
        if (fy_trace_next_use(t, i, c) != want) {
          if (bad++ < 5)
            fprintf(stderr, "next_use(i=%d, c=%d) = %lld, naive %lld\n", i, c,
                    (long long)fy_trace_next_use(t, i, c), (long long)want);
        }
        if (fy_trace_next_use(t, i + 7 * (int64_t)n, c) != want) bad++;  // a later step
      }
    }
    CHECKF(bad == 0, "rep %d: %d mismatches", rep, bad);
    fy_trace_free(t);
  }
  // By hand: trace 0 1 0 2 over 4 chunks (chunk 3 absent).
  int32_t h[] = {0, 1, 0, 2};
  struct fy_trace *t = NULL;
  CHECK_OK(fy_trace_create(h, 4, 4, &t));
  if (t) {
    CHECK(fy_trace_next_use(t, 0, 0) == 2);
    CHECK(fy_trace_next_use(t, 2, 0) == 2);  // wraps: 2 -> 4 (= 0 of the next step)
    CHECK(fy_trace_next_use(t, 1, 1) == 4);  // used only at 1: next step
    CHECK(fy_trace_next_use(t, 3, 2) == 4);
    CHECK(fy_trace_next_use(t, 3, 1) == 2);
    CHECK(fy_trace_next_use(t, 0, 3) == INT64_MAX);
    CHECK(fy_trace_next_use(t, 0, 4) == INT64_MAX);
    fy_trace_free(t);
  }
  // The empty trace: nothing is ever used.
  CHECK_OK(fy_trace_create(NULL, 0, 3, &t));
  if (t) {
    CHECK(fy_trace_length(t) == 0);
    CHECK(fy_trace_at(t, 0) == -1);
    CHECK(fy_trace_next_use(t, 0, 1) == INT64_MAX);
    CHECK(fy_cache_simulate(t, 2, 3) == 0);
    fy_trace_free(t);
  }
}

// The optimal number of misses by exhaustive search: from access `pos` of the unrolled sequence
// with cache contents `mask`, the fewest loads to serve the rest, trying every eviction when a miss
// finds the cache full (demand loads only, exactly one eviction per load when full). Memoised over
// (pos, mask): at most 30 positions x 64 masks.
#define BF_MAXLEN 32
static int bf_memo[BF_MAXLEN + 1][1 << 6];
static int bf(const int32_t *seq, int len, int cap, int pos, unsigned mask) {
  if (pos == len) return 0;
  int *m = &bf_memo[pos][mask];
  if (*m >= 0) return *m;
  unsigned bit = 1u << seq[pos];
  int best;
  if (mask & bit) {
    best = bf(seq, len, cap, pos + 1, mask);
  } else if (__builtin_popcount(mask) < cap) {
    best = 1 + bf(seq, len, cap, pos + 1, mask | bit);
  } else {
    best = INT32_MAX;
    for (unsigned v = mask; v; v &= v - 1) {
      unsigned out = v & -v;
      int r = 1 + bf(seq, len, cap, pos + 1, (mask & ~out) | bit);
      if (r < best) best = r;
    }
  }
  return *m = best;
}

// The same simulation written with fy_cache_victim at every miss (no pins), the way the runtime
// will call it: checks fy_cache_simulate's heap against the plain rule.
static int64_t simulate_with_victim(const struct fy_trace *t, const int32_t *tr, int64_t n, int cap,
                                    int steps) {
  int32_t res[64];
  int nres = 0;
  int64_t misses = 0;
  for (int s = 0; s < steps; s++) {
    for (int64_t i = 0; i < n; i++) {
      int32_t c = tr[i];
      bool hit = false;
      for (int k = 0; k < nres; k++) hit |= res[k] == c;
      if (hit) continue;
      misses++;
      if (nres == cap) {
        int32_t v = fy_cache_victim(t, s * n + i, res, nres, NULL);
        int k = 0;
        while (k < nres && res[k] != v) k++;
        if (k == nres) return -1;
        res[k] = res[--nres];
      }
      res[nres++] = c;
    }
  }
  return misses;
}

// (2) Belady's miss count equals the exhaustive optimum on many small random traces.
static void test_optimal(void) {
  int32_t tr[10], seq[BF_MAXLEN];
  int bad = 0, cases = 0, gap_naive = 0;
  for (int rep = 0; rep < 20000; rep++) {
    int nc = rnd_in(2, 6), n = rnd_in(2, 10), cap = rnd_in(1, nc - 1), steps = rnd_in(1, 3);
    for (int i = 0; i < n; i++) tr[i] = (int32_t)(rnd() % (uint32_t)nc);
    int len = n * steps;
    for (int k = 0; k < len; k++) seq[k] = tr[k % n];
    memset(bf_memo, 0xff, sizeof bf_memo);
    int want = bf(seq, len, cap, 0, 0);
    struct fy_trace *t = NULL;
    if (fy_trace_create(tr, n, nc, &t) != FY_OK) {
      bad++;
      continue;
    }
    int64_t got = fy_cache_simulate(t, cap, steps);
    int64_t got_v = simulate_with_victim(t, tr, n, cap, steps);
    cases++;
    if (got != want || got_v != want) {
      if (bad++ < 5) {
        fprintf(stderr, "nc=%d cap=%d steps=%d trace:", nc, cap, steps);
        for (int i = 0; i < n; i++) fprintf(stderr, " %d", tr[i]);
        fprintf(stderr, "  simulate %lld, victim-loop %lld, optimum %d\n", (long long)got,
                (long long)got_v, want);
      }
    }
    // A non-optimal policy (evict the most recently loaded) must sometimes differ, or this test
    // could not tell Belady from anything else.
    {
      int32_t res[8];
      int nres = 0, mm = 0;
      for (int k = 0; k < len; k++) {
        bool hit = false;
        for (int j = 0; j < nres; j++) hit |= res[j] == seq[k];
        if (hit) continue;
        mm++;
        if (nres == cap) nres--;
        res[nres++] = seq[k];
      }
      if (mm != want) gap_naive++;
    }
    fy_trace_free(t);
  }
  CHECKF(bad == 0, "%d of %d random traces differ from the exhaustive optimum", bad, cases);
  CHECKF(gap_naive > 100, "only %d cases separate a naive policy from the optimum",
         gap_naive);
}

// (3) A training trace: chunks 0..k forward, then k..0 backward, K = k + 1 chunks.
//   capacity K-2: step 1 loads all K in forward (evicting 0 and 1), hits k..2 in backward, then
//     loads 1 and 0 (evicting k and k-1): K + 2. Every later step starts with 0..k-2 resident:
//     forward loads k-1 and k (evicting 0, 1), backward loads 1 and 0 again: 4 per step.
//   capacity K-1: step 1 loads K forward (evicting 0) and 0 in backward (evicting k): K + 1; later
//     steps load k and 0: 2 per step.
//   capacity >= K: K loads, then nothing.
static void test_training_trace(void) {
  for (int k = 2; k <= 40; k++) {
    int K = k + 1;
    int32_t tr[82];
    int n = 0;
    for (int c = 0; c <= k; c++) tr[n++] = c;
    for (int c = k; c >= 0; c--) tr[n++] = c;
    struct fy_trace *t = NULL;
    CHECK_OK(fy_trace_create(tr, n, K, &t));
    if (!t) continue;
    for (int steps = 1; steps <= 5; steps++) {
      CHECKF(fy_cache_simulate(t, K - 2, steps) == K + 2 + 4 * (steps - 1), "k=%d steps=%d: %lld", k,
             steps, (long long)fy_cache_simulate(t, K - 2, steps));
      CHECKF(fy_cache_simulate(t, K - 1, steps) == K + 1 + 2 * (steps - 1), "k=%d steps=%d: %lld", k,
             steps, (long long)fy_cache_simulate(t, K - 1, steps));
      CHECK(fy_cache_simulate(t, K, steps) == K);
      CHECK(fy_cache_simulate(t, K + 5, steps) == K);
      CHECK(simulate_with_victim(t, tr, n, K - 2, steps) == K + 2 + 4 * (steps - 1));
    }
    // The first eviction of step 1 (at forward access K-2, cache 0..K-3 full) takes chunk 0, the one
    // backward needs last.
    int32_t res[64];
    for (int c = 0; c < K - 2; c++) res[c] = c;
    CHECK(fy_cache_victim(t, K - 2, res, K - 2, NULL) == 0);
    fy_trace_free(t);
  }
  // A long trace with a few large steps finishes fast (the planner calls this in its search).
  enum { KK = 2000 };
  static int32_t big[2 * KK];
  for (int c = 0; c < KK; c++) big[c] = c, big[2 * KK - 1 - c] = c;
  struct fy_trace *t = NULL;
  CHECK_OK(fy_trace_create(big, 2 * KK, KK, &t));
  if (t) {
    CHECK(fy_cache_simulate(t, KK / 2, 20) == KK + (KK - KK / 2) + 19 * 2 * (KK - KK / 2));
    fy_trace_free(t);
  }
}

// (4) Pinned chunks are never chosen; -1 when every resident chunk is pinned.
static void test_pinned(void) {
  // trace 0 1 2 3 4 5; at access 0 the farthest next use among {1..5} is 5, then 4, ...
  int32_t tr[] = {0, 1, 2, 3, 4, 5};
  struct fy_trace *t = NULL;
  CHECK_OK(fy_trace_create(tr, 6, 7, &t));
  if (!t) return;
  int32_t res[] = {3, 5, 1, 4, 2};
  bool pinned[7] = {false};
  CHECK(fy_cache_victim(t, 0, res, 5, NULL) == 5);
  CHECK(fy_cache_victim(t, 0, res, 5, pinned) == 5);
  pinned[5] = true;
  CHECK(fy_cache_victim(t, 0, res, 5, pinned) == 4);
  pinned[4] = true;
  pinned[3] = true;
  CHECK(fy_cache_victim(t, 0, res, 5, pinned) == 2);
  pinned[2] = true;
  CHECK(fy_cache_victim(t, 0, res, 5, pinned) == 1);
  pinned[1] = true;
  CHECK(fy_cache_victim(t, 0, res, 5, pinned) == -1);
  CHECK(fy_cache_victim(t, 0, res, 0, NULL) == -1);
  // Wrap-around: at access 4, chunk 0's next use (6) is nearer than chunk 3's (9).
  int32_t r2[] = {0, 3};
  CHECK(fy_cache_victim(t, 4, r2, 2, NULL) == 3);
  // Absent chunk 6 (never used) is the best victim unless pinned; ties go to the smaller id.
  int32_t r3[] = {2, 6, 1};
  CHECK(fy_cache_victim(t, 0, r3, 3, NULL) == 6);
  bool p6[7] = {false, false, false, false, false, false, true};
  CHECK(fy_cache_victim(t, 0, r3, 3, p6) == 2);  // next use of 1 is at 1, of 2 at 2
  fy_trace_free(t);

  int32_t tr2[] = {0, 1};
  CHECK_OK(fy_trace_create(tr2, 2, 6, &t));
  if (t) {
    int32_t r4[] = {5, 3, 4};  // all absent: tie at infinity -> smallest id
    CHECK(fy_cache_victim(t, 0, r4, 3, NULL) == 3);
    // Random pins: the choice is never pinned, is resident, and has the largest unpinned distance.
    int bad = 0;
    for (int rep = 0; rep < 2000; rep++) {
      int32_t tr3[16], rr[8];
      int n = rnd_in(1, 16), nc = 8;
      for (int i = 0; i < n; i++) tr3[i] = (int32_t)rnd_in(0, nc - 1);
      struct fy_trace *t3 = NULL;
      if (fy_trace_create(tr3, n, nc, &t3) != FY_OK) { bad++; continue; }
      int nr = rnd_in(0, 8);
      for (int k = 0; k < nr; k++) rr[k] = k;  // a shuffled set of distinct ids
      for (int k = nr - 1; k > 0; k--) { int j = rnd_in(0, k); int32_t x = rr[k]; rr[k] = rr[j]; rr[j] = x; }
      bool pin[8];
      for (int c = 0; c < 8; c++) pin[c] = rnd() % 3 == 0;
      int64_t i = rnd_in(0, 3 * n);
      int32_t v = fy_cache_victim(t3, i, rr, nr, pin);
      int32_t want = -1;
      int64_t wd = -1;
      for (int k = 0; k < nr; k++) {
        if (pin[rr[k]]) continue;
        int64_t d = naive_next_use(tr3, n, i % n, rr[k]);
        if (d > wd || (d == wd && rr[k] < want)) { want = rr[k]; wd = d; }
      }
      if (v != want) bad++;
      fy_trace_free(t3);
    }
    CHECKF(bad == 0, "%d random pinned victims wrong", bad);
    fy_trace_free(t);
  }
}

// (5) Bad input.
static void test_errors(void) {
  int32_t ok[] = {0, 1, 2};
  int32_t neg[] = {0, -1};
  int32_t big[] = {0, 3};
  struct fy_trace *t = (struct fy_trace *)&t;  // must be overwritten with NULL
  CHECK_ERR(fy_trace_create(ok, 3, 0, &t), FY_ERR_INVALID);
  CHECK(t == NULL);
  CHECK_ERR(fy_trace_create(ok, 3, -2, &t), FY_ERR_INVALID);
  CHECK_ERR(fy_trace_create(ok, -1, 3, &t), FY_ERR_INVALID);
  CHECK_ERR(fy_trace_create(neg, 2, 3, &t), FY_ERR_INVALID);
  CHECK_ERR(fy_trace_create(big, 2, 3, &t), FY_ERR_INVALID);
  CHECK(strstr(fy_error_msg(), "access 1") != NULL);
  CHECK_ERR(fy_trace_create(NULL, 2, 3, &t), FY_ERR_INVALID);
  CHECK_ERR(fy_trace_create(ok, 3, 3, NULL), FY_ERR_INVALID);
  CHECK(t == NULL);
  CHECK_OK(fy_trace_create(ok, 3, 3, &t));
  if (t) {
    CHECK(fy_cache_simulate(t, 0, 1) == -1);
    CHECK(fy_cache_simulate(t, 1, -1) == -1);
    CHECK(fy_cache_simulate(t, 1, 0) == 0);
    CHECK(fy_cache_simulate(t, 1, 2) == 6);
    fy_trace_free(t);
  }
  fy_trace_free(NULL);
}

// A bf16 payload: a block of 2-byte elements takes the chunk's bf16 copy from home; the gradients
// written over it come home widened to fp32 (= in the first pass, += in the next).
static void test_device_cache_bf16(void) {
  struct fy_opt_config cfg;
  fy_opt_preset("opt-tiny", &cfg);
  struct fy_graph *g = NULL;
  struct fy_chunk_layout *l = NULL;
  struct fy_device *dev = NULL;
  CHECK_OK(fy_opt_build_graph(&cfg, 1, 4, &g));
  CHECK_OK(fy_chunk_layout_create(g, fy_chunk_min_elems(g), &l));
  CHECK_OK(fy_device_sim_create(64 << 20, 0, &dev));
  if (!g || !l || !dev) return;
  fy_stream *compute, *copy_in, *copy_out;
  CHECK_OK(fy_stream_create(dev, &compute));
  CHECK_OK(fy_stream_create(dev, &copy_in));
  CHECK_OK(fy_stream_create(dev, &copy_out));
  const int c = 0, n = l->chunks[0].n_users_bwd;
  const int64_t used = l->chunks[0].used, ce = l->chunk_elems;
  CHECK(n >= 1 && n <= 16 && used > 1000);
  int32_t tr[16];
  for (int i = 0; i < n; i++) tr[i] = c;
  struct fy_trace *t = NULL;
  CHECK_OK(fy_trace_create(tr, n, l->n_chunks, &t));
  uint16_t *home16 = malloc((size_t)ce * 2);
  float *staging = malloc((size_t)ce * 4), *dst = malloc((size_t)ce * 4), *want = malloc((size_t)ce * 4);
  const float **home = calloc((size_t)l->n_chunks, sizeof *home);
  for (int64_t j = 0; j < ce; j++) home16[j] = fy_f32_to_bf16(0.001f * (float)(j % 1000) - 0.5f);
  home[c] = (const float *)home16;
  struct fy_device_cache_opts o = {.dev = dev, .compute = compute, .copy_in = copy_in, .copy_out = copy_out,
                                   .n_blocks = 1, .trace = t, .home = home, .staging = staging, .elem_bytes = 2};
  struct fy_device_cache *cache = NULL;
  CHECK_OK(fy_device_cache_create(l, &o, &cache));
  size_t before = dev->bytes_in_use;
  CHECKF(before >= (size_t)ce * 2 && before < (size_t)ce * 4, "one block of %lld bf16 elements: %zu bytes",
         (long long)ce, before);
  for (int pass = 0; cache && pass < 2; pass++) {
    fy_device_cache_begin_pass(cache);
    for (int i = 0; i < n; i++) {
      float *block = NULL;
      CHECK_OK(fy_device_cache_acquire(cache, (int64_t)pass * n + i, c, &block));
      CHECK_OK(fy_stream_sync(copy_in));
      uint16_t *b16 = (uint16_t *)block;
      if (i == 0) {  // the weights as loaded, then this pass's gradients over them
        CHECK(memcmp(b16, home16, (size_t)used * 2) == 0);
        for (int64_t j = 0; j < used; j++) {
          float gj = 0.25f * (float)((j + pass) % 7) - 0.75f + (float)pass;  // exact in bf16
          b16[j] = fy_f32_to_bf16(gj);
          want[j] = pass == 0 ? gj : want[j] + gj;
        }
      }
      enum fy_chunk_state st = fy_device_cache_release(cache, c, true);
      CHECK(st == (i + 1 == n ? FY_CHUNK_READY_FOR_REDUCE : FY_CHUNK_HOLD_AFTER_BWD));
    }
    CHECK_OK(fy_device_cache_write_back(cache, c, dst, pass > 0, NULL));
    CHECK_OK(fy_stream_sync(copy_out));
    int64_t bad = 0;
    for (int64_t j = 0; j < used; j++) bad += dst[j] != want[j];
    CHECKF(bad == 0, "pass %d: %lld of %lld gradients widened wrong (first: %g, want %g)", pass, (long long)bad,
           (long long)used, dst[0], want[0]);
  }
  fy_device_cache_free(cache);
  CHECK(dev->bytes_in_use == 0);
  fy_trace_free(t);
  free(home16);
  free(staging);
  free(dst);
  free(want);
  free(home);
  fy_stream_free(compute);
  fy_stream_free(copy_in);
  fy_stream_free(copy_out);
  fy_device_free(dev);
  fy_chunk_layout_free(l);
  fy_graph_free(g);
}

// A device update's pieces (fy_chunk_piece_elems): a quarter of a chunk's part, whole 256-element
// blocks, so that FY_CHUNK_PIECES of them cover it and one fewer does not.
static void test_piece_elems(void) {
  const int64_t n[] = {1, 255, 256, 1000, 1024, 1025, 13107, 205914112, 205914112 / 3};
  for (size_t i = 0; i < sizeof n / sizeof *n; i++) {
    const int64_t p = fy_chunk_piece_elems(n[i]);
    CHECKF(p > 0 && p % 256 == 0 && p * FY_CHUNK_PIECES >= n[i] && (p - 256) * FY_CHUNK_PIECES < n[i],
           "%lld elements: pieces of %lld", (long long)n[i], (long long)p);
  }
  CHECK(fy_chunk_piece_elems(0) == 0 && fy_chunk_piece_elems(-5) == 0);
  CHECK(fy_chunk_piece_elems(4096) == 1024 && fy_chunk_piece_elems(4097) == 1280);
}

int main(void) {
  test_piece_elems();
  test_device_cache_bf16();
  test_next_use();
  test_optimal();
  test_training_trace();
  test_pinned();
  test_errors();
  return check_summary("cache");
}
