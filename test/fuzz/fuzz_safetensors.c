// libFuzzer target: fy_safetensors_open on an arbitrary file (header length, header JSON, dtypes,
// shapes, data_offsets). On success every tensor's bytes are read and the set's promises checked:
// names found by lookup, nbytes = numel x dtype size, spans disjoint and inside the data.
//
// An input that starts with '{' cannot be a safetensors file (its header length would be over
// 2^56 bytes), so such inputs go to fy_safetensors_open_dir instead, as the
// model.safetensors.index.json of a directory that holds fixed shards (see fz_dir below).
#ifndef _GNU_SOURCE
#define _GNU_SOURCE  // memfd_create
#endif
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/safetensors.h"
#include "fuzz_common.h"


// The sharded-model directory, made once per process under $TMPDIR: shards a.safetensors
// (x, y), b.safetensors (z), dup.safetensors (x again) and bad.safetensors (not a file of tensors);
// the index is rewritten for every input.
static char fz_dirpath[256];
static const char *const fz_shards[] = {"a.safetensors", "b.safetensors", "dup.safetensors",
                                        "bad.safetensors", "model.safetensors.index.json"};

static void fz_dir_cleanup(void) {
  char p[400];
  for (size_t i = 0; i < sizeof fz_shards / sizeof *fz_shards; i++) {
    snprintf(p, sizeof p, "%s/%s", fz_dirpath, fz_shards[i]);
    unlink(p);
  }
  rmdir(fz_dirpath);
}

static void fz_put(const char *name, const void *buf, size_t n) {
  char p[400];
  snprintf(p, sizeof p, "%s/%s", fz_dirpath, name);
  int fd = open(p, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) abort();
  for (size_t done = 0; done < n;) {
    ssize_t w = write(fd, (const char *)buf + done, n - done);
    if (w <= 0) abort();
    done += (size_t)w;
  }
  close(fd);
}

static const char *fz_path_of(const char *name) {
  static char p[400];
  snprintf(p, sizeof p, "%s/%s", fz_dirpath, name);
  return p;
}

static const char *fz_dir(const uint8_t *data, size_t size) {
  if (!fz_dirpath[0]) {
    const char *tmp = getenv("TMPDIR");
    snprintf(fz_dirpath, sizeof fz_dirpath, "%s/ferry-fuzz-st-%d.d", tmp && tmp[0] ? tmp : "/tmp",
             (int)getpid());
    if (mkdir(fz_dirpath, 0700) != 0 && errno != EEXIST) abort();
    atexit(fz_dir_cleanup);
    float xs[6] = {1, 2, 3, 4, 5, 6};
    struct fy_st_tensor a[2] = {
        {.name = "x", .dtype = FY_F32, .rank = 2, .shape = {2, 2}, .data = xs, .nbytes = 16},
        {.name = "y", .dtype = FY_F32, .rank = 1, .shape = {2}, .data = xs + 4, .nbytes = 8}};
    struct fy_st_tensor b = {.name = "z", .dtype = FY_BF16, .rank = 1, .shape = {3}, .data = xs,
                             .nbytes = 6};
    if (fy_safetensors_write(fz_path_of("a.safetensors"), a, 2, NULL) != FY_OK ||
        fy_safetensors_write(fz_path_of("b.safetensors"), &b, 1, NULL) != FY_OK ||
        fy_safetensors_write(fz_path_of("dup.safetensors"), a, 1, NULL) != FY_OK)
      abort();
    fz_put("bad.safetensors", "\x02\0\0\0\0\0\0\0[]", 10);
  }
  fz_put("model.safetensors.index.json", data, size);
  return fz_dirpath;
}

struct span { uintptr_t b, e; };

static int span_cmp(const void *a, const void *b) {
  const struct span *x = a, *y = b;
  return x->b < y->b ? -1 : x->b > y->b;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  bool dir = size > 0 && data[0] == '{';
  fy_safetensors *st = NULL;
  fy_status rc = dir ? fy_safetensors_open_dir(fz_dir(data, size), &st)
                     : fy_safetensors_open(fz_write(data, size), &st);
  if (rc != FY_OK) {
    if (st) __builtin_trap();  // a failed open hands nothing back
    if (strlen(fy_error_msg()) == 0) __builtin_trap();
    return 0;
  }
  uint64_t hlen = 0, data_size = UINT64_MAX;  // a directory's shards: any size
  if (!dir) {
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | data[i];
    data_size = size - 8 - hlen;  // the open checked that the header fits
  }
  int n = fy_safetensors_count(st);
  struct span *spans = calloc((size_t)n + 1, sizeof *spans);
  if (!spans) abort();
  int ns = 0;
  volatile uint8_t sink = 0;
  for (int i = 0; i < n; i++) {
    const struct fy_st_tensor *t = fy_safetensors_at(st, i);
    if (!t || !t->name || fy_safetensors_find(st, t->name) != t) __builtin_trap();
    if (t->rank < 0 || t->rank > FY_MAX_RANK) __builtin_trap();
    uint64_t numel = 1;
    for (int d = 0; d < t->rank; d++) {
      if (t->shape[d] < 0) __builtin_trap();
      if (__builtin_mul_overflow(numel, (uint64_t)t->shape[d], &numel)) __builtin_trap();
    }
    uint64_t nbytes;
    if (__builtin_mul_overflow(numel, (uint64_t)fy_dtype_size(t->dtype), &nbytes) ||
        nbytes != t->nbytes)
      __builtin_trap();
    if (t->nbytes > data_size) __builtin_trap();
    const uint8_t *p = t->data;
    uint8_t x = 0;
    for (size_t k = 0; k < t->nbytes; k++) x ^= p[k];
    sink ^= x;
    if (t->nbytes) spans[ns++] = (struct span){(uintptr_t)p, (uintptr_t)p + t->nbytes};
  }
  (void)sink;
  if (ns > 0) {  // disjoint, and all inside one data region of data_size bytes
    qsort(spans, (size_t)ns, sizeof *spans, span_cmp);
    uintptr_t lo = spans[0].b, hi = spans[0].e;
    for (int i = 1; i < ns; i++) {
      if (spans[i].b < spans[i - 1].e) __builtin_trap();
      if (spans[i].e > hi) hi = spans[i].e;
    }
    if (!dir && hi - lo > data_size) __builtin_trap();
  }
  if (fy_safetensors_find(st, "\x01 surely absent \x02")) __builtin_trap();
  if (fy_safetensors_at(st, n) || fy_safetensors_at(st, -1)) __builtin_trap();
  free(spans);
  fy_safetensors_close(st);
  return 0;
}
