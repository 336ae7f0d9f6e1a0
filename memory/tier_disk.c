// Disk tier: slots in one scratch file, read and written on libuv's thread pool.
//
// The tier owns a libuv loop and the thread that runs it. A submission, from any thread, puts the
// request on a locked queue and wakes the loop with uv_async_send; the loop hands each queued
// request to uv_queue_work, whose work callback runs the pread/pwrite loop on a pool thread, and
// whose after-work callback (back on the loop thread, when libuv is done with the request) records
// the statistics and signals the request's condition variable. A request is reusable, and may be
// freed by its owner, from the moment that signal is given: nothing touches it afterwards.
//
// The pool is libuv's process-wide one (4 threads unless UV_THREADPOOL_SIZE says otherwise), so at
// most that many requests of all tiers touch the disk at once.
#include "memory/tier.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#include "core/clock.h"
#include "core/rand.h"
#include "core/status.h"

#define SLOT_ALIGN 4096  // slots start on page (and usual block) boundaries

struct fy_disk_req {
  uv_work_t work;  // must stay untouched by us while libuv holds it
  pthread_mutex_t mu;
  pthread_cond_t cv;
  bool busy;  // submitted and not yet completed
  fy_status st;
  char msg[384];
  // The operation, set at submission.
  struct fy_disk_tier *t;
  bool write;
  int64_t pos;
  void *buf;
  size_t n;
  unsigned delay_us;
  double secs;
  struct fy_disk_req *next;  // the submission queue
};

struct fy_disk_tier {
  char *dir, *path;
  int fd;
  size_t cap;
  pthread_mutex_t mu;  // guards everything below
  size_t end;          // bytes reserved: slots are [0, end)
  struct fy_disk_req *qhead, *qtail;
  bool stopping;
  struct fy_disk_stats stats;
  int jitter_us;
  uint64_t rng;
  uv_loop_t loop;
  uv_async_t wake;
  pthread_t thread;
};

static unsigned tier_counter;  // n in ferry-<pid>-<n>.bin: several tiers in one process

// strerror is not thread-safe; the pool threads use this. _GNU_SOURCE gives the GNU strerror_r.
static const char *errtext(int err, char *buf, size_t n) { return strerror_r(err, buf, n); }

// ---- the loop thread and the pool ----

static void work_cb(uv_work_t *w) {
  struct fy_disk_req *r = (struct fy_disk_req *)w;
  struct fy_disk_tier *t = r->t;
  if (r->delay_us) {
    struct timespec d = {r->delay_us / 1000000, (long)(r->delay_us % 1000000) * 1000};
    while (nanosleep(&d, &d) != 0 && errno == EINTR) {
    }
  }
  double t0 = fy_now();
  size_t done = 0;
  int err = 0;
  while (done < r->n) {
    ssize_t k = r->write ? pwrite(t->fd, (const char *)r->buf + done, r->n - done, r->pos + done)
                         : pread(t->fd, (char *)r->buf + done, r->n - done, r->pos + done);
    if (k < 0) {
      if (errno == EINTR) continue;
      err = errno;
      break;
    }
    if (k == 0) break;  // end of file on read; a write that makes no progress
    done += (size_t)k;
  }
  r->secs = fy_now() - t0;
  char eb[128];
  if (done == r->n) {
    r->st = FY_OK;
  } else if (r->write) {
    // A write that stops short without an errno is the disk filling up.
    r->st = FY_ERR_IO;
    snprintf(r->msg, sizeof r->msg, "disk tier %s: writing %zu bytes failed: %s", t->dir, r->n,
             errtext(err ? err : ENOSPC, eb, sizeof eb));
  } else if (err) {
    r->st = FY_ERR_IO;
    snprintf(r->msg, sizeof r->msg, "disk tier %s: reading %zu bytes failed: %s", t->dir, r->n,
             errtext(err, eb, sizeof eb));
  } else {
    r->st = FY_ERR_IO;
    snprintf(r->msg, sizeof r->msg,
             "disk tier %s: reading %zu bytes at offset %lld: short read (%zu bytes): %s was "
             "truncated",
             t->dir, r->n, (long long)r->pos, done, t->path);
  }
}

