// AdamW over the model's parameters with gradient clipping by global norm (docs/design.md, "One
// training step", step 4). The norm is the sum of per-parameter sums of squares taken in parameter
// order, so it does not depend on how parameters are laid out or placed; clipping is decided from
// it before any parameter is updated.
#ifndef FY_OPTIMIZER_H
#define FY_OPTIMIZER_H

#include "runtime/model.h"

struct fy_adamw {
  float beta1, beta2, eps, weight_decay;  // decay applies to matrices and embeddings only
  float clip;                             // max global norm; <= 0 disables clipping
};

// torch.optim.AdamW's defaults except weight decay 0.1 (OPT's), with clipping at 1.0.
struct fy_adamw fy_adamw_defaults(void);

// The global L2 norm of the gradients scaled by grad_scale (a tied parameter counted once).
double fy_optimizer_grad_norm(const struct fy_model *m, float grad_scale);
// The sum of squares of the gradients (unscaled) of the parameters only[] marks (NULL: all), summed
// over the tp group and, the experts' (kept apart when experts_apart), over the ep group, in rank
// order; NAN when a collective fails. (A pipeline stage's part: fy_pipeline_grad_norm.)
double fy_optimizer_grad_sumsq(const struct fy_model *m, const bool *only, bool experts_apart);
// One AdamW step (t counts from 1) at learning rate lr on grads x grad_scale, clipped to the global
// norm `norm` as torch.nn.utils.clip_grad_norm_ does (coefficient clip / (norm + 1e-6), at most 1).
// Refuses a non-finite norm (nothing is updated then).
fy_status fy_optimizer_step(struct fy_model *m, const struct fy_adamw *h, float lr, int64_t t,
                            float grad_scale, double norm);
// The same on the parameters i with which[i] alone (a pipeline stage's; fp32 state only).
fy_status fy_optimizer_step_some(struct fy_model *m, const struct fy_adamw *h, float lr, int64_t t,
                                 float grad_scale, double norm, const bool *which);

// Dynamic loss scaling (as PyTorch's GradScaler): the loss is multiplied by `scale` (a power of
// two, so that scaling and unscaling are exact) before backward. A step whose gradients overflow
// is skipped and the scale halved; `growth_interval` good steps in a row double it. Overflow at
// the minimum scale (1) cannot be helped: fy_loss_scaler_update returns FY_ERR_NUMERIC then.
struct fy_loss_scaler {
  double scale;
  int64_t good;             // good steps since the scale last changed
  int64_t growth_interval;  // 2000
};

struct fy_loss_scaler fy_loss_scaler_init(double scale);
// After a step: `overflow` says whether its gradients were not finite (the step was skipped).
fy_status fy_loss_scaler_update(struct fy_loss_scaler *s, bool overflow);

#endif
