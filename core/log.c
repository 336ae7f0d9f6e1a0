#include "core/log.h"

#include <stdarg.h>
#include <stdio.h>

static enum fy_log_level fy_log_level_now = FY_LOG_INFO;
static int fy_log_rank = -1;

void fy_log_set_level(enum fy_log_level level) { fy_log_level_now = level; }
void fy_log_set_rank(int rank) { fy_log_rank = rank; }

void fy_log(enum fy_log_level level, const char *fmt, ...) {
  static const char *names[] = {"debug", "info", "warning", "error"};
  if (level < fy_log_level_now) return;
  char line[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  if (fy_log_rank >= 0)
    fprintf(stderr, "[rank %d] ferry %s: %s\n", fy_log_rank, names[level], line);
  else
    fprintf(stderr, "ferry %s: %s\n", names[level], line);
}
