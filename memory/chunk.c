#include "memory/chunk.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ALIGN 16  // floats: 64 bytes, the alignment every parameter group starts at by default

// Every parameter group starts at a multiple of g->chunk_align (ALIGN when 0), and so does every
// chunk: 8-bit AdamW state quantises blocks of 256 elements counted from a chunk's start, and
// with groups so aligned a block holds the same elements in any chunk layout (ops/ops.h).
static int64_t group_align(const struct fy_graph *g) { return g->chunk_align > ALIGN ? g->chunk_align : ALIGN; }

static int64_t align_to(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

// Size of the group of parameters op o uses first (0 if none).
static int64_t group_elems(const struct fy_graph *g, int o) {
  int64_t n = 0;
  const struct fy_op *op = &g->ops[o];
  for (int k = 0; k < op->n_params; k++) {
    const struct fy_param *p = &g->params[op->params[k]];
    if (p->first_use == o && !p->absent) n += p->numel;
  }
  return n;
}

int64_t fy_chunk_min_elems(const struct fy_graph *g) {
  int64_t m = 0;
  for (int o = 0; o < g->n_ops; o++) {
    int64_t n = align_to(group_elems(g, o), group_align(g));
    if (n > m) m = n;
  }
  return m;
}

fy_status fy_chunk_layout_create(struct fy_graph *g, int64_t chunk_elems, struct fy_chunk_layout **out) {
  const int64_t align = group_align(g);
  int64_t min = fy_chunk_min_elems(g), total = 0;
  for (int o = 0; o < g->n_ops; o++) total += align_to(group_elems(g, o), align);
  if (chunk_elems == 0) chunk_elems = total;
  chunk_elems = align_to(chunk_elems, align);
  if (chunk_elems < min)
    return fy_error_set(FY_ERR_INVALID,
                        "a chunk of %lld parameters cannot hold the largest parameter group "
                        "(%lld parameters, %.1f MiB in fp32); use a chunk size of at least that",
                        (long long)chunk_elems, (long long)min, min * 4.0 / 1048576.0);
  struct fy_chunk_layout *l = calloc(1, sizeof *l);
  if (!l) return fy_error_set(FY_ERR_NOMEM, "cannot allocate the chunk layout");
  // First pass: assign chunks and offsets, group by group in first-use order.
  int c = 0;
  int64_t off = 0;
  for (int o = 0; o < g->n_ops; o++) {
    int64_t n = group_elems(g, o);
    if (n == 0) continue;
    if (off + n > chunk_elems) {
      c++;
      off = 0;
    }
    const struct fy_op *op = &g->ops[o];
    for (int k = 0; k < op->n_params; k++) {
      struct fy_param *p = &g->params[op->params[k]];
      if (p->first_use != o || p->absent) continue;  // (absent: another pipeline stage's)
      p->chunk = c;
      p->chunk_offset = off;
      p->offset = (int64_t)c * chunk_elems + off;
      off += p->numel;
    }
    off = align_to(off, align);
  }
  l->chunk_elems = chunk_elems;
  l->n_chunks = c + 1;
  l->chunks = calloc((size_t)l->n_chunks, sizeof *l->chunks);
  l->op_first = calloc((size_t)g->n_ops + 1, sizeof *l->op_first);
  l->op_chunks = calloc((size_t)g->n_ops * FY_OP_MAX_PARAMS + 1, sizeof *l->op_chunks);
  if (!l->chunks || !l->op_first || !l->op_chunks) {
    fy_chunk_layout_free(l);
    return fy_error_set(FY_ERR_NOMEM, "cannot allocate the chunk layout");
  }
  for (int i = 0; i < l->n_chunks; i++)
    l->chunks[i] = (struct fy_chunk){.id = i, .first_use = -1, .last_use = -1, .state = FY_CHUNK_FREE, .block = -1};
  for (int i = 0; i < g->n_params; i++) {
    if (g->params[i].absent) continue;
    struct fy_chunk *ch = &l->chunks[g->params[i].chunk];
    int64_t end = g->params[i].chunk_offset + g->params[i].numel;
    if (end > ch->used) ch->used = end;
  }
  // The distinct chunks of each op, and each chunk's users.
  int n = 0;
  for (int o = 0; o < g->n_ops; o++) {
    l->op_first[o] = n;
    const struct fy_op *op = &g->ops[o];
    for (int k = 0; k < op->n_params; k++) {
      if (g->params[op->params[k]].absent) continue;
      int ch = g->params[op->params[k]].chunk;
      bool seen = false;
      for (int j = l->op_first[o]; j < n; j++) seen |= l->op_chunks[j] == ch;
      if (seen) continue;
      l->op_chunks[n++] = ch;
      struct fy_chunk *cc = &l->chunks[ch];
      if (cc->first_use < 0) cc->first_use = o;
      cc->last_use = o;
      cc->n_users_bwd++;
    }
  }
  l->op_first[g->n_ops] = n;
  g->chunk_elems = chunk_elems;
  g->n_param_elems = (int64_t)l->n_chunks * chunk_elems;
  *out = l;
  return FY_OK;
}

void fy_chunk_layout_keep_ops(struct fy_chunk_layout *l, int n_ops, int lo, int hi) {
  for (int i = 0; i < l->n_chunks; i++) {
    l->chunks[i].first_use = l->chunks[i].last_use = -1;
    l->chunks[i].n_users_bwd = 0;
  }
  int n = 0;
  for (int o = 0; o < n_ops; o++) {
    const int a = l->op_first[o], b = l->op_first[o + 1];
    l->op_first[o] = n;
    if (o < lo || o >= hi) continue;
    for (int k = a; k < b; k++) {  // (n <= a: moved down in place)
      struct fy_chunk *cc = &l->chunks[l->op_chunks[n++] = l->op_chunks[k]];
      if (cc->first_use < 0) cc->first_use = o;
      cc->last_use = o;
      cc->n_users_bwd++;
    }
  }
  l->op_first[n_ops] = n;
}

void fy_chunk_layout_free(struct fy_chunk_layout *l) {
  if (!l) return;
  free(l->chunks);
  free(l->op_first);
  free(l->op_chunks);
  free(l);
}

bool fy_chunk_transition_legal(enum fy_chunk_state from, enum fy_chunk_state to) {
  switch (from) {
    case FY_CHUNK_FREE: return to == FY_CHUNK_COMPUTE || to == FY_CHUNK_HOLD;  // HOLD: prefetched
    case FY_CHUNK_COMPUTE:
      return to == FY_CHUNK_HOLD || to == FY_CHUNK_HOLD_AFTER_BWD || to == FY_CHUNK_READY_FOR_REDUCE;
    case FY_CHUNK_HOLD: return to == FY_CHUNK_COMPUTE || to == FY_CHUNK_FREE;
    case FY_CHUNK_HOLD_AFTER_BWD: return to == FY_CHUNK_COMPUTE || to == FY_CHUNK_FREE;  // FREE: spilled
    case FY_CHUNK_READY_FOR_REDUCE: return to == FY_CHUNK_FREE;
  }
  return false;
}

const char *fy_chunk_state_name(enum fy_chunk_state s) {
  static const char *const names[] = {"free", "compute", "hold", "hold-after-backward", "ready-for-reduce"};
  return names[s];
}

void fy_chunk_set_state(struct fy_chunk *c, enum fy_chunk_state to) {
  if (!fy_chunk_transition_legal(c->state, to)) {
    fprintf(stderr, "ferry: internal error: chunk %d cannot go from %s to %s\n", c->id,
            fy_chunk_state_name(c->state), fy_chunk_state_name(to));
    abort();
  }
  c->state = to;
}

int fy_chunk_min_blocks(const struct fy_chunk_layout *l, int n_ops) {
  int need = 1;
  for (int o = 0; o < n_ops; o++)
    if (l->op_first[o + 1] - l->op_first[o] > need) need = l->op_first[o + 1] - l->op_first[o];
  return need;
}

int64_t fy_chunk_piece_elems(int64_t n) {
  const int64_t align = 256, piece = (n + FY_CHUNK_PIECES - 1) / FY_CHUNK_PIECES;
  return n <= 0 ? 0 : (piece + align - 1) / align * align;
}
