// Whole-file reads (the small JSON files: configs, indexes, probe files) and atomic file writes: every file ferry writes for a user (configs, weights, shards, checkpoint
// indexes, plans) goes through here, so that a crash or a full disk never leaves half a file
// under the real name.
#include "core/fileio.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

fy_status fy_file_read_all(const char *path, size_t max, const char *what, char **buf, size_t *len) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int e = errno;
    return fy_error_set(e == ENOENT ? FY_ERR_NOT_FOUND : FY_ERR_IO, "cannot open %s: %s", path, strerror(e));
  }
  struct stat sb;
  if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
    close(fd);
    return fy_error_set(FY_ERR_IO, "%s is not a readable regular file", path);
  }
  if ((uint64_t)sb.st_size > (uint64_t)max) {
    close(fd);
    return fy_error_set(FY_ERR_FORMAT, "%s: %lld bytes is too large for %s", path, (long long)sb.st_size, what);
  }
  size_t n = (size_t)sb.st_size, got = 0;
  char *b = malloc(n + 1);
  if (!b) {
    close(fd);
    return fy_error_set(FY_ERR_NOMEM, "out of memory reading %s", path);
  }
  while (got < n) {
    ssize_t r = read(fd, b + got, n - got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {  // (0: the file shrank under us)
      int e = r < 0 ? errno : EIO;
      free(b);
      close(fd);
      return fy_error_set(FY_ERR_IO, "reading %s: %s", path, strerror(e));
    }
    got += (size_t)r;
  }
  close(fd);
  b[n] = 0;
  *buf = b;
  if (len) *len = n;
  return FY_OK;
}

// write(2), or pwrite(2) at off when off >= 0, until all n bytes are out.
static fy_status write_out(int fd, const void *buf, size_t n, int64_t off, const char *path) {
  const char *p = buf;
  while (n > 0) {
    size_t chunk = n > (1u << 30) ? (1u << 30) : n;
    ssize_t w = off < 0 ? write(fd, p, chunk) : pwrite(fd, p, chunk, (off_t)off);
    if (w < 0) {
      if (errno == EINTR) continue;
      return fy_error_set(FY_ERR_IO, "writing %s: %s", path, strerror(errno));
    }
    if (w == 0) return fy_error_set(FY_ERR_IO, "writing %s: no progress (disk full?)", path);
    p += w;
    n -= (size_t)w;
    if (off >= 0) off += w;
  }
  return FY_OK;
}

fy_status fy_file_write_all(int fd, const void *buf, size_t n, const char *path) { return write_out(fd, buf, n, -1, path); }

fy_status fy_file_pwrite_all(int fd, const void *buf, size_t n, uint64_t off, const char *path) {
  return write_out(fd, buf, n, (int64_t)off, path);
}

// fsync the directory holding `path`, so that a rename into it survives a crash.
fy_status fy_file_sync_parent(const char *path) {
  char *d = strdup(path);
  if (!d) return fy_error_set(FY_ERR_NOMEM, "out of memory");
  char *slash = strrchr(d, '/');
  if (slash == d) slash[1] = 0;
  else if (slash) *slash = 0;
  else strcpy(d, ".");
  int fd = open(d, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  fy_status rc = FY_OK;
  if (fd >= 0) {
    // Some file systems cannot sync a directory (EINVAL); the data itself is already synced.
    if (fsync(fd) != 0 && errno != EINVAL && errno != EROFS)
      rc = fy_error_set(FY_ERR_IO, "syncing directory %s: %s", d, strerror(errno));
    close(fd);
  }
  free(d);
  return rc;
}

fy_status fy_file_temp_create(const char *path, char **tmp_out, int *fd_out) {
  size_t len = strlen(path);
  char *tmp = malloc(len + 12);
  if (!tmp) return fy_error_set(FY_ERR_NOMEM, "out of memory");
  memcpy(tmp, path, len);
  memcpy(tmp + len, ".tmp.XXXXXX", 12);
  int fd = mkostemp(tmp, O_CLOEXEC);
  if (fd < 0) {
    fy_status e = fy_error_set(FY_ERR_IO, "cannot create a temporary file next to %s: %s", path,
                               strerror(errno));
    free(tmp);
    return e;
  }
  if (fchmod(fd, 0644) != 0) {
    fy_status e = fy_error_set(FY_ERR_IO, "chmod %s: %s", tmp, strerror(errno));
    fy_file_temp_discard(tmp, fd);
    return e;
  }
  *tmp_out = tmp;
  *fd_out = fd;
  return FY_OK;
}

fy_status fy_file_temp_commit(const char *path, char *tmp, int fd) {
  fy_status rc = FY_OK;
  if (fsync(fd) != 0) rc = fy_error_set(FY_ERR_IO, "fsync %s: %s", tmp, strerror(errno));
  if (close(fd) != 0 && rc == FY_OK) rc = fy_error_set(FY_ERR_IO, "closing %s: %s", tmp, strerror(errno));
  if (rc == FY_OK && rename(tmp, path) != 0)
    rc = fy_error_set(FY_ERR_IO, "cannot rename %s to %s: %s", tmp, path, strerror(errno));
  if (rc != FY_OK) unlink(tmp);
  free(tmp);
  return rc == FY_OK ? fy_file_sync_parent(path) : rc;
}

void fy_file_temp_discard(char *tmp, int fd) {
  close(fd);
  unlink(tmp);
  free(tmp);
}

// Writes the pieces to `path` atomically: "<path>.tmp.XXXXXX", fsync, rename, fsync the directory.
// On failure the temporary file is removed and an existing `path` is untouched.
fy_status fy_file_write_atomic(const char *path, const struct fy_file_piece *pieces, int npieces) {
  char *tmp;
  int fd;
  FY_TRY(fy_file_temp_create(path, &tmp, &fd));
  fy_status rc = FY_OK;
  for (int i = 0; rc == FY_OK && i < npieces; i++) rc = fy_file_write_all(fd, pieces[i].data, pieces[i].n, tmp);
  if (rc != FY_OK) {
    fy_file_temp_discard(tmp, fd);
    return rc;
  }
  return fy_file_temp_commit(path, tmp, fd);
}

fy_status fy_mkdir_p(const char *dir) {
  char tmp[4096];
  snprintf(tmp, sizeof tmp, "%s", dir);
  for (char *p = tmp + 1; *p; p++) {
    if (*p != '/') continue;
    *p = 0;
    if (mkdir(tmp, 0755) != 0 && errno != EEXIST)
      return fy_error_set(FY_ERR_IO, "cannot create directory %s: %s", tmp, strerror(errno));
    *p = '/';
  }
  if (mkdir(tmp, 0755) != 0 && errno != EEXIST)
    return fy_error_set(FY_ERR_IO, "cannot create directory %s: %s", tmp, strerror(errno));
  return FY_OK;
}
