#include "runtime/engine.h"
#include "runtime/ep.h"

#include <math.h>
#include <omp.h>
#include <string.h>

#include "ops/ops.h"
#include "planner/pattern.h"

void fy_engine_positions(int32_t *pos, const int32_t *mask, int64_t B, int64_t T) {
  for (int64_t b = 0; b < B; b++) {
    int32_t run = 0;
    for (int64_t t = 0; t < T; t++) {
      int32_t mk = mask ? (mask[b * T + t] != 0) : 1;
      run += mk;
      pos[b * T + t] = run * mk - 1 + 2;
    }
  }
}

fy_status fy_engine_check_batch(const struct fy_model *m, const struct fy_batch *batch) {
  const struct fy_graph *g = m->graph;
  if (batch->B != g->B || batch->T != g->T)
    return fy_error_set(FY_ERR_INVALID, "batch is %lld x %lld but the model was built for %lld x %lld",
                        (long long)batch->B, (long long)batch->T, (long long)g->B, (long long)g->T);
  int64_t V = m->cfg.vocab_size, n = g->B * g->T;
  for (int64_t i = 0; i < n; i++) {
    int32_t x = batch->inputs[i], y = batch->targets[i];
    if (x < 0 || x >= V)
      return fy_error_set(FY_ERR_INVALID, "token id %d at row %lld, position %lld is not below the "
                          "vocabulary size %lld", x, (long long)(i / g->T), (long long)(i % g->T), (long long)V);
    if (y != -100 && (y < 0 || y >= V))
      return fy_error_set(FY_ERR_INVALID, "target id %d at row %lld, position %lld is neither -100 "
                          "nor below the vocabulary size %lld", y, (long long)(i / g->T),
                          (long long)(i % g->T), (long long)V);
  }
  return FY_OK;
}

int64_t fy_engine_count_targets(const struct fy_batch *batch) {
  int64_t n = 0;
  for (int64_t i = 0; i < batch->B * batch->T; i++) n += batch->targets[i] != -100;
  return n;
}

// ---- parallel patterns (planner/pattern.h): their hooks after the kernels ----

// buf (n of dt) summed over c: where the kernels run, or on the host for the CPU's (always fp32).
static fy_status all_reduce(struct fy_model *m, struct fy_comm *c, void *buf, size_t n, enum fy_reduce_dtype dt) {
  if (m->kernels->all_reduce) return m->kernels->all_reduce(m, c, buf, n, dt);
  return fy_comm_all_reduce(c, buf, n, FY_COMM_F32, NULL);
}

static fy_status pattern_all_reduce(void *ctx, int group, float *buf, size_t n) {
  struct fy_model *m = ctx;
  struct fy_comm *c = group == FY_PATTERN_GROUP_TP ? m->tp_comm : m->dp_comm;
  if (!c || fy_comm_size(c) == 1) return FY_OK;
  return all_reduce(m, c, buf, n, m->graph->act16 ? FY_COMM_BF16 : FY_COMM_F32);  // (activations' dtype)
}

static fy_status pattern_add(void *ctx, float *dst, const float *src, size_t n) {
  struct fy_model *m = ctx;
  if (m->kernels->pattern_add) return m->kernels->pattern_add(m, dst, src, (int64_t)n);
  fy_add_forward(dst, dst, src, (int64_t)n);
  return FY_OK;
}

static fy_status pattern_add_bias(void *ctx, float *out, const float *bias, int64_t rows, int64_t cols) {
  struct fy_model *m = ctx;
  if (m->kernels->pattern_bias_add) return m->kernels->pattern_bias_add(m, out, bias, rows, cols);
  fy_bias_add(out, bias, rows, cols);
  return FY_OK;
}

fy_status fy_engine_run_hook(struct fy_model *m, int o, bool backward, struct fy_pattern_run *r) {
  const struct fy_pattern *p = m->patterns[o];
  fy_status (*hook)(const struct fy_pattern_run *) = p ? (backward ? p->post_backward : p->post_forward) : NULL;
  if (!hook) return FY_OK;
  r->g = m->graph;
  r->op = o;
  r->all_reduce = pattern_all_reduce;
  r->add = pattern_add;
  r->add_bias = pattern_add_bias;
  r->ctx = m;
  fy_status st = hook(r);
  return st == FY_OK ? FY_OK : fy_error_wrap(st, "pattern %s", p->name);
}

// ---- the CPU kernels of each op kind (cpu and sim devices) ----

static fy_status embedding_fwd(const struct fy_op_args *a) {
  const struct fy_op *op = a->op;
  fy_embedding_forward(a->out, op->index == FY_INDEX_TOKENS ? a->c->batch->inputs : a->c->batch->positions,
                       a->c->w[0], a->BT, op->C);
  return FY_OK;
}

