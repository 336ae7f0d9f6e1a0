// The OPT graph builder and the graph's layout: parameter counts, first-use order, fused QKV
// adjacency, that no two activation gradients that are live at once share memory, the
// flash-attention layout of the GPU kernels, and which ops a backend with epilogues may fuse.
#include <string.h>

#include "check.h"
#include "core/graph.h"
#include "core/opt.h"
#include "planner/profile.h"
#include "runtime/engine.h"

// Floats of the arenas slot s spans: its elements, or with 16-bit activations half of them,
// except the fp32 statistics (ops' aux slots) and the per-row losses.
static int64_t extent(const struct fy_graph *g, int s) {
  bool f32 = s == g->loss_slot;
  for (int o = 0; o < g->n_ops; o++)
    for (int a = 0; a < g->ops[o].n_aux; a++) f32 |= g->ops[o].aux[a] == s;
  int64_t n = g->slots[s].numel;
  return g->act16 && !f32 ? (n + 1) / 2 : n;
}

// Simulates the backward walk and checks the gradient arena's liveness plan. An op's input that
// shares its output's gradient (grad_shared) becomes live there in the same buffer: slots of one
// such group may overlap (at the same offset), no others; and a relu or gelu, which writes the
// buffer, shares it only when its output is the one live gradient there.
static void check_grad_plan(const struct fy_graph *g, const char *name) {
  int n = g->n_slots;
  char *live = calloc((size_t)n, 1);
  int *group = malloc((size_t)n * sizeof *group);
  for (int s = 0; s < n; s++) group[s] = s;
  int bad = 0;
  for (int o = g->n_ops - 1; o >= 0; o--) {
    const struct fy_op *op = &g->ops[o];
    for (int k = 0; k < op->n_zero; k++) live[op->zero[k]] = 1;
    for (int k = 0; k < op->n_in; k++)
      if (op->grad_shared[k]) {
        // A relu or gelu writes the shared buffer: no other live gradient may be in it.
        for (int s = 0; s < n && !fy_op_grad_handed_down(op, k); s++)
          if (s != op->out && live[s] && g->slots[s].grad_offset == g->slots[op->out].grad_offset) bad++;
        live[op->in[k]] = 1;
        group[op->in[k]] = group[op->out];
        if ((op->kind != FY_OP_ADD && op->kind != FY_OP_RELU && op->kind != FY_OP_GELU) ||
            g->slots[op->in[k]].grad_offset != g->slots[op->out].grad_offset)
          bad++;
      }
    // Every input's gradient that is written here must be live.
    for (int k = 0; k < op->n_in; k++) {
      const struct fy_slot *s = &g->slots[op->in[k]];
      if (s->grad_offset >= 0 && !live[op->in[k]]) bad++;
    }
    if (op->out >= 0 && g->slots[op->out].grad_offset >= 0 && !live[op->out]) bad++;
    // No two live gradients overlap.
    for (int a = 0; a < n; a++) {
      if (!live[a]) continue;
      for (int b = a + 1; b < n; b++) {
        if (!live[b]) continue;
        const struct fy_slot *x = &g->slots[a], *y = &g->slots[b];
        if (group[a] == group[b] && x->grad_offset == y->grad_offset) continue;
        if (x->grad_offset < y->grad_offset + extent(g, b) && y->grad_offset < x->grad_offset + extent(g, a)) bad++;
      }
    }
    if (op->out >= 0) live[op->out] = 0;
  }
  CHECKF(bad == 0, "%s: %d liveness violations", name, bad);
  free(live);
  free(group);
}

