// Token shard data loader (llm.c's shard format).
//
// The stream: each shard of `count` tokens holds floor((count - 1) / T) windows of T+1 tokens,
// window i starting at token i*T (so consecutive windows share one token, and no window crosses a
// shard boundary). Windows are numbered through the shards in sorted name order; Nw is their total,
// and an epoch visits all of them. Row j of batch k on rank r of W is stream element
// s = k*W*B + r*B + j; it is window (s mod Nw) of epoch floor(s / Nw) — in order, or, shuffled,
// window perm_e[s mod Nw], where perm_e is a Fisher-Yates shuffle (i from Nw-1 down to 1, swap with
// a uniform j in [0, i], drawn by rejection from xoshiro256**) whose generator state is filled by
// splitmix64 from seed ^ (epoch * 0xD1B54A32D192ED03).
#include "runtime/data.h"

#include "core/fileio.h"
#include "core/rand.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define DATA_HEADER_BYTES (FY_SHARD_HEADER_INTS * 4)

struct shard {
  char *path;
  void *map;
  size_t map_size;
  const void *tokens;  // uint16, or uint32 in a wide shard
  int width;           // bytes a token: 2 or 4
  int64_t count;
  int64_t first_window;  // index of its first window in the stream
  int64_t nwindows;
  void *mask_map;        // its loss mask (data.h), or NULL
  size_t mask_map_size;
  const uint8_t *mask;   // count bytes
};

struct fy_data {
  struct shard *shards;
  int nshards;
  int64_t ntokens, nwindows;
  int64_t B, T;
  bool shuffle;
  uint64_t seed;
  int rank, world;
  int64_t position;
  int64_t *perm;         // permutation of the cached epoch (shuffled only)
  int64_t perm_epoch;    // -1: none
  struct fy_batch batch;
};

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t xoshiro256ss(uint64_t s[4]) {
  uint64_t result = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
  s[2] ^= s[0];
  s[3] ^= s[1];
  s[1] ^= s[2];
  s[0] ^= s[3];
  s[2] ^= t;
  s[3] = rotl(s[3], 45);
  return result;
}

static void data_make_perm(fy_data *d, int64_t epoch) {
  uint64_t x = d->seed ^ ((uint64_t)epoch * 0xD1B54A32D192ED03ull), s[4];
  for (int i = 0; i < 4; i++) s[i] = fy_splitmix64(&x);
  int64_t n = d->nwindows;
  for (int64_t i = 0; i < n; i++) d->perm[i] = i;
  for (int64_t i = n - 1; i > 0; i--) {
    uint64_t bound = (uint64_t)i + 1, r;
    uint64_t limit = UINT64_MAX - UINT64_MAX % bound;  // reject the biased tail
    do r = xoshiro256ss(s); while (r >= limit);
    int64_t j = (int64_t)(r % bound);
    int64_t t = d->perm[i];
    d->perm[i] = d->perm[j];
    d->perm[j] = t;
  }
  d->perm_epoch = epoch;
}

void fy_data_close(fy_data *d) {
  if (!d) return;
  for (int i = 0; i < d->nshards; i++) {
    if (d->shards[i].map) munmap(d->shards[i].map, d->shards[i].map_size);
    if (d->shards[i].mask_map) munmap(d->shards[i].mask_map, d->shards[i].mask_map_size);
    free(d->shards[i].path);
  }
  free(d->shards);
  free(d->perm);
  free(d->batch.inputs);
  free(d->batch.targets);
  free(d);
}

