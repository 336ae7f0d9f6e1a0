// --plan: a plan's knobs applied to a run's options.
#include "runtime/trainer.h"

#include <math.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "core/log.h"
#include "ops/ops.h"
#include "fy_config.h"
#include "runtime/engine.h"
#include "runtime/model.h"
#include "runtime/offload.h"
#include "runtime/checkpoint.h"
#include "runtime/comm.h"
#include "planner/plan.h"
#include "planner/probe.h"
#include "memory/tier.h"
#include "runtime/run.h"

// --plan: the plan's knobs replace the run's (a plan that cannot fit this machine is refused with
// the reason). An offloaded plan runs on the sim device, whose machine is the cached probe with
// this run's device memory and link, or with --device cuda on the GPU with --offload (the plan
// came from `ferry plan --device cuda`: this process cannot time a GPU, and the offload engine
// refuses a plan that does not fit when it sets up). A resident plan (ferry plan --device cuda
// for a model that fits the GPU whole) runs with --device cuda without --offload, its ranks
// replicas, pipeline stages (dp x pp) or, with dp 1, tensor-parallel slices kept on the GPUs;
// an offloaded one with --offload, its layout any dp x pp x tp. With several ranks (comm), rank 0
// alone reads or measures the machine (timing it while the others time it too would measure them
// all) and every rank plans from its figures: the same plan everywhere.
// seq_given: --seq was given (not the default), so a plan for other sequences says it overrides it.
fy_status apply_plan(struct fy_train_opts *o, struct fy_comm *comm, bool seq_given) {
  const bool cuda = o->device && strcmp(o->device, "cuda") == 0, automatic = strcmp(o->plan, "auto") == 0;
  const int ranks = fy_comm_size(comm), rank = fy_comm_rank(comm);
  if (cuda && automatic && !FY_HAVE_CUDA)
    return fy_error_set(FY_ERR_UNSUPPORTED, "--plan auto with --device cuda needs a ferry built with CUDA: write a "
                        "plan with ferry plan --device cuda%s --out FILE and train with --plan FILE",
                        ranks > 1 ? " --gpus N" : "");
  struct fy_plan plan;
  if (!automatic) {
    FY_TRY(fy_plan_read(o->plan, &plan));
    // A plan is for its model: the run's when --model (or --init DIR, --resume) does not say which.
    static char plan_model[sizeof plan.model];
    const bool named = o->model || o->resume || (o->init && strcmp(o->init, "random") != 0);
    if (!named && plan.model[0]) {
      snprintf(plan_model, sizeof plan_model, "%s", plan.model);
      o->model = plan_model;
      if (fy_comm_launch_rank() == 0) fy_log_info("--plan %s is for %s: training it", o->plan, plan_model);
    }
  }
  struct fy_opt_config cfg;
  FY_TRY(resolve_config(o, &cfg));
  cfg.train_dropout = train_dropout(o, &cfg);  // (the planner prices the graph that will run)
  struct fy_probe probe;
  size_t dev_mem = o->device_mem ? o->device_mem : (size_t)1 << 30;
  if (!cuda || automatic) {
    // The sim device: the cached probe with this run's device memory and link. A GPU (--plan
    // auto): the cached probe of a GPU, else this machine's measured (GPU 0's figures).
    char path[4096];
    fy_probe_default_path(path, sizeof path);
    const struct fy_probe_cache c = {.path = path, .device = cuda ? "cuda" : "sim", .disk_dir = o->disk_dir,
                                     .gpu = cuda, .write = true,  // (a cache: failing to write it is no error)
                                     .device_mem = (double)dev_mem, .link_gbps = o->sim_link_gbps};
    bool measured = false;
    fy_status st = rank == 0 ? fy_probe_cached(&c, &probe, &measured) : FY_OK;
    if (ranks > 1) {  // rank 0's figures (or that it has none) to every rank
      int32_t ok = st == FY_OK;
      FY_TRY(fy_comm_broadcast(comm, &ok, sizeof ok, 0, NULL));
      if (!ok)
        return rank == 0 ? st : fy_error_set(FY_ERR_INVALID, "--plan auto: rank 0 could not read or measure the machine");
      FY_TRY(fy_comm_broadcast(comm, &probe, sizeof probe, 0, NULL));
    }
    FY_TRY(st);
    if (rank == 0 && measured) fy_log_info("--plan auto: this machine measured for the planner (cached in %s)", path);
    char v[64];
    if (!cuda || o->device_mem) {
      snprintf(v, sizeof v, "%zu", dev_mem);
      FY_TRY(fy_probe_override(&probe, "device_mem", v));
    }
    if (o->host_mem) {
      snprintf(v, sizeof v, "%zu", o->host_mem);
      FY_TRY(fy_probe_override(&probe, "host_mem", v));
    }
    if (!cuda && o->sim_link_gbps > 0) {
      snprintf(v, sizeof v, "%g", o->sim_link_gbps);
      FY_TRY(fy_probe_override(&probe, "link_gbps", v));
    }
    // The ranks on this machine share its memory and its disk: each plans with its share, as it
    // runs with it (setup_offload), --host-mem being already one rank's.
    const int local = fy_comm_local_size(comm) > 1 ? fy_comm_local_size(comm) : 1;
    if (!o->host_mem) probe.host_mem = floor(probe.host_mem / local);
    probe.disk_space = floor(probe.disk_space / local);
    if (!o->disk_dir) {  // (a disk the cached probe timed is not this run's without --disk-dir)
      probe.disk_read_gbps = probe.disk_write_gbps = probe.disk_space = 0;
      probe.disk_dir[0] = '\0';
    }
  }
  if (automatic) {  // the global batch as if every rank were data-parallel, in this run's precision
    FY_TRY(fy_plan_search_state(&cfg, o->model ? o->model : cfg.name, o->batch * o->grad_accum * ranks, o->seq, ranks,
                                cuda && o->offload, o->precision, o->optimizer_lag, o->optimizer_state, &probe, &plan,
                                NULL));
  } else {
    if (plan.k.resident && !cuda)
      return fy_error_set(FY_ERR_INVALID, "--plan %s keeps the whole model on a GPU (resident): train it with "
                          "--device cuda", o->plan);
    if (plan.k.resident && o->offload)
      return fy_error_set(FY_ERR_INVALID, "--plan %s keeps the whole model on the GPU (resident), and --offload asks "
                          "for it offloaded: drop --offload, or write an offloaded plan (ferry plan --offload)", o->plan);
    if (plan.k.seq != o->seq && seq_given && fy_comm_launch_rank() == 0)  // (rank 0 speaks for all)
      fy_log_info("--plan %s is for sequences of %lld tokens, not %lld: the plan's are used", o->plan,
                  (long long)plan.k.seq, (long long)o->seq);
    if (o->batch_given && (plan.k.micro_batch != o->batch || plan.k.grad_accum != o->grad_accum) &&
        fy_comm_launch_rank() == 0)
      fy_log_info("--plan %s is for micro-batches of %lld sequences, %lld accumulated a step, not --batch %lld "
                  "--grad-accum %lld: the plan's are used", o->plan, (long long)plan.k.micro_batch,
                  (long long)plan.k.grad_accum, (long long)o->batch, (long long)o->grad_accum);
    // What ferry train runs of a plan is what the search prices (planner/plan.c, fy_plan_refused: the
    // one place that says so); a plan runs on sim or on cuda.
    struct fy_plan_knobs lk = plan.k;
    lk.dp = plan.dp, lk.tp = plan.tp, lk.pp = plan.pp, lk.ep = plan.ep;
    snprintf(lk.pattern, sizeof lk.pattern, "%s", plan.pattern);
    const char *no = fy_plan_refused(cuda ? "cuda" : "sim", &cfg, &lk);
    if (no)
      return fy_error_set(FY_ERR_UNSUPPORTED, "--plan %s (dp %d x pp %d x tp %d, %s%s%s): %s: not supported yet",
                          o->plan, plan.dp, plan.pp > 1 ? plan.pp : 1, plan.tp, plan.k.resident ? "resident" : "offloaded",
                          plan.dp > 1 ? ", " : "", plan.dp > 1 ? plan.pattern : "", no);
    if (o->ep > 1 && o->ep != plan.ep)
      return fy_error_set(FY_ERR_INVALID, "--plan %s is for ep %d, not --ep %d: drop --ep, or write a plan for it",
                          o->plan, plan.ep, o->ep);
    if (plan.dp * plan.pp * plan.tp != ranks)  // (first: its memory and chunks are for that many)
      return fy_error_set(FY_ERR_INVALID, "--plan %s is for %d ranks (%d x %d x %d); this run has %d", o->plan,
                          plan.dp * plan.pp * plan.tp, plan.dp, plan.pp, plan.tp, ranks);
    fy_status st = cuda ? fy_plan_validate(&cfg, &plan) : fy_plan_check(&cfg, &plan, &probe);
    if (st != FY_OK) return fy_error_wrap(st, "--plan %s cannot run here", o->plan);
  }
  // The plan's precision is the run's; another given with --precision is refused, as its memory
  // and speed are another plan's. (A plan file written before plans said theirs is for the
  // device's default, and takes --precision as such files always did.)
  enum fy_dtype pdt = FY_F32;  // (a plan file's precision is checked when read)
  fy_precision_dtype(fy_cost_precision(&plan.k, cuda ? "cuda" : "sim"), &pdt);
  const char *prec = fy_precision_name(pdt);  // (static: not the local plan's)
  if (o->precision && strcmp(o->precision, prec) != 0 && plan.k.precision[0])
    return fy_error_set(FY_ERR_INVALID, "--plan %s is for %s compute, not --precision %s: drop --precision, or write a "
                        "plan for it (ferry plan --precision %s)", o->plan, prec, o->precision, o->precision);
  if (o->precision && strcmp(o->precision, prec) != 0 && fy_comm_launch_rank() == 0)
    fy_log_info("--plan %s says no precision (written before plans did): it was priced for %s compute, and runs in "
                "--precision %s", o->plan, prec, o->precision);
  if (!o->precision) o->precision = prec;
  o->tp = plan.tp;
  o->pp = plan.pp > 1 ? plan.pp : 1;
  o->ep = plan.ep > 1 ? plan.ep : 0;
  const struct fy_plan_knobs *k = &plan.k;
  if (cuda) {
    o->offload = !k->resident;  // (--device-mem stays the run's: the GPU's unless given)
  } else {
    o->device = "sim";
    o->device_mem = dev_mem;
  }
  o->batch = k->micro_batch;
  o->grad_accum = k->grad_accum;
  o->seq = k->seq;
  o->recompute = k->recompute;
  if (!k->resident) {  // (a resident run has no chunks)
    o->chunk_mib = k->chunk_elems * 4.0 / 1048576.0;
    o->blocks = k->blocks;
    o->prefetch = k->prefetch;
    o->disk_chunks = k->disk_chunks;
    o->disk_master = k->disk_master;
    o->device_chunks = k->device_chunks;
    o->spec_chunks = k->spec_chunks;
    o->device_updates = k->device_updates;
  }
  if (k->optimizer_lag && !o->optimizer_lag && fy_comm_launch_rank() == 0)
    fy_log_info("--plan %s is for the one-step-delayed update: training with --optimizer-lag %d", o->plan,
                k->optimizer_lag);
  if (k->optimizer_lag) o->optimizer_lag = k->optimizer_lag;
  // The plan's AdamW state format is the run's (its host and disk bytes are that format's).
  enum fy_state_format pf = FY_STATE_F32;
  if (k->optimizer_state[0]) fy_state_format_from_name(k->optimizer_state, &pf);  // (checked when read)
  if (o->optimizer_state && strcmp(o->optimizer_state, fy_state_format_name(pf)) != 0)
    return fy_error_set(FY_ERR_INVALID, "--plan %s is for AdamW state stored as %s, not --optimizer-state %s: drop "
                        "--optimizer-state, or write a plan for it (ferry plan --optimizer-state %s)", o->plan,
                        fy_state_format_name(pf), o->optimizer_state, o->optimizer_state);
  o->optimizer_state = fy_state_format_name(pf);
  if (o->quiet || fy_comm_launch_rank() != 0) return FY_OK;  // (rank 0 speaks for all)
  if (!cuda || automatic) {
    fy_plan_print(&plan, stdout);
  } else if (k->resident) {  // (not re-simulated here: the plan's own figures are those of ferry plan)
    char lay[96] = "";
    if (plan.pp > 1 || plan.tp > 1)
      snprintf(lay, sizeof lay, " (dp %d x pp %d x tp %d: each rank its stage's part)", plan.dp, plan.pp > 1 ? plan.pp : 1,
               plan.tp);
    printf("plan %s for the GPU: the whole model resident%s%s; micro-batch %lld x %lld tokens, %lld accumulated, "
           "recompute %s\n", o->plan, plan.dp > 1 && plan.pp <= 1 ? " on every rank (replicas)" : "", lay,
           (long long)k->micro_batch, (long long)k->seq, (long long)k->grad_accum, k->recompute ? "on" : "off");
  } else if (plan.pp > 1) {
    printf("plan %s for the GPUs: dp %d x pp %d x tp %d, each stage offloading its own chunks (as many cache blocks as "
           "fit, the state its host share cannot hold on disk); micro-batch %lld x %lld tokens, %lld a step (1F1B); "
           "chunks of %.2f MiB, prefetch %d, recompute %s; each stage's %d chunks updated speculatively "
           "(--spec-chunks), %d updated on the GPU (--device-updates)\n", o->plan, plan.dp, plan.pp, plan.tp,
           (long long)k->micro_batch, (long long)k->seq, (long long)k->grad_accum, o->chunk_mib, k->prefetch,
           k->recompute ? "on" : "off", k->spec_chunks, k->device_updates);
  } else {
    printf("plan %s for the GPU: micro-batch %lld x %lld tokens, %lld accumulated; chunks of %.2f MiB, prefetch %d, "
           "recompute %s, the AdamW state%s of %d chunks on disk, %d on the GPU, %d updated speculatively "
           "(--spec-chunks), %d updated on the GPU (--device-updates)\n", o->plan, (long long)k->micro_batch,
           (long long)k->seq, (long long)k->grad_accum, o->chunk_mib, k->prefetch, k->recompute ? "on" : "off",
           k->disk_master ? " and master weights" : "", k->disk_chunks > 0 ? k->disk_chunks : 0, k->device_chunks,
           k->spec_chunks, k->device_updates);
  }
  return FY_OK;
}
