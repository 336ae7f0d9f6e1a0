// core/safetensors.c: round trips, sharded directories, and files that lie.
// usage: test_safetensors                        (the plain run)
//        test_safetensors --part unwritable-dir  (a write refused by the directory; exits 77 as
//                                                 root where a tmpfs cannot be mounted)
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/safetensors.h"
#include "test/check.h"

static char tmpdir[64];

static int count_entries(const char *dir) {
  DIR *d = opendir(dir);
  if (!d) return -1;
  int n = 0;
  struct dirent *de;
  while ((de = readdir(d))) n += strcmp(de->d_name, ".") && strcmp(de->d_name, "..");
  closedir(d);
  return n;
}

static void write_bytes(const char *path, const void *p, size_t n) {
  FILE *f = fopen(path, "wb");
  if (!f) {
    perror(path);
    exit(2);
  }
  fwrite(p, 1, n, f);
  fclose(f);
}

static void write_str(const char *path, const char *s) { write_bytes(path, s, strlen(s)); }

static void *read_bytes(const char *path, size_t *n) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  long sz = ftell(f);
  fseek(f, 0, SEEK_SET);
  void *p = malloc((size_t)sz + 1);
  *n = fread(p, 1, (size_t)sz, f);
  fclose(f);
  return p;
}

// A file with header `json` (padded to 8) and `ndata` bytes of data.
static void write_raw(const char *path, const char *json, size_t ndata) {
  size_t jl = strlen(json), hl = (jl + 7) & ~(size_t)7;
  unsigned char *b = calloc(1, 8 + hl + ndata);
  for (int i = 0; i < 8; i++) b[i] = (unsigned char)(hl >> (8 * i));
  memcpy(b + 8, json, jl);
  memset(b + 8 + jl, ' ', hl - jl);
  write_bytes(path, b, 8 + hl + ndata);
  free(b);
}

static struct fy_st_tensor mk(const char *name, enum fy_dtype dt, int rank, const int64_t *shape,
                              const void *data) {
  struct fy_st_tensor t = {.name = name, .dtype = dt, .rank = rank, .data = data};
  size_t n = 1;
  for (int i = 0; i < rank; i++) {
    t.shape[i] = shape[i];
    n *= (size_t)shape[i];
  }
  t.nbytes = n * fy_dtype_size(dt);
  return t;
}

static bool same_tensor(const struct fy_st_tensor *a, const struct fy_st_tensor *b) {
  if (!a || !b) return false;
  if (strcmp(a->name, b->name) || a->dtype != b->dtype || a->rank != b->rank || a->nbytes != b->nbytes)
    return false;
  for (int i = 0; i < a->rank; i++)
    if (a->shape[i] != b->shape[i]) return false;
  return a->nbytes == 0 || memcmp(a->data, b->data, a->nbytes) == 0;
}

