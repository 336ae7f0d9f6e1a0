// runtime/data.c: token shards, windows and targets, order, wrap-around, rank split, shuffling,
// resuming, and bad shards.
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "runtime/data.h"
#include "runtime/engine.h"
#include "test/check.h"

static char tmpdir[64];

// Shards whose token at position i of shard s is base[s] + i, so every token says where it is from.
static void make_shards(const char *dir, int n, const int64_t *counts, const uint16_t *base) {
  mkdir(dir, 0755);
  for (int s = 0; s < n; s++) {
    uint16_t *t = malloc((size_t)(counts[s] + 1) * 2);
    for (int64_t i = 0; i < counts[s]; i++) t[i] = (uint16_t)(base[s] + i);
    char p[300];
    snprintf(p, sizeof p, "%s/shard_%03d.bin", dir, s);
    CHECK_OK(fy_shard_write(p, t, counts[s]));
    free(t);
  }
}

// The expected window w (0-based, in order) for the layout above, T tokens + 1.
static void expect_window(int64_t w, int64_t T, int n, const int64_t *counts, const uint16_t *base,
                          int32_t *out /* T+1 */) {
  for (int s = 0; s < n; s++) {
    int64_t nw = (counts[s] - 1) / T;
    if (w < nw) {
      for (int64_t t = 0; t <= T; t++) out[t] = base[s] + w * T + t;
      return;
    }
    w -= nw;
  }
  abort();
}

static const int NS = 3;
static const int64_t counts[3] = {41, 10, 33};  // T=4: 10 + 2 + 8 = 20 windows
static const uint16_t bases[3] = {100, 1000, 2000};

static void test_order(const char *dir) {
  fy_data *d = NULL;
  const int64_t B = 3, T = 4, Nw = 20;
  CHECK_OK(fy_data_open(dir, 4096, B, T, false, 0, 0, 1, &d));
  if (!d) return;
  CHECK(fy_data_num_tokens(d) == 41 + 10 + 33);
  int bad = 0;
  int32_t want[5];
  // 20 batches = 60 rows = 3 epochs: rows follow each other and wrap around.
  for (int k = 0; k < 20; k++) {
    struct fy_batch *b = NULL;
    CHECK_OK(fy_data_next(d, &b));
    CHECK(b && b->B == B && b->T == T && b->mask == NULL);
    for (int64_t j = 0; b && j < B; j++) {
      expect_window((k * B + j) % Nw, T, NS, counts, bases, want);
      for (int64_t t = 0; t < T; t++) {
        bad += b->inputs[j * T + t] != want[t];
        bad += b->targets[j * T + t] != want[t + 1];  // shifted by one
        bad += b->targets[j * T + t] != (t + 1 < T ? b->inputs[j * T + t + 1] : want[T]);
      }
    }
  }
  CHECKF(bad == 0, "%d wrong tokens", bad);
  CHECK(fy_data_position(d) == 20);
  // The first rows of the first batch, spelt out.
  CHECK_OK(fy_data_seek(d, 0));
  struct fy_batch *b;
  CHECK_OK(fy_data_next(d, &b));
  CHECK(b->inputs[0] == 100 && b->inputs[3] == 103 && b->targets[3] == 104);
  CHECK(b->inputs[4] == 104 && b->targets[7] == 108);  // windows overlap by one token
  // Batch 3 holds rows 9, 10, 11: the last window of shard 0 and the windows of shard 1.
  CHECK_OK(fy_data_seek(d, 3));
  CHECK_OK(fy_data_next(d, &b));
  CHECK(b->inputs[0] == 136 && b->targets[3] == 140);
  CHECK(b->inputs[4] == 1000 && b->inputs[8] == 1004 && b->targets[11] == 1008);
  // Batch 6 holds rows 18, 19, 20 -> window 0 of the next epoch.
  CHECK_OK(fy_data_seek(d, 6));
  CHECK_OK(fy_data_next(d, &b));
  CHECK(b->inputs[0] == 2024 && b->inputs[4] == 2028 && b->targets[7] == 2032 && b->inputs[8] == 100);
  CHECK_ERR(fy_data_seek(d, -1), FY_ERR_INVALID);
  fy_data_close(d);
}

