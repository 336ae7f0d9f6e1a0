#include "runtime/checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <json-c/json.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "core/clock.h"
#include "core/fileio.h"
#include "core/log.h"
#include "core/safetensors.h"
#include "memory/uv_pool.h"
#include "ops/ops.h"
#include "runtime/comm.h"

#define MAX_SHARD_BYTES ((size_t)5 << 30)

// Where a write takes the state from: whole flat buffers, or pieces a fill hands out in order.
struct ckpt_source {
  const float *params, *m, *v;
  fy_ckpt_fill_fn fill;
  void *ctx;
  int64_t piece;
  struct fy_ckpt_meta meta;
};

struct fy_ckpt_writer {
  char root[3072];
  int keep;
  const struct fy_model *model;
  struct fy_ckpt_snapshot snap;    // the writer's own buffers (written asynchronously)
  struct ckpt_source src;          // what the write in progress reads
  char **m_names, **v_names;      // exp_avg.NAME, exp_avg_sq.NAME
  char **ms_names, **vs_names;    // 8-bit state: exp_avg_absmax.NAME, exp_avg_sq_absmax.NAME
  char **phase_keys, **phase_vals;  // 8-bit state: the metadata of parameters not at a block start
  int64_t *go, *glen;             // each parameter's offset in its group, the group's elements
  struct fy_uv_pool *pool;
  struct fy_uv_job job;
  fy_status st;  // of the last write (read after waiting)
  char msg[1024];
  double seconds, hash_seconds;
};

// ---- files ----

static fy_status fsync_path(const char *path, bool dir) {
  int fd = open(path, dir ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd < 0) return fy_error_set(FY_ERR_IO, "cannot open %s to sync it: %s", path, strerror(errno));
  int rc = fsync(fd);
  int err = errno;
  close(fd);
  if (rc != 0) return fy_error_set(FY_ERR_IO, "fsync %s: %s", path, strerror(err));
  return FY_OK;
}

static fy_status remove_tree(const char *path) {
  DIR *d = opendir(path);
  if (!d) return errno == ENOENT ? FY_OK : fy_error_set(FY_ERR_IO, "cannot open %s: %s", path, strerror(errno));
  struct dirent *e;
  char p[4200];
  while ((e = readdir(d))) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
    snprintf(p, sizeof p, "%s/%s", path, e->d_name);
    struct stat sb;
    if (lstat(p, &sb) == 0 && S_ISDIR(sb.st_mode)) remove_tree(p);
    else unlink(p);
  }
  closedir(d);
  if (rmdir(path) != 0) return fy_error_set(FY_ERR_IO, "cannot remove %s: %s", path, strerror(errno));
  return FY_OK;
}

static fy_status fsync_dir_files(const char *dir) {
  DIR *d = opendir(dir);
  if (!d) return fy_error_set(FY_ERR_IO, "cannot open %s: %s", dir, strerror(errno));
  struct dirent *e;
  char p[4200];
  fy_status st = FY_OK;
  while (st == FY_OK && (e = readdir(d))) {
    if (e->d_name[0] == '.') continue;
    snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
    st = fsync_path(p, false);
  }
  closedir(d);
  return st == FY_OK ? fsync_path(dir, true) : st;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

// ---- checksums ----
//
// Once a step directory's files are written and fsync'd, each is read back and hashed (XXH3-128,
// one streaming pass), and the sums go into FY_CKPT_SUMS, the last file written, in xxhsum's
// format: "<32 hex digits>  <file name>" a line, so `xxhsum -c checksums.xxh128` checks a
// directory by hand. trainer.json, written before it, names the list: a checkpoint that lost its
// list is told apart from one written before checksums. Reading a checkpoint checks every listed
// file first: a byte flipped on disk, which no parser notices, is refused naming the file.

#define SUMS_MAX_BYTES ((size_t)1 << 20)
#define HASH_BLOCK ((size_t)8 << 20)

// XXH3-128 of a file read in one streaming pass, as xxhsum prints it (32 hex digits).
static fy_status hash_file(const char *path, char hex[33]) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return fy_error_set(errno == ENOENT ? FY_ERR_NOT_FOUND : FY_ERR_IO, "cannot open %s: %s", path, strerror(errno));
  posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  unsigned char *buf = malloc(HASH_BLOCK);
  XXH3_state_t *h = XXH3_createState();
  fy_status st = buf && h ? FY_OK : fy_error_set(FY_ERR_NOMEM, "cannot allocate a buffer to hash %s", path);
  if (st == FY_OK) XXH3_128bits_reset(h);
  while (st == FY_OK) {
    ssize_t n = read(fd, buf, HASH_BLOCK);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) st = fy_error_set(FY_ERR_IO, "reading %s: %s", path, strerror(errno));
    if (n <= 0) break;
    XXH3_128bits_update(h, buf, (size_t)n);
  }
  if (st == FY_OK) {
    XXH128_canonical_t c;  // (big-endian: xxhsum's spelling)
    XXH128_canonicalFromHash(&c, XXH3_128bits_digest(h));
    for (int i = 0; i < 16; i++) snprintf(hex + 2 * i, 3, "%02x", c.digest[i]);
  }
  XXH3_freeState(h);
  free(buf);
  close(fd);
  return st;
}

// The names of dir's files that the list covers, sorted: every regular file but the list itself
// and hidden ones (a temporary file of fy_file_write_atomic is never left in a complete directory).
static fy_status list_files(const char *dir, char ***out, int *n_out) {
  *out = NULL;
  *n_out = 0;
  DIR *d = opendir(dir);
  if (!d) return fy_error_set(FY_ERR_IO, "cannot open %s: %s", dir, strerror(errno));
  char **names = NULL, p[4200];
  int n = 0, cap = 0;
  fy_status st = FY_OK;
  for (struct dirent *e; st == FY_OK && (e = readdir(d));) {
    struct stat sb;
    snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
    if (e->d_name[0] == '.' || strcmp(e->d_name, FY_CKPT_SUMS) == 0 || stat(p, &sb) != 0 || !S_ISREG(sb.st_mode))
      continue;
    if (n == cap) {
      char **grown = realloc(names, (size_t)(cap = cap ? 2 * cap : 16) * sizeof *names);
      if (!grown) {
        st = fy_error_set(FY_ERR_NOMEM, "out of memory");
        break;
      }
      names = grown;
    }
    if (!(names[n] = strdup(e->d_name))) st = fy_error_set(FY_ERR_NOMEM, "out of memory");
    else n++;
  }
  closedir(d);
  if (names) qsort(names, (size_t)n, sizeof *names, cmp_str);
  *out = names;
  *n_out = n;
  return st;
}

