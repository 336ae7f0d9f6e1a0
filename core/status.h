// Status codes and the last error message.
//
// Functions that can fail return fy_status and leave a message with fy_error_set; the message is
// per thread, so a caller reads it with fy_error_msg() right after the failing call. The CLI prints
// it and exits non-zero. FY_ASSERT is only for broken internal invariants: it aborts.
#ifndef FY_STATUS_H
#define FY_STATUS_H

#include <stdio.h>
#include <stdlib.h>

typedef enum fy_status {
  FY_OK = 0,
  FY_ERR_INVALID,   // bad argument or bad input data (config, flags, shard, plan)
  FY_ERR_IO,        // open/read/write/mmap failed
  FY_ERR_FORMAT,    // a file is malformed (truncated, lying header, wrong magic)
  FY_ERR_NOT_FOUND, // a file or a tensor that must exist does not
  FY_ERR_NOMEM,     // allocation failed or a memory cap is too small
  FY_ERR_UNSUPPORTED,
  FY_ERR_NUMERIC,   // NaN or inf where a number was expected
  FY_ERR_INTERNAL,
} fy_status;

// Sets the calling thread's error message (printf-style) and returns `st`, so that a failure reads
// `return fy_error_set(FY_ERR_IO, "cannot open %s", path);`.
fy_status fy_error_set(fy_status st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
// Prefixes the current message with context: "loading weights: " + old message.
fy_status fy_error_wrap(fy_status st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
const char *fy_error_msg(void);
void fy_error_clear(void);
const char *fy_status_name(fy_status st);

#define FY_TRY(expr)                 \
  do {                               \
    fy_status fy_try_st_ = (expr);   \
    if (fy_try_st_ != FY_OK) return fy_try_st_; \
  } while (0)

#define FY_ASSERT(cond)                                                                  \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      fprintf(stderr, "ferry: internal error at %s:%d: %s\n", __FILE__, __LINE__, #cond); \
      abort();                                                                           \
    }                                                                                    \
  } while (0)

#endif
