#include "runtime/optimizer.h"

#include <math.h>
#include <stdlib.h>

#include "ops/ops.h"

struct fy_adamw fy_adamw_defaults(void) {
  return (struct fy_adamw){.beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f, .clip = 1.0f};
}

double fy_optimizer_grad_sumsq(const struct fy_model *m, const bool *only, bool experts_apart) {
  const struct fy_graph *g = m->graph;
  // experts[1]: the experts' tp slices (ep with tp), summed over ep and then with the split ones
  double s = 0, split = 0, experts[2] = {0, 0}, sums[g->n_params > 0 ? g->n_params : 1];
  if (m->kernels->grads_sumsq((struct fy_model *)m, sums) != FY_OK) return NAN;  // the step is then refused
  for (int i = 0; i < g->n_params; i++) {
    if (only && !only[i]) continue;
    if (g->params[i].expert && experts_apart) experts[fy_param_split_tp(g, &g->params[i])] += sums[i];
    else if (g->params[i].split_dim >= 0) split += sums[i];
    else s += sums[i];
  }
  if (g->ep > 1) {  // a mixture's experts over the expert-parallel group: every rank's, in rank order
    double all[2 * g->ep];
    if (fy_comm_all_gather(m->ep_comm, experts, all, 4, FY_COMM_F32, NULL) != FY_OK) return NAN;
    experts[0] = experts[1] = 0;
    for (int r = 0; r < g->ep; r++) experts[0] += all[2 * r], experts[1] += all[2 * r + 1];
  }
  s += experts[0];
  split += experts[1];
  if (g->tp > 1) {  // split parameters: every rank's part, added in rank order (the same bits everywhere)
    double all[g->tp];
    if (fy_comm_all_gather(m->tp_comm, &split, all, 2, FY_COMM_F32, NULL) != FY_OK) return NAN;  // a double as two words
    split = 0;
    for (int r = 0; r < g->tp; r++) split += all[r];
  }
  return s + split;
}

double fy_optimizer_grad_norm(const struct fy_model *m, float grad_scale) {
  return sqrt(fy_optimizer_grad_sumsq(m, NULL, true)) * fabs((double)grad_scale);
}

static int range_cmp(const void *a, const void *b) {
  int64_t x = ((const struct fy_adamw_range *)a)->off, y = ((const struct fy_adamw_range *)b)->off;
  return (x > y) - (x < y);
}

// m and v stored as bf16 or 8-bit codes (model.h, state_format): one call over the whole buffer
// with a range a parameter, so that a block two parameters share is quantised once, after both
// are updated (ops/ops.h); the same blocks as every chunk of an offloaded run (fy_graph.chunk_align).
// which (NULL: all) picks the parameters updated, a pipeline stage's: those it holds, whose groups
// start at block multiples in its flat buffer as in the whole model's (fy_graph.chunk_align), so
// the blocks hold the same elements as one rank's.
static fy_status step_compressed(struct fy_model *m, const struct fy_adamw *h, float lr, int64_t t, float scale,
                                 const bool *which) {
  const struct fy_graph *g = m->graph;
  if (m->device_memory)  // (refused by the trainer before this: the resident GPU keeps fp32 state)
    return fy_error_set(FY_ERR_UNSUPPORTED, "--optimizer-state %s on a resident GPU model",
                        fy_state_format_name(m->state_format));
  struct fy_adamw_range *r = malloc((size_t)(g->n_params > 0 ? g->n_params : 1) * sizeof *r);
  if (!r) return fy_error_set(FY_ERR_NOMEM, "out of memory");
  int n = 0;
  for (int i = 0; i < g->n_params; i++)
    if (!g->params[i].absent && (!which || which[i]))
      r[n++] = (struct fy_adamw_range){g->params[i].offset, g->params[i].numel,
                                       g->params[i].decay ? h->weight_decay : 0.0f};
  qsort(r, (size_t)n, sizeof *r, range_cmp);
  m->cparams_fresh = false;  // the 16-bit copy is refreshed before the next forward
  fy_status st = fy_adamw_state_update(m->state_format, m->params, m->m, m->v, m->grads, g->n_param_elems, r, n,
                                       lr, h->beta1, h->beta2, h->eps, t, scale);
  free(r);
  return st;
}

fy_status fy_optimizer_step(struct fy_model *m, const struct fy_adamw *h, float lr, int64_t t,
                            float grad_scale, double norm) {
  return fy_optimizer_step_some(m, h, lr, t, grad_scale, norm, NULL);
}

fy_status fy_optimizer_step_some(struct fy_model *m, const struct fy_adamw *h, float lr, int64_t t,
                                 float grad_scale, double norm, const bool *which) {
  if (!isfinite(norm))
    return fy_error_set(FY_ERR_NUMERIC, "the gradient norm is %f; no parameter was updated", norm);
  float scale = grad_scale;
  if (h->clip > 0) {
    double coef = h->clip / (norm + 1e-6);
    if (coef < 1.0) scale = (float)((double)grad_scale * coef);
  }
  const struct fy_graph *g = m->graph;
  if (m->state_format != FY_STATE_F32) return step_compressed(m, h, lr, t, scale, which);
  for (int i = 0; i < g->n_params; i++) {
    if (which && !which[i]) continue;
    const struct fy_param *p = &g->params[i];
    m->kernels->adamw(m, fy_model_param(m, i), m->m + p->offset, m->v + p->offset, fy_model_grad(m, i),
                    p->numel, lr, h->beta1, h->beta2, h->eps, p->decay ? h->weight_decay : 0.0f, t, scale);
  }
  return FY_OK;
}

struct fy_loss_scaler fy_loss_scaler_init(double scale) {
  return (struct fy_loss_scaler){.scale = scale, .good = 0, .growth_interval = 2000};
}

fy_status fy_loss_scaler_update(struct fy_loss_scaler *s, bool overflow) {
  if (!overflow) {
    if (++s->good >= s->growth_interval && s->scale < 0x1p120) {
      s->scale *= 2;
      s->good = 0;
    }
    return FY_OK;
  }
  if (s->scale <= 1.0)
    return fy_error_set(FY_ERR_NUMERIC, "the gradients overflow even at the minimum loss scale 1; stopping "
                        "(the last checkpoint is the last good state)");
  s->scale /= 2;
  s->good = 0;
  return FY_OK;
}
