#include "memory/cache.h"

#include <stdlib.h>
#include <string.h>

// The trace plus, for every chunk, the sorted positions of its uses (CSR: uses of chunk c are
// pos[start[c]] .. pos[start[c + 1] - 1], ascending), so a next-use look is one binary search.
struct fy_trace {
  int64_t n;
  int32_t n_chunks;
  int32_t *trace;  // n entries
  int64_t *start;  // n_chunks + 1 entries
  int64_t *pos;    // n entries
  int64_t *run_end;  // n entries: the first later access of another chunk, or n (fy_trace_run_end)
};

fy_status fy_trace_create(const int32_t *trace, int64_t n, int32_t n_chunks, struct fy_trace **out) {
  if (!out) return fy_error_set(FY_ERR_INVALID, "trace: no output pointer");
  *out = NULL;
  if (n < 0) return fy_error_set(FY_ERR_INVALID, "trace: negative length %lld", (long long)n);
  if (n_chunks < 1)
    return fy_error_set(FY_ERR_INVALID, "trace: n_chunks must be at least 1, got %d", (int)n_chunks);
  if (n > 0 && !trace) return fy_error_set(FY_ERR_INVALID, "trace: NULL trace of length %lld", (long long)n);
  if ((uint64_t)n > SIZE_MAX / sizeof(int64_t))
    return fy_error_set(FY_ERR_INVALID, "trace: length %lld too large", (long long)n);
  for (int64_t i = 0; i < n; i++) {
    if (trace[i] < 0 || trace[i] >= n_chunks)
      return fy_error_set(FY_ERR_INVALID, "trace: access %lld uses chunk %d, outside [0, %d)",
                          (long long)i, (int)trace[i], (int)n_chunks);
  }
  struct fy_trace *t = calloc(1, sizeof *t);
  if (!t) return fy_error_set(FY_ERR_NOMEM, "trace: out of memory");
  t->n = n;
  t->n_chunks = n_chunks;
  size_t nn = n > 0 ? (size_t)n : 1;
  t->trace = malloc(nn * sizeof *t->trace);
  t->pos = malloc(nn * sizeof *t->pos);
  t->start = calloc((size_t)n_chunks + 1, sizeof *t->start);
  t->run_end = malloc(nn * sizeof *t->run_end);
  if (!t->trace || !t->pos || !t->start || !t->run_end) {
    fy_trace_free(t);
    return fy_error_set(FY_ERR_NOMEM, "trace: out of memory (%lld accesses, %d chunks)",
                        (long long)n, (int)n_chunks);
  }
  if (n > 0) memcpy(t->trace, trace, (size_t)n * sizeof *t->trace);
  for (int64_t i = n - 1; i >= 0; i--)
    t->run_end[i] = i + 1 < n && trace[i + 1] == trace[i] ? t->run_end[i + 1] : i + 1;
  // Counting sort by chunk; scanning i ascending keeps each chunk's positions sorted.
  for (int64_t i = 0; i < n; i++) t->start[trace[i] + 1]++;
  for (int32_t c = 0; c < n_chunks; c++) t->start[c + 1] += t->start[c];
  int64_t *fill = malloc((size_t)n_chunks * sizeof *fill);
  if (!fill) {
    fy_trace_free(t);
    return fy_error_set(FY_ERR_NOMEM, "trace: out of memory");
  }
  memcpy(fill, t->start, (size_t)n_chunks * sizeof *fill);
  for (int64_t i = 0; i < n; i++) t->pos[fill[trace[i]]++] = i;
  free(fill);
  *out = t;
  return FY_OK;
}

void fy_trace_free(struct fy_trace *t) {
  if (!t) return;
  free(t->trace);
  free(t->start);
  free(t->pos);
  free(t->run_end);
  free(t);
}

int64_t fy_trace_length(const struct fy_trace *t) { return t->n; }
int32_t fy_trace_chunks(const struct fy_trace *t) { return t->n_chunks; }

static int64_t wrap(const struct fy_trace *t, int64_t i) {
  int64_t r = i % t->n;
  return r < 0 ? r + t->n : r;
}

int32_t fy_trace_at(const struct fy_trace *t, int64_t i) {
  if (t->n == 0) return -1;
  return t->trace[wrap(t, i)];
}

int64_t fy_trace_run_end(const struct fy_trace *t, int64_t i) {
  if (t->n == 0) return i + 1;
  const int64_t r = wrap(t, i);
  return i - r + t->run_end[r];
}

