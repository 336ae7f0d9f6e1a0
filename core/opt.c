// OPT presets, parameter counts and the graph builder (OPTForCausalLM of transformers).
#include "core/opt.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "core/graph.h"

struct opt_preset {
  const char *name;
  int64_t hidden, layers, heads, ffn, proj, vocab, max_pos;
  bool pre_ln;
  int64_t experts, top_k, moe_every;  // a mixture of experts (0: dense)
};

// The public sizes are those of facebook/opt-* config.json files.
static const struct opt_preset fy_opt_presets[] = {
    {"opt-tiny", 32, 2, 4, 64, 32, 97, 64, true, 0, 0, 0},
    {"opt-demo", 256, 4, 4, 1024, 256, 512, 256, true, 0, 0, 0},
    // Mixtures of experts (before the dense sizes, which stay in increasing order for ferry plan
    // --largest): opt-tiny's sizes over 4 layers (two dense, two of 4 experts), and opt-125m's
    // shape with 8 experts and top-2 routing in every other layer (the Switch/GShard placement),
    // 6 of its 12 layers.
    {"opt-moe-tiny", 32, 4, 4, 64, 32, 97, 64, true, 4, 2, 2},
    {"opt-125m-moe8", 768, 12, 12, 3072, 768, 50272, 2048, true, 8, 2, 2},
    {"opt-125m", 768, 12, 12, 3072, 768, 50272, 2048, true, 0, 0, 0},
    {"opt-350m", 1024, 24, 16, 4096, 512, 50272, 2048, false, 0, 0, 0},
    {"opt-1.3b", 2048, 24, 32, 8192, 2048, 50272, 2048, true, 0, 0, 0},
    {"opt-2.7b", 2560, 32, 32, 10240, 2560, 50272, 2048, true, 0, 0, 0},
    {"opt-6.7b", 4096, 32, 32, 16384, 4096, 50272, 2048, true, 0, 0, 0},
    {"opt-13b", 5120, 40, 40, 20480, 5120, 50272, 2048, true, 0, 0, 0},
    {"opt-30b", 7168, 48, 56, 28672, 7168, 50272, 2048, true, 0, 0, 0},
    {"opt-66b", 9216, 64, 72, 36864, 9216, 50272, 2048, true, 0, 0, 0},
    {"opt-175b", 12288, 96, 96, 49152, 12288, 50272, 2048, true, 0, 0, 0},
};
#define N_PRESETS (int)(sizeof fy_opt_presets / sizeof *fy_opt_presets)

const char *const *fy_opt_preset_names(void) {
  static const char *names[N_PRESETS + 1];
  for (int i = 0; i < N_PRESETS; i++) names[i] = fy_opt_presets[i].name;
  names[N_PRESETS] = NULL;
  return names;
}

fy_status fy_opt_preset(const char *name, struct fy_opt_config *cfg) {
  if (strncmp(name, "facebook/", 9) == 0) name += 9;
  for (int i = 0; i < N_PRESETS; i++) {
    const struct opt_preset *p = &fy_opt_presets[i];
    if (strcmp(p->name, name) != 0) continue;
    memset(cfg, 0, sizeof *cfg);
    snprintf(cfg->name, sizeof cfg->name, "%s", p->name);
    cfg->vocab_size = p->vocab;
    cfg->hidden_size = p->hidden;
    cfg->word_embed_proj_dim = p->proj;
    cfg->ffn_dim = p->ffn;
    cfg->num_hidden_layers = p->layers;
    cfg->num_attention_heads = p->heads;
    cfg->max_position_embeddings = p->max_pos;
    cfg->do_layer_norm_before = p->pre_ln;
    cfg->enable_bias = true;
    cfg->layer_norm_elementwise_affine = true;
    cfg->tie_word_embeddings = true;
    cfg->init_std = 0.02f;
    cfg->layer_norm_eps = 1e-5f;
    // Published configs say dropout 0.1; ferry trains without dropout unless asked (as llm.c
    // does), so the presets say 0: what is run by default.
    cfg->pad_token_id = 1;
    cfg->bos_token_id = 2;
    cfg->eos_token_id = 2;
    snprintf(cfg->torch_dtype, sizeof cfg->torch_dtype, "float32");
    cfg->num_local_experts = p->experts;
    cfg->num_experts_per_tok = p->experts ? p->top_k : 2;
    cfg->moe_layer_frequency = p->experts ? p->moe_every : 1;
    // Switch Transformer's alpha (Mixtral's config says 0.001).
    cfg->router_aux_loss_coef = p->experts ? 0.01f : 0.001f;
    return FY_OK;
  }
  return fy_error_set(FY_ERR_NOT_FOUND, "unknown model preset '%s' (see ferry train --help)", name);
}