static void test_round_trip(void) {
  float f32[6] = {1, -2, 3.5f, 0, 1e-8f, -7};
  uint16_t bf[4] = {0x3f80, 0xc000, 0x7f80, 0x0001}, hf[3] = {0x3c00, 0x7bff, 0x8001};
  int32_t i32[5] = {1, -1, 2147483647, -2147483647 - 1, 42};
  int64_t i64[2] = {1ll << 40, -3};
  float scalar = 2.5f;
  int64_t s23[2] = {2, 3}, s4[1] = {4}, s3[1] = {3}, s5[1] = {5}, s0[2] = {0, 7}, s2[1] = {2};
  struct fy_st_tensor ts[] = {
      mk("model.decoder.embed_tokens.weight", FY_F32, 2, s23, f32),
      mk("bf16/x", FY_BF16, 1, s4, bf),
      mk("f16 \"quoted\" name", FY_F16, 1, s3, hf),
      mk("ints", FY_I32, 1, s5, i32),
      mk("scalar", FY_F32, 0, NULL, &scalar),
      mk("empty", FY_F32, 2, s0, NULL),
      mk("i64", FY_I64, 1, s2, i64),
  };
  int n = (int)(sizeof ts / sizeof *ts);
  const char *md[] = {"format", "pt", "note", "hello", NULL};
  const char *p = check_path(tmpdir, "rt.safetensors");
  CHECK_OK(fy_safetensors_write(p, ts, n, md));
  // Header length is a multiple of 8 and the data follows it aligned.
  size_t sz;
  unsigned char *raw = read_bytes(p, &sz);
  CHECK(raw != NULL);
  if (raw) {
    uint64_t hl = 0;
    for (int i = 7; i >= 0; i--) hl = hl << 8 | raw[i];
    CHECK(hl % 8 == 0);
    CHECK(sz == 8 + hl + 24 + 8 + 6 + 20 + 4 + 0 + 16);
    CHECK(memmem(raw + 8, hl, "\"__metadata__\"", 14) != NULL);
    free(raw);
  }
  fy_safetensors *st = NULL;
  CHECK_OK(fy_safetensors_open(p, &st));
  if (!st) return;
  CHECK(fy_safetensors_count(st) == n);
  for (int i = 0; i < n; i++)
    CHECKF(same_tensor(fy_safetensors_find(st, ts[i].name), &ts[i]), "tensor %s", ts[i].name);
  // Whatever the order given, every tensor is aligned to its element size in the mapping.
  for (int i = 0; i < n; i++) {
    const struct fy_st_tensor *t = fy_safetensors_at(st, i);
    CHECKF((uintptr_t)t->data % fy_dtype_size(t->dtype) == 0, "%s misaligned", t->name);
  }
  const struct fy_st_tensor *sc = fy_safetensors_find(st, "scalar");
  CHECK(sc && sc->rank == 0 && sc->nbytes == 4 && *(const float *)sc->data == 2.5f);
  const struct fy_st_tensor *em = fy_safetensors_find(st, "empty");
  CHECK(em && em->nbytes == 0 && em->rank == 2 && em->shape[0] == 0 && em->shape[1] == 7);
  CHECK(fy_safetensors_find(st, "__metadata__") == NULL);
  CHECK(fy_safetensors_find(st, "absent") == NULL);
  CHECK(fy_safetensors_at(st, n) == NULL && fy_safetensors_at(st, -1) == NULL);
  int seen = 0;
  for (int i = 0; i < n; i++) seen += fy_safetensors_find(st, fy_safetensors_at(st, i)->name) ==
                                        fy_safetensors_at(st, i);
  CHECK(seen == n);
  fy_safetensors_close(st);

  // Overwriting an existing file replaces it and leaves no temporary file.
  CHECK_OK(fy_safetensors_write(p, ts, 1, NULL));
  CHECK_OK(fy_safetensors_open(p, &st));
  CHECK(st && fy_safetensors_count(st) == 1);
  fy_safetensors_close(st);
  unlink(p);
  CHECK(count_entries(tmpdir) == 0);

  // Writing refuses bad tensors.
  struct fy_st_tensor bad = ts[0];
  bad.nbytes = 20;
  CHECK_ERR(fy_safetensors_write(p, &bad, 1, NULL), FY_ERR_INVALID);
  struct fy_st_tensor dup[2] = {ts[1], ts[1]};
  CHECK_ERR(fy_safetensors_write(p, dup, 2, NULL), FY_ERR_INVALID);
  CHECK(access(p, F_OK) != 0);
}

// Reading a large tensor part by part and letting go of each part (fy_safetensors_done_with):
// the parts read again give the same values.
static void test_done_with(void) {
  enum { N = 3 << 18 };  // 3 MiB of floats
  float *vals = malloc(N * sizeof *vals);
  CHECK(vals != NULL);
  if (!vals) return;
  for (int i = 0; i < N; i++) vals[i] = (float)(i % 1000) * 0.5f;
  int64_t shape[1] = {N};
  struct fy_st_tensor t0 = mk("big", FY_F32, 1, shape, vals);
  const char *p = check_path(tmpdir, "big.safetensors");
  CHECK_OK(fy_safetensors_write(p, &t0, 1, NULL));
  fy_safetensors *st = NULL;
  CHECK_OK(fy_safetensors_open(p, &st));
  const struct fy_st_tensor *t = st ? fy_safetensors_find(st, "big") : NULL;
  CHECK(t != NULL);
  int bad = 0;
  for (int round = 0; t && round < 2; round++)
    for (int64_t a = 0; a < N; a += 100000) {  // parts that do not fall on page boundaries
      int64_t n = a + 100000 < N ? 100000 : N - a;
      const float *src = (const float *)t->data + a;
      for (int64_t i = 0; i < n; i++) bad += src[i] != vals[a + i];
      fy_safetensors_done_with(src, (size_t)n * 4);
    }
  CHECK(bad == 0);
  fy_safetensors_close(st);
  unlink(p);
  free(vals);
}

