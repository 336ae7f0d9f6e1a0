// The device chunk cache's eviction policy over a recorded access trace (docs/design.md, "Chunks").
//
// A training step touches chunks in a known order that repeats every step (forward order, then
// backward order). The planner records it once as a trace; with the whole future known, the best
// chunk to evict is the resident one whose next use is farthest away (Belady's rule, optimal for a
// known trace: no other eviction choice loads fewer chunks).
//
// Steps repeat, so next-use looks wrap around: the next use of chunk c after access i is the first
// j > i with trace[j % n] == c, at distance j - i; a chunk absent from the trace is never used again
// (infinite distance, INT64_MAX). Access indices may count across steps: every function that takes
// an access index i reads it modulo the trace length.
#ifndef FY_MEMORY_CACHE_H
#define FY_MEMORY_CACHE_H

#include <stdbool.h>
#include <stdint.h>

#include "core/status.h"

// The access trace of one step: trace[i] is the chunk used by the i-th access (0 <= chunk <
// n_chunks). Immutable once created. Opaque.
struct fy_trace;

// Copies the trace. FY_ERR_INVALID when n < 0, n_chunks < 1, trace is NULL with n > 0, or an entry
// is outside [0, n_chunks); FY_ERR_NOMEM when out of memory. *out is NULL on error. An empty trace
// (n == 0) is valid: nothing is ever used.
fy_status fy_trace_create(const int32_t *trace, int64_t n, int32_t n_chunks, struct fy_trace **out);
void fy_trace_free(struct fy_trace *t);
int64_t fy_trace_length(const struct fy_trace *t);
int32_t fy_trace_chunks(const struct fy_trace *t);
// The chunk of access i (i modulo the length, i >= 0); -1 for an empty trace.
int32_t fy_trace_at(const struct fy_trace *t, int64_t i);
// The first access after i, in i's pass (i modulo the length), of another chunk than i's; the end
// of the pass when the rest of it uses i's chunk alone. O(1): a walk ahead can skip a run of one
// chunk's accesses (a chunk holds the parameters of many consecutive ops).
int64_t fy_trace_run_end(const struct fy_trace *t, int64_t i);
// Distance from access i to the next use of chunk c (INT64_MAX when never used, which includes a
// c outside [0, n_chunks)). A chunk used only at access i itself is next used one step later, at
// distance n. O(log k), k the number of uses of c.
int64_t fy_trace_next_use(const struct fy_trace *t, int64_t i, int32_t c);

// Belady's choice: among the `n` resident chunks, the one whose next use after access i is
// farthest (ties broken by the smaller chunk id, so the choice is deterministic). `pinned` chunks
// (in use right now, e.g. the current op's chunks, or prefetched ahead of use and not yet used)
// are never chosen; `pinned` is indexed by chunk id and may be NULL. Returns -1 when every
// resident chunk is pinned (or n == 0). Resident ids outside [0, n_chunks) are a caller bug; they
// are skipped, never chosen.
int32_t fy_cache_victim(const struct fy_trace *t, int64_t i, const int32_t *resident, int n,
                        const bool *pinned);

// Simulates `steps` repetitions of the trace with a cache of `capacity` chunks starting empty:
// each access of a chunk not resident is a miss and loads it, evicting Belady's victim first when
// the cache is full. Returns the number of misses (loads); -1 when capacity < 1, steps < 0, or out
// of memory. O(steps * n * log(n)). Used by tests and by the planner.
int64_t fy_cache_simulate(const struct fy_trace *t, int capacity, int steps);

#endif
