#include "core/graph.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/device.h"

#define FY_ALIGN_ELEMS 16  // 64 bytes

static int64_t align_up(int64_t x) { return (x + FY_ALIGN_ELEMS - 1) / FY_ALIGN_ELEMS * FY_ALIGN_ELEMS; }

// Grows *arr (of *cap elements of size sz) to hold n elements; returns false when out of memory.
static bool grow(void **arr, int *cap, int n, size_t sz) {
  if (n <= *cap) return true;
  int nc = *cap ? *cap * 2 : 64;
  while (nc < n) nc *= 2;
  void *p = realloc(*arr, (size_t)nc * sz);
  if (!p) return false;
  memset((char *)p + (size_t)*cap * sz, 0, (size_t)(nc - *cap) * sz);
  *arr = p;
  *cap = nc;
  return true;
}

struct graph_caps { int ops, params, slots; };

// The capacities live just after the public struct, so fy_graph stays a plain description.
struct graph_box {
  struct fy_graph g;
  struct graph_caps caps;
};

fy_status fy_graph_create(int64_t B, int64_t T, struct fy_graph **out) {
  struct graph_box *box = calloc(1, sizeof *box);
  if (!box) return fy_error_set(FY_ERR_NOMEM, "cannot allocate a graph");
  box->g.B = B;
  box->g.T = T;
  box->g.loss_slot = box->g.logits_slot = -1;
  box->g.tp = 1;
  box->g.ep = 1;
  *out = &box->g;
  return FY_OK;
}

void fy_graph_free(struct fy_graph *g) {
  if (!g) return;
  free(g->ops);
  free(g->params);
  free(g->slots);
  free((struct graph_box *)g);
}

int fy_graph_add_param(struct fy_graph *g, const char *name, int rank, const int64_t *shape,
                       bool decay) {
  struct graph_box *box = (struct graph_box *)g;
  if (!grow((void **)&g->params, &box->caps.params, g->n_params + 1, sizeof *g->params)) return -1;
  struct fy_param *p = &g->params[g->n_params];
  memset(p, 0, sizeof *p);
  snprintf(p->name, sizeof p->name, "%s", name);
  p->rank = rank;
  p->numel = 1;
  for (int i = 0; i < rank; i++) {
    p->shape[i] = shape[i];
    p->numel *= shape[i];
  }
  p->decay = decay;
  p->first_use = -1;
  p->offset = -1;
  p->padding_idx = -1;
  p->split_dim = -1;
  p->full_shape[0] = p->shape[0];
  p->full_shape[1] = p->shape[1];
  return g->n_params++;
}

int fy_graph_add_slot(struct fy_graph *g, int64_t numel) {
  struct graph_box *box = (struct graph_box *)g;
  if (!grow((void **)&g->slots, &box->caps.slots, g->n_slots + 1, sizeof *g->slots)) return -1;
  struct fy_slot *s = &g->slots[g->n_slots];
  memset(s, 0, sizeof *s);
  s->numel = numel;
  s->producer = -1;
  s->last_consumer = -1;
  s->grad_offset = -1;
  return g->n_slots++;
}

int fy_graph_add_op(struct fy_graph *g, const struct fy_op *op) {
  struct graph_box *box = (struct graph_box *)g;
  if (!grow((void **)&g->ops, &box->caps.ops, g->n_ops + 1, sizeof *g->ops)) return -1;
  g->ops[g->n_ops] = *op;
  if (op->out >= 0) g->slots[op->out].producer = g->n_ops;
  for (int i = 0; i < op->n_aux; i++) g->slots[op->aux[i]].producer = g->n_ops;
  return g->n_ops++;
}

// The first op of decoder layer l (n_ops when there is none).
static int layer_start(const struct fy_graph *g, int64_t l) {
  for (int o = 0; o < g->n_ops; o++)
    if (g->ops[o].layer == l) return o;
  return g->n_ops;
}

fy_status fy_graph_stage_ops(const struct fy_graph *g, int64_t layers, int pp, int stage, int *lo, int *hi) {
  if (pp < 1 || stage < 0 || stage >= pp || layers % pp != 0)
    return fy_error_set(FY_ERR_INVALID, "pipeline stage %d of %d over %lld decoder layers", stage, pp,
                        (long long)layers);
  const int64_t per = layers / pp;
  *lo = stage == 0 ? 0 : layer_start(g, stage * per);
  *hi = stage == pp - 1 ? g->n_ops : layer_start(g, (stage + 1) * per);
  return FY_OK;
}

