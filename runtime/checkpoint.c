#include "runtime/checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <json-c/json.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "core/clock.h"
#include "core/fileio.h"
#include "core/log.h"
#include "core/safetensors.h"
#include "memory/uv_pool.h"

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
  char **m_names, **v_names;
  struct fy_uv_pool *pool;
  struct fy_uv_job job;
  fy_status st;  // of the last write (read after waiting)
  char msg[1024];
  double seconds;
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

// ---- writing ----

// The AdamW state's part in elements [lo, hi) of the flat layout (m and v hold those elements).
static fy_status put_adam(struct fy_ckpt_writer *w, fy_st_writer *adam, int64_t lo, int64_t hi, const float *m,
                          const float *v) {
  const struct fy_graph *g = w->model->graph;
  int64_t a, b;
  for (int i = 0; i < g->n_params; i++) {
    const struct fy_param *prm = &g->params[i];
    if (!fy_param_part(prm, lo, hi, &a, &b)) continue;
    size_t off = (size_t)a * 4, n = (size_t)(b - a) * 4, at = (size_t)(prm->offset + a - lo);
    FY_TRY(fy_st_writer_put(adam, 2 * i, off, m + at, n));
    FY_TRY(fy_st_writer_put(adam, 2 * i + 1, off, v + at, n));
  }
  return FY_OK;
}

// The tensors of a step directory: the weights (a Hugging Face model directory, config.json
// included) and the AdamW state.
static fy_status write_tensors(struct fy_ckpt_writer *w, const char *dir) {
  const struct fy_graph *g = w->model->graph;
  const struct ckpt_source *s = &w->src;
  struct fy_st_tensor *ts = calloc((size_t)g->n_params * 2, sizeof *ts);
  if (!ts) return fy_error_set(FY_ERR_NOMEM, "cannot allocate the checkpoint's tensor list");
  fy_st_writer *model = NULL, *adam = NULL;
  for (int i = 0; i < g->n_params; i++) {
    const struct fy_param *p = &g->params[i];
    struct fy_st_tensor t = {.dtype = FY_F32, .rank = p->rank, .shape = {p->shape[0], p->shape[1]},
                             .nbytes = (size_t)p->numel * 4};
    ts[2 * i] = ts[2 * i + 1] = t;
    ts[2 * i].name = w->m_names[i];
    ts[2 * i + 1].name = w->v_names[i];
  }
  char path[4200];
  snprintf(path, sizeof path, "%s/optimizer.safetensors", dir);
  fy_status st = fy_model_save_open(w->model, dir, MAX_SHARD_BYTES, &model);
  if (st == FY_OK) st = fy_st_writer_open(path, ts, 2 * g->n_params, NULL, &adam);
  free(ts);
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

static fy_status write_step_dir(struct fy_ckpt_writer *w, const char *dir) {
  fy_status st = write_tensors(w, dir);
  if (st == FY_OK) st = fy_ckpt_index_write(dir, &w->src.meta);
  if (st == FY_OK) st = fsync_dir_files(dir);
  return st;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

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
  for (int i = 0; st == FY_OK && i < g->n_params; i++) {
    size_t len = strlen(g->params[i].name) + 16;
    w->m_names[i] = malloc(len);
    w->v_names[i] = malloc(len);
    if (!w->m_names[i] || !w->v_names[i]) {
      st = fy_error_set(FY_ERR_NOMEM, "out of memory");
      break;
    }
    snprintf(w->m_names[i], len, "exp_avg.%s", g->params[i].name);
    snprintf(w->v_names[i], len, "exp_avg_sq.%s", g->params[i].name);
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
  for (int i = 0; w->m_names && i < w->model->graph->n_params; i++) {
    free(w->m_names[i]);
    if (w->v_names) free(w->v_names[i]);
  }
  free(w->m_names);
  free(w->v_names);
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

// ---- reading ----


struct fy_ckpt_adam {
  fy_safetensors *st;
  const struct fy_graph *g;
  const struct fy_st_tensor **t;  // per parameter: exp_avg, exp_avg_sq
};

void fy_ckpt_adam_close(struct fy_ckpt_adam *a) {
  if (!a) return;
  fy_safetensors_close(a->st);
  free(a->t);
  free(a);
}

fy_status fy_ckpt_adam_open(const char *path, const struct fy_model *model, struct fy_ckpt_adam **out) {
  char dir[4096], p[4200];
  FY_TRY(fy_ckpt_resolve(path, dir, sizeof dir));
  snprintf(p, sizeof p, "%s/optimizer.safetensors", dir);
  const struct fy_graph *g = model->graph;
  struct fy_ckpt_adam *a = calloc(1, sizeof *a);
  if (!a || !(a->t = calloc(2 * (size_t)g->n_params, sizeof *a->t))) {
    free(a);
    return fy_error_set(FY_ERR_NOMEM, "cannot allocate the AdamW state's index");
  }
  a->g = g;
  fy_status status = fy_safetensors_open(p, &a->st);
  for (int i = 0; i < g->n_params && status == FY_OK; i++) {
    const struct fy_param *prm = &g->params[i];
    for (int k = 0; k < 2 && status == FY_OK; k++) {
      char name[FY_NAME_MAX + 16];
      snprintf(name, sizeof name, "%s.%s", k ? "exp_avg_sq" : "exp_avg", prm->name);
      const struct fy_st_tensor *t = fy_safetensors_find(a->st, name);
      bool ok = t && t->dtype == FY_F32 && t->rank == prm->rank && t->shape[0] == prm->shape[0] &&
                (prm->rank < 2 || t->shape[1] == prm->shape[1]);
      if (!ok)
        status = fy_error_set(FY_ERR_FORMAT, "%s: %s is %s", p, name, t ? "not an f32 tensor of the parameter's shape" : "missing");
      a->t[2 * i + k] = t;
    }
  }
  if (status != FY_OK) {
    fy_ckpt_adam_close(a);
    return status;
  }
  *out = a;
  return FY_OK;
}

void fy_ckpt_adam_read_param(const struct fy_ckpt_adam *a, int i, int64_t b0, int64_t b1, float *m, float *v) {
  for (int k = 0; k < 2; k++) {
    const float *src = (const float *)a->t[2 * i + k]->data + b0;
    if (k ? v : m) memcpy(k ? v : m, src, (size_t)(b1 - b0) * 4);
    fy_safetensors_done_with(src, (size_t)(b1 - b0) * 4);
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
  FY_TRY(fy_ckpt_index_read(dir, meta));
  FY_TRY(fy_model_load(model, dir));
  if (!m && !v) return FY_OK;
  struct fy_ckpt_adam *a;
  FY_TRY(fy_ckpt_adam_open(dir, model, &a));
  fy_ckpt_adam_read(a, 0, model->graph->n_param_elems, m, v);
  fy_ckpt_adam_close(a);
  return FY_OK;
}
