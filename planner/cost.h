// The cost model (docs/design.md, `fy_plan`): one training step simulated as a timeline of streams —
// compute, copies to and from the device, the host optimizer — from the model's operators, the
// probe's rates and the plan's knobs. The device chunk cache itself (memory/device_cache.h) runs
// against a timeline device (planner/timeline.h), so the predicted loads, prefetches, evictions,
// spills and device memory are the ones the runtime will have; only durations are modelled.
#ifndef FY_COST_H
#define FY_COST_H

#include <stdbool.h>
#include <stdint.h>

#include "core/device.h"
#include "core/dtype.h"
#include "core/opt.h"
#include "core/stall.h"
#include "planner/probe.h"

// Where a plan's ranks lie (ferry plan --nodes K --gpus-per-node G --intra-gbps --inter-gbps): K
// nodes of G GPUs each, ranks numbered node by node (rank r on node r / G), GPUs of a node joined
// at intra_gbps (GB/s each way, a GPU's), nodes at inter_gbps (GB/s each way, a node's network
// links together, shared by its GPUs). nodes 0: no cluster given — every link between ranks is the
// probe's comm_gbps (fy_probe_comm_gbps), as on one machine.
struct fy_cluster {
  int nodes, gpus_per_node;
  double intra_gbps, inter_gbps;
};

// The bandwidth (GB/s) of a ring collective over a group of n ranks `stride` apart (the dp x pp x tp
// grid's groups: tp's stride 1, a stage's data-parallel group's pp x tp): the intra-node link when
// the group lies in one node, else the slowest hop: the intra-node link or the node's network
// shared by the groups that cross it at once (G / q of them, q of each group's ranks on a node).
double fy_cluster_group_gbps(const struct fy_cluster *cl, const struct fy_probe *p, int n, int stride);
// The bandwidth (GB/s) one rank of a tp group of `tp` sends at from global rank a to rank b (a
// pipeline stage's activation to the next one's): the intra-node link within a node, the node's
// network shared by the tp ranks that send across it at once between nodes.
double fy_cluster_p2p_gbps(const struct fy_cluster *cl, const struct fy_probe *p, int a, int b, int tp);

