// The pattern registry and the helpers patterns share.
#include "planner/pattern.h"

#include <pthread.h>
#include <string.h>

// Registration is rare (start-up) and lookups are cheap, so one mutex guards the table; entries are
// never removed, so a pointer handed out stays valid.
static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t builtin_once = PTHREAD_ONCE_INIT;
static const struct fy_pattern *registry[FY_PATTERN_MAX];
static int registry_n;

static bool name_valid(const char *s) {
  size_t n = strlen(s);
  if (n == 0 || n >= FY_PATTERN_NAME_MAX) return false;
  for (size_t i = 0; i < n; i++) {
    char ch = s[i];
    bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
              ch == '_' || ch == '-' || ch == '.';
    if (!ok) return false;
  }
  return true;
}

static const struct fy_pattern *find_locked(const char *name) {
  for (int i = 0; i < registry_n; i++)
    if (strcmp(registry[i]->name, name) == 0) return registry[i];
  return NULL;
}

static fy_status add(const struct fy_pattern *p) {
  if (!p) return fy_error_set(FY_ERR_INVALID, "pattern: NULL pattern");
  if (!p->name || !name_valid(p->name))
    return fy_error_set(FY_ERR_INVALID,
                        "pattern: name \"%s\" must be 1 to %d characters of [A-Za-z0-9_.-]",
                        p->name ? p->name : "(null)", FY_PATTERN_NAME_MAX - 1);
  const char *missing = !p->doc         ? "doc"
                        : !p->applies   ? "applies"
                        : !p->layout    ? "layout"
                        : !p->comm      ? "comm"
                        : !p->act_bytes ? "act_bytes"
                                        : NULL;
  if (missing)
    return fy_error_set(FY_ERR_INVALID, "pattern %s: slot %s is NULL", p->name, missing);
  pthread_mutex_lock(&registry_lock);
  fy_status st = FY_OK;
  if (find_locked(p->name))
    st = fy_error_set(FY_ERR_INVALID, "pattern %s is already registered", p->name);
  else if (registry_n == FY_PATTERN_MAX)
    st = fy_error_set(FY_ERR_INVALID, "pattern %s: the registry is full (%d patterns)", p->name,
                      FY_PATTERN_MAX);
  else
    registry[registry_n++] = p;
  pthread_mutex_unlock(&registry_lock);
  return st;
}

static void register_builtin_once(void) {
  static const struct fy_pattern *const builtin[] = {
      &fy_pattern_replicate, &fy_pattern_zero, &fy_pattern_tp_col, &fy_pattern_tp_row, &fy_pattern_expert,
  };
  for (size_t i = 0; i < sizeof builtin / sizeof *builtin; i++)
    FY_ASSERT(add(builtin[i]) == FY_OK);
}

void fy_pattern_register_builtin(void) { pthread_once(&builtin_once, register_builtin_once); }

fy_status fy_pattern_register(const struct fy_pattern *p) {
  fy_pattern_register_builtin();
  return add(p);
}

const struct fy_pattern *fy_pattern_find(const char *name) {
  if (!name) return NULL;
  fy_pattern_register_builtin();
  pthread_mutex_lock(&registry_lock);
  const struct fy_pattern *p = find_locked(name);
  pthread_mutex_unlock(&registry_lock);
  return p;
}

int fy_pattern_count(void) {
  fy_pattern_register_builtin();
  pthread_mutex_lock(&registry_lock);
  int n = registry_n;
  pthread_mutex_unlock(&registry_lock);
  return n;
}

const struct fy_pattern *fy_pattern_at(int i) {
  fy_pattern_register_builtin();
  pthread_mutex_lock(&registry_lock);
  const struct fy_pattern *p = i >= 0 && i < registry_n ? registry[i] : NULL;
  pthread_mutex_unlock(&registry_lock);
  return p;
}

double fy_pattern_comm_bytes(const struct fy_pattern *p, const struct fy_pattern_ctx *c) {
  double total = 0;
  for (int phase = 0; phase < FY_PHASE_COUNT; phase++) {
    struct fy_comm_step steps[FY_PATTERN_MAX_STEPS];
    int n = p->comm(c, phase, steps, FY_PATTERN_MAX_STEPS);
    FY_ASSERT(n >= 0 && n <= FY_PATTERN_MAX_STEPS);
    for (int i = 0; i < n; i++)
      if (steps[i].op != FY_COMM_NONE) total += steps[i].bytes;
  }
  return total;
}

int fy_pattern_optim_bytes_per_elem(int param_bytes) { return param_bytes < 4 ? 12 : 8; }

double fy_pattern_state_bytes(const struct fy_pattern *p, const struct fy_pattern_ctx *c) {
  struct fy_pattern_layout l = {.split_dim = -1};
  p->layout(c, &l);
  return l.param_elems_per_rank * c->param_bytes +
         l.optim_elems_per_rank * fy_pattern_optim_bytes_per_elem(c->param_bytes);
}

int64_t fy_pattern_param_elems(const struct fy_pattern_ctx *c, int which, bool owned_only) {
  const struct fy_op *op = &c->g->ops[c->op];
  int64_t n = 0;
  for (int k = 0; k < op->n_params; k++) {
    const struct fy_param *prm = &c->g->params[op->params[k]];
    if (owned_only && prm->first_use != c->op) continue;
    if ((which == 1 && prm->rank != 2) || (which == 2 && prm->rank != 1)) continue;
    n += prm->numel;
  }
  return n;
}

bool fy_pattern_params_private(const struct fy_pattern_ctx *c) {
  const struct fy_op *op = &c->g->ops[c->op];
  for (int k = 0; k < op->n_params; k++) {
    const struct fy_param *prm = &c->g->params[op->params[k]];
    if (prm->first_use != c->op || prm->last_use != c->op) return false;
  }
  return true;
}

int fy_pattern_group_size(const struct fy_pattern_ctx *c, int group) {
  const int ep = c->ep > 1 ? c->ep : 1;
  switch (group) {
  case FY_PATTERN_GROUP_TP: return c->tp;
  case FY_PATTERN_GROUP_EP: return ep;
  case FY_PATTERN_GROUP_EP_REP: return c->dp / ep;
  default: return c->dp;
  }
}

int fy_pattern_push(const struct fy_pattern_ctx *c, struct fy_comm_step *steps, int n, int max,
                    enum fy_comm_op op, double bytes, int group) {
  if (op == FY_COMM_NONE || bytes <= 0 || fy_pattern_group_size(c, group) <= 1) return n;
  FY_ASSERT(n < max);
  steps[n] = (struct fy_comm_step){.op = op, .bytes = bytes, .group = group};
  return n + 1;
}

const char *fy_comm_op_name(enum fy_comm_op op) {
  switch (op) {
  case FY_COMM_NONE: return "none";
  case FY_COMM_ALL_REDUCE: return "all_reduce";
  case FY_COMM_ALL_GATHER: return "all_gather";
  case FY_COMM_REDUCE_SCATTER: return "reduce_scatter";
  case FY_COMM_BROADCAST: return "broadcast";
  case FY_COMM_ALL_TO_ALL: return "all_to_all";
  }
  return "?";
}