static void check_model(const char *preset, int64_t B, int64_t T) {
  struct fy_opt_config c;
  CHECK_OK(fy_opt_preset(preset, &c));
  struct fy_graph *g;
  fy_status st = fy_opt_build_graph(&c, B, T, &g);
  CHECK_OK(st);
  if (st != FY_OK) return;
  int64_t total = 0;
  for (int i = 0; i < g->n_params; i++) total += g->params[i].numel;
  CHECKF(total == fy_opt_num_params(&c), "%s: graph has %lld parameters, formula %lld", preset,
         (long long)total, (long long)fy_opt_num_params(&c));
  // Offsets follow first use, do not overlap, fit in the flat buffer.
  int64_t prev_end = 0;
  int prev_first = -1, disorder = 0, overlap = 0;
  for (int o = 0; o < g->n_ops; o++)
    for (int k = 0; k < g->ops[o].n_params; k++) {
      const struct fy_param *p = &g->params[g->ops[o].params[k]];
      if (p->first_use != o) continue;
      if (p->offset < prev_end) overlap++;
      if (p->first_use < prev_first) disorder++;
      prev_end = p->offset + p->numel;
      prev_first = p->first_use;
    }
  CHECK(overlap == 0 && disorder == 0);
  CHECK(prev_end <= g->n_param_elems);
  // The fused QKV of each layer: weights q, k, v adjacent, then the three biases adjacent.
  for (int o = 0; o < g->n_ops; o++) {
    const struct fy_op *op = &g->ops[o];
    if (op->kind != FY_OP_LINEAR || op->n_params < 3) continue;
    int n_w = op->has_bias ? op->n_params / 2 : op->n_params;
    for (int k = 1; k < n_w; k++)
      CHECK(g->params[op->params[k]].offset ==
            g->params[op->params[k - 1]].offset + g->params[op->params[k - 1]].numel);
    for (int k = n_w + 1; k < op->n_params; k++)
      CHECK(g->params[op->params[k]].offset ==
            g->params[op->params[k - 1]].offset + g->params[op->params[k - 1]].numel);
    CHECK(op->OC == 3 * op->C);
  }
  // HF names.
  CHECK(fy_graph_find_param(g, "model.decoder.embed_tokens.weight") >= 0);
  CHECK(fy_graph_find_param(g, "model.decoder.layers.0.self_attn.k_proj.bias") >= 0);
  CHECK(fy_graph_find_param(g, "model.decoder.layers.0.fc2.weight") >= 0);
  bool proj = c.word_embed_proj_dim != c.hidden_size;
  CHECK((fy_graph_find_param(g, "model.decoder.project_in.weight") >= 0) == proj);
  CHECK((fy_graph_find_param(g, "model.decoder.final_layer_norm.weight") >= 0) == c.do_layer_norm_before);
  CHECK(g->ops[g->n_ops - 1].kind == FY_OP_CROSS_ENTROPY);
  // Activation gradients are reused: far less than one per activation for deep models.
  if (c.num_hidden_layers >= 12)
    CHECKF(g->grad_elems * 4 < g->act_elems, "%s: gradient arena %lld vs activations %lld", preset,
           (long long)g->grad_elems, (long long)g->act_elems);
  check_grad_plan(g, preset);
  // Every activation that is read and has a producer has a gradient (or takes it in place).
  int missing = 0;
  for (int s = 0; s < g->n_slots; s++) {
    const struct fy_slot *sl = &g->slots[s];
    if (sl->producer >= 0 && sl->last_consumer >= 0 && !sl->grad_in_place && sl->grad_offset < 0) missing++;
  }
  CHECKF(missing == 0, "%s: %d activations without a gradient slot", preset, missing);
  // Recomputation: a layer's own activations share one region, layer inputs are kept apart.
  int64_t full = g->act_elems;
  fy_graph_set_recompute(g, true);
  if (c.num_hidden_layers >= 12) CHECKF(g->act_elems * 2 < full, "%s: %lld vs %lld", preset, (long long)g->act_elems, (long long)full);
  int clash = 0;
  for (int a = 0; a < g->n_slots && g->n_slots < 1000; a++)  // quadratic: the smaller models
    for (int b = a + 1; b < g->n_slots; b++) {
      const struct fy_slot *x = &g->slots[a], *y = &g->slots[b];
      bool overlap = x->offset < y->offset + y->numel && y->offset < x->offset + x->numel;
      int la = x->producer >= 0 ? g->ops[x->producer].layer : -1, lb = y->producer >= 0 ? g->ops[y->producer].layer : -1;
      // Overlap is allowed only between slots made inside two different layers.
      if (overlap && !(la >= 0 && lb >= 0 && la != lb)) clash++;
    }
  CHECKF(clash == 0, "%s: %d overlapping activations with recomputation", preset, clash);
  fy_graph_free(g);
}

// Every slot inside the activation arena, and no two slots sharing memory (without recomputation).
static int arena_faults(const struct fy_graph *g) {
  int bad = 0;
  for (int a = 0; a < g->n_slots; a++) {
    const struct fy_slot *x = &g->slots[a];
    bad += x->offset < 0 || x->offset + extent(g, a) > g->act_elems || x->offset % 16 != 0;
    for (int b = a + 1; b < g->n_slots && !g->recompute; b++) {
      const struct fy_slot *y = &g->slots[b];
      bad += x->offset < y->offset + extent(g, b) && y->offset < x->offset + extent(g, a);
    }
  }
  return bad;
}

