// libFuzzer target: fy_opt_config_read on an arbitrary config.json (JSON syntax, key types,
// integers given as floats, huge and negative values, nulls). On success the config must pass
// fy_opt_config_check, and the parameter and FLOP counts are computed (UBSan sees overflow).
#ifndef _GNU_SOURCE
#define _GNU_SOURCE  // memfd_create
#endif
#include <fcntl.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "core/opt.h"
#include "fuzz_common.h"


int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  const char *path = fz_write(data, size);
  struct fy_opt_config cfg;
  memset(&cfg, 0xa5, sizeof cfg);
  fy_status rc = fy_opt_config_read(path, &cfg);
  if (rc != FY_OK) {
    if (strlen(fy_error_msg()) == 0) __builtin_trap();
    return 0;
  }
  if (fy_opt_config_check(&cfg) != FY_OK) __builtin_trap();  // read promises a checked config
  if (!memchr(cfg.name, 0, sizeof cfg.name) || !memchr(cfg.torch_dtype, 0, sizeof cfg.torch_dtype))
    __builtin_trap();
  int64_t np = fy_opt_num_params(&cfg);
  if (np <= 0) __builtin_trap();
  double fl = fy_opt_step_flops(&cfg, 4, 512, FY_FLOPS_PALM) + fy_opt_step_flops(&cfg, 4, 512, FY_FLOPS_LLMC);
  if (!(fl > 0) || isinf(fl)) __builtin_trap();
  return 0;
}