// What the planner decides (and a plan file holds).
struct fy_plan_knobs {
  int64_t micro_batch, grad_accum, seq;
  int64_t chunk_elems;   // 0: the smallest that holds the largest parameter group
  int blocks;            // device cache blocks; 0: as many as the device holds
  int prefetch;
  bool recompute;
  int disk_chunks;       // chunks whose gradients and AdamW state live on disk; -1: as needed
  // 16-bit compute: the disk chunks' fp32 master weights live on disk too, read and written with
  // their m and v (ferry train --disk-master); the host keeps their 16-bit copy. Offloaded plans
  // with disk chunks only.
  bool disk_master;
  int device_chunks;     // the first chunks kept on the device with their gradients and AdamW
                         // state, updated there (ferry train --device-chunks); one data-parallel rank
  // Ranks (a dp x tp grid): tp ranks split each layer's attention and MLP linears (tp_col and
  // tp_row); the dp groups run `pattern` (planner/pattern.h) over the rest — "zero" (chunks
  // sharded over dp, as the runtime does on the sim device), "replicate", or a registered one.
  // 0 means 1; an empty pattern means zero with dp > 1, else replicate.
  int dp, tp;
  char pattern[32];
  // Pipeline stages (runtime/pipeline.h; 0 or 1: none): the grid is dp x pp x tp, tp innermost
  // (rank = (dp_rank x pp + stage) x tp + tp_rank), the decoder layers split evenly over the
  // stages (the embeddings with the first, the final norm, lm_head and loss with the last), each
  // stage resident on its ranks (a resident plan), grad_accum micro-batches a step on the 1F1B
  // schedule. A resident plan with pp > 1 or a cluster is costed stage by stage (fy_cost_simulate):
  // there "zero" shards the fp32 master weights, AdamW's m and v and the fp32 gradients over the
  // stage's data-parallel group (ZeRO-1: the 16-bit weights and gradients stay whole; the
  // gradients reduce-scattered and the weights all-gathered once a step), "replicate" keeps them all.
  int pp;
  // Expert parallelism (runtime/ep.c; 0 or 1: none): a mixture's experts computed by groups of ep
  // data-parallel ranks, each rank E/ep of them, the rows moved by all-to-alls (the `expert`
  // pattern's comm(), costed on the data-parallel link). Offloaded sim plans with sharded chunks
  // (pattern zero) only, ep dividing dp and the experts; every rank's chunks keep every expert.
  int ep;
  // Where the ranks lie (not a choice: the machine's; the search copies it in). Every collective
  // and point-to-point send is timed over the links its ranks cross.
  struct fy_cluster cluster;
  // Everything resident on a GPU (probe "cuda" only): weights, gradients, AdamW's state and the
  // activations on the device, the optimizer there too; no chunks, blocks, prefetch or disk (the
  // knobs above that say so are 0). Several ranks of one stage are replicas (pattern
  // "replicate") whose gradients are summed over the ranks once a step; with tp > 1 (each rank
  // its slices: ferry train --tp without --offload) or pp > 1 it is costed stage by stage. What
  // ferry train --device cuda runs without --offload (planner/plan.h, fy_plan_refused: which
  // layouts it runs).
  bool resident;
  // The compute precision the plan is for: "fp32", "bf16", or "fp16" (cpu and sim); "" means the
  // device's default (bf16 on a GPU, fp32 on cpu and sim: what ferry train runs without
  // --precision). On a GPU 16-bit halves the payload crossing the link, the cache blocks and the
  // activations; on cpu and sim (whose chunks and activations hold floats in any precision) it
  // changes only the products' rate (the probe's bf16_speedup; fp16's products are fp32 ones).
  char precision[8];
  // 1: the one-step-delayed update (ferry train --optimizer-lag 1): each step's host updates run
  // under the next step, which reads the other of two 16-bit copies a chunk; the device chunks'
  // updates run after the next step's passes. 16-bit compute, grad_accum 1, offloaded only.
  int optimizer_lag;
  // How AdamW's m and v are stored (ferry train --optimizer-state): "fp32" (or ""), "bf16" or
  // "8bit" (ops/ops.h): the bytes of every chunk's state in the host tier, on disk and on the
  // device; 8-bit packs the chunks at multiples of 256 elements (runtime/model.h). Offloaded plans
  // only (a resident GPU keeps fp32 state).
  char optimizer_state[8];
  // Speculative updates (ferry train --spec-chunks N): the host-tier chunks whose gradients come
  // home first in the backward (the last host-tier chunks in forward order, neither device nor
  // disk chunks), up to N of them, are updated on the host before the gradient norm is known, as
  // if it will not clip, into a spare slot each (fp32 master, m and v at their stored size, the
  // 16-bit copy: host memory, priced); the norm then keeps them (no clipping, finite) or has them
  // redone from the untouched slot, so the bits are the exact step's either way. The rest are
  // updated after the norm as without it. Offloaded (one rank, tp, sharded dp: a rank its shards;
  // pipeline stages: a stage N of its own chunks), no lag. 0: none.
  int spec_chunks;
  // Device updates (ferry train --device-updates N): the first N host-tier chunks in chunk order
  // (after the device chunks) that are not speculated are updated by the device instead of the
  // host's optimizer: once the norm is known their fp32 master, m, v (at their stored size) and
  // gradients cross the link, a piece (fy_chunk_piece_elems) at a time, to one of two staging sets
  // in device memory (each a piece's master, m, v, gradients and with 16-bit compute its 16-bit
  // copy: device memory, priced, so fewer cache blocks fit), the device's AdamW (the device
  // chunks' kernels) updates them, and master, m, v and the new 16-bit copy go home, on three
  // streams of their own sharing the link with the cache's copies; the host updates the other
  // chunks meanwhile. Offloaded on a GPU or sim: one rank, tp ranks, sharded data-parallel ranks
  // (a rank its shards), offloaded pipeline stages (each stage N of its own chunks); not
  // optimizer_lag, a resident plan or the cpu device; N beyond the host-tier chunks neither
  // speculated nor on disk counts as all of them. 0: none.
  int device_updates;
};