static void test_many(void) {
  // Thousands of tensors: the lookup must find each one.
  enum { N = 5000 };
  static struct fy_st_tensor ts[N];
  static char names[N][48];
  static float vals[N];
  int64_t s1[1] = {1};
  for (int i = 0; i < N; i++) {
    snprintf(names[i], sizeof names[i], "model.decoder.layers.%d.fc1.weight", i);
    vals[i] = (float)i;
    ts[i] = mk(names[i], FY_F32, 1, s1, &vals[i]);
  }
  const char *p = check_path(tmpdir, "many.safetensors");
  CHECK_OK(fy_safetensors_write(p, ts, N, NULL));
  fy_safetensors *st = NULL;
  CHECK_OK(fy_safetensors_open(p, &st));
  int bad = 0;
  for (int i = 0; st && i < N; i++) {
    const struct fy_st_tensor *t = fy_safetensors_find(st, names[i]);
    bad += !t || *(const float *)t->data != (float)i;
  }
  CHECK(st && bad == 0);
  fy_safetensors_close(st);
  unlink(p);
}

static void test_dir(void) {
  float a[100], b[50], c[10], d[1];
  for (int i = 0; i < 100; i++) a[i] = (float)i;
  for (int i = 0; i < 50; i++) b[i] = -(float)i;
  for (int i = 0; i < 10; i++) c[i] = 0.5f * (float)i;
  d[0] = 9;
  int64_t s100[1] = {100}, s50[2] = {5, 10}, s10[1] = {10}, s1[1] = {1};
  struct fy_st_tensor ts[] = {mk("z.a", FY_F32, 1, s100, a), mk("b", FY_F32, 2, s50, b),
                              mk("c", FY_F32, 1, s10, c), mk("d", FY_F32, 1, s1, d)};
  const char *dir = check_path(tmpdir, "model");
  // 400 + 200 + 40 + 4 bytes, shards of at most 256: [a] [b c] [d]? a alone (400 > 256), then
  // b (200) + c (40) = 240, then d would make 244 — fits; so [a] [b c d].
  CHECK_OK(fy_safetensors_write_dir(dir, ts, 4, 256));
  char p[512];
  snprintf(p, sizeof p, "%s/model-00001-of-00002.safetensors", dir);
  CHECK(access(p, F_OK) == 0);
  snprintf(p, sizeof p, "%s/model-00002-of-00002.safetensors", dir);
  CHECK(access(p, F_OK) == 0);
  snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
  size_t n;
  char *idx = read_bytes(p, &n);
  CHECK(idx != NULL);
  if (idx) {
    idx[n] = 0;
    CHECK(strstr(idx, "\"total_size\": 644") != NULL);
    CHECK(strstr(idx, "\"z.a\": \"model-00001-of-00002.safetensors\"") != NULL);
    CHECK(strstr(idx, "\"d\": \"model-00002-of-00002.safetensors\"") != NULL);
    // Sorted weight map.
    CHECK(strstr(idx, "\"b\"") < strstr(idx, "\"c\"") && strstr(idx, "\"d\"") < strstr(idx, "\"z.a\""));
    free(idx);
  }
  CHECK(count_entries(dir) == 3);
  fy_safetensors *st = NULL;
  CHECK_OK(fy_safetensors_open_dir(dir, &st));
  CHECK(st && fy_safetensors_count(st) == 4);
  for (int i = 0; st && i < 4; i++) CHECKF(same_tensor(fy_safetensors_find(st, ts[i].name), &ts[i]), "%s", ts[i].name);
  fy_safetensors_close(st);

  // Shards carry {"format": "pt"}, which transformers requires.
  snprintf(p, sizeof p, "%s/model-00001-of-00002.safetensors", dir);
  char *raw = read_bytes(p, &n);
  CHECK(raw && memmem(raw, n, "\"format\":\"pt\"", 13));
  free(raw);

  // Re-writing as one file removes the stale index and shards.
  CHECK_OK(fy_safetensors_write_dir(dir, ts, 4, 0));
  CHECK(count_entries(dir) == 1);
  CHECK_OK(fy_safetensors_open_dir(dir, &st));
  CHECK(st && fy_safetensors_count(st) == 4);
  for (int i = 0; st && i < 4; i++) CHECK(same_tensor(fy_safetensors_find(st, ts[i].name), &ts[i]));
  fy_safetensors_close(st);
  // Under the limit: one file too.
  CHECK_OK(fy_safetensors_write_dir(dir, ts, 4, 1 << 20));
  CHECK(count_entries(dir) == 1);
  // Every tensor in its own shard, then back to two shards: old shards of another count go.
  CHECK_OK(fy_safetensors_write_dir(dir, ts, 4, 1));
  CHECK(count_entries(dir) == 5);
  CHECK_OK(fy_safetensors_write_dir(dir, ts, 4, 256));
  CHECK(count_entries(dir) == 3);
  CHECK_OK(fy_safetensors_open_dir(dir, &st));
  CHECK(st && fy_safetensors_count(st) == 4);
  fy_safetensors_close(st);

  // A shard the index names is missing.
  snprintf(p, sizeof p, "%s/model-00002-of-00002.safetensors", dir);
  char moved[600];
  snprintf(moved, sizeof moved, "%s.bak", p);
  CHECK(rename(p, moved) == 0);
  st = (fy_safetensors *)1;
  CHECK_ERR(fy_safetensors_open_dir(dir, &st), FY_ERR_NOT_FOUND);
  CHECK(st == NULL);
  // The index names a tensor its shard does not hold: put a shard without "d" in its place.
  CHECK_OK(fy_safetensors_write(p, &ts[1], 2, NULL));
  CHECK_ERR(fy_safetensors_open_dir(dir, &st), FY_ERR_FORMAT);
  // The index says "c" is in shard 1 while shard 2 holds it: also a lie.
  snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
  write_str(p, "{\"weight_map\": {\"z.a\": \"model-00001-of-00002.safetensors\", "
               "\"b\": \"model-00002-of-00002.safetensors\", "
               "\"c\": \"model-00001-of-00002.safetensors\"}}");
  CHECK_ERR(fy_safetensors_open_dir(dir, &st), FY_ERR_FORMAT);
  write_str(p, "{\"weight_map\": {\"z.a\": \"../x.safetensors\"}}");
  CHECK_ERR(fy_safetensors_open_dir(dir, &st), FY_ERR_FORMAT);
  write_str(p, "{\"weight_map\": [1, 2]}");
  CHECK_ERR(fy_safetensors_open_dir(dir, &st), FY_ERR_FORMAT);
  write_str(p, "{\"weight_map\": {");
  CHECK_ERR(fy_safetensors_open_dir(dir, &st), FY_ERR_FORMAT);
  check_rm_rf(dir);
  // Neither layout present.
  mkdir(dir, 0755);
  CHECK_ERR(fy_safetensors_open_dir(dir, &st), FY_ERR_NOT_FOUND);
  check_rm_rf(dir);
}