static void free_names(char **names, int n) {
  for (int i = 0; i < n; i++) free(names[i]);
  free(names);
}

// Hashes every file of dir (written and fsync'd) and writes the list, FY_CKPT_SUMS, atomically.
static fy_status write_sums(const char *dir, double *seconds) {
  double t0 = fy_now();
  char **names, p[4200];
  int n;
  fy_status st = list_files(dir, &names, &n);
  size_t cap = (size_t)n * 300 + 1, len = 0;
  char *text = st == FY_OK ? malloc(cap) : NULL;
  if (st == FY_OK && !text) st = fy_error_set(FY_ERR_NOMEM, "out of memory");
  for (int i = 0; st == FY_OK && i < n; i++) {
    char hex[33];
    snprintf(p, sizeof p, "%s/%s", dir, names[i]);
    st = hash_file(p, hex);
    if (st == FY_OK) len += (size_t)snprintf(text + len, cap - len, "%s  %s\n", hex, names[i]);
  }
  snprintf(p, sizeof p, "%s/%s", dir, FY_CKPT_SUMS);
  if (st == FY_OK) st = fy_file_write_atomic(p, &(struct fy_file_piece){text, len}, 1);
  free(text);
  free_names(names, n);
  *seconds = fy_now() - t0;
  return st;
}

struct sum_entry {
  char name[256];
  char hex[33];
};

// dir's list of sums: *n = -1 when it has none. Every line must be "<32 hex digits>  <name>" with
// a plain file name (no directory part): anything else is a damaged list.
static fy_status read_sums(const char *dir, struct sum_entry **out, int *n_out) {
  char p[4200];
  snprintf(p, sizeof p, "%s/%s", dir, FY_CKPT_SUMS);
  *out = NULL;
  *n_out = -1;
  FILE *f = fopen(p, "rb");
  if (!f) return errno == ENOENT ? FY_OK : fy_error_set(FY_ERR_IO, "cannot open %s: %s", p, strerror(errno));
  char *text = malloc(SUMS_MAX_BYTES + 1);
  size_t len = text ? fread(text, 1, SUMS_MAX_BYTES + 1, f) : 0;
  bool err = ferror(f);
  fclose(f);
  if (!text) return fy_error_set(FY_ERR_NOMEM, "out of memory");
  fy_status st = FY_OK;
  if (err) st = fy_error_set(FY_ERR_IO, "cannot read %s", p);
  else if (len > SUMS_MAX_BYTES) st = fy_error_set(FY_ERR_FORMAT, "%s is over %zu bytes: not a list of checksums", p, SUMS_MAX_BYTES);
  text[len] = 0;
  int lines = 0;
  for (size_t i = 0; i < len; i++) lines += text[i] == '\n';
  struct sum_entry *e = st == FY_OK ? calloc((size_t)lines + 1, sizeof *e) : NULL;
  if (st == FY_OK && !e) st = fy_error_set(FY_ERR_NOMEM, "out of memory");
  int n = 0;
  for (char *line = text, *next; st == FY_OK && line < text + len; line = next) {
    char *nl = memchr(line, '\n', (size_t)(text + len - line));
    if (!nl) {
      st = fy_error_set(FY_ERR_FORMAT, "%s: line %d is cut short (no end of line)", p, n + 1);
      break;
    }
    *nl = 0;
    next = nl + 1;
    bool ok = strlen(line) > 34 && strlen(line + 34) < sizeof e[n].name && line[32] == ' ' && line[33] == ' ';
    for (int i = 0; ok && i < 32; i++) ok = strchr("0123456789abcdef", line[i]) != NULL && line[i];
    const char *name = line + 34;
    ok = ok && name[0] != '.' && !strchr(name, '/');
    if (!ok) {
      st = fy_error_set(FY_ERR_FORMAT, "%s: line %d is not \"<32 hex digits>  <file name>\"", p, n + 1);
      break;
    }
    memcpy(e[n].hex, line, 32);
    snprintf(e[n].name, sizeof e[n].name, "%s", name);
    n++;
  }
  if (st == FY_OK && n == 0) st = fy_error_set(FY_ERR_FORMAT, "%s lists no files", p);
  free(text);
  if (st != FY_OK) {
    free(e);
    return st;
  }
  *out = e;
  *n_out = n;
  return FY_OK;
}

// Whether dir's trainer.json names a list of sums (a checkpoint written with checksums).
static bool sums_declared(const char *dir) {
  char p[4200];
  snprintf(p, sizeof p, "%s/trainer.json", dir);
  json_object *o = json_object_from_file(p), *v;
  bool yes = o && json_object_is_type(o, json_type_object) && json_object_object_get_ex(o, "checksums", &v);
  json_object_put(o);
  return yes;
}

// A file as it stands: a directory whose files all stand as they did when they were checked is not
// hashed again in this process (fy_ckpt_load, fy_ckpt_adam_open and --resume's early check each
// ask; a write replaces files, new inodes and times).
struct file_id {
  dev_t dev;
  ino_t ino;
  off_t size;
  struct timespec mtime, ctime;
};

static struct file_id file_id_of(const char *dir, const char *name) {
  char p[4200];
  struct stat sb;
  snprintf(p, sizeof p, "%s/%s", dir, name);
  if (stat(p, &sb) != 0) return (struct file_id){0};
  return (struct file_id){sb.st_dev, sb.st_ino, sb.st_size, sb.st_mtim, sb.st_ctim};
}

static bool same_id(const struct file_id *a, const struct file_id *b) {
  return a->dev == b->dev && a->ino == b->ino && a->size == b->size && a->mtime.tv_sec == b->mtime.tv_sec &&
         a->mtime.tv_nsec == b->mtime.tv_nsec && a->ctime.tv_sec == b->ctime.tv_sec && a->ctime.tv_nsec == b->ctime.tv_nsec;
}

#define CHECKED_MAX 8
static struct {
  pthread_mutex_t lock;  // held while a directory is checked: ranks that share a process hash it once
  struct checked {
    char path[PATH_MAX];
    int n;                // files: the list, then those it names (the list absent: trainer.json)
    struct file_id *ids;
    bool noted;           // (no checksums) the note was given
  } e[CHECKED_MAX];
  int next;
} checked = {.lock = PTHREAD_MUTEX_INITIALIZER};

