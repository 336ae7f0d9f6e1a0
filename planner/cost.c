#include "planner/cost.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/graph.h"
#include "memory/cache.h"
#include "memory/chunk.h"
#include "memory/device_cache.h"
#include "ops/cuda/parts.h"
#include "ops/ops.h"
#include "planner/pattern.h"
#include "planner/profile.h"
#include "planner/timeline.h"

#define FAKE_HOST ((uintptr_t)1 << 40)  // host addresses of the simulation: never dereferenced
// On the sim device the "device" is the host's own cores, which also run the copy engines'
// memcpy and the host optimizer: a kernel call costs a dispatch to the compute stream's thread and
// waking its OpenMP helpers (the probe's kernel_overhead_us; this when a probe file lacks it), and
// host work takes its time from the kernels instead of overlapping with them.
#define SIM_OP_OVERHEAD 30e-6
// A speculative host update (knobs.spec_chunks) against the same update in place: its outputs go
// to a spare slot (measured 1.1-1.6x on the 2-core dev machine; see the timeline below).
#define SPEC_UPDATE_COST 1.25

static double sim_op_overhead(const struct fy_probe *p) {
  // (On the cpu device the kernels run on the calling thread, whose team is the process's only
  // one and spins between regions: opt-demo's 4 x 128 step came out 17% long with the default.)
  if (strcmp(p->device, "cpu") == 0) return 0;
  return p->kernel_overhead_us > 0 ? p->kernel_overhead_us * 1e-6 : SIM_OP_OVERHEAD;
}

// runtime/offload.c: the fp32 master and, with a 16-bit payload, its copy in that dtype stay on
// the host; m and v of a chunk, and its fp32 gradients unless they come home over the 16-bit
// copy (one micro-batch a step), may go to disk.
static double host_weight_bytes(enum fy_dtype compute, int payload_bytes) {
  return 4.0 + (compute != FY_F32 ? payload_bytes : 0);
}

// Whether a chunk's gradients come home over its 16-bit copy (runtime/offload.c,
// fy_offload_grads_in_copy): no fp32 gradients in the host tier or on disk.
static bool grads_in_copy(enum fy_dtype compute, bool accumulate) { return compute != FY_F32 && !accumulate; }

static double host_state_bytes(enum fy_dtype compute, bool accumulate) {
  return 8.0 + (grads_in_copy(compute, accumulate) ? 0.0 : 4.0);
}

double fy_cost_host_bytes_per_param(enum fy_dtype compute, int payload_bytes, bool accumulate) {
  return host_weight_bytes(compute, payload_bytes) + host_state_bytes(compute, accumulate);
}

// The knobs' state format (checked by fy_cost_check_knobs).
static enum fy_state_format knob_state(const char *name) {
  enum fy_state_format f = FY_STATE_F32;
  if (name && name[0]) fy_state_format_from_name(name, &f);
  return f;
}

// Host bytes of a chunk's (gradients,) m and v, `elems` elements of it (a rank's shard), as
// runtime/offload.c allocates them: fp32 gradients unless they come home over the 16-bit copy,
// and a moment's buffer of fy_state_moment_bytes each.
static double chunk_state_bytes(enum fy_dtype compute, bool accumulate, enum fy_state_format f, int64_t elems) {
  return (grads_in_copy(compute, accumulate) ? 0.0 : 4.0 * (double)elems) + 2.0 * (double)fy_state_moment_bytes(f, elems);
}

double fy_cost_host_bytes_per_param_state(enum fy_dtype compute, int payload_bytes, bool accumulate, const char *state,
                                          int64_t chunk_elems) {
  const enum fy_state_format f = knob_state(state);
  if (f == FY_STATE_F32 || chunk_elems < 1) return fy_cost_host_bytes_per_param(compute, payload_bytes, accumulate);
  return host_weight_bytes(compute, payload_bytes) + chunk_state_bytes(compute, accumulate, f, chunk_elems) / (double)chunk_elems;
}

void fy_cost_disk_chunk_bytes_per_param(enum fy_dtype compute, int payload_bytes, bool accumulate, const char *state,
                                        int64_t chunk_elems, bool disk_master, double *host, double *disk) {
  const enum fy_state_format f = knob_state(state);
  const bool dm = disk_master && compute != FY_F32;
  if (chunk_elems < 1) chunk_elems = 1;
  *host = host_weight_bytes(compute, payload_bytes) - (dm ? 4.0 : 0.0);
  *disk = (f == FY_STATE_F32 ? host_state_bytes(compute, accumulate)
                             : chunk_state_bytes(compute, accumulate, f, chunk_elems) / (double)chunk_elems) +
          (dm ? 4.0 : 0.0);
}

static fy_status fake_spill_alloc(void *ctx, size_t n, void **out) {
  uintptr_t *next = ctx;
  *out = (void *)*next;
  *next += fy_device_round(n, FY_HOST_ALLOC_GRANULE);
  return FY_OK;
}
static void fake_spill_free(void *ctx, void *p, size_t n) {}

struct sim {
  // Ranks: the chunk-level collectives of the zero pattern, timed on the stream they run on.
  double gather_s, scatter_s, comm_s;
  // A mixture's sharded chunks (on sim, any ep): per chunk, the elements a rank's loads leave out
  // in expectation (every expert but its own that got rows) and its write-backs (the other ranks'
  // experts), and the seconds of the collectives an element (ep_skips).
  double *ep_skip, *ep_skip_out, ep_elem_s;
  int dp;
  int64_t ce;
  size_t pb;
  bool counting;
  struct fy_device *dev;
  fy_stream *compute, *copy_in, *copy_out, *optim;
  fy_stream *sums;  // optimizer_lag: the sums of squares and the norm, beside the updates (offload.c)
  fy_event **home_ready, **grad_ready, *batch_ready, *norm_ready, *dev_sums_ready;
  fy_event **home_ready_alt;  // optimizer_lag: the other 16-bit copy's (runtime/offload.c)
  // Device updates (knobs.device_updates; runtime/offload.c, dup_up, dup_run, dup_down): the
  // streams that copy a streamed chunk in, update it and copy it home, and per staging set the
  // events of its upload, its update and each of its buffers' copy home (master, m, v, 16-bit
  // copy); its buffers (dup_buf's order).
  fy_stream *dup_up, *dup_run, *dup_down;
  fy_event *dup_in[2], *dup_done[2], *dup_free[2][4];
  void *dup_set[2][5], *dup_scale;
  int64_t dup_shard;  // a sharded rank's elements of a chunk (its shard), else 0: the chunk's
  int64_t dup_piece;  // the elements of a piece (fy_chunk_piece_elems), what a staging set holds
  // The step's streamed chunks in order (dup_chunk[0 .. dup_n), dup_idx[c] the index of chunk c or
  // -1), and the next copy to queue: chunk dup_i's piece dup_k's upload dup_copy, the step's piece
  // dup_p (dup_flush).
  int *dup_chunk, *dup_idx, dup_n, dup_i, dup_k, dup_p, dup_copy;
  int *dup_seen, dup_call;  // (dup_before_access: the chunks a prefetch's walk has met)
  double *dup_home;         // when each queued chunk is home (its home_ready), by index
  // What a streamed chunk's copies and update take (simulate_one fills them in).
  const struct fy_chunk_layout *l;
  enum fy_state_format sf;
  bool gpu, act16, g16, f32;  // (and pb, the payload's bytes)
  double mv_bpp, dev_mem, mem, adamw_s, *host_work;
  struct fy_device_cache *cache;
  struct fy_trace *trace;
  struct fy_action *actions;
  int n_actions;
  const float **home;
  uintptr_t spill_next;
};

static void sim_free(struct sim *s, int nc) {
  fy_device_cache_free(s->cache);
  fy_trace_free(s->trace);
  for (int c = 0; c < nc; c++) {
    if (s->home_ready) fy_event_free(s->home_ready[c]);
    if (s->home_ready_alt) fy_event_free(s->home_ready_alt[c]);
    if (s->grad_ready) fy_event_free(s->grad_ready[c]);
  }
  free(s->home_ready);
  free(s->home_ready_alt);
  free(s->grad_ready);
  fy_event_free(s->batch_ready);
  fy_event_free(s->norm_ready);
  fy_event_free(s->dev_sums_ready);
  fy_stream_free(s->compute);
  fy_stream_free(s->copy_in);
  fy_stream_free(s->copy_out);
  fy_stream_free(s->optim);
  fy_stream_free(s->sums);
  free(s->dup_chunk);
  free(s->dup_idx);
  free(s->dup_seen);
  free(s->dup_home);
  fy_stream_free(s->dup_up);
  fy_stream_free(s->dup_run);
  fy_stream_free(s->dup_down);
  for (int i = 0; i < 2; i++) {
    fy_event_free(s->dup_in[i]);
    fy_event_free(s->dup_done[i]);
    for (int b = 0; b < 4; b++) fy_event_free(s->dup_free[i][b]);
  }
  free(s->actions);
  free(s->home);
  free(s->ep_skip);
  free(s->ep_skip_out);
}

// ---- mixtures of experts: the loads that depend on the routing ----
//
// An offloaded mixture's chunk is loaded without its experts' weights, then only the experts that
// got tokens (runtime/offload.c, docs/offloading.md). Which ones depends on the data; the plan
// takes the expectation under routing spread evenly: each of a micro-batch's N tokens picks K of
// the E experts, so an expert goes without all N with probability (1 - K/E)^N (independent
// tokens), and a load moves 1 - (1 - K/E)^N of the experts' bytes in expectation. A router whose
// choices are uneven (early in training, or one that collapsed) leaves more experts idle, so this
// is the load's upper side: it is exact for one token and tends to every expert as N grows.
struct moe_sim {
  const struct fy_graph *g;
  const struct fy_chunk_layout *l;
  const float *const *home;
  size_t pb;
  double tokens;
};

// The elements of chunk c a load is expected to move: all but the idle experts' share.
static double moe_expected_elems(const struct moe_sim *m, int c) {
  double elems = (double)m->l->chunks[c].used;
  for (int o = 0; o < m->g->n_ops; o++) {
    const struct fy_op *op = &m->g->ops[o];
    if (op->kind != FY_OP_MOE || m->g->params[op->params[0]].chunk != c) continue;
    double experts = 0;  // the stacked parameters (all but the router, params[0])
    for (int k = 1; k < op->n_params; k++) experts += (double)m->g->params[op->params[k]].numel;
    elems -= experts * pow(1.0 - (double)op->top_k / (double)op->experts, m->tokens);
  }
  return elems;
}

// The cache's load hook on the timeline: a mixture's chunk moves its expected bytes.
static fy_status moe_sim_load(void *ctx, int chunk, void *block, fy_stream *s, bool *done) {
  const struct moe_sim *m = ctx;
  const double elems = moe_expected_elems(m, chunk);
  if (elems >= (double)m->l->chunks[chunk].used) return FY_OK;  // (no mixture in it)
  *done = true;
  return fy_copy_async(s, block, m->home[chunk], (size_t)(elems * (double)m->pb));
}

// Expert parallelism (knobs.ep > 1): what runs it, runtime/ep.c on sim, where every chunk is
// sharded over the data-parallel ranks (pattern zero) and every rank's chunks keep every expert.
// A rank then computes its E/ep experts on the rows all ep ranks of its group routed to them: with
// routing spread evenly, ep ranks' BT k rows times its share 1/ep of the experts, BT k rows, as
// many as one rank computes without ep; so the compute is the op's own (fy_profile_op's), the
// state is zero's, and ep adds the expert pattern's all-to-alls, forward and backward, on the
// data-parallel link (pattern_seconds). What it takes away: a rank's load of a mixture's chunk
// brings only its own experts' ranges, of those only the ones that got rows (runtime/offload.c,
// "expert parallelism over sharded chunks"): its shard of them over the link, the other shards'
// parts by ranged all-to-alls; the write-back's ranged reduce-scatter moves its own experts' whole.
// So a chunk's loads and gathers leave out all its experts but the expected used share of a rank's
// 1/ep of them, and its scatters (ep - 1)/ep of them (ep_skips). The experts' fetch after the
// router is taken as part of the load, where it waits on the compute stream in the runtime.
// Sharded ranks without ep (on sim) load the experts their own tokens chose the same way: ep 1.
static fy_status check_ep(const struct fy_opt_config *cfg, const struct fy_plan_knobs *k, bool gpu,
                          const struct fy_pattern *dpp) {
  if (k->ep < 0) return fy_error_set(FY_ERR_INVALID, "plan: ep %d must be positive", k->ep);
  if (k->ep <= 1) return FY_OK;
  const int dp = k->dp > 1 ? k->dp : 1;
  if (cfg->num_local_experts < 1)
    return fy_error_set(FY_ERR_INVALID, "plan: ep %d splits a mixture's experts; this model has none", k->ep);
  if (cfg->num_local_experts % k->ep || dp % k->ep)
    return fy_error_set(FY_ERR_INVALID, "plan: ep %d must divide the %lld experts and the %d data-parallel ranks", k->ep,
                        (long long)cfg->num_local_experts, dp);
  if (gpu || k->resident || (k->pp > 1) || dpp != &fy_pattern_zero)
    return fy_error_set(FY_ERR_INVALID, "plan: ep %d is planned offloaded on sim, its chunks sharded over the "
                        "data-parallel ranks (pattern zero, any tp, no pipeline): what runs expert parallelism "
                        "offloaded", k->ep);
  return FY_OK;
}

// A chunk's collective on the timeline (the cache's shard hooks): seconds of `what` on stream s.
static fy_status sim_collective(struct sim *x, double seconds, const char *what, fy_stream *s) {
  fy_timeline_run(s, seconds, what);
  if (x->counting) x->comm_s += seconds;
  return FY_OK;
}
// (ep: a chunk's collective less the elements it leaves out, skip of them at ep_elem_s)
static double ep_less(const struct sim *x, const double *skip, int chunk) { return skip ? skip[chunk] * x->ep_elem_s : 0; }
static fy_status sim_gather(void *ctx, int chunk, float *block, fy_stream *s) {
  const struct sim *x = ctx;
  (void)block;
  return sim_collective(ctx, x->gather_s - ep_less(x, x->ep_skip, chunk), "all-gather", s);
}
static fy_status sim_scatter(void *ctx, int chunk, float *block, fy_stream *s) {
  const struct sim *x = ctx;
  (void)block;
  return sim_collective(ctx, x->scatter_s - ep_less(x, x->ep_skip_out, chunk), "reduce-scatter", s);
}
// The sharded load's own part of a mixture's chunk: this rank's shard less its share of the experts it leaves out.
static fy_status ep_sim_load(void *ctx, int chunk, void *block, fy_stream *s, bool *done) {
  const struct sim *x = ctx;
  if (x->ep_skip[chunk] <= 0) return FY_OK;
  *done = true;
  return fy_copy_async(s, block, x->home[chunk], (size_t)(((double)x->ce - x->ep_skip[chunk]) / x->dp * (double)x->pb));
}