int64_t fy_trace_next_use(const struct fy_trace *t, int64_t i, int32_t c) {
  if (t->n == 0 || c < 0 || c >= t->n_chunks) return INT64_MAX;
  int64_t lo = t->start[c], hi = t->start[c + 1];
  if (lo == hi) return INT64_MAX;
  int64_t r = wrap(t, i);
  // First use position > r in [lo, hi).
  int64_t a = lo, b = hi;
  while (a < b) {
    int64_t m = a + (b - a) / 2;
    if (t->pos[m] > r) b = m;
    else a = m + 1;
  }
  if (a < hi) return t->pos[a] - r;
  return t->pos[lo] + t->n - r;  // wraps into the next step
}

int32_t fy_cache_victim(const struct fy_trace *t, int64_t i, const int32_t *resident, int n,
                        const bool *pinned) {
  int32_t best = -1;
  int64_t best_d = -1;
  for (int k = 0; k < n; k++) {
    int32_t c = resident[k];
    if (c < 0 || c >= t->n_chunks) continue;
    if (pinned && pinned[c]) continue;
    int64_t d = fy_trace_next_use(t, i, c);
    if (d > best_d || (d == best_d && c < best)) {
      best = c;
      best_d = d;
    }
  }
  return best;
}

// The simulation keeps the resident chunks in a max-heap keyed by the absolute position (across
// steps) of their next use; an entry is stale once its chunk was evicted or used again (the chunk's
// current key then differs), and stale entries are dropped lazily or by compaction. Popping the
// largest live key is fy_cache_victim's choice: the same order (no two resident chunks share a
// next-use position, so ties cannot arise), in O(log) instead of O(capacity).
struct heap_entry {
  int64_t key;
  int32_t chunk;
};

static bool above(struct heap_entry a, struct heap_entry b) {
  return a.key > b.key || (a.key == b.key && a.chunk < b.chunk);
}

static void sift_down(struct heap_entry *h, int64_t n, int64_t k) {
  for (;;) {
    int64_t l = 2 * k + 1, r = l + 1, m = k;
    if (l < n && above(h[l], h[m])) m = l;
    if (r < n && above(h[r], h[m])) m = r;
    if (m == k) return;
    struct heap_entry x = h[k];
    h[k] = h[m];
    h[m] = x;
    k = m;
  }
}

static void sift_up(struct heap_entry *h, int64_t k) {
  while (k > 0) {
    int64_t p = (k - 1) / 2;
    if (!above(h[k], h[p])) return;
    struct heap_entry x = h[k];
    h[k] = h[p];
    h[p] = x;
    k = p;
  }
}

int64_t fy_cache_simulate(const struct fy_trace *t, int capacity, int steps) {
  if (capacity < 1 || steps < 0) return -1;
  if (t->n == 0 || steps == 0) return 0;
  int32_t nc = t->n_chunks;
  bool *resident = calloc((size_t)nc, sizeof *resident);
  int64_t *key = malloc((size_t)nc * sizeof *key);
  // Live entries are at most min(capacity, nc); compaction keeps the heap under 2 * that + 64.
  int64_t live_max = capacity < nc ? capacity : nc;
  int64_t heap_cap = 2 * live_max + 64;
  struct heap_entry *heap = malloc((size_t)heap_cap * sizeof *heap);
  if (!resident || !key || !heap) {
    free(resident);
    free(key);
    free(heap);
    return -1;
  }
  int64_t hn = 0, count = 0, misses = 0;
  for (int64_t s = 0; s < steps; s++) {
    for (int64_t i = 0; i < t->n; i++) {
      int64_t g = s * t->n + i;
      int32_t c = t->trace[i];
      int64_t next = g + fy_trace_next_use(t, i, c);  // finite: c is in the trace
      if (!resident[c]) {
        misses++;
        if (count == capacity) {
          for (;;) {
            struct heap_entry top = heap[0];
            heap[0] = heap[--hn];
            sift_down(heap, hn, 0);
            if (resident[top.chunk] && key[top.chunk] == top.key) {
              resident[top.chunk] = false;
              count--;
              break;
            }
          }
        }
        resident[c] = true;
        count++;
      }
      key[c] = next;
      if (hn == heap_cap) {  // drop stale entries, then rebuild the heap
        int64_t w = 0;
        for (int64_t k = 0; k < hn; k++)
          if (resident[heap[k].chunk] && key[heap[k].chunk] == heap[k].key) heap[w++] = heap[k];
        hn = w;
        for (int64_t k = hn / 2 - 1; k >= 0; k--) sift_down(heap, hn, k);
      }
      heap[hn] = (struct heap_entry){next, c};
      sift_up(heap, hn++);
    }
  }
  free(resident);
  free(key);
  free(heap);
  return misses;
}
