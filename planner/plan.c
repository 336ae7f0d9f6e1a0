#include "planner/plan.h"

#include <errno.h>
#include <json-c/json.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/fileio.h"
#include "core/graph.h"
#include "core/parse.h"
#include "memory/chunk.h"
#include "ops/ops.h"
#include "planner/pattern.h"

// A plan's score: the mean of its step when the gradient norm does not clip and when it does. The
// two differ for speculative updates, which stand only in steps that do not clip: a model trained
// from random weights clips its first steps at --clip 1, a fine-tuned one seldom does, and the
// runtime cannot know which run it is; so a plan is chosen to hold up either way.
static double score(const struct fy_cost *c) { return 0.5 * (c->step_s + c->clip_step_s); }

static bool better(const struct fy_cost *a, const struct fy_cost *b) {
  if (!b->fits) return a->fits;
  return a->fits && score(a) < score(b) * (1 - 1e-9);
}

fy_status fy_plan_search(const struct fy_opt_config *cfg, const char *model, int64_t batch, int64_t seq,
                         const struct fy_probe *probe, struct fy_plan *best, int *n_tried) {
  return fy_plan_search_ranks(cfg, model, batch, seq, 1, false, NULL, probe, best, n_tried);
}

// Keeps k when it is the fastest so far.
static void consider(const struct fy_plan_knobs *k, const struct fy_cost *c, struct fy_plan *best) {
  if (!better(c, &best->predicted)) return;
  best->k = *k;
  best->predicted = *c;
  best->dp = k->dp;
  best->tp = k->tp;
  best->pp = k->pp > 1 ? k->pp : 1;
  best->ep = k->ep > 1 ? k->ep : 1;
  snprintf(best->pattern, sizeof best->pattern, "%s", k->pattern);
}

// The whole model resident on each of dp GPUs (replicas; knobs.resident), per_rank sequences a
// rank: every micro-batch dividing it, recomputation off and on, each kept in best and in
// resident when fastest; *least (when not NULL) the least device memory of one that did not fit.
static fy_status search_resident(const struct fy_opt_config *cfg, int dp, int64_t per_rank, int64_t seq, const char *prec,
                                 const struct fy_probe *probe, struct fy_plan *best, struct fy_plan *resident,
                                 int *tried, double *least) {
  for (int64_t micro = per_rank; micro >= 1; micro--) {
    if (per_rank % micro) continue;
    for (int rc = 0; rc < 2; rc++) {
      struct fy_plan_knobs k = {.micro_batch = micro, .grad_accum = per_rank / micro, .seq = seq, .recompute = rc,
                                .dp = dp, .tp = 1, .resident = true};
      snprintf(k.pattern, sizeof k.pattern, "replicate");
      snprintf(k.precision, sizeof k.precision, "%s", prec);
      if (fy_plan_refused(probe->device, cfg, &k)) continue;
      struct fy_cost c;
      FY_TRY(fy_cost_simulate(cfg, &k, probe, &c, NULL));
      ++*tried;
      if (least && !c.fits && c.min_device_bytes < *least) *least = c.min_device_bytes;
      consider(&k, &c, best);
      consider(&k, &c, resident);
    }
  }
  return FY_OK;
}

fy_status fy_plan_search_resident(const struct fy_opt_config *cfg, const char *model, int64_t batch, int64_t seq,
                                  const char *precision, const struct fy_probe *probe, struct fy_plan *best,
                                  int *n_tried) {
  if (strcmp(probe->device, "cuda") != 0)
    return fy_error_set(FY_ERR_INVALID, "plan: a resident plan keeps the whole model on a GPU (device cuda)");
  if (batch < 1 || seq < 1) return fy_error_set(FY_ERR_INVALID, "plan: batch and sequence must be positive");
  enum fy_dtype cdt;
  FY_TRY(fy_cost_check_precision(precision, probe->device, &cdt));
  memset(best, 0, sizeof *best);
  snprintf(best->model, sizeof best->model, "%s", model);
  snprintf(best->pattern, sizeof best->pattern, "replicate");
  best->dp = best->tp = best->pp = best->ep = 1;
  best->machine = *probe;
  struct fy_plan resident = *best;
  int tried = 0;
  double least = INFINITY;
  FY_TRY(search_resident(cfg, 1, batch, seq, fy_precision_name(cdt), probe, best, &resident, &tried, &least));
  if (n_tried) *n_tried = tried;
  if (best->predicted.fits) return FY_OK;
  char have[32], need[32];
  return fy_error_set(FY_ERR_NOMEM, "%s does not fit resident on a GPU of %s at %lld x %lld tokens a step: the least "
                      "it needs is %s", model, fy_format_bytes(probe->device_mem, have, sizeof have), (long long)batch,
                      (long long)seq, fy_format_bytes(least, need, sizeof need));
}

// Speculative updates (knobs.spec_chunks) for an offloaded plan (one rank, tp ranks, sharded
// data-parallel ranks or offloaded stages, each its own chunks; no lag: fy_cost_check_knobs) that
// fits, (k, c) with K0 of them (0, or what an earlier call chose) and N device updates: besides
// K0, 0, a quarter, half and all of the most host-tier chunks (host_chunks: a stage's most) whose
// spare slots the host memory left holds (every host chunk not updated on the device when their
// slots all fit: the host bytes of that plan tell a slot's size). The fastest is kept in (k, c); a
// tie keeps K0, so another K only where it is faster. A plan without either lever whose compute
// waits neither for the host optimizer nor for the norm has nothing to hide: K stays 0 without
// pricing. Each plan with K > 0 takes as its clipping step (clip_step_s, what `better` weighs) the
// same plan's with K 0.
static fy_status try_spec(const struct fy_opt_config *cfg, const struct fy_probe *probe, struct fy_plan_knobs *k,
                          struct fy_cost *c, int *tried) {
  if (!c->fits || k->resident || k->optimizer_lag) return FY_OK;
  const int host = c->host_chunks, cap = host - k->device_updates;
  const int k0 = k->spec_chunks < host ? k->spec_chunks : host;
  // (A step bound by its optimizer stream's work may show no wait in the simulated steps: the
  // step is then the busiest stream's work, which speculation moves under the backward too.)
  if (cap < 1 || (k0 == 0 && k->device_updates == 0 &&
                  c->stall_s[FY_STALL_OPTIMIZER] + c->stall_s[FY_STALL_NORM] <= 1e-3 * c->step_s &&
                  strcmp(c->bottleneck, "optimizer") != 0))
    return FY_OK;
  struct fy_plan_knobs ka = *k, kz = *k;
  struct fy_cost cz = *c;  // (the same plan without speculation: the step while the norm clips)
  if (k0 != 0) {
    kz.spec_chunks = 0;
    FY_TRY(fy_cost_simulate(cfg, &kz, probe, &cz, NULL));
    ++*tried;
    c->clip_step_s = cz.step_s;
  }
  ka.spec_chunks = cap;
  struct fy_cost ca = *c;
  if (cap != k0) {
    FY_TRY(fy_cost_simulate(cfg, &ka, probe, &ca, NULL));
    ++*tried;
  }
  ca.clip_step_s = cz.step_s;
  int most = cap;
  if (!ca.fits) {
    if (!(ca.host_bytes > probe->host_mem) || cap == k0) return FY_OK;  // (not for the host memory: no more K fits)
    const double slot = (ca.host_bytes - c->host_bytes) / (cap - k0);
    most = slot > 0 ? k0 + (int)floor((probe->host_mem - c->host_bytes) / slot) : k0;
    if (most > cap) most = cap;
  }
  const int ks[4] = {0, most / 4, most / 2, most};
  struct fy_plan_knobs kb = *k;
  struct fy_cost cb = *c;
  for (int i = 0; i < 4; i++) {
    if ((i > 0 && ks[i] < 1) || ks[i] == k0 || (i > 1 && ks[i] == ks[i - 1])) continue;
    struct fy_plan_knobs kk = *k;
    kk.spec_chunks = ks[i];
    struct fy_cost cc = ks[i] == 0 ? cz : ca;
    if (ks[i] != 0 && (ks[i] != cap || !ca.fits)) {
      FY_TRY(fy_cost_simulate(cfg, &kk, probe, &cc, NULL));
      ++*tried;
    }
    cc.clip_step_s = cz.step_s;
    if (better(&cc, &cb)) kb = kk, cb = cc;
  }
  *k = kb;
  *c = cb;
  return FY_OK;
}