void fy_graph_set_stage(struct fy_graph *g, int lo, int hi) {
  for (int i = 0; i < g->n_params; i++) g->params[i].absent = true;
  for (int o = lo; o < hi; o++)
    for (int k = 0; k < g->ops[o].n_params; k++) g->params[g->ops[o].params[k]].absent = false;
  for (int i = 0; i < g->n_params; i++)
    if (g->params[i].absent) g->params[i].offset = g->params[i].chunk_offset = -1, g->params[i].chunk = -1;
}

void fy_graph_ops_act_span(const struct fy_graph *g, int op_lo, int op_hi, int64_t *lo, int64_t *hi) {
  *lo = g->act_elems, *hi = 0;
  for (int o = op_lo; o < op_hi; o++) {
    const struct fy_op *op = &g->ops[o];
    int touched[FY_OP_MAX_IN + 1 + FY_OP_MAX_AUX], n = 0;
    for (int k = 0; k < op->n_in; k++) touched[n++] = op->in[k];
    touched[n++] = op->out;
    for (int k = 0; k < op->n_aux; k++) touched[n++] = op->aux[k];
    for (int k = 0; k < n; k++) {
      const int64_t a = g->slots[touched[k]].offset, b = a + fy_graph_slot_floats(g, touched[k]);
      if (a < *lo) *lo = a;
      if (b > *hi) *hi = b;
    }
  }
  if (*lo >= *hi) *lo = 0, *hi = 1;
}

fy_status fy_graph_set_experts(struct fy_graph *g, int ep, int ep_rank) {
  if (ep < 1 || ep_rank < 0 || ep_rank >= ep)
    return fy_error_set(FY_ERR_INVALID, "expert-parallel rank %d of %d", ep_rank, ep);
  for (int o = 0; o < g->n_ops; o++) {
    const struct fy_op *op = &g->ops[o];
    if (op->kind != FY_OP_MOE) continue;
    if (op->experts % ep != 0)
      return fy_error_set(FY_ERR_INVALID, "--ep %d does not divide the %d experts of %s: each rank of an "
                          "expert-parallel group holds experts/ep of them", ep, op->experts, op->name);
    for (int k = 1; k < op->n_params && ep > 1; k++) {  // (params[0]: the router, whole on every rank)
      struct fy_param *p = &g->params[op->params[k]];
      if (p->expert) continue;
      // (tp's slices keep their split and the whole full_shape: its rows are all the experts' already)
      if (!fy_param_split_tp(g, p)) {
        p->split_dim = 0;
        p->full_shape[0] = p->shape[0], p->full_shape[1] = p->shape[1];
      }
      p->expert = true;
      p->shape[0] /= ep;
      p->numel /= ep;
    }
  }
  g->ep = ep;
  g->ep_rank = ep_rank;
  return FY_OK;
}

int fy_graph_find_param(const struct fy_graph *g, const char *name) {
  for (int i = 0; i < g->n_params; i++)
    if (strcmp(g->params[i].name, name) == 0) return i;
  return -1;
}

// The op kinds' names: a new op kind is one line here, one in each backend's op table
// (runtime/engine.c, runtime/engine_cuda.c) and one in the planner's (planner/profile.c).
static const char *const op_kind_names[] = {
    [FY_OP_EMBEDDING] = "embedding",
    [FY_OP_LAYERNORM] = "layernorm",
    [FY_OP_LINEAR] = "linear",
    [FY_OP_ATTENTION] = "attention",
    [FY_OP_RELU] = "relu",
    [FY_OP_ADD] = "add",
    [FY_OP_CROSS_ENTROPY] = "cross_entropy",
    [FY_OP_GELU] = "gelu",
    [FY_OP_MOE] = "moe",
};
_Static_assert(sizeof op_kind_names / sizeof op_kind_names[0] == FY_OP_KIND_COUNT, "an op kind without a name");

const char *fy_op_kind_name(enum fy_op_kind k) {
  return k < FY_OP_KIND_COUNT && op_kind_names[k] ? op_kind_names[k] : "unknown";
}

// First-fit allocation of gradient slots over the backward walk.
struct live_block { int64_t off, len; int slot; };