// Flash-style attention (the cuda kernels): the aux slot and the scratch hold B x NH x T floats
// instead of B x NH x T x T, the arena shrinks by the difference and stays consistent, with and
// without recomputation, and switching back restores the CPU layout.
static void check_flash(void) {
  struct fy_opt_config c;
  CHECK_OK(fy_opt_preset("opt-125m", &c));
  const int64_t B = 3, T = 100;
  struct fy_graph *g;
  CHECK_OK(fy_opt_build_graph(&c, B, T, &g));
  const int64_t plain = g->act_elems, NH = c.num_attention_heads;
  CHECK(g->scratch_elems == B * NH * T * T && !g->flash_attention);
  fy_graph_set_flash_attention(g, true);
  int n_att = 0, wrong = 0;
  for (int o = 0; o < g->n_ops; o++)
    if (g->ops[o].kind == FY_OP_ATTENTION) {
      n_att++;
      wrong += g->slots[g->ops[o].aux[0]].numel != B * NH * T;
    }
  CHECKF(n_att == c.num_hidden_layers && wrong == 0, "flash: %d of %d attention aux slots mis-sized", wrong, n_att);
  CHECK(g->scratch_elems == B * NH * T && g->flash_attention);
  CHECKF(g->act_elems < plain - n_att * B * NH * (T * T - T) + 16 * (int64_t)g->n_slots,
         "flash: the arena is %lld floats, %lld without", (long long)g->act_elems, (long long)plain);
  CHECKF(arena_faults(g) == 0, "flash: slots outside the arena or overlapping");
  fy_graph_set_recompute(g, true);
  CHECKF(arena_faults(g) == 0 && g->flash_attention, "flash with recomputation: slots outside the arena");
  fy_graph_set_recompute(g, false);
  fy_graph_set_flash_attention(g, false);
  CHECK(g->act_elems == plain && g->scratch_elems == B * NH * T * T);
  fy_graph_free(g);
}

// Forward passes alone (evaluation): the recomputation layout (a layer's own activations share
// one region), no gradient arena, no backward scratch, no slot with a gradient; and it stays so
// when flash attention or 16-bit activations plan the arenas again.
static void check_forward_only(void) {
  struct fy_opt_config c;
  CHECK_OK(fy_opt_preset("opt-125m", &c));
  struct fy_graph *g, *rc;
  CHECK_OK(fy_opt_build_graph(&c, 2, 128, &g));
  CHECK_OK(fy_opt_build_graph(&c, 2, 128, &rc));
  if (!g || !rc) return;
  const int64_t kept = g->act_elems;
  fy_graph_set_recompute(rc, true);
  fy_graph_set_forward_only(g);
  int with_grad = 0, zeroing = 0;
  for (int s = 0; s < g->n_slots; s++) with_grad += g->slots[s].grad_offset >= 0;
  for (int o = 0; o < g->n_ops; o++) zeroing += g->ops[o].n_zero;
  CHECKF(g->forward_only && g->act_elems == rc->act_elems && g->act_elems < kept / 2 && g->grad_elems == 0 &&
             g->scratch_elems == 0 && with_grad == 0 && zeroing == 0 && arena_faults(g) == 0,
         "forward-only: arena %lld floats (recompute %lld, all kept %lld), gradients %lld, scratch %lld, %d slots "
         "with gradients", (long long)g->act_elems, (long long)rc->act_elems, (long long)kept, (long long)g->grad_elems,
         (long long)g->scratch_elems, with_grad);
  fy_graph_set_flash_attention(g, true);
  CHECK_OK(fy_graph_set_act16(g, true));
  CHECK(g->grad_elems == 0 && g->scratch_elems == 0 && arena_faults(g) == 0);
  fy_graph_free(g);
  fy_graph_free(rc);
}