int64_t fy_opt_num_params(const struct fy_opt_config *c) {
  int64_t D = c->hidden_size, W = c->word_embed_proj_dim, F = c->ffn_dim, V = c->vocab_size;
  int64_t bias = c->enable_bias, ln = c->layer_norm_elementwise_affine ? 2 : 0;
  int64_t layer = 4 * D * D + 2 * D * F + bias * (4 * D + F + D) + 2 * ln * D;
  int64_t n = V * W + (c->max_position_embeddings + 2) * D + c->num_hidden_layers * layer;
  // A mixture's layer holds E feed-forwards and the router (E,D) in place of one feed-forward.
  const int64_t ffn = 2 * D * F + bias * (F + D), E = c->num_local_experts;
  n += fy_opt_moe_layers(c) * ((E - 1) * ffn + E * D);
  if (W != D) n += 2 * D * W;
  if (c->do_layer_norm_before && !c->remove_final_layer_norm) n += ln * D;
  if (!c->tie_word_embeddings) n += V * W;
  return n;
}

double fy_opt_step_flops(const struct fy_opt_config *c, int64_t B, int64_t T, enum fy_flops_count count) {
  // Every weight used in a product does one multiply-add per token forward (2 FLOPs) and two
  // backward (the input's gradient and its own: 4 FLOPs): 6 x parameters x tokens. Attention's
  // QK^T and AV are 2 x T x D multiply-adds per token and layer forward, 4 x T x D FLOPs, and
  // twice that backward: 12 x L x D x T a token.
  //
  // ferry's count (FY_FLOPS_PALM) is PaLM's (appendix B) and Megatron-LM's: the non-embedding
  // parameters (the layers' matrices, and, as PaLM's N does, their biases and layer norms: 0.1% of
  // opt-125m), plus the lm_head's product V x W once: with tied embeddings that product is the
  // table's only matrix use, with an untied lm_head it is that matrix's; the input embedding and
  // the positional table are lookups, not products, and do not count. OPT-350m's project_in and
  // project_out are products and count. The causal mask is ignored (both papers count the whole
  // T x T square), so attention is 12 x L x D x T.
  //
  // llm.c's count (FY_FLOPS_LLMC, its gpt2_estimate_mfu) takes every parameter (the positional
  // table too, a tied table once, an untied lm_head and the input table both) and only the causal
  // half of attention, 6 x L x D x T. On opt-125m it is 10.7% below ferry's count at T 2048 and
  // 0.3% above it at T 128 (its positional table outweighs the attention it leaves out).
  const double tokens = (double)B * (double)T, L = (double)c->num_hidden_layers, D = (double)c->hidden_size;
  const double all = (double)fy_opt_num_params(c);
  if (count == FY_FLOPS_LLMC && c->num_local_experts == 0) return 6.0 * all * tokens + 6.0 * L * D * (double)T * tokens;
  if (count == FY_FLOPS_LLMC) {  // (every parameter a token computes with: the active experts)
    const double F = (double)c->ffn_dim, E = (double)c->num_local_experts;
    const double active = all - (double)fy_opt_moe_layers(c) * (E - (double)c->num_experts_per_tok) *
                                    (2 * D * F + (c->enable_bias ? F + D : 0));
    return 6.0 * active * tokens + 6.0 * L * D * (double)T * tokens;
  }
  const double vw = (double)c->vocab_size * (double)c->word_embed_proj_dim;
  const double positions = (double)(c->max_position_embeddings + 2) * D;
  // all - positions holds the token table once (the lm_head's product when tied) and, untied, the
  // lm_head's matrix besides: then one of the two V x W is the input lookup and goes.
  double dense = all - positions - (c->tie_word_embeddings ? 0.0 : vw);
  // A mixture computes k of its E experts a token (and its router): the E - k others do not count.
  const double F = (double)c->ffn_dim, E = (double)c->num_local_experts;
  dense -= (double)fy_opt_moe_layers(c) * (E - (double)c->num_experts_per_tok) *
           (2 * D * F + (c->enable_bias ? F + D : 0));
  return 6.0 * dense * tokens + 12.0 * L * D * (double)T * tokens;
}