// The identities of the list and the files it names (n < 0: no list; trainer.json stands in).
static struct file_id *ids_of(const char *dir, const struct sum_entry *e, int n) {
  struct file_id *ids = calloc(n < 0 ? 2 : (size_t)n + 1, sizeof *ids);
  if (!ids) return NULL;
  ids[0] = file_id_of(dir, FY_CKPT_SUMS);
  if (n < 0) ids[1] = file_id_of(dir, "trainer.json");
  for (int i = 0; i < n; i++) ids[i + 1] = file_id_of(dir, e[i].name);
  return ids;
}

static struct checked *checked_find(const char *path, const struct file_id *ids, int n) {
  for (int i = 0; ids && i < CHECKED_MAX; i++) {
    struct checked *c = &checked.e[i];
    if (!c->ids || c->n != n || strcmp(c->path, path) != 0) continue;
    bool same = true;
    for (int k = 0; same && k < n; k++) same = same_id(&c->ids[k], &ids[k]);
    if (same) return c;
  }
  return NULL;
}

// Remembers a checked directory (takes ids).
static struct checked *checked_add(const char *path, struct file_id *ids, int n) {
  if (!ids) return NULL;
  struct checked *c = &checked.e[checked.next];
  checked.next = (checked.next + 1) % CHECKED_MAX;
  free(c->ids);
  snprintf(c->path, sizeof c->path, "%s", path);
  c->ids = ids;
  c->n = n;
  c->noted = false;
  return c;
}

// Checks dir's files against its list (the caller holds checked.lock). *sums: whether it has one;
// without (a checkpoint from before checksums) a note unless quiet.
static fy_status verify_locked(const char *dir, bool quiet, bool *sums) {
  char real[PATH_MAX], p[4200];
  *sums = false;
  if (!realpath(dir, real)) return fy_error_set(FY_ERR_NOT_FOUND, "%s: %s", dir, strerror(errno));
  struct sum_entry *e;
  int n;
  FY_TRY(read_sums(dir, &e, &n));
  int nid = n < 0 ? 2 : n + 1;
  struct file_id *ids = ids_of(dir, e, n);
  struct checked *c = checked_find(real, ids, nid);
  fy_status st = FY_OK;
  if (n < 0) {
    if (!c && sums_declared(dir)) {
      st = fy_error_set(FY_ERR_NOT_FOUND, "%s/%s is missing, though its trainer.json says it was written: the "
                        "checkpoint is damaged", dir, FY_CKPT_SUMS);
    } else {
      if (!c) {
        c = checked_add(real, ids, nid);
        ids = NULL;
      }
      if (!quiet && (!c || !c->noted) && fy_comm_launch_rank() == 0) {  // (rank 0 speaks for all)
        fy_log_info("checkpoint %s carries no checksums (written by an older ferry): its files are not checked", dir);
        if (c) c->noted = true;
      }
    }
  } else if (!c) {
    *sums = true;
    for (int i = 0; st == FY_OK && i < n; i++) {
      char hex[33];
      snprintf(p, sizeof p, "%s/%s", dir, e[i].name);
      st = hash_file(p, hex);
      if (st == FY_ERR_NOT_FOUND)
        st = fy_error_set(FY_ERR_NOT_FOUND, "%s is missing, though %s lists it: the checkpoint is damaged", p, FY_CKPT_SUMS);
      else if (st == FY_OK && memcmp(hex, e[i].hex, 32) != 0)
        st = fy_error_set(FY_ERR_FORMAT, "%s is damaged: its contents do not match the checksum written with it "
                          "(XXH3-128, in %s)", p, FY_CKPT_SUMS);
    }
    if (st == FY_OK) {
      checked_add(real, ids, nid);
      ids = NULL;
    }
  } else {
    *sums = true;
  }
  free(ids);
  free(e);
  return st;
}

static fy_status verify_dir(const char *dir, bool quiet, bool *sums) {
  pthread_mutex_lock(&checked.lock);
  fy_status st = verify_locked(dir, quiet, sums);
  pthread_mutex_unlock(&checked.lock);
  return st;
}

// The step number of a step directory's name ("step-00000010"), or -1.
static int64_t step_of(const char *name) {
  if (strncmp(name, "step-", 5) != 0 || name[5] < '0' || name[5] > '9') return -1;
  char *end;
  long long s = strtoll(name + 5, &end, 10);
  return *end ? -1 : s;
}

// The newest complete checkpoint beside step directory dir (in its root) of an earlier step whose
// files check (into out; "" when there is none). *unchecked: it carries no checksums.
static void previous_intact(const char *dir, char *root, size_t nroot, char *out, size_t n, bool *unchecked) {
  out[0] = 0;
  *unchecked = false;
  snprintf(root, nroot, "%s", dir);
  size_t len = strlen(root);
  while (len > 1 && root[len - 1] == '/') root[--len] = 0;
  char *slash = strrchr(root, '/'), base[256];
  snprintf(base, sizeof base, "%s", slash ? slash + 1 : root);
  if (slash == root) root[1] = 0;
  else if (slash) *slash = 0;
  else snprintf(root, nroot, ".");
  int64_t mine = step_of(base);
  if (mine < 0) return;
  DIR *d = opendir(root);
  if (!d) return;
  int64_t steps[4096];
  int k = 0;
  for (struct dirent *e; (e = readdir(d)) && k < 4096;) {
    int64_t s = step_of(e->d_name);
    if (s >= 0 && s < mine) steps[k++] = s;
  }
  closedir(d);
  while (k > 0) {  // newest first
    int best = 0;
    for (int i = 1; i < k; i++)
      if (steps[i] > steps[best]) best = i;
    char cand[4200], p[4300];
    snprintf(cand, sizeof cand, "%s/step-%08lld", root, (long long)steps[best]);
    steps[best] = steps[--k];
    snprintf(p, sizeof p, "%s/trainer.json", cand);
    bool sums;
    if (access(p, R_OK) == 0 && verify_dir(cand, true, &sums) == FY_OK) {
      snprintf(out, n, "%s", cand);
      *unchecked = !sums;
      return;
    }
  }
}

