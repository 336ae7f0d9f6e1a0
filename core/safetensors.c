// Safetensors reading (mmap + a header checked against the file) and atomic writing.
#include "core/safetensors.h"

#include "core/fileio.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <json-c/json.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

// safetensors (the Rust crate) refuses headers over 100 MB; a real header is a few hundred KB.
#define ST_MAX_HEADER ((uint64_t)100 << 20)
#define ST_INDEX_NAME "model.safetensors.index.json"
#define ST_SINGLE_NAME "model.safetensors"

struct st_file {
  char *path;
  void *map;          // whole file, read-only; NULL when the file is empty of data
  size_t map_size;
};

struct fy_safetensors {
  struct st_file *files;
  int nfiles;
  struct fy_st_tensor *t;
  int *file_of;       // file index of each tensor
  int n, cap;
  int *slots;         // open-addressing hash of names -> tensor index, -1 empty
  size_t nslots;      // power of two, > 2n
};

static uint64_t st_hash(const char *s) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
  return h;
}

static fy_status st_build_index(fy_safetensors *st) {
  size_t ns = 16;
  while (ns < 2 * (size_t)st->n + 1) ns *= 2;
  int *slots = malloc(ns * sizeof *slots);
  if (!slots) return fy_error_set(FY_ERR_NOMEM, "safetensors: out of memory for the name index");
  for (size_t i = 0; i < ns; i++) slots[i] = -1;
  for (int i = 0; i < st->n; i++) {
    size_t h = st_hash(st->t[i].name) & (ns - 1);
    while (slots[h] >= 0) {
      if (strcmp(st->t[slots[h]].name, st->t[i].name) == 0) {
        fy_status e = fy_error_set(FY_ERR_FORMAT, "safetensors: tensor '%s' appears in both %s and %s",
                                   st->t[i].name, st->files[st->file_of[slots[h]]].path,
                                   st->files[st->file_of[i]].path);
        free(slots);
        return e;
      }
      h = (h + 1) & (ns - 1);
    }
    slots[h] = i;
  }
  free(st->slots);
  st->slots = slots;
  st->nslots = ns;
  return FY_OK;
}

const struct fy_st_tensor *fy_safetensors_find(const fy_safetensors *st, const char *name) {
  if (!st || !name || !st->slots) return NULL;
  size_t h = st_hash(name) & (st->nslots - 1);
  while (st->slots[h] >= 0) {
    if (strcmp(st->t[st->slots[h]].name, name) == 0) return &st->t[st->slots[h]];
    h = (h + 1) & (st->nslots - 1);
  }
  return NULL;
}

int fy_safetensors_count(const fy_safetensors *st) { return st ? st->n : 0; }

const struct fy_st_tensor *fy_safetensors_at(const fy_safetensors *st, int i) {
  return (st && i >= 0 && i < st->n) ? &st->t[i] : NULL;
}

void fy_safetensors_close(fy_safetensors *st) {
  if (!st) return;
  for (int i = 0; i < st->n; i++) free((char *)st->t[i].name);
  for (int i = 0; i < st->nfiles; i++) {
    if (st->files[i].map) munmap(st->files[i].map, st->files[i].map_size);
    free(st->files[i].path);
  }
  free(st->files);
  free(st->t);
  free(st->file_of);
  free(st->slots);
  free(st);
}

static fy_status st_push_tensor(fy_safetensors *st, const struct fy_st_tensor *t, int file) {
  if (st->n == st->cap) {
    int cap = st->cap ? st->cap * 2 : 64;
    struct fy_st_tensor *nt = realloc(st->t, (size_t)cap * sizeof *nt);
    if (!nt) return fy_error_set(FY_ERR_NOMEM, "safetensors: out of memory");
    st->t = nt;
    int *nf = realloc(st->file_of, (size_t)cap * sizeof *nf);
    if (!nf) return fy_error_set(FY_ERR_NOMEM, "safetensors: out of memory");
    st->file_of = nf;
    st->cap = cap;
  }
  st->t[st->n] = *t;
  st->file_of[st->n] = file;
  st->n++;
  return FY_OK;
}

struct st_span {
  uint64_t begin, end;
  const char *name;
};

static int st_span_cmp(const void *a, const void *b) {
  const struct st_span *x = a, *y = b;
  if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
  return x->end < y->end ? -1 : x->end > y->end;
}

// A non-negative JSON integer, or false.
static bool st_get_u64(json_object *o, uint64_t *v) {
  if (!json_object_is_type(o, json_type_int)) return false;
  int64_t i = json_object_get_int64(o);
  if (i < 0) return false;
  // Values above INT64_MAX are clamped by json-c; they are past any real file anyway.
  *v = (uint64_t)i;
  return true;
}

