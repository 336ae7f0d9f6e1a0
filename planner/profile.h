// The profiler: for a model, micro-batch and sequence, each operator's FLOPs, memory traffic,
// activation memory, workspace and parameter accesses, computed from the graph, and its time on a
// probed machine. The cost model (planner/cost.h) is built on these times; tests check them
// against `ferry train --profile` on the CPU.
#ifndef FY_PROFILE_H
#define FY_PROFILE_H

#include <stdbool.h>

#include "core/dtype.h"
#include "core/graph.h"
#include "planner/probe.h"

struct fy_op_profile {
  int op;
  double flops[2];        // forward [0], backward [1]
  double mem_bytes[2];    // bytes a memory-bound kernel moves (for GEMM-bound ops 0, or the
                          // cpu's 16-bit rounding passes)
  double act_bytes;       // its output and saved tensors (aux)
  double workspace_bytes; // scratch it needs while running (attention's backward)
  double param_bytes;     // parameters it reads
  double seconds[2];      // predicted on the probed device
  double kernel_calls[2]; // the parallel regions of the op's CPU kernels: oneDNN products and the
                          // loops large enough to be split (sim: each costs the probe's
                          // kernel_overhead_us besides its work: waking the stream thread's team)
};

// act_bytes: bytes per activation element (4 fp32, 2 bf16). compute: the run's precision (FY_F32,
// FY_BF16 or FY_F16). In bf16 a GPU's products are all bf16 ones (fp32 accumulation); a CPU's
// linears are (the probe's rate for them, fy_probe_gemm_gflops), its attention's batched products
// fp32 ones; and in 16-bit precision the cpu and sim devices, whose tensors hold floats, round each
// output and gradient to the dtype in one more pass over it (runtime/engine.c).
void fy_profile_op(const struct fy_graph *g, int op, const struct fy_probe *p, int act_bytes, enum fy_dtype compute,
                   struct fy_op_profile *out);
// Bytes per second a memory-bound kernel moves on the probed device (fy_probe_device_mem_gbps).
double fy_profile_mem_rate(const struct fy_probe *p);
// Predicted seconds of one op's kernel (forward or backward).
double fy_profile_op_seconds(const struct fy_graph *g, int op, bool backward, const struct fy_probe *p,
                             int act_bytes, enum fy_dtype compute);
// The first op kind the profile's table of op kinds (cost, CPU parallel regions, efficiency) lacks
// an entry for, or -1 when every kind has one.
int fy_profile_ops_missing(void);

#endif