fy_status fy_ckpt_verify(const char *dir) {
  bool sums;
  fy_status st = verify_dir(dir, false, &sums);
  if (st == FY_OK || st == FY_ERR_NOMEM) return st;
  char msg[1024], root[4200], prev[4200];
  snprintf(msg, sizeof msg, "%s", fy_error_msg());
  bool unchecked;
  previous_intact(dir, root, sizeof root, prev, sizeof prev, &unchecked);
  if (!prev[0]) return fy_error_set(st, "%s; no earlier complete checkpoint in %s is intact to use instead", msg, root);
  return fy_error_set(st, "%s; the previous complete checkpoint, %s, %s: give that directory instead", msg, prev,
                      unchecked ? "carries no checksums (written by an older ferry)" : "is intact");
}

// ---- AdamW's state as it is stored ----
//
// optimizer.safetensors holds m and v in the run's --optimizer-state format (trainer.json says
// which; the file's __metadata__ "optimizer_state" too, except for fp32, whose file is what it
// always was):
//   fp32  exp_avg.NAME and exp_avg_sq.NAME, F32 tensors of the parameter's shape.
//   bf16  the same names, BF16 tensors (the stored bits).
//   8bit  exp_avg.NAME (I8) and exp_avg_sq.NAME (U8), the codes, one a parameter element in the
//         parameter's shape; exp_avg_absmax.NAME and exp_avg_sq_absmax.NAME (F32, 1-D), the scale
//         (absmax) of every block of FY_Q8_BLOCK elements that holds an element of the parameter,
//         in order. Blocks are counted from the start of the parameter's group, the parameters
//         that one op uses first, laid end to end in the op's order: memory/chunk.c packs a group
//         contiguously and, with 8-bit state, starts every group and every chunk at a multiple
//         of FY_Q8_BLOCK, so each block holds the same elements in every chunk layout, shard and
//         placement, and the training stores these same blocks. Element k of a parameter is in
//         its block (phase + k) / FY_Q8_BLOCK, phase its offset in the group modulo FY_Q8_BLOCK
//         (the __metadata__ "block_offset.NAME" where it is not 0), and reads back as
//         code_value[code] * absmax (ops/ops.h); a block shared by two parameters appears in both.
// The writer is handed the values the run's state reads back as (the snapshot and the pieces are
// f32, whatever the format) and stores them again in the format's blocks: the same format stores
// its values to the same bits (ops/ops.h), so the files hold the run's codes and scales; a
// resume reads the values back and the run stores them in its format (again the same bits; in
// another format, converted). Checkpoints before this held f32 values in every format: they are
// read as fp32 files.

#define Q8_BLOCK_TEXT "256"  // (the metadata's "block")
_Static_assert(FY_Q8_BLOCK == 256, "Q8_BLOCK_TEXT spells FY_Q8_BLOCK");

static enum fy_state_format meta_format(const struct fy_ckpt_meta *meta) {
  enum fy_state_format f = FY_STATE_F32;
  fy_state_format_from_name(meta->optimizer_state, &f);  // ("" reads as fp32)
  return f;
}

// Each parameter's offset in its group (go) and its group's elements (glen), from the graph's ops
// alone (memory/chunk.c's order), so the same in every layout. malloc'd; false when they cannot be.
static bool param_groups(const struct fy_graph *g, int64_t **go_out, int64_t **glen_out) {
  int64_t *go = calloc((size_t)(g->n_params > 0 ? g->n_params : 1), sizeof *go);
  int64_t *glen = calloc((size_t)(g->n_params > 0 ? g->n_params : 1), sizeof *glen);
  if (!go || !glen) {
    free(go);
    free(glen);
    return false;
  }
  for (int o = 0; o < g->n_ops; o++) {
    const struct fy_op *op = &g->ops[o];
    int64_t n = 0;
    for (int k = 0; k < op->n_params; k++) {
      const struct fy_param *p = &g->params[op->params[k]];
      if (p->first_use != o) continue;
      go[op->params[k]] = n;
      n += p->numel;
    }
    for (int k = 0; k < op->n_params; k++)
      if (g->params[op->params[k]].first_use == o) glen[op->params[k]] = n;
  }
  *go_out = go;
  *glen_out = glen;
  return true;
}

double fy_ckpt_bytes_per_param(enum fy_state_format f) {
  return 4.0 + (f == FY_STATE_Q8 ? 2.0 * (1.0 + 4.0 / FY_Q8_BLOCK) : f == FY_STATE_BF16 ? 4.0 : 8.0);
}

// The 8-bit blocks that hold elements [a, b) of a parameter at offset go of its group: j0..j1.
static void q8_block_span(int64_t go, int64_t a, int64_t b, int64_t *j0, int64_t *j1) {
  const int64_t phase = go % FY_Q8_BLOCK;
  *j0 = (phase + a) / FY_Q8_BLOCK;
  *j1 = (phase + b - 1) / FY_Q8_BLOCK;
}

// ---- writing ----

// 8-bit: parameter i's elements [a, b) (its part in [lo, hi), flat holding those elements) as
// codes and the scales of their blocks. A block's values are its group's elements in the flat
// layout (the group is contiguous there); a block must lie inside the piece, as it does when the
// pieces are chunks (groups never cross one). Elements of the group only: the padding after a
// group, whose state is 0 (or NaN in a NaN block, whose elements are NaN too), adds nothing.
static fy_status put_q8(struct fy_ckpt_writer *w, fy_st_writer *adam, int i, int64_t a, int64_t b, int64_t lo,
                        int64_t hi, const float *m, const float *v) {
  const struct fy_param *prm = &w->model->graph->params[i];
  const int64_t go = w->go[i], glen = w->glen[i], gs = prm->offset - go;  // gs: the group's flat start
  int64_t j0, j1;
  q8_block_span(go, a, b, &j0, &j1);
  uint8_t *codes = malloc((size_t)(b - a));
  float *scales = malloc((size_t)(j1 - j0 + 1) * 4);
  fy_status st = codes && scales ? FY_OK : fy_error_set(FY_ERR_NOMEM, "cannot allocate the 8-bit state of %s", prm->name);
  _Alignas(64) uint8_t blk[FY_Q8_BLOCK + 64 + 4];
  for (int k = 0; k < 2 && st == FY_OK; k++) {
    const float *src = k ? v : m;
    for (int64_t j = j0; j <= j1 && st == FY_OK; j++) {
      // The parameter's block j is its group's block go / FY_Q8_BLOCK + j: group elements [b0, b1).
      const int64_t b0 = (go / FY_Q8_BLOCK) * FY_Q8_BLOCK + j * FY_Q8_BLOCK;
      const int64_t b1 = b0 + FY_Q8_BLOCK < glen ? b0 + FY_Q8_BLOCK : glen;
      if (gs + b0 < lo || gs + b1 > hi) {
        st = fy_error_set(FY_ERR_INTERNAL, "checkpoint: an 8-bit block of %s crosses the pieces written", prm->name);
        break;
      }
      const int64_t len = b1 - b0;
      fy_state_encode(FY_STATE_Q8, k ? FY_MOMENT_V : FY_MOMENT_M, blk, src + (gs + b0 - lo), len);
      memcpy(&scales[j - j0], blk + fy_q8_scales_offset(len), 4);
      // The parameter's elements in the block: [max(a, b0 - go), min(b, b1 - go)).
      const int64_t p0 = b0 - go > a ? b0 - go : a, p1 = b1 - go < b ? b1 - go : b;
      memcpy(codes + (p0 - a), blk + (go + p0 - b0), (size_t)(p1 - p0));
    }
    if (st == FY_OK) st = fy_st_writer_put(adam, 4 * i + k, (size_t)a, codes, (size_t)(b - a));
    if (st == FY_OK) st = fy_st_writer_put(adam, 4 * i + 2 + k, (size_t)j0 * 4, scales, (size_t)(j1 - j0 + 1) * 4);
  }
  free(codes);
  free(scales);
  return st;
}