// Parses and checks the header of file `fi` (already mapped), appending its tensors to `st`.
static fy_status st_parse_header(fy_safetensors *st, int fi, const char *hdr, size_t hlen,
                                 const unsigned char *data, uint64_t data_size) {
  const char *path = st->files[fi].path;
  if (memchr(hdr, 0, hlen))
    return fy_error_set(FY_ERR_FORMAT, "%s: safetensors header contains a NUL byte", path);
  json_tokener *tok = json_tokener_new();
  if (!tok) return fy_error_set(FY_ERR_NOMEM, "%s: out of memory parsing the header", path);
  json_object *root = json_tokener_parse_ex(tok, hdr, (int)hlen);
  enum json_tokener_error jerr = json_tokener_get_error(tok);
  size_t end = json_tokener_get_parse_end(tok);
  json_tokener_free(tok);
  if (!root || jerr != json_tokener_success) {
    json_object_put(root);
    return fy_error_set(FY_ERR_FORMAT, "%s: safetensors header is not valid JSON (%s at byte %zu)",
                        path, jerr == json_tokener_continue ? "unexpected end of header"
                                                            : json_tokener_error_desc(jerr),
                        end);
  }
  for (size_t i = end; i < hlen; i++) {
    if (hdr[i] != ' ' && hdr[i] != '\t' && hdr[i] != '\n' && hdr[i] != '\r') {
      json_object_put(root);
      return fy_error_set(FY_ERR_FORMAT, "%s: safetensors header has trailing data at byte %zu",
                          path, i);
    }
  }
  if (!json_object_is_type(root, json_type_object)) {
    json_object_put(root);
    return fy_error_set(FY_ERR_FORMAT, "%s: safetensors header is not a JSON object", path);
  }

  fy_status rc = FY_OK;
  int first = st->n;
  size_t nspans = 0;
  struct st_span *spans = malloc(((size_t)json_object_object_length(root) + 1) * sizeof *spans);
  if (!spans) {
    json_object_put(root);
    return fy_error_set(FY_ERR_NOMEM, "%s: out of memory", path);
  }

  json_object_object_foreach(root, key, val) {
    if (strcmp(key, "__metadata__") == 0) {
      if (!json_object_is_type(val, json_type_object) && !json_object_is_type(val, json_type_null)) {
        rc = fy_error_set(FY_ERR_FORMAT, "%s: __metadata__ is not an object", path);
        break;
      }
      continue;
    }
    if (!json_object_is_type(val, json_type_object)) {
      rc = fy_error_set(FY_ERR_FORMAT, "%s: tensor '%s': entry is not an object", path, key);
      break;
    }
    json_object *jd, *js, *jo;
    if (!json_object_object_get_ex(val, "dtype", &jd) || !json_object_is_type(jd, json_type_string)) {
      rc = fy_error_set(FY_ERR_FORMAT, "%s: tensor '%s': missing or non-string dtype", path, key);
      break;
    }
    int dt = fy_dtype_from_safetensors(json_object_get_string(jd));
    if (dt < 0) {
      rc = fy_error_set(FY_ERR_FORMAT, "%s: tensor '%s': unknown or unsupported dtype '%s' "
                        "(known: F32 BF16 F16 I32 U16 I64)", path, key, json_object_get_string(jd));
      break;
    }
    if (!json_object_object_get_ex(val, "shape", &js) || !json_object_is_type(js, json_type_array)) {
      rc = fy_error_set(FY_ERR_FORMAT, "%s: tensor '%s': missing or non-array shape", path, key);
      break;
    }
    struct fy_st_tensor t = {.dtype = (enum fy_dtype)dt};
    size_t rank = json_object_array_length(js);
    if (rank > FY_MAX_RANK) {
      rc = fy_error_set(FY_ERR_FORMAT, "%s: tensor '%s': rank %zu exceeds the maximum %d", path,
                        key, rank, FY_MAX_RANK);
      break;
    }
    t.rank = (int)rank;
    uint64_t numel = 1;
    bool overflow = false;
    for (size_t d = 0; d < rank; d++) {
      uint64_t v;
      if (!st_get_u64(json_object_array_get_idx(js, d), &v) || v > INT64_MAX) {
        rc = fy_error_set(FY_ERR_FORMAT, "%s: tensor '%s': shape[%zu] is not a non-negative integer",
                          path, key, d);
        break;
      }
      t.shape[d] = (int64_t)v;
      if (__builtin_mul_overflow(numel, v, &numel)) overflow = true;
    }
    if (rc) break;
    uint64_t nbytes;
    if (overflow || __builtin_mul_overflow(numel, (uint64_t)fy_dtype_size(t.dtype), &nbytes)) {
      rc = fy_error_set(FY_ERR_FORMAT, "%s: tensor '%s': shape is too large", path, key);
      break;
    }
    if (!json_object_object_get_ex(val, "data_offsets", &jo) ||
        !json_object_is_type(jo, json_type_array) || json_object_array_length(jo) != 2) {
      rc = fy_error_set(FY_ERR_FORMAT, "%s: tensor '%s': data_offsets must be [begin, end]", path, key);
      break;
    }
    uint64_t b, e;
    if (!st_get_u64(json_object_array_get_idx(jo, 0), &b) ||
        !st_get_u64(json_object_array_get_idx(jo, 1), &e)) {
      rc = fy_error_set(FY_ERR_FORMAT, "%s: tensor '%s': data_offsets are not non-negative integers",
                        path, key);
      break;
    }
    if (b > e || e > data_size) {
      rc = fy_error_set(FY_ERR_FORMAT, "%s: tensor '%s': data_offsets [%llu, %llu] lie outside the "
                        "%llu bytes of data", path, key, (unsigned long long)b,
                        (unsigned long long)e, (unsigned long long)data_size);
      break;
    }
    if (e - b != nbytes) {
      rc = fy_error_set(FY_ERR_FORMAT, "%s: tensor '%s': data_offsets span %llu bytes but the shape "
                        "and dtype %s need %llu", path, key, (unsigned long long)(e - b),
                        fy_dtype_safetensors_name(t.dtype), (unsigned long long)nbytes);
      break;
    }
    t.nbytes = (size_t)nbytes;
    t.data = data + b;
    t.name = strdup(key);
    if (!t.name) {
      rc = fy_error_set(FY_ERR_NOMEM, "%s: out of memory", path);
      break;
    }
    if ((rc = st_push_tensor(st, &t, fi)) != FY_OK) {
      free((char *)t.name);
      break;
    }
    spans[nspans++] = (struct st_span){b, e, st->t[st->n - 1].name};
  }

  if (rc == FY_OK) {
    qsort(spans, nspans, sizeof *spans, st_span_cmp);
    uint64_t prev_end = 0;
    const char *prev = NULL;
    for (size_t i = 0; i < nspans; i++) {
      if (spans[i].begin == spans[i].end) continue;  // empty tensors occupy nothing
      if (prev && spans[i].begin < prev_end) {
        rc = fy_error_set(FY_ERR_FORMAT, "%s: tensors '%s' and '%s' overlap in the data", path, prev,
                          spans[i].name);
        break;
      }
      prev_end = spans[i].end;
      prev = spans[i].name;
    }
  }
  free(spans);
  json_object_put(root);
  if (rc != FY_OK) {  // drop this file's tensors; the caller frees the set
    for (int i = first; i < st->n; i++) free((char *)st->t[i].name);
    st->n = first;
  }
  return rc;
}