static fy_status layernorm_fwd(const struct fy_op_args *a) {
  const struct fy_op *op = a->op;
  struct fy_model *m = a->m;
  const struct fy_op_call *c = a->c;
  fy_layernorm_forward(a->out, fy_engine_act(m, op->aux[0]), fy_engine_act(m, op->aux[1]), a->in0, op->n_params ? c->w[0] : NULL,
                       op->n_params ? c->w[1] : NULL, a->BT, op->C, op->eps);
  return FY_OK;
}

static fy_status linear_fwd(const struct fy_op_args *a) {
  const struct fy_op *op = a->op;
  const struct fy_op_call *c = a->c;
  int n_w = op->has_bias ? op->n_params / 2 : op->n_params;
  // A row-split linear's partial product is summed by its pattern, which adds the bias after.
  const float *bias = op->has_bias ? c->w[n_w] : NULL;
  if (op->split == FY_SPLIT_ROW) a->run->bias = bias;
  return fy_linear_forward(a->out, a->in0 + c->row0 * op->C, c->w[0], op->split == FY_SPLIT_ROW ? NULL : bias, a->BT, op->C,
                           op->OC, a->m->compute_dtype == FY_BF16);
}

static fy_status attention_fwd(const struct fy_op_args *a) {
  const struct fy_op *op = a->op;
  return fy_attention_forward(a->out, fy_engine_act(a->m, op->aux[0]), a->in0, a->c->batch->mask, a->B, a->T, op->C, op->NH,
                              op->scale);
}

static fy_status relu_fwd(const struct fy_op_args *a) {
  fy_relu_forward(a->out, a->in0, fy_op_call_numel(a->c, a->op->out));
  return FY_OK;
}

static fy_status gelu_fwd(const struct fy_op_args *a) {
  fy_gelu_forward(a->out, a->in0, fy_op_call_numel(a->c, a->op->out));
  return FY_OK;
}

static fy_status add_fwd(const struct fy_op_args *a) {
  const struct fy_op *op = a->op;
  uint64_t key;
  int64_t u0;
  if (fy_engine_dropout(a->c, op, &key, &u0))
    fy_dropout_add_forward(a->out, a->in0, fy_engine_act(a->m, op->in[1]), a->BT, op->C, key, u0, op->dropout);
  else
    fy_add_forward(a->out, a->in0, fy_engine_act(a->m, op->in[1]), fy_op_call_numel(a->c, op->out));
  return FY_OK;
}

static fy_status cross_entropy_fwd(const struct fy_op_args *a) {
  fy_crossentropy_forward(a->out, a->in0, a->c->batch->targets, a->BT, a->op->V);
  double s = 0;
  for (int64_t i = 0; i < a->BT; i++) s += a->out[i];
  if (a->c->loss_sum) *a->c->loss_sum += s;
  return FY_OK;
}

// A tensor-parallel mixture's sums over the group (struct fy_moe_dims), in fp32 whatever the
// activations' dtype: the routing weights' gradients feed the router's.
static fy_status moe_tp_sum(void *ctx, float *buf, int64_t n) {
  struct fy_model *m = ctx;
  return all_reduce(m, m->tp_comm, buf, (size_t)n, FY_COMM_F32);
}

// A mixture of experts' kernels (ops/ops.h): its parameters in op->params order.
static struct fy_moe_dims moe_dims(const struct fy_op_args *a) {
  const struct fy_op *op = a->op;
  const bool tp = a->m->tp_comm && fy_comm_size(a->m->tp_comm) > 1;  // (its experts are slices: core/opt.c)
  // (padding, the batch's attention mask 0, goes to no expert; the call's rows are the batch's first)
  return (struct fy_moe_dims){.BT = a->BT, .C = op->C, .F = op->OC, .E = op->experts, .K = op->top_k,
                              .gelu = op->gelu, .bf16 = a->m->compute_dtype == FY_BF16, .mask = a->c->batch->mask,
                              .tp_sum = tp ? moe_tp_sum : NULL, .tp_ctx = a->m};
}

// The targets of the call's rows not ignored: the weight of its balance term (struct fy_loss).
static int64_t moe_targets(const struct fy_op_args *a) {
  int64_t n = 0;
  for (int64_t i = 0; i < a->BT; i++) n += a->c->batch->targets[i] != -100;
  return n;
}

static fy_status moe_fwd(const struct fy_op_args *a) {
  const struct fy_op *op = a->op;
  const struct fy_op_call *c = a->c;
  const struct fy_moe_dims d = moe_dims(a);
  const int b = op->has_bias;
  double balance;
  // With tensor parallelism fc2's bias goes into the group's sum once, from its rank 0 (ops/ops.h).
  const float *b2 = b && (!d.tp_sum || a->g->tp_rank == 0) ? c->w[4] : NULL;
  if (a->m->ep) FY_TRY(fy_ep_moe_forward(a, &balance));  // (experts over ranks: runtime/ep.c)
  else
    FY_TRY(fy_moe_forward(a->out, fy_engine_act(a->m, op->aux[0]), fy_engine_act(a->m, op->aux[1]), &balance, a->in0,
                          c->w[0], c->w[1], b ? c->w[2] : NULL, c->w[2 + b], b2, &d));
  if (c->aux_sum) *c->aux_sum += (double)op->aux_coef * balance * (double)moe_targets(a);
  return FY_OK;
}