// The AdamW state's part in elements [lo, hi) of the flat layout (m and v hold those elements, the
// values the run's state reads back as), stored in the checkpoint's format.
static fy_status put_adam(struct fy_ckpt_writer *w, fy_st_writer *adam, int64_t lo, int64_t hi, const float *m,
                          const float *v) {
  const struct fy_graph *g = w->model->graph;
  const enum fy_state_format f = meta_format(&w->src.meta);
  int64_t a, b;
  for (int i = 0; i < g->n_params; i++) {
    const struct fy_param *prm = &g->params[i];
    if (!fy_param_part(prm, lo, hi, &a, &b)) continue;
    const size_t at = (size_t)(prm->offset + a - lo), n = (size_t)(b - a);
    if (f == FY_STATE_Q8) {
      FY_TRY(put_q8(w, adam, i, a, b, lo, hi, m, v));
    } else if (f == FY_STATE_BF16) {
      uint16_t *h = malloc(n * 2);
      if (!h) return fy_error_set(FY_ERR_NOMEM, "cannot allocate the bf16 state of %s", prm->name);
      fy_status st = FY_OK;
      for (int k = 0; k < 2 && st == FY_OK; k++) {  // (values of bf16 state: exact in bf16)
        const float *src = (k ? v : m) + at;  // (one thread: a background write runs beside training's)
        for (size_t e = 0; e < n; e++) h[e] = fy_f32_to_bf16(src[e]);
        st = fy_st_writer_put(adam, 2 * i + k, (size_t)a * 2, h, n * 2);
      }
      free(h);
      FY_TRY(st);
    } else {
      FY_TRY(fy_st_writer_put(adam, 2 * i, (size_t)a * 4, m + at, n * 4));
      FY_TRY(fy_st_writer_put(adam, 2 * i + 1, (size_t)a * 4, v + at, n * 4));
    }
  }
  return FY_OK;
}

// The tensors of a step directory: the weights (a Hugging Face model directory, config.json
// included) and the AdamW state.
static fy_status write_tensors(struct fy_ckpt_writer *w, const char *dir) {
  const struct fy_graph *g = w->model->graph;
  const struct ckpt_source *s = &w->src;
  const enum fy_state_format f = meta_format(&s->meta);
  const int per = f == FY_STATE_Q8 ? 4 : 2;  // tensors a parameter (8-bit: the codes, then the scales)
  const enum fy_dtype dt[4] = {f == FY_STATE_Q8 ? FY_I8 : f == FY_STATE_BF16 ? FY_BF16 : FY_F32,
                               f == FY_STATE_Q8 ? FY_U8 : f == FY_STATE_BF16 ? FY_BF16 : FY_F32, FY_F32, FY_F32};
  struct fy_st_tensor *ts = calloc((size_t)g->n_params * (size_t)per, sizeof *ts);
  // The file says its format (fp32 files stay what they were: no metadata), and 8-bit files where
  // a parameter does not start a block (put_q8).
  const char **md = calloc((size_t)g->n_params * 2 + 8, sizeof *md);
  if (!ts || !md) {
    free(ts);
    free(md);
    return fy_error_set(FY_ERR_NOMEM, "cannot allocate the checkpoint's tensor list");
  }
  int nmd = 0;
  if (f != FY_STATE_F32) {
    md[nmd++] = "optimizer_state";
    md[nmd++] = fy_state_format_name(f);
  }
  if (f == FY_STATE_Q8) {
    md[nmd++] = "block";
    md[nmd++] = Q8_BLOCK_TEXT;
  }
  for (int i = 0; i < g->n_params; i++) {
    const struct fy_param *p = &g->params[i];
    char **names[4] = {w->m_names, w->v_names, w->ms_names, w->vs_names};
    for (int k = 0; k < per; k++) {
      struct fy_st_tensor t = {.name = names[k][i], .dtype = dt[k], .rank = p->rank, .shape = {p->shape[0], p->shape[1]},
                               .nbytes = (size_t)p->numel * fy_dtype_size(dt[k])};
      if (k >= 2) {  // the scales of the blocks the parameter's elements are in
        int64_t j0, j1;
        q8_block_span(w->go[i], 0, p->numel, &j0, &j1);
        t = (struct fy_st_tensor){.name = names[k][i], .dtype = FY_F32, .rank = 1, .shape = {j1 - j0 + 1},
                                  .nbytes = (size_t)(j1 - j0 + 1) * 4};
      }
      ts[per * i + k] = t;
    }
    if (f == FY_STATE_Q8 && w->phase_vals[i]) {
      md[nmd++] = w->phase_keys[i];
      md[nmd++] = w->phase_vals[i];
    }
  }
  md[nmd] = NULL;
  fy_st_writer *model = NULL, *adam = NULL;
  char path[4200];
  snprintf(path, sizeof path, "%s/optimizer.safetensors", dir);
  fy_status st = fy_model_save_open(w->model, dir, MAX_SHARD_BYTES, &model);
  if (st == FY_OK) st = fy_st_writer_open(path, ts, per * g->n_params, nmd ? md : NULL, &adam);
  free(ts);
  free(md);
  if (!s->fill) {
    if (st == FY_OK) st = fy_model_save_put(w->model, model, 0, g->n_param_elems, s->params);
    if (st == FY_OK) st = put_adam(w, adam, 0, g->n_param_elems, s->m, s->v);
  } else {
    // Piece by piece: every piece is asked for, even after an error, so that ranks that gather
    // each piece together stay in step.
    float *buf = malloc((size_t)s->piece * 3 * 4);
    if (!buf) st = fy_error_set(FY_ERR_NOMEM, "cannot allocate %.1f MiB for a piece of the checkpoint", s->piece * 12 / 1048576.0);
    for (int64_t lo = 0; lo < g->n_param_elems; lo += s->piece) {
      int64_t hi = lo + s->piece < g->n_param_elems ? lo + s->piece : g->n_param_elems;
      float *p = buf, *m = buf ? buf + s->piece : NULL, *v = buf ? buf + 2 * s->piece : NULL;
      fy_status f = s->fill(s->ctx, lo, hi, p, m, v);
      if (st == FY_OK) st = f;
      if (st == FY_OK) st = fy_model_save_put(w->model, model, lo, hi, p);
      if (st == FY_OK) st = put_adam(w, adam, lo, hi, m, v);
    }
    free(buf);
  }
  if (st == FY_OK) {
    st = fy_model_save_commit(w->model, dir, model);
    model = NULL;
  }
  if (st == FY_OK) {
    st = fy_st_writer_commit(adam);
    adam = NULL;
  }
  fy_st_writer_abort(model);
  fy_st_writer_abort(adam);
  return st;
}