// Maps `path` as file number st->nfiles and reads its tensors.
static fy_status st_add_file(fy_safetensors *st, const char *path) {
  struct st_file *nf = realloc(st->files, (size_t)(st->nfiles + 1) * sizeof *nf);
  if (!nf) return fy_error_set(FY_ERR_NOMEM, "safetensors: out of memory");
  st->files = nf;
  struct st_file *f = &st->files[st->nfiles];
  memset(f, 0, sizeof *f);
  f->path = strdup(path);
  if (!f->path) return fy_error_set(FY_ERR_NOMEM, "safetensors: out of memory");
  int fi = st->nfiles++;

  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int e = errno;
    return fy_error_set(e == ENOENT ? FY_ERR_NOT_FOUND : FY_ERR_IO, "cannot open %s: %s", path,
                        strerror(e));
  }
  struct stat sb;
  if (fstat(fd, &sb) != 0) {
    int e = errno;
    close(fd);
    return fy_error_set(FY_ERR_IO, "cannot stat %s: %s", path, strerror(e));
  }
  if (!S_ISREG(sb.st_mode)) {
    close(fd);
    return fy_error_set(FY_ERR_IO, "%s is not a regular file", path);
  }
  uint64_t size = (uint64_t)sb.st_size;
  if (size < 8) {
    close(fd);
    return fy_error_set(FY_ERR_FORMAT, "%s: truncated safetensors file (%llu bytes, the header "
                        "length alone takes 8)", path, (unsigned long long)size);
  }
  void *map = mmap(NULL, (size_t)size, PROT_READ, MAP_PRIVATE, fd, 0);
  int e = errno;
  close(fd);
  if (map == MAP_FAILED) return fy_error_set(FY_ERR_IO, "cannot map %s: %s", path, strerror(e));
  f->map = map;
  f->map_size = (size_t)size;

  const unsigned char *p = map;
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | p[i];
  if (hlen > size - 8)
    return fy_error_set(FY_ERR_FORMAT, "%s: header length %llu is larger than the file (%llu bytes)",
                        path, (unsigned long long)hlen, (unsigned long long)size);
  if (hlen > ST_MAX_HEADER || hlen < 2)
    return fy_error_set(FY_ERR_FORMAT, "%s: implausible safetensors header length %llu", path,
                        (unsigned long long)hlen);
  return st_parse_header(st, fi, (const char *)p + 8, (size_t)hlen, p + 8 + hlen,
                         size - 8 - hlen);
}

fy_status fy_safetensors_open(const char *path, fy_safetensors **out) {
  *out = NULL;
  fy_safetensors *st = calloc(1, sizeof *st);
  if (!st) return fy_error_set(FY_ERR_NOMEM, "safetensors: out of memory");
  fy_status rc = st_add_file(st, path);
  if (rc == FY_OK) rc = st_build_index(st);
  if (rc != FY_OK) {
    fy_safetensors_close(st);
    return rc;
  }
  *out = st;
  return FY_OK;
}

