// Why the compute stream waited in an offloaded step: what ferry train --profile measures and
// ferry plan predicts, so that the two can be set side by side. A wait is charged to what held it
// up: a chunk's load over the link (or a block's write-back it needed), the host optimizer's
// update of a chunk the pass reads (AdamW of the step before, on the host), the disk (a disk
// chunk's state read or written), or the gradient norm that ends a step (the next step is
// enqueued once it is known).
#ifndef FY_STALL_H
#define FY_STALL_H

#include <stdio.h>

enum fy_stall { FY_STALL_LOAD, FY_STALL_OPTIMIZER, FY_STALL_DISK, FY_STALL_NORM, FY_STALL_COUNT };

static inline const char *fy_stall_name(enum fy_stall s) {
  static const char *const names[FY_STALL_COUNT] = {"chunk loads", "host optimizer", "disk", "gradient norm"};
  return (unsigned)s < FY_STALL_COUNT ? names[s] : "?";
}

// " chunk loads 0.201 s, host optimizer 1.740 s, ...\n": the waits' line after its heading, as
// ferry train --profile and ferry plan print it.
static inline void fy_stall_print(FILE *f, const double seconds[FY_STALL_COUNT]) {
  for (int i = 0; i < FY_STALL_COUNT; i++)
    fprintf(f, "%s %s %.3f s", i ? "," : "", fy_stall_name((enum fy_stall)i), seconds[i]);
  fprintf(f, "\n");
}

#endif