// The precision a device computes in by default (docs/design.md, "Numbers"): "bf16" on a GPU ("cuda"),
// "fp32" on the cpu and sim devices (and NULL: the cpu's). A static string.
const char *fy_cost_default_precision(const char *device);
// The knobs' precision, "" resolved for the device ("cpu", "sim" or "cuda").
const char *fy_cost_precision(const struct fy_plan_knobs *k, const char *device);
// A precision for a plan on `device`: NULL or "" is the device's default; FY_ERR_INVALID with the
// reason unless fp32, bf16, or fp16 off a GPU. *dt: its dtype.
fy_status fy_cost_check_precision(const char *precision, const char *device, enum fy_dtype *dt);

struct fy_cost {
  bool fits;
  char why[320];           // when it does not fit: what and by how much
  // All ranks' tokens and model FLOPs (fy_opt_step_flops: PaLM's and Megatron's count); MFU per
  // rank against the device's measured GEMM rate (mfu) and against its dense peak (mfu_peak,
  // fy_probe_peak_gflops; peak_gflops 0 when unknown, and mfu_peak then the same as mfu).
  double step_s, tokens_per_s, flops_per_step, mfu, mfu_peak, peak_gflops;
  // The step while the gradient norm clips (or skips): with speculative updates (spec_chunks) the
  // steps after one that clipped do not speculate until one would have stood, so a run that
  // clips steps at the plan's step without them. The simulation sets it to step_s; the search
  // (planner/plan.c, try_spec) to the same plan's without speculation.
  double clip_step_s;
  double compute_s, h2d_s, d2h_s, optim_s;  // busy seconds per step of each stream
  double comm_s;           // collectives per step (inside the streams' busy time), 0 on one rank
  // Seconds per step the compute stream waited, by cause (core/stall.h): what ferry train
  // --profile measures on an offloaded run.
  double stall_s[FY_STALL_COUNT];
  char bottleneck[24];     // "compute", "copy to device", "copy to host", "optimizer"
  double device_peak, min_device_bytes, host_bytes, disk_bytes;
  int n_blocks, n_chunks, n_disk_chunks, n_device_chunks;  // (0 for a resident plan)
  // The chunks whose state the host tier holds (neither device nor disk chunks): what speculative
  // updates and device updates take theirs from (a stage's most with offloaded stages, where each
  // stage's engine takes spec_chunks and device_updates of its own).
  int host_chunks;
  double chunk_bytes;
  double device_chunk_bytes;  // what one chunk kept on the device takes there (device_chunks)
  double staging_bytes;       // the device updates' two staging sets in device memory (device_updates)
  int64_t loads_per_step;
  // A resident plan of pipeline stages (knobs.pp > 1), of tensor-parallel ranks or on a cluster,
  // costed stage by stage: the 1F1B bubble (the idle share of the slowest stage's step,
  // (p - 1) / (m + p - 1) for p equal stages and m micro-batches), the point-to-point sends' seconds on the step's path
  // (p2p_s), the data-parallel gradient reduction (dp_comm_s, the slowest stage's) and the
  // tensor-parallel collectives (tp_comm_s, inside the stages' compute); each stage's device bytes
  // (stage_bytes[s], s < FY_COST_MAX_STAGES; device_peak their largest), compute seconds a
  // micro-batch (forward and backward, stage_s[s]) and the slowest stage.
  int pp, slowest_stage;
  double bubble, p2p_s, dp_comm_s, tp_comm_s;
#define FY_COST_MAX_STAGES 256
  double stage_bytes[FY_COST_MAX_STAGES], stage_s[FY_COST_MAX_STAGES];
  // Offloaded stages (pp > 1 on sim): stage_s[s] is a stage's cycle (one more micro-batch's
  // forward and backward half-pass, its chunk loads and copies with it) and stage_once_s[s] its
  // once-a-step part (norm, host AdamW, what its copies still owe); the step is
  // (m - 1) x the slowest cycle with its receives + the cycles' sum + the sends + the largest
  // once-a-step part (planner/cost.c, simulate_offloaded_staged).
  double stage_once_s[FY_COST_MAX_STAGES];
};