static int64_t first_fit(struct live_block *live, int n, int64_t len) {
  // live[] is kept sorted by offset.
  int64_t at = 0;
  for (int i = 0; i < n; i++) {
    if (live[i].off - at >= len) return at;
    if (live[i].off + live[i].len > at) at = live[i].off + live[i].len;
  }
  return at;
}

static void live_insert(struct live_block *live, int *n, struct live_block b) {
  int i = *n;
  while (i > 0 && live[i - 1].off > b.off) { live[i] = live[i - 1]; i--; }
  live[i] = b;
  (*n)++;
}

// Whether no live gradient but slot's own overlaps slot's block.
static bool live_alone(const struct live_block *live, int n, int slot) {
  const struct live_block *b = NULL;
  for (int i = 0; i < n && !b; i++)
    if (live[i].slot == slot) b = &live[i];
  for (int i = 0; b && i < n; i++)
    if (live[i].slot != slot && live[i].off < b->off + b->len && b->off < live[i].off + live[i].len) return false;
  return true;
}

static void live_remove(struct live_block *live, int *n, int slot) {
  for (int i = 0; i < *n; i++)
    if (live[i].slot == slot) {
      memmove(&live[i], &live[i + 1], (size_t)(*n - i - 1) * sizeof *live);
      (*n)--;
      return;
    }
}

// Floats of the arenas a slot takes: its elements, or with 16-bit activations (act16) half of
// them, two values to a float, except the fp32 statistics (every op's aux slots: layernorm's mean
// and rstd, attention's probabilities or log-sum-exp) and the per-row losses.
// (An aux slot's producer is the op it is aux to: fy_graph_add_op. Asking that op alone, rather
// than scanning every op for every slot, took a 175B model's plan search from 4 s to 0.7 s.)
static bool slot_f32(const struct fy_graph *g, int s) {
  if (s == g->loss_slot) return true;
  const int p = g->slots[s].producer;
  if (p < 0 || p >= g->n_ops) return false;
  for (int a = 0; a < g->ops[p].n_aux; a++)
    if (g->ops[p].aux[a] == s) return true;
  return false;
}

int64_t fy_graph_slot_floats(const struct fy_graph *g, int s) {
  int64_t n = g->slots[s].numel;
  return align_up(g->act16 && !slot_f32(g, s) ? (n + 1) / 2 : n);
}

// Activation offsets. Without recomputation every slot is kept through the step. With it, the
// slots a decoder layer makes for itself (all but its output, which is the next layer's input)
// share one region: a layer's forward is run again just before its backward.
static void plan_activations(struct fy_graph *g, bool recompute) {
  int64_t off = 0;
  for (int s = 0; s < g->n_slots; s++) g->slots[s].offset = -1;
  if (recompute) {
    // The output of each layer is the output of its last op.
    int64_t region = 0;
    for (int o = 0; o < g->n_ops;) {
      int l = g->ops[o].layer, end = o;
      if (l < 0) { o++; continue; }
      while (end + 1 < g->n_ops && g->ops[end + 1].layer == l) end++;
      int64_t local = 0;
      for (int k = o; k <= end; k++) {
        const struct fy_op *op = &g->ops[k];
        int made[1 + FY_OP_MAX_AUX], n = 0;
        if (k != end) made[n++] = op->out;
        for (int a = 0; a < op->n_aux; a++) made[n++] = op->aux[a];
        for (int j = 0; j < n; j++) {
          g->slots[made[j]].offset = -2 - local;  // region-relative, resolved below
          local += fy_graph_slot_floats(g, made[j]);
        }
      }
      if (local > region) region = local;
      o = end + 1;
    }
    for (int s = 0; s < g->n_slots; s++)
      if (g->slots[s].offset <= -2) g->slots[s].offset = -2 - g->slots[s].offset;
    off = region;
    for (int s = 0; s < g->n_slots; s++)
      if (g->slots[s].offset < 0) {
        g->slots[s].offset = off;
        off += fy_graph_slot_floats(g, s);
      }
  } else {
    for (int s = 0; s < g->n_slots; s++) {
      g->slots[s].offset = off;
      off += fy_graph_slot_floats(g, s);
    }
  }
  g->act_elems = off;
  g->recompute = recompute;
}

void fy_graph_set_recompute(struct fy_graph *g, bool on) { plan_activations(g, on); }

