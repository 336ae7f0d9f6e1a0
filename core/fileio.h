// Whole-file reads and atomic file writes (core/fileio.c).
#ifndef FY_FILEIO_H
#define FY_FILEIO_H

#include <stddef.h>
#include <stdint.h>

#include "core/status.h"

// Reads the whole regular file at `path` into *buf (malloc'd, NUL-terminated; its length without
// the NUL in *len, which may be NULL). A missing file is FY_ERR_NOT_FOUND; a file over max bytes is
// FY_ERR_FORMAT ("too large for <what>", what such as "a config.json"): small files only, read
// whole. Every error names the file.
fy_status fy_file_read_all(const char *path, size_t max, const char *what, char **buf, size_t *len);

struct fy_file_piece {
  const void *data;
  size_t n;
};

// Writes the pieces, in order, to `path`: into "<path>.tmp.XXXXXX" next to it, fsync'd, renamed
// over `path`, and the directory fsync'd. On failure (a full disk among them) the temporary file
// is removed and an existing `path` is untouched; the error names the file and the cause.
fy_status fy_file_write_atomic(const char *path, const struct fy_file_piece *pieces, int npieces);
// write(2) until all n bytes are out (EINTR retried; no progress is an error: a full disk).
fy_status fy_file_write_all(int fd, const void *buf, size_t n, const char *path);
// pwrite(2) until all n bytes are out at offset off (as fy_file_write_all).
fy_status fy_file_pwrite_all(int fd, const void *buf, size_t n, uint64_t off, const char *path);
// A file written in place, in any order, before it takes its name: create makes
// "<path>.tmp.XXXXXX" (mode 0644; *tmp is malloc'd); commit fsyncs and closes it, renames it over
// path and fsyncs the directory (on failure it is removed); discard closes and removes it. Both
// free tmp.
fy_status fy_file_temp_create(const char *path, char **tmp, int *fd);
fy_status fy_file_temp_commit(const char *path, char *tmp, int fd);
void fy_file_temp_discard(char *tmp, int fd);
// fsync of the directory holding `path` (a rename's durability).
fy_status fy_file_sync_parent(const char *path);

// mkdir -p: creates dir and its missing parents (an existing directory is fine).
fy_status fy_mkdir_p(const char *dir);

#endif