// Device updates (knobs.device_updates) for an offloaded plan that fits, (k, c) with none and its
// K speculated chunks: N a quarter, half, three quarters and all of the host-tier chunks neither
// speculated nor on disk (a stage's most), where ferry train runs them and the planner prices them
// (one rank, tp ranks, sharded data-parallel ranks or offloaded stages, on a GPU or sim; no lag:
// fy_cost_check_knobs).
// The fastest is kept; N > 0 only where strictly faster. As for speculation, a plan whose compute
// waits neither for the host optimizer nor for the norm (nor is bound by the optimizer) is left
// without pricing.
static fy_status try_device_updates(const struct fy_opt_config *cfg, const struct fy_probe *probe,
                                    struct fy_plan_knobs *k, struct fy_cost *c, int *tried) {
  if (!c->fits || k->device_updates || k->resident || k->optimizer_lag || strcmp(probe->device, "cpu") == 0)
    return FY_OK;
  const int host = c->host_chunks;
  const int elig = host - (k->spec_chunks < host ? k->spec_chunks : host);
  if (elig < 1 || (c->stall_s[FY_STALL_OPTIMIZER] + c->stall_s[FY_STALL_NORM] <= 1e-3 * c->step_s &&
                   strcmp(c->bottleneck, "optimizer") != 0))
    return FY_OK;
  const int ns[4] = {elig / 4, elig / 2, elig * 3 / 4, elig};
  struct fy_plan_knobs kb = *k;
  struct fy_cost cb = *c;
  for (int i = 0; i < 4; i++) {
    if (ns[i] < 1 || (i > 0 && ns[i] == ns[i - 1])) continue;
    struct fy_plan_knobs kk = *k;
    kk.device_updates = ns[i];
    struct fy_cost cc;
    FY_TRY(fy_cost_simulate(cfg, &kk, probe, &cc, NULL));
    ++*tried;
    if (better(&cc, &cb)) kb = kk, cb = cc;
  }
  *k = kb;
  *c = cb;
  return FY_OK;
}

// The host optimizer's levers for an offloaded plan that fits, two ways, the better kept:
// speculation (K) alone; and device updates (N) first, then K given N (fewer chunks left to
// speculate, or none needed). Speculation alone is the faster while the norm does not clip;
// device updates hold while it clips too, and `better` weighs both. A few simulations more a
// plan, not their product; and none for device updates where the plan's compute alone takes the
// step of `best` (the fastest so far) or more: no lever of the optimizer's makes it the fastest.
static fy_status try_host_levers(const struct fy_opt_config *cfg, const struct fy_probe *probe,
                                 struct fy_plan_knobs *k, struct fy_cost *c, int *tried, const struct fy_plan *best) {
  struct fy_plan_knobs kd = *k;
  struct fy_cost cd = *c;
  FY_TRY(try_spec(cfg, probe, k, c, tried));
  if (best->predicted.fits && cd.compute_s >= score(&best->predicted)) return FY_OK;
  FY_TRY(try_device_updates(cfg, probe, &kd, &cd, tried));
  if (kd.device_updates == 0) return FY_OK;  // (the same plan as the first way's start)
  FY_TRY(try_spec(cfg, probe, &kd, &cd, tried));
  if (better(&cd, c)) *k = kd, *c = cd;
  return FY_OK;
}

// What the offloaded plans that did not fit needed, for the message when none does.
struct misses {
  double smallest;    // the least device memory of a plan that fails for the device alone
  double least_host;  // the least host memory of any plan, with disk or without
  double least_disk;  // the least disk of a plan the device and host can hold, given a disk tier
};

static void note_miss(const struct fy_cost *c, const struct fy_probe *probe, struct misses *m) {
  if (c->host_bytes < m->least_host) m->least_host = c->host_bytes;
  const bool disk_tier = probe->disk_write_gbps > 0;
  if (disk_tier && c->host_bytes <= probe->host_mem && c->min_device_bytes <= probe->device_mem &&
      c->disk_bytes < m->least_disk)
    m->least_disk = c->disk_bytes;
  const bool disk_ok =
      c->n_disk_chunks == 0 || (disk_tier && !(probe->disk_space > 0 && c->disk_bytes > probe->disk_space));
  // (a plan that fails for the device alone: its smallest working set; not one that fails for the
  // host's memory or the disk tier)
  if (!c->fits && c->min_device_bytes > probe->device_mem && c->host_bytes <= probe->host_mem && disk_ok &&
      c->min_device_bytes < m->smallest)
    m->smallest = c->min_device_bytes;
  if (c->fits && c->min_device_bytes < m->smallest) m->smallest = c->min_device_bytes;
}

// A grid that can be laid out, or FY_ERR_INVALID naming the numbers that do not fit.
static fy_status check_grid(const struct fy_opt_config *cfg, int64_t batch, int ranks, const struct fy_plan_grid *g) {
  const struct fy_cluster *cl = &g->cluster;
  const long long L = (long long)cfg->num_hidden_layers, H = (long long)cfg->num_attention_heads,
                  FF = (long long)cfg->ffn_dim;
  if (cl->nodes > 0 && (long long)cl->nodes * cl->gpus_per_node != ranks)
    return fy_error_set(FY_ERR_INVALID, "plan: --gpus %d is not --nodes %d x --gpus-per-node %d = %lld", ranks, cl->nodes,
                        cl->gpus_per_node, (long long)cl->nodes * cl->gpus_per_node);
  if (g->dp < 0 || g->pp < 0 || g->tp < 0) return fy_error_set(FY_ERR_INVALID, "plan: --dp, --pp and --tp must be positive");
  if (g->tp && (ranks % g->tp || H % g->tp || FF % g->tp))
    return fy_error_set(FY_ERR_INVALID, "plan: --tp %d must divide the %d ranks, the model's %lld heads and its "
                        "feed-forward size %lld", g->tp, ranks, H, FF);
  if (g->tp && cl->nodes > 0 && cl->gpus_per_node % g->tp)
    return fy_error_set(FY_ERR_INVALID, "plan: --tp %d does not lie within a node of %d GPUs (a tensor-parallel group's "
                        "ranks are one node's: tp must divide --gpus-per-node)", g->tp, cl->gpus_per_node);
  if (g->pp && g->pp > L)
    return fy_error_set(FY_ERR_INVALID, "plan: --pp %d: more pipeline stages than the model's %lld decoder layers", g->pp, L);
  if (g->pp && L % g->pp)
    return fy_error_set(FY_ERR_INVALID, "plan: --pp %d does not divide the model's %lld decoder layers (each stage takes "
                        "the same number)", g->pp, L);
  if (g->pp > FY_COST_MAX_STAGES)
    return fy_error_set(FY_ERR_INVALID, "plan: --pp %d: at most %d stages are planned", g->pp, FY_COST_MAX_STAGES);
  const long long fixed = (long long)(g->dp ? g->dp : 1) * (g->pp ? g->pp : 1) * (g->tp ? g->tp : 1);
  if (ranks % fixed || (g->dp && g->pp && g->tp && fixed != ranks)) {
    char d[16] = "?", p[16] = "?", t[16] = "?";
    if (g->dp) snprintf(d, sizeof d, "%d", g->dp);
    if (g->pp) snprintf(p, sizeof p, "%d", g->pp);
    if (g->tp) snprintf(t, sizeof t, "%d", g->tp);
    return fy_error_set(FY_ERR_INVALID, "plan: dp %s x pp %s x tp %s does not lay out %d ranks (the fixed axes multiply "
                        "to %lld, which must %s %d)", d, p, t, ranks, fixed, g->dp && g->pp && g->tp ? "equal" : "divide",
                        ranks);
  }
  if (g->dp && batch % g->dp)
    return fy_error_set(FY_ERR_INVALID, "plan: --dp %d does not divide the batch of %lld sequences", g->dp, (long long)batch);
  return FY_OK;
}

