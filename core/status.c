#include "core/status.h"

#include <stdarg.h>
#include <string.h>

static _Thread_local char fy_err_buf[1024];

fy_status fy_error_set(fy_status st, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(fy_err_buf, sizeof fy_err_buf, fmt, ap);
  va_end(ap);
  return st;
}

fy_status fy_error_wrap(fy_status st, const char *fmt, ...) {
  char prefix[256], old[sizeof fy_err_buf];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(prefix, sizeof prefix, fmt, ap);
  va_end(ap);
  memcpy(old, fy_err_buf, sizeof old);
  // Truncation is acceptable: the message stays readable, only its tail is lost.
  int n = snprintf(fy_err_buf, sizeof fy_err_buf, "%s: ", prefix);
  if (n > 0 && (size_t)n < sizeof fy_err_buf) strncat(fy_err_buf, old, sizeof fy_err_buf - (size_t)n - 1);
  return st;
}

const char *fy_error_msg(void) { return fy_err_buf[0] ? fy_err_buf : "no error message"; }

void fy_error_clear(void) { fy_err_buf[0] = 0; }

const char *fy_status_name(fy_status st) {
  switch (st) {
    case FY_OK: return "ok";
    case FY_ERR_INVALID: return "invalid input";
    case FY_ERR_IO: return "i/o error";
    case FY_ERR_FORMAT: return "malformed file";
    case FY_ERR_NOT_FOUND: return "not found";
    case FY_ERR_NOMEM: return "out of memory";
    case FY_ERR_UNSUPPORTED: return "unsupported";
    case FY_ERR_NUMERIC: return "numeric error";
    case FY_ERR_INTERNAL: return "internal error";
  }
  return "unknown status";
}