// Attention's aux slot and the backward scratch: the T x T probabilities of every head (the CPU
// kernels), or one float per query and head (flash-style kernels: the log-sum-exp).
static void size_attention(struct fy_graph *g, bool flash) {
  g->scratch_elems = 0;
  for (int o = 0; o < g->n_ops; o++) {
    struct fy_op *op = &g->ops[o];
    if (op->kind != FY_OP_ATTENTION) continue;
    int64_t need = g->B * op->NH * g->T * (flash ? 1 : g->T);
    if (op->n_aux > 0) g->slots[op->aux[0]].numel = need;
    if (need > g->scratch_elems && !g->forward_only) g->scratch_elems = need;
  }
  g->flash_attention = flash;
}

void fy_graph_set_flash_attention(struct fy_graph *g, bool on) {
  size_attention(g, on);
  plan_activations(g, g->recompute);
}


// Whether op j reads slot s.
static bool reads(const struct fy_op *op, int s) {
  for (int k = 0; k < op->n_in; k++)
    if (op->in[k] == s) return true;
  return false;
}

// Whether the gradients of add o's inputs a and b can both be its output's buffer. Backward then
// hands that buffer first to the producer of one (which reads it), while the other's other
// consumers add into it: so b must have no consumer but the add, and every other consumer of a
// must come before b's producer (in backward, after it) — or the same with a and b swapped. The
// residual stream of OPT is so: a (the stream) feeds a layer norm (pre-LN) or the projections
// (post-LN) before the branch b is made, and b feeds the add alone.
static bool share_both(const struct fy_graph *g, int o, int a, int b) {
  for (int swap = 0; swap < 2; swap++) {
    const int x = swap ? b : a, y = swap ? a : b, py = g->slots[y].producer;
    bool ok = py >= 0;
    for (int j = 0; j < o && ok; j++)
      ok = !reads(&g->ops[j], y) && (!reads(&g->ops[j], x) || j < py);
    if (ok) return true;
  }
  return false;
}

// Whether input k of op o can take its output's gradient buffer over: its gradient starts at o
// (o is its last consumer), it has one to start (a producer, not the logits'), and it spans the
// output's floats. The output's gradient is dead after o's backward.
static bool can_share(const struct fy_graph *g, const struct fy_op *op, int o, int k) {
  const struct fy_slot *s = &g->slots[op->in[k]];
  return s->last_consumer == o && !s->grad_in_place && s->producer >= 0 &&
         fy_graph_slot_floats(g, op->in[k]) == fy_graph_slot_floats(g, op->out);
}

// A plain add's backward gives each input its output's gradient unchanged, so an input that can
// share (can_share) holds it with nothing written; the branch (input 1) only when the add drops
// nothing from it. Both at once only when share_both allows, else the residual (input 0) alone.
// A relu's or gelu's backward scales its output's gradient element by element, so it can write
// its input's over it (the kernels' in-place form): the fc1 output's gradient, a (BT, 4C) buffer,
// needs none of its own. Only when live_alone: no other live gradient is in that buffer (as an
// add's other input is when it shares both), for the write would change that one too.
// Sets op->grad_shared; live: the gradients live before o's backward.
static void plan_shared(const struct fy_graph *g, struct fy_op *op, int o, const struct live_block *live,
                        int n_live) {
  op->grad_shared[0] = op->grad_shared[1] = false;
  if (op->out < 0 || g->slots[op->out].grad_offset < 0) return;
  if ((op->kind == FY_OP_RELU || op->kind == FY_OP_GELU) && op->n_in == 1) {
    op->grad_shared[0] = can_share(g, op, o, 0) && live_alone(live, n_live, op->out);
    return;
  }
  if (op->kind != FY_OP_ADD || op->n_in != 2 || op->in[0] == op->in[1]) return;
  bool can[2];
  for (int k = 0; k < 2; k++) can[k] = can_share(g, op, o, k) && (k == 0 || !(op->dropout > 0));
  if (can[0] && can[1] && !share_both(g, o, op->in[0], op->in[1])) can[1] = false;
  op->grad_shared[0] = can[0];
  op->grad_shared[1] = can[1];
}