fy_status fy_plan_search_ranks(const struct fy_opt_config *cfg, const char *model, int64_t batch, int64_t seq,
                               int ranks, bool offload_only, const char *precision, const struct fy_probe *probe,
                               struct fy_plan *best, int *n_tried) {
  return fy_plan_search_lag(cfg, model, batch, seq, ranks, offload_only, precision, 0, probe, best, n_tried);
}

fy_status fy_plan_search_lag(const struct fy_opt_config *cfg, const char *model, int64_t batch, int64_t seq,
                             int ranks, bool offload_only, const char *precision, int optimizer_lag,
                             const struct fy_probe *probe, struct fy_plan *best, int *n_tried) {
  return fy_plan_search_state(cfg, model, batch, seq, ranks, offload_only, precision, optimizer_lag, NULL, probe, best,
                              n_tried);
}

fy_status fy_plan_search_state(const struct fy_opt_config *cfg, const char *model, int64_t batch, int64_t seq,
                               int ranks, bool offload_only, const char *precision, int optimizer_lag, const char *state,
                               const struct fy_probe *probe, struct fy_plan *best, int *n_tried) {
  return fy_plan_search_grid(cfg, model, batch, seq, ranks, offload_only, precision, optimizer_lag, state, NULL, probe,
                             best, n_tried);
}

// The expert-parallel sizes the search tries on a dp x tp grid (into eps, ep 1 first; returns how
// many): for a mixture on sim with its chunks sharded (dp > 1; with tp too, each rank its slices of
// the experts; any precision and AdamW state format), every divisor of the experts that divides dp
// (runtime/ep.c's offloaded expert parallelism); else 1 alone.
static int ep_sizes(const struct fy_opt_config *cfg, const char *device, int dp, int tp, int eps[16]) {
  (void)tp;  // (any tp: ep x tp runs, runtime/ep.c)
  int n = 0;
  eps[n++] = 1;
  if (cfg->num_local_experts < 2 || strcmp(device, "sim") != 0 || dp < 2) return n;
  for (int e = 2; e <= dp && n < 16; e++)
    if (dp % e == 0 && cfg->num_local_experts % e == 0) eps[n++] = e;
  return n;
}

const char *fy_plan_refused(const char *device, const struct fy_opt_config *cfg, const struct fy_plan_knobs *k) {
  const int dp = k->dp > 1 ? k->dp : 1, tp = k->tp > 1 ? k->tp : 1, pp = k->pp > 1 ? k->pp : 1;
  const bool zero = k->pattern[0] ? strcmp(k->pattern, "zero") == 0 : !k->resident;
  const bool lag = k->optimizer_lag > 0, compressed = k->optimizer_state[0] && strcmp(k->optimizer_state, "fp32") != 0;
  // (device updates: offload engines' exact step, a host tier; fy_cost_check_knobs says so too;
  // and the cpu device's plans refuse them here, before the rest of what cpu plans are not checked
  // for)
  if (k->device_updates > 0 && (k->resident || lag || !device || strcmp(device, "cpu") == 0))
    return k->resident ? "device updates (device_updates) are for offloaded runs: a resident run updates on the device "
                         "already"
           : lag       ? "device updates (device_updates) do not combine with --optimizer-lag"
                       : "device updates (device_updates) run on a GPU or the sim device, not the cpu device";
  if (!device || strcmp(device, "cpu") == 0) return NULL;  // (priced, never run from a plan)
  const bool cuda = strcmp(device, "cuda") == 0;
  if (!cuda && strcmp(device, "sim") != 0) return "plans run on the sim device and on GPUs (cuda)";
  if (k->resident && !cuda) return "a resident plan keeps the whole model on a GPU: it runs with --device cuda";
  // (runtime/run.c, ep_layout: expert-parallel groups within pipeline stages run on cpu and sim;
  // the planner does not price them: check_ep, planner/cost.c)
  if (k->ep > 1 && pp > 1) return "expert parallelism within pipeline stages is not planned yet (plans keep pp 1)";
  if (dp > 1 && !k->resident && !zero)
    return "the data-parallel ranks of an offloaded run shard the chunks (pattern zero)";
  // (speculative updates: offload engines' exact step; fy_cost_check_knobs says so too)
  if (k->spec_chunks > 0 && (k->resident || lag))
    return k->resident ? "speculative updates (spec_chunks) are for offloaded runs: a resident run has no host updates"
                       : "speculative updates (spec_chunks) do not combine with --optimizer-lag, which hides the host "
                         "optimizer already";
  if (!cuda) return NULL;
  // (runtime/run.c and train_opts.c: what a GPU run refuses)
  if (k->ep > 1 && (tp > 1 || pp > 1))
    return "expert parallelism on GPUs runs without tensor-parallel slices or pipeline stages (tp 1, pp 1)";
  if (k->resident && lag) return "a resident GPU run updates on the GPU: no --optimizer-lag";
  if (k->resident && compressed) return "a resident GPU run keeps fp32 AdamW state";
  if (k->resident && dp > 1 && zero)
    return "resident data-parallel ranks on GPUs run as replicas (pattern replicate), not with their optimizer state "
           "sharded (zero: ZeRO-1)";
  if (k->resident && tp > 1 && dp > 1)
    return "resident tensor-parallel GPUs run with dp 1 (a grid of data- and tensor-parallel GPUs shards its chunks "
           "offloaded: --offload)";
  return NULL;
}