// All rows of `nb` batches, in order, as (T+1)-token windows identified by their first input.
static int32_t *collect(fy_data *d, int nb, int64_t B, int64_t T) {
  int32_t *rows = malloc((size_t)(nb * B * 2) * sizeof *rows);
  for (int k = 0; k < nb; k++) {
    struct fy_batch *b;
    if (fy_data_next(d, &b) != FY_OK) abort();
    for (int64_t j = 0; j < B; j++) {
      rows[(k * B + j) * 2] = b->inputs[j * T];
      rows[(k * B + j) * 2 + 1] = b->targets[j * T + T - 1];
    }
  }
  return rows;
}

static void test_ranks(const char *dir, bool shuffle) {
  const int64_t T = 4;
  const int nb = 13;  // crosses epochs (20 windows, 4 rows a step)
  fy_data *one, *r0, *r1;
  CHECK_OK(fy_data_open(dir, 4096, 4, T, shuffle, 7, 0, 1, &one));
  CHECK_OK(fy_data_open(dir, 4096, 2, T, shuffle, 7, 0, 2, &r0));
  CHECK_OK(fy_data_open(dir, 4096, 2, T, shuffle, 7, 1, 2, &r1));
  if (!one || !r0 || !r1) return;
  int32_t *a = collect(one, nb, 4, T), *b0 = collect(r0, nb, 2, T), *b1 = collect(r1, nb, 2, T);
  int bad = 0;
  for (int k = 0; k < nb; k++)
    for (int j = 0; j < 2; j++)
      for (int e = 0; e < 2; e++) {
        bad += a[(k * 4 + j) * 2 + e] != b0[(k * 2 + j) * 2 + e];
        bad += a[(k * 4 + 2 + j) * 2 + e] != b1[(k * 2 + j) * 2 + e];
      }
  CHECKF(bad == 0, "shuffle=%d: 2 ranks x B=2 differ from 1 rank x B=4 in %d places", shuffle, bad);
  free(a);
  free(b0);
  free(b1);
  fy_data_close(one);
  fy_data_close(r0);
  fy_data_close(r1);
  fy_data *x;
  CHECK_ERR(fy_data_open(dir, 4096, 2, T, shuffle, 7, 2, 2, &x), FY_ERR_INVALID);
  CHECK_ERR(fy_data_open(dir, 4096, 2, T, shuffle, 7, -1, 2, &x), FY_ERR_INVALID);
  CHECK_ERR(fy_data_open(dir, 4096, 2, T, shuffle, 7, 0, 0, &x), FY_ERR_INVALID);
}

static int cmp_i32(const void *a, const void *b) {
  int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
  return (x > y) - (x < y);
}

static void test_shuffle(const char *dir) {
  const int64_t T = 4, B = 5, Nw = 20;
  fy_data *d, *e, *f;
  CHECK_OK(fy_data_open(dir, 4096, B, T, true, 1, 0, 1, &d));
  CHECK_OK(fy_data_open(dir, 4096, B, T, true, 1, 0, 1, &e));
  CHECK_OK(fy_data_open(dir, 4096, B, T, true, 2, 0, 1, &f));
  if (!d || !e || !f) return;
  // Three epochs of 4 batches each.
  int32_t *a = collect(d, 12, B, T), *a2 = collect(e, 12, B, T), *c = collect(f, 12, B, T);
  int32_t ordered[20], ep[3][20];
  int32_t want[5];
  for (int w = 0; w < Nw; w++) {
    expect_window(w, T, NS, counts, bases, want);
    ordered[w] = want[0];
  }
  qsort(ordered, 20, sizeof *ordered, cmp_i32);
  int same_seed = 1, diff_seed = 0, diff_epoch = 0, in_order = 1;
  for (int k = 0; k < 3; k++) {
    for (int w = 0; w < Nw; w++) {
      ep[k][w] = a[(k * Nw + w) * 2];
      same_seed &= a[(k * Nw + w) * 2] == a2[(k * Nw + w) * 2];
      diff_seed |= a[(k * Nw + w) * 2] != c[(k * Nw + w) * 2];
      if (k == 0) in_order &= ep[0][w] == ordered[w];
      // The target after the last input is still the window's own next token.
      int32_t first = a[(k * Nw + w) * 2], last = a[(k * Nw + w) * 2 + 1];
      CHECK(last == first + 4);
    }
    if (k) diff_epoch |= memcmp(ep[k], ep[0], sizeof ep[0]) != 0;
    int32_t s[20];
    memcpy(s, ep[k], sizeof s);
    qsort(s, 20, sizeof *s, cmp_i32);
    CHECKF(memcmp(s, ordered, sizeof s) == 0, "epoch %d is not a permutation of the windows", k);
  }
  CHECK(same_seed);
  CHECK(diff_seed);
  CHECK(diff_epoch);
  CHECK(!in_order);
  free(a);
  free(a2);
  free(c);
  fy_data_close(d);
  fy_data_close(e);
  fy_data_close(f);
}

