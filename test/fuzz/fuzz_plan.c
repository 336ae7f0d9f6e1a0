// libFuzzer target: plan files (fy_plan_read): arbitrary JSON, unknown keys, wrong types, values
// out of range. An accepted plan holds sane knobs.
#include "planner/plan.h"
#include "fuzz_common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  const char *path = fz_write(data, size);
  struct fy_plan p;
  if (fy_plan_read(path, &p) == FY_OK) {
    const struct fy_plan_knobs *k = &p.k;
    if (k->micro_batch < 1 || k->grad_accum < 1 || k->seq < 1 || k->prefetch < 0 || k->blocks < 0 ||
        k->chunk_elems < 0 || k->disk_chunks < -1 || p.dp < 1 || p.tp < 1 || !memchr(p.model, 0, sizeof p.model))
      abort();
  }
  return 0;
}