static void test_bad_files(void) {
  fy_safetensors *st = NULL;
  const char *p = check_path(tmpdir, "bad.safetensors");
  CHECK_ERR(fy_safetensors_open(check_path(tmpdir, "nonexistent.safetensors"), &st), FY_ERR_NOT_FOUND);
  CHECK(st == NULL);

  write_str(p, "");
  CHECK_ERR(fy_safetensors_open(p, &st), FY_ERR_FORMAT);
  write_bytes(p, "\x10\x00\x00", 3);
  CHECK_ERR(fy_safetensors_open(p, &st), FY_ERR_FORMAT);

  // Truncated: a valid file cut short (the data is missing).
  float v[4] = {1, 2, 3, 4};
  int64_t s4[1] = {4};
  struct fy_st_tensor t = mk("w", FY_F32, 1, s4, v);
  CHECK_OK(fy_safetensors_write(p, &t, 1, NULL));
  size_t n;
  char *raw = read_bytes(p, &n);
  write_bytes(p, raw, n - 5);
  CHECK_ERR(fy_safetensors_open(p, &st), FY_ERR_FORMAT);
  write_bytes(p, raw, 20);  // cut inside the header
  CHECK_ERR(fy_safetensors_open(p, &st), FY_ERR_FORMAT);
  free(raw);

  // Header length larger than the file; and absurdly large (would overflow additions).
  unsigned char h[16] = {0xff, 0xff, 0, 0, 0, 0, 0, 0, '{', '}'};
  write_bytes(p, h, 16);
  CHECK_ERR(fy_safetensors_open(p, &st), FY_ERR_FORMAT);
  memset(h, 0xff, 8);
  write_bytes(p, h, 16);
  CHECK_ERR(fy_safetensors_open(p, &st), FY_ERR_FORMAT);

  // Offsets past the data.
  write_raw(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[8,24]}}", 16);
  CHECK_ERR(fy_safetensors_open(p, &st), FY_ERR_FORMAT);
  write_raw(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[18446744073709551612,"
               "18446744073709551616]}}", 16);
  CHECK_ERR(fy_safetensors_open(p, &st), FY_ERR_FORMAT);
  write_raw(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,4]}}", 16);
  CHECK_ERR(fy_safetensors_open(p, &st), FY_ERR_FORMAT);
  // Overlapping tensors.
  write_raw(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
               "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 16);
  CHECK_ERR(fy_safetensors_open(p, &st), FY_ERR_FORMAT);
  // Two tensors at the same place.
  write_raw(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
               "\"b\":{\"dtype\":\"I32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 16);
  CHECK_ERR(fy_safetensors_open(p, &st), FY_ERR_FORMAT);
  // Wrong byte count for the shape.
  write_raw(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,16]}}", 16);
  CHECK_ERR(fy_safetensors_open(p, &st), FY_ERR_FORMAT);
  write_raw(p, "{\"w\":{\"dtype\":\"BF16\",\"shape\":[4],\"data_offsets\":[0,16]}}", 16);
  CHECK_ERR(fy_safetensors_open(p, &st), FY_ERR_FORMAT);
  // A shape whose element count overflows.
  write_raw(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,4],\"data_offsets\":[0,16]}}", 16);
  CHECK_ERR(fy_safetensors_open(p, &st), FY_ERR_FORMAT);
  // Negative, fractional, non-numeric dims; rank too large.
  write_raw(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[-4],\"data_offsets\":[0,16]}}", 16);
  CHECK_ERR(fy_safetensors_open(p, &st), FY_ERR_FORMAT);
  write_raw(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[4.0],\"data_offsets\":[0,16]}}", 16);
  CHECK_ERR(fy_safetensors_open(p, &st), FY_ERR_FORMAT);
  write_raw(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":\"4\",\"data_offsets\":[0,16]}}", 16);
  CHECK_ERR(fy_safetensors_open(p, &st), FY_ERR_FORMAT);
  write_raw(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,4],\"data_offsets\":[0,16]}}", 16);
  CHECK_ERR(fy_safetensors_open(p, &st), FY_ERR_FORMAT);
  write_raw(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0]}}", 16);
  CHECK_ERR(fy_safetensors_open(p, &st), FY_ERR_FORMAT);
  write_raw(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[4]}}", 16);
  CHECK_ERR(fy_safetensors_open(p, &st), FY_ERR_FORMAT);
  // Unknown dtype; dtype not a string.
  write_raw(p, "{\"w\":{\"dtype\":\"F128\",\"shape\":[1],\"data_offsets\":[0,16]}}", 16);
  CHECK_ERR(fy_safetensors_open(p, &st), FY_ERR_FORMAT);
  write_raw(p, "{\"w\":{\"dtype\":7,\"shape\":[4],\"data_offsets\":[0,16]}}", 16);
  CHECK_ERR(fy_safetensors_open(p, &st), FY_ERR_FORMAT);
  // JSON that is not an object, invalid JSON, trailing garbage, an entry that is not an object.
  write_raw(p, "[1,2,3]", 16);
  CHECK_ERR(fy_safetensors_open(p, &st), FY_ERR_FORMAT);
  write_raw(p, "{\"w\":{\"dtype\":\"F32\",", 16);
  CHECK_ERR(fy_safetensors_open(p, &st), FY_ERR_FORMAT);
  write_raw(p, "{} xyz", 16);
  CHECK_ERR(fy_safetensors_open(p, &st), FY_ERR_FORMAT);
  write_raw(p, "{\"w\": 5}", 16);
  CHECK_ERR(fy_safetensors_open(p, &st), FY_ERR_FORMAT);
  write_raw(p, "{\"__metadata__\": 5}", 16);
  CHECK_ERR(fy_safetensors_open(p, &st), FY_ERR_FORMAT);
  {  // a NUL inside the header
    unsigned char z[24] = {8, 0, 0, 0, 0, 0, 0, 0, '{', '}', 0, ' ', ' ', ' ', ' ', ' '};
    write_bytes(p, z, 24);
    CHECK_ERR(fy_safetensors_open(p, &st), FY_ERR_FORMAT);
  }
  // Still fine: metadata only, no tensors; and a hand-made file with a gap and padding.
  write_raw(p, "{\"__metadata__\":{\"format\":\"pt\"}}", 0);
  CHECK_OK(fy_safetensors_open(p, &st));
  CHECK(st && fy_safetensors_count(st) == 0);
  fy_safetensors_close(st);
  write_raw(p, "{\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]},"
               "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 16);
  CHECK_OK(fy_safetensors_open(p, &st));
  CHECK(st && fy_safetensors_count(st) == 2);
  if (st) {  // each tensor where its offsets say, not where the header lists it
    const struct fy_st_tensor *a = fy_safetensors_find(st, "a"), *b = fy_safetensors_find(st, "b");
    CHECK(a && b && a->nbytes == 8 && b->nbytes == 4 && a->shape[0] == 2 && b->shape[0] == 1 &&
          (const char *)b->data == (const char *)a->data + 8);
  }
  fy_safetensors_close(st);
  unlink(p);

  // A directory where a file is expected.
  CHECK_ERR(fy_safetensors_open(tmpdir, &st), FY_ERR_IO);
}

