#include "memory/uv_pool.h"

#include <stdlib.h>

struct fy_uv_pool {
  uv_loop_t loop;
  uv_async_t wake;
  pthread_t thread;
  pthread_mutex_t mu;  // guards the queue and stopping
  struct fy_uv_job *head, *tail;
  bool stopping;
};

static void work_cb(uv_work_t *w) {
  struct fy_uv_job *j = (struct fy_uv_job *)w;
  j->fn(j->arg);
}

static void after_cb(uv_work_t *w, int status) {
  struct fy_uv_job *j = (struct fy_uv_job *)w;
  (void)status;  // never cancelled
  pthread_mutex_lock(&j->mu);
  j->busy = false;
  pthread_cond_broadcast(&j->cv);
  pthread_mutex_unlock(&j->mu);
}

static void wake_cb(uv_async_t *a) {
  struct fy_uv_pool *p = a->data;
  pthread_mutex_lock(&p->mu);
  struct fy_uv_job *q = p->head;
  p->head = p->tail = NULL;
  bool stop = p->stopping;
  pthread_mutex_unlock(&p->mu);
  while (q) {
    struct fy_uv_job *next = q->next;
    FY_ASSERT(uv_queue_work(&p->loop, &q->work, work_cb, after_cb) == 0);
    q = next;
  }
  if (stop) uv_close((uv_handle_t *)&p->wake, NULL);  // uv_run returns once the work is done
}

static void *loop_main(void *arg) {
  struct fy_uv_pool *p = arg;
  uv_run(&p->loop, UV_RUN_DEFAULT);
  return NULL;
}

fy_status fy_uv_pool_create(struct fy_uv_pool **out) {
  struct fy_uv_pool *p = calloc(1, sizeof *p);
  if (!p) return fy_error_set(FY_ERR_NOMEM, "cannot allocate a libuv pool");
  int rc = uv_loop_init(&p->loop);
  if (rc == 0 && (rc = uv_async_init(&p->loop, &p->wake, wake_cb)) != 0) uv_loop_close(&p->loop);
  if (rc != 0) {
    free(p);
    return fy_error_set(FY_ERR_INTERNAL, "libuv: %s", uv_strerror(rc));
  }
  p->wake.data = p;
  pthread_mutex_init(&p->mu, NULL);
  if (pthread_create(&p->thread, NULL, loop_main, p) != 0) {
    uv_close((uv_handle_t *)&p->wake, NULL);
    uv_run(&p->loop, UV_RUN_DEFAULT);
    uv_loop_close(&p->loop);
    pthread_mutex_destroy(&p->mu);
    free(p);
    return fy_error_set(FY_ERR_INTERNAL, "cannot start the libuv loop thread");
  }
  *out = p;
  return FY_OK;
}

void fy_uv_pool_free(struct fy_uv_pool *p) {
  if (!p) return;
  pthread_mutex_lock(&p->mu);
  p->stopping = true;
  pthread_mutex_unlock(&p->mu);
  uv_async_send(&p->wake);
  pthread_join(p->thread, NULL);
  uv_loop_close(&p->loop);
  pthread_mutex_destroy(&p->mu);
  free(p);
}

void fy_uv_job_init(struct fy_uv_job *j) {
  *j = (struct fy_uv_job){0};
  pthread_mutex_init(&j->mu, NULL);
  pthread_cond_init(&j->cv, NULL);
}

void fy_uv_job_destroy(struct fy_uv_job *j) {
  fy_uv_job_wait(j);
  pthread_mutex_destroy(&j->mu);
  pthread_cond_destroy(&j->cv);
}

fy_status fy_uv_pool_submit(struct fy_uv_pool *p, struct fy_uv_job *j, void (*fn)(void *), void *arg) {
  pthread_mutex_lock(&j->mu);
  bool busy = j->busy;
  if (!busy) j->busy = true;
  pthread_mutex_unlock(&j->mu);
  if (busy) return fy_error_set(FY_ERR_INVALID, "a libuv job was submitted while still running");
  j->fn = fn;
  j->arg = arg;
  j->next = NULL;
  pthread_mutex_lock(&p->mu);
  if (p->tail) p->tail->next = j; else p->head = j;
  p->tail = j;
  pthread_mutex_unlock(&p->mu);
  uv_async_send(&p->wake);
  return FY_OK;
}

void fy_uv_job_wait(struct fy_uv_job *j) {
  pthread_mutex_lock(&j->mu);
  while (j->busy) pthread_cond_wait(&j->cv, &j->mu);
  pthread_mutex_unlock(&j->mu);
}

bool fy_uv_job_busy(struct fy_uv_job *j) {
  pthread_mutex_lock(&j->mu);
  bool b = j->busy;
  pthread_mutex_unlock(&j->mu);
  return b;
}