// Activation gradients: a slot's gradient is live from its last consumer's backward (where it
// is zeroed, then accumulated into) to its producer's backward (its last reader); an add's input
// that shares its output's gradient (plan_shared) takes the buffer over, with nothing zeroed.
static fy_status plan_gradients(struct fy_graph *g) {
  for (int s = 0; s < g->n_slots; s++) g->slots[s].grad_offset = -1;
  if (g->forward_only) {  // no backward: no gradients
    for (int o = 0; o < g->n_ops; o++) {
      g->ops[o].n_zero = 0;
      g->ops[o].grad_shared[0] = g->ops[o].grad_shared[1] = false;
    }
    g->grad_elems = 0;
    return FY_OK;
  }
  struct live_block *live = calloc((size_t)g->n_slots + 1, sizeof *live);
  if (!live) return fy_error_set(FY_ERR_NOMEM, "cannot plan the gradient arena");
  int n_live = 0;
  int64_t top = 0;
  for (int o = g->n_ops - 1; o >= 0; o--) {
    struct fy_op *op = &g->ops[o];
    op->n_zero = 0;
    plan_shared(g, op, o, live, n_live);
    for (int k = 0; k < op->n_in; k++) {
      struct fy_slot *s = &g->slots[op->in[k]];
      if (s->last_consumer != o || s->grad_in_place || s->producer < 0) continue;
      if (op->grad_shared[k]) {  // the output's buffer, live now until this input's producer
        s->grad_offset = g->slots[op->out].grad_offset;
        live_insert(live, &n_live, (struct live_block){s->grad_offset, fy_graph_slot_floats(g, op->in[k]), op->in[k]});
        continue;
      }
      bool seen = false;  // the same slot twice in one op (x + x)
      for (int j = 0; j < op->n_zero; j++) seen |= op->zero[j] == op->in[k];
      if (seen) continue;
      int64_t len = fy_graph_slot_floats(g, op->in[k]);
      s->grad_offset = first_fit(live, n_live, len);
      live_insert(live, &n_live, (struct live_block){s->grad_offset, len, op->in[k]});
      if (s->grad_offset + len > top) top = s->grad_offset + len;
      op->zero[op->n_zero++] = op->in[k];
    }
    if (op->out >= 0 && g->slots[op->out].grad_offset >= 0) live_remove(live, &n_live, op->out);
  }
  free(live);
  g->grad_elems = top;
  return FY_OK;
}

void fy_graph_set_forward_only(struct fy_graph *g) {
  g->forward_only = true;
  size_attention(g, g->flash_attention);
  plan_activations(g, true);
  (void)plan_gradients(g);  // (forward-only: clears them, allocating nothing)
}

fy_status fy_graph_set_act16(struct fy_graph *g, bool on) {
  g->act16 = on;
  plan_activations(g, g->recompute);
  return plan_gradients(g);
}

fy_status fy_graph_finalize(struct fy_graph *g) {
  // Parameters in first-use order; an op's own list stays contiguous (fused weights).
  int64_t off = 0;
  for (int o = 0; o < g->n_ops; o++) {
    struct fy_op *op = &g->ops[o];
    bool group_started = false;
    for (int k = 0; k < op->n_params; k++) {
      struct fy_param *p = &g->params[op->params[k]];
      if (p->first_use >= 0) continue;
      p->first_use = o;
      if (!group_started) off = align_up(off);
      group_started = true;
      p->offset = p->chunk_offset = off;
      p->chunk = 0;
      off += p->numel;
    }
  }
  for (int o = 0; o < g->n_ops; o++)
    for (int k = 0; k < g->ops[o].n_params; k++) g->params[g->ops[o].params[k]].last_use = o;
  for (int i = 0; i < g->n_params; i++)
    if (g->params[i].first_use < 0)
      return fy_error_set(FY_ERR_INTERNAL, "parameter %s is used by no operator", g->params[i].name);
  g->n_param_elems = g->chunk_elems = align_up(off);

  plan_activations(g, false);
  for (int s = 0; s < g->n_slots; s++) g->slots[s].last_consumer = -1;
  for (int o = 0; o < g->n_ops; o++)
    for (int k = 0; k < g->ops[o].n_in; k++) g->slots[g->ops[o].in[k]].last_consumer = o;
  FY_TRY(plan_gradients(g));
  size_attention(g, false);
  return FY_OK;
}

int fy_graph_layer_first_op(const struct fy_graph *g, int o) {
  int l = g->ops[o].layer;
  if (l < 0 || (o + 1 < g->n_ops && g->ops[o + 1].layer == l)) return -1;
  while (o > 0 && g->ops[o - 1].layer == l) o--;
  return o;
}

int fy_graph_max_actions(const struct fy_graph *g) { return 3 * g->n_ops; }