// Corrupt every byte of a small valid file in turn: opening must fail cleanly or succeed, never
// crash (AddressSanitizer watches the reads).
static void test_mutations(void) {
  float v[3] = {1, 2, 3};
  int64_t s3[1] = {3}, s1[1] = {1};
  struct fy_st_tensor ts[2] = {mk("alpha", FY_F32, 1, s3, v), mk("b", FY_BF16, 1, s1, v)};
  const char *p = check_path(tmpdir, "mut.safetensors"), *q = check_path(tmpdir, "mut2.safetensors");
  CHECK_OK(fy_safetensors_write(p, ts, 2, NULL));
  size_t n;
  unsigned char *raw = read_bytes(p, &n);
  int ok = 0, failed = 0;
  for (size_t i = 0; raw && i < n; i++) {
    static const unsigned char repl[] = {0, '"', '9', '}', 0xff};
    for (size_t r = 0; r < sizeof repl; r++) {
      unsigned char old = raw[i];
      raw[i] = repl[r];
      write_bytes(q, raw, n);
      raw[i] = old;
      fy_safetensors *st = NULL;
      fy_status s = fy_safetensors_open(q, &st);
      if (s == FY_OK) {
        ok++;
        for (int k = 0; k < fy_safetensors_count(st); k++) {
          const struct fy_st_tensor *t = fy_safetensors_at(st, k);
          volatile unsigned char sink = 0;
          for (size_t b = 0; b < t->nbytes; b++) sink ^= ((const unsigned char *)t->data)[b];
          (void)sink;
        }
        fy_safetensors_close(st);
      } else {
        failed += s == FY_ERR_FORMAT;
      }
    }
  }
  CHECK(ok > 0 && failed > 0);
  // Every prefix of the file.
  int prefix_fail = 0;
  for (size_t k = 0; raw && k < n; k++) {
    write_bytes(q, raw, k);
    fy_safetensors *st = NULL;
    prefix_fail += fy_safetensors_open(q, &st) == FY_ERR_FORMAT;
    fy_safetensors_close(st);
  }
  CHECKF(prefix_fail == (int)n, "%d of %zu prefixes refused", prefix_fail, n);
  free(raw);
  unlink(p);
  unlink(q);
}