static void after_cb(uv_work_t *w, int status) {
  struct fy_disk_req *r = (struct fy_disk_req *)w;
  struct fy_disk_tier *t = r->t;
  (void)status;  // never cancelled
  if (r->st == FY_OK) {
    pthread_mutex_lock(&t->mu);
    if (r->write) {
      t->stats.write_bytes += (double)r->n;
      t->stats.write_s += r->secs;
    } else {
      t->stats.read_bytes += (double)r->n;
      t->stats.read_s += r->secs;
    }
    pthread_mutex_unlock(&t->mu);
  }
  pthread_mutex_lock(&r->mu);
  r->busy = false;
  pthread_cond_broadcast(&r->cv);
  pthread_mutex_unlock(&r->mu);  // from here on r belongs to its owner again
}

static void wake_cb(uv_async_t *a) {
  struct fy_disk_tier *t = a->data;
  pthread_mutex_lock(&t->mu);
  struct fy_disk_req *q = t->qhead;
  t->qhead = t->qtail = NULL;
  bool stop = t->stopping;
  pthread_mutex_unlock(&t->mu);
  while (q) {
    struct fy_disk_req *next = q->next;  // read first: the request may complete at once
    int rc = uv_queue_work(&t->loop, &q->work, work_cb, after_cb);
    FY_ASSERT(rc == 0);  // fails only for a NULL work callback
    q = next;
  }
  // Closing the handle lets uv_run return once the queued work is done.
  if (stop) uv_close((uv_handle_t *)&t->wake, NULL);
}

static void *loop_main(void *arg) {
  struct fy_disk_tier *t = arg;
  uv_run(&t->loop, UV_RUN_DEFAULT);
  return NULL;
}

// ---- open and close ----

static fy_status probe_dir(const char *dir) {
  struct stat sb;
  if (stat(dir, &sb) != 0)
    return fy_error_set(FY_ERR_IO, "disk tier %s: cannot use the directory: %s", dir, strerror(errno));
  if (!S_ISDIR(sb.st_mode))
    return fy_error_set(FY_ERR_IO, "disk tier %s: cannot use the directory: %s", dir, strerror(ENOTDIR));
  size_t len = strlen(dir) + 64;
  char *p = malloc(len);
  if (!p) return fy_error_set(FY_ERR_NOMEM, "disk tier: out of memory");
  snprintf(p, len, "%s/.ferry-probe-%ld-%u", dir, (long)getpid(),
           __atomic_fetch_add(&tier_counter, 1, __ATOMIC_RELAXED));
  int fd = open(p, O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0600);
  if (fd < 0) {
    int e = errno;
    free(p);
    return fy_error_set(FY_ERR_IO, "disk tier %s: the directory is not writable: creating a file "
                        "failed: %s", dir, strerror(e));
  }
  char block[SLOT_ALIGN] = {0};
  int e = 0;
  size_t done = 0;
  while (done < sizeof block) {
    ssize_t k = write(fd, block + done, sizeof block - done);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) {
      e = k < 0 ? errno : ENOSPC;
      break;
    }
    done += (size_t)k;
  }
  if (close(fd) != 0 && !e) e = errno;
  unlink(p);
  free(p);
  if (e)
    return fy_error_set(FY_ERR_IO, "disk tier %s: the directory is not writable: writing a file "
                        "failed: %s", dir, strerror(e));
  return FY_OK;
}

size_t fy_disk_slot_bytes(size_t n) { return ((n ? n : 1) + SLOT_ALIGN - 1) / SLOT_ALIGN * SLOT_ALIGN; }

fy_status fy_disk_space(const char *dir, double *bytes) {
  *bytes = 0;
  struct statvfs vs;
  if (statvfs(dir, &vs) != 0)
    return fy_error_set(FY_ERR_IO, "disk tier %s: cannot query free space: %s", dir, strerror(errno));
  *bytes = (double)vs.f_bavail * (double)vs.f_frsize;
  return FY_OK;
}

