// Jobs on libuv's thread pool, for work that must not block the training loop (checkpoints).
// A pool owns a libuv loop on a thread of its own; submit hands a job to uv_queue_work from any
// thread, and the job's owner waits for it on a condition variable (no polling).
#ifndef FY_UV_POOL_H
#define FY_UV_POOL_H

#include <pthread.h>
#include <stdbool.h>
#include <uv.h>

#include "core/status.h"

struct fy_uv_pool;

struct fy_uv_job {
  uv_work_t work;  // libuv's; untouched by us while the job runs
  void (*fn)(void *arg);
  void *arg;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  bool busy;
  struct fy_uv_job *next;
};

fy_status fy_uv_pool_create(struct fy_uv_pool **out);
// Waits for every submitted job, then stops the loop thread.
void fy_uv_pool_free(struct fy_uv_pool *p);
void fy_uv_job_init(struct fy_uv_job *j);
void fy_uv_job_destroy(struct fy_uv_job *j);
// Runs fn(arg) on a pool thread; j must not be busy (wait for it first).
fy_status fy_uv_pool_submit(struct fy_uv_pool *p, struct fy_uv_job *j, void (*fn)(void *), void *arg);
// Blocks until j has run (returns at once for a job never submitted).
void fy_uv_job_wait(struct fy_uv_job *j);
bool fy_uv_job_busy(struct fy_uv_job *j);

#endif