static char *st_join(const char *dir, const char *name) {
  size_t a = strlen(dir), b = strlen(name);
  char *s = malloc(a + b + 2);
  if (!s) return NULL;
  memcpy(s, dir, a);
  size_t k = a;
  if (k == 0 || s[k - 1] != '/') s[k++] = '/';
  memcpy(s + k, name, b + 1);
  return s;
}

static fy_status st_open_index(fy_safetensors *st, const char *dir, const char *ipath) {
  char *buf = NULL;
  size_t len = 0;
  FY_TRY(fy_file_read_all(ipath, ST_MAX_HEADER, "an index", &buf, &len));
  json_tokener *tok = json_tokener_new();
  if (!tok) {
    free(buf);
    return fy_error_set(FY_ERR_NOMEM, "out of memory");
  }
  json_object *root = json_tokener_parse_ex(tok, buf, (int)len);
  enum json_tokener_error jerr = json_tokener_get_error(tok);
  size_t end = json_tokener_get_parse_end(tok);
  json_tokener_free(tok);
  free(buf);
  if (!root || jerr != json_tokener_success) {
    json_object_put(root);
    return fy_error_set(FY_ERR_FORMAT, "%s: not valid JSON (%s at byte %zu)", ipath,
                        jerr == json_tokener_continue ? "unexpected end of file"
                                                      : json_tokener_error_desc(jerr), end);
  }
  json_object *wm;
  if (!json_object_is_type(root, json_type_object) ||
      !json_object_object_get_ex(root, "weight_map", &wm) ||
      !json_object_is_type(wm, json_type_object)) {
    json_object_put(root);
    return fy_error_set(FY_ERR_FORMAT, "%s: no \"weight_map\" object", ipath);
  }
  fy_status rc = FY_OK;
  // Distinct shard names, in first-seen order; a model has at most a few hundred shards.
  const char **shards = NULL;
  int nshards = 0;
  json_object_object_foreach(wm, name, fileo) {
    if (!json_object_is_type(fileo, json_type_string)) {
      rc = fy_error_set(FY_ERR_FORMAT, "%s: weight_map[\"%s\"] is not a file name", ipath, name);
      break;
    }
    const char *fn = json_object_get_string(fileo);
    if (!fn[0] || strchr(fn, '/') || strcmp(fn, "..") == 0 || strcmp(fn, ".") == 0) {
      rc = fy_error_set(FY_ERR_FORMAT, "%s: weight_map[\"%s\"] = \"%s\" is not a file in the "
                        "directory", ipath, name, fn);
      break;
    }
    int k = 0;
    while (k < nshards && strcmp(shards[k], fn) != 0) k++;
    if (k == nshards) {
      const char **ns = realloc(shards, (size_t)(nshards + 1) * sizeof *ns);
      if (!ns) {
        rc = fy_error_set(FY_ERR_NOMEM, "out of memory");
        break;
      }
      shards = ns;
      shards[nshards++] = fn;
    }
  }
  for (int k = 0; rc == FY_OK && k < nshards; k++) {
    char *p = st_join(dir, shards[k]);
    if (!p) {
      rc = fy_error_set(FY_ERR_NOMEM, "out of memory");
      break;
    }
    rc = st_add_file(st, p);
    free(p);
    if (rc != FY_OK) fy_error_wrap(rc, "shard listed in %s", ipath);
  }
  if (rc == FY_OK) rc = st_build_index(st);
  if (rc == FY_OK) {
    json_object_object_foreach(wm, name2, fileo2) {
      const struct fy_st_tensor *t = fy_safetensors_find(st, name2);
      const char *fn = json_object_get_string(fileo2);
      int k = 0;
      while (k < nshards && strcmp(shards[k], fn) != 0) k++;
      // Shard k was the k-th file added.
      if (!t || st->file_of[t - st->t] != k) {
        rc = fy_error_set(FY_ERR_FORMAT, "%s names tensor '%s' in %s, but %s does not hold it",
                          ipath, name2, fn, st->files[k].path);
        break;
      }
    }
  }
  free(shards);
  json_object_put(root);
  return rc;
}

const char *fy_safetensors_dir_weights(const char *dir) {
  static const char *const names[] = {ST_INDEX_NAME, ST_SINGLE_NAME, "pytorch_model.bin.index.json",
                                      "pytorch_model.bin"};
  for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
    char *path = st_join(dir, names[i]);
    bool there = path && access(path, F_OK) == 0;
    free(path);
    if (there) return names[i];
  }
  return NULL;
}