static fy_status moe_bwd(const struct fy_op_args *a) {
  const struct fy_op *op = a->op;
  const struct fy_op_call *c = a->c;
  const struct fy_moe_dims d = moe_dims(a);
  const int b = op->has_bias;
  // The objective's balance term is coef x balance x (this micro-batch's targets) x loss_scale
  // (1 / the step's targets): with one micro-batch, coef x balance added to the mean loss.
  const float dbalance = op->aux_coef * c->loss_scale * (float)moe_targets(a);
  if (a->m->ep) return fy_ep_moe_backward(a, dbalance);
  return fy_moe_backward(fy_engine_dinput(a->m, op, 0), c->g[0], c->g[1], b ? c->g[2] : NULL, c->g[2 + b],
                         b ? c->g[4] : NULL, a->dout, a->in0, fy_engine_act(a->m, op->aux[0]),
                         fy_engine_act(a->m, op->aux[1]), c->w[0], c->w[1], c->w[2 + b], dbalance, !a->first[0], &d);
}

static fy_status embedding_bwd(const struct fy_op_args *a) {
  const struct fy_op *op = a->op;
  const struct fy_param *p = &a->g->params[op->params[0]];
  float *dtable = a->c->g[0];
  if (a->first[0]) memset(dtable, 0, (size_t)p->numel * 4);
  // nn.Embedding(padding_idx=...) gives its padding row no gradient from the lookup; the
  // tied output projection's gradient to that row (already in) stays.
  float *row = p->padding_idx >= 0 ? dtable + p->padding_idx * op->C : NULL;
  float keep[op->C > 0 && row ? op->C : 1];
  if (row) memcpy(keep, row, (size_t)op->C * 4);
  fy_embedding_backward(dtable, a->dout, op->index == FY_INDEX_TOKENS ? a->c->batch->inputs : a->c->batch->positions,
                        a->BT, op->C, op->V);
  if (row) memcpy(row, keep, (size_t)op->C * 4);
  return FY_OK;
}

static fy_status layernorm_bwd(const struct fy_op_args *a) {
  const struct fy_op *op = a->op;
  struct fy_model *m = a->m;
  const struct fy_op_call *c = a->c;
  // The input gradient first: it reads the weights the parameter gradients may overwrite.
  fy_layernorm_backward(fy_engine_dinput(m, op, 0), NULL, NULL, a->dout, a->in0, op->n_params ? c->w[0] : NULL,
                        fy_engine_act(m, op->aux[0]), fy_engine_act(m, op->aux[1]), a->BT, op->C);
  if (op->n_params)
    fy_layernorm_backward_params(c->g[0], c->g[1], a->dout, a->in0, fy_engine_act(m, op->aux[0]), fy_engine_act(m, op->aux[1]),
                                 a->BT, op->C, !a->first[0]);
  return FY_OK;
}

static fy_status linear_bwd(const struct fy_op_args *a) {
  const struct fy_op *op = a->op;
  struct fy_model *m = a->m;
  const struct fy_op_call *c = a->c;
  const int64_t BT = a->BT;
  int n_w = op->has_bias ? op->n_params / 2 : op->n_params;
  // A column-split linear's input gradient is this rank's part: written apart, for its pattern
  // to sum over the group and add to the slot (which may hold another consumer's gradient).
  float *dinp = fy_engine_dinput(m, op, 0);
  if (op->split == FY_SPLIT_COL) {
    FY_ASSERT(BT * op->C <= m->tp_buf_elems);
    memset(m->tp_buf, 0, (size_t)(BT * op->C) * 4);
    dinp = a->run->dinput_part = m->tp_buf;
  }
  const bool bf16 = m->compute_dtype == FY_BF16;
  fy_status st = fy_linear_backward(dinp, NULL, NULL, a->dout, a->in0, c->w[0], BT, op->C, op->OC, bf16);
  if (st == FY_OK)
    st = fy_linear_backward_params(c->g[0], op->has_bias ? c->g[n_w] : NULL, a->dout, a->in0, BT, op->C, op->OC,
                                   !a->first[0], bf16);
  return st;
}

static fy_status attention_bwd(const struct fy_op_args *a) {
  const struct fy_op *op = a->op;
  struct fy_model *m = a->m;
  return fy_attention_backward(fy_engine_dinput(m, op, 0), m->scratch, a->dout, a->in0, fy_engine_act(m, op->aux[0]), a->B,
                               a->T, op->C, op->NH, op->scale);
}