// One dp x pp x tp layout with offloaded stages (the sim device: runtime/run.c runs each stage on
// its own offload engine): each micro-batch count, recomputation, chunk size (the smallest that
// holds the largest group, and twice it) and prefetch depth, every stage's cache taking as many
// blocks as fit its device and putting on disk what its host share cannot hold (blocks 0 and
// disk_chunks -1 in the plan: each stage's own, as ferry train counts them); the chunks sharded
// over dp (zero).
static fy_status search_offloaded_stages(const struct fy_opt_config *cfg, int64_t per, int64_t seq, int dp, int pp, int tp,
                                         const char *prec, const struct fy_cluster *cl, const struct fy_probe *probe,
                                         struct fy_plan *best, int *tried, double *least, char *least_what,
                                         size_t least_cap) {
  struct fy_graph *g;
  FY_TRY(fy_opt_build_graph_tp(cfg, 1, seq, tp, 0, &g));
  const int64_t min_chunk = fy_chunk_min_elems(g), total = g->n_param_elems, line = 16 * (int64_t)dp;
  fy_graph_free(g);
  // (on a GPU, beside the resident and flat offloaded plans, the smallest chunk alone: its stages'
  // search stays a few seconds for OPT-30B on 8 GPUs)
  const int64_t most_mult = strcmp(probe->device, "cuda") == 0 ? 1 : 2;
  for (int64_t micro = per; micro >= 1; micro--) {
    if (per % micro) continue;
    for (int rc = 0; rc < 2; rc++)
      for (int64_t mult = 1; mult <= most_mult; mult *= 2) {
        if (mult > 1 && min_chunk * mult / 2 > total) break;
        const int64_t ce = (min_chunk * mult + line - 1) / line * line;
        for (int pf = 0; pf <= 4; pf = pf ? pf * 2 : 1) {
          struct fy_plan_knobs k = {.micro_batch = micro, .grad_accum = per / micro, .seq = seq, .chunk_elems = ce,
                                    .prefetch = pf, .recompute = rc, .disk_chunks = -1, .dp = dp, .tp = tp, .pp = pp,
                                    .cluster = *cl};
          snprintf(k.pattern, sizeof k.pattern, "%s", dp > 1 ? "zero" : "replicate");
          snprintf(k.precision, sizeof k.precision, "%s", prec);
          if (fy_plan_refused(probe->device, cfg, &k)) return FY_OK;  // (none of this layout's runs)
          struct fy_cost c;
          FY_TRY(fy_cost_simulate(cfg, &k, probe, &c, NULL));
          ++*tried;
          if (!c.fits && c.device_peak < *least) {
            *least = c.min_device_bytes > c.device_peak ? c.min_device_bytes : c.device_peak;
            snprintf(least_what, least_cap, "%s", c.why);
          }
          struct fy_plan_knobs ks = k;  // (speculative and device updates, each stage's of its chunks)
          struct fy_cost cs = c;
          FY_TRY(try_host_levers(cfg, probe, &ks, &cs, tried, best));
          consider(&ks, &cs, best);
          if (!c.fits) break;  // (more prefetch will not fit either)
        }
      }
  }
  return FY_OK;
}

// The layouts of `ranks` a grid allows that ferry train runs (fy_plan_refused), each priced stage
// by stage (fy_plan_search_grid with a cluster or a fixed axis; or, beside the other plans,
// pp_only: the pp > 1 ones): on a GPU resident on its GPUs unless offload_only, and offloaded, each stage its own chunks, on the sim device, on
// GPUs beside the other plans (pp_only) and with offload_only. A layout of one stage is kept in
// *flat, one of several in *staged (the caller chooses between them).
static fy_status search_layouts(const struct fy_opt_config *cfg, int64_t batch, int64_t seq, int ranks, const char *prec,
                                const struct fy_plan_grid *grid, bool pp_only, bool offload_only,
                                const struct fy_probe *probe, struct fy_plan *flat, struct fy_plan *staged,
                                struct fy_plan *unrun, int *tried, int *layouts, double *least, char *least_what,
                                size_t least_cap) {
  const struct fy_cluster *cl = &grid->cluster;
  const int64_t layers = cfg->num_hidden_layers;
  const bool sim = strcmp(probe->device, "sim") == 0, cuda = strcmp(probe->device, "cuda") == 0;
  const bool resident = !sim && !offload_only, offloaded = sim || (cuda && (pp_only || offload_only));
  for (int tp = 1; tp <= ranks; tp++) {
    if (ranks % tp || cfg->num_attention_heads % tp || cfg->ffn_dim % tp || (grid->tp && tp != grid->tp)) continue;
    if (cl->nodes > 0 && cl->gpus_per_node % tp) continue;  // (tp within a node)
    // (Beside the other plans: pp > 1. The resident tensor-parallel ranks of one stage run as an
    // offload engine with every chunk on its GPU, which the search of dp x tp grids prices as such,
    // device chunks and host memory included.)
    for (int pp = pp_only ? 2 : 1; pp <= ranks / tp && pp <= FY_COST_MAX_STAGES; pp++) {
      if ((ranks / tp) % pp || layers % pp || pp > layers || (grid->pp && pp != grid->pp)) continue;
      const int dp = ranks / tp / pp;
      if ((grid->dp && dp != grid->dp) || batch % dp) continue;
      const int64_t per = batch / dp;
      ++*layouts;
      if (offloaded && pp > 1)  // (each stage offloading its own chunks)
        FY_TRY(search_offloaded_stages(cfg, per, seq, dp, pp, tp, prec, cl, probe, staged, tried, least, least_what,
                                       least_cap));
      if (offloaded && pp == 1 && !pp_only)  // (one stage: an offloaded rank of the grid)
        FY_TRY(search_offloaded_stages(cfg, per, seq, dp, pp, tp, prec, cl, probe, flat, tried, least, least_what,
                                       least_cap));
      for (int64_t micro = per; resident && micro >= 1; micro--) {
        if (per % micro) continue;
        for (int rc = 0; rc < 2; rc++)
          for (int z = 0; z < (dp > 1 ? 2 : 1); z++) {
            struct fy_plan_knobs k = {.micro_batch = micro, .grad_accum = per / micro, .seq = seq, .recompute = rc,
                                      .dp = dp, .tp = tp, .pp = pp, .resident = true, .cluster = *cl};
            snprintf(k.pattern, sizeof k.pattern, "%s", z ? "zero" : "replicate");
            snprintf(k.precision, sizeof k.precision, "%s", prec);
            const char *no = fy_plan_refused(probe->device, cfg, &k);
            if (no) {  // (said when no layout runs: the first refused, while none was priced)
              if (!isfinite(*least) && !least_what[0])
                snprintf(least_what, least_cap, "dp %d x pp %d x tp %d resident, %s: %s", dp, pp, tp, k.pattern, no);
              if (!unrun) continue;
              struct fy_cost c;  // (priced apart: the caller may show it, marked)
              FY_TRY(fy_cost_simulate(cfg, &k, probe, &c, NULL));
              ++*tried;
              consider(&k, &c, unrun);
              continue;
            }
            struct fy_cost c;
            FY_TRY(fy_cost_simulate(cfg, &k, probe, &c, NULL));
            ++*tried;
            if (!c.fits && c.device_peak < *least) {
              *least = c.device_peak;
              snprintf(least_what, least_cap, "%s", c.why);
            }
            consider(&k, &c, pp > 1 ? staged : flat);
          }
      }
    }
  }
  return FY_OK;
}

// A plan of pipeline stages is the more involved run (its bubble, its sends, a rank per stage):
// the fastest plan without them stands when it is within 5% of the stages' (replicas before
// stages when the model fits); stages are chosen when they are faster than that, or alone fit.
static void choose_stages(struct fy_plan *best, const struct fy_plan *staged) {
  if (!staged->predicted.fits) return;
  if (best->predicted.fits && best->predicted.step_s <= 1.05 * staged->predicted.step_s) return;
  *best = *staged;
}