// ---- the graph of OPTForCausalLM ----

struct builder {
  struct fy_graph *g;
  const struct fy_opt_config *c;
  int64_t BT;
  int tp, tp_rank;  // tensor parallelism: the attention and MLP linears are split over tp ranks
  fy_status st;
};

static int param(struct builder *b, const char *name, int64_t d0, int64_t d1) {
  char full[FY_NAME_MAX];
  snprintf(full, sizeof full, "model.decoder.%s", name);
  int64_t shape[2] = {d0, d1};
  int id = fy_graph_add_param(b->g, full, d1 ? 2 : 1, shape, d1 != 0);
  if (id < 0) b->st = fy_error_set(FY_ERR_NOMEM, "cannot grow the graph");
  return id;
}

static int slot(struct builder *b, int64_t numel) {
  int s = fy_graph_add_slot(b->g, numel);
  if (s < 0) b->st = fy_error_set(FY_ERR_NOMEM, "cannot grow the graph");
  return s;
}

static int add_op(struct builder *b, struct fy_op *op) {
  if (b->st != FY_OK) return -1;
  if (fy_graph_add_op(b->g, op) < 0) b->st = fy_error_set(FY_ERR_NOMEM, "cannot grow the graph");
  return op->out;
}

static int embedding(struct builder *b, const char *name, int table, enum fy_index_source src,
                     int64_t V, int64_t C) {
  struct fy_op op = {.kind = FY_OP_EMBEDDING, .layer = -1, .n_params = 1, .params = {table},
                     .out = slot(b, b->BT * C), .C = C, .V = V, .index = src};
  snprintf(op.name, sizeof op.name, "%s", name);
  return add_op(b, &op);
}

static int layernorm(struct builder *b, const char *name, int layer, int in) {
  int64_t C = b->c->hidden_size;
  struct fy_op op = {.kind = FY_OP_LAYERNORM, .layer = layer, .n_in = 1, .in = {in},
                     .out = slot(b, b->BT * C), .n_aux = 2, .aux = {slot(b, b->BT), slot(b, b->BT)},
                     .C = C, .eps = b->c->layer_norm_eps};
  snprintf(op.name, sizeof op.name, "%s", name);
  if (b->c->layer_norm_elementwise_affine) {
    char pn[FY_NAME_MAX];
    snprintf(pn, sizeof pn, "%s.weight", name);
    op.params[0] = param(b, pn, C, 0);
    snprintf(pn, sizeof pn, "%s.bias", name);
    op.params[1] = param(b, pn, C, 0);
    op.n_params = 2;
  }
  return add_op(b, &op);
}

// Marks parameter id as this rank's part of a tensor split over b->tp ranks along dim.
static void split_param(struct builder *b, int id, int dim) {
  if (id < 0 || b->tp == 1) return;
  struct fy_param *p = &b->g->params[id];
  p->split_dim = dim;
  p->full_shape[dim] = p->shape[dim] * b->tp;
}

// The same for a mixture's stacked experts' rows, each of `blocks` experts' rows split apart.
static void split_param_blocks(struct builder *b, int id, int64_t blocks) {
  split_param(b, id, 0);
  if (id >= 0 && b->tp > 1) b->g->params[id].split_blocks = blocks;
}