static fy_status relu_bwd(const struct fy_op_args *a) {
  const struct fy_op *op = a->op;
  fy_relu_backward(fy_engine_dinput(a->m, op, 0), a->dout, fy_engine_act(a->m, op->out), a->g->slots[op->out].numel);
  return FY_OK;
}

static fy_status gelu_bwd(const struct fy_op_args *a) {
  const struct fy_op *op = a->op;
  fy_gelu_backward(fy_engine_dinput(a->m, op, 0), a->dout, a->in0, a->g->slots[op->out].numel);
  return FY_OK;
}

static fy_status add_bwd(const struct fy_op_args *a) {
  const struct fy_op *op = a->op;
  struct fy_model *m = a->m;
  uint64_t key;
  int64_t u0;
  if (fy_engine_dropout(a->c, op, &key, &u0))
    fy_dropout_add_backward(fy_engine_dinput_own(m, op, 0), fy_engine_dinput_own(m, op, 1), a->dout, a->BT, op->C, key, u0,
                            op->dropout);
  else
    fy_add_backward(fy_engine_dinput_own(m, op, 0), fy_engine_dinput_own(m, op, 1), a->dout, a->g->slots[op->out].numel);
  return FY_OK;
}

static fy_status cross_entropy_bwd(const struct fy_op_args *a) {
  const struct fy_op *op = a->op;
  fy_crossentropy_backward(fy_engine_dact(a->m, op->in[0]), a->in0, a->c->batch->targets, a->BT, op->V, a->c->loss_scale);
  return FY_OK;
}

// The CPU backend's op table: a new op kind is one line here (and one in each other backend's,
// runtime/engine_cuda.c, and in the planner's costs, planner/profile.c).
static const struct fy_op_kernels cpu_ops[] = {
    [FY_OP_EMBEDDING] = {embedding_fwd, embedding_bwd},
    [FY_OP_LAYERNORM] = {layernorm_fwd, layernorm_bwd},
    [FY_OP_LINEAR] = {linear_fwd, linear_bwd},
    [FY_OP_ATTENTION] = {attention_fwd, attention_bwd},
    [FY_OP_RELU] = {relu_fwd, relu_bwd},
    [FY_OP_ADD] = {add_fwd, add_bwd},
    [FY_OP_CROSS_ENTROPY] = {cross_entropy_fwd, cross_entropy_bwd},
    [FY_OP_GELU] = {gelu_fwd, gelu_bwd},
    [FY_OP_MOE] = {moe_fwd, moe_bwd},
};
_Static_assert(sizeof cpu_ops / sizeof cpu_ops[0] == FY_OP_KIND_COUNT, "an op kind without CPU kernels");

int fy_engine_ops_missing(void) { return fy_op_kernels_missing(cpu_ops, (int)(sizeof cpu_ops / sizeof cpu_ops[0])); }

void fy_op_call_forward(void *arg) {
  struct fy_op_call *c = arg;
  struct fy_model *m = c->m;
  const struct fy_graph *g = m->graph;
  const struct fy_op *op = &g->ops[c->op];
  float *out = fy_engine_act(m, op->out);
  double t0 = m->profile ? omp_get_wtime() : 0;
  struct fy_pattern_run run = {.out = out};
  const struct fy_op_args a = {.c = c, .m = m, .g = g, .op = op, .B = g->B, .T = g->T, .BT = fy_op_call_rows(c),
                               .out = out, .in0 = op->n_in > 0 ? fy_engine_act(m, op->in[0]) : NULL, .run = &run};
  FY_ASSERT(op->kind < FY_OP_KIND_COUNT && cpu_ops[op->kind].forward);
  fy_status st = cpu_ops[op->kind].forward(&a);
  if (st == FY_OK) st = fy_engine_run_hook(m, c->op, false, &run);
  // 16-bit numerics: the output as a 16-bit tensor would hold it (the per-row losses stay fp32).
  if (m->compute_dtype != FY_F32 && op->kind != FY_OP_CROSS_ENTROPY)
    fy_round_to_dtype(out, out, m->compute_dtype, (size_t)fy_op_call_numel(c, op->out));
  if (m->profile) m->op_seconds[op->kind][0] += omp_get_wtime() - t0;
  if (st != FY_OK) c->st = fy_error_wrap(st, "forward of %s", op->name);
}