// The elements of each chunk an ep rank leaves out, per chunk: of its loads (skip_in) all of its
// mixtures' experts but its own 1/ep of them that got rows, an expert getting none of its group's
// ep x tokens rows with probability (1 - K/E)^(ep tokens) as moe_sim takes it; of its write-backs
// (skip_out) the other ranks' (ep - 1)/ep of them. (ep 1: a sharded rank without expert
// parallelism, which loads the experts its own tokens chose and writes back every expert.)
static void ep_skips(const struct fy_graph *g, int ep, double tokens, double *skip_in, double *skip_out) {
  for (int o = 0; o < g->n_ops; o++) {
    const struct fy_op *op = &g->ops[o];
    if (op->kind != FY_OP_MOE) continue;
    double experts = 0;  // the stacked parameters (all but the router, params[0])
    for (int k = 1; k < op->n_params; k++) experts += (double)g->params[op->params[k]].numel;
    const double used = 1.0 - pow(1.0 - (double)op->top_k / (double)op->experts, ep * tokens);
    skip_in[g->params[op->params[0]].chunk] += experts * (1.0 - used / ep);
    skip_out[g->params[op->params[0]].chunk] += experts * (ep - 1.0) / ep;
  }
}

// Seconds of a pattern's steps for `phase`, each group's collectives at its bus bandwidth bw[group]
// (B/s; FY_PATTERN_GROUP_DP, FY_PATTERN_GROUP_TP): a ring all-reduce moves 2(n-1)/n of the buffer
// per rank, the other collectives (n-1)/n.
static double pattern_seconds(const struct fy_pattern *p, const struct fy_pattern_ctx *c, int phase, const double bw[2]) {
  struct fy_comm_step st[FY_PATTERN_MAX_STEPS];
  int n = p->comm(c, phase, st, FY_PATTERN_MAX_STEPS);
  double t = 0;
  for (int i = 0; i < n; i++) {
    double ranks = fy_pattern_group_size(c, st[i].group);
    if (ranks <= 1) continue;
    double f = st[i].op == FY_COMM_ALL_REDUCE ? 2 * (ranks - 1) / ranks : (ranks - 1) / ranks;
    t += f * st[i].bytes / bw[st[i].group == FY_PATTERN_GROUP_TP];
  }
  return t;
}

double fy_cluster_group_gbps(const struct fy_cluster *cl, const struct fy_probe *p, int n, int stride) {
  if (!cl || cl->nodes < 1 || cl->gpus_per_node < 1) return fy_probe_comm_gbps(p);
  const int G = cl->gpus_per_node;
  if (stride < 1) stride = 1;
  // q of the group's ranks on a node (its ranks are stride apart, nodes G ranks wide)
  int q = stride >= G ? 1 : G / stride;
  if (q > n) q = n;
  if (n <= 1 || (q >= n && stride * (n - 1) < G)) return cl->intra_gbps;
  const double net = cl->inter_gbps * q / G;  // the node's network over the G / q groups crossing it
  return q > 1 && cl->intra_gbps < net ? cl->intra_gbps : net;
}

double fy_cluster_p2p_gbps(const struct fy_cluster *cl, const struct fy_probe *p, int a, int b, int tp) {
  if (!cl || cl->nodes < 1 || cl->gpus_per_node < 1) return fy_probe_comm_gbps(p);
  const int G = cl->gpus_per_node;
  if (a / G == b / G) return cl->intra_gbps;
  return cl->inter_gbps / (tp < G ? (tp > 1 ? tp : 1) : G);
}

static void bump(fy_stream *s, double t) {
  double c = fy_timeline_clock(s);
  if (t > c) fy_timeline_run(s, t - c, NULL);
}

const char *fy_cost_default_precision(const char *device) {
  return device && strcmp(device, "cuda") == 0 ? "bf16" : "fp32";
}

const char *fy_cost_precision(const struct fy_plan_knobs *k, const char *device) {
  return k->precision[0] ? k->precision : fy_cost_default_precision(device);
}

fy_status fy_cost_check_precision(const char *precision, const char *device, enum fy_dtype *dt) {
  const char *p = precision && precision[0] ? precision : fy_cost_default_precision(device);
  if (!fy_precision_dtype(p, dt)) return fy_error_set(FY_ERR_INVALID, "plan: precision '%s': fp32, bf16 or fp16", p);
  if (*dt == FY_F16 && strcmp(device, "cuda") == 0)
    return fy_error_set(FY_ERR_INVALID, "plan: precision fp16 runs on cpu and sim; on a GPU bf16 or fp32");
  return FY_OK;
}

// The plan's compute dtype (its precision checked by fy_cost_simulate).
static enum fy_dtype compute_dtype(const struct fy_plan_knobs *k, const struct fy_probe *probe) {
  enum fy_dtype dt = FY_F32;
  fy_precision_dtype(fy_cost_precision(k, probe->device), &dt);
  return dt;
}

// What follows from a step's time and busy streams: tokens/s, MFU (of the device's measured GEMM
// rate in the plan's precision, and of its peak where known) and the busiest stream's name.
static void step_rates(struct fy_cost *c, const struct fy_plan_knobs *k, const struct fy_probe *probe) {
  c->clip_step_s = c->step_s;
  const int dp = k->dp > 1 ? k->dp : 1, tp = k->tp > 1 ? k->tp : 1, pp = k->pp > 1 ? k->pp : 1;
  c->tokens_per_s = (double)(k->micro_batch * k->seq * k->grad_accum * dp) / c->step_s;
  const bool bf16 = compute_dtype(k, probe) == FY_BF16;
  const double gpus = (double)dp * tp * pp;
  c->mfu = c->flops_per_step / c->step_s / (fy_probe_gemm_gflops(probe, bf16) * 1e9 * gpus);
  c->peak_gflops = fy_probe_peak_gflops(probe, bf16);
  c->mfu_peak = c->peak_gflops > 0 ? c->flops_per_step / c->step_s / (c->peak_gflops * 1e9 * gpus) : c->mfu;
  if (c->pp > 0) return;  // (a plan costed stage by stage names its own)
  const char *names[] = {"compute", "copy to device", "copy to host", "optimizer"};
  const double busy[4] = {c->compute_s, c->h2d_s, c->d2h_s, c->optim_s};
  int worst = 0;
  for (int i = 1; i < 4; i++)
    if (busy[i] > busy[worst]) worst = i;
  snprintf(c->bottleneck, sizeof c->bottleneck, "%s", names[worst]);
}

// A knob of the host optimizer's levers (spec_chunks, device_updates: `key`, doing `what`), n of
// them: not negative, and none where `no` says why the plan cannot have them (NULL: it can).
static fy_status check_host_lever(int n, const char *key, const char *what, const char *no) {
  if (n < 0) return fy_error_set(FY_ERR_INVALID, "plan: %s must not be negative", key);
  if (n > 0 && no)
    return fy_error_set(FY_ERR_INVALID, "plan: %s %d: %s are planned for offloaded runs without optimizer_lag (%s); %s "
                        "must be 0", key, n, what, no, key);
  return FY_OK;
}

fy_status fy_cost_check_knobs(const struct fy_plan_knobs *k) {
  if (k->micro_batch < 1 || k->grad_accum < 1 || k->seq < 1 || k->prefetch < 0 || k->blocks < 0)
    return fy_error_set(FY_ERR_INVALID, "plan: micro_batch, grad_accum, seq must be positive, prefetch and blocks >= 0");
  if (k->device_chunks < 0) return fy_error_set(FY_ERR_INVALID, "plan: device_chunks must not be negative");
  enum fy_dtype dt;
  if (k->precision[0] && !fy_precision_dtype(k->precision, &dt))
    return fy_error_set(FY_ERR_INVALID, "plan: precision '%s': fp32, bf16 or fp16", k->precision);
  enum fy_state_format sf;
  if (k->optimizer_state[0] && !fy_state_format_from_name(k->optimizer_state, &sf))
    return fy_error_set(FY_ERR_INVALID, "plan: optimizer_state '%s': fp32, bf16 or 8bit", k->optimizer_state);
  if (k->resident && knob_state(k->optimizer_state) != FY_STATE_F32)
    return fy_error_set(FY_ERR_INVALID, "plan: a resident plan keeps fp32 AdamW state (optimizer_state %s is for "
                        "offloaded plans)", k->optimizer_state);
  if (k->disk_master && (k->resident || k->disk_chunks == 0))
    return fy_error_set(FY_ERR_INVALID, "plan: disk_master puts the disk chunks' master weights on disk: an offloaded "
                        "plan with disk chunks (disk_chunks -1 or more than 0)");
  if (k->device_chunks > 0 && k->dp > 1)
    return fy_error_set(FY_ERR_INVALID, "plan: chunks kept on the device (device_chunks) do not combine with %d "
                        "data-parallel ranks, whose chunks are sharded", k->dp);
  if (k->pp < 0 || k->pp > FY_COST_MAX_STAGES)
    return fy_error_set(FY_ERR_INVALID, "plan: pp %d: 1 to %d pipeline stages", k->pp, FY_COST_MAX_STAGES);
  // Speculative updates hide the host optimizer of the exact step of offload engines (one rank,
  // tp slices, sharded data-parallel ranks, each offloaded pipeline stage its own chunks): the lag
  // hides it already, and a resident run has no host updates (runtime/offload.h, spec_chunks).
  FY_TRY(check_host_lever(k->spec_chunks, "spec_chunks", "speculative updates",
                          k->resident           ? "a resident plan has no host updates"
                          : k->optimizer_lag > 0 ? "optimizer_lag 1 hides the host optimizer already"
                                                 : NULL));
  // Device updates take host-tier chunks off the host optimizer of the exact step of offload
  // engines (one rank, tp slices, sharded data-parallel ranks: a rank its shards; each offloaded
  // pipeline stage its own chunks); ferry train refuses them with the lag and without a host tier
  // (a resident run, the cpu device: refused by fy_cost_simulate, which knows the device)
  // (runtime/offload.h, device_updates).
  FY_TRY(check_host_lever(k->device_updates, "device_updates", "device updates",
                          k->resident           ? "a resident plan updates everything on the device already"
                          : k->optimizer_lag > 0 ? "optimizer_lag 1 runs the updates under the next step already"
                                                 : NULL));
  if (k->cluster.nodes < 0 || k->cluster.gpus_per_node < 0 || k->cluster.intra_gbps < 0 || k->cluster.inter_gbps < 0 ||
      (k->cluster.nodes > 0 && (k->cluster.gpus_per_node < 1 || !(k->cluster.intra_gbps > 0) || !(k->cluster.inter_gbps > 0))))
    return fy_error_set(FY_ERR_INVALID, "plan: a cluster is nodes >= 1 of gpus_per_node >= 1 GPUs with positive "
                        "intra- and inter-node bandwidths");
  if (!k->resident) return FY_OK;
  if (k->chunk_elems || k->blocks || k->prefetch || k->disk_chunks > 0 || k->device_chunks)
    return fy_error_set(FY_ERR_INVALID, "plan: a resident plan has no chunks, cache blocks, prefetch, disk or device "
                        "chunks (chunk_elems, blocks, prefetch, disk_chunks and device_chunks must be 0)");
  if (k->pp > 1 || k->tp > 1 || k->cluster.nodes > 0) {  // (costed stage by stage: replicate, or zero as ZeRO-1)
    if (k->dp > 1 && k->pattern[0] && strcmp(k->pattern, "replicate") != 0 && strcmp(k->pattern, "zero") != 0)
      return fy_error_set(FY_ERR_INVALID, "plan: the data-parallel ranks of pipeline stages replicate their state or "
                          "shard it (zero), not %s", k->pattern);
    return FY_OK;
  }
  if (k->dp > 1 && k->pattern[0] && strcmp(k->pattern, "replicate") != 0)
    return fy_error_set(FY_ERR_INVALID, "plan: the data-parallel ranks of a resident plan of one stage are replicas "
                        "(pattern replicate), not %s", k->pattern);
  return FY_OK;
}

// The graph of a model resident on a GPU as the cuda engine runs it.
static fy_status resident_graph(const struct fy_opt_config *cfg, int64_t B, int64_t T, bool recompute, bool train,
                                bool bf16, struct fy_graph **out) {
  FY_TRY(fy_opt_build_graph(cfg, B, T, out));
  fy_graph_set_flash_attention(*out, true);
  if (recompute) fy_graph_set_recompute(*out, true);
  if (!train) fy_graph_set_forward_only(*out);
  fy_status st = bf16 ? fy_graph_set_act16(*out, true) : FY_OK;
  if (st != FY_OK) fy_graph_free(*out);
  return st;
}

// Its bytes on the GPU, and of them the state's: fp32 weights; gradients, m, v (and their sum);
// the 16-bit weights (and gradients).
static void resident_bytes(const struct fy_graph *g, int64_t hidden, bool train, bool bf16, bool accumulate,
                           double *bytes, double *state_bytes) {
  accumulate = accumulate && train;
  *bytes = fy_graph_model_bytes(g, hidden, train, bf16, accumulate, FY_CUDA_ALLOC_GRANULE) +
           (double)fy_cuda_scratch_bytes(g->n_params, fy_graph_max_channels(g));
  // (fp32 weights but when evaluating in bf16, which keeps the bf16 ones alone: fy_model_opts.weights16)
  *state_bytes = (double)g->n_param_elems * ((train || !bf16 ? 4.0 : 0.0) +
                                             (train ? 12.0 + (accumulate ? 4.0 : 0.0) : 0.0) +
                                             (bf16 ? (train ? 4.0 : 2.0) : 0.0));
}

fy_status fy_cost_resident_bytes(const struct fy_opt_config *cfg, int64_t B, int64_t T, bool recompute, bool train,
                                 bool bf16, bool accumulate, double *bytes, double *state_bytes) {
  struct fy_graph *g;
  FY_TRY(resident_graph(cfg, B, T, recompute, train, bf16, &g));
  resident_bytes(g, cfg->hidden_size, train, bf16, accumulate, bytes, state_bytes);
  fy_graph_free(g);
  return FY_OK;
}

// Bytes per parameter of a GPU's gradient sum with accumulation (the cuda engine's chunk_add): the
// first micro-batch's gradients (cb bytes each) widened into the fp32 sum, each later one's read
// and added to it (the sum read and written).
static double gpu_grad_sum_bytes(double cb, bool first) { return cb + (first ? 4 : 8); }

