// Reading numbers a person wrote (command-line flags, probe overrides).
#ifndef FY_PARSE_H
#define FY_PARSE_H

#include <stdbool.h>

// A size: a positive number with an optional binary unit B, K/KB/KiB, M/MB/MiB, G/GB/GiB or
// T/TB/TiB (case-insensitive), at most 1e18 bytes. *bytes receives the number of bytes (not
// rounded); false, and *bytes untouched, for anything else.
bool fy_parse_size(const char *s, double *bytes);

#endif