static void test_write_failures(void) {
  float v[4] = {1, 2, 3, 4};
  int64_t s4[1] = {4};
  struct fy_st_tensor t = mk("w", FY_F32, 1, s4, v);
  fy_safetensors *st = NULL;

  // A directory that does not exist.
  CHECK_ERR(fy_safetensors_write(check_path(tmpdir, "no/such/dir/x.safetensors"), &t, 1, NULL), FY_ERR_IO);

  // The target is a directory: the rename fails, the temporary file is removed.
  const char *d = check_path(tmpdir, "isdir");
  mkdir(d, 0755);
  char sub[300];
  snprintf(sub, sizeof sub, "%s/x", d);
  mkdir(sub, 0755);
  CHECK_ERR(fy_safetensors_write(sub, &t, 1, NULL), FY_ERR_IO);
  CHECK(count_entries(d) == 1);

  // A file already there, which the failed writes below leave as it was. (A directory the
  // writer may not write in: test_unwritable_dir.)
  const char *p = check_path(tmpdir, "isdir/keep.safetensors");
  CHECK_OK(fy_safetensors_write(p, &t, 1, NULL));

  // A full disk: a file-size limit makes write() fail with EFBIG part-way through, as ENOSPC
  // would. The old file must survive and no temporary file may remain.
  float *big = calloc(1 << 18, sizeof(float));
  int64_t sbig[1] = {1 << 18};
  struct fy_st_tensor tb = mk("big", FY_F32, 1, sbig, big);
  struct rlimit old, lim;
  getrlimit(RLIMIT_FSIZE, &old);
  lim = old;
  lim.rlim_cur = 64 << 10;
  void (*prev)(int) = signal(SIGXFSZ, SIG_IGN);
  CHECK(setrlimit(RLIMIT_FSIZE, &lim) == 0);
  CHECK_ERR(fy_safetensors_write(p, &tb, 1, NULL), FY_ERR_IO);
  CHECK(strstr(fy_error_msg(), "File too large") != NULL);
  CHECK_ERR(fy_safetensors_write_dir(d, &tb, 1, 0), FY_ERR_IO);
  setrlimit(RLIMIT_FSIZE, &old);
  signal(SIGXFSZ, prev);
  free(big);
  CHECK(count_entries(d) == 2);  // x/ and keep.safetensors
  CHECK_OK(fy_safetensors_open(p, &st));
  CHECK(st && fy_safetensors_count(st) == 1 && memcmp(fy_safetensors_find(st, "w")->data, v, 16) == 0);
  fy_safetensors_close(st);
  check_rm_rf(d);
}