// Host bytes per parameter of an offloaded model (runtime/offload.h), as runtime/trainer.c counts
// them: the fp32 master weights, with 16-bit compute their copy in the payload (what crosses the
// link: a GPU's bf16, 2 bytes; the sim device's rounded floats, 4), AdamW's m and v, and fp32
// gradients unless 16-bit compute's come home over that copy (without accumulation).
double fy_cost_host_bytes_per_param(enum fy_dtype compute, int payload_bytes, bool accumulate);
// The same with m and v stored in `state` ("fp32", "bf16", "8bit"; NULL or "": fp32), per
// parameter of a chunk of chunk_elems elements (8-bit: its codes and its blocks' scales).
double fy_cost_host_bytes_per_param_state(enum fy_dtype compute, int payload_bytes, bool accumulate, const char *state,
                                          int64_t chunk_elems);
// Per parameter of a chunk whose state is on disk (its slot holds its gradients unless they come
// home over the 16-bit copy, m and v in `state`, and with disk_master the fp32 master): *host the
// bytes left in host memory (the master unless disk_master, the 16-bit copy), *disk the slot's.
// disk_master with fp32 compute is not a placement (the master is what the device reads): *host
// then counts it as without.
void fy_cost_disk_chunk_bytes_per_param(enum fy_dtype compute, int payload_bytes, bool accumulate, const char *state,
                                        int64_t chunk_elems, bool disk_master, double *host, double *disk);

// A model resident on a GPU with micro-batches of B x T, its graph as the cuda engine runs it
// (flash attention; recomputation when asked; 16-bit activations with bf16): *bytes it takes there
// (fy_graph_model_bytes and the kernels' scratch, to the byte), *state_bytes of it the weights
// (and with train, gradients and AdamW state) alone. Resident plans are priced with it, and the
// trainer checks a resident run against it before allocating.
fy_status fy_cost_resident_bytes(const struct fy_opt_config *cfg, int64_t B, int64_t T, bool recompute, bool train,
                                 bool bf16, bool accumulate, double *bytes, double *state_bytes);

// The knobs agree with each other (what needs no model or machine): positive sizes; chunks on
// the device with one data-parallel rank only; prefetch and blocks not negative; a resident plan without chunk knobs, its ranks
// replicas; a known precision. fy_cost_simulate checks them first (and that a GPU's precision is
// bf16 or fp32).
fy_status fy_cost_check_knobs(const struct fy_plan_knobs *k);

// Simulates `steps` steps (the last ones count) of cfg under the knobs on the probed machine.
// timeline_out, when not NULL, receives the timeline device with the last step's spans
// (free it with fy_device_free).
fy_status fy_cost_simulate(const struct fy_opt_config *cfg, const struct fy_plan_knobs *k,
                           const struct fy_probe *probe, struct fy_cost *out,
                           struct fy_device **timeline_out);
// Writes the step's timeline as an SVG: one lane per stream, and device memory over the step.
fy_status fy_cost_svg(const struct fy_device *timeline, const struct fy_cost *c, const char *path);

#endif