fy_status fy_safetensors_open_dir(const char *dir, fy_safetensors **out) {
  *out = NULL;
  fy_safetensors *st = calloc(1, sizeof *st);
  char *ipath = st_join(dir, ST_INDEX_NAME), *spath = st_join(dir, ST_SINGLE_NAME);
  fy_status rc = FY_OK;
  if (!st || !ipath || !spath) {
    rc = fy_error_set(FY_ERR_NOMEM, "safetensors: out of memory");
  } else if (access(ipath, F_OK) == 0) {
    rc = st_open_index(st, dir, ipath);
  } else if (access(spath, F_OK) == 0) {
    rc = st_add_file(st, spath);
    if (rc == FY_OK) rc = st_build_index(st);
  } else {
    // A model saved as PyTorch pickles (older Hugging Face checkpoints) is not read: say how to
    // convert it.
    bool pickles = fy_safetensors_dir_weights(dir) != NULL;  // (no safetensors here: a pickle it is)
    rc = fy_error_set(FY_ERR_NOT_FOUND, "%s holds neither %s nor %s%s", dir, ST_INDEX_NAME, ST_SINGLE_NAME,
                      pickles ? " (its pytorch_model.bin files are PyTorch pickles, which ferry does not read: "
                                "python3 tools/convert.py DIR OUT writes the safetensors files)" : "");
  }
  free(ipath);
  free(spath);
  if (rc != FY_OK) {
    fy_safetensors_close(st);
    return rc;
  }
  *out = st;
  return FY_OK;
}

// ---- writing ----

struct st_pair {
  const char *name;
  int shard;
};

static int st_pair_cmp(const void *a, const void *b) {
  return strcmp(((const struct st_pair *)a)->name, ((const struct st_pair *)b)->name);
}

// After a new layout is in place, removes the files of an earlier one (as save_pretrained does),
// so that open_dir never mixes an old index with new weights: the index and every shard when the
// new layout is one file; model.safetensors and shards of another count when it is sharded.
static void st_remove_stale(const char *dir, int nshards) {
  char *p = st_join(dir, nshards ? ST_SINGLE_NAME : ST_INDEX_NAME);
  if (p) unlink(p);
  free(p);
  DIR *d = opendir(dir);
  if (!d) return;
  struct dirent *de;
  while ((de = readdir(d))) {
    int a, b, used = 0;
    if (strlen(de->d_name) != 32 ||
        sscanf(de->d_name, "model-%5d-of-%5d.safetensors%n", &a, &b, &used) != 2 || used != 32)
      continue;
    if (nshards && b == nshards) continue;
    char *q = st_join(dir, de->d_name);
    if (q) unlink(q);
    free(q);
  }
  closedir(d);
}

static fy_status st_check_tensor(const struct fy_st_tensor *t, int i, bool need_data) {
  if (!t->name || !t->name[0])
    return fy_error_set(FY_ERR_INVALID, "safetensors write: tensor %d has no name", i);
  if (strcmp(t->name, "__metadata__") == 0)
    return fy_error_set(FY_ERR_INVALID, "safetensors write: '__metadata__' is not a tensor name");
  if ((unsigned)t->dtype > FY_U8)
    return fy_error_set(FY_ERR_INVALID, "safetensors write: tensor '%s' has an invalid dtype", t->name);
  if (t->rank < 0 || t->rank > FY_MAX_RANK)
    return fy_error_set(FY_ERR_INVALID, "safetensors write: tensor '%s' has rank %d", t->name, t->rank);
  uint64_t numel = 1;
  for (int d = 0; d < t->rank; d++) {
    if (t->shape[d] < 0 || __builtin_mul_overflow(numel, (uint64_t)t->shape[d], &numel))
      return fy_error_set(FY_ERR_INVALID, "safetensors write: tensor '%s' has a bad shape", t->name);
  }
  uint64_t nb;
  if (__builtin_mul_overflow(numel, (uint64_t)fy_dtype_size(t->dtype), &nb) || nb != t->nbytes)
    return fy_error_set(FY_ERR_INVALID, "safetensors write: tensor '%s' has nbytes %zu, its shape "
                        "and dtype need %llu", t->name, t->nbytes, (unsigned long long)nb);
  if (need_data && t->nbytes && !t->data)
    return fy_error_set(FY_ERR_INVALID, "safetensors write: tensor '%s' has no data", t->name);
  return FY_OK;
}

