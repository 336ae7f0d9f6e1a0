#include "core/parse.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

bool fy_parse_size(const char *s, double *bytes) {
  char *end;
  errno = 0;
  double v = strtod(s, &end);
  double mult = 1;
  const char *u = end;
  if (*u == ' ' && u[1]) u++;  // "3.25 GiB", as fy_format_bytes writes it
  if (*u == 'K' || *u == 'k') mult = 1024.0, u++;
  else if (*u == 'M' || *u == 'm') mult = 1048576.0, u++;
  else if (*u == 'G' || *u == 'g') mult = 1073741824.0, u++;
  else if (*u == 'T' || *u == 't') mult = 1099511627776.0, u++;
  if (mult > 1 && *u == 'i') u++;
  if (*u == 'B' || *u == 'b') u++;
  if (errno || end == s || *u || !isfinite(v) || v <= 0 || v * mult > 1e18) return false;
  *bytes = v * mult;
  return true;
}

const char *fy_format_bytes(double b, char *buf, size_t n) {
  if (b >= 1099511627776.0) snprintf(buf, n, "%.2f TiB", b / 1099511627776.0);
  else if (b >= 1073741824.0) snprintf(buf, n, "%.2f GiB", b / 1073741824.0);
  else if (b >= 1048576.0) snprintf(buf, n, "%.1f MiB", b / 1048576.0);
  else if (b >= 1024.0) snprintf(buf, n, "%.1f KiB", b / 1024.0);
  else snprintf(buf, n, "%.0f B", b);
  return buf;
}