fy_status fy_disk_tier_open(const char *dir, size_t cap, struct fy_disk_tier **out) {
  *out = NULL;
  if (!dir || !*dir) return fy_error_set(FY_ERR_INVALID, "disk tier: no directory given");
  FY_TRY(probe_dir(dir));
  if (cap > 0) {
    double avail;
    FY_TRY(fy_disk_space(dir, &avail));
    if (avail < (double)cap)
      return fy_error_set(FY_ERR_IO, "disk tier %s: %zu bytes do not fit: %.0f bytes free", dir, cap, avail);
  }

  struct fy_disk_tier *t = calloc(1, sizeof *t);
  if (!t) return fy_error_set(FY_ERR_NOMEM, "disk tier: out of memory");
  t->fd = -1;
  t->cap = cap;
  t->dir = strdup(dir);
  size_t len = strlen(dir) + 64;
  t->path = malloc(len);
  if (!t->dir || !t->path) {
    free(t->dir);
    free(t->path);
    free(t);
    return fy_error_set(FY_ERR_NOMEM, "disk tier: out of memory");
  }
  snprintf(t->path, len, "%s/ferry-%ld-%u.bin", dir, (long)getpid(),
           __atomic_fetch_add(&tier_counter, 1, __ATOMIC_RELAXED));
  t->fd = open(t->path, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  fy_status st = FY_OK;
  int rc = 0;
  if (t->fd < 0) {
    st = fy_error_set(FY_ERR_IO, "disk tier %s: cannot create %s: %s", dir, t->path, strerror(errno));
    goto fail;
  }
  if ((rc = uv_loop_init(&t->loop)) != 0) {
    st = fy_error_set(FY_ERR_INTERNAL, "disk tier %s: uv_loop_init: %s", dir, uv_strerror(rc));
    goto fail;
  }
  if ((rc = uv_async_init(&t->loop, &t->wake, wake_cb)) != 0) {
    uv_loop_close(&t->loop);
    st = fy_error_set(FY_ERR_INTERNAL, "disk tier %s: uv_async_init: %s", dir, uv_strerror(rc));
    goto fail;
  }
  t->wake.data = t;
  pthread_mutex_init(&t->mu, NULL);
  if ((rc = pthread_create(&t->thread, NULL, loop_main, t)) != 0) {
    uv_close((uv_handle_t *)&t->wake, NULL);
    uv_run(&t->loop, UV_RUN_DEFAULT);
    uv_loop_close(&t->loop);
    pthread_mutex_destroy(&t->mu);
    st = fy_error_set(FY_ERR_INTERNAL, "disk tier %s: cannot start its thread: %s", dir, strerror(rc));
    goto fail;
  }
  *out = t;
  return FY_OK;
fail:
  if (t->fd >= 0) {
    close(t->fd);
    unlink(t->path);
  }
  free(t->dir);
  free(t->path);
  free(t);
  return st;
}

void fy_disk_tier_close(struct fy_disk_tier *t) {
  if (!t) return;
  // Sent under the lock, as every submission's wake-up is: the loop closes the handle only after
  // it has seen `stopping` under the same lock, so no send can reach a closed handle.
  pthread_mutex_lock(&t->mu);
  t->stopping = true;
  uv_async_send(&t->wake);
  pthread_mutex_unlock(&t->mu);
  pthread_join(t->thread, NULL);  // uv_run returns when every request has completed
  int rc = uv_loop_close(&t->loop);
  FY_ASSERT(rc == 0);
  pthread_mutex_destroy(&t->mu);
  close(t->fd);
  unlink(t->path);
  free(t->dir);
  free(t->path);
  free(t);
}

// ---- slots and requests ----

fy_status fy_disk_alloc(struct fy_disk_tier *t, size_t n, int64_t *handle) {
  *handle = -1;
  size_t size = fy_disk_slot_bytes(n);
  if (size < n) return fy_error_set(FY_ERR_INVALID, "disk tier %s: %zu bytes is too large", t->dir, n);
  pthread_mutex_lock(&t->mu);
  size_t end = t->end;
  if (t->cap && (size > t->cap || end > t->cap - size)) {
    pthread_mutex_unlock(&t->mu);
    return fy_error_set(FY_ERR_NOMEM,
                        "disk tier %s: cannot reserve %zu bytes: %zu bytes in use, cap %zu bytes",
                        t->dir, n, end, t->cap);
  }
  // The file covers every reserved slot (sparsely), so that reading a slot never written gives
  // zeros rather than a short read, and a short read always means the file was damaged.
  while (ftruncate(t->fd, (off_t)(end + size)) != 0) {
    if (errno == EINTR) continue;
    int e = errno;
    pthread_mutex_unlock(&t->mu);
    return fy_error_set(FY_ERR_IO, "disk tier %s: growing %s to %zu bytes failed: %s", t->dir,
                        t->path, end + size, strerror(e));
  }
  t->end = end + size;
  pthread_mutex_unlock(&t->mu);
  *handle = (int64_t)end;
  return FY_OK;
}

fy_status fy_disk_req_create(struct fy_disk_req **out) {
  *out = calloc(1, sizeof **out);
  if (!*out) return fy_error_set(FY_ERR_NOMEM, "disk tier: out of memory");
  pthread_mutex_init(&(*out)->mu, NULL);
  pthread_cond_init(&(*out)->cv, NULL);
  return FY_OK;
}

void fy_disk_req_free(struct fy_disk_req *r) {
  if (!r) return;
  pthread_mutex_lock(&r->mu);
  bool busy = r->busy;
  pthread_mutex_unlock(&r->mu);
  FY_ASSERT(!busy);  // freeing a request in flight: wait for it first
  pthread_cond_destroy(&r->cv);
  pthread_mutex_destroy(&r->mu);
  free(r);
}

static fy_status submit(struct fy_disk_tier *t, bool write, int64_t handle, size_t off, void *buf,
                        size_t n, struct fy_disk_req *r) {
  const char *what = write ? "writing" : "reading";
  pthread_mutex_lock(&t->mu);
  size_t end = t->end;
  FY_ASSERT(!t->stopping);  // a request after close began
  pthread_mutex_unlock(&t->mu);
  if (handle < 0 || (size_t)handle > end || off > end - (size_t)handle ||
      n > end - (size_t)handle - off)
    return fy_error_set(FY_ERR_INVALID,
                        "disk tier %s: %s %zu bytes at handle %lld + %zu: outside the %zu reserved bytes",
                        t->dir, what, n, (long long)handle, off, end);

  pthread_mutex_lock(&r->mu);
  if (r->busy) {
    pthread_mutex_unlock(&r->mu);
    return fy_error_set(FY_ERR_INVALID, "disk tier %s: %s: the request is still in flight", t->dir, what);
  }
  r->busy = true;
  r->st = FY_OK;
  r->msg[0] = 0;
  pthread_mutex_unlock(&r->mu);
  r->t = t;
  r->write = write;
  r->pos = handle + (int64_t)off;
  r->buf = buf;
  r->n = n;
  r->next = NULL;

  pthread_mutex_lock(&t->mu);
  r->delay_us = t->jitter_us ? (unsigned)(fy_splitmix64(&t->rng) % ((uint64_t)t->jitter_us + 1)) : 0;
  if (t->qtail)
    t->qtail->next = r;
  else
    t->qhead = r;
  t->qtail = r;
  uv_async_send(&t->wake);
  pthread_mutex_unlock(&t->mu);
  return FY_OK;
}

fy_status fy_disk_read_async(struct fy_disk_tier *t, int64_t handle, size_t off, void *buf, size_t n,
                             struct fy_disk_req *r) {
  return submit(t, false, handle, off, buf, n, r);
}

fy_status fy_disk_write_async(struct fy_disk_tier *t, int64_t handle, size_t off, const void *buf,
                              size_t n, struct fy_disk_req *r) {
  return submit(t, true, handle, off, (void *)buf, n, r);
}

fy_status fy_disk_wait(struct fy_disk_req *r) {
  pthread_mutex_lock(&r->mu);
  while (r->busy) pthread_cond_wait(&r->cv, &r->mu);
  fy_status st = r->st;
  pthread_mutex_unlock(&r->mu);
  if (st != FY_OK) fy_error_set(st, "%s", r->msg);
  return st;
}

size_t fy_disk_in_use(const struct fy_disk_tier *t) {
  struct fy_disk_tier *m = (struct fy_disk_tier *)t;
  pthread_mutex_lock(&m->mu);
  size_t v = m->end;
  pthread_mutex_unlock(&m->mu);
  return v;
}

void fy_disk_stats(const struct fy_disk_tier *t, struct fy_disk_stats *out) {
  struct fy_disk_tier *m = (struct fy_disk_tier *)t;
  pthread_mutex_lock(&m->mu);
  *out = m->stats;
  pthread_mutex_unlock(&m->mu);
}

void fy_disk_set_jitter(struct fy_disk_tier *t, int max_us, uint64_t seed) {
  pthread_mutex_lock(&t->mu);
  t->jitter_us = max_us > 0 ? max_us : 0;
  t->rng = seed;
  pthread_mutex_unlock(&t->mu);
}