// A resident plan (knobs.resident): the step as the cuda engine runs it without --offload, one
// stream — each micro-batch's upload and its ops (with accumulation, the gradients added to their
// sum), then the replicas' gradient sum (NCCL, a ring: 2(n-1)/n of the gradients per rank, in the
// dtype AdamW reads them: bf16, or the fp32 sum with accumulation), the norm and AdamW over every
// parameter at the device's memory rate. Device memory is the model's buffers, to the byte, and
// the kernels' scratch (fy_cost_resident_bytes).
static fy_status simulate_resident(const struct fy_opt_config *cfg, const struct fy_plan_knobs *k,
                                   const struct fy_probe *probe, struct fy_cost *out) {
  if (strcmp(probe->device, "cuda") != 0)
    return fy_error_set(FY_ERR_INVALID, "plan: a resident plan keeps the model on a GPU (device cuda); on %s it is "
                        "offloaded", probe->device);
  const int dp = k->dp > 1 ? k->dp : 1;
  const bool bf16 = compute_dtype(k, probe) == FY_BF16;  // (else fp32: fp16 is no GPU precision, fy_cost_simulate)
  struct fy_graph *g;
  FY_TRY(resident_graph(cfg, k->micro_batch, k->seq, k->recompute, true, bf16, &g));
  const bool accumulate = k->grad_accum > 1;
  const double np = (double)g->n_param_elems, cb = bf16 ? 2 : 4;  // a computed gradient's bytes
  const double gb = accumulate ? 4 : cb;  // the gradients AdamW reads
  double state = 0;
  resident_bytes(g, cfg->hidden_size, true, bf16, accumulate, &out->device_peak, &state);
  out->min_device_bytes = out->device_peak;
  out->flops_per_step = fy_opt_step_flops(cfg, k->micro_batch, k->seq, FY_FLOPS_PALM) * (double)k->grad_accum * dp;
  out->fits = out->device_peak <= probe->device_mem;
  if (!out->fits) {
    snprintf(out->why, sizeof out->why,
             "everything on the device needs %.1f MiB (weights, gradients and AdamW state %.1f MiB, activations and "
             "kernel scratch %.1f MiB); the device has %.1f MiB", out->device_peak / 1048576.0, state / 1048576.0,
             (out->device_peak - state) / 1048576.0, probe->device_mem / 1048576.0);
    fy_graph_free(g);
    return FY_OK;
  }
  struct fy_action *actions = calloc((size_t)fy_graph_max_actions(g), sizeof *actions);
  if (!actions) {
    fy_graph_free(g);
    return fy_error_set(FY_ERR_NOMEM, "out of memory");
  }
  const int n_actions = fy_graph_pass_actions(g, actions);
  double pass = 0;
  for (int a = 0; a < n_actions; a++)
    pass += fy_profile_op_seconds(g, actions[a].op, actions[a].kind == FY_ACT_BACKWARD, probe, (int)cb, bf16 ? FY_BF16 : FY_F32);
  free(actions);
  const double mem = fy_profile_mem_rate(probe), bt = (double)(g->B * g->T);
  const double a = (double)k->grad_accum;
  // Per micro-batch: ids, targets, mask and positions up, one copy each before its ops (the
  // offload engine stages the next one meanwhile; the resident engine does not); with
  // accumulation, its gradients into the fp32 sum (read, and the sum read and written but the first).
  out->h2d_s = a * (4 * bt * 4 / (probe->h2d_gbps * 1e9) + 4 * probe->copy_latency_us * 1e-6);
  out->compute_s = a * pass + (accumulate ? (a - 1) * np * gpu_grad_sum_bytes(cb, false) / mem +
                                                np * gpu_grad_sum_bytes(cb, true) / mem
                                          : 0);
  out->comm_s = dp > 1 ? 2.0 * (dp - 1) / dp * np * gb / (fy_cluster_group_gbps(&k->cluster, probe, dp, 1) * 1e9) : 0;
  // The norm reads the gradients; AdamW reads them with the weights, m and v, and writes those
  // (and in bf16 the weights' bf16 copy).
  out->optim_s = np * gb / mem + np * (24 + (bf16 ? 2 : 0) + gb) / mem + out->comm_s;
  out->step_s = out->h2d_s + out->compute_s + out->optim_s;
  step_rates(out, k, probe);
  fy_graph_free(g);
  return FY_OK;
}

// A resident pipeline stage's bytes on its GPU as the runtime allocates them (one tp rank: the
// cuda engine's model of the stage's parameters alone, runtime/model.c; then runtime/pipeline.c's
// arenas, one span of the activations for each of the `held` micro-batches in flight, allocated
// while the model's whole arena is still there: the peak). -1 when the graph cannot be built.
static double resident_stage_bytes(const struct fy_opt_config *cfg, const struct fy_plan_knobs *k, bool bf16, int s,
                                   int64_t held) {
  struct fy_graph *g;
  if (resident_graph(cfg, k->micro_batch, k->seq, k->recompute, true, bf16, &g) != FY_OK) return -1;
  int lo, hi;
  struct fy_chunk_layout *l = NULL;
  double bytes = -1;
  if (fy_graph_stage_ops(g, cfg->num_hidden_layers, k->pp, s, &lo, &hi) == FY_OK) {
    fy_graph_set_stage(g, lo, hi);
    if (fy_chunk_layout_create(g, 0, &l) == FY_OK) {
      int64_t a_lo, a_hi;
      fy_graph_ops_act_span(g, lo, hi, &a_lo, &a_hi);
      const size_t span = (size_t)(a_hi - a_lo) * 4;
      bytes = fy_graph_model_bytes(g, cfg->hidden_size, true, bf16, k->grad_accum > 1, FY_CUDA_ALLOC_GRANULE) +
              (double)fy_cuda_scratch_bytes(g->n_params, fy_graph_max_channels(g)) +
              (double)held * (double)fy_device_round(span, FY_CUDA_ALLOC_GRANULE);
      fy_chunk_layout_free(l);
    }
  }
  fy_graph_free(g);
  return bytes;
}

// A resident layout costed stage by stage (knobs.pp > 1, or resident tensor-parallel ranks): each
// of the pp stages runs its decoder layers (the embeddings with the first, the final norm, lm_head
// and loss with the last: fy_graph_stage_ops, as runtime/pipeline.c splits them) on one rank of
// each tp group, resident (as the runtime's pipeline runs its stages), grad_accum micro-batches a
// step on the 1F1B schedule.
// - A stage's compute a micro-batch: its ops' forward and backward (and recomputed forward) times
//   from the profiler, the tensor-parallel collectives of its split linears at the tp group's link
//   (on the path: a linear's all-reduce is waited for), with accumulation the gradients added to
//   their fp32 sum.
// - The step: the first micro-batch goes through every stage and back, each later one costs the
//   slowest stage's cycle (a forward and a backward) and its two receives (the activation from
//   the stage before, the gradient from the one after, each the size of a hidden state, sent by
//   each tp rank over the link between the two stages' GPUs): (m - 1) x cycle + the stages' sum.
//   With equal stages and free sends that is (m + p - 1) x (F + B): the bubble (p - 1)/(m + p - 1).
// - Then, once a step: each stage's gradients reduced over its data-parallel group (ranks pp x tp
//   apart: another node when pp x tp fills one), a tied embedding's gradient summed between the
//   first and last stage, the norm and AdamW over the stage's (or with zero its dp shard's)
//   parameters at the device's memory rate. The slowest stage sets each.
// - Memory of stage s: its parameters' (a tied embedding on both ends) weights, gradients and
//   AdamW state (zero: the fp32 ones sharded over dp), the activations of the micro-batches it
//   holds at once on 1F1B (min(pp - s, m): pp on the first, one on the last; each its ops' span of
//   the activation arena, as runtime/pipeline.c allocates them), the activation-gradient arena,
//   and on a GPU the kernels' scratch.
// - On a GPU with one GPU a stage and its state whole (tp 1, replicate), a stage's memory is the
//   runtime's allocations to the byte instead (resident_stage_bytes), the model's whole activation
//   arena among them at the peak.
// - On a GPU each stage's cycle also has its micro-batch's uploads (the batch and its positions,
//   before the forward and again before the backward ops: runtime/engine.c), as a resident rank's.
static fy_status simulate_staged(const struct fy_opt_config *cfg, const struct fy_plan_knobs *k,
                                 const struct fy_probe *probe, struct fy_cost *out) {
  const int dp = k->dp > 1 ? k->dp : 1, tp = k->tp > 1 ? k->tp : 1, pp = k->pp > 1 ? k->pp : 1;
  const int64_t layers = cfg->num_hidden_layers, m = k->grad_accum;
  if (pp > layers)
    return fy_error_set(FY_ERR_INVALID, "plan: pp %d: more pipeline stages than the model's %lld decoder layers", pp,
                        (long long)layers);
  if (layers % pp)
    return fy_error_set(FY_ERR_INVALID, "plan: pp %d does not divide the model's %lld decoder layers (each stage takes "
                        "the same number)", pp, (long long)layers);
  if (cfg->num_attention_heads % tp || cfg->ffn_dim % tp)
    return fy_error_set(FY_ERR_INVALID, "plan: tp %d must divide the %lld heads and the feed-forward size %lld", tp,
                        (long long)cfg->num_attention_heads, (long long)cfg->ffn_dim);
  const bool gpu = strcmp(probe->device, "cuda") == 0;
  const enum fy_dtype cdt = compute_dtype(k, probe);
  const bool act16 = gpu && cdt == FY_BF16, acc = m > 1;
  const int pb = act16 ? 2 : 4;  // activations and the 16-bit weights and gradients: bf16 on a GPU, else floats
  const char *dp_name = k->pattern[0] ? k->pattern : "replicate";
  const bool zero = dp > 1 && strcmp(dp_name, "zero") == 0;
  struct fy_graph *g = NULL, *whole = NULL;
  FY_TRY(fy_opt_build_graph_tp(cfg, k->micro_batch, k->seq, tp, 0, &g));
  fy_status st = fy_opt_build_graph(cfg, k->micro_batch, k->seq, &whole);
  struct fy_graph *gs[2] = {g, whole};
  for (int i = 0; i < 2 && st == FY_OK; i++) {
    if (gpu) fy_graph_set_flash_attention(gs[i], true);
    if (k->recompute) fy_graph_set_recompute(gs[i], true);
    if (act16) st = fy_graph_set_act16(gs[i], true);
  }
  int *stage_of = NULL, *used = NULL, *seen = NULL;
  struct fy_action *actions = NULL;
  if (st == FY_OK) {
    stage_of = calloc((size_t)g->n_ops, sizeof *stage_of);
    used = calloc((size_t)g->n_params + 1, sizeof *used);
    seen = calloc((size_t)g->n_params + 1, sizeof *seen);
    actions = calloc((size_t)fy_graph_max_actions(g), sizeof *actions);
    if (!stage_of || !used || !seen || !actions) st = fy_error_set(FY_ERR_NOMEM, "out of memory");
  }
  double F[FY_COST_MAX_STAGES] = {0}, Bk[FY_COST_MAX_STAGES] = {0}, tpc[FY_COST_MAX_STAGES] = {0};
  double P[FY_COST_MAX_STAGES] = {0}, span[FY_COST_MAX_STAGES] = {0}, tied_elems = 0;
  for (int s = 0; s < pp && st == FY_OK; s++) {
    int lo, hi;
    st = fy_graph_stage_ops(g, layers, pp, s, &lo, &hi);
    if (st != FY_OK) break;
    for (int o = lo; o < hi; o++) {
      stage_of[o] = s;
      const struct fy_op *op = &g->ops[o];
      for (int j = 0; j < op->n_params; j++) used[op->params[j]] |= 1 << (s == 0 ? 0 : s == pp - 1 ? 1 : 2);
    }
    int64_t a_lo, a_hi;  // (the stage's span of the arena: runtime/pipeline.c)
    fy_graph_ops_act_span(g, lo, hi, &a_lo, &a_hi);
    span[s] = (double)(a_hi - a_lo) * 4;
    for (int o = lo; o < hi; o++)  // (each parameter the stage's ops read, once)
      for (int j = 0; j < g->ops[o].n_params; j++) {
        const int i = g->ops[o].params[j];
        if (seen[i] == s + 1) continue;
        seen[i] = s + 1;
        P[s] += (double)g->params[i].numel;
      }
  }
  for (int i = 0; st == FY_OK && pp > 1 && i < g->n_params; i++)
    if ((used[i] & 3) == 3) tied_elems += (double)g->params[i].numel;  // (on the first and the last stage)
  // Each stage's compute a micro-batch, the tensor-parallel collectives on its path.
  const double bw_tp[2] = {1, fy_cluster_group_gbps(&k->cluster, probe, tp, 1) * 1e9};
  const int n_actions = st == FY_OK ? fy_graph_pass_actions(g, actions) : 0;
  for (int a = 0; a < n_actions; a++) {
    const int o = actions[a].op, s = stage_of[o];
    const bool bwd = actions[a].kind == FY_ACT_BACKWARD;
    struct fy_op_profile pr;
    fy_profile_op(g, o, probe, pb, cdt, &pr);
    double t = pr.seconds[bwd] + (gpu ? 0 : pr.kernel_calls[bwd] * sim_op_overhead(probe)), tc = 0;
    if (tp > 1 && g->ops[o].pattern[0] && actions[a].kind != FY_ACT_RECOMPUTE) {
      const struct fy_pattern *pat = fy_pattern_find(g->ops[o].pattern);
      struct fy_pattern_ctx pc = {.g = whole, .op = o, .dp = 1, .tp = tp, .param_bytes = pb};
      if (pat)
        tc = pattern_seconds(pat, &pc, bwd ? FY_PHASE_PRE_BACKWARD : FY_PHASE_PRE_FORWARD, bw_tp) +
             pattern_seconds(pat, &pc, bwd ? FY_PHASE_POST_BACKWARD : FY_PHASE_POST_FORWARD, bw_tp);
    }
    if (actions[a].kind == FY_ACT_FORWARD) F[s] += t + tc;
    else Bk[s] += t + tc;
    tpc[s] += tc;
  }
  const double mem = fy_profile_mem_rate(probe);
  const double cb = act16 ? 2 : 4, gb = acc ? 4 : cb;  // a computed gradient's bytes; the reduced and updated one's
  // Bytes a parameter: replicated, everything (as fy_cost_resident_bytes counts a resident model:
  // fp32 weights, gradients, m and v, and in bf16 the 16-bit weights and gradients; the fp32 sum
  // with accumulation); zero, the fp32 state sharded over dp and the compute's weights and
  // gradients whole.
  const double whole_b = (act16 ? 4.0 : 8.0) + (acc ? 4.0 : 0.0), shard_b = act16 ? 16.0 : 8.0;
  const double per_param = zero ? whole_b + shard_b / dp : 4.0 + 12.0 + (acc ? 4.0 : 0.0) + (act16 ? 4.0 : 0.0);
  const double scratch = gpu && st == FY_OK ? (double)fy_cuda_scratch_bytes(g->n_params, fy_graph_max_channels(g)) : 0;
  const double fixed = st == FY_OK ? 4.0 * (double)(g->grad_elems + g->scratch_elems + g->B * g->T) + scratch : 0;
  const double hidden_bytes = (double)(k->micro_batch * k->seq * cfg->hidden_size) * pb;  // a stage's output
  const double bt = (double)(k->micro_batch * k->seq);
  double c[FY_COST_MAX_STAGES], x[FY_COST_MAX_STAGES] = {0}, cmax = 0, csum = 0, xsum = 0, period = 0;
  double dp_max = 0, opt_max = 0, tp_max = 0;
  int worst = 0, worst_mem = 0;
  bool exact_mem = false;  // (stage_bytes the runtime's allocations: resident_stage_bytes)
  out->pp = pp;
  for (int s = 0; s < pp && st == FY_OK; s++) {
    // with accumulation each micro-batch's gradients added to the fp32 sum (the first copied in)
    const double sum = acc ? P[s] * ((double)(m - 1) * (gpu ? gpu_grad_sum_bytes(cb, false) : 12.0) +
                                     (gpu ? gpu_grad_sum_bytes(cb, true) : 4.0)) / (double)m / mem
                           : 0;
    // on a GPU each stage uploads the micro-batch's ids, targets, mask and positions before its
    // forward ops and again before its backward ones (runtime/engine.c, stage_batch), on its path
    const double up = gpu ? 2 * (4 * bt * 4 / (probe->h2d_gbps * 1e9) + 4 * probe->copy_latency_us * 1e-6) : 0;
    c[s] = F[s] + Bk[s] + sum + up;
    out->stage_s[s] = c[s];
    if (c[s] > cmax) cmax = c[s], worst = s, tp_max = tpc[s];
    csum += c[s];
    if (s < pp - 1) {  // (dp rank 0's pipeline: the others' stages lie alike, or as far apart)
      x[s] = hidden_bytes / (fy_cluster_p2p_gbps(&k->cluster, probe, s * tp, (s + 1) * tp, tp) * 1e9);
      xsum += x[s];
    }
    const int64_t held = pp - s < m ? pp - s : m;
    out->stage_bytes[s] = P[s] * per_param + (double)held * span[s] + fixed;
    // one GPU a stage, its state whole (tp 1, replicated): the runtime's allocations, to the byte
    if (gpu && tp == 1 && !zero && pp > 1) {
      const double exact = resident_stage_bytes(cfg, k, act16, s, held);
      if (exact > 0) out->stage_bytes[s] = exact, exact_mem = true;
    }
    if (out->stage_bytes[s] > out->stage_bytes[worst_mem]) worst_mem = s;
    // the stage's gradients over its data-parallel group (its ranks pp x tp apart); zero's reduced
    // to their shards and the updated weights gathered back
    if (dp > 1) {
      const double bw = fy_cluster_group_gbps(&k->cluster, probe, dp, pp * tp) * 1e9, f = (dp - 1.0) / dp;
      const double t = zero ? f * P[s] * (gb + cb) / bw : 2 * f * P[s] * gb / bw;
      if (t > dp_max) dp_max = t;
    }
    const double mine = zero ? P[s] / dp : P[s];  // the norm, then AdamW (as a resident plan's)
    const double t = mine * gb / mem + mine * (24 + (act16 ? 2 : 0) + gb) / mem;
    if (t > opt_max) opt_max = t;
  }
  for (int s = 0; s < pp && st == FY_OK; s++) {
    const double cyc = c[s] + (s > 0 ? x[s - 1] : 0) + (s < pp - 1 ? x[s] : 0);
    if (cyc > period) period = cyc;
  }
  if (st == FY_OK) {
    const double md = (double)m, ideal = (md - 1) * cmax + csum, pipe = (md - 1) * period + csum + 2 * xsum;
    const double tied = tied_elems > 0 ? tied_elems * gb / (fy_cluster_p2p_gbps(&k->cluster, probe, 0, (pp - 1) * tp, tp) * 1e9)
                                       : 0;
    out->bubble = ideal > 0 ? 1 - md * cmax / ideal : 0;
    out->p2p_s = pipe - ideal + tied;
    out->dp_comm_s = dp_max;
    out->tp_comm_s = md * tp_max;
    out->slowest_stage = worst;
    out->compute_s = md * cmax;
    out->optim_s = opt_max;
    out->comm_s = out->p2p_s + out->dp_comm_s + out->tp_comm_s;
    out->step_s = pipe + tied + dp_max + opt_max;
    out->device_peak = out->min_device_bytes = out->stage_bytes[worst_mem];
    out->flops_per_step = fy_opt_step_flops(cfg, k->micro_batch, k->seq, FY_FLOPS_PALM) * md * dp;
    out->fits = out->device_peak <= probe->device_mem;
    // What holds the step up most: the slowest stage's own work, the bubble, the sends, the
    // gradient reduction or the optimizer.
    const char *names[] = {"compute", "pipeline bubble", "pipeline sends", "tp collectives", "dp gradients", "optimizer"};
    const double part[] = {md * (cmax - tp_max), ideal * out->bubble, out->p2p_s, out->tp_comm_s, dp_max, opt_max};
    int b = 0;
    for (int i = 1; i < 6; i++)
      if (part[i] > part[b]) b = i;
    snprintf(out->bottleneck, sizeof out->bottleneck, "%s", names[b]);
    if (!out->fits) {
      const int s = worst_mem;
      const int64_t held = pp - s < m ? pp - s : m;
      snprintf(out->why, sizeof out->why,
               "stage %d of %d (dp %d x pp %d x tp %d) needs %.2f GiB a GPU: weights, gradients and AdamW state of "
               "%.3g parameters %.2f GiB, activations of %lld micro-batch%s in flight %.2f GiB, gradient arena, "
               "scratch and batch%s %.2f GiB; the device has %.2f GiB", s, pp, dp, pp, tp, out->device_peak / 1073741824.0,
               P[s], P[s] * per_param / 1073741824.0, (long long)held, held == 1 ? "" : "es",
               (double)held * span[s] / 1073741824.0,
               exact_mem ? " (and the model's whole activation arena, kept until the stage's are allocated)" : "",
               (out->device_peak - P[s] * per_param - (double)held * span[s]) / 1073741824.0,
               probe->device_mem / 1073741824.0);
    }
    step_rates(out, k, probe);
  }
  free(actions);
  free(used);
  free(seen);
  free(stage_of);
  fy_graph_free(whole);
  fy_graph_free(g);
  return st;
}