static void test_resume(const char *dir, bool shuffle) {
  const int64_t B = 3, T = 4;
  fy_data *d, *e;
  CHECK_OK(fy_data_open(dir, 4096, B, T, shuffle, 99, 0, 1, &d));
  CHECK_OK(fy_data_open(dir, 4096, B, T, shuffle, 99, 0, 1, &e));
  if (!d || !e) return;
  int32_t *all = collect(d, 17, B, T);
  struct fy_batch *b;
  for (int k = 0; k < 5; k++) CHECK_OK(fy_data_next(e, &b));
  int64_t pos = fy_data_position(e);
  CHECK(pos == 5);
  fy_data_close(e);
  // A new loader seeked to the saved position continues exactly where the old one stopped.
  CHECK_OK(fy_data_open(dir, 4096, B, T, shuffle, 99, 0, 1, &e));
  CHECK_OK(fy_data_seek(e, pos));
  int32_t *rest = collect(e, 12, B, T);
  CHECK(memcmp(rest, all + 5 * B * 2, (size_t)(12 * B * 2) * sizeof *rest) == 0);
  // Seeking backwards replays.
  CHECK_OK(fy_data_seek(e, 0));
  int32_t *again = collect(e, 17, B, T);
  CHECK(memcmp(again, all, (size_t)(17 * B * 2) * sizeof *all) == 0);
  free(all);
  free(rest);
  free(again);
  fy_data_close(d);
  fy_data_close(e);
}

static void test_forms(const char *dir) {
  fy_data *d;
  const int64_t T = 4;
  // One file.
  CHECK_OK(fy_data_open(check_path(tmpdir, "shards/shard_001.bin"), 4096, 2, T, false, 0, 0, 1, &d));
  if (d) {
    struct fy_batch *b;
    CHECK(fy_data_num_tokens(d) == 10);
    CHECK_OK(fy_data_next(d, &b));
    CHECK(b->inputs[0] == 1000 && b->inputs[4] == 1004);
    CHECK_OK(fy_data_next(d, &b));  // wraps: only two windows
    CHECK(b->inputs[0] == 1000);
    fy_data_close(d);
  }
  // A glob: shards 1 and 2 only (sorted), then the directory form sees all three.
  char pat[300];
  snprintf(pat, sizeof pat, "%s/shard_00[21].bin", dir);
  CHECK_OK(fy_data_open(pat, 4096, 2, T, false, 0, 0, 1, &d));
  if (d) {
    struct fy_batch *b;
    CHECK(fy_data_num_tokens(d) == 43);
    CHECK_OK(fy_data_next(d, &b));
    CHECK(b->inputs[0] == 1000 && b->inputs[4] == 1004);
    CHECK_OK(fy_data_next(d, &b));
    CHECK(b->inputs[0] == 2000);
    fy_data_close(d);
  }
  snprintf(pat, sizeof pat, "%s/", dir);
  CHECK_OK(fy_data_open(pat, 4096, 2, T, false, 0, 0, 1, &d));
  CHECK(d && fy_data_num_tokens(d) == 84);
  fy_data_close(d);
  snprintf(pat, sizeof pat, "%s/*.nothing", dir);
  CHECK_ERR(fy_data_open(pat, 4096, 2, T, false, 0, 0, 1, &d), FY_ERR_NOT_FOUND);
  CHECK_ERR(fy_data_open(check_path(tmpdir, "absent.bin"), 4096, 2, T, false, 0, 0, 1, &d), FY_ERR_NOT_FOUND);
  mkdir(check_path(tmpdir, "emptydir"), 0755);
  CHECK_ERR(fy_data_open(check_path(tmpdir, "emptydir"), 4096, 2, T, false, 0, 0, 1, &d), FY_ERR_NOT_FOUND);
  rmdir(check_path(tmpdir, "emptydir"));
}