// The files, synced; then their checksums, read back from what was written (the writers put the
// tensors in any order, so they cannot be hashed on the way out), last.
static fy_status write_step_dir(struct fy_ckpt_writer *w, const char *dir) {
  fy_status st = write_tensors(w, dir);
  if (st == FY_OK) st = fy_ckpt_index_write(dir, &w->src.meta);
  if (st == FY_OK) st = fsync_dir_files(dir);
  w->hash_seconds = 0;
  if (st == FY_OK) st = write_sums(dir, &w->hash_seconds);
  return st;
}

// Removes complete checkpoints older than the newest `keep` (and stale temporary directories).
static void prune(struct fy_ckpt_writer *w, const char *newest) {
  DIR *d = opendir(w->root);
  if (!d) return;
  char *names[4096];
  int n = 0;
  struct dirent *e;
  char p[4200];
  while ((e = readdir(d)) && n < 4096) {
    if (strncmp(e->d_name, "step-", 5) == 0) names[n++] = strdup(e->d_name);
    else if (strncmp(e->d_name, ".step-", 6) == 0 && strstr(e->d_name, ".tmp-")) {
      snprintf(p, sizeof p, "%s/%s", w->root, e->d_name);  // left by a crashed write
      remove_tree(p);
    }
  }
  closedir(d);
  qsort(names, (size_t)n, sizeof *names, cmp_str);
  for (int i = 0; i < n; i++) {
    if (i < n - w->keep && strcmp(names[i], newest) != 0) {
      snprintf(p, sizeof p, "%s/%s", w->root, names[i]);
      remove_tree(p);
    }
    free(names[i]);
  }
}

static void write_job(void *arg) {
  struct fy_ckpt_writer *w = arg;
  double t0 = fy_now();
  char name[64], tmp[3200], dir[3200], latest[3200];
  snprintf(name, sizeof name, "step-%08lld", (long long)w->src.meta.step);
  snprintf(tmp, sizeof tmp, "%s/.%s.tmp-%d", w->root, name, (int)getpid());
  snprintf(dir, sizeof dir, "%s/%s", w->root, name);
  snprintf(latest, sizeof latest, "%s/latest", w->root);
  fy_status st = remove_tree(tmp);
  if (st == FY_OK) st = fy_mkdir_p(tmp);
  if (st == FY_OK) st = write_step_dir(w, tmp);
  if (st == FY_OK) {
    struct stat sb;
    if (stat(dir, &sb) == 0) st = remove_tree(dir);  // the same step saved again
  }
  if (st == FY_OK && rename(tmp, dir) != 0)
    st = fy_error_set(FY_ERR_IO, "cannot rename %s to %s: %s", tmp, dir, strerror(errno));
  if (st == FY_OK) st = fsync_path(w->root, true);
  if (st == FY_OK) {
    char text[80];
    snprintf(text, sizeof text, "%s\n", name);
    st = fy_ckpt_write_text(latest, text);
  }
  if (st == FY_OK) st = fsync_path(w->root, true);
  if (st == FY_OK) {
    prune(w, name);
  } else {
    remove_tree(tmp);
    fy_error_wrap(st, "writing the checkpoint of step %lld to %s", (long long)w->src.meta.step, w->root);
    snprintf(w->msg, sizeof w->msg, "%s", fy_error_msg());
  }
  w->st = st;
  w->seconds = fy_now() - t0;
}