static fy_status simulate_offloaded_staged(const struct fy_opt_config *cfg, const struct fy_plan_knobs *k,
                                           const struct fy_probe *probe, struct fy_cost *out);

// Device updates on the timeline (knobs.device_updates; runtime/offload.c, dup_upload and
// dup_updates): a streamed chunk goes through in pieces (fy_chunk_piece_elems), the step's piece p
// through staging set p % 2. On dup_up the piece's gradients, once its chunk's are home and the
// update of piece p - 2 has read the set's, then its master, m and v, each once piece p - 2's copy
// of it is home (a buffer at a time, so that the uploads follow the copies home closely; no norm
// needed: the first two pieces' go before the norm is known). On dup_run, once the norm is known,
// the step's scale to the device (once a step), then for each piece after its uploads and piece p
// - 2's 16-bit copy home the master converted to the 16-bit copy and the device's AdamW (a GPU's
// kernels at its memory rate, as the device chunks'; on sim host functions, which take the cores
// as the host optimizer does). On dup_down, master, m, v and the new 16-bit copy home, and after a
// chunk's last piece its home_ready (what its next load waits for). A sharded rank moves and
// updates its shard of each chunk.
//
// The link: the timeline serves a direction's copies in the order they are queued, each after the
// one before (one resource a direction, shared with the cache's loads and write-backs). The
// runtime queues uploads ahead, each waiting for its set, but the copy engines take copies as they
// become ready: the next step's batch and loads go between the uploads. So the uploads are queued
// here one copy at a time, in the order they become ready among the other copies: before the
// simulation queues a copy (the batch, a load), dup_flush queues the uploads that are ready before
// `t`, when that copy can start; and every upload of a streamed chunk up to `through` (the index of
// one the cache is about to load: its home_ready must be the new one). A copy in flight is not
// pre-empted. Each chunk's update and copies home are queued with its last upload (the link's
// other direction carries nothing else until the next backward's write-backs, which come after the
// chunk's next load).
static fy_status dup_flush(struct sim *s, double t, int through) {
  while (s->dup_i < s->dup_n) {
    const int i = s->dup_i, set = s->dup_p % 2, c = s->dup_chunk[i];
    const int64_t span = s->dup_shard > 0 ? s->dup_shard : s->l->chunks[c].used, off = s->dup_k * s->dup_piece;
    const int64_t used = span - off < s->dup_piece ? span - off : s->dup_piece;  // (the piece's elements)
    const bool last = off + used >= span;
    const size_t mb = fy_state_moment_bytes(s->sf, used), gbytes = (size_t)used * (s->g16 ? s->pb : 4);
    void *const *d = s->dup_set[set];
    // (the gradients once the update of the set's piece before has read them, then master, m and
    // v, each once its copy home is done)
    const int k = s->dup_copy, buf[4] = {3, 0, 1, 2};
    if (k == 0) {
      fy_stream_wait(s->dup_up, s->dup_done[set]);
      fy_stream_wait(s->dup_up, s->grad_ready[c]);
    } else {
      fy_stream_wait(s->dup_up, s->dup_free[set][k - 1]);
    }
    if (i > through && !(fy_timeline_clock(s->dup_up) < t)) return FY_OK;  // (not ready before that copy)
    const size_t bytes[4] = {gbytes, (size_t)used * 4, mb, mb};
    FY_TRY(fy_copy_async(s->dup_up, d[buf[k]], (const void *)FAKE_HOST, bytes[k]));
    if (++s->dup_copy < 4) continue;
    s->dup_copy = 0;
    if (last) s->dup_i++, s->dup_k = 0;
    else s->dup_k++;
    fy_event_record(s->dup_in[set], s->dup_up);
    if (s->dup_p++ == 0) {  // (the host enqueues the updates once it knows the norm: the scale first)
      fy_stream_wait(s->dup_run, s->norm_ready);
      FY_TRY(fy_copy_async(s->dup_run, s->dup_scale, (const void *)FAKE_HOST, 2 * sizeof(float)));
    }
    fy_stream_wait(s->dup_run, s->dup_in[set]);
    if (!s->f32) fy_stream_wait(s->dup_run, s->dup_free[set][3]);  // (its 16-bit copy's buffer home)
    const double u = (double)used, conv = s->f32 ? 0 : u * (4.0 + (double)s->pb);  // (the master read, the 16-bit copy written)
    const double tr = s->gpu ? (u * (8 + 4 * s->mv_bpp + (s->act16 ? 2 : 0)) + (double)gbytes + conv) / s->dev_mem
                             : u * s->adamw_s + conv / s->mem;
    fy_timeline_run(s->dup_run, tr, "AdamW on the device");
    fy_event_record(s->dup_done[set], s->dup_run);
    if (!s->gpu) *s->host_work += tr;
    fy_stream_wait(s->dup_down, s->dup_done[set]);
    void *h = (void *)FAKE_HOST;
    const size_t down[4] = {(size_t)used * 4, mb, mb, s->f32 ? 0 : (size_t)used * s->pb};
    for (int b = 0; b < 4; b++) {
      if (down[b]) FY_TRY(fy_copy_async(s->dup_down, h, d[b == 3 ? 4 : b], down[b]));
      fy_event_record(s->dup_free[set][b], s->dup_down);
    }
    if (!last) continue;
    fy_event_record(s->home_ready[c], s->dup_down);
    s->dup_home[i] = fy_timeline_clock(s->dup_down);
  }
  return FY_OK;
}

// Before the cache's access: its acquire of `chunk`, or (chunk -1) its prefetch from trace position
// pos (fy_device_cache_prefetch's argument), which walks ahead to `prefetch` chunks of the pass as
// the cache does. The streamed chunks it may load are queued to the end (their home_ready is what
// the loads wait for); then the uploads that become ready before the first load can start (t, or
// a streamed chunk's time home) go before it on the link (dup_flush).
static fy_status dup_before_access(struct sim *s, int64_t pos, int chunk, int prefetch, double t) {
  if (s->dup_i >= s->dup_n) return FY_OK;
  int through = -1, first = -1;  // (the streamed chunks' last index to load; the chunk loaded first)
  if (chunk >= 0 && s->l->chunks[chunk].block < 0) through = s->dup_idx[chunk], first = chunk;
  const int64_t n = fy_trace_length(s->trace);
  if (chunk < 0 && n > 0) {
    const int64_t end = (pos / n + 1) * n;
    const int call = ++s->dup_call;
    int seen = 0;
    for (int64_t j = pos + 1; j < end && seen < prefetch; j = fy_trace_run_end(s->trace, j)) {
      const int c = fy_trace_at(s->trace, j);
      if (s->dup_seen[c] == call) continue;
      s->dup_seen[c] = call;
      seen++;
      if (s->l->chunks[c].block >= 0) continue;
      if (first < 0) first = c;
      if (s->dup_idx[c] > through) through = s->dup_idx[c];
    }
  }
  FY_TRY(dup_flush(s, -INFINITY, through));
  if (first >= 0 && s->dup_idx[first] >= 0 && s->dup_home[s->dup_idx[first]] > t) t = s->dup_home[s->dup_idx[first]];
  return dup_flush(s, t, -1);
}