// 16-bit activations (a GPU's bf16): the arenas shrink to about half, every slot but the fp32
// statistics and losses spans half its elements, nothing overlaps (with and without
// recomputation, and in the gradient arena), and switching back restores the layout.
static void check_act16(void) {
  struct fy_opt_config c;
  CHECK_OK(fy_opt_preset("opt-125m", &c));
  struct fy_graph *g;
  CHECK_OK(fy_opt_build_graph(&c, 3, 100, &g));
  fy_graph_set_flash_attention(g, true);
  const int64_t acts = g->act_elems, grads = g->grad_elems;
  int64_t stats = 0;
  for (int o = 0; o < g->n_ops; o++)
    for (int a = 0; a < g->ops[o].n_aux; a++) stats += g->slots[g->ops[o].aux[a]].numel;
  stats += g->slots[g->loss_slot].numel;
  CHECK_OK(fy_graph_set_act16(g, true));
  CHECKF(g->act16 && g->act_elems <= (acts - stats) / 2 + stats + 16 * (int64_t)g->n_slots && g->act_elems < acts,
         "act16: activation arena %lld floats, %lld in fp32 (%lld of statistics)", (long long)g->act_elems,
         (long long)acts, (long long)stats);
  CHECKF(g->grad_elems <= grads / 2 + 16 * (int64_t)g->n_slots, "act16: gradient arena %lld floats, %lld in fp32",
         (long long)g->grad_elems, (long long)grads);
  CHECKF(arena_faults(g) == 0, "act16: slots outside the arena, unaligned or overlapping");
  check_grad_plan(g, "act16");
  CHECK(extent(g, g->loss_slot) == g->slots[g->loss_slot].numel);
  fy_graph_set_recompute(g, true);
  CHECKF(arena_faults(g) == 0, "act16 with recomputation: slots outside the arena");
  fy_graph_set_recompute(g, false);
  CHECK_OK(fy_graph_set_act16(g, false));
  CHECK(g->act_elems == acts && g->grad_elems == grads && !g->act16);
  check_grad_plan(g, "act16 off again");
  fy_graph_free(g);
}

// In every layer of the OPT graphs the cuda engine runs (flash attention; 16-bit or fp32
// activations; with or without recomputation; pre- or post-LN), fc1 takes its relu and out_proj
// and fc2 take their residual adds, and nothing else is fused: if the arena plan ever put two of
// those slots on the same memory, the fusion would be dropped (correct, slower) and this fails.
// With gelu (Galactica's activation) the layers have a gelu op, which no epilogue takes. With
// dropout the residual adds drop their branch (each layer's two with their own sites, 2l and
// 2l + 1) and no epilogue takes them either.
static void check_fusions(void) {
  struct fy_opt_config c;
  fy_opt_preset("opt-tiny", &c);
  c.num_hidden_layers = 3;
  for (int v = 0; v < 32; v++) {
    c.do_layer_norm_before = !(v & 4);
    c.activation = v & 8 ? FY_ACT_GELU : FY_ACT_RELU;
    c.train_dropout = v & 16 ? 0.1f : 0.0f;
    struct fy_graph *g = NULL;
    CHECK_OK(fy_opt_build_graph(&c, 2, 24, &g));
    if (!g) continue;
    fy_graph_set_flash_attention(g, true);
    fy_graph_set_recompute(g, v & 1);
    if (v & 2) CHECK_OK(fy_graph_set_act16(g, true));
    int relu = 0, add = 0, wrong = 0, gelu = 0;
    for (int o = 0; o < g->n_ops; o++) {
      gelu += g->ops[o].kind == FY_OP_GELU && strstr(g->ops[o].name, ".gelu");
      enum fy_fusion f = fy_graph_fusion(g, o);
      const char *next = o + 1 < g->n_ops ? g->ops[o + 1].name : "";
      if (f == FY_FUSED_RELU) relu++, wrong += !strstr(g->ops[o].name, "fc1") || !strstr(next, "relu");
      if (f == FY_FUSED_ADD)
        add++, wrong += !(strstr(g->ops[o].name, "out_proj") && strstr(next, "attn_residual")) &&
                        !(strstr(g->ops[o].name, "fc2") && strstr(next, "ffn_residual"));
    }
    const bool gl = v & 8, dr = v & 16;
    int dropping = 0, sites = 0;
    for (int o = 0; o < g->n_ops; o++) {
      const struct fy_op *op = &g->ops[o];
      if (op->dropout == 0) continue;
      dropping++;
      wrong += op->kind != FY_OP_ADD || op->dropout != 0.1f || op->C != c.hidden_size ||
               op->site != 2 * op->layer + (strstr(op->name, "ffn_residual") != NULL);
      sites |= 1 << op->site;
    }
    CHECKF(relu == (gl ? 0 : 3) && gelu == (gl ? 3 : 0) && add == (dr ? 0 : 6) && wrong == 0 &&
           dropping == (dr ? 6 : 0) && sites == (dr ? 63 : 0),
           "fusions (%s, %s, %s, %s, %s): %d relu, %d gelu ops, %d add, %d misplaced, %d dropping adds",
           v & 4 ? "post-LN" : "pre-LN", v & 2 ? "act16" : "fp32", v & 1 ? "recompute" : "kept", gl ? "gelu" : "relu",
           dr ? "dropout" : "no dropout", relu, gelu, add, wrong, dropping);
    fy_graph_free(g);
  }
}