// A linear layer over `n` fused projections named names[i] (each OC x C), with or without biases.
// split COL: this rank holds OC/tp of each projection's outputs (rows of the weight, and of the
// bias); ROW: C/tp of the inputs (columns of the weight; the bias is held whole).
static int linear_split(struct builder *b, const char *label, int layer, int in, const char *const *names,
                        int n, int64_t C, int64_t OC, bool bias, int shared_weight, enum fy_split split) {
  if (b->tp == 1) split = FY_SPLIT_NONE;
  if (split == FY_SPLIT_COL) OC /= b->tp;
  if (split == FY_SPLIT_ROW) C /= b->tp;
  struct fy_op op = {.kind = FY_OP_LINEAR, .layer = layer, .n_in = 1, .in = {in},
                     .out = slot(b, b->BT * OC * n), .C = C, .OC = OC * n, .has_bias = bias, .split = split};
  snprintf(op.name, sizeof op.name, "%s", label);
  if (split != FY_SPLIT_NONE) snprintf(op.pattern, sizeof op.pattern, "%s", split == FY_SPLIT_COL ? "tp_col" : "tp_row");
  char pn[FY_NAME_MAX];
  if (shared_weight >= 0) {
    op.params[op.n_params++] = shared_weight;
  } else {
    for (int i = 0; i < n; i++) {
      snprintf(pn, sizeof pn, "%s.weight", names[i]);
      op.params[op.n_params] = param(b, pn, OC, C);
      if (split != FY_SPLIT_NONE) split_param(b, op.params[op.n_params], split == FY_SPLIT_COL ? 0 : 1);
      op.n_params++;
    }
  }
  if (bias)
    for (int i = 0; i < n; i++) {
      snprintf(pn, sizeof pn, "%s.bias", names[i]);
      op.params[op.n_params] = param(b, pn, OC, 0);
      if (split == FY_SPLIT_COL) split_param(b, op.params[op.n_params], 0);
      op.n_params++;
    }
  return add_op(b, &op);
}

static int linear(struct builder *b, const char *label, int layer, int in, const char *const *names,
                  int n, int64_t C, int64_t OC, bool bias, int shared_weight) {
  return linear_split(b, label, layer, in, names, n, C, OC, bias, shared_weight, FY_SPLIT_NONE);
}

static int binary(struct builder *b, enum fy_op_kind kind, const char *name, int layer, int x,
                  int y, int64_t numel) {
  struct fy_op op = {.kind = kind, .layer = layer, .n_in = y >= 0 ? 2 : 1, .in = {x, y},
                     .out = slot(b, numel)};
  snprintf(op.name, sizeof op.name, "%s", name);
  return add_op(b, &op);
}

// A residual add: h + the branch x, with the run's dropout on x (site: 2l + 0 attention, 1 MLP).
static int residual(struct builder *b, const char *name, int l, int h, int x, int site) {
  const int64_t D = b->c->hidden_size;
  struct fy_op op = {.kind = FY_OP_ADD, .layer = l, .n_in = 2, .in = {h, x}, .out = slot(b, b->BT * D), .C = D,
                     .dropout = b->c->train_dropout, .site = site};
  snprintf(op.name, sizeof op.name, "%s", name);
  return add_op(b, &op);
}

// A mixture-of-experts feed-forward block (FY_OP_MOE): Mixtral's gate name, and the experts'
// weights stacked along their first dimension (expert e's fc1 is rows [e F, (e + 1) F) of
// experts.fc1.weight), so that one product kernel walks them and a chunk holds them contiguously.
// With tensor parallelism each expert is split as the dense fc1 / fc2 are (the expert pattern):
// this rank holds F/tp of every expert's fc1 rows (and biases) and the same F/tp columns of its
// fc2, so op.OC is F/tp; the router and fc2's bias are whole on every rank.
static int moe(struct builder *b, int l, int x) {
  const struct fy_opt_config *c = b->c;
  const int64_t D = c->hidden_size, F = c->ffn_dim / b->tp, E = c->num_local_experts;
  const bool bias = c->enable_bias;
  char pn[FY_NAME_MAX];
  struct fy_op op = {.kind = FY_OP_MOE, .layer = l, .n_in = 1, .in = {x}, .out = slot(b, b->BT * D), .n_aux = 2,
                     .aux = {slot(b, b->BT * (E + 3 * c->num_experts_per_tok)),
                             slot(b, fy_moe_rows_cap(b->BT, E, c->num_experts_per_tok) * (F + D))},
                     .C = D, .OC = F, .has_bias = bias, .experts = (int)E, .top_k = (int)c->num_experts_per_tok,
                     .gelu = c->activation == FY_ACT_GELU, .aux_coef = c->router_aux_loss_coef};
  snprintf(op.name, sizeof op.name, "layers.%d.block_sparse_moe", l);
  if (b->tp > 1) snprintf(op.pattern, sizeof op.pattern, "expert");
  snprintf(pn, sizeof pn, "layers.%d.block_sparse_moe.gate.weight", l);
  op.params[op.n_params++] = param(b, pn, E, D);
  snprintf(pn, sizeof pn, "layers.%d.block_sparse_moe.experts.fc1.weight", l);
  op.params[op.n_params++] = param(b, pn, E * F, D);
  split_param_blocks(b, op.params[op.n_params - 1], E);
  if (bias) {
    snprintf(pn, sizeof pn, "layers.%d.block_sparse_moe.experts.fc1.bias", l);
    op.params[op.n_params++] = param(b, pn, E * F, 0);
    split_param_blocks(b, op.params[op.n_params - 1], E);
  }
  snprintf(pn, sizeof pn, "layers.%d.block_sparse_moe.experts.fc2.weight", l);
  op.params[op.n_params++] = param(b, pn, E * D, F);
  split_param(b, op.params[op.n_params - 1], 1);
  if (bias) {
    snprintf(pn, sizeof pn, "layers.%d.block_sparse_moe.experts.fc2.bias", l);
    op.params[op.n_params++] = param(b, pn, E * D, 0);
  }
  return add_op(b, &op);
}