fy_status fy_ckpt_writer_create(const char *root, int keep, const struct fy_model *m, struct fy_ckpt_writer **out) {
  FY_TRY(fy_mkdir_p(root));
  struct fy_ckpt_writer *w = calloc(1, sizeof *w);
  if (!w) return fy_error_set(FY_ERR_NOMEM, "cannot allocate the checkpoint writer");
  snprintf(w->root, sizeof w->root, "%s", root);
  w->keep = keep < 1 ? 1 : keep;
  w->model = m;
  fy_uv_job_init(&w->job);
  const struct fy_graph *g = m->graph;
  w->m_names = calloc((size_t)g->n_params, sizeof *w->m_names);
  w->v_names = calloc((size_t)g->n_params, sizeof *w->v_names);
  fy_status st = !w->m_names || !w->v_names ? fy_error_set(FY_ERR_NOMEM, "cannot allocate the checkpoint writer")
                                            : FY_OK;
  w->ms_names = calloc((size_t)g->n_params, sizeof *w->ms_names);
  w->vs_names = calloc((size_t)g->n_params, sizeof *w->vs_names);
  w->phase_keys = calloc((size_t)g->n_params, sizeof *w->phase_keys);
  w->phase_vals = calloc((size_t)g->n_params, sizeof *w->phase_vals);
  if (st == FY_OK && (!w->ms_names || !w->vs_names || !w->phase_keys || !w->phase_vals || !param_groups(g, &w->go, &w->glen)))
    st = fy_error_set(FY_ERR_NOMEM, "cannot allocate the checkpoint writer");
  for (int i = 0; st == FY_OK && i < g->n_params; i++) {
    size_t len = strlen(g->params[i].name) + 24;
    char **names[4] = {w->m_names, w->v_names, w->ms_names, w->vs_names};
    const char *prefix[4] = {"exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax"};
    for (int k = 0; st == FY_OK && k < 4; k++) {
      if (!(names[k][i] = malloc(len))) st = fy_error_set(FY_ERR_NOMEM, "out of memory");
      else snprintf(names[k][i], len, "%s.%s", prefix[k], g->params[i].name);
    }
    if (st == FY_OK && w->go[i] % FY_Q8_BLOCK != 0) {  // (8-bit files: where the parameter starts in its first block)
      w->phase_keys[i] = malloc(len);
      w->phase_vals[i] = malloc(24);
      if (!w->phase_keys[i] || !w->phase_vals[i]) {
        st = fy_error_set(FY_ERR_NOMEM, "out of memory");
        break;
      }
      snprintf(w->phase_keys[i], len, "block_offset.%s", g->params[i].name);
      snprintf(w->phase_vals[i], 24, "%lld", (long long)(w->go[i] % FY_Q8_BLOCK));
    }
  }
  if (st == FY_OK) st = fy_uv_pool_create(&w->pool);
  if (st != FY_OK) {
    fy_ckpt_writer_free(w);
    return st;
  }
  *out = w;
  return FY_OK;
}

void fy_ckpt_writer_free(struct fy_ckpt_writer *w) {
  if (!w) return;
  fy_uv_job_destroy(&w->job);
  fy_uv_pool_free(w->pool);
  char **lists[6] = {w->m_names, w->v_names, w->ms_names, w->vs_names, w->phase_keys, w->phase_vals};
  for (int k = 0; k < 6; k++) {
    for (int i = 0; lists[k] && i < w->model->graph->n_params; i++) free(lists[k][i]);
    free(lists[k]);
  }
  free(w->go);
  free(w->glen);
  free(w->snap.params);
  free(w->snap.m);
  free(w->snap.v);
  free(w);
}

struct fy_ckpt_snapshot *fy_ckpt_snapshot_buffers(struct fy_ckpt_writer *w) {
  fy_uv_job_wait(&w->job);  // the buffers are the write in flight's
  if (!w->snap.params) {  // at the first use: a run that writes in place never needs them
    size_t n = (size_t)w->model->graph->n_param_elems * 4;
    float **bufs[] = {&w->snap.params, &w->snap.m, &w->snap.v};
    for (int i = 0; i < 3; i++)
      if (!(*bufs[i] = malloc(n))) {
        for (int k = 0; k < 3; k++) free(*bufs[k]), *bufs[k] = NULL;
        fy_error_set(FY_ERR_NOMEM, "cannot allocate %.1f MiB for a checkpoint snapshot", 3 * n / 1048576.0);
        return NULL;
      }
  }
  return &w->snap;
}

fy_status fy_ckpt_wait(struct fy_ckpt_writer *w) {
  fy_uv_job_wait(&w->job);
  if (w->st != FY_OK) return fy_error_set(w->st, "%s", w->msg);
  return FY_OK;
}

fy_status fy_ckpt_write_async(struct fy_ckpt_writer *w) {
  FY_TRY(fy_ckpt_wait(w));
  w->src = (struct ckpt_source){.params = w->snap.params, .m = w->snap.m, .v = w->snap.v, .meta = w->snap.meta};
  return fy_uv_pool_submit(w->pool, &w->job, write_job, w);
}

fy_status fy_ckpt_fill_without(int64_t n, int64_t piece, fy_ckpt_fill_fn fill, void *ctx) {
  fy_status st = FY_OK;
  for (int64_t lo = 0; piece > 0 && lo < n; lo += piece) {
    fy_status s1 = fill(ctx, lo, lo + piece < n ? lo + piece : n, NULL, NULL, NULL);
    if (st == FY_OK) st = s1;
  }
  return st;
}

fy_status fy_ckpt_write_pieces(struct fy_ckpt_writer *w, const struct fy_ckpt_meta *meta, int64_t piece,
                               fy_ckpt_fill_fn fill, void *ctx) {
  fy_status st = fy_ckpt_wait(w);
  if (st == FY_OK && piece <= 0) st = fy_error_set(FY_ERR_INVALID, "checkpoint: pieces of %lld elements", (long long)piece);
  if (st != FY_OK) {  // every piece is still asked for (see fy_ckpt_fill_fn)
    fy_ckpt_fill_without(w->model->graph->n_param_elems, piece, fill, ctx);
    return st;
  }
  w->src = (struct ckpt_source){.fill = fill, .ctx = ctx, .piece = piece, .meta = *meta};
  write_job(w);  // on this thread: the fill's state is only valid until we return
  return fy_ckpt_wait(w);
}

bool fy_ckpt_busy(struct fy_ckpt_writer *w) { return fy_uv_job_busy(&w->job); }
double fy_ckpt_last_seconds(const struct fy_ckpt_writer *w) { return w->seconds; }
double fy_ckpt_last_hash_seconds(const struct fy_ckpt_writer *w) { return w->hash_seconds; }

// ---- reading ----


struct fy_ckpt_adam {
  fy_safetensors *st;
  const struct fy_graph *g;
  const struct fy_st_tensor **t;  // per parameter: exp_avg, exp_avg_sq (F32, BF16, or I8 and U8 codes)
  const struct fy_st_tensor **s;  // 8-bit: per parameter, the scales of exp_avg, exp_avg_sq
  int64_t *go, *glen;             // each parameter's offset in its group (the blocks' phase)
};

void fy_ckpt_adam_close(struct fy_ckpt_adam *a) {
  if (!a) return;
  fy_safetensors_close(a->st);
  free(a->t);
  free(a->s);
  free(a->go);
  free(a->glen);
  free(a);
}