static bool same_file(const char *a, const char *b) {
  size_t na = 0, nb = 0;
  char *x = read_bytes(a, &na), *y = read_bytes(b, &nb);
  bool same = x && y && na == nb && memcmp(x, y, na) == 0;
  free(x);
  free(y);
  return same;
}

// A directory the writer may not write in: the write fails with FY_ERR_IO and the file already
// there stays as it was. Its own part (`--part unwritable-dir`): permissions do not stop root, so
// as root the directory is a tmpfs made read-only after the first write instead, and the part is
// skipped where root may not mount one.
static void test_unwritable_dir(void) {
  float v[4] = {1, 2, 3, 4}, w[4] = {5, 6, 7, 8};
  int64_t s4[1] = {4};
  struct fy_st_tensor t = mk("w", FY_F32, 1, s4, v), t2 = mk("w", FY_F32, 1, s4, w);
  const char *d = check_path(tmpdir, "unwritable");
  CHECK(mkdir(d, 0755) == 0);
  const bool root = geteuid() == 0;
  if (root && mount("tmpfs", d, "tmpfs", 0, "size=1m") != 0) {
    CHECK_SKIP("as root only a read-only file system stops a write, and mounting a tmpfs is not permitted here (%s)",
               strerror(errno));
    rmdir(d);
    return;
  }
  const char *p = check_path(tmpdir, "unwritable/keep.safetensors");
  CHECK_OK(fy_safetensors_write(p, &t, 1, NULL));
  if (root)
    CHECK(mount(NULL, d, NULL, MS_REMOUNT | MS_RDONLY, NULL) == 0);
  else
    CHECK(chmod(d, 0555) == 0);
  CHECK_ERR(fy_safetensors_write(p, &t2, 1, NULL), FY_ERR_IO);
  CHECK(count_entries(d) == 1);  // no temporary file either
  fy_safetensors *st = NULL;
  CHECK_OK(fy_safetensors_open(p, &st));
  CHECK(st && memcmp(fy_safetensors_find(st, "w")->data, v, 16) == 0);
  fy_safetensors_close(st);
  if (root)
    CHECK(umount2(d, MNT_DETACH) == 0);
  else
    CHECK(chmod(d, 0755) == 0);
}