void fy_op_call_backward(void *arg) {
  struct fy_op_call *c = arg;
  struct fy_model *m = c->m;
  const struct fy_graph *g = m->graph;
  const struct fy_op *op = &g->ops[c->op];
  double t0 = m->profile ? omp_get_wtime() : 0;
  for (int k = 0; k < op->n_zero; k++) {
    const struct fy_slot *s = &g->slots[op->zero[k]];
    memset(m->dacts + s->grad_offset, 0, (size_t)s->numel * 4);
  }
  // Whether each parameter's gradient is written (its first in this pass) or added.
  bool first[FY_OP_MAX_PARAMS];
  for (int k = 0; k < op->n_params; k++) first[k] = g->params[op->params[k]].last_use == c->op;
  struct fy_pattern_run run = {.dinput = op->n_in > 0 && op->kind != FY_OP_EMBEDDING ? fy_engine_dinput(m, op, 0) : NULL};
  const struct fy_op_args a = {.c = c, .m = m, .g = g, .op = op, .B = g->B, .T = g->T, .BT = g->B * g->T,
                               .in0 = op->n_in > 0 ? fy_engine_act(m, op->in[0]) : NULL,
                               .dout = op->kind == FY_OP_CROSS_ENTROPY ? NULL : fy_engine_dact(m, op->out),
                               .first = first, .run = &run};
  FY_ASSERT(op->kind < FY_OP_KIND_COUNT && cpu_ops[op->kind].backward);
  fy_status st = cpu_ops[op->kind].backward(&a);
  if (st == FY_OK) st = fy_engine_run_hook(m, c->op, true, &run);
  if (m->compute_dtype != FY_F32) {  // 16-bit numerics: the gradients as 16-bit tensors would hold them
    for (int k = 0; k < op->n_in && op->kind != FY_OP_EMBEDDING; k++) {
      float *d = fy_engine_dinput_own(m, op, k);  // (an add's shared one is dout, already rounded)
      if (d) fy_round_to_dtype(d, d, m->compute_dtype, (size_t)g->slots[op->in[k]].numel);
    }
    for (int k = 0; k < op->n_params; k++) {
      if (m->ep && op->kind == FY_OP_MOE && k > 0) continue;  // (the experts': ep.c rounds each source's part)
      fy_round_to_dtype(c->g[k], c->g[k], m->compute_dtype, (size_t)g->params[op->params[k]].numel);
    }
  }
  if (m->profile) m->op_seconds[op->kind][1] += omp_get_wtime() - t0;
  if (st != FY_OK) c->st = fy_error_wrap(st, "backward of %s", op->name);
}

// ---- resident parameters ----

static void resident_call(struct fy_model *m, int o, const struct fy_dev_batch *b, struct fy_op_call *c) {
  const struct fy_op *op = &m->graph->ops[o];
  *c = (struct fy_op_call){.m = m, .op = o, .batch = b, .st = FY_OK};
  for (int k = 0; k < op->n_params; k++) {
    int64_t off = m->graph->params[op->params[k]].offset;
    // 16-bit compute: the weights in the compute dtype (and on a GPU the gradients too), at the
    // parameter's element offset in arrays of cparams_esize-byte elements.
    c->w[k] = m->cparams && m->compute_dtype != FY_F32 ? (float *)((char *)m->cparams + off * m->cparams_esize)
                                                       : fy_model_param(m, op->params[k]);
    c->g[k] = m->cgrads && m->compute_dtype != FY_F32 ? (float *)((char *)m->cgrads + off * 2) : fy_model_grad(m, op->params[k]);
  }
}

// The batch where the kernels read it: the loader's buffers on a host-addressable device, else
// copied (with the positions) into the model's device buffers.
static fy_status stage_batch(struct fy_model *m, const struct fy_batch *batch, const int32_t *positions,
                             struct fy_dev_batch *out) {
  if (!m->device_memory) {
    *out = (struct fy_dev_batch){.inputs = batch->inputs, .targets = batch->targets, .mask = batch->mask,
                                 .positions = m->positions, .row0 = batch->row0};
    return FY_OK;
  }
  size_t n = (size_t)(batch->B * batch->T) * 4;
  int32_t *d = m->dbatch;
  *out = (struct fy_dev_batch){.inputs = d, .targets = d + batch->B * batch->T,
                               .mask = batch->mask ? d + 2 * batch->B * batch->T : NULL, .positions = m->positions,
                               .row0 = batch->row0};
  FY_TRY(fy_model_upload(m, out->inputs, batch->inputs, n));
  FY_TRY(fy_model_upload(m, out->targets, batch->targets, n));
  if (batch->mask) FY_TRY(fy_model_upload(m, (void *)out->mask, batch->mask, n));
  if (positions) FY_TRY(fy_model_upload(m, m->positions, positions, n));
  return FY_OK;
}