// Which adds hand their output's gradient buffer to their inputs (fy_op.grad_shared): every
// residual add of OPT, pre- and post-LN, and the embeddings' sum, both inputs; with dropout on the
// branch, the residual alone. Every layer's activation hands its own to fc1's output. In small
// graphs: not the branch when it feeds another op too, or when the residual feeds the branch's
// producer or an op after it (the shared buffer would be read and added to at once).
static void check_shared_grads(void) {
  for (int post = 0; post < 3; post++) {
    struct fy_opt_config c;
    CHECK_OK(fy_opt_preset(post == 1 ? "opt-350m" : "opt-tiny", &c));
    if (post == 2) c.train_dropout = 0.1f;
    struct fy_graph *g;
    CHECK_OK(fy_opt_build_graph(&c, 2, 8, &g));
    if (!g) continue;
    int adds = 0, both = 0, residual_only = 0, activations = 0;
    for (int o = 0; o < g->n_ops; o++) {
      const struct fy_op *op = &g->ops[o];
      if (op->kind == FY_OP_RELU || op->kind == FY_OP_GELU) {  // fc1's output: the activation's alone
        CHECK(op->grad_shared[0] && !op->grad_shared[1]);
        activations++;
        continue;
      }
      if (op->kind != FY_OP_ADD) {
        CHECK(!op->grad_shared[0] && !op->grad_shared[1]);
        continue;
      }
      adds++;
      both += op->grad_shared[0] && op->grad_shared[1];
      residual_only += op->grad_shared[0] && !op->grad_shared[1];
    }
    const int L = (int)c.num_hidden_layers;
    CHECKF(adds == 2 * L + 1 && both == (post == 2 ? 1 : adds) && residual_only == (post == 2 ? 2 * L : 0) &&
               activations == L,
           "%s%s: %d adds, %d share both inputs, %d the residual alone; %d activations", c.name,
           post == 2 ? " with dropout" : "", adds, both, residual_only, activations);
    check_grad_plan(g, "shared");
    fy_graph_free(g);
  }
  // x (no producer) -relu-> a -relu-> b, and the cases around add(a, b).
  enum { BRANCH_TWICE, A_FEEDS_PRODUCER, A_AFTER_PRODUCER, BOTH_OK };
  for (int v = BRANCH_TWICE; v <= BOTH_OK; v++) {
    struct fy_graph *g;
    CHECK_OK(fy_graph_create(1, 4, &g));
    if (!g) continue;
    const int64_t N = 16;
    int x = fy_graph_add_slot(g, N), a = fy_graph_add_slot(g, N), t = fy_graph_add_slot(g, N);
    int b = fy_graph_add_slot(g, N), u = fy_graph_add_slot(g, N), sum = fy_graph_add_slot(g, N);
    int y = fy_graph_add_slot(g, N);
    struct fy_op op = {.kind = FY_OP_RELU, .n_in = 1, .in = {x}, .out = a};
    fy_graph_add_op(g, &op);                                                   // 0: a = relu(x)
    op.in[0] = v == A_FEEDS_PRODUCER ? a : (op.out = t, a);                    // 1: t = relu(a), or b's producer
    if (v == A_FEEDS_PRODUCER) op.out = b;
    fy_graph_add_op(g, &op);
    if (v != A_FEEDS_PRODUCER) {
      op.in[0] = t, op.out = b;                                                // 2: b = relu(t)
      fy_graph_add_op(g, &op);
    }
    if (v == BRANCH_TWICE || v == A_AFTER_PRODUCER) {
      op.in[0] = v == BRANCH_TWICE ? b : a, op.out = u;                        // u = relu(b) or relu(a)
      fy_graph_add_op(g, &op);
    }
    struct fy_op add = {.kind = FY_OP_ADD, .n_in = 2, .in = {a, b}, .out = sum, .C = N};
    fy_graph_add_op(g, &add);
    op.in[0] = sum, op.out = y;
    fy_graph_add_op(g, &op);
    CHECK_OK(fy_graph_finalize(g));
    const struct fy_op *ad = NULL;
    for (int o = 0; o < g->n_ops; o++)
      if (g->ops[o].kind == FY_OP_ADD) ad = &g->ops[o];
    CHECKF(ad && ad->grad_shared[0] && ad->grad_shared[1] == (v == BOTH_OK), "case %d: shared %d %d", v,
           ad ? ad->grad_shared[0] : -1, ad ? ad->grad_shared[1] : -1);
    // b's producer, a relu, takes b's gradient buffer over when its input is t (whose gradient
    // starts there), unless a's gradient is in that buffer too (BOTH_OK: its write would change a's).
    const struct fy_op *pb = &g->ops[g->slots[b].producer];
    const bool b_takes = v == BRANCH_TWICE || v == A_AFTER_PRODUCER;
    CHECKF(pb->grad_shared[0] == b_takes, "case %d: b's producer shares %d", v, pb->grad_shared[0]);
    check_grad_plan(g, "small");
    fy_graph_free(g);
  }
}