// stage >= 0: pipeline stage `stage` of k->pp alone, offloaded as runtime/run.c runs it (its
// graph's other parameters absent, its chunk layout packing its own and counting its ops' uses,
// its actions those of its ops, its activations one span of the arena for each micro-batch it
// holds under 1F1B), its micro-batches one after another (simulate_offloaded_staged lays the
// stages out on the schedule).
static fy_status simulate_one(const struct fy_opt_config *cfg, const struct fy_plan_knobs *k, const struct fy_probe *probe,
                              struct fy_cost *out, struct fy_device **timeline_out, int stage, int64_t sched_m) {
  memset(out, 0, sizeof *out);
  FY_TRY(fy_cost_check_knobs(k));
  bool gpu = strcmp(probe->device, "cuda") == 0;
  enum fy_dtype cdt;
  FY_TRY(fy_cost_check_precision(k->precision, probe->device, &cdt));
  if (k->optimizer_lag < 0 || k->optimizer_lag > 1)
    return fy_error_set(FY_ERR_INVALID, "plan: optimizer_lag %d: 0 or 1", k->optimizer_lag);
  const bool lag = k->optimizer_lag > 0;
  if (k->disk_master && cdt == FY_F32)
    return fy_error_set(FY_ERR_INVALID, "plan: disk_master needs 16-bit compute (precision bf16 or fp16): in fp32 the "
                        "master weights are what the device reads");
  if (lag && (k->resident || cdt == FY_F32 || k->grad_accum > 1))
    return fy_error_set(FY_ERR_INVALID, "plan: optimizer_lag 1 is for offloaded plans in 16-bit compute with one "
                        "micro-batch a step (grad_accum 1)");
  if (k->device_updates > 0 && !gpu && strcmp(probe->device, "sim") != 0)
    return fy_error_set(FY_ERR_INVALID, "plan: device_updates %d: device updates run on a GPU or the sim device, not "
                        "on %s (whose optimizer is the host's already)", k->device_updates, probe->device);
  if (k->resident) {
    if (timeline_out) *timeline_out = NULL;
    if (k->pp > 1 || k->tp > 1 || k->cluster.nodes > 0) return simulate_staged(cfg, k, probe, out);
    return simulate_resident(cfg, k, probe, out);
  }
  if (k->pp > 1 && stage < 0) {
    if (timeline_out) *timeline_out = NULL;
    return simulate_offloaded_staged(cfg, k, probe, out);
  }
  const bool act16 = gpu && cdt == FY_BF16, g16 = grads_in_copy(cdt, k->grad_accum > 1);
  int pb = act16 ? 2 : 4;  // compute payload and activations: bf16 on a GPU, else floats (cpu/sim in any precision)
  const size_t gran = gpu ? FY_CUDA_ALLOC_GRANULE : FY_HOST_ALLOC_GRANULE;  // (how the device counts an allocation)
  int dp = k->dp > 1 ? k->dp : 1, tp = k->tp > 1 ? k->tp : 1;
  const char *dp_name = k->pattern[0] ? k->pattern : dp > 1 ? "zero" : "replicate";
  const struct fy_pattern *dpp = fy_pattern_find(dp_name);
  if (!dpp) return fy_error_set(FY_ERR_INVALID, "plan: unknown parallel pattern '%s'", dp_name);
  FY_TRY(check_ep(cfg, k, gpu, dpp));
  const int ep = k->ep > 1 ? k->ep : 1;
  bool sharded = dp > 1 && dpp == &fy_pattern_zero;  // chunk-level, in the cache (as the runtime)
  // A GPU takes the sums of squares of gradients that come home over the 16-bit copies from the
  // blocks before they leave (runtime/offload.c, sums_on_device): the norm reads no host memory.
  const bool sums_dev = gpu && g16 && !sharded;
  // One rank's part of the model (all ranks do the same work), and the whole model for the
  // patterns, which speak of whole tensors.
  struct fy_graph *g, *whole = NULL;
  FY_TRY(fy_opt_build_graph_tp(cfg, k->micro_batch, k->seq, tp, 0, &g));
  fy_status st = fy_opt_build_graph(cfg, k->micro_batch, k->seq, &whole);
  if (st != FY_OK) {
    fy_graph_free(g);
    return st;
  }
  if (gpu) fy_graph_set_flash_attention(g, true);  // the cuda kernels keep no T x T matrix
  if (gpu) fy_graph_set_flash_attention(whole, true);
  if (k->recompute) fy_graph_set_recompute(g, true);
  if (k->recompute) fy_graph_set_recompute(whole, true);
  if (act16 && st == FY_OK) st = fy_graph_set_act16(g, true);  // bf16 activations, two to a float
  if (act16 && st == FY_OK) st = fy_graph_set_act16(whole, true);
  const enum fy_state_format sf = knob_state(k->optimizer_state);
  if (sf == FY_STATE_Q8) g->chunk_align = FY_Q8_BLOCK;  // (as runtime/model.c packs them)
  int64_t ce = k->chunk_elems > 0 ? k->chunk_elems : fy_chunk_min_elems(g);
  // whole 64-byte lines per shard (8-bit state: whole blocks, runtime/trainer.c)
  const int64_t line = (sf == FY_STATE_Q8 ? FY_Q8_BLOCK : 16) * (int64_t)dp;
  if (sharded) ce = (ce + line - 1) / line * line;
  int st_lo = 0, st_hi = g->n_ops;  // (the stage's ops; a stage's chunks are the whole model's size)
  if (stage >= 0 && st == FY_OK) st = fy_graph_stage_ops(g, cfg->num_hidden_layers, k->pp, stage, &st_lo, &st_hi);
  if (stage >= 0 && st == FY_OK) fy_graph_set_stage(g, st_lo, st_hi);
  // Each op's pattern: tp_col / tp_row for split linears, the data-parallel one for the rest; the
  // share of the model state a rank keeps under the data-parallel pattern.
  const struct fy_pattern **pat = calloc((size_t)g->n_ops, sizeof *pat);
  if (!pat) st = fy_error_set(FY_ERR_NOMEM, "out of memory");
  double kept = 0, all = 0;
  for (int o = 0; st == FY_OK && o < g->n_ops; o++) {
    pat[o] = g->ops[o].pattern[0] ? fy_pattern_find(g->ops[o].pattern) : dpp;
    if (g->ops[o].n_params == 0) pat[o] = &fy_pattern_replicate;  // nothing to lay out
    if (ep > 1 && g->ops[o].kind == FY_OP_MOE) pat[o] = &fy_pattern_expert;  // (check_ep)
    struct fy_pattern_ctx c = {.g = whole, .op = o, .dp = dp, .tp = tp, .ep = ep, .chunk_elems = ce, .param_bytes = pb};
    if (!pat[o] || !pat[o]->applies(&c)) {
      st = fy_error_set(FY_ERR_INVALID, "plan: the pattern %s does not apply to %s", pat[o] ? pat[o]->name : "?",
                        g->ops[o].name);
      break;
    }
    if (g->ops[o].pattern[0]) continue;
    struct fy_pattern_ctx one = c;
    one.dp = one.tp = 1;
    kept += fy_pattern_state_bytes(dpp, &c);
    all += fy_pattern_state_bytes(&fy_pattern_replicate, &one);
  }
  double share = sharded ? 1.0 / dp : all > 0 ? kept / all : 1.0;
  struct fy_chunk_layout *l = NULL;
  if (st == FY_OK) st = fy_chunk_layout_create(g, ce, &l);
  if (st != FY_OK) {
    free(pat);
    fy_graph_free(whole);
    fy_graph_free(g);
    return st;
  }
  ce = l->chunk_elems;
  if (stage >= 0) fy_chunk_layout_keep_ops(l, g->n_ops, st_lo, st_hi);
  int nc = l->n_chunks;
  double chunk_bytes = (double)ce * pb, np = (double)g->n_param_elems;
  // The first n_dev chunks stay on the device with their state (runtime/offload.c): the fp32
  // weights, the gradients in the payload's dtype (and their fp32 sum with accumulation), m, v,
  // and with 16-bit compute the weights' copy (a GPU's bf16, the sim device's rounded floats); the
  // optimizer runs there, on the compute stream.
  int n_dev = k->device_chunks > 0 ? (k->device_chunks < nc ? k->device_chunks : nc) : 0;
  const size_t dev_buf[] = {(size_t)ce * 4, (size_t)ce * pb, k->grad_accum > 1 ? (size_t)ce * 4 : 0,
                            fy_state_moment_bytes(sf, ce), fy_state_moment_bytes(sf, ce), cdt != FY_F32 ? (size_t)ce * pb : 0};
  for (size_t i = 0; i < sizeof dev_buf / sizeof *dev_buf; i++)
    if (dev_buf[i]) out->device_chunk_bytes += (double)fy_device_round(dev_buf[i], gran);
  double dev_elems = 0;
  for (int c = 0; c < n_dev; c++) dev_elems += (double)l->chunks[c].used;
  // (and their parameters' sums of squares and the update's scale)
  if (lag) out->device_chunk_bytes += (double)fy_device_round((size_t)ce * pb, gran);  // (its gradients kept a step)
  // Device updates (knobs.device_updates): two staging sets, each a piece's (fy_chunk_piece_elems
  // of a chunk, or of a sharded rank's shard) fp32 master, m and v at their stored size, its
  // gradients as the host tier holds them (the payload's dtype where they come home over the
  // 16-bit copy, else fp32) and with 16-bit compute the new 16-bit copy (runtime/offload.c,
  // create_dup: dup_w, dup_m, dup_v, dup_g, dup_w16), and the steps' scales. (Compressed state on
  // a GPU also puts each piece's parameter ranges there, a few bytes a parameter group: not
  // counted.)
  const bool dup = k->device_updates > 0;
  const int64_t piece = fy_chunk_piece_elems(sharded ? ce / dp : ce);
  const size_t dup_buf[] = {(size_t)piece * 4, fy_state_moment_bytes(sf, piece), fy_state_moment_bytes(sf, piece),
                            (size_t)piece * (g16 ? (size_t)pb : 4), cdt != FY_F32 ? (size_t)piece * pb : 0};
  for (size_t i = 0; dup && i < sizeof dup_buf / sizeof *dup_buf; i++)
    if (dup_buf[i]) out->staging_bytes += 2 * (double)fy_device_round(dup_buf[i], gran);
  const double dev_state = (n_dev > 0 ? n_dev * out->device_chunk_bytes +
                                            (double)fy_device_round((size_t)g->n_params * 8, gran) +
                                            (double)fy_device_round(16, gran)
                                      : 0) +
                           out->staging_bytes + (dup ? (double)fy_device_round(4 * sizeof(float), gran) : 0);
  out->n_chunks = nc;
  out->chunk_bytes = chunk_bytes;
  out->flops_per_step = fy_opt_step_flops(cfg, k->micro_batch, k->seq, FY_FLOPS_PALM) * (double)k->grad_accum * dp;

  // Device memory: activations and the batch as the offload engine allocates them, then blocks.
  // The arenas count floats (a GPU's bf16 activations two to a float: the graph's act16).
  size_t fixed[FY_GRAPH_OFFLOAD_BUFS];  // (the batch's buffer last: the simulation stages the batch into it)
  const int n_fixed = fy_graph_offload_buffers(g, cfg->hidden_size, gpu, fixed);
  double fixed_bytes = 0;
  for (int i = 0; i < n_fixed; i++) fixed_bytes += (double)fy_device_round(fixed[i], gran);
  // A stage: the model's arena allocated, then one span of it for each micro-batch held at once
  // on 1F1B (min(pp - stage, grad_accum)), then the whole arena freed (runtime/pipeline.c).
  size_t stage_span = 0;
  int stage_held = 0;
  if (stage >= 0) {
    int64_t a_lo, a_hi;
    fy_graph_ops_act_span(g, st_lo, st_hi, &a_lo, &a_hi);
    stage_span = (size_t)(a_hi - a_lo) * 4;
    stage_held = k->pp - stage < sched_m ? k->pp - stage : (int)sched_m;
    if (stage_held < 1) stage_held = 1;
    fixed_bytes += stage_held * (double)fy_device_round(stage_span, gran) - (double)fy_device_round(fixed[0], gran);
  }
  // (while the pipeline allocates its arenas the model's whole one is still there: a peak of its own)
  double stage_transient = 0;
  for (int i = 0; stage >= 0 && i < n_fixed - 2; i++) stage_transient += (double)fy_device_round(fixed[i], gran);
  if (stage >= 0) stage_transient += stage_held * (double)fy_device_round(stage_span, gran);
  // and on a GPU the kernels' scratch (cuBLASLt's workspace ...), as the engine sizes it
  const double scratch = gpu ? (double)fy_cuda_scratch_bytes(g->n_params, fy_graph_max_channels(g)) : 0;
  fixed_bytes += scratch;
  int min_blocks = fy_chunk_min_blocks(l, g->n_ops);
  double block = (double)fy_device_round((size_t)chunk_bytes, gran);
  out->min_device_bytes = fixed_bytes + dev_state + min_blocks * block;
  if (stage_transient > out->min_device_bytes) out->min_device_bytes = stage_transient;
  int n_blocks = k->blocks;
  if (n_blocks <= 0) {  // as many as fit, up to one per chunk the cache manages (as the runtime)
    double left = probe->device_mem - fixed_bytes - dev_state;
    n_blocks = left > 0 ? (int)(left / block) : 0;
    int cached = nc - n_dev > min_blocks ? nc - n_dev : min_blocks;
    if (n_blocks > cached) n_blocks = cached;
  }
  out->n_blocks = n_blocks;
  // Host and disk: parameters stay on the host; gradients and AdamW state of the chunks the host
  // cannot hold go to disk (with the chunk-sized buffers the runtime keeps aside).
  // As the runtime counts (runtime/trainer.c, setup_offload): when the host cannot hold every
  // chunk's state, the disk tier's buffers are set aside first and what fits is counted again.
  // (gradients,) m, v; compressed m and v in buffers of a rank's shard, as the runtime's
  // disk_master: a chunk's master weights (a rank's shard) go with its state (to disk, for a disk
  // chunk), kept by the engine in a buffer of the chunk's size; the device chunks' stay in host
  // memory (their host copy), with the 16-bit copies of every chunk.
  const bool dm = k->disk_master;
  const double master_chunk = (double)ce * 4 / dp;
  double per_chunk_state = (sf == FY_STATE_F32 ? ce * host_state_bytes(cdt, k->grad_accum > 1) * share
                                               : chunk_state_bytes(cdt, k->grad_accum > 1, sf, (int64_t)llround(ce * share))) +
                           (dm ? master_chunk : 0);
  // (--optimizer-lag: a second 16-bit copy of every chunk the host updates)
  double params_host = (np * (dm ? (double)pb : host_weight_bytes(cdt, pb)) + (lag ? (nc - n_dev) * (double)ce * pb : 0)) * share +
                       (dm ? n_dev * master_chunk : 0),
         reserve = 3 * (double)ce * 4,
         disk_reserve = (sf == FY_STATE_F32 ? (g16 ? 4 : 7) * (double)ce * 4 / dp  // (the disk chunks' buffers: shards of a chunk)
                                            : 4.0 * (double)fy_state_moment_bytes(sf, ce / dp) + (g16 ? 0 : 3) * (double)ce * 4 / dp) +
                        (dm ? 2 * master_chunk : 0);  // (two sets of master weights)
  double fit_d = floor((probe->host_mem - params_host - reserve) / per_chunk_state);
  if (fit_d < nc) fit_d = floor((probe->host_mem - params_host - reserve - disk_reserve) / per_chunk_state);
  int fit = fit_d > 0 ? (fit_d < nc ? (int)fit_d : nc) : 0;
  int n_disk = k->disk_chunks >= 0 ? k->disk_chunks : (fit >= nc - n_dev ? 0 : nc - n_dev - fit);
  if (n_disk > nc - n_dev) n_disk = nc - n_dev;
  if (n_disk > 0) reserve += disk_reserve;
  out->n_disk_chunks = n_disk;
  out->host_chunks = nc - n_dev - n_disk;
  out->n_device_chunks = n_dev;
  out->host_bytes = params_host + reserve + (nc - n_dev - n_disk) * per_chunk_state;
  // Speculative updates (knobs.spec_chunks; fy_cost_check_knobs says where): up to that many
  // host-tier chunks, each with a spare slot the update writes out of place: its fp32 master, m
  // and v at their stored size and with 16-bit compute its 16-bit copy (runtime/offload.h); a
  // sharded rank's of its shard.
  const int n_spec = k->spec_chunks < nc - n_dev - n_disk ? k->spec_chunks : nc - n_dev - n_disk;
  const int64_t spec_elems = sharded ? ce / dp : ce;
  out->host_bytes += n_spec * ((double)spec_elems * 4 + 2.0 * (double)fy_state_moment_bytes(sf, spec_elems) +
                               (cdt != FY_F32 ? (double)spec_elems * pb : 0));
  // Device updates: the first n_up host-tier chunks in chunk order that are not speculated (more
  // than there are: all of them, as the runtime takes them).
  const int n_eligible = nc - n_dev - n_disk - n_spec;
  const int n_up = k->device_updates < n_eligible ? k->device_updates : n_eligible > 0 ? n_eligible : 0;
  // A disk chunk's slot: the same state, in whole 4 KiB pages (runtime/offload.c).
  out->disk_bytes = n_disk * ceil(per_chunk_state / 4096) * 4096;
  out->fits = true;
  if (n_blocks < min_blocks || out->min_device_bytes > probe->device_mem) {
    out->fits = false;
    snprintf(out->why, sizeof out->why,
             "the device (%.1f MiB) cannot hold the smallest working set: %d blocks of %.1f MiB plus %.1f MiB of "
             "activations%s%s, %.1f MiB in all", probe->device_mem / 1048576.0, min_blocks, block / 1048576.0,
             fixed_bytes / 1048576.0, gpu ? " and kernel scratch" : "",
             n_dev ? " and the device's chunks" : dup ? " and the device updates' staging" : "",
             out->min_device_bytes / 1048576.0);
  } else if (fixed_bytes + dev_state + n_blocks * block > probe->device_mem) {
    out->fits = false;
    snprintf(out->why, sizeof out->why, "%d blocks of %.1f MiB and %.1f MiB of activations%s%s need %.1f MiB; the device "
             "has %.1f MiB", n_blocks, block / 1048576.0, (fixed_bytes + dev_state) / 1048576.0,
             gpu ? " and kernel scratch" : "", n_dev ? " and the device's chunks" : dup ? " and the device updates' staging" : "",
             (fixed_bytes + dev_state + n_blocks * block) / 1048576.0, probe->device_mem / 1048576.0);
  } else if (out->host_bytes > probe->host_mem) {
    out->fits = false;
    snprintf(out->why, sizeof out->why, "the host memory (%.1f GiB) cannot hold the parameters and buffers (%.1f GiB)",
             probe->host_mem / 1073741824.0, out->host_bytes / 1073741824.0);
  } else if (dm && n_disk == 0) {
    out->fits = false;
    snprintf(out->why, sizeof out->why, "disk_master puts the disk chunks' master weights on disk, and no chunk's state "
             "goes to disk (the host holds it all, or disk_chunks 0)");
  } else if (n_disk > 0 && !(probe->disk_write_gbps > 0)) {
    out->fits = false;
    snprintf(out->why, sizeof out->why, "the state of %d chunks (%.1f GiB) needs a disk tier (a --disk-dir)",
             n_disk, out->disk_bytes / 1073741824.0);
  } else if (n_disk > 0 && probe->disk_space > 0 && out->disk_bytes > probe->disk_space) {
    out->fits = false;
    snprintf(out->why, sizeof out->why, "the state of %d chunks (%.1f GiB) does not fit the disk tier's %.1f GiB",
             n_disk, out->disk_bytes / 1073741824.0, probe->disk_space / 1073741824.0);
  }
  if (!out->fits) {
    fy_chunk_layout_free(l);
    free(pat);
    fy_graph_free(whole);
    fy_graph_free(g);
    return FY_OK;
  }
  // (the dp group's ranks are tp apart, the tp group's neighbours: each at its links' bandwidth)
  const double bwg[2] = {fy_cluster_group_gbps(&k->cluster, probe, dp, tp) * 1e9,
                         fy_cluster_group_gbps(&k->cluster, probe, tp, 1) * 1e9};
  double bw = bwg[0];

  // The simulation: the real cache on a device that keeps time.
  struct sim s = {0};
  struct moe_sim moe = {0};  // (the cache's load hook's, for a mixture of experts)
  double h2d = probe->h2d_gbps, d2h = probe->d2h_gbps;
  st = fy_timeline_create((size_t)probe->device_mem + 4096, h2d, d2h, &s.dev);
  if (st == FY_OK) fy_timeline_set_copy_latency(s.dev, probe->copy_latency_us * 1e-6);
  if (st == FY_OK) fy_timeline_set_granule(s.dev, gran);
  void *p;
  void *arena = NULL;
  for (int i = 0; st == FY_OK && i < n_fixed; i++) {
    st = fy_device_alloc(s.dev, fixed[i], &p);
    if (i == 0) arena = p;
    if (st == FY_OK && i == n_fixed - 3 && stage >= 0) {  // (before the engine's batches: the pipeline's arenas)
      for (int a = 0; st == FY_OK && a < stage_held; a++) st = fy_device_alloc(s.dev, stage_span, &p);
      if (st == FY_OK) fy_device_dealloc(s.dev, arena, fixed[0]);
    }
  }
  void *dbatch = p;
  for (int c = 0; st == FY_OK && c < n_dev; c++) {
    for (size_t i = 0; st == FY_OK && i < sizeof dev_buf / sizeof *dev_buf; i++)
      if (dev_buf[i]) st = fy_device_alloc(s.dev, dev_buf[i], &p);
    if (st == FY_OK && lag) st = fy_device_alloc(s.dev, (size_t)ce * pb, &p);
  }
  // (the sums of squares and the scale: the device chunks', or the blocks' on a GPU, sums_dev)
  if (st == FY_OK && (n_dev > 0 || sums_dev)) st = fy_device_alloc(s.dev, (size_t)g->n_params * 8, &p);
  if (st == FY_OK && (n_dev > 0 || sums_dev)) st = fy_device_alloc(s.dev, 16, &p);
  if (st == FY_OK) st = fy_stream_create(s.dev, &s.compute);
  if (st == FY_OK) st = fy_stream_create(s.dev, &s.copy_in);
  if (st == FY_OK) st = fy_stream_create(s.dev, &s.copy_out);
  if (st == FY_OK) st = fy_stream_create(s.dev, &s.optim);
  // (the lag's sums and norm on a stream of their own, and speculation's: the speculative updates
  // queued on the optimizer stream as the gradients come home hold no norm up)
  if (st == FY_OK && (lag || n_spec > 0)) st = fy_stream_create(s.dev, &s.sums);
  // (device updates: their staging sets, allocated after the device chunks' buffers, and streams)
  for (int i = 0; st == FY_OK && dup && i < 2; i++) {  // (as the fit check counts them: with no chunk to stream too)
    for (size_t b = 0; st == FY_OK && b < sizeof dup_buf / sizeof *dup_buf; b++)
      if (dup_buf[b]) st = fy_device_alloc(s.dev, dup_buf[b], &s.dup_set[i][b]);
    if (st == FY_OK) st = fy_event_create(s.dev, &s.dup_in[i]);
    if (st == FY_OK) st = fy_event_create(s.dev, &s.dup_done[i]);
    for (int b = 0; st == FY_OK && b < 4; b++) st = fy_event_create(s.dev, &s.dup_free[i][b]);
  }
  if (st == FY_OK && dup) st = fy_device_alloc(s.dev, 4 * sizeof(float), &s.dup_scale);  // (the steps' scales)
  if (st == FY_OK && n_up > 0) st = fy_stream_create(s.dev, &s.dup_up);
  if (st == FY_OK && n_up > 0) st = fy_stream_create(s.dev, &s.dup_run);
  if (st == FY_OK && n_up > 0) st = fy_stream_create(s.dev, &s.dup_down);
  if (st == FY_OK && n_up > 0) {
    s.dup_chunk = calloc((size_t)nc, sizeof *s.dup_chunk);
    s.dup_idx = calloc((size_t)nc, sizeof *s.dup_idx);
    s.dup_seen = calloc((size_t)nc, sizeof *s.dup_seen);
    s.dup_home = calloc((size_t)nc, sizeof *s.dup_home);
    if (!s.dup_chunk || !s.dup_idx || !s.dup_seen || !s.dup_home) st = fy_error_set(FY_ERR_NOMEM, "out of memory");
    for (int c = 0; st == FY_OK && c < nc; c++) s.dup_idx[c] = -1;
  }
  if (st == FY_OK) st = fy_event_create(s.dev, &s.batch_ready);
  if (st == FY_OK) st = fy_event_create(s.dev, &s.norm_ready);
  if (st == FY_OK) st = fy_event_create(s.dev, &s.dev_sums_ready);
  s.home_ready = calloc((size_t)nc, sizeof *s.home_ready);
  s.home_ready_alt = calloc((size_t)nc, sizeof *s.home_ready_alt);
  s.grad_ready = calloc((size_t)nc, sizeof *s.grad_ready);
  s.home = calloc((size_t)nc, sizeof *s.home);
  s.actions = calloc((size_t)fy_graph_max_actions(g), sizeof *s.actions);
  if (st == FY_OK && (!s.home_ready || !s.home_ready_alt || !s.grad_ready || !s.home || !s.actions))
    st = fy_error_set(FY_ERR_NOMEM, "out of memory");
  for (int c = 0; st == FY_OK && c < nc; c++) {
    st = fy_event_create(s.dev, &s.home_ready[c]);
    if (st == FY_OK) st = fy_event_create(s.dev, &s.home_ready_alt[c]);
    if (st == FY_OK) st = fy_event_create(s.dev, &s.grad_ready[c]);
    s.home[c] = (const float *)(FAKE_HOST + (uintptr_t)c * (uintptr_t)block);
  }
  if (st == FY_OK) {
    fy_timeline_name_stream(s.compute, "compute");
    fy_timeline_name_stream(s.copy_in, "copy to device");
    fy_timeline_name_stream(s.copy_out, "copy to host");
    fy_timeline_name_stream(s.optim, "host optimizer");
    fy_timeline_set_cause(s.optim, FY_STALL_OPTIMIZER);
    if (s.sums) fy_timeline_name_stream(s.sums, "gradient norm");
    if (s.dup_up) {  // (what the compute waits for on their account is the optimizer's)
      fy_timeline_name_stream(s.dup_up, "updates to device");
      fy_timeline_name_stream(s.dup_run, "device updates");
      fy_timeline_name_stream(s.dup_down, "updates to host");
      fy_timeline_set_cause(s.dup_up, FY_STALL_OPTIMIZER);
      fy_timeline_set_cause(s.dup_run, FY_STALL_OPTIMIZER);
      fy_timeline_set_cause(s.dup_down, FY_STALL_OPTIMIZER);
    }
    s.n_actions = fy_graph_pass_actions(g, s.actions);
    if (stage >= 0) {  // (the stage's ops' actions: their forward, then their backward)
      int na = 0;
      for (int a = 0; a < s.n_actions; a++)
        if (s.actions[a].op >= st_lo && s.actions[a].op < st_hi) s.actions[na++] = s.actions[a];
      s.n_actions = na;
    }
    int64_t n = 0;
    for (int a = 0; a < s.n_actions; a++) n += l->op_first[s.actions[a].op + 1] - l->op_first[s.actions[a].op];
    int32_t *trace = malloc((size_t)(n + 1) * sizeof *trace);
    if (!trace) st = fy_error_set(FY_ERR_NOMEM, "out of memory");
    n = 0;  // (the cache's accesses: not those of the device's own chunks)
    for (int a = 0; trace && a < s.n_actions; a++)
      for (int j = l->op_first[s.actions[a].op]; j < l->op_first[s.actions[a].op + 1]; j++)
        if (l->op_chunks[j] >= n_dev) trace[n++] = l->op_chunks[j];
    if (st == FY_OK) st = fy_trace_create(trace, n, nc, &s.trace);
    free(trace);
  }
  s.spill_next = FAKE_HOST + (uintptr_t)nc * (uintptr_t)block + 4096;
  if (st == FY_OK) {
    struct fy_device_cache_opts co = {.dev = s.dev, .compute = s.compute, .copy_in = s.copy_in, .copy_out = s.copy_out,
                                      .n_blocks = n_blocks, .prefetch = k->prefetch, .trace = s.trace,
                                      .home = s.home, .home_ready = s.home_ready,
                                      .staging = (float *)(s.spill_next - 2048), .spill_alloc = fake_spill_alloc,
                                      .spill_free = fake_spill_free, .spill_ctx = &s.spill_next,
                                      .elem_bytes = (size_t)pb};
    if (!sharded && !gpu && cfg->num_local_experts > 0) {  // (the engine's: CPU kernels, unsharded chunks)
      moe = (struct moe_sim){.g = g, .l = l, .home = s.home, .pb = (size_t)pb,
                             .tokens = (double)(k->micro_batch * k->seq)};
      co.load_home = moe_sim_load;
      co.load_ctx = &moe;
    }
    if (sharded) {  // this rank's shard crosses the link; the collectives fill in the rest
      co.shard_off = 0;
      co.shard_elems = ce / dp;
      co.gather = sim_gather;
      co.scatter = sim_scatter;
      co.shard_ctx = &s;
      s.gather_s = s.scatter_s = (dp - 1.0) / dp * chunk_bytes / bw;
      if (!gpu && cfg->num_local_experts > 0) {  // (the ranged loads and collectives of a mixture's chunks, ep_skips)
        if (!(s.ep_skip = calloc((size_t)nc, sizeof *s.ep_skip)) || !(s.ep_skip_out = calloc((size_t)nc, sizeof *s.ep_skip)))
          st = fy_error_set(FY_ERR_NOMEM, "out of memory");
        else ep_skips(g, ep, (double)(k->micro_batch * k->seq), s.ep_skip, s.ep_skip_out);
        s.ep_elem_s = (dp - 1.0) / dp * pb / bw;
        s.dp = dp, s.ce = ce, s.pb = (size_t)pb;
        co.load_home = ep_sim_load;
        co.load_ctx = &s;
      }
    }
    if (st == FY_OK) st = fy_device_cache_create(l, &co, &s.cache);
  }
  // The action after which each device chunk's gradients of a micro-batch are complete: its last
  // backward op (with accumulation, they go into their fp32 sum there: runtime/offload.c).
  int *dev_done = n_dev > 0 ? malloc((size_t)n_dev * sizeof *dev_done) : NULL;
  if (st == FY_OK && n_dev > 0 && !dev_done) st = fy_error_set(FY_ERR_NOMEM, "out of memory");
  for (int c = 0; st == FY_OK && c < n_dev; c++) dev_done[c] = -1;
  // Speculation: the host chunks in the order the backward completes their gradients (each
  // step's last micro-batch), and which of them are updated before the norm.
  int *bwd_order = n_spec > 0 ? malloc((size_t)nc * sizeof *bwd_order) : NULL, n_bwd = 0;
  bool *speculated = n_spec > 0 ? calloc((size_t)nc, sizeof *speculated) : NULL;
  if (st == FY_OK && n_spec > 0 && (!bwd_order || !speculated)) st = fy_error_set(FY_ERR_NOMEM, "out of memory");
  for (int a = 0; st == FY_OK && n_dev > 0 && a < s.n_actions; a++) {
    if (s.actions[a].kind != FY_ACT_BACKWARD) continue;
    for (int j = l->op_first[s.actions[a].op]; j < l->op_first[s.actions[a].op + 1]; j++)
      if (l->op_chunks[j] < n_dev) dev_done[l->op_chunks[j]] = a;
  }
  const int steps = 3;
  double ends[3] = {0}, host = 0, busy[4] = {0}, copy0[2] = {0}, optim_step = 0, cpu_copied = 0;
  // For charging the wait for the norm: the last norm's own work (its sums of squares), and when
  // the updates queued before it on the optimizer stream (the step before's) ended.
  double norm_work = 0, backlog_end = 0, adamw_end = 0;
  double optim_own = 0;  // the last step's work on the optimizer stream itself (not the lag's sums)
  int64_t pos = 0, loads0 = 0;
  double mem = probe->host_mem_gbps * 1e9;
  const double dev_mem = fy_profile_mem_rate(probe);  // (memory-bound kernels on the device)
  // (A sim copy's memcpy runs on one thread: its rate, when the probe knows it.)
  const double cp = probe->host_copy_gbps > 0 ? probe->host_copy_gbps * 1e9 : mem;
  double dread = probe->disk_read_gbps * 1e9, dwrite = probe->disk_write_gbps * 1e9;
  // (one moment's bytes an element on disk: 4 in fp32, its stored size otherwise)
  const double mv_bpp = sf == FY_STATE_F32 ? 4.0 : (double)fy_state_moment_bytes(sf, ce) / (double)ce;
  // The host AdamW's seconds an element (fy_probe_adamw_s): the state format's own measured rate
  // (bf16 and 8-bit state convert each moment, which a few cores may not keep up with), or,
  // unknown, the probe's host_adamw_gbps (timed on fp32 state's 28 bytes: the master and m and v
  // read and written, a gradient read) on the state's bytes as stored (bf16 20, 8-bit 16.06), as a
  // memory-bound update.
  const double adamw_s = fy_probe_adamw_s(probe, sf);
  s.l = l, s.sf = sf, s.gpu = gpu, s.act16 = act16, s.g16 = g16, s.f32 = cdt == FY_F32, s.pb = (size_t)pb;  // (dup_flush's)
  s.mv_bpp = mv_bpp, s.dev_mem = dev_mem, s.mem = mem, s.adamw_s = adamw_s, s.host_work = &optim_step;
  s.dup_shard = sharded ? ce / dp : 0, s.dup_piece = piece;
  for (int step = 0; st == FY_OK && step < steps; step++) {
    bool last = step == steps - 1;
    s.counting = last;
    fy_timeline_record(s.dev, last);
    struct fy_copy_stats cs;
    struct fy_device_cache_stats ks;
    if (last) {
      fy_device_copy_stats(s.dev, &cs);
      copy0[0] = cs.busy_s[0];
      copy0[1] = cs.busy_s[1];
      fy_device_cache_stats(s.cache, &ks);
      loads0 = ks.loads;
    }
    // The host enqueues the step once it knows the last step's norm: a wait that is the norm's own
    // work at most, the rest the updates queued before it (the lag's) or the gradients' way home.
    {
      double c0 = fy_timeline_clock(s.compute), gap = host - c0;
      double rest = gap > norm_work ? gap - norm_work : 0;
      if (rest > 0) fy_timeline_wait_until(s.compute, c0 + rest, backlog_end > c0 ? FY_STALL_OPTIMIZER : FY_STALL_LOAD);
      fy_timeline_wait_until(s.compute, host, FY_STALL_NORM);
    }
    bump(s.copy_in, host);
    bump(s.copy_out, host);
    n_bwd = 0;
    for (int64_t micro = 0; st == FY_OK && micro < k->grad_accum; micro++) {
      // (the micro-batch: ids, targets, mask and positions, into the last of the fixed buffers)
      if (st == FY_OK && n_up > 0) st = dup_flush(&s, fy_timeline_clock(s.copy_in), -1);
      fy_copy_async(s.copy_in, dbatch, (const void *)FAKE_HOST, fixed[n_fixed - 1]);
      fy_event_record(s.batch_ready, s.copy_in);
      fy_stream_wait(s.compute, s.batch_ready);
      fy_device_cache_begin_pass(s.cache);
      for (int a = 0; st == FY_OK && a < s.n_actions; a++) {
        const struct fy_op *op = &g->ops[s.actions[a].op];
        int o = s.actions[a].op;
        float *base;
        for (int j = l->op_first[o]; st == FY_OK && j < l->op_first[o + 1]; j++)
          if (l->op_chunks[j] >= n_dev) {
            if (n_up > 0)
              st = dup_before_access(&s, pos, l->op_chunks[j], 0,
                                     fmax(fy_timeline_clock(s.compute), fy_timeline_clock(s.copy_in)));
            if (st == FY_OK) st = fy_device_cache_acquire(s.cache, pos++, l->op_chunks[j], &base);
          }
        if (st != FY_OK) break;
        bool bwd = s.actions[a].kind == FY_ACT_BACKWARD;
        struct fy_op_profile pr;
        fy_profile_op(g, o, probe, pb, cdt, &pr);
        double t = pr.seconds[bwd] + (gpu ? 0 : pr.kernel_calls[bwd] * sim_op_overhead(probe));
        // The op's pattern's collectives around its kernel (zero's are the cache's, chunk by chunk;
        // a recomputed forward's are counted before backward, as the patterns do).
        double tc = 0;
        if (dp * tp > 1 && !(sharded && pat[o] == dpp) && s.actions[a].kind != FY_ACT_RECOMPUTE) {
          struct fy_pattern_ctx pc = {.g = whole, .op = o, .dp = dp, .tp = tp, .ep = ep, .chunk_elems = ce,
                                      .param_bytes = pb};
          tc = pattern_seconds(pat[o], &pc, bwd ? FY_PHASE_PRE_BACKWARD : FY_PHASE_PRE_FORWARD, bwg) +
               pattern_seconds(pat[o], &pc, bwd ? FY_PHASE_POST_BACKWARD : FY_PHASE_POST_FORWARD, bwg);
        }
        fy_timeline_run(s.compute, t + tc, op->name);
        if (last) busy[0] += t + tc, s.comm_s += tc;
        for (int j = l->op_first[o]; st == FY_OK && j < l->op_first[o + 1]; j++) {
          int c = l->op_chunks[j];
          if (c < n_dev) continue;
          if (fy_device_cache_release(s.cache, c, s.actions[a].kind == FY_ACT_BACKWARD) == FY_CHUNK_READY_FOR_REDUCE) {
            if (sums_dev) {
              double ts = (double)l->chunks[c].used * pb / dev_mem;
              fy_timeline_run(s.compute, ts, "sums of squares");
              if (last) busy[0] += ts;
            }
            const bool to_disk = c >= nc - n_disk && !g16;
            if (bwd_order && micro == k->grad_accum - 1 && n_bwd < nc) bwd_order[n_bwd++] = c;
            st = fy_device_cache_write_back(s.cache, c, (float *)(FAKE_HOST + (uintptr_t)c * (uintptr_t)block),
                                            micro > 0, to_disk ? NULL : s.grad_ready[c]);
            if (st == FY_OK && to_disk) {  // and on to its disk slot
              fy_timeline_run(s.copy_out, l->chunks[c].used * 4.0 * (micro > 0 ? 2 : 1) / dwrite, "to disk");
              fy_event_record(s.grad_ready[c], s.copy_out);
            }
          }
        }
        // The device's chunks whose gradients this op completed: with accumulation, summed in fp32
        // on the compute stream (the first micro-batch's copied, a GPU's widened from bf16; the
        // later ones' added).
        for (int c = 0; k->grad_accum > 1 && c < n_dev; c++) {
          if (dev_done[c] != a) continue;
          double u = (double)l->chunks[c].used, ta;
          if (gpu) ta = u * gpu_grad_sum_bytes(pb, micro == 0) / dev_mem;
          else ta = micro > 0 ? u * 12 / mem + (u > (double)FY_PAR_ELEMENTWISE ? sim_op_overhead(probe) : 0) : u * 4 / cp;
          fy_timeline_run(s.compute, ta, "gradient sum");
          if (last) busy[0] += ta;
        }
        if (st == FY_OK && n_up > 0)
          st = dup_before_access(&s, pos - 1, -1, k->prefetch,
                                 fmax(fy_timeline_clock(s.compute), fy_timeline_clock(s.copy_in)));
        if (st == FY_OK) st = fy_device_cache_prefetch(s.cache, pos - 1);
      }
    }
    // Speculative updates: the first n_spec host-tier chunks whose gradients the backward
    // completes (no disk chunk), each updated as soon as its gradients are home, in that order,
    // before the norm is known, as if it will not clip (the planner's assumption: a step that
    // clips has them updated again after the norm, about the exact step's time). Out of place into
    // the spare slot: the same bytes read and written as the update in place, but the outputs are
    // lines not read before, which the host writes more slowly than those it just read
    // (fy_adamw_state_update_into took 1.1-1.6x the in-place update's time on the 2-core dev
    // machine, `build/bench/adamw --into`): priced at SPEC_UPDATE_COST of it.
    fy_timeline_set_cause(s.optim, FY_STALL_OPTIMIZER);
    if (speculated) memset(speculated, 0, (size_t)nc * sizeof *speculated);
    for (int i = 0, taken = 0; st == FY_OK && speculated && i < n_bwd && taken < n_spec; i++) {
      const int c = bwd_order[i];
      if (c < n_dev || c >= nc - n_disk || speculated[c]) continue;
      speculated[c] = true;
      taken++;
      const double t = SPEC_UPDATE_COST * (double)l->chunks[c].used * share * adamw_s;
      fy_stream_wait(s.optim, s.grad_ready[c]);
      fy_timeline_run(s.optim, t, "AdamW (speculative)");
      fy_event_record(s.home_ready[c], s.optim);
      optim_step += t;
      if (last) optim_own += t, busy[3] += t;
    }
    // Once per step, the patterns' gradient reductions (replicate's all-reduce over dp; zero's
    // reduce-scatters were the cache's), before the norm, on the norm's stream: the optimizer's,
    // or with the lag or speculation its own, beside the updates on the optimizer stream.
    fy_stream *ns = s.sums ? s.sums : s.optim;
    if (dp * tp > 1 && st == FY_OK) {
      double tg = 0;
      for (int o = 0; o < g->n_ops; o++) {
        if (sharded) break;
        struct fy_pattern_ctx pc = {.g = whole, .op = o, .dp = dp, .tp = tp, .chunk_elems = ce, .param_bytes = pb};
        tg += pattern_seconds(pat[o], &pc, FY_PHASE_GRADS, bwg);
      }
      for (int c = 0; c < nc; c++) fy_stream_wait(ns, s.grad_ready[c]);
      fy_timeline_run(ns, tg, "gradient all-reduce");
      optim_step += tg;
      if (last && ns == s.optim) optim_own += tg;
      if (last) busy[3] += tg, s.comm_s += tg;
    }
    // The device's chunks: their sums of squares on the compute stream, which the norm waits for
    // (their AdamW follows it, there too).
    const double dev_gb = k->grad_accum > 1 ? 4 : pb;
    if (n_dev > 0 || sums_dev) {
      double t = dev_elems * dev_gb / dev_mem;
      fy_timeline_run(s.compute, t, "device norm");
      fy_event_record(s.dev_sums_ready, s.compute);
      fy_stream_wait(ns, s.dev_sums_ready);
      if (last) busy[0] += t;
    }
    // The optimizer: sums of squares as gradients arrive, the norm, then AdamW chunk by chunk.
    norm_work = 0;
    backlog_end = adamw_end;
    for (int c = n_dev; st == FY_OK && !sums_dev && c < nc; c++) {
      fy_stream_wait(ns, s.grad_ready[c]);
      // (the gradients read: a GPU's bf16 where they come home over the copy, else floats)
      double u = (double)l->chunks[c].used * share, t = u * (g16 ? pb : 4) / mem + (c >= nc - n_disk && !g16 ? u * 4 / dread : 0);
      fy_timeline_run(ns, t, "norm");
      norm_work += t;
      if (last && ns == s.optim) optim_own += t;
      optim_step += t;
      if (last) busy[3] += t;
    }
    if (st == FY_OK && n_up > 0) st = dup_flush(&s, INFINITY, n_up);  // (the step before's: queued by now)
    fy_event_record(s.norm_ready, ns);
    double norm_at = fy_timeline_clock(ns);
    if (ns != s.optim) fy_stream_wait(s.optim, s.norm_ready);  // (this step's updates need its norm)
    // (a GPU's AdamW at its memory rate; on sim the host's AdamW, on the compute thread; with the
    // lag the step before's, which waits for no norm)
    if (n_dev > 0) {
      if (!lag) fy_timeline_wait_until(s.compute, norm_at, FY_STALL_NORM);
      double t = gpu ? dev_elems * (8 + 4 * mv_bpp + (act16 ? 2 : 0) + dev_gb) / dev_mem : dev_elems * adamw_s;
      fy_timeline_run(s.compute, t, "device AdamW");
      if (last) busy[0] += t;
    }
    // Device updates: the first n_up host-tier chunks in chunk order not speculated, streamed
    // after the norm (dup_flush queues their copies as they become ready, through the next step).
    if (n_up > 0) {
      s.dup_n = s.dup_i = s.dup_k = s.dup_p = s.dup_copy = 0;
      for (int c = 0; c < nc; c++) s.dup_idx[c] = -1;
    }
    for (int c = n_dev; n_up > 0 && c < nc - n_disk && s.dup_n < n_up; c++) {
      if (speculated && speculated[c]) continue;
      s.dup_idx[c] = s.dup_n;
      s.dup_chunk[s.dup_n++] = c;
    }
    for (int c = n_dev; st == FY_OK && c < nc; c++) {
      if (speculated && speculated[c]) continue;  // (updated before the norm)
      if (n_up > 0 && s.dup_idx[c] >= 0) continue;  // (updated by the device)
      double u = (double)l->chunks[c].used * share;
      double t = u * adamw_s;
      // A disk chunk: (its fp32 gradients,) m and v (and with disk_master the fp32 master) read,
      // then the update while the chunk before's are written (runtime/offload.c: they go back
      // behind it).
      const double mv = 2 * mv_bpp + (dm ? 4 : 0);  // m and v's (and the master's) bytes an element, read and written
      if (c >= nc - n_disk) t = u * ((g16 ? 0 : 4) + mv) / dread + (t > u * mv / dwrite ? t : u * mv / dwrite);
      fy_timeline_set_cause(s.optim, c >= nc - n_disk ? FY_STALL_DISK : FY_STALL_OPTIMIZER);
      if (sums_dev) fy_stream_wait(s.optim, s.grad_ready[c]);  // (no sum waited for it)
      fy_timeline_run(s.optim, t, "AdamW");
      fy_event_record(s.home_ready[c], s.optim);
      optim_step += t;
      if (last) optim_own += t;
      if (last) busy[3] += t;
    }
    if (!gpu) {  // the same cores: the optimizer and the copies' memcpy delay the kernels
      struct fy_copy_stats now;
      fy_device_copy_stats(s.dev, &now);
      double copied = now.bytes[0] + now.bytes[1] - cpu_copied;
      cpu_copied = now.bytes[0] + now.bytes[1];
      fy_timeline_run(s.compute, optim_step + copied / cp, "host work");
    }
    fy_timeline_set_cause(s.optim, FY_STALL_OPTIMIZER);
    adamw_end = fy_timeline_clock(s.optim);
    // The lag: the next step reads the other copies, which the update of this step's predecessor
    // wrote (runtime/offload.c, swap_copies).
    for (int c = n_dev; lag && c < nc; c++) {
      fy_event *e = s.home_ready[c];
      s.home_ready[c] = s.home_ready_alt[c];
      s.home_ready_alt[c] = e;
    }
    optim_step = 0;
    host = norm_at;
    ends[step] = host;
    if (last) {
      fy_device_copy_stats(s.dev, &cs);
      busy[1] = cs.busy_s[0] - copy0[0];
      busy[2] = cs.busy_s[1] - copy0[1];
      fy_device_cache_stats(s.cache, &ks);
      out->loads_per_step = ks.loads - loads0;
    }
  }
  if (st == FY_OK) {
    out->step_s = ends[steps - 1] - ends[steps - 2];
    out->comm_s = s.comm_s;
    out->compute_s = busy[0];
    out->h2d_s = busy[1];
    out->d2h_s = busy[2];
    out->optim_s = busy[3];
    fy_timeline_stalls(s.compute, out->stall_s);
    // In a steady state no stream does more than a step's time of work a step. With the lag the
    // optimizer's backlog can outgrow the few steps simulated (each step's updates run under the
    // next), so the step is at least the busiest stream's work a step; the difference is time the
    // compute stream waits for that stream.
    double own[] = {busy[1], busy[2], gpu ? optim_own : 0};
    const enum fy_stall why[] = {FY_STALL_LOAD, FY_STALL_LOAD, FY_STALL_OPTIMIZER};
    for (int i = 0; i < 3; i++) {
      if (own[i] <= out->step_s) continue;
      out->stall_s[why[i]] += own[i] - out->step_s;
      out->step_s = own[i];
    }
    out->device_peak = (double)s.dev->bytes_peak + scratch;  // (the timeline's device holds no scratch)
    step_rates(out, k, probe);
  }
  sim_free(&s, nc);
  free(dev_done);
  free(bwd_order);
  free(speculated);
  if (st == FY_OK && timeline_out) {
    *timeline_out = s.dev;
  } else {
    fy_device_free(s.dev);
  }
  fy_chunk_layout_free(l);
  free(pat);
  fy_graph_free(whole);
  fy_graph_free(g);
  return st;
}