// The header of a file holding tensors[0..n) (8-byte length, JSON padded to 8) into *hdr
// (malloc'd, *hlen bytes), and each tensor's data offset from the end of the header into begin[].
static fy_status st_header(const struct fy_st_tensor *tensors, int n, const char *const *metadata,
                           unsigned char **hdr_out, size_t *hlen_out, uint64_t *begin) {
  fy_status rc = FY_OK;
  json_object *root = json_object_new_object();
  if (!root) return fy_error_set(FY_ERR_NOMEM, "out of memory");
  if (metadata) {
    json_object *md = json_object_new_object();
    if (!md) {
      rc = fy_error_set(FY_ERR_NOMEM, "out of memory");
      goto done;
    }
    json_object_object_add(root, "__metadata__", md);
    for (int i = 0; metadata[i]; i += 2) {
      if (!metadata[i + 1]) {
        rc = fy_error_set(FY_ERR_INVALID, "safetensors write: metadata key '%s' has no value",
                          metadata[i]);
        goto done;
      }
      json_object_object_add(md, metadata[i], json_object_new_string(metadata[i + 1]));
    }
  }
  // Data in order of decreasing element size (as the safetensors library does): with the header
  // padded to 8, every tensor is then aligned to its element size in the mapping.
  uint64_t off = 0;
  for (size_t es = 8; es >= 1; es /= 2)
    for (int i = 0; i < n; i++) {
      if (fy_dtype_size(tensors[i].dtype) != es) continue;
      begin[i] = off;
      off += tensors[i].nbytes;
    }
  for (int i = 0; i < n; i++) {
    const struct fy_st_tensor *t = &tensors[i];
    if (json_object_object_get_ex(root, t->name, NULL)) {
      rc = fy_error_set(FY_ERR_INVALID, "safetensors write: tensor name '%s' appears twice", t->name);
      goto done;
    }
    json_object *e = json_object_new_object(), *shape = json_object_new_array(),
                *offs = json_object_new_array();
    if (!e || !shape || !offs) {
      json_object_put(e);
      json_object_put(shape);
      json_object_put(offs);
      rc = fy_error_set(FY_ERR_NOMEM, "out of memory");
      goto done;
    }
    json_object_object_add(e, "dtype", json_object_new_string(fy_dtype_safetensors_name(t->dtype)));
    for (int d = 0; d < t->rank; d++) json_object_array_add(shape, json_object_new_int64(t->shape[d]));
    json_object_object_add(e, "shape", shape);
    json_object_array_add(offs, json_object_new_int64((int64_t)begin[i]));
    json_object_array_add(offs, json_object_new_int64((int64_t)(begin[i] + t->nbytes)));
    json_object_object_add(e, "data_offsets", offs);
    json_object_object_add(root, t->name, e);
  }
  size_t jlen;
  const char *js = json_object_to_json_string_length(
      root, JSON_C_TO_STRING_PLAIN | JSON_C_TO_STRING_NOSLASHESCAPE, &jlen);
  if (!js) {
    rc = fy_error_set(FY_ERR_NOMEM, "out of memory");
    goto done;
  }
  // Pad with spaces so that the data starts 8-byte aligned, as the safetensors library does.
  size_t hlen = (jlen + 7) & ~(size_t)7;
  unsigned char *hdr = malloc(8 + hlen);
  if (!hdr) {
    rc = fy_error_set(FY_ERR_NOMEM, "out of memory");
    goto done;
  }
  for (int i = 0; i < 8; i++) hdr[i] = (unsigned char)((uint64_t)hlen >> (8 * i));
  memcpy(hdr + 8, js, jlen);
  memset(hdr + 8 + jlen, ' ', hlen - jlen);
  *hdr_out = hdr;
  *hlen_out = 8 + hlen;
done:
  json_object_put(root);
  return rc;
}

// One file of a writer: a temporary file next to its final name until commit.
struct st_out {
  char *path, *tmp;
  int fd;
};

struct fy_st_writer {
  struct st_out *files;
  int nfiles;
  int n;
  char **names;       // copies, for messages and the index
  int *file_of;       // tensor -> file
  uint64_t *at;       // tensor -> first byte of its data in its file
  size_t *nbytes, *got;  // tensor -> its size, the bytes put so far
  char *dir;          // a model directory, or NULL for one file
  bool sharded;       // the directory's files are shards listed in an index
};

void fy_st_writer_abort(fy_st_writer *w) {
  if (!w) return;
  for (int f = 0; f < w->nfiles; f++) {
    if (w->files[f].tmp) fy_file_temp_discard(w->files[f].tmp, w->files[f].fd);
    free(w->files[f].path);
  }
  for (int i = 0; w->names && i < w->n; i++) free(w->names[i]);
  free(w->names);
  free(w->files);
  free(w->file_of);
  free(w->at);
  free(w->nbytes);
  free(w->got);
  free(w->dir);
  free(w);
}

static fy_status st_writer_new(const struct fy_st_tensor *tensors, int n, int nfiles, fy_st_writer **out) {
  if (n < 0 || (n > 0 && !tensors))
    return fy_error_set(FY_ERR_INVALID, "safetensors write: bad tensor list");
  for (int i = 0; i < n; i++) FY_TRY(st_check_tensor(&tensors[i], i, false));
  fy_st_writer *w = calloc(1, sizeof *w);
  size_t k = n ? (size_t)n : 1;
  if (!w || !(w->files = calloc((size_t)nfiles, sizeof *w->files)) || !(w->names = calloc(k, sizeof *w->names)) ||
      !(w->file_of = calloc(k, sizeof *w->file_of)) || !(w->at = calloc(k, sizeof *w->at)) ||
      !(w->nbytes = calloc(k, sizeof *w->nbytes)) || !(w->got = calloc(k, sizeof *w->got))) {
    fy_st_writer_abort(w);
    return fy_error_set(FY_ERR_NOMEM, "out of memory");
  }
  w->nfiles = nfiles;
  w->n = n;
  for (int i = 0; i < n; i++) {
    w->nbytes[i] = tensors[i].nbytes;
    if (!(w->names[i] = strdup(tensors[i].name))) {
      fy_st_writer_abort(w);
      return fy_error_set(FY_ERR_NOMEM, "out of memory");
    }
  }
  *out = w;
  return FY_OK;
}