// Every op kind has a name and an entry in the CPU backend's op table and the planner's (the cuda
// backend's: test_backend_ops): a kind added without them fails here, not when a model first runs it.
static void check_op_tables(void) {
  for (int k = 0; k < FY_OP_KIND_COUNT; k++) {
    CHECKF(strcmp(fy_op_kind_name((enum fy_op_kind)k), "unknown") != 0, "op kind %d has no name", k);
    for (int j = 0; j < k; j++)
      CHECKF(strcmp(fy_op_kind_name((enum fy_op_kind)j), fy_op_kind_name((enum fy_op_kind)k)) != 0,
             "op kinds %d and %d share a name", j, k);
  }
  CHECK(strcmp(fy_op_kind_name(FY_OP_KIND_COUNT), "unknown") == 0);
  CHECKF(fy_engine_ops_missing() < 0, "the CPU op table lacks op kind %d", fy_engine_ops_missing());
  CHECKF(fy_profile_ops_missing() < 0, "the planner's op table lacks op kind %d", fy_profile_ops_missing());
}

int main(void) {
  check_op_tables();
  check_shared_grads();
  check_fusions();
  check_flash();
  check_act16();
  check_forward_only();
  for (const char *const *p = fy_opt_preset_names(); *p; p++) {
    bool huge = strstr(*p, "66b") || strstr(*p, "175b") || strstr(*p, "30b");
    check_model(*p, 2, huge ? 32 : 64);
  }
  // Published sizes (rounded as the model names are).
  struct fy_opt_config c;
  fy_opt_preset("opt-125m", &c);
  CHECKF(llabs(fy_opt_num_params(&c) - 125239296) == 0, "opt-125m: %lld", (long long)fy_opt_num_params(&c));
  fy_opt_preset("facebook/opt-350m", &c);
  CHECKF(llabs(fy_opt_num_params(&c) - 331196416) == 0, "opt-350m: %lld", (long long)fy_opt_num_params(&c));
  fy_opt_preset("opt-175b", &c);
  CHECK(fy_opt_num_params(&c) > 174e9 && fy_opt_num_params(&c) < 176e9);
  CHECK_ERR(fy_opt_preset("opt-7b", &c), FY_ERR_NOT_FOUND);
  // A sequence longer than the positions.
  struct fy_graph *g;
  fy_opt_preset("opt-tiny", &c);
  CHECK_ERR(fy_opt_build_graph(&c, 1, c.max_position_embeddings + 1, &g), FY_ERR_INVALID);
  // Model variants: no bias, no affine layer norms, untied head, post-LN without projections.
  c.enable_bias = false;
  c.layer_norm_elementwise_affine = false;
  c.tie_word_embeddings = false;
  CHECK_OK(fy_opt_build_graph(&c, 2, 8, &g));
  int64_t total = 0;
  for (int i = 0; i < g->n_params; i++) total += g->params[i].numel;
  CHECK(total == fy_opt_num_params(&c));
  CHECK(fy_graph_find_param(g, "lm_head.weight") >= 0);
  CHECK(fy_graph_find_param(g, "model.decoder.layers.0.fc1.bias") < 0);
  check_grad_plan(g, "variant");
  fy_graph_free(g);
  return check_summary("graph");
}