static int data_strcmp(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

static bool has_glob_chars(const char *s) { return strpbrk(s, "*?[") != NULL; }

// Lists the shard paths for `path` (file, directory of *.bin, or glob), sorted by name.
static fy_status data_list(const char *path, char ***out, int *n) {
  char **list = NULL;
  int cnt = 0;
  struct stat sb;
  if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode)) {
    DIR *dir = opendir(path);
    if (!dir) return fy_error_set(FY_ERR_IO, "cannot open directory %s: %s", path, strerror(errno));
    struct dirent *de;
    size_t pl = strlen(path);
    while ((de = readdir(dir))) {
      size_t l = strlen(de->d_name);
      if (l < 5 || strcmp(de->d_name + l - 4, ".bin") != 0 || de->d_name[0] == '.') continue;
      char **nl = realloc(list, (size_t)(cnt + 1) * sizeof *nl);
      char *p = malloc(pl + l + 2);
      if (!nl || !p) {
        free(p);
        if (nl) list = nl;
        for (int i = 0; i < cnt; i++) free(list[i]);
        free(list);
        closedir(dir);
        return fy_error_set(FY_ERR_NOMEM, "out of memory");
      }
      list = nl;
      snprintf(p, pl + l + 2, "%s%s%s", path, pl && path[pl - 1] == '/' ? "" : "/", de->d_name);
      list[cnt++] = p;
    }
    closedir(dir);
    if (cnt == 0) return fy_error_set(FY_ERR_NOT_FOUND, "no token shards (*.bin) in directory %s", path);
  } else if (stat(path, &sb) == 0 || !has_glob_chars(path)) {
    if (stat(path, &sb) != 0)
      return fy_error_set(FY_ERR_NOT_FOUND, "no token shards: %s: %s", path, strerror(errno));
    list = malloc(sizeof *list);
    if (!list || !(list[0] = strdup(path))) {
      free(list);
      return fy_error_set(FY_ERR_NOMEM, "out of memory");
    }
    cnt = 1;
  } else {
    glob_t g;
    int r = glob(path, 0, NULL, &g);
    if (r == GLOB_NOMATCH) return fy_error_set(FY_ERR_NOT_FOUND, "no token shards match %s", path);
    if (r != 0) {
      globfree(&g);
      return fy_error_set(FY_ERR_IO, "cannot expand %s", path);
    }
    list = calloc(g.gl_pathc, sizeof *list);
    for (size_t i = 0; list && i < g.gl_pathc; i++) {
      if (!(list[cnt] = strdup(g.gl_pathv[i]))) break;
      cnt++;
    }
    bool short_of = !list || (size_t)cnt != g.gl_pathc;
    globfree(&g);
    if (short_of) {
      for (int i = 0; i < cnt; i++) free(list[i]);
      free(list);
      return fy_error_set(FY_ERR_NOMEM, "out of memory");
    }
  }
  // glob and readdir order by locale or not at all; the stream is defined by byte order.
  qsort(list, (size_t)cnt, sizeof *list, data_strcmp);
  *out = list;
  *n = cnt;
  return FY_OK;
}

static inline uint32_t shard_token(const struct shard *s, int64_t i) {
  return s->width == 4 ? ((const uint32_t *)s->tokens)[i] : ((const uint16_t *)s->tokens)[i];
}

// Maps the file at path read-only (what names it in messages): a regular file of at least the
// header's bytes. FY_ERR_NOT_FOUND when there is none.
static fy_status map_file(const char *path, const char *what, void **map, size_t *size) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int e = errno;
    return fy_error_set(e == ENOENT ? FY_ERR_NOT_FOUND : FY_ERR_IO, "cannot open %s %s: %s", what, path, strerror(e));
  }
  struct stat sb;
  fy_status st = FY_OK;
  void *m = MAP_FAILED;
  if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode))
    st = fy_error_set(FY_ERR_IO, "%s %s is not a regular file", what, path);
  else if (sb.st_size < DATA_HEADER_BYTES)
    st = fy_error_set(FY_ERR_FORMAT, "%s %s is too small for a header (%lld bytes, need %d; tools/tokenize.py "
                      "makes shards from text)", what, path, (long long)sb.st_size, DATA_HEADER_BYTES);
  else if ((m = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0)) == MAP_FAILED)
    st = fy_error_set(FY_ERR_IO, "cannot map %s %s: %s", what, path, strerror(errno));
  close(fd);
  if (st == FY_OK) *map = m, *size = (size_t)sb.st_size;
  return st;
}