static fy_status forward(struct fy_model *m, const struct fy_batch *batch, bool dropout, int lo, int hi,
                         struct fy_loss *loss) {
  FY_TRY(fy_engine_check_batch(m, batch));
  const struct fy_graph *g = m->graph;
  int32_t *pos = m->device_memory ? m->host_positions : m->positions;
  fy_engine_positions(pos, batch->mask, g->B, g->T);
  struct fy_dev_batch b;
  FY_TRY(stage_batch(m, batch, pos, &b));
  b.no_dropout = !dropout;
  loss->sum = 0;
  loss->aux_sum = 0;
  loss->count = fy_engine_count_targets(batch);
  // 16-bit numerics: the kernels read the master weights in the compute dtype (refreshed once after
  // they changed, not every micro-batch).
  if (m->compute_dtype != FY_F32 && !m->cparams_fresh) {
    m->kernels->prepare_weights(m);
    m->cparams_fresh = true;
  }
  for (int o = lo; o < hi; o++) {
    struct fy_op_call c;
    resident_call(m, o, &b, &c);
    c.loss_sum = &loss->sum;
    c.aux_sum = &loss->aux_sum;
    m->kernels->op_forward(&c);
    if (c.st != FY_OK) return c.st;
  }
  return FY_OK;
}

fy_status fy_engine_forward(struct fy_model *m, const struct fy_batch *batch, struct fy_loss *loss) {
  return forward(m, batch, true, 0, m->graph->n_ops, loss);
}

fy_status fy_engine_forward_eval(struct fy_model *m, const struct fy_batch *batch, struct fy_loss *loss) {
  return forward(m, batch, false, 0, m->graph->n_ops, loss);
}

fy_status fy_engine_forward_ops(struct fy_model *m, const struct fy_batch *batch, int lo, int hi, struct fy_loss *loss) {
  FY_ASSERT(lo >= 0 && lo <= hi && hi <= m->graph->n_ops);
  return forward(m, batch, true, lo, hi, loss);
}

fy_status fy_engine_forward_eval_ops(struct fy_model *m, const struct fy_batch *batch, int lo, int hi,
                                     struct fy_loss *loss) {
  FY_ASSERT(lo >= 0 && lo <= hi && hi <= m->graph->n_ops);
  return forward(m, batch, false, lo, hi, loss);
}

static fy_status backward(struct fy_model *m, const struct fy_batch *batch, const int32_t *positions, int lo, int hi,
                          float loss_scale) {
  const struct fy_graph *g = m->graph;
  struct fy_dev_batch b;
  FY_TRY(stage_batch(m, batch, positions, &b));
  for (int o = hi - 1; o >= lo; o--) {
    struct fy_op_call c;
    int first = g->recompute ? fy_graph_layer_first_op(g, o) : -1;
    for (int r = first; r >= 0 && r <= o; r++) {  // recompute the layer's activations
      resident_call(m, r, &b, &c);
      m->kernels->op_forward(&c);
      if (c.st != FY_OK) return c.st;
    }
    resident_call(m, o, &b, &c);
    c.loss_scale = loss_scale;
    m->kernels->op_backward(&c);
    if (c.st != FY_OK) return c.st;
  }
  return FY_OK;
}

fy_status fy_engine_backward(struct fy_model *m, const struct fy_batch *batch, float loss_scale) {
  return backward(m, batch, NULL, 0, m->graph->n_ops, loss_scale);
}

fy_status fy_engine_backward_ops(struct fy_model *m, const struct fy_batch *batch, int lo, int hi, float loss_scale) {
  FY_ASSERT(lo >= 0 && lo <= hi && hi <= m->graph->n_ops);
  // (On a GPU the positions are computed on the host and go up with the batch, as the forward's.)
  int32_t *pos = m->device_memory ? m->host_positions : m->positions;
  fy_engine_positions(pos, batch->mask, m->graph->B, m->graph->T);
  return backward(m, batch, m->device_memory ? pos : NULL, lo, hi, loss_scale);
}

// ---- incremental decoding ----

// The op that writes the logits, when it is a product that can take one row of its input.
static bool logits_one_row(const struct fy_graph *g, int o) {
  return g->ops[o].out == g->logits_slot && g->ops[o].kind == FY_OP_LINEAR && g->ops[o].split == FY_SPLIT_NONE;
}

struct fy_kv_cache {
  struct fy_device *dev;  // where k and v live (the model's)
  int64_t cap, len;
  size_t esize, bytes;    // an element of k and v (the compute dtype's), and each buffer's size
  int64_t *at;            // per op: where its keys start in k and v, in elements (-1: not attention)
  bool logits_one_row;    // the logits' product computes the last token's row alone
  void *k, *v;            // every attention op's (cap, C) keys and values, one after another
  float *att;             // (NH, T, cap) host scratch of the widest (the CPU's kernel)
  float *logits;          // (V) the logits brought to the host (a device the host cannot address)
  void *logits_raw;       // ... as the device holds them (V of the compute dtype), with 16-bit compute
};

