// Logging to stderr with a level and an optional rank prefix.
#ifndef FY_LOG_H
#define FY_LOG_H

enum fy_log_level { FY_LOG_DEBUG, FY_LOG_INFO, FY_LOG_WARN, FY_LOG_ERROR };

void fy_log_set_level(enum fy_log_level level);
// rank < 0: no prefix (the single-process default).
void fy_log_set_rank(int rank);
void fy_log(enum fy_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define fy_log_info(...) fy_log(FY_LOG_INFO, __VA_ARGS__)
#define fy_log_warn(...) fy_log(FY_LOG_WARN, __VA_ARGS__)
#define fy_log_debug(...) fy_log(FY_LOG_DEBUG, __VA_ARGS__)

#endif