static fy_status data_map_shard(struct shard *s, int64_t vocab_size) {
  FY_TRY(map_file(s->path, "shard", &s->map, &s->map_size));
  const void *map = s->map;
  int32_t h[3];
  memcpy(h, map, sizeof h);
  if (h[0] == FY_MASK_MAGIC)
    return fy_error_set(FY_ERR_FORMAT, "%s is a loss mask, not a token shard (the loader finds a shard's mask "
                        "itself: give the shards, as a directory or a glob of *.bin)", s->path);
  if (h[0] != FY_SHARD_MAGIC && h[0] != FY_SHARD32_MAGIC)
    return fy_error_set(FY_ERR_FORMAT, "%s: not a token shard (magic %d, expected %d, or %d for uint32 tokens; "
                        "tools/tokenize.py makes shards from text)", s->path, h[0], FY_SHARD_MAGIC, FY_SHARD32_MAGIC);
  const bool wide = h[0] == FY_SHARD32_MAGIC;
  if (h[1] != (wide ? FY_SHARD32_VERSION : FY_SHARD_VERSION))
    return fy_error_set(FY_ERR_FORMAT, "%s: shard version %d is not supported (expected %d: %s tokens)", s->path,
                        h[1], wide ? FY_SHARD32_VERSION : FY_SHARD_VERSION, wide ? "uint32" : "uint16");
  s->width = wide ? 4 : 2;
  if (h[2] < 0 || (int64_t)s->map_size != DATA_HEADER_BYTES + s->width * (int64_t)h[2])
    return fy_error_set(FY_ERR_FORMAT, "%s: header says %d tokens (%lld bytes) but the file has "
                        "%lld bytes", s->path, h[2], (long long)DATA_HEADER_BYTES + s->width * (long long)h[2],
                        (long long)s->map_size);
  s->count = h[2];
  s->tokens = (const char *)map + DATA_HEADER_BYTES;
  uint32_t mx = 0;  // (the loops vectorise)
  if (wide)
    for (int64_t i = 0; i < s->count; i++) mx = ((const uint32_t *)s->tokens)[i] > mx ? ((const uint32_t *)s->tokens)[i] : mx;
  else
    for (int64_t i = 0; i < s->count; i++) mx = ((const uint16_t *)s->tokens)[i] > mx ? ((const uint16_t *)s->tokens)[i] : mx;
  for (int64_t i = 0; (int64_t)mx >= vocab_size && i < s->count; i++) {
    uint32_t t = shard_token(s, i);
    if ((int64_t)t >= vocab_size)
      return fy_error_set(FY_ERR_INVALID, "%s: token %lld has value %u, outside the vocabulary "
                          "(vocab_size %lld)", s->path, (long long)i, t, (long long)vocab_size);
  }
  return FY_OK;
}

// Where shard_path's loss mask lives: X.bin -> X.mask, anything else -> itself + ".mask".
static char *mask_path_of(const char *shard_path) {
  size_t l = strlen(shard_path);
  bool bin = l >= 4 && strcmp(shard_path + l - 4, ".bin") == 0;
  char *p = malloc(l + 6);
  if (p) snprintf(p, l + 6, "%.*s.mask", (int)(bin ? l - 4 : l), shard_path);
  return p;
}

// The shard's loss mask, when it has one: mapped and checked (header, count, bytes 0 or 1).
static fy_status data_map_mask(struct shard *s) {
  char *path = mask_path_of(s->path);
  if (!path) return fy_error_set(FY_ERR_NOMEM, "out of memory");
  fy_status st = map_file(path, "loss mask", &s->mask_map, &s->mask_map_size);
  if (st == FY_ERR_NOT_FOUND) {  // none: every target counts
    free(path);
    fy_error_clear();
    return FY_OK;
  }
  const void *map = s->mask_map;
  if (st == FY_OK && s->mask_map_size != (size_t)(DATA_HEADER_BYTES + s->count))
    st = fy_error_set(FY_ERR_FORMAT, "loss mask %s has %zu bytes; its shard's %lld tokens need %lld", path,
                      s->mask_map_size, (long long)s->count, (long long)(DATA_HEADER_BYTES + s->count));
  if (st == FY_OK) {
    int32_t h[3];
    memcpy(h, map, sizeof h);
    if (h[0] != FY_MASK_MAGIC || h[1] != FY_MASK_VERSION || h[2] != s->count)
      st = fy_error_set(FY_ERR_FORMAT, "%s: not the loss mask of %s (magic %d, version %d, %d tokens; expected %d, "
                        "%d, %lld)", path, s->path, h[0], h[1], h[2], FY_MASK_MAGIC, FY_MASK_VERSION, (long long)s->count);
  }
  if (st == FY_OK) {
    s->mask = (const uint8_t *)map + DATA_HEADER_BYTES;
    uint8_t any = 0;  // (vectorises)
    for (int64_t i = 0; i < s->count; i++) any |= s->mask[i];
    for (int64_t i = 0; any > 1 && i < s->count; i++)
      if (s->mask[i] > 1) {
        st = fy_error_set(FY_ERR_FORMAT, "%s: byte %lld of the mask is %u (0 or 1)", path, (long long)i, s->mask[i]);
        break;
      }
  }
  free(path);
  return st;
}