#define ACCUM_SIMULATED 8  // (fy_cost_simulate)

static fy_status simulate(const struct fy_opt_config *cfg, const struct fy_plan_knobs *k, const struct fy_probe *probe,
                          struct fy_cost *out, struct fy_device **timeline_out) {
  return simulate_one(cfg, k, probe, out, timeline_out, -1, k->grad_accum);
}

// Offloaded pipeline stages (knobs.pp > 1 without resident: the sim device, runtime/run.c): each
// stage is one rank's offloaded step of its own ops and chunks (simulate_one with its stage: the
// same cache, copies, host AdamW and the host work that shares the compute thread on sim), timed
// at two micro-batch counts, a and b. Their difference is the stage's cycle c_s, what one more
// micro-batch's forward and backward half-pass cost it (its ops, its chunks loaded for each
// half-pass and the loads it waited for, their copies' memcpy on the cores); the rest of its step,
// T_s(m) - m c_s, is once a step (the gradients' norm and AdamW of its chunks, what the copies
// still owe). Then the stages on the 1F1B schedule as simulate_staged lays them out: the first
// micro-batch through every stage and back, each later one the slowest cycle with its two
// receives (a hidden state each way, MPI through host memory: the probe's comm_gbps; a sim stage
// waits for each half-pass before it sends and receives before the next, so they are on its path),
// (m - 1) x period + sum c_s + the sends; a tied embedding's gradient summed between the ends;
// then the slowest stage's once-a-step part (every stage's update waits for the norm over all).
// Memory is each stage's own (its blocks, its arenas, its host and disk tiers).
static fy_status simulate_offloaded_staged(const struct fy_opt_config *cfg, const struct fy_plan_knobs *k,
                                           const struct fy_probe *probe, struct fy_cost *out) {
  const int pp = k->pp, tp = k->tp > 1 ? k->tp : 1, dp = k->dp > 1 ? k->dp : 1;
  const int64_t layers = cfg->num_hidden_layers, m = k->grad_accum;
  if (pp > layers || layers % pp)
    return fy_error_set(FY_ERR_INVALID, "plan: pp %d must divide the model's %lld decoder layers (and not exceed them)",
                        pp, (long long)layers);
  if (pp > FY_COST_MAX_STAGES) return fy_error_set(FY_ERR_INVALID, "plan: pp %d: at most %d stages", pp, FY_COST_MAX_STAGES);
  if (k->optimizer_lag) return fy_error_set(FY_ERR_INVALID, "plan: optimizer_lag 1 does not run on pipeline stages");
  // A GPU stage's messages are its activations' dtype (bf16: 2 bytes a value), NCCL send/recv
  // between the GPUs; the sim device's floats through host memory.
  const bool gpu = strcmp(probe->device, "cuda") == 0;
  const double vb = gpu && compute_dtype(k, probe) == FY_BF16 ? 2 : 4;
  // The two micro-batch counts: m itself (up to ACCUM_SIMULATED, the rest extrapolated as
  // fy_cost_simulate does) and one beside it, both accumulating when m does.
  const int64_t a = m < ACCUM_SIMULATED ? m : ACCUM_SIMULATED, b = a - 1 >= 2 ? a - 1 : a + 1;
  memset(out, 0, sizeof *out);
  out->pp = pp;
  out->fits = true;
  double c[FY_COST_MAX_STAGES], f[FY_COST_MAX_STAGES], x[FY_COST_MAX_STAGES] = {0};
  double cmax = 0, csum = 0, xsum = 0, period = 0, fmax = 0;
  int worst = 0;
  struct fy_cost slow_a = {0}, slow_b = {0};
  for (int s = 0; s < pp; s++) {
    struct fy_plan_knobs ka = *k, kb = *k;
    ka.grad_accum = a;
    kb.grad_accum = b;
    struct fy_cost ca, cb;
    FY_TRY(simulate_one(cfg, &ka, probe, &ca, NULL, s, m));
    if (!ca.fits) {
      *out = ca;
      out->pp = pp;
      snprintf(out->why, sizeof out->why, "stage %d of %d: %s", s, pp, ca.why);
      return FY_OK;
    }
    FY_TRY(simulate_one(cfg, &kb, probe, &cb, NULL, s, m));
    c[s] = (cb.step_s - ca.step_s) / (double)(b - a);
    if (c[s] < 0) c[s] = 0;
    const double tm = ca.step_s + (double)(m - a) * c[s];
    f[s] = tm - (double)m * c[s];
    if (f[s] < 0) f[s] = 0;
    out->stage_s[s] = c[s];
    out->stage_once_s[s] = f[s];
    out->stage_bytes[s] = ca.device_peak;
    if (ca.device_peak > out->device_peak) out->device_peak = ca.device_peak;
    if (ca.min_device_bytes > out->min_device_bytes) out->min_device_bytes = ca.min_device_bytes;
    if (ca.host_bytes > out->host_bytes) out->host_bytes = ca.host_bytes;
    if (ca.disk_bytes > out->disk_bytes) out->disk_bytes = ca.disk_bytes;
    if (ca.n_chunks > out->n_chunks) out->n_chunks = ca.n_chunks, out->chunk_bytes = ca.chunk_bytes;
    out->n_disk_chunks += ca.n_disk_chunks;
    out->n_device_chunks += ca.n_device_chunks;
    if (ca.host_chunks > out->host_chunks) out->host_chunks = ca.host_chunks;
    if (ca.staging_bytes > out->staging_bytes) out->staging_bytes = ca.staging_bytes;
    out->loads_per_step += ca.loads_per_step + (int64_t)(m - a) * (cb.loads_per_step - ca.loads_per_step) / (b - a);
    if (s == 0 || c[s] > cmax) cmax = c[s], worst = s, slow_a = ca, slow_b = cb;
    if (f[s] > fmax) fmax = f[s];
    csum += c[s];
    if (s < pp - 1) {
      x[s] = (double)(k->micro_batch * k->seq * cfg->hidden_size) * vb /
             (fy_cluster_p2p_gbps(&k->cluster, probe, s * tp, (s + 1) * tp, tp) * 1e9);
      xsum += x[s];
    }
  }
  for (int s = 0; s < pp; s++) {
    const double cyc = c[s] + (s > 0 ? x[s - 1] : 0) + (s < pp - 1 ? x[s] : 0);
    if (cyc > period) period = cyc;
  }
  // A tied embedding's gradient between the first and the last stage, once a step.
  double tied = 0;
  if (cfg->tie_word_embeddings)
    tied = (double)(cfg->vocab_size * cfg->word_embed_proj_dim) * 4 /  // (not split over tp)
           
           (fy_cluster_p2p_gbps(&k->cluster, probe, 0, (pp - 1) * tp, tp) * 1e9);
  const double md = (double)m, ideal = (md - 1) * cmax + csum, pipe = (md - 1) * period + csum + 2 * xsum;
  out->n_blocks = k->blocks;  // (0: each stage as many as fit its device)
  out->bubble = ideal > 0 ? 1 - md * cmax / ideal : 0;
  out->p2p_s = pipe - ideal + tied;
  out->slowest_stage = worst;
  out->step_s = pipe + tied + fmax;
  // The slowest stage's streams, at m micro-batches.
  const double more = (double)(m - a) / (double)(b - a);
  out->compute_s = slow_a.compute_s + more * (slow_b.compute_s - slow_a.compute_s);
  out->h2d_s = slow_a.h2d_s + more * (slow_b.h2d_s - slow_a.h2d_s);
  out->d2h_s = slow_a.d2h_s + more * (slow_b.d2h_s - slow_a.d2h_s);
  out->optim_s = slow_a.optim_s + more * (slow_b.optim_s - slow_a.optim_s);
  out->comm_s = slow_a.comm_s + more * (slow_b.comm_s - slow_a.comm_s) + out->p2p_s;
  for (int i = 0; i < FY_STALL_COUNT; i++)
    out->stall_s[i] = slow_a.stall_s[i] + more * (slow_b.stall_s[i] - slow_a.stall_s[i]);
  out->flops_per_step = fy_opt_step_flops(cfg, k->micro_batch, k->seq, FY_FLOPS_PALM) * md * dp;
  const char *names[] = {"compute", "pipeline bubble", "pipeline sends", "optimizer"};
  const double part[] = {md * cmax, ideal * out->bubble, out->p2p_s, fmax};
  int bi = 0;
  for (int i = 1; i < 4; i++)
    if (part[i] > part[bi]) bi = i;
  snprintf(out->bottleneck, sizeof out->bottleneck, "%s", names[bi]);
  step_rates(out, k, probe);
  return FY_OK;
}