fy_status fy_kv_cache_create(const struct fy_model *m, int64_t cap, struct fy_kv_cache **out) {
  const struct fy_graph *g = m->graph;
  // (On the cpu 16-bit compute is fp32 storage rounded at every op: not the decoding kernel's.)
  const bool dtype_ok = m->compute_dtype == FY_F32 || (m->device_memory && m->compute_dtype == FY_BF16);
  if (g->B != 1 || g->tp > 1 || !dtype_ok || !m->kernels->attention_decode ||
      (m->host && !m->kernels->set_stream))
    return fy_error_set(FY_ERR_INVALID, "decoding needs a model built for one sequence on one rank, computing in fp32 "
                        "(or bf16 on a GPU), resident (or offloaded to a GPU)");
  if (cap < 1) return fy_error_set(FY_ERR_INVALID, "decoding: a cache of %lld tokens", (long long)cap);
  struct fy_kv_cache *kv = calloc(1, sizeof *kv);
  if (!kv || !(kv->at = malloc((size_t)g->n_ops * sizeof *kv->at))) {
    free(kv);
    return fy_error_set(FY_ERR_NOMEM, "out of memory");
  }
  int64_t total = 0, nh = 1;
  for (int o = 0; o < g->n_ops; o++) {
    const struct fy_op *op = &g->ops[o];
    kv->at[o] = op->kind == FY_OP_ATTENTION ? total : -1;
    kv->logits_one_row |= logits_one_row(g, o);
    if (op->kind == FY_OP_ATTENTION) total += cap * op->C, nh = op->NH > nh ? op->NH : nh;
  }
  kv->dev = m->dev;
  kv->cap = cap;
  kv->esize = m->device_memory ? fy_dtype_size(m->compute_dtype) : 4;
  kv->bytes = (size_t)(total > 0 ? total : 1) * kv->esize;
  const int64_t V = m->cfg.vocab_size;
  fy_status st = fy_device_alloc(m->dev, kv->bytes, &kv->k);
  if (st == FY_OK) st = fy_device_alloc(m->dev, kv->bytes, &kv->v);
  // (The CPU's kernel takes NH x T x cap floats for T tokens at once; a GPU's keeps its own.)
  const int64_t att = nh * (m->device_memory ? 1 : g->T) * cap;
  if (st == FY_OK && !(kv->att = malloc((size_t)att * sizeof(float)))) st = FY_ERR_NOMEM;
  if (st == FY_OK && m->device_memory &&
      (!(kv->logits = malloc((size_t)V * sizeof(float))) ||
       (kv->esize != 4 && !(kv->logits_raw = malloc((size_t)V * kv->esize)))))
    st = FY_ERR_NOMEM;
  if (st != FY_OK) {
    fy_kv_cache_free(kv);
    return fy_error_set(FY_ERR_NOMEM, "decoding: no memory for a cache of %lld tokens (%.1f MiB on %s)",
                        (long long)cap, 2.0 * (double)kv->bytes / 1048576.0, m->dev->name);
  }
  *out = kv;
  return FY_OK;
}

void fy_kv_cache_free(struct fy_kv_cache *kv) {
  if (!kv) return;
  if (kv->k) fy_device_dealloc(kv->dev, kv->k, kv->bytes);
  if (kv->v) fy_device_dealloc(kv->dev, kv->v, kv->bytes);
  free(kv->at), free(kv->att), free(kv->logits), free(kv->logits_raw);
  free(kv);
}

void fy_kv_cache_reset(struct fy_kv_cache *kv) { kv->len = 0; }

int64_t fy_kv_cache_len(const struct fy_kv_cache *kv) { return kv->len; }

double fy_kv_cache_bytes(const struct fy_opt_config *cfg, int64_t cap, enum fy_dtype dtype) {
  return 2.0 * (double)cfg->num_hidden_layers * (double)cap * (double)cfg->hidden_size * (double)fy_dtype_size(dtype);
}

fy_status fy_kv_cache_check(const struct fy_kv_cache *kv, const struct fy_model *m, const int32_t *tokens, int64_t n) {
  const struct fy_graph *g = m->graph;
  if (n < 1 || n > g->T)
    return fy_error_set(FY_ERR_INVALID, "decoding: %lld tokens at once with a model built for %lld", (long long)n,
                        (long long)g->T);
  if (kv->len + n > kv->cap)
    return fy_error_set(FY_ERR_INVALID, "decoding: the cache of %lld tokens holds %lld and cannot take %lld more",
                        (long long)kv->cap, (long long)kv->len, (long long)n);
  const int64_t V = m->cfg.vocab_size;
  for (int64_t i = 0; i < n; i++)
    if (tokens[i] < 0 || tokens[i] >= V)
      return fy_error_set(FY_ERR_INVALID, "decoding: token id %d is not below the vocabulary size %lld", tokens[i],
                          (long long)V);
  return FY_OK;
}

