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

// One file per process, rewritten for every input: a memfd (no file left behind), else /tmp.
static char fz_path[64];
static int fz_fd = -1;

static void fz_cleanup(void) {
  if (strncmp(fz_path, "/tmp/", 5) == 0) unlink(fz_path);
}

static const char *fz_write(const uint8_t *data, size_t size) {
  if (fz_fd < 0) {
    fz_fd = memfd_create("fuzz_config", MFD_CLOEXEC);
    if (fz_fd >= 0) {
      snprintf(fz_path, sizeof fz_path, "/proc/self/fd/%d", fz_fd);
    } else {
      snprintf(fz_path, sizeof fz_path, "/tmp/ferry-fuzz-cfg-%d", (int)getpid());
      fz_fd = open(fz_path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
      if (fz_fd < 0) abort();
      atexit(fz_cleanup);
    }
  }
  if (ftruncate(fz_fd, 0) != 0) abort();
  for (size_t done = 0; done < size;) {
    ssize_t w = pwrite(fz_fd, data + done, size - done, (off_t)done);
    if (w <= 0) abort();
    done += (size_t)w;
  }
  return fz_path;
}

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
  double fl = fy_opt_step_flops(&cfg, 4, 512);
  if (!(fl > 0) || isinf(fl)) __builtin_trap();
  return 0;
}