// Tensor k (0: exp_avg, 1: exp_avg_sq) of parameter prm, checked: f32 in any checkpoint; bf16 or
// 8-bit codes (I8 for m, U8 for v) with their scales, one a block the parameter's elements are in.
static fy_status adam_tensor(struct fy_ckpt_adam *a, const char *path, int i, int k) {
  const struct fy_param *prm = &a->g->params[i];
  const char *pre = k ? "exp_avg_sq" : "exp_avg";
  char name[FY_NAME_MAX + 32];
  snprintf(name, sizeof name, "%s.%s", pre, prm->name);
  const struct fy_st_tensor *t = fy_safetensors_find(a->st, name);
  const enum fy_dtype code = k ? FY_U8 : FY_I8;
  bool ok = t && (t->dtype == FY_F32 || t->dtype == FY_BF16 || t->dtype == code) && t->rank == prm->rank &&
            t->shape[0] == prm->shape[0] && (prm->rank < 2 || t->shape[1] == prm->shape[1]);
  if (!ok)
    return fy_error_set(FY_ERR_FORMAT, "%s: %s is %s", path, name,
                        t ? "not an f32, bf16 or 8-bit tensor of the parameter's shape" : "missing");
  a->t[2 * i + k] = t;
  if (t->dtype != code) return FY_OK;
  int64_t j0, j1;
  q8_block_span(a->go[i], 0, prm->numel, &j0, &j1);
  snprintf(name, sizeof name, "%s_absmax.%s", pre, prm->name);
  const struct fy_st_tensor *sc = fy_safetensors_find(a->st, name);
  if (!sc || sc->dtype != FY_F32 || sc->rank != 1 || sc->shape[0] != j1 - j0 + 1)
    return fy_error_set(FY_ERR_FORMAT, "%s: %s is %s (the scales of %lld blocks of %d elements)", path, name,
                        sc ? "not an f32 vector of the parameter's blocks" : "missing", (long long)(j1 - j0 + 1),
                        FY_Q8_BLOCK);
  a->s[2 * i + k] = sc;
  return FY_OK;
}

fy_status fy_ckpt_adam_open(const char *path, const struct fy_model *model, struct fy_ckpt_adam **out) {
  char dir[4096], p[4200];
  FY_TRY(fy_ckpt_resolve(path, dir, sizeof dir));
  FY_TRY(fy_ckpt_verify(dir));
  snprintf(p, sizeof p, "%s/optimizer.safetensors", dir);
  const struct fy_graph *g = model->graph;
  struct fy_ckpt_adam *a = calloc(1, sizeof *a);
  if (!a || !(a->t = calloc(2 * (size_t)g->n_params, sizeof *a->t)) || !(a->s = calloc(2 * (size_t)g->n_params, sizeof *a->s)) ||
      !param_groups(g, &a->go, &a->glen)) {
    fy_ckpt_adam_close(a);
    return fy_error_set(FY_ERR_NOMEM, "cannot allocate the AdamW state's index");
  }
  a->g = g;
  fy_status status = fy_safetensors_open(p, &a->st);
  for (int i = 0; i < g->n_params && status == FY_OK; i++)
    for (int k = 0; k < 2 && status == FY_OK; k++) status = adam_tensor(a, p, i, k);
  if (status != FY_OK) {
    fy_ckpt_adam_close(a);
    return status;
  }
  *out = a;
  return FY_OK;
}

void fy_ckpt_adam_read_param(const struct fy_ckpt_adam *a, int i, int64_t b0, int64_t b1, float *m, float *v) {
  const int64_t n = b1 - b0;
  for (int k = 0; k < 2; k++) {
    const struct fy_st_tensor *t = a->t[2 * i + k];
    const size_t es = fy_dtype_size(t->dtype);
    const void *src = (const char *)t->data + (size_t)b0 * es;
    float *dst = k ? v : m;
    if (dst && t->dtype == FY_F32) {
      memcpy(dst, src, (size_t)n * 4);
    } else if (dst && t->dtype == FY_BF16) {
      fy_state_decode(FY_STATE_BF16, k ? FY_MOMENT_V : FY_MOMENT_M, dst, src, n);
    } else if (dst) {  // codes: code_value[code] * the scale of the element's block, as fy_state_decode
      const float *val = fy_q8_code_values(k ? FY_MOMENT_V : FY_MOMENT_M), *scale = a->s[2 * i + k]->data;
      const uint8_t *c = src;
      const int64_t phase = a->go[i] % FY_Q8_BLOCK;
      for (int64_t e = 0; e < n; e++) dst[e] = val[c[e]] * scale[(phase + b0 + e) / FY_Q8_BLOCK];
    }
    fy_safetensors_done_with(src, (size_t)n * es);
  }
}

void fy_ckpt_adam_read(const struct fy_ckpt_adam *a, int64_t lo, int64_t hi, float *m, float *v) {
  int64_t b0, b1;
  for (int i = 0; i < a->g->n_params; i++) {
    const struct fy_param *prm = &a->g->params[i];
    if (fy_param_part(prm, lo, hi, &b0, &b1))
      fy_ckpt_adam_read_param(a, i, b0, b1, m ? m + (prm->offset + b0 - lo) : NULL, v ? v + (prm->offset + b0 - lo) : NULL);
  }
}

fy_status fy_ckpt_load(const char *path, struct fy_model *model, float *m, float *v, struct fy_ckpt_meta *meta) {
  char dir[4096];
  FY_TRY(fy_ckpt_resolve(path, dir, sizeof dir));
  FY_TRY(fy_ckpt_verify(dir));
  FY_TRY(fy_ckpt_index_read(dir, meta));
  FY_TRY(fy_model_load(model, dir));
  if (!m && !v) return FY_OK;
  struct fy_ckpt_adam *a;
  FY_TRY(fy_ckpt_adam_open(dir, model, &a));
  fy_ckpt_adam_read(a, 0, model->graph->n_param_elems, m, v);
  fy_ckpt_adam_close(a);
  return FY_OK;
}

fy_status fy_ckpt_model_dir(const char *path, char *buf, size_t n, const char **dir) {
  *dir = path;
  char p[4200];
  snprintf(p, sizeof p, "%s/latest", path);
  if (access(p, F_OK) == 0) {  // (anything but a root reports itself when read)
    FY_TRY(fy_ckpt_resolve(path, buf, n));
    *dir = buf;
  }
  snprintf(p, sizeof p, "%s/trainer.json", *dir);
  return access(p, F_OK) == 0 ? fy_ckpt_verify(*dir) : FY_OK;  // a step directory: its files checked
}