static void write_file(const char *path, const void *p, size_t n) {
  FILE *f = fopen(path, "wb");
  fwrite(p, 1, n, f);
  fclose(f);
}

static void test_bad(const char *dir) {
  fy_data *d = (fy_data *)1;
  // Bad B, T.
  CHECK_ERR(fy_data_open(dir, 4096, 0, 4, false, 0, 0, 1, &d), FY_ERR_INVALID);
  CHECK(d == NULL);
  CHECK_ERR(fy_data_open(dir, 4096, 2, 0, false, 0, 0, 1, &d), FY_ERR_INVALID);
  // A token outside the vocabulary: shard 2 holds 2000..2032.
  CHECK_ERR(fy_data_open(dir, 2010, 2, 4, false, 0, 0, 1, &d), FY_ERR_INVALID);
  CHECK(strstr(fy_error_msg(), "shard_002.bin") && strstr(fy_error_msg(), "token 10 ") &&
        strstr(fy_error_msg(), "2010"));
  // Too small: 20 windows of T+1=5; B=21 needs more. T=40 gives shard 0 one window and the others
  // none (windows never cross shards).
  CHECK_ERR(fy_data_open(dir, 4096, 21, 4, false, 0, 0, 1, &d), FY_ERR_INVALID);
  CHECK_ERR(fy_data_open(dir, 4096, 11, 4, false, 0, 0, 2, &d), FY_ERR_INVALID);
  CHECK_OK(fy_data_open(dir, 4096, 1, 40, false, 0, 0, 1, &d));
  struct fy_batch *b;
  if (d) {
    CHECK_OK(fy_data_next(d, &b));
    CHECK(b->inputs[0] == 100 && b->targets[39] == 140);
    CHECK_OK(fy_data_next(d, &b));
    CHECK(b->inputs[0] == 100);
    fy_data_close(d);
  }
  CHECK_ERR(fy_data_open(dir, 4096, 2, 40, false, 0, 0, 1, &d), FY_ERR_INVALID);
  CHECK_ERR(fy_data_open(dir, 4096, 1, 41, false, 0, 0, 1, &d), FY_ERR_INVALID);

  int32_t hdr[256] = {FY_SHARD_MAGIC, FY_SHARD_VERSION, 8};
  uint16_t toks[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  char buf[1024 + 16];
  const char *p = check_path(tmpdir, "bad.bin");
  // Wrong magic.
  hdr[0] = 12345;
  memcpy(buf, hdr, 1024);
  memcpy(buf + 1024, toks, 16);
  write_file(p, buf, sizeof buf);
  CHECK_ERR(fy_data_open(p, 4096, 1, 2, false, 0, 0, 1, &d), FY_ERR_FORMAT);
  CHECK(strstr(fy_error_msg(), "not a token shard (magic 12345, expected 20240520, or 20240801 for uint32 tokens; tools/tokenize.py"));
  // Wrong version.
  hdr[0] = FY_SHARD_MAGIC;
  hdr[1] = 2;
  memcpy(buf, hdr, 1024);
  write_file(p, buf, sizeof buf);
  CHECK_ERR(fy_data_open(p, 4096, 1, 2, false, 0, 0, 1, &d), FY_ERR_FORMAT);
  // Count disagrees with the size, both ways; negative count.
  hdr[1] = FY_SHARD_VERSION;
  int32_t bad_counts[3] = {9, 7, -1};
  for (int i = 0; i < 3; i++) {
    hdr[2] = bad_counts[i];
    memcpy(buf, hdr, 1024);
    write_file(p, buf, sizeof buf);
    CHECK_ERR(fy_data_open(p, 4096, 1, 2, false, 0, 0, 1, &d), FY_ERR_FORMAT);
  }
  // Smaller than a header.
  write_file(p, buf, 100);
  CHECK_ERR(fy_data_open(p, 4096, 1, 2, false, 0, 0, 1, &d), FY_ERR_FORMAT);
  write_file(p, buf, 0);
  CHECK_ERR(fy_data_open(p, 4096, 1, 2, false, 0, 0, 1, &d), FY_ERR_FORMAT);
  // An empty but valid shard contributes nothing; with no windows at all the set is too small.
  CHECK_OK(fy_shard_write(p, NULL, 0));
  CHECK_ERR(fy_data_open(p, 4096, 1, 2, false, 0, 0, 1, &d), FY_ERR_INVALID);
  CHECK_OK(fy_shard_write(p, toks, 1));
  CHECK_ERR(fy_data_open(p, 4096, 1, 1, false, 0, 0, 1, &d), FY_ERR_INVALID);
  CHECK_OK(fy_shard_write(p, toks, 2));
  CHECK_OK(fy_data_open(p, 4096, 1, 1, false, 0, 0, 1, &d));
  fy_data_close(d);
  CHECK_ERR(fy_shard_write(p, toks, -1), FY_ERR_INVALID);
  CHECK_ERR(fy_shard_write(check_path(tmpdir, "no/dir/x.bin"), toks, 2), FY_ERR_IO);
  unlink(p);
}

// llm.c's wide shards (uint32 tokens): ids past 65535 for a large vocabulary, the same stream as
// narrow shards of the same tokens (both kinds in one set), and their header checks.
static void test_wide_shards(const char *narrow_dir) {
  const char *dir = check_path(tmpdir, "wide");
  mkdir(dir, 0755);
  // The narrow set's shards again, every other one written wide: the same batches, shuffled and split.
  for (int s = 0; s < NS; s++) {
    char p[300];
    snprintf(p, sizeof p, "%s/shard_%03d.bin", dir, s);
    uint16_t *t = malloc((size_t)(counts[s] + 1) * 2);
    uint32_t *w = malloc((size_t)(counts[s] + 1) * 4);
    for (int64_t i = 0; i < counts[s]; i++) w[i] = t[i] = (uint16_t)(bases[s] + i);
    CHECK_OK(s % 2 ? fy_shard_write32(p, w, counts[s]) : fy_shard_write(p, t, counts[s]));
    free(t);
    free(w);
  }
  for (int r = 0; r < 2; r++) {
    fy_data *a = NULL, *b = NULL;
    CHECK_OK(fy_data_open(narrow_dir, 4096, 3, 7, true, 11, r, 2, &a));
    CHECK_OK(fy_data_open(dir, 4096, 3, 7, true, 11, r, 2, &b));
    CHECK(a && b && fy_data_num_tokens(a) == fy_data_num_tokens(b));
    for (int k = 0; a && b && k < 12; k++) {
      struct fy_batch *x, *y;
      CHECK_OK(fy_data_next(a, &x));
      CHECK_OK(fy_data_next(b, &y));
      CHECKF(memcmp(x->inputs, y->inputs, 21 * 4) == 0 && memcmp(x->targets, y->targets, 21 * 4) == 0,
             "rank %d batch %d: wide shards give other tokens", r, k);
    }
    fy_data_close(a);
    fy_data_close(b);
  }
  // Ids past 65535.
  const char *p = check_path(tmpdir, "wide.bin");
  uint32_t big[9];
  for (int i = 0; i < 9; i++) big[i] = 70000u + 1000u * (uint32_t)i;
  CHECK_OK(fy_shard_write32(p, big, 9));
  fy_data *d = NULL;
  CHECK_OK(fy_data_open(p, 100000, 2, 4, false, 0, 0, 1, &d));
  struct fy_batch *b;
  if (d) {
    CHECK_OK(fy_data_next(d, &b));
    CHECK(b->inputs[0] == 70000 && b->targets[3] == 74000 && b->inputs[4] == 74000 && b->targets[7] == 78000);
    fy_data_close(d);
  }
  CHECK_ERR(fy_data_open(p, 78000, 1, 4, false, 0, 0, 1, &d), FY_ERR_INVALID);
  CHECK(strstr(fy_error_msg(), "token 8 has value 78000, outside the vocabulary (vocab_size 78000)"));
  // A wide header with the narrow version, and a count that fits uint16 tokens, not uint32.
  int32_t hdr[256] = {FY_SHARD32_MAGIC, FY_SHARD_VERSION, 9};
  char buf[1024 + 36];
  memcpy(buf, hdr, 1024);
  memcpy(buf + 1024, big, 36);
  write_file(p, buf, sizeof buf);
  CHECK_ERR(fy_data_open(p, 100000, 1, 2, false, 0, 0, 1, &d), FY_ERR_FORMAT);
  CHECK(strstr(fy_error_msg(), "version 1 is not supported (expected 7: uint32 tokens)"));
  hdr[1] = FY_SHARD32_VERSION;
  hdr[2] = 18;
  memcpy(buf, hdr, 1024);
  write_file(p, buf, sizeof buf);
  CHECK_ERR(fy_data_open(p, 100000, 1, 2, false, 0, 0, 1, &d), FY_ERR_FORMAT);
  unlink(p);
}

static void test_empty_shards(void) {
  // Empty and one-token shards between real ones: windows skip them.
  const char *dir = check_path(tmpdir, "sparse");
  int64_t c[5] = {0, 9, 1, 0, 5};
  uint16_t base[5] = {0, 10, 30, 0, 50};
  make_shards(dir, 5, c, base);
  fy_data *d;
  CHECK_OK(fy_data_open(dir, 4096, 3, 4, false, 0, 0, 1, &d));
  if (d) {
    struct fy_batch *b;
    CHECK_OK(fy_data_next(d, &b));
    CHECK(b->inputs[0] == 10 && b->inputs[4] == 14 && b->inputs[8] == 50 && b->targets[11] == 54);
    CHECK_OK(fy_data_next(d, &b));
    CHECK(b->inputs[0] == 10);
    fy_data_close(d);
  }
  CHECK_OK(fy_data_open(dir, 4096, 3, 4, true, 5, 0, 1, &d));
  if (d) {
    struct fy_batch *b;
    int seen = 0;
    for (int k = 0; k < 4; k++) {
      CHECK_OK(fy_data_next(d, &b));
      for (int j = 0; j < 3; j++) seen |= 1 << (b->inputs[j * 4] == 10 ? 0 : b->inputs[j * 4] == 14 ? 1 : 2);
    }
    CHECK(seen == 7);
    fy_data_close(d);
  }
  check_rm_rf(dir);
}

// Loss masks beside shards (data.h): a target whose mask byte is 0 becomes -100, inputs stay; a
// shard without a mask counts every target; in the directory form the .mask files are not shards;
// a mask of the wrong length, magic or bytes is refused, naming the file.
static void test_masks(void) {
  const char *dir = check_path(tmpdir, "masked");
  int64_t c[2] = {41, 41};
  uint16_t base[2] = {100, 200};
  make_shards(dir, 2, c, base);
  char shard0[600], mask0[600];
  snprintf(shard0, sizeof shard0, "%s/shard_000.bin", dir);
  snprintf(mask0, sizeof mask0, "%s/shard_000.mask", dir);
  uint8_t m[41];
  for (int i = 0; i < 41; i++) m[i] = (uint8_t)(i % 3 != 0);  // every third token's prediction ignored
  CHECK_OK(fy_shard_write_mask(shard0, m, 41));
  fy_data *d;
  CHECK_OK(fy_data_open(dir, 4096, 2, 10, false, 0, 0, 1, &d));
  if (d) {
    struct fy_batch *b;
    int bad = 0, ignored = 0;
    for (int k = 0; k < 4; k++) {  // windows 0..7: 0..3 in shard 0 (masked), 4..7 in shard 1
      CHECK_OK(fy_data_next(d, &b));
      for (int j = 0; j < 2; j++) {
        int64_t w = k * 2 + j, sh = w / 4, first = (w % 4) * 10;
        for (int t = 0; t < 10; t++) {
          int32_t in = b->inputs[j * 10 + t], tg = b->targets[j * 10 + t];
          int32_t want_tg = sh == 0 && (first + t + 1) % 3 == 0 ? -100 : (int32_t)(base[sh] + first + t + 1);
          bad += in != (int32_t)(base[sh] + first + t) || tg != want_tg;
          ignored += tg == -100;
        }
      }
    }
    CHECKF(bad == 0 && ignored == 13, "masked targets: %d wrong, %d ignored (want 13)", bad, ignored);
    fy_data_close(d);
  }
  // fy_data_count_targets: the batches ahead's counted targets, from the masks alone, as reading
  // them gives (in order and shuffled, over two epochs, on each of 2 ranks).
  for (int shuffle = 0; shuffle < 2; shuffle++)
    for (int rank = 0; rank < 2; rank++) {
      CHECK_OK(fy_data_open(dir, 4096, 3, 10, shuffle, 5, rank, 2, &d));
      if (!d) continue;
      int wrong = 0;
      for (int k = 0; k < 4; k++) {
        int64_t ahead[3] = {fy_data_count_targets(d, 0), fy_data_count_targets(d, 1), fy_data_count_targets(d, 2)};
        struct fy_batch *b;
        CHECK_OK(fy_data_next(d, &b));
        wrong += ahead[0] != fy_engine_count_targets(b) || fy_data_count_targets(d, 0) != ahead[1] ||
                 fy_data_count_targets(d, 1) != ahead[2];
      }
      CHECKF(wrong == 0 && fy_data_position(d) == 4, "counted ahead: %d batches wrong (shuffle %d, rank %d)", wrong,
             shuffle, rank);
      fy_data_close(d);
    }
  // Not a mask: the wrong size, magic, or a byte other than 0 or 1.
  CHECK_OK(fy_shard_write_mask(shard0, m, 40));
  CHECK_ERR(fy_data_open(dir, 4096, 2, 10, false, 0, 0, 1, &d), FY_ERR_FORMAT);
  CHECK(strstr(fy_error_msg(), "shard_000.mask") != NULL);
  m[7] = 2;
  CHECK_OK(fy_shard_write_mask(shard0, m, 41));
  CHECK_ERR(fy_data_open(dir, 4096, 2, 10, false, 0, 0, 1, &d), FY_ERR_FORMAT);
  m[7] = 1;
  CHECK_OK(fy_shard_write_mask(shard0, m, 41));
  // A glob that takes the masks for shards is told what they are.
  char all[600];
  snprintf(all, sizeof all, "%s/shard_*", dir);
  CHECK_ERR(fy_data_open(all, 4096, 2, 10, false, 0, 0, 1, &d), FY_ERR_FORMAT);
  CHECK(strstr(fy_error_msg(), "is a loss mask, not a token shard") != NULL);
  FILE *f = fopen(mask0, "r+b");
  if (f) {
    int32_t wrong = 12345;
    fwrite(&wrong, 4, 1, f);
    fclose(f);
  }
  CHECK_ERR(fy_data_open(dir, 4096, 2, 10, false, 0, 0, 1, &d), FY_ERR_FORMAT);
  // A single shard not named *.bin: its mask is NAME.mask.
  char odd[600];
  snprintf(odd, sizeof odd, "%s/tokens.dat", tmpdir);
  uint16_t t[21];
  for (int i = 0; i < 21; i++) t[i] = (uint16_t)(7 + i);
  CHECK_OK(fy_shard_write(odd, t, 21));
  uint8_t zero[21] = {0};
  CHECK_OK(fy_shard_write_mask(odd, zero, 21));
  CHECK(access(check_path(tmpdir, "tokens.dat.mask"), F_OK) == 0);
  CHECK_OK(fy_data_open(odd, 4096, 2, 10, false, 0, 0, 1, &d));
  if (d) {
    struct fy_batch *b;
    CHECK_OK(fy_data_next(d, &b));
    int all = 1;
    for (int i = 0; i < 20; i++) all &= b->targets[i] == -100;
    CHECK(all && b->inputs[0] == 7);
    fy_data_close(d);
  }
  check_rm_rf(dir);
}

int main(void) {
  snprintf(tmpdir, sizeof tmpdir, "/tmp/fy_data_XXXXXX");
  if (!mkdtemp(tmpdir)) {
    perror("mkdtemp");
    return 2;
  }
  char dir[300];
  snprintf(dir, sizeof dir, "%s/shards", tmpdir);
  make_shards(dir, NS, counts, bases);
  // A stray file that is not a shard does not count in the directory form.
  FILE *f = fopen(check_path(tmpdir, "shards/README.txt"), "w");
  fputs("not a shard", f);
  fclose(f);
  test_order(dir);
  test_ranks(dir, false);
  test_ranks(dir, true);
  test_shuffle(dir);
  test_resume(dir, false);
  test_resume(dir, true);
  test_forms(dir);
  test_bad(dir);
  test_empty_shards();
  test_masks();
  test_wide_shards(dir);
  check_rm_rf(tmpdir);
  return check_summary("data");
}