static int decoder_layer(struct builder *b, int l, int h) {
  const struct fy_opt_config *c = b->c;
  int64_t D = c->hidden_size, F = c->ffn_dim, NH = c->num_attention_heads;
  bool bias = c->enable_bias, pre = c->do_layer_norm_before;
  char p[64], n1[FY_NAME_MAX], n2[FY_NAME_MAX], n3[FY_NAME_MAX], label[64];
  snprintf(p, sizeof p, "layers.%d", l);

  // Self-attention block.
  snprintf(n1, sizeof n1, "%s.self_attn_layer_norm", p);
  int x = pre ? layernorm(b, n1, l, h) : h;
  snprintf(n1, sizeof n1, "%s.self_attn.q_proj", p);
  snprintf(n2, sizeof n2, "%s.self_attn.k_proj", p);
  snprintf(n3, sizeof n3, "%s.self_attn.v_proj", p);
  const char *qkv_names[3] = {n1, n2, n3};
  snprintf(label, sizeof label, "%s.self_attn.qkv", p);
  int qkv = linear_split(b, label, l, x, qkv_names, 3, D, D, bias, -1, FY_SPLIT_COL);
  // With tensor parallelism this rank attends with its NH/tp heads (head size D/NH as ever).
  int64_t Dl = D / b->tp, NHl = NH / b->tp;
  struct fy_op att = {.kind = FY_OP_ATTENTION, .layer = l, .n_in = 1, .in = {qkv},
                      .out = slot(b, b->BT * Dl), .n_aux = 1,
                      .aux = {slot(b, b->g->B * NHl * b->g->T * b->g->T)}, .C = Dl, .NH = NHl,
                      .scale = 1.0f / sqrtf((float)(D / NH))};
  snprintf(att.name, sizeof att.name, "%s.self_attn", p);
  int a = add_op(b, &att);
  snprintf(n1, sizeof n1, "%s.self_attn.out_proj", p);
  const char *out_names[1] = {n1};
  int o = linear_split(b, n1, l, a, out_names, 1, D, D, bias, -1, FY_SPLIT_ROW);
  snprintf(label, sizeof label, "%s.attn_residual", p);
  h = residual(b, label, l, h, o, 2 * l);
  snprintf(n1, sizeof n1, "%s.self_attn_layer_norm", p);
  if (!pre) h = layernorm(b, n1, l, h);

  // Feed-forward block.
  snprintf(n1, sizeof n1, "%s.final_layer_norm", p);
  x = pre ? layernorm(b, n1, l, h) : h;
  if (fy_opt_layer_is_moe(c, l)) {
    int f = moe(b, l, x);
    snprintf(label, sizeof label, "%s.ffn_residual", p);
    h = residual(b, label, l, h, f, 2 * l + 1);
    snprintf(n1, sizeof n1, "%s.final_layer_norm", p);
    if (!pre) h = layernorm(b, n1, l, h);
    return h;
  }
  snprintf(n1, sizeof n1, "%s.fc1", p);
  const char *fc1[1] = {n1};
  int f = linear_split(b, n1, l, x, fc1, 1, D, F, bias, -1, FY_SPLIT_COL);
  const bool gelu = b->c->activation == FY_ACT_GELU;
  snprintf(label, sizeof label, "%s.%s", p, gelu ? "gelu" : "relu");
  f = binary(b, gelu ? FY_OP_GELU : FY_OP_RELU, label, l, f, -1, b->BT * (F / b->tp));
  snprintf(n1, sizeof n1, "%s.fc2", p);
  const char *fc2[1] = {n1};
  f = linear_split(b, n1, l, f, fc2, 1, F, D, bias, -1, FY_SPLIT_ROW);
  snprintf(label, sizeof label, "%s.ffn_residual", p);
  h = residual(b, label, l, h, f, 2 * l + 1);
  snprintf(n1, sizeof n1, "%s.final_layer_norm", p);
  if (!pre) h = layernorm(b, n1, l, h);
  return h;
}

