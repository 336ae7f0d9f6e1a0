// libFuzzer target: fy_data_open on an arbitrary token shard (magic, version, token count
// against the file size, tokens < vocab_size), then fy_data_next and fy_data_seek. The loader's
// knobs come from header ints 3..9, which the format reserves (written as 0) and the reader
// ignores: vocab_size, B, T, shuffle, rank/world, seed, and how the data set is given. Every batch
// handed out must hold tokens inside the vocabulary.
//
// h9 bit 0 set: the input is a run of shards (uint16 or, by their magic, uint32 tokens), each as
// long as its header's count says (the last takes the rest, 8 at most), written as 000.bin,
// 001.bin, ... in a directory under $TMPDIR that is opened as a directory, or (bit 1 also set)
// through the glob DIR/*.bin. A piece with a loss mask's magic is written as the mask of the shard
// before it (NNN.mask, as long as its count says): its zeros make targets -100.
#ifndef _GNU_SOURCE
#define _GNU_SOURCE  // memfd_create
#endif
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "runtime/data.h"
#include "fuzz_common.h"


#define FZ_MAX_SHARDS 8
static char fz_dirpath[256];

static void fz_piece_path(char *p, size_t n, int i) {
  snprintf(p, n, "%s/%03d.bin", fz_dirpath, i);
}

static void fz_mask_path(char *p, size_t n, int i) {
  snprintf(p, n, "%s/%03d.mask", fz_dirpath, i);
}

static void fz_dir_cleanup(void) {
  char p[300];
  for (int i = 0; i < FZ_MAX_SHARDS; i++) {
    fz_piece_path(p, sizeof p, i);
    unlink(p);
    fz_mask_path(p, sizeof p, i);
    unlink(p);
  }
  rmdir(fz_dirpath);
}

static const char *fz_dir(const uint8_t *data, size_t size, bool glob) {
  static char pattern[300];
  if (!fz_dirpath[0]) {
    const char *tmp = getenv("TMPDIR");
    snprintf(fz_dirpath, sizeof fz_dirpath, "%s/ferry-fuzz-shard-%d.d",
             tmp && tmp[0] ? tmp : "/tmp", (int)getpid());
    if (mkdir(fz_dirpath, 0700) != 0 && errno != EEXIST) abort();
    atexit(fz_dir_cleanup);
  }
  size_t off = 0;
  int shard = 0;  // the next shard's number
  for (int i = 0; i < FZ_MAX_SHARDS; i++) {  // (the previous input's masks go first)
    char p[300];
    fz_mask_path(p, sizeof p, i);
    unlink(p);
  }
  for (int i = 0; i < FZ_MAX_SHARDS; i++) {
    char p[300];
    if (off >= size && i > 0) break;  // no more input (the first piece is written even if empty)
    size_t len = size - off;
    int32_t magic = 0, count;
    if (len >= 4) memcpy(&magic, data + off, 4);
    if (i < FZ_MAX_SHARDS - 1 && len >= FY_SHARD_HEADER_INTS * 4) {
      memcpy(&count, data + off + 8, 4);
      size_t w = magic == FY_SHARD32_MAGIC ? 4 : magic == FY_MASK_MAGIC ? 1 : 2;
      size_t want = FY_SHARD_HEADER_INTS * 4 + w * (size_t)(uint32_t)count;
      if (count >= 0 && want < len) len = want;
    }
    if (magic == FY_MASK_MAGIC && shard > 0) {
      fz_mask_path(p, sizeof p, shard - 1);
    } else {
      fz_piece_path(p, sizeof p, shard++);
    }
    int fd = open(p, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) abort();
    for (size_t done = 0; done < len;) {
      ssize_t w = write(fd, data + off + done, len - done);
      if (w <= 0) abort();
      done += (size_t)w;
    }
    close(fd);
    off += len;
  }
  for (int k = shard; k < FZ_MAX_SHARDS; k++) {  // the previous input's extra shards
    char p[300];
    fz_piece_path(p, sizeof p, k);
    unlink(p);
  }
  if (!glob) return fz_dirpath;
  snprintf(pattern, sizeof pattern, "%s/*.bin", fz_dirpath);
  return pattern;
}

static uint32_t hdr_int(const uint8_t *data, size_t size, int i) {
  uint32_t v = 0;
  if (size >= (size_t)(i + 1) * 4) memcpy(&v, data + 4 * i, 4);
  return v;
}

static void check_batch(const struct fy_batch *b, int64_t B, int64_t T, int64_t vocab) {
  if (!b || b->B != B || b->T != T) __builtin_trap();
  for (int64_t i = 0; i < B * T; i++) {
    if (b->inputs[i] < 0 || b->inputs[i] >= vocab) __builtin_trap();
    if (b->targets[i] != -100 && (b->targets[i] < 0 || b->targets[i] >= vocab)) __builtin_trap();  // (-100: masked)
  }
  for (int64_t j = 0; j < B; j++)  // rows are consecutive tokens: targets lead inputs by one
    for (int64_t t = 0; t + 1 < T; t++)
      if (b->targets[j * T + t] != -100 && b->targets[j * T + t] != b->inputs[j * T + t + 1]) __builtin_trap();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  uint32_t h9 = hdr_int(data, size, 9);
  const char *path = (h9 & 1) ? fz_dir(data, size, h9 & 2) : fz_write(data, size);
  uint32_t h3 = hdr_int(data, size, 3), h4 = hdr_int(data, size, 4), h5 = hdr_int(data, size, 5);
  uint32_t h6 = hdr_int(data, size, 6), h7 = hdr_int(data, size, 7), h8 = hdr_int(data, size, 8);
  int64_t vocab = h3 ? (int64_t)(h3 & 0x1ffff) : 65536;  // 0..131071: 0 must be refused
  int64_t B = 1 + (int64_t)(h4 % 4), T = 1 + (int64_t)(h5 % 64);
  bool shuffle = h6 & 1;
  int world = 1 + (int)((h6 >> 1) % 3), rank = (int)((h6 >> 3) % (uint32_t)world);
  uint64_t seed = ((uint64_t)h8 << 32) | h7;

  fy_data *d = NULL;
  fy_status rc = fy_data_open(path, vocab, B, T, shuffle, seed, rank, world, &d);
  if (rc != FY_OK) {
    if (d) __builtin_trap();
    if (strlen(fy_error_msg()) == 0) __builtin_trap();
    return 0;
  }
  if (fy_data_num_tokens(d) <= T) __builtin_trap();  // a batch needs at least one window
  struct fy_batch *b;
  for (int k = 0; k < 5; k++) {  // five batches: enough to wrap a small shard into epoch 2
    if (fy_data_next(d, &b) != FY_OK) __builtin_trap();
    check_batch(b, B, T, vocab);
  }
  if (fy_data_position(d) != 5) __builtin_trap();
  int64_t far = (int64_t)(seed >> 20);  // any position, also past every epoch
  if (fy_data_seek(d, far) == FY_OK) {
    if (fy_data_next(d, &b) != FY_OK) __builtin_trap();
    check_batch(b, B, T, vocab);
  }
  if (fy_data_seek(d, -1) == FY_OK) __builtin_trap();
  fy_data_close(d);
  return 0;
}
