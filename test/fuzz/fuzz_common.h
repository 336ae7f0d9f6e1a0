// Shared by the fuzz targets: the input as a file the parsers can open.
#ifndef FY_FUZZ_COMMON_H
#define FY_FUZZ_COMMON_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE  // memfd_create
#endif
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

// One file per process, rewritten for every input: a memfd (no file left behind), else /tmp.
static char fz_path[64];
static int fz_fd = -1;

static void fz_cleanup(void) {
  if (strncmp(fz_path, "/tmp/", 5) == 0) unlink(fz_path);
}

static const char *fz_write(const uint8_t *data, size_t size) {
  if (fz_fd < 0) {
    fz_fd = memfd_create("ferry_fuzz", MFD_CLOEXEC);
    if (fz_fd >= 0) {
      snprintf(fz_path, sizeof fz_path, "/proc/self/fd/%d", fz_fd);
    } else {
      snprintf(fz_path, sizeof fz_path, "/tmp/ferry-fuzz-%d", (int)getpid());
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

#endif