// A step of many micro-batches: each after the first few costs what the one before it did (the
// same ops, chunk loads and copies), so a step of A > ACCUM_SIMULATED micro-batches is simulated
// with ACCUM_SIMULATED - 1 and ACCUM_SIMULATED of them and extended by the last one's share per
// further micro-batch (memory does not grow with A). A search over the micro-batch sizes of a
// large batch then no longer simulates every micro-batch of every candidate (a batch of 100000
// sequences took the planner two minutes). A timeline to draw is always the whole step.

// Ranks on one CPU machine (the cpu and sim devices: ferry train's ranks there each take their
// share of the cores, runtime/trainer.c) share its cores and its memory bandwidth: each runs its
// kernels, its AdamW and its memory-bound ops at 1/n of the rates the probe measured with all of
// them, n the ranks on a machine (all of them without a cluster, a node's with one). A GPU's
// ranks have a device each.
static fy_status cost_simulate(const struct fy_opt_config *cfg, const struct fy_plan_knobs *k,
                               const struct fy_probe *probe, struct fy_cost *out, struct fy_device **timeline_out);

static struct fy_probe rank_share(const struct fy_plan_knobs *k, const struct fy_probe *probe) {
  struct fy_probe p = *probe;
  const int ranks = (k->dp > 1 ? k->dp : 1) * (k->tp > 1 ? k->tp : 1) * (k->pp > 1 ? k->pp : 1);
  int local = k->cluster.nodes > 0 && k->cluster.gpus_per_node < ranks ? k->cluster.gpus_per_node : ranks;
  if (strcmp(probe->device, "cuda") == 0 || local <= 1) return p;
  const double f = 1.0 / local;
  p.device_gflops *= f;
  p.host_gflops *= f;
  p.host_mem_gbps *= f;
  p.host_adamw_gbps *= f, p.host_adamw_bf16_gbps *= f, p.host_adamw_8bit_gbps *= f;
  p.peak_gflops *= f;
  return p;
}