fy_status fy_plan_search_grid(const struct fy_opt_config *cfg, const char *model, int64_t batch, int64_t seq,
                              int ranks, bool offload_only, const char *precision, int optimizer_lag, const char *state,
                              const struct fy_plan_grid *grid, const struct fy_probe *probe, struct fy_plan *best,
                              int *n_tried) {
  const struct fy_plan_grid none = {.dp = 0};
  if (!grid) grid = &none;
  const bool priced = grid->cluster.nodes > 0 || grid->dp || grid->pp || grid->tp;  // (layouts priced, stage by stage)
  if (priced) FY_TRY(check_grid(cfg, batch, ranks, grid));
  struct fy_plan_grid one_node = *grid;  // (priced without a cluster: one machine of the ranks, at comm_gbps)
  if (priced && one_node.cluster.nodes == 0)
    one_node.cluster = (struct fy_cluster){.nodes = 1, .gpus_per_node = ranks, .intra_gbps = fy_probe_comm_gbps(probe),
                                           .inter_gbps = fy_probe_comm_gbps(probe)};
  grid = &one_node;
  const struct fy_cluster *cl = &grid->cluster;
  enum fy_state_format sf = FY_STATE_F32;
  if (state && !fy_state_format_from_name(state, &sf))
    return fy_error_set(FY_ERR_INVALID, "plan: optimizer state '%s': fp32, bf16 or 8bit", state);
  if (sf != FY_STATE_F32) offload_only = true;  // (a resident GPU keeps fp32 state)
  if (batch < 1 || seq < 1) return fy_error_set(FY_ERR_INVALID, "plan: batch and sequence must be positive");
  if (optimizer_lag < 0 || optimizer_lag > 1) return fy_error_set(FY_ERR_INVALID, "plan: optimizer lag 0 or 1");
  if (ranks < 1) return fy_error_set(FY_ERR_INVALID, "plan: the number of ranks must be positive");
  // Every plan tried is for this precision, written out (a plan file says what it was made for).
  enum fy_dtype cdt;
  FY_TRY(fy_cost_check_precision(precision, probe->device, &cdt));
  const char *prec = fy_precision_name(cdt);
  if (optimizer_lag && cdt == FY_F32)
    return fy_error_set(FY_ERR_INVALID, "plan: --optimizer-lag 1 needs 16-bit compute (--precision bf16 or fp16)");
  if (optimizer_lag) offload_only = true;  // (a resident run updates on the device: nothing to hide)
  memset(best, 0, sizeof *best);
  snprintf(best->model, sizeof best->model, "%s", model);
  snprintf(best->pattern, sizeof best->pattern, "replicate");
  best->dp = best->tp = best->pp = best->ep = 1;
  best->machine = *probe;
  int tried = 0, grids = 0;
  double least = INFINITY;
  char least_why[320] = "";
  if (priced) {  // the layouts of the grid stage by stage: resident on GPUs, offloaded on sim or with --offload
    if (optimizer_lag || sf != FY_STATE_F32)
      return fy_error_set(FY_ERR_INVALID, "plan: a cluster or a fixed --dp/--pp/--tp is priced with fp32 AdamW state "
                          "and the exact step (no --optimizer-lag or --optimizer-state)");
    struct fy_plan staged = *best, unrun = *best;
    // A cluster's layouts, or those of the axes given (--dp, --pp, --tp: a published layout), are
    // priced even where ferry train does not run them (resident ZeRO-1 ranks, resident dp x tp
    // grids), so that a machine one does not have can be compared: the fastest of those stands
    // when no layout that runs fits, marked so (plan->refused; --plan refuses it).
    FY_TRY(search_layouts(cfg, batch, seq, ranks, prec, grid, false, offload_only, probe, best, &staged, &unrun, &tried,
                          &grids, &least, least_why, sizeof least_why));
    choose_stages(best, &staged);
    if (n_tried) *n_tried = tried;
    if (!best->predicted.fits && unrun.predicted.fits) {
      struct fy_plan_knobs k = unrun.k;
      const char *no = fy_plan_refused(probe->device, cfg, &k);
      *best = unrun;
      snprintf(best->refused, sizeof best->refused, "%s", no ? no : "");
    }
    if (grids == 0)
      return fy_error_set(FY_ERR_INVALID, "plan: no dp x pp x tp layout of %d ranks for %s: tp must divide the %lld "
                          "heads, the feed-forward size %lld%s, pp the %lld decoder layers, dp the batch of %lld", ranks,
                          model, (long long)cfg->num_attention_heads, (long long)cfg->ffn_dim,
                          cl->nodes > 0 ? " and the GPUs of a node" : "", (long long)cfg->num_hidden_layers,
                          (long long)batch);
    if (!best->predicted.fits && !isfinite(least))
      return fy_error_set(FY_ERR_UNSUPPORTED, "plan: no dp x pp x tp layout of %d ranks for %s that ferry train runs on "
                          "%s: %s%s", ranks, model, probe->device, least_why,
                          offload_only ? "" : " (--offload prices the layout offloaded)");
    if (!best->predicted.fits) {
      char have[32], need[32];
      return fy_error_set(FY_ERR_NOMEM, "no layout of %s with %lld x %lld tokens a step fits %s a GPU; the least any "
                          "needs is %s: %s", model, (long long)batch, (long long)seq,
                          fy_format_bytes(probe->device_mem, have, sizeof have), fy_format_bytes(least, need, sizeof need),
                          least_why);
    }
    return FY_OK;
  }
  struct misses miss = {INFINITY, INFINITY, INFINITY};
  struct fy_plan resident = *best;  // the fastest resident plan (none: predicted.fits false)
  // The grids: tp ranks split each layer (when they divide its heads and feed-forward size), the
  // rest shard the chunks (zero); each data-parallel rank takes batch / dp sequences per step.
  // (A mixture of experts trains with tp too, each expert split: core/opt.c; fy_plan_refused says
  // what does not run.)
  for (int tp = 1; tp <= ranks; tp++) {
    if (ranks % tp || cfg->num_attention_heads % tp || cfg->ffn_dim % tp) continue;
    int dp = ranks / tp;
    if (batch % dp) continue;
    int64_t per_rank = batch / dp;
    grids++;
    // On a GPU, the whole model resident (its ranks replicas) when it fits.
    if (tp == 1 && !offload_only && strcmp(probe->device, "cuda") == 0)
      FY_TRY(search_resident(cfg, dp, per_rank, seq, prec, probe, best, &resident, &tried, NULL));
    {  // (the offloaded ranks of this grid, sharding the chunks over dp: when ferry train runs them)
      struct fy_plan_knobs ko = {.dp = dp, .tp = tp, .optimizer_lag = optimizer_lag};
      snprintf(ko.pattern, sizeof ko.pattern, "%s", dp > 1 ? "zero" : "replicate");
      if (sf != FY_STATE_F32) snprintf(ko.optimizer_state, sizeof ko.optimizer_state, "%s", fy_state_format_name(sf));
      if (fy_plan_refused(probe->device, cfg, &ko)) continue;
    }
    // The chunk sizes to try: the smallest that holds the largest group, and a few multiples.
    struct fy_graph *g;
    FY_TRY(fy_opt_build_graph_tp(cfg, 1, seq, tp, 0, &g));
    if (sf == FY_STATE_Q8) g->chunk_align = FY_Q8_BLOCK;  // (groups packed as the runtime packs them)
    int64_t min_chunk = fy_chunk_min_elems(g), total = g->n_param_elems;
    fy_graph_free(g);
    for (int64_t micro = per_rank; micro >= 1; micro--) {
      if (per_rank % micro || (optimizer_lag && micro != per_rank)) continue;  // (the lag: one micro-batch a step)
      for (int rc = 0; rc < 2; rc++)
        for (int64_t mult = 1; mult <= 4; mult *= 2) {
          if (mult > 1 && min_chunk * mult / 2 > total) break;
          // (sharded over dp ranks: whole 64-byte lines a shard, as a plan file must say)
          // (8-bit state: whole blocks of 256 elements a shard)
          const int64_t line = (sf == FY_STATE_Q8 ? FY_Q8_BLOCK : 16) * (int64_t)dp,
                        ce = (min_chunk * mult + line - 1) / line * line;
          // This chunk size's fastest prefetch without device chunks; none fitting, the first when
          // it fails for the host's memory or the disk alone (device chunks take state off both).
          struct fy_plan_knobs kbest = {0};
          struct fy_cost cbest = {0};
          // A mixture on sim's sharded chunks: each expert-parallel size (ep_sizes), ep 1 first (a
          // tie keeps it: the simpler run). kbest and the device chunks below are ep 1's.
          int eps[16], n_ep = ep_sizes(cfg, probe->device, dp, tp, eps);
          // ep > 1 is taken only when more than 5% faster than ep 1 at the same knobs: its price
          // assumes routing spread evenly over the experts, and a real router is uneven (a rank
          // with more rows holds the all-to-alls up), which the model does not see.
          double ep1_step[4] = {INFINITY, INFINITY, INFINITY, INFINITY};
          for (int e = 0; e < n_ep; e++)
          for (int pf = 0, pi = 0; pf <= 4; pf = pf ? pf * 2 : 1, pi++) {
            struct fy_plan_knobs k = {.micro_batch = micro, .grad_accum = per_rank / micro, .seq = seq,
                                      .chunk_elems = ce, .blocks = 0, .prefetch = pf,
                                      .recompute = rc, .disk_chunks = -1, .dp = dp, .tp = tp,
                                      .optimizer_lag = optimizer_lag, .ep = eps[e]};
            snprintf(k.pattern, sizeof k.pattern, "%s", dp > 1 ? "zero" : "replicate");
            snprintf(k.precision, sizeof k.precision, "%s", prec);
            if (sf != FY_STATE_F32) snprintf(k.optimizer_state, sizeof k.optimizer_state, "%s", fy_state_format_name(sf));
            struct fy_cost c;
            FY_TRY(fy_cost_simulate(cfg, &k, probe, &c, NULL));
            tried++;
            note_miss(&c, probe, &miss);
            // 16-bit compute with a disk tier: the disk chunks' master weights on disk too
            // (disk_master), when some chunks' state goes there or the host cannot hold the plan;
            // kept when it fits where the plan without does not, or runs faster.
            if (cdt != FY_F32 && probe->disk_write_gbps > 0 &&
                (c.n_disk_chunks > 0 || (!c.fits && c.host_bytes > probe->host_mem))) {
              struct fy_plan_knobs km = k;
              km.disk_master = true;
              struct fy_cost cm;
              FY_TRY(fy_cost_simulate(cfg, &km, probe, &cm, NULL));
              tried++;
              note_miss(&cm, probe, &miss);
              if (better(&cm, &c)) k = km, c = cm;
            }
            if (e == 0 && c.fits) ep1_step[pi] = c.step_s;
            if (e == 0 || c.step_s < 0.95 * ep1_step[pi]) consider(&k, &c, best);
            if (e > 0) {
              if (!c.fits) break;
              continue;
            }
            if (pf == 0 && !c.fits && c.min_device_bytes <= probe->device_mem) kbest = k, cbest = c;
            if (!c.fits) break;  // more prefetch will not fit either
            if (better(&c, &cbest)) kbest = k, cbest = c;
          }
          // Speculative updates for this chunk size's fastest prefetch (try_spec; kbest itself stays
          // without them, the device chunks' plans below trying their own).
          if (kbest.micro_batch && cbest.fits) {
            struct fy_plan_knobs ks = kbest;
            struct fy_cost cs = cbest;
            FY_TRY(try_host_levers(cfg, probe, &ks, &cs, &tried, best));
            consider(&ks, &cs, best);
          }
          // One data-parallel rank: chunks kept on the device with their state (updated there),
          // the cache taking what is left (at that prefetch): a quarter, half, three quarters or
          // all of as many as fit beside the smallest cache.
          double room = probe->device_mem - cbest.min_device_bytes;
          int most = kbest.micro_batch && cbest.device_chunk_bytes > 0 && room > 0 ? (int)(room / cbest.device_chunk_bytes)
                                                                                  : 0;
          if (most > cbest.n_chunks) most = cbest.n_chunks;
          for (int q = 1; dp == 1 && q <= 4; q++) {
            struct fy_plan_knobs kd = kbest;
            kd.device_chunks = most * q / 4;
            if (kd.device_chunks < 1 || kd.device_chunks == most * (q - 1) / 4) continue;
            struct fy_cost cd;
            FY_TRY(fy_cost_simulate(cfg, &kd, probe, &cd, NULL));
            tried++;
            note_miss(&cd, probe, &miss);
            const double dev_bytes = cd.min_device_bytes;
            FY_TRY(try_host_levers(cfg, probe, &kd, &cd, &tried, best));
            consider(&kd, &cd, best);
            if (dev_bytes > probe->device_mem) break;  // more device chunks will not fit either
          }
        }
    }
  }
  // A resident plan is the simpler run (no host tier, no cache): it stands when it is within 2% of
  // the fastest (an offloaded plan with every chunk on the device can come out a hair ahead).
  if (resident.predicted.fits && !best->k.resident && resident.predicted.step_s <= 1.02 * best->predicted.step_s)
    *best = resident;
  // Pipelines (pp > 1) that ferry train runs (fy_plan_refused; search_layouts): each stage resident
  // on its GPUs, or offloading its own chunks (sim; GPUs), beside the rest, chosen over them only
  // when clearly faster or alone fitting (choose_stages).
  if (!optimizer_lag && sf == FY_STATE_F32) {
    int layouts = 0;
    struct fy_plan staged = resident;
    staged.predicted.fits = false;
    FY_TRY(search_layouts(cfg, batch, seq, ranks, prec, grid, true, offload_only, probe, best, &staged, NULL, &tried,
                          &layouts, &least, least_why, sizeof least_why));
    grids += layouts;
    choose_stages(best, &staged);
  }
  if (grids == 0)
    return fy_error_set(FY_ERR_INVALID, "plan: no way to lay %d ranks out for %s: the tensor-parallel size must divide "
                        "the %lld heads and the feed-forward size %lld, and the data-parallel size the batch of %lld",
                        ranks, model, (long long)cfg->num_attention_heads, (long long)cfg->ffn_dim, (long long)batch);
  if (n_tried) *n_tried = tried;
  if (!best->predicted.fits) {
    char have[32], need[32], room[32];
    if (isfinite(miss.least_disk) && probe->disk_space > 0 && miss.least_disk > probe->disk_space)
      return fy_error_set(FY_ERR_NOMEM,
                          "no plan for %s with %lld x %lld tokens per step fits the disk tier: the gradients and AdamW "
                          "state that %s of host memory cannot hold need at least %s on disk, and %s has %s for them: "
                          "free some space, use a larger disk, or give more host memory",
                          model, (long long)batch, (long long)seq,
                          fy_format_bytes(probe->host_mem, have, sizeof have),
                          fy_format_bytes(miss.least_disk, need, sizeof need),
                          probe->disk_dir[0] ? probe->disk_dir : "the disk tier",
                          fy_format_bytes(probe->disk_space, room, sizeof room));
    if (isfinite(miss.smallest))
      return fy_error_set(FY_ERR_NOMEM,
                          "no plan for %s with %lld x %lld tokens per step fits %.1f MiB of device memory and %.1f "
                          "GiB of host memory; the smallest device memory that works is %.1f MiB",
                          model, (long long)batch, (long long)seq, probe->device_mem / 1048576.0,
                          probe->host_mem / 1073741824.0, miss.smallest / 1048576.0);
    fy_format_bytes(probe->host_mem, have, sizeof have);
    fy_format_bytes(miss.least_host, need, sizeof need);
    if (probe->disk_write_gbps > 0 && miss.least_host > probe->host_mem)
      return fy_error_set(FY_ERR_NOMEM,
                          "no plan for %s fits %s of host memory: the smallest needs %s there (%s)", model, have, need,
                          cdt == FY_F32 ? "in fp32 the weights stay in host memory; the disk tier takes only gradients "
                                          "and AdamW state"
                                        : "the weights' 16-bit copy stays in host memory; the disk tier takes "
                                          "gradients, AdamW state and the master weights");
    return fy_error_set(FY_ERR_NOMEM,
                        "no plan for %s fits %s of host memory without a disk tier: give a --disk-dir for the AdamW "
                        "state (the smallest plan then needs %s of host memory)", model, have, need);
  }
  if (best->k.pp > 1) return FY_OK;  // (stages: blocks 0 and disk_chunks -1, each stage's own)
  best->k.blocks = best->predicted.n_blocks;
  best->k.disk_chunks = best->predicted.n_disk_chunks;
  return FY_OK;
}