fy_status fy_kv_cache_attend(struct fy_kv_cache *kv, struct fy_model *m, int o, int64_t n) {
  FY_ASSERT(kv->at[o] >= 0);
  return m->kernels->attention_decode(m, o, (char *)kv->k + kv->at[o] * (int64_t)kv->esize,
                                      (char *)kv->v + kv->at[o] * (int64_t)kv->esize, kv->att, kv->len, n, kv->cap);
}

void fy_kv_cache_rows(const struct fy_model *m, int o, int64_t n, struct fy_op_call *c) {
  const bool last = logits_one_row(m->graph, o);
  c->rows = last ? 1 : n;
  c->row0 = last ? n - 1 : 0;
}

fy_status fy_kv_cache_advance(struct fy_kv_cache *kv, struct fy_model *m, int64_t n, const float **logits) {
  kv->len += n;
  // The last token's row of the logits: the first (fy_kv_cache_rows), or with every row computed
  // row n - 1 of the slot (B = 1).
  const int64_t row = kv->logits_one_row ? 0 : n - 1;
  const size_t V = (size_t)m->cfg.vocab_size, esize = m->device_memory ? kv->esize : 4;
  const char *lg = (const char *)fy_engine_act(m, m->graph->logits_slot) + (size_t)row * V * esize;
  if (!m->device_memory) {
    *logits = (const float *)lg;
    return FY_OK;
  }
  // (fy_model_download waits for the kernels)
  if (kv->logits_raw) {
    FY_TRY(fy_model_download(m, kv->logits_raw, lg, V * kv->esize));
    fy_convert_to_f32(kv->logits, kv->logits_raw, m->compute_dtype, V);
  } else {
    FY_TRY(fy_model_download(m, kv->logits, lg, V * sizeof(float)));
  }
  *logits = kv->logits;
  return FY_OK;
}

fy_status fy_engine_decode(struct fy_model *m, struct fy_kv_cache *kv, const int32_t *tokens, int64_t n,
                           const float **logits) {
  const struct fy_graph *g = m->graph;
  if (m->host) return fy_error_set(FY_ERR_INVALID, "decoding an offloaded model: fy_offload_decode");
  FY_TRY(fy_kv_cache_check(kv, m, tokens, n));
  // OPT's learned positions start at 2 (fy_engine_positions); a device's go up with the batch.
  int32_t *pos = m->device_memory ? m->host_positions : m->positions;
  for (int64_t i = 0; i < n; i++) pos[i] = (int32_t)(kv->len + i + 2);
  // (The loss is not run: the targets are never read.)
  const struct fy_batch batch = {.B = 1, .T = n, .inputs = (int32_t *)tokens, .targets = (int32_t *)tokens};  // (read)
  struct fy_dev_batch b;
  FY_TRY(stage_batch(m, &batch, m->device_memory ? pos : NULL, &b));
  b.no_dropout = true;
  if (m->compute_dtype != FY_F32 && !m->cparams_fresh) {
    m->kernels->prepare_weights(m);
    m->cparams_fresh = true;
  }
  for (int o = 0; o < g->n_ops; o++) {
    if (g->ops[o].kind == FY_OP_CROSS_ENTROPY) continue;  // (the logits are what is read)
    if (kv->at[o] >= 0) {
      FY_TRY(fy_kv_cache_attend(kv, m, o, n));
      continue;
    }
    struct fy_op_call c;
    resident_call(m, o, &b, &c);
    fy_kv_cache_rows(m, o, n, &c);
    m->kernels->op_forward(&c);
    if (c.st != FY_OK) return c.st;
  }
  return fy_kv_cache_advance(kv, m, n, logits);
}

fy_status fy_engine_all_reduce_grads(struct fy_model *m) {
  const bool g16 = fy_model_grads_16(m);
  return all_reduce(m, m->dp_comm, g16 ? (void *)m->cgrads : (void *)m->grads, (size_t)m->graph->n_param_elems,
                    g16 ? FY_COMM_BF16 : FY_COMM_F32);
}

fy_status fy_engine_find_nonfinite(struct fy_model *m, const struct fy_batch *batch, int *op) {
  FY_TRY(fy_engine_check_batch(m, batch));
  const struct fy_graph *g = m->graph;
  if (m->device_memory) return fy_error_set(FY_ERR_UNSUPPORTED, "naming the operator needs host-addressable activations");
  fy_engine_positions(m->positions, batch->mask, g->B, g->T);
  struct fy_dev_batch b;
  FY_TRY(stage_batch(m, batch, NULL, &b));
  *op = -1;
  for (int o = 0; o < g->n_ops; o++) {
    struct fy_op_call c;
    resident_call(m, o, &b, &c);
    fy_op_call_forward(&c);
    if (c.st != FY_OK) return c.st;
    const float *out = fy_engine_act(m, g->ops[o].out);
    for (int64_t i = 0; i < g->slots[g->ops[o].out].numel; i++)
      if (!isfinite(out[i])) {
        *op = o;
        return FY_OK;
      }
  }
  return FY_OK;
}