int64_t fy_graph_max_channels(const struct fy_graph *g) {
  int64_t C = 1;
  for (int o = 0; o < g->n_ops; o++)
    if (g->ops[o].C > C) C = g->ops[o].C;
  return C;
}

int fy_graph_pass_actions(const struct fy_graph *g, struct fy_action *out) {
  int n = 0;
  for (int o = 0; o < g->n_ops; o++) out[n++] = (struct fy_action){o, FY_ACT_FORWARD};
  for (int o = g->n_ops - 1; o >= 0; o--) {
    int first = g->recompute ? fy_graph_layer_first_op(g, o) : -1;
    for (int r = first; r >= 0 && r <= o; r++) out[n++] = (struct fy_action){r, FY_ACT_RECOMPUTE};
    out[n++] = (struct fy_action){o, FY_ACT_BACKWARD};
  }
  return n;
}

// Slots a and b share no memory in the activation arena.
static bool slots_apart(const struct fy_graph *g, int a, int b) {
  const int64_t oa = g->slots[a].offset, ob = g->slots[b].offset;
  return oa + fy_graph_slot_floats(g, a) <= ob || ob + fy_graph_slot_floats(g, b) <= oa;
}

enum fy_fusion fy_graph_fusion(const struct fy_graph *g, int o) {
  if (o < 0 || o + 1 >= g->n_ops) return FY_FUSED_NONE;
  const struct fy_op *lin = &g->ops[o], *next = &g->ops[o + 1];
  if (lin->kind != FY_OP_LINEAR || lin->pattern[0] || g->slots[lin->out].last_consumer != o + 1) return FY_FUSED_NONE;
  if (!slots_apart(g, next->out, lin->in[0])) return FY_FUSED_NONE;
  if (next->kind == FY_OP_RELU && next->in[0] == lin->out) return FY_FUSED_RELU;
  if (next->kind == FY_OP_ADD && next->n_in == 2 && next->dropout == 0 &&
      (next->in[0] == lin->out) != (next->in[1] == lin->out)) {
    const int r = next->in[next->in[0] == lin->out];
    if (g->slots[next->out].offset == g->slots[r].offset || slots_apart(g, next->out, r)) return FY_FUSED_ADD;
  }
  return FY_FUSED_NONE;
}

int fy_graph_offload_buffers(const struct fy_graph *g, int64_t hidden, bool gpu, size_t bytes[FY_GRAPH_OFFLOAD_BUFS]) {
  const size_t bt = (size_t)(g->B * g->T);
  int n = 0;
  bytes[n++] = (size_t)(g->act_elems > 0 ? g->act_elems : 1) * 4;
  bytes[n++] = (size_t)(g->grad_elems > 0 ? g->grad_elems : 1) * 4;
  bytes[n++] = (size_t)(g->scratch_elems > 0 ? g->scratch_elems : 1) * 4;
  if (g->tp > 1) bytes[n++] = (size_t)fy_graph_tp_buf_elems(g, hidden) * 4;
  if (gpu) bytes[n++] = 3 * bt * 4;
  bytes[n++] = bt * 4;
  bytes[n++] = 4 * bt * 4;
  bytes[n++] = 4 * bt * 4;
  return n;
}

double fy_graph_model_bytes(const struct fy_graph *g, int64_t hidden, bool train, bool bf16, bool accumulate,
                            size_t granule) {
  const int64_t np = g->n_param_elems, bt = g->B * g->T;
  const struct { bool on; int64_t elems; size_t esize; } bufs[] = {
      {train || !bf16, np, 4},  // params (evaluating in bf16: cparams alone)
      {train, np, 4}, {train, np, 4}, {train, np, 4},  // grads, m, v
      {train && accumulate, np, 4},  // grad_acc
      {bf16, np, 2}, {bf16 && train, np, 2},  // cparams, cgrads
      {true, g->act_elems, 4}, {true, g->grad_elems, 4}, {true, g->scratch_elems, 4},
      {true, bt, 4}, {true, 3 * bt, 4},  // positions, dbatch
      {g->tp > 1, fy_graph_tp_buf_elems(g, hidden), 4}};
  double total = 0;
  for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++)
    if (bufs[i].on) total += (double)fy_device_round((size_t)(bufs[i].elems > 0 ? bufs[i].elems : 1) * bufs[i].esize, granule);
  return total;
}