fy_status fy_plan_validate(const struct fy_opt_config *cfg, struct fy_plan *p) {
  struct fy_plan_knobs *k = &p->k;
  if (!fy_pattern_find(p->pattern))
    return fy_error_set(FY_ERR_INVALID, "plan: unknown parallel pattern '%s'", p->pattern);
  if (p->dp < 1 || p->tp < 1) return fy_error_set(FY_ERR_INVALID, "plan: dp and tp must be at least 1");
  if (cfg->num_attention_heads % p->tp || cfg->ffn_dim % p->tp)
    return fy_error_set(FY_ERR_INVALID, "plan: tp %d must divide the %lld heads and the feed-forward size %lld", p->tp,
                        (long long)cfg->num_attention_heads, (long long)cfg->ffn_dim);
  k->dp = p->dp;
  k->tp = p->tp;
  k->pp = p->pp > 1 ? p->pp : 0;
  k->ep = p->ep > 1 ? p->ep : 0;
  snprintf(k->pattern, sizeof k->pattern, "%s", p->pattern);
  FY_TRY(fy_cost_check_knobs(k));
  if (p->ep > 1 && p->pp > 1)
    return fy_error_set(FY_ERR_INVALID, "plan: ep %d with pp %d: expert parallelism is planned without pipeline "
                        "stages (pp 1)", p->ep, p->pp);
  if (p->ep > 1 && (cfg->num_local_experts < 1 || cfg->num_local_experts % p->ep || p->dp % p->ep))
    return fy_error_set(FY_ERR_INVALID, "plan: ep %d must divide the model's experts (%lld) and dp %d", p->ep,
                        (long long)cfg->num_local_experts, p->dp);
  if (p->pp > 1 && (cfg->num_hidden_layers % p->pp || p->pp > cfg->num_hidden_layers))
    return fy_error_set(FY_ERR_INVALID, "plan: pp %d must divide the model's %lld decoder layers (and not exceed them)",
                        p->pp, (long long)cfg->num_hidden_layers);
  enum fy_dtype cdt;
  if (k->precision[0]) FY_TRY(fy_cost_check_precision(k->precision, p->machine.device, &cdt));
  if (p->dp > 1 && k->chunk_elems % (16 * p->dp))
    return fy_error_set(FY_ERR_INVALID, "plan: chunk_elems %lld does not split into %d shards of whole 64-byte lines",
                        (long long)k->chunk_elems, p->dp);
  if (k->chunk_elems % 16)
    return fy_error_set(FY_ERR_INVALID, "plan: chunk_elems %lld is not a multiple of 16 (64 bytes)", (long long)k->chunk_elems);
  if (strcmp(k->optimizer_state, "8bit") == 0 && k->chunk_elems % (FY_Q8_BLOCK * p->dp))
    return fy_error_set(FY_ERR_INVALID, "plan: optimizer_state 8bit needs chunk_elems (%lld) a multiple of %d (blocks of "
                        "%d elements a %s)", (long long)k->chunk_elems, FY_Q8_BLOCK * p->dp, FY_Q8_BLOCK,
                        p->dp > 1 ? "shard" : "chunk");
  struct fy_graph *g;  // (one tensor-parallel rank's part: its groups are what a chunk holds)
  FY_TRY(fy_opt_build_graph_tp(cfg, k->micro_batch, k->seq, p->tp, 0, &g));
  if (strcmp(k->optimizer_state, "8bit") == 0) g->chunk_align = FY_Q8_BLOCK;
  int64_t min_chunk = fy_chunk_min_elems(g);
  fy_graph_free(g);
  if (k->chunk_elems && k->chunk_elems < min_chunk)
    return fy_error_set(FY_ERR_INVALID, "plan: chunk_elems %lld cannot hold the largest parameter group (%lld)",
                        (long long)k->chunk_elems, (long long)min_chunk);
  return FY_OK;
}