fy_status fy_data_open(const char *path, int64_t vocab_size, int64_t B, int64_t T, bool shuffle,
                       uint64_t seed, int rank, int world, fy_data **out) {
  *out = NULL;
  if (!path) return fy_error_set(FY_ERR_INVALID, "data: no path");
  if (B < 1 || T < 1)
    return fy_error_set(FY_ERR_INVALID, "data: batch size B=%lld and sequence length T=%lld must "
                        "be at least 1", (long long)B, (long long)T);
  if (B > (1 << 24) || T > (1 << 24) || B * T > ((int64_t)1 << 31))
    return fy_error_set(FY_ERR_INVALID, "data: B*T = %lld*%lld is too large", (long long)B,
                        (long long)T);
  if (world < 1 || rank < 0 || rank >= world)
    return fy_error_set(FY_ERR_INVALID, "data: rank %d of world %d", rank, world);
  if (vocab_size < 1) return fy_error_set(FY_ERR_INVALID, "data: vocab_size %lld", (long long)vocab_size);

  fy_data *d = calloc(1, sizeof *d);
  if (!d) return fy_error_set(FY_ERR_NOMEM, "out of memory");
  d->B = B;
  d->T = T;
  d->shuffle = shuffle;
  d->seed = seed;
  d->rank = rank;
  d->world = world;
  d->perm_epoch = -1;
  char **list = NULL;
  int n = 0;
  fy_status st = data_list(path, &list, &n);
  if (st != FY_OK) {
    free(d);
    return st;
  }
  d->shards = calloc((size_t)n, sizeof *d->shards);
  if (!d->shards) {
    for (int i = 0; i < n; i++) free(list[i]);
    free(list);
    free(d);
    return fy_error_set(FY_ERR_NOMEM, "out of memory");
  }
  for (int i = 0; i < n; i++) d->shards[i].path = list[i];  // ownership moves
  d->nshards = n;
  free(list);
  for (int i = 0; i < n && st == FY_OK; i++) {
    struct shard *s = &d->shards[i];
    st = data_map_shard(s, vocab_size);
    if (st == FY_OK) st = data_map_mask(s);
    s->nwindows = s->count > 0 ? (s->count - 1) / T : 0;
    s->first_window = d->nwindows;
    d->nwindows += s->nwindows;
    d->ntokens += s->count;
  }
  int64_t need = B * world;
  if (st == FY_OK && d->nwindows < need)
    st = fy_error_set(FY_ERR_INVALID, "data set %s is too small: %lld tokens in %d shard(s) make "
                      "%lld windows of T+1 = %lld tokens (windows do not cross shards), but a batch "
                      "needs %lld (B=%lld x %d rank(s))", path, (long long)d->ntokens, n,
                      (long long)d->nwindows, (long long)(T + 1), (long long)need, (long long)B,
                      world);
  if (st == FY_OK) {
    d->batch.B = B;
    d->batch.T = T;
    d->batch.inputs = malloc((size_t)(B * T) * sizeof(int32_t));
    d->batch.targets = malloc((size_t)(B * T) * sizeof(int32_t));
    d->batch.mask = NULL;
    if (shuffle) d->perm = malloc((size_t)d->nwindows * sizeof *d->perm);
    if (!d->batch.inputs || !d->batch.targets || (shuffle && !d->perm))
      st = fy_error_set(FY_ERR_NOMEM, "data: out of memory for the batch or the permutation");
  }
  if (st != FY_OK) {
    fy_data_close(d);
    return st;
  }
  *out = d;
  return FY_OK;
}

static const struct shard *data_shard_of(const fy_data *d, int64_t w) {
  int lo = 0, hi = d->nshards - 1;  // last shard with first_window <= w and a window to give
  while (lo < hi) {
    int mid = (lo + hi + 1) / 2;
    if (d->shards[mid].first_window <= w) lo = mid;
    else hi = mid - 1;
  }
  // Shards without windows share first_window with the next one; step back to the one holding w.
  while (d->shards[lo].nwindows == 0 || w >= d->shards[lo].first_window + d->shards[lo].nwindows) lo--;
  return &d->shards[lo];
}

// The stream element of row 0 of this rank's batch at position (it fits in int64 for any position
// below 2^63 / (W*B); seek checks that bound).
static int64_t batch_row0(const fy_data *d, int64_t position) {
  return position * d->world * d->B + (int64_t)d->rank * d->B;
}

