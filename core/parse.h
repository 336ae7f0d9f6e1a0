// Reading numbers a person wrote (command-line flags, probe overrides), and writing sizes for one.
#ifndef FY_PARSE_H
#define FY_PARSE_H

#include <stdbool.h>
#include <stddef.h>

// A size: a positive number with an optional binary unit B, K/KB/KiB, M/MB/MiB, G/GB/GiB or
// T/TB/TiB (case-insensitive; one space may come before it), at most 1e18 bytes. *bytes receives
// the number of bytes (not rounded); false, and *bytes untouched, for anything else.
bool fy_parse_size(const char *s, double *bytes);
// Bytes in the unit that reads best ("1.50 GiB", "12.3 MiB", "4.0 KiB", "512 B") into buf; returns buf.
const char *fy_format_bytes(double bytes, char *buf, size_t n);

#endif