fy_status fy_plan_check(const struct fy_opt_config *cfg, struct fy_plan *p, const struct fy_probe *probe) {
  struct fy_plan_knobs *k = &p->k;
  FY_TRY(fy_plan_validate(cfg, p));
  FY_TRY(fy_cost_simulate(cfg, k, probe, &p->predicted, NULL));
  p->machine = *probe;  // (what the prediction is for: printed with it)
  if (!p->predicted.fits) return fy_error_set(FY_ERR_NOMEM, "plan does not fit: %s", p->predicted.why);
  return FY_OK;
}

// The host optimizer's levers of an offloaded plan, a line each (`whose`: "" for one engine,
// "each stage's " where every stage's engine takes as many of its own chunks), with the device
// memory the device updates' staging takes (c->staging_bytes: a stage's most).
static void print_host_levers(FILE *f, const struct fy_plan_knobs *k, const struct fy_cost *c, const char *whose) {
  if (k->spec_chunks > 0)
    fprintf(f, "  speculative updates: %s%d host chunk%s (the first whose gradients the backward completes) updated "
               "by the host as their gradients come home, before the norm, into a spare slot each (ferry train "
               "--spec-chunks %d; priced as if the norm does not clip)\n", whose, k->spec_chunks,
            k->spec_chunks > 1 ? "s" : "", k->spec_chunks);
  char staging[32];
  if (k->device_updates > 0)
    fprintf(f, "  device updates: %s%d host chunk%s (the first after the device chunks) updated on the device each "
               "step, their master and AdamW state over the link and back, a quarter chunk at a time through %s of "
               "staging in device memory (ferry train --device-updates %d)\n",
            whose, k->device_updates, k->device_updates > 1 ? "s" : "",
            fy_format_bytes(c->staging_bytes, staging, sizeof staging), k->device_updates);
}