// File f at path holds tensors [first, first + m): its header goes out now, at the file's start.
static fy_status st_writer_file(fy_st_writer *w, int f, const char *path, const struct fy_st_tensor *tensors,
                                int first, int m, const char *const *metadata) {
  struct st_out *o = &w->files[f];
  if (!(o->path = strdup(path))) return fy_error_set(FY_ERR_NOMEM, "out of memory");
  unsigned char *hdr = NULL;
  size_t hlen = 0;
  FY_TRY(st_header(tensors + first, m, metadata, &hdr, &hlen, w->at + first));
  uint64_t total = hlen;
  for (int i = first; i < first + m; i++) {
    w->at[i] += hlen;
    w->file_of[i] = f;
    total += tensors[i].nbytes;
  }
  fy_status rc = fy_file_temp_create(path, &o->tmp, &o->fd);
  if (rc == FY_OK) rc = fy_file_pwrite_all(o->fd, hdr, hlen, 0, o->tmp);
  // The file's blocks are reserved at once (fallocate; where the file system cannot, the file
  // only takes its size): a full disk shows here, before a checkpoint gathered chunk by chunk
  // has done its work, rather than halfway through.
  if (rc == FY_OK && fallocate(o->fd, 0, 0, (off_t)total) != 0 &&
      !((errno == EOPNOTSUPP || errno == ENOSYS) && ftruncate(o->fd, (off_t)total) == 0))
    rc = fy_error_set(FY_ERR_IO, "cannot reserve %llu bytes for %s: %s", (unsigned long long)total, o->tmp,
                      strerror(errno));
  free(hdr);
  return rc;
}

fy_status fy_st_writer_open(const char *path, const struct fy_st_tensor *tensors, int n,
                            const char *const *metadata, fy_st_writer **out) {
  fy_st_writer *w = NULL;
  FY_TRY(st_writer_new(tensors, n, 1, &w));
  fy_status rc = st_writer_file(w, 0, path, tensors, 0, n, metadata);
  if (rc != FY_OK) {
    fy_st_writer_abort(w);
    return rc;
  }
  *out = w;
  return FY_OK;
}

fy_status fy_st_writer_open_dir(const char *dir, const struct fy_st_tensor *tensors, int n,
                                size_t max_shard_bytes, fy_st_writer **out) {
  static const char *const md[] = {"format", "pt", NULL};
  if (n < 0 || (n > 0 && !tensors))
    return fy_error_set(FY_ERR_INVALID, "safetensors write: bad tensor list");
  if (mkdir(dir, 0755) != 0 && errno != EEXIST)
    return fy_error_set(FY_ERR_IO, "cannot create directory %s: %s", dir, strerror(errno));
  uint64_t total = 0;
  for (int i = 0; i < n; i++) total += tensors[i].nbytes;
  // Sharded when the total is over the limit; greedy, in the given order, as transformers'
  // shard_checkpoint: a tensor larger than the limit gets a shard of its own.
  const bool sharded = max_shard_bytes && total > max_shard_bytes;
  int *first = malloc(((size_t)n + 2) * sizeof *first);  // shard s holds tensors [first[s], first[s + 1])
  if (!first) return fy_error_set(FY_ERR_NOMEM, "out of memory");
  int nshards = 1;
  first[0] = 0;
  size_t cur = 0;
  for (int i = 0; i < n; i++) {
    if (sharded && cur > 0 && cur + tensors[i].nbytes > max_shard_bytes) first[nshards++] = i, cur = 0;
    cur += tensors[i].nbytes;
  }
  first[nshards] = n;
  fy_st_writer *w = NULL;
  fy_status rc = nshards > 99999 ? fy_error_set(FY_ERR_INVALID, "safetensors write: %d shards are too many; raise the "
                                                "shard size", nshards)
                                 : st_writer_new(tensors, n, nshards, &w);
  if (rc == FY_OK) {
    w->sharded = sharded;
    if (!(w->dir = strdup(dir))) rc = fy_error_set(FY_ERR_NOMEM, "out of memory");
  }
  char fname[64];
  for (int s = 0; rc == FY_OK && s < nshards; s++) {
    if (sharded) snprintf(fname, sizeof fname, "model-%05d-of-%05d.safetensors", s + 1, nshards);
    else snprintf(fname, sizeof fname, "%s", ST_SINGLE_NAME);
    char *p = st_join(dir, fname);
    rc = p ? st_writer_file(w, s, p, tensors, first[s], first[s + 1] - first[s], md)
           : fy_error_set(FY_ERR_NOMEM, "out of memory");
    free(p);
  }
  free(first);
  if (rc != FY_OK) {
    fy_st_writer_abort(w);
    return rc;
  }
  *out = w;
  return FY_OK;
}