fy_status fy_opt_build_graph(const struct fy_opt_config *c, int64_t B, int64_t T,
                             struct fy_graph **out) {
  return fy_opt_build_graph_tp(c, B, T, 1, 0, out);
}

fy_status fy_opt_build_graph_tp(const struct fy_opt_config *c, int64_t B, int64_t T, int tp, int tp_rank,
                                struct fy_graph **out) {
  FY_TRY(fy_opt_config_check(c));
  if (tp < 1 || tp_rank < 0 || tp_rank >= tp)
    return fy_error_set(FY_ERR_INVALID, "tensor-parallel rank %d of %d", tp_rank, tp);
  if (c->num_attention_heads % tp != 0 || c->ffn_dim % tp != 0)
    return fy_error_set(FY_ERR_INVALID, "%d tensor-parallel ranks must divide the %lld attention heads and the "
                        "feed-forward size %lld of %s", tp, (long long)c->num_attention_heads,
                        (long long)c->ffn_dim, c->name);
  if (B < 1 || T < 1) return fy_error_set(FY_ERR_INVALID, "batch and sequence must be positive");
  if (T > c->max_position_embeddings)
    return fy_error_set(FY_ERR_INVALID,
                        "sequence length %lld is longer than the model allows "
                        "(max_position_embeddings = %lld)",
                        (long long)T, (long long)c->max_position_embeddings);
  struct fy_graph *g;
  FY_TRY(fy_graph_create(B, T, &g));
  struct builder b = {.g = g, .c = c, .BT = B * T, .tp = tp, .tp_rank = tp_rank, .st = FY_OK};
  g->tp = tp;
  g->tp_rank = tp_rank;
  int64_t D = c->hidden_size, W = c->word_embed_proj_dim, V = c->vocab_size;

  int wte = param(&b, "embed_tokens.weight", V, W);
  if (wte >= 0 && c->pad_token_id >= 0 && c->pad_token_id < V) g->params[wte].padding_idx = c->pad_token_id;
  int wpe = param(&b, "embed_positions.weight", c->max_position_embeddings + 2, D);
  int x = embedding(&b, "embed_tokens", wte, FY_INDEX_TOKENS, V, W);
  if (W != D) {
    const char *n[1] = {"project_in"};
    x = linear(&b, "project_in", -1, x, n, 1, W, D, false, -1);
  }
  int pos = embedding(&b, "embed_positions", wpe, FY_INDEX_POSITIONS, c->max_position_embeddings + 2, D);
  int h = binary(&b, FY_OP_ADD, "embed_sum", -1, x, pos, b.BT * D);
  for (int l = 0; l < c->num_hidden_layers && b.st == FY_OK; l++) h = decoder_layer(&b, l, h);
  if (c->do_layer_norm_before && !c->remove_final_layer_norm) h = layernorm(&b, "final_layer_norm", -1, h);
  if (W != D) {
    const char *n[1] = {"project_out"};
    h = linear(&b, "project_out", -1, h, n, 1, D, W, false, -1);
  }
  int head = wte;
  if (!c->tie_word_embeddings) {
    int64_t shape[2] = {V, W};
    head = fy_graph_add_param(g, "lm_head.weight", 2, shape, true);
  }
  int logits = linear(&b, "lm_head", -1, h, NULL, 1, W, V, false, head);
  struct fy_op ce = {.kind = FY_OP_CROSS_ENTROPY, .layer = -1, .n_in = 1, .in = {logits},
                     .out = slot(&b, b.BT), .V = V};
  snprintf(ce.name, sizeof ce.name, "loss");
  int loss = add_op(&b, &ce);
  if (b.st != FY_OK) {
    fy_graph_free(g);
    return b.st;
  }
  g->slots[logits].grad_in_place = true;
  g->logits_slot = logits;
  g->loss_slot = loss;
  fy_status st = fy_graph_finalize(g);
  if (st != FY_OK) {
    fy_graph_free(g);
    return st;
  }
  *out = g;
  return FY_OK;
}