void fy_plan_print(const struct fy_plan *p, FILE *f) {
  const struct fy_plan_knobs *k = &p->k;
  const struct fy_cost *c = &p->predicted;
  char b1[32], b2[32], b3[32];
  const char *prec = fy_cost_precision(k, p->machine.device);
  fprintf(f, "plan for %s in %s on %s (%s device, %s host, %.0f GFLOP/s in %s, link %.1f/%.1f GB/s)\n", p->model,
          prec, p->machine.device, fy_format_bytes(p->machine.device_mem, b1, sizeof b1),
          fy_format_bytes(p->machine.host_mem, b2, sizeof b2),
          fy_probe_gemm_gflops(&p->machine, strcmp(prec, "bf16") == 0), strcmp(prec, "bf16") == 0 ? "bf16" : "fp32",
          p->machine.h2d_gbps, p->machine.d2h_gbps);
  const bool staged = (k->resident && (p->pp > 1 || p->tp > 1 || k->cluster.nodes > 0)) || p->pp > 1;
  if (k->cluster.nodes > 0)
    fprintf(f, "  cluster: %d nodes of %d GPUs, %.1f GB/s between a node's GPUs, %.1f GB/s a node between nodes\n",
            k->cluster.nodes, k->cluster.gpus_per_node, k->cluster.intra_gbps, k->cluster.inter_gbps);
  if (staged) {
    fprintf(f, "  %d ranks: %d data-parallel (%s) x %d pipeline stages x %d tensor-parallel (tp innermost); per "
               "pipeline micro-batch %lld x %lld tokens, %lld micro-batches a step (1F1B); recompute %s\n",
            p->dp * p->pp * p->tp, p->dp, p->dp > 1 ? p->pattern : "-", p->pp, p->tp, (long long)k->micro_batch,
            (long long)k->seq, (long long)k->grad_accum, k->recompute ? "on" : "off");
    if (k->resident)
      fprintf(f, "  each stage resident on its GPUs (weights, gradients, AdamW state%s and activations); device memory "
                 "a GPU: stage 0 %s, last stage %s, most %s\n", strcmp(p->pattern, "zero") == 0 && p->dp > 1 ?
              " sharded over dp (ZeRO-1)" : "", fy_format_bytes(c->stage_bytes[0], b1, sizeof b1),
              fy_format_bytes(c->stage_bytes[p->pp - 1], b2, sizeof b2), fy_format_bytes(c->device_peak, b3, sizeof b3));
    else {
      char b4[32], b5[32];
      fprintf(f, "  each stage offloads its own chunks (chunks of %s%s, prefetch %d, each stage's cache as many blocks "
                 "as fit); device memory a rank: stage 0 %s, last stage %s; host %s, disk %s (most of a stage)\n",
              fy_format_bytes(c->chunk_bytes, b1, sizeof b1), p->dp > 1 ? ", sharded over dp" : "", k->prefetch,
              fy_format_bytes(c->stage_bytes[0], b2, sizeof b2), fy_format_bytes(c->stage_bytes[p->pp - 1], b3, sizeof b3),
              fy_format_bytes(c->host_bytes, b4, sizeof b4), fy_format_bytes(c->disk_bytes, b5, sizeof b5));
      print_host_levers(f, k, c, "each stage's ");
    }
    fprintf(f, "  per step: the slowest stage (%d) computes %.3f s a micro-batch; pipeline bubble %.1f%% ((p - 1)/(m + p - 1) "
               "= %.1f%% for equal stages), sends on the path %.3f s, tp collectives %.3f s, dp gradients %.3f s, "
               "optimizer %.3f s\n", c->slowest_stage, c->stage_s[c->slowest_stage], 100 * c->bubble,
            100.0 * (p->pp - 1) / (double)(k->grad_accum + p->pp - 1), c->p2p_s, c->tp_comm_s, c->dp_comm_s, c->optim_s);
  } else if (p->dp * p->tp == 1)
    fprintf(f, "  micro-batch %lld x %lld tokens, %lld accumulated; one rank\n", (long long)k->micro_batch,
            (long long)k->seq, (long long)k->grad_accum);
  else if (k->resident)
    fprintf(f, "  %d ranks: replicas, one GPU each, whose gradients are summed every step; per rank micro-batch "
               "%lld x %lld tokens, %lld accumulated\n", p->dp, (long long)k->micro_batch, (long long)k->seq,
            (long long)k->grad_accum);
  else
    fprintf(f, "  %d ranks: %d data-parallel (%s) x %d tensor-parallel (tp_col / tp_row); per data-parallel rank "
               "micro-batch %lld x %lld tokens, %lld accumulated\n", p->dp * p->tp, p->dp, p->pattern, p->tp,
            (long long)k->micro_batch, (long long)k->seq, (long long)k->grad_accum);
  if (p->ep > 1)
    fprintf(f, "  expert parallelism: ep %d (ferry train --ep %d): each rank computes E/%d experts of every mixture layer "
               "on the rows its group routes to them, moved by all-to-alls forward and backward (the expert pattern)\n",
            p->ep, p->ep, p->ep);
  if (k->resident && !staged) {
    fprintf(f, "  resident: weights, gradients, AdamW state and activations on the device, the optimizer there "
               "too (ferry train --device cuda, no --offload); recompute %s\n", k->recompute ? "on" : "off");
    fprintf(f, "  memory per rank: device %s (peak)\n", fy_format_bytes(c->device_peak, b1, sizeof b1));
  } else if (!staged) {
    fprintf(f, "  %d chunks of %s, %d device cache blocks, prefetch %d, recompute %s\n", c->n_chunks,
            fy_format_bytes(c->chunk_bytes, b1, sizeof b1), c->n_blocks, k->prefetch, k->recompute ? "on" : "off");
    if (c->n_device_chunks > 0)
      fprintf(f, "  the first %d chunks kept on the device with their gradients and AdamW state (updated there)\n",
              c->n_device_chunks);
    print_host_levers(f, k, c, "");
    if (k->disk_master)
      fprintf(f, "  the disk chunks' fp32 master weights on disk too, read and written with their AdamW state; host "
                 "memory keeps their 16-bit copy (ferry train --disk-master)\n");
    fprintf(f, "  memory per rank: device %s (peak), host %s, disk %s (state of %d chunks)\n",
            fy_format_bytes(c->device_peak, b1, sizeof b1), fy_format_bytes(c->host_bytes, b2, sizeof b2),
            fy_format_bytes(c->disk_bytes, b3, sizeof b3), c->n_disk_chunks);
  }
  const bool bf16 = strcmp(prec, "bf16") == 0, gpu = strcmp(p->machine.device, "cuda") == 0;
  // (model FLOPs as PaLM and Megatron count them: fy_opt_step_flops)
  fprintf(f, "  predicted: %.3f s/step, %.0f tokens/s, MFU (PaLM's FLOP count) %.1f%% of the device's measured GEMM rate",
          c->step_s, c->tokens_per_s, 100 * c->mfu);
  if (c->peak_gflops > 0)
    fprintf(f, ", %.1f%% of its peak (%.0f %s, %s)\n", 100 * c->mfu_peak,
            c->peak_gflops >= 1e4 ? c->peak_gflops / 1e3 : c->peak_gflops, c->peak_gflops >= 1e4 ? "TFLOP/s" : "GFLOP/s",
            gpu ? (bf16 ? "dense bf16" : "fp32, no TF32") : (bf16 ? "bf16 from the fp32 FMA peak" : "fp32 FMA, all cores"));
  else
    fprintf(f, "; its peak is unknown (give --device-peak-tflops), so MFU of the peak is taken as the same\n");
  if (staged)
    fprintf(f, "  bottleneck: %s\n", c->bottleneck);
  else
    fprintf(f, "  busy per step: compute %.3f s, to device %.3f s, to host %.3f s, optimizer %.3f s; bottleneck: %s\n",
            c->compute_s, c->h2d_s, c->d2h_s, c->optim_s, c->bottleneck);
  if (!k->resident) {  // (ferry train --profile measures the same)
    fprintf(f, "  compute waited per step:");
    fy_stall_print(f, c->stall_s);
  }
  if (k->optimizer_state[0] && strcmp(k->optimizer_state, "fp32") != 0)
    fprintf(f, "  AdamW state stored as %s (ferry train --optimizer-state %s)\n", k->optimizer_state, k->optimizer_state);
  if (k->optimizer_lag)
    fprintf(f, "  optimizer lag 1: each step's host updates run under the next step (ferry train --optimizer-lag 1; "
               "other numbers than the exact step's)\n");
  if (p->dp * p->tp > 1 && !staged)
    fprintf(f, "  collectives per step: %.3f s of the above at %.1f GB/s between ranks\n", c->comm_s,
            fy_probe_comm_gbps(&p->machine));
  if (p->refused[0])
    fprintf(f, "  priced only: ferry train does not run this layout on %s yet (%s); none of the layouts it "
               "runs fits\n", p->machine.device, p->refused);
}