fy_status fy_st_writer_put(fy_st_writer *w, int i, size_t off, const void *data, size_t n) {
  if (i < 0 || i >= w->n || off > w->nbytes[i] || n > w->nbytes[i] - off || w->got[i] + n > w->nbytes[i])
    return fy_error_set(FY_ERR_INVALID, "safetensors write: bytes [%zu, %zu) of tensor %d are outside it or written "
                        "twice", off, off + n, i);
  if (n == 0) return FY_OK;
  struct st_out *o = &w->files[w->file_of[i]];
  FY_TRY(fy_file_pwrite_all(o->fd, data, n, w->at[i] + off, o->tmp));
  w->got[i] += n;
  return FY_OK;
}

// The index of a sharded directory: every tensor's file, the names sorted (as transformers writes it).
static fy_status st_write_index(fy_st_writer *w) {
  fy_status rc = FY_OK;
  uint64_t total = 0;
  struct st_pair *pairs = malloc((w->n ? (size_t)w->n : 1) * sizeof *pairs);
  json_object *root = json_object_new_object(), *meta = json_object_new_object(), *wm = json_object_new_object();
  char *ip = st_join(w->dir, ST_INDEX_NAME);
  if (!pairs || !root || !meta || !wm || !ip) {
    json_object_put(meta);
    json_object_put(wm);
    rc = fy_error_set(FY_ERR_NOMEM, "out of memory");
    goto done;
  }
  for (int i = 0; i < w->n; i++) total += w->nbytes[i];
  json_object_object_add(meta, "total_size", json_object_new_int64((int64_t)total));
  json_object_object_add(root, "metadata", meta);
  json_object_object_add(root, "weight_map", wm);
  for (int i = 0; i < w->n; i++) pairs[i] = (struct st_pair){w->names[i], w->file_of[i]};
  qsort(pairs, (size_t)w->n, sizeof *pairs, st_pair_cmp);
  char fname[64];
  for (int i = 0; i < w->n; i++) {
    snprintf(fname, sizeof fname, "model-%05d-of-%05d.safetensors", pairs[i].shard + 1, w->nfiles);
    json_object_object_add(wm, pairs[i].name, json_object_new_string(fname));
  }
  size_t jlen;
  const char *js = json_object_to_json_string_length(
      root, JSON_C_TO_STRING_PRETTY | JSON_C_TO_STRING_SPACED | JSON_C_TO_STRING_NOSLASHESCAPE, &jlen);
  if (!js) {
    rc = fy_error_set(FY_ERR_NOMEM, "out of memory");
    goto done;
  }
  struct fy_file_piece pc[2] = {{js, jlen}, {"\n", 1}};
  rc = fy_file_write_atomic(ip, pc, 2);
done:
  free(ip);
  json_object_put(root);
  free(pairs);
  return rc;
}

fy_status fy_st_writer_commit(fy_st_writer *w) {
  fy_status rc = FY_OK;
  for (int i = 0; rc == FY_OK && i < w->n; i++)
    if (w->got[i] != w->nbytes[i])
      rc = fy_error_set(FY_ERR_INVALID, "safetensors write: tensor '%s' got %zu of its %zu bytes", w->names[i],
                        w->got[i], w->nbytes[i]);
  for (int f = 0; rc == FY_OK && f < w->nfiles; f++) {
    struct st_out *o = &w->files[f];
    rc = fy_file_temp_commit(o->path, o->tmp, o->fd);
    o->tmp = NULL;  // committed or removed
  }
  if (rc == FY_OK && w->sharded) rc = st_write_index(w);
  if (rc == FY_OK && w->dir) st_remove_stale(w->dir, w->sharded ? w->nfiles : 0);
  fy_st_writer_abort(w);  // frees (the files are committed or removed)
  return rc;
}

// Every tensor whole from its data pointer (checked by the caller).
static fy_status st_put_all(fy_st_writer *w, const struct fy_st_tensor *tensors, int n) {
  for (int i = 0; i < n; i++) {
    fy_status rc = fy_st_writer_put(w, i, 0, tensors[i].data, tensors[i].nbytes);
    if (rc != FY_OK) {
      fy_st_writer_abort(w);
      return rc;
    }
  }
  return fy_st_writer_commit(w);
}

fy_status fy_safetensors_write(const char *path, const struct fy_st_tensor *tensors, int n,
                               const char *const *metadata) {
  for (int i = 0; tensors && i < n; i++) FY_TRY(st_check_tensor(&tensors[i], i, true));
  fy_st_writer *w = NULL;
  FY_TRY(fy_st_writer_open(path, tensors, n, metadata, &w));
  return st_put_all(w, tensors, n);
}

fy_status fy_safetensors_write_dir(const char *dir, const struct fy_st_tensor *tensors, int n,
                                   size_t max_shard_bytes) {
  for (int i = 0; tensors && i < n; i++) FY_TRY(st_check_tensor(&tensors[i], i, true));
  fy_st_writer *w = NULL;
  FY_TRY(fy_st_writer_open_dir(dir, tensors, n, max_shard_bytes, &w));
  return st_put_all(w, tensors, n);
}

void fy_safetensors_done_with(const void *p, size_t n) {
  uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
  uintptr_t a = ((uintptr_t)p + page - 1) / page * page, b = ((uintptr_t)p + n) / page * page;
  if (b > a) (void)madvise((void *)a, b - a, MADV_DONTNEED);
}
