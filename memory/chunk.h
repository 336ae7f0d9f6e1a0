// Chunks (docs/design.md, "The objects"): parameters packed in first-use order into equal-size chunks,
// each chunk in one state at a time with checked transitions.
//
// Packing keeps the parameters an operator uses first together (a fused QKV's weights stay
// adjacent), so a chunk is at least as large as the largest such group. In the flat layout a
// chunk c occupies elements [c * chunk_elems, (c + 1) * chunk_elems) of every parameter-sized
// buffer, so "all resident" is the special case where the device holds every chunk in place.
#ifndef FY_CHUNK_H
#define FY_CHUNK_H

#include <stdbool.h>
#include <stdint.h>

#include "core/graph.h"
#include "core/status.h"

// The life of a chunk's device copy over a step (Elixir's and ColossalAI Gemini's states):
//   FREE              not on the device
//   COMPUTE           an operator is using it now
//   HOLD              on the device with its weights, not in use (may be evicted; clean)
//   HOLD_AFTER_BWD    backward has written some of its gradients over their weights and more
//                     operators will still use it in this backward pass (evicting it means
//                     spilling its block to the host and loading that back)
//   READY_FOR_REDUCE  every gradient of the chunk is in: ready to be reduced and moved to where
//                     its optimizer state lives, after which it is FREE
enum fy_chunk_state {
  FY_CHUNK_FREE,
  FY_CHUNK_COMPUTE,
  FY_CHUNK_HOLD,
  FY_CHUNK_HOLD_AFTER_BWD,
  FY_CHUNK_READY_FOR_REDUCE,
};

struct fy_chunk {
  int id;
  int64_t used;                 // floats holding parameters (the rest is padding)
  int first_use, last_use;      // first and last op (forward order) using it
  int n_users_bwd;              // ops using it, i.e. backward uses per micro-batch
  enum fy_chunk_state state;
  int block;                    // device cache block holding it, -1 when FREE
};

struct fy_chunk_layout {
  int64_t chunk_elems;
  int n_chunks;
  struct fy_chunk *chunks;
  // The distinct chunks each op uses: op_chunks[op_first[o] .. op_first[o + 1]).
  int *op_first, *op_chunks;
};

// The smallest chunk (floats) that can hold every group of parameters an op uses first.
int64_t fy_chunk_min_elems(const struct fy_graph *g);
// A device update (runtime/offload.c, --device-updates) moves a chunk's n elements (its used part,
// or a rank's shard) through device memory in pieces of this many (the last may be shorter), so
// that its staging holds two pieces, not two chunks: n / FY_CHUNK_PIECES rounded up to a multiple
// of 256 (an 8-bit state block: each piece's blocks are the chunk's).
#define FY_CHUNK_PIECES 4
int64_t fy_chunk_piece_elems(int64_t n);
// Packs g's parameters into chunks of chunk_elems floats (0: one chunk for all), rewriting each
// parameter's chunk, chunk_offset and offset and g->n_param_elems, g->chunk_elems.
fy_status fy_chunk_layout_create(struct fy_graph *g, int64_t chunk_elems,
                                 struct fy_chunk_layout **out);
void fy_chunk_layout_free(struct fy_chunk_layout *l);
// A pipeline stage's layout (runtime/pipeline.h): only ops [lo, hi) of the graph's n_ops use chunks,
// and each chunk's users are counted among them (a tied embedding's chunk has one backward use on
// the first stage and one on the last, not the two of the whole graph).
void fy_chunk_layout_keep_ops(struct fy_chunk_layout *l, int n_ops, int lo, int hi);
// The device blocks a pass needs at once: the most chunks one op uses (chunks that backward has
// started writing gradients into can be spilled, so they need not stay).
int fy_chunk_min_blocks(const struct fy_chunk_layout *l, int n_ops);
// Moves a chunk to `to`; an illegal transition is a broken invariant of the memory manager.
void fy_chunk_set_state(struct fy_chunk *c, enum fy_chunk_state to);
bool fy_chunk_transition_legal(enum fy_chunk_state from, enum fy_chunk_state to);
const char *fy_chunk_state_name(enum fy_chunk_state s);

#endif