fy_status fy_cost_simulate(const struct fy_opt_config *cfg, const struct fy_plan_knobs *k,
                           const struct fy_probe *whole_machine, struct fy_cost *out, struct fy_device **timeline_out) {
  const struct fy_probe shared = rank_share(k, whole_machine), *probe = &shared;
  const fy_status st = cost_simulate(cfg, k, probe, out, timeline_out);
  // (MFU is of the whole machine's rates, the ranks' shares together; its peak is said whole)
  if (st == FY_OK && shared.peak_gflops != whole_machine->peak_gflops)
    out->peak_gflops = fy_probe_peak_gflops(whole_machine, compute_dtype(k, whole_machine) == FY_BF16);
  return st;
}

static fy_status cost_simulate(const struct fy_opt_config *cfg, const struct fy_plan_knobs *k,
                               const struct fy_probe *probe, struct fy_cost *out, struct fy_device **timeline_out) {
  if (timeline_out || k->resident || k->pp > 1 || k->grad_accum <= ACCUM_SIMULATED)
    return simulate(cfg, k, probe, out, timeline_out);
  struct fy_plan_knobs less = *k, most = *k;
  less.grad_accum = ACCUM_SIMULATED - 1;
  most.grad_accum = ACCUM_SIMULATED;
  struct fy_cost c7;
  FY_TRY(simulate(cfg, &less, probe, &c7, NULL));
  FY_TRY(simulate(cfg, &most, probe, out, NULL));
  if (!out->fits) return FY_OK;
  const double more = (double)(k->grad_accum - ACCUM_SIMULATED);
  out->step_s += more * (out->step_s - c7.step_s);
  out->compute_s += more * (out->compute_s - c7.compute_s);
  out->h2d_s += more * (out->h2d_s - c7.h2d_s);
  out->d2h_s += more * (out->d2h_s - c7.d2h_s);
  out->optim_s += more * (out->optim_s - c7.optim_s);
  out->comm_s += more * (out->comm_s - c7.comm_s);
  out->loads_per_step += (int64_t)more * (out->loads_per_step - c7.loads_per_step);
  out->flops_per_step = out->flops_per_step / ACCUM_SIMULATED * (double)k->grad_accum;
  step_rates(out, k, probe);
  return FY_OK;
}

fy_status fy_cost_svg(const struct fy_device *timeline, const struct fy_cost *c, const char *path) {
  const struct fy_timeline_span *sp;
  int n = fy_timeline_spans(timeline, &sp);
  if (n == 0) return fy_error_set(FY_ERR_INVALID, "no timeline to draw");
  double t0 = sp[0].start, t1 = sp[0].end;
  int lanes = 0;
  for (int i = 0; i < n; i++) {
    if (sp[i].start < t0) t0 = sp[i].start;
    if (sp[i].end > t1) t1 = sp[i].end;
    if (sp[i].stream + 1 > lanes) lanes = sp[i].stream + 1;
  }
  FILE *f = fopen(path, "w");
  if (!f) return fy_error_set(FY_ERR_IO, "cannot write %s", path);
  const double W = 1100, left = 130, lane_h = 34, top = 40;
  double scale = (W - left - 20) / (t1 - t0 > 0 ? t1 - t0 : 1);
  double H = top + (lanes + 2) * lane_h + 40;
  static const char *const colors[] = {"#4e79a7", "#f28e2b", "#e15759", "#59a14f", "#76b7b2", "#edc948"};
  fprintf(f, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" font-family=\"sans-serif\" "
             "font-size=\"12\">\n<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n", W, H);
  fprintf(f, "<text x=\"10\" y=\"20\" font-size=\"14\">one step: %.3f s predicted, %.0f tokens/s, bottleneck %s</text>\n",
          c->step_s, c->tokens_per_s, c->bottleneck);
  for (int l = 0; l < lanes; l++) {
    double y = top + l * lane_h;
    fprintf(f, "<text x=\"10\" y=\"%.0f\">%s</text>\n", y + 20, fy_timeline_stream_name(timeline, l));
    fprintf(f, "<line x1=\"%.0f\" y1=\"%.0f\" x2=\"%.0f\" y2=\"%.0f\" stroke=\"#ddd\"/>\n", left, y + lane_h - 2, W - 20,
            y + lane_h - 2);
  }
  for (int i = 0; i < n; i++) {
    double x = left + (sp[i].start - t0) * scale, w = (sp[i].end - sp[i].start) * scale;
    double y = top + sp[i].stream * lane_h + 4;
    fprintf(f, "<rect x=\"%.2f\" y=\"%.0f\" width=\"%.2f\" height=\"%.0f\" fill=\"%s\"><title>%s %.3f ms</title></rect>\n",
            x, y, w < 0.3 ? 0.3 : w, lane_h - 10, colors[sp[i].stream % 6], sp[i].label,
            (sp[i].end - sp[i].start) * 1e3);
  }
  // Device memory: the cache blocks and activations are allocated before the first step and held.
  double y = top + lanes * lane_h + 10, frac = c->device_peak / (timeline->cap > 0 ? (double)timeline->cap : 1);
  fprintf(f, "<text x=\"10\" y=\"%.0f\">device memory</text>\n", y + 16);
  fprintf(f, "<rect x=\"%.0f\" y=\"%.0f\" width=\"%.0f\" height=\"20\" fill=\"#eee\"/>\n", left, y, W - left - 20);
  fprintf(f, "<rect x=\"%.0f\" y=\"%.0f\" width=\"%.0f\" height=\"20\" fill=\"#b07aa1\"/>\n", left, y,
          (W - left - 20) * (frac > 1 ? 1 : frac));
  fprintf(f, "<text x=\"%.0f\" y=\"%.0f\">%.1f MiB in use through the step (%d blocks and the activations)</text>\n",
          left + 6, y + 15, c->device_peak / 1048576.0, c->n_blocks);
  fprintf(f, "<text x=\"%.0f\" y=\"%.0f\" fill=\"#555\">0 s</text><text x=\"%.0f\" y=\"%.0f\" fill=\"#555\" "
             "text-anchor=\"end\">%.3f s</text>\n</svg>\n", left, H - 10, W - 20, H - 10, t1 - t0);
  bool ok = !ferror(f);
  ok = fclose(f) == 0 && ok;
  return ok ? FY_OK : fy_error_set(FY_ERR_IO, "writing %s failed", path);
}