// Stream element s's window: the shard holding it and the index there of its first token.
static const struct shard *row_window(fy_data *d, int64_t s, int64_t *first) {
  int64_t epoch = s / d->nwindows, w = s % d->nwindows;
  if (d->shuffle) {
    if (d->perm_epoch != epoch) data_make_perm(d, epoch);
    w = d->perm[w];
  }
  const struct shard *sh = data_shard_of(d, w);
  *first = (w - sh->first_window) * d->T;
  return sh;
}

fy_status fy_data_next(fy_data *d, struct fy_batch **out) {
  if (!d || !out) return fy_error_set(FY_ERR_INVALID, "fy_data_next: NULL argument");
  const int64_t B = d->B, T = d->T, s0 = batch_row0(d, d->position);
  for (int64_t j = 0; j < B; j++) {
    int64_t first;
    const struct shard *sh = row_window(d, s0 + j, &first);
    int32_t *in = d->batch.inputs + j * T, *tg = d->batch.targets + j * T;
    for (int64_t t = 0; t < T; t++) {  // (tokens < vocab_size, which fits an int32)
      in[t] = (int32_t)shard_token(sh, first + t);
      tg[t] = (int32_t)shard_token(sh, first + t + 1);
    }
    if (sh->mask)  // a target whose mask byte is 0 does not count
      for (int64_t t = 0; t < T; t++)
        if (!sh->mask[first + t + 1]) tg[t] = -100;
  }
  d->batch.row0 = s0;
  d->position++;
  *out = &d->batch;
  return FY_OK;
}

int64_t fy_data_count_targets(fy_data *d, int64_t ahead) {
  const int64_t s0 = batch_row0(d, d->position + ahead);
  int64_t n = 0;
  for (int64_t j = 0; j < d->B; j++) {
    int64_t first;
    const struct shard *sh = row_window(d, s0 + j, &first);
    if (!sh->mask) {
      n += d->T;
      continue;
    }
    for (int64_t t = 1; t <= d->T; t++) n += sh->mask[first + t];
  }
  return n;
}

int64_t fy_data_num_tokens(const fy_data *d) { return d ? d->ntokens : 0; }

int64_t fy_data_position(const fy_data *d) { return d ? d->position : 0; }

fy_status fy_data_seek(fy_data *d, int64_t position) {
  if (!d) return fy_error_set(FY_ERR_INVALID, "fy_data_seek: NULL loader");
  if (position < 0 || position > INT64_MAX / 2 / (d->world * d->B) - 1)
    return fy_error_set(FY_ERR_INVALID, "data: cannot seek to batch %lld", (long long)position);
  d->position = position;
  return FY_OK;
}

static fy_status shard_write(const char *path, const void *tokens, int64_t n, bool wide) {
  if (!path || n < 0 || n > INT32_MAX || (n > 0 && !tokens))
    return fy_error_set(FY_ERR_INVALID, "shard write: %lld tokens (a shard holds 0 to %d)",
                        (long long)n, INT32_MAX);
  int32_t header[FY_SHARD_HEADER_INTS] = {wide ? FY_SHARD32_MAGIC : FY_SHARD_MAGIC,
                                          wide ? FY_SHARD32_VERSION : FY_SHARD_VERSION, (int32_t)n};
  struct fy_file_piece pieces[2] = {{header, sizeof header}, {tokens, (size_t)n * (wide ? 4 : 2)}};
  return fy_file_write_atomic(path, pieces, 2);
}

fy_status fy_shard_write(const char *path, const uint16_t *tokens, int64_t n) { return shard_write(path, tokens, n, false); }
fy_status fy_shard_write32(const char *path, const uint32_t *tokens, int64_t n) { return shard_write(path, tokens, n, true); }

fy_status fy_shard_write_mask(const char *shard_path, const uint8_t *mask, int64_t n) {
  if (!shard_path || n < 0 || n > INT32_MAX || (n > 0 && !mask))
    return fy_error_set(FY_ERR_INVALID, "loss mask write: %lld bytes (a shard holds 0 to %d tokens)", (long long)n,
                        INT32_MAX);
  char *path = mask_path_of(shard_path);
  if (!path) return fy_error_set(FY_ERR_NOMEM, "out of memory");
  int32_t header[FY_SHARD_HEADER_INTS] = {FY_MASK_MAGIC, FY_MASK_VERSION, (int32_t)n};
  struct fy_file_piece pieces[2] = {{header, sizeof header}, {mask, (size_t)n}};
  fy_status st = fy_file_write_atomic(path, pieces, 2);
  free(path);
  return st;
}