// A writer fed in pieces, in any order, makes the same bytes as a write from whole tensors; a
// writer that was not given every byte, or given bytes twice, makes nothing.
static void test_parts(void) {
  enum { NA = 1000, NB = 37, NC = 5 };
  float a[NA], b[NB];
  int64_t c[NC];
  uint16_t h[NB];
  for (int i = 0; i < NA; i++) a[i] = (float)i * 0.25f - 7;
  for (int i = 0; i < NB; i++) b[i] = -(float)i, h[i] = (uint16_t)(0x3c00 + i);
  for (int i = 0; i < NC; i++) c[i] = (int64_t)i << 35;
  int64_t sa[2] = {25, 40}, sb[1] = {NB}, sc[1] = {NC};
  struct fy_st_tensor ts[] = {mk("a", FY_F32, 2, sa, a), mk("half", FY_F16, 1, sb, h), mk("b", FY_F32, 1, sb, b),
                              mk("c", FY_I64, 1, sc, c)};
  const int n = 4;
  const char *md[] = {"format", "pt", NULL};
  char whole[512], parts[512];
  snprintf(whole, sizeof whole, "%s/whole.safetensors", tmpdir);
  snprintf(parts, sizeof parts, "%s/parts.safetensors", tmpdir);
  CHECK_OK(fy_safetensors_write(whole, ts, n, md));
  // Last tensor first, each in pieces of 7 bytes from its end (the data pointers are not read).
  struct fy_st_tensor shapes[4];
  memcpy(shapes, ts, sizeof ts);
  for (int i = 0; i < n; i++) shapes[i].data = NULL;
  fy_st_writer *w = NULL;
  CHECK_OK(fy_st_writer_open(parts, shapes, n, md, &w));
  CHECK(access(parts, F_OK) != 0);  // nothing under the name before commit
  for (int i = n - 1; w && i >= 0; i--)
    for (size_t end = ts[i].nbytes; end > 0;) {
      size_t lo = end > 7 ? end - 7 : 0;
      CHECK_OK(fy_st_writer_put(w, i, lo, (const char *)ts[i].data + lo, end - lo));
      end = lo;
    }
  CHECK_OK(fy_st_writer_commit(w));
  CHECKF(same_file(whole, parts), "a file written in pieces differs from one written whole");

  // The same for a sharded directory (shards of at most 256 bytes: [a] [half b] [c]).
  char dw[512], dp[512], fw[600], fp[600];
  snprintf(dw, sizeof dw, "%s/dwhole", tmpdir);
  snprintf(dp, sizeof dp, "%s/dparts", tmpdir);
  CHECK_OK(fy_safetensors_write_dir(dw, ts, n, 256));
  CHECK_OK(fy_st_writer_open_dir(dp, shapes, n, 256, &w));
  for (int i = 0; w && i < n; i++) {
    size_t half = ts[i].nbytes / 2;
    CHECK_OK(fy_st_writer_put(w, i, half, (const char *)ts[i].data + half, ts[i].nbytes - half));
    CHECK_OK(fy_st_writer_put(w, i, 0, ts[i].data, half));
  }
  CHECK_OK(fy_st_writer_commit(w));
  const char *files[] = {"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                         "model-00003-of-00003.safetensors", "model.safetensors.index.json"};
  for (int k = 0; k < 4; k++) {
    snprintf(fw, sizeof fw, "%s/%s", dw, files[k]);
    snprintf(fp, sizeof fp, "%s/%s", dp, files[k]);
    CHECKF(same_file(fw, fp), "%s written in pieces differs", files[k]);
  }
  CHECK(count_entries(dp) == 4);
  // One tensor over the limit: a shard of its own, still listed in an index (as transformers does).
  CHECK_OK(fy_safetensors_write_dir(dw, ts, 1, 256));
  snprintf(fw, sizeof fw, "%s/model-00001-of-00001.safetensors", dw);
  CHECK(access(fw, F_OK) == 0 && count_entries(dw) == 2);
  check_rm_rf(dw);
  check_rm_rf(dp);

  // Bytes outside a tensor, or put twice, are refused; a writer short of bytes commits nothing.
  CHECK_OK(fy_st_writer_open(parts, shapes, n, NULL, &w));
  if (w) {
    CHECK_ERR(fy_st_writer_put(w, 2, 4 * NB - 4, b, 8), FY_ERR_INVALID);
    CHECK_ERR(fy_st_writer_put(w, 4, 0, b, 4), FY_ERR_INVALID);
    CHECK_OK(fy_st_writer_put(w, 2, 0, b, 4 * NB));
    CHECK_ERR(fy_st_writer_put(w, 2, 0, b, 4), FY_ERR_INVALID);
    for (int i = 0; i < n; i++)
      if (i != 2) CHECK_OK(fy_st_writer_put(w, i, 0, ts[i].data, ts[i].nbytes - (i == 0 ? 4 : 0)));
    CHECK_ERR(fy_st_writer_commit(w), FY_ERR_INVALID);
  }
  CHECK(same_file(whole, parts));  // the earlier file is untouched
  CHECK_OK(fy_st_writer_open(parts, shapes, n, NULL, &w));
  fy_st_writer_abort(w);
  CHECK(same_file(whole, parts));
  unlink(whole);
  unlink(parts);
  CHECK(count_entries(tmpdir) == 0);  // no temporary file left behind
}

int main(int argc, char **argv) {
  check_args(argc, argv);
  snprintf(tmpdir, sizeof tmpdir, "/tmp/fy_st_XXXXXX");
  if (!mkdtemp(tmpdir)) {
    perror("mkdtemp");
    return 2;
  }
  if (check_plain()) {
    test_round_trip();
    test_many();
    test_done_with();
    test_dir();
    test_bad_files();
    test_mutations();
    test_write_failures();
    test_parts();
  }
  if (check_part("unwritable-dir")) test_unwritable_dir();
  check_rm_rf(tmpdir);
  return check_summary("safetensors");
}
