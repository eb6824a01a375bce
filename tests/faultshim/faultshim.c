/*
 * faultshim: an LD_PRELOAD library that makes file operations on chosen paths fail with a chosen errno, shifts
 * the wall clock, and can pause a process at a chosen moment. Used by tests/test_faults.py to give real merges
 * (Python's os calls and SQLite's own I/O alike) the failures disks really produce: ENOSPC, EIO, EROFS, EACCES.
 *
 * Configuration (environment, read once at load, or again by forkserver_child()):
 *   FAULTSHIM_MATCH        substring a path must contain for its operations to be faulted (no faults when unset)
 *   FAULTSHIM_OPS          comma list of: write (write/pwrite/writev on files opened under MATCH), fsync
 *                          (fsync/fdatasync), open (opens for writing or creating, mkdir), rename, unlink
 *   FAULTSHIM_ERRNO        ENOSPC | EIO | EROFS | EACCES | EDQUOT | EFBIG | a number        [default ENOSPC]
 *   FAULTSHIM_SKIP         matching operations that still succeed before the faults start   [default 0]
 *   FAULTSHIM_SKIP_BYTES   bytes of matching writes that still succeed; the write that crosses the limit is short
 *                          (as on a real full disk) and the next one fails                  [default unlimited]
 *   FAULTSHIM_ARM_RENAMES  faults, the clock shift and the pause start only after this many successful renames onto
 *                          paths containing FAULTSHIM_ARM_MATCH (e.g. after the 2nd shard was published) [default 0]
 *   FAULTSHIM_ARM_MATCH    substring for the renames counted above                          [default MATCH]
 *   FAULTSHIM_CLOCK_SHIFT  seconds (may be negative) added to the wall clock (CLOCK_REALTIME, time,
 *                          gettimeofday) once armed; CLOCK_MONOTONIC is left alone, as the kernel does on a jump
 *   FAULTSHIM_PAUSE_FLAG   when arming, create this file and wait (up to 120 s) until someone deletes it
 *   FAULTSHIM_LOG          append one line per injected fault (the first 50) to this file
 * Once the faults start they stay: a full disk stays full until the test removes the shim.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define OP_WRITE 1
#define OP_FSYNC 2
#define OP_OPEN 4
#define OP_RENAME 8
#define OP_UNLINK 16
#define MAX_FD 65536

static const char *match_s, *arm_match_s, *pause_flag_s, *log_s;
static int ops, fault_errno = ENOSPC;
static long skip_calls, arm_renames;
static long long skip_bytes = -1;
static long long clock_shift;
static atomic_char tracked[MAX_FD];
static atomic_long calls, renames_seen, fired;
static atomic_llong bytes_written;
static atomic_int armed;

static ssize_t (*real_write)(int, const void *, size_t);
static ssize_t (*real_pwrite)(int, const void *, size_t, off_t);
static ssize_t (*real_pwrite64)(int, const void *, size_t, off_t);
static ssize_t (*real_writev)(int, const struct iovec *, int);
static int (*real_fsync)(int), (*real_fdatasync)(int), (*real_close)(int);
static int (*real_open)(const char *, int, ...), (*real_open64)(const char *, int, ...);
static int (*real_openat)(int, const char *, int, ...), (*real_openat64)(int, const char *, int, ...);
static int (*real_mkdir)(const char *, mode_t);
static int (*real_rename)(const char *, const char *);
static int (*real_renameat)(int, const char *, int, const char *);
static int (*real_renameat2)(int, const char *, int, const char *, unsigned int);
static int (*real_unlink)(const char *), (*real_unlinkat)(int, const char *, int);
static int (*real_clock_gettime)(clockid_t, struct timespec *);
static int (*real_gettimeofday)(struct timeval *, void *);
static time_t (*real_time)(time_t *);

#define RESOLVE(name) real_##name = dlsym(RTLD_NEXT, #name)

static int parse_errno(const char *s) {
    static const struct { const char *name; int value; } names[] = {
        {"ENOSPC", ENOSPC}, {"EIO", EIO}, {"EROFS", EROFS}, {"EACCES", EACCES}, {"EDQUOT", EDQUOT},
        {"EFBIG", EFBIG}, {"EPERM", EPERM},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strcmp(s, names[i].name) == 0) return names[i].value;
    return atoi(s) > 0 ? atoi(s) : ENOSPC;
}

/* The settings read from the environment, every count started from zero. */
static void configure(void) {
    ops = 0;
    fault_errno = ENOSPC;
    skip_calls = arm_renames = 0;
    skip_bytes = -1;
    clock_shift = 0;
    atomic_store(&calls, 0);
    atomic_store(&renames_seen, 0);
    atomic_store(&fired, 0);
    atomic_store(&bytes_written, 0);
    for (int fd = 0; fd < MAX_FD; fd++) atomic_store(&tracked[fd], 0);
    match_s = getenv("FAULTSHIM_MATCH");
    if (match_s && !*match_s) match_s = NULL;
    const char *o = getenv("FAULTSHIM_OPS");
    if (!o) o = "write";
    if (strstr(o, "write")) ops |= OP_WRITE;
    if (strstr(o, "fsync")) ops |= OP_FSYNC;
    if (strstr(o, "open")) ops |= OP_OPEN;
    if (strstr(o, "rename")) ops |= OP_RENAME;
    if (strstr(o, "unlink")) ops |= OP_UNLINK;
    const char *e = getenv("FAULTSHIM_ERRNO");
    if (e) fault_errno = parse_errno(e);
    if ((e = getenv("FAULTSHIM_SKIP"))) skip_calls = atol(e);
    if ((e = getenv("FAULTSHIM_SKIP_BYTES"))) skip_bytes = atoll(e);
    if ((e = getenv("FAULTSHIM_ARM_RENAMES"))) arm_renames = atol(e);
    if ((e = getenv("FAULTSHIM_CLOCK_SHIFT"))) clock_shift = atoll(e);
    arm_match_s = getenv("FAULTSHIM_ARM_MATCH");
    if (!arm_match_s || !*arm_match_s) arm_match_s = match_s;
    pause_flag_s = getenv("FAULTSHIM_PAUSE_FLAG");
    log_s = getenv("FAULTSHIM_LOG");
    atomic_store(&armed, arm_renames <= 0);
}

__attribute__((constructor)) static void init(void) {
    RESOLVE(write); RESOLVE(pwrite); RESOLVE(pwrite64); RESOLVE(writev); RESOLVE(fsync); RESOLVE(fdatasync);
    RESOLVE(close); RESOLVE(open); RESOLVE(open64); RESOLVE(openat); RESOLVE(openat64); RESOLVE(mkdir);
    RESOLVE(rename); RESOLVE(renameat); RESOLVE(renameat2); RESOLVE(unlink); RESOLVE(unlinkat);
    RESOLVE(clock_gettime); RESOLVE(gettimeofday); RESOLVE(time);
    configure();
}

/* Read the settings again, as a process started now would: a process forked from one the shim was loaded into
 * (the tests' fork server, tests/forkserver.py) calls it once its environment is the command's. */
void forkserver_child(void) { configure(); }

/* The absolute form of ``path`` relative to ``dirfd`` (best effort: AT_FDCWD or a directory descriptor). */
static void absolute(int dirfd, const char *path, char *out, size_t size) {
    if (!path) { out[0] = 0; return; }
    if (path[0] == '/') { snprintf(out, size, "%s", path); return; }
    char base[PATH_MAX] = "";
    if (dirfd == AT_FDCWD) {
        if (!getcwd(base, sizeof base)) base[0] = 0;
    } else {
        char link[64];
        snprintf(link, sizeof link, "/proc/self/fd/%d", dirfd);
        ssize_t n = readlink(link, base, sizeof base - 1);
        base[n > 0 ? n : 0] = 0;
    }
    snprintf(out, size, "%s/%s", base, path);
}

static int matches(const char *abs) { return match_s && abs && strstr(abs, match_s) != NULL; }

static void note(const char *op, const char *what) {
    long n = atomic_fetch_add(&fired, 1);
    if (!log_s || n >= 50) return;
    int fd = real_open(log_s, O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd < 0) return;
    char line[PATH_MAX + 64];
    int len = snprintf(line, sizeof line, "%s %d %s\n", op, fault_errno, what ? what : "");
    if (len > 0) real_write(fd, line, (size_t)len < sizeof line ? (size_t)len : sizeof line - 1);
    real_close(fd);
}

/* True when this matching operation of kind ``op`` must fail (counts it). */
static int should_fail(int op) {
    if (!(ops & op) || !atomic_load(&armed)) return 0;
    return atomic_fetch_add(&calls, 1) >= skip_calls;
}

static void track(int fd, const char *abs) {
    if (fd >= 0 && fd < MAX_FD) atomic_store(&tracked[fd], (char)matches(abs));
}

static int is_tracked(int fd) { return fd >= 0 && fd < MAX_FD && atomic_load(&tracked[fd]); }

static void fd_name(int fd, char *out, size_t size) {
    char link[64];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, out, size - 1);
    out[n > 0 ? n : 0] = 0;
}

/* How many of ``count`` bytes a write to ``fd`` may pass on; -1 means fail the call with fault_errno. */
static long long write_allowance(int fd, size_t count, const char *op) {
    if (!is_tracked(fd) || !(ops & OP_WRITE) || !atomic_load(&armed)) return (long long)count;
    char name[PATH_MAX];
    if (skip_bytes >= 0) {
        long long before = atomic_fetch_add(&bytes_written, (long long)count);
        long long left = skip_bytes - before;
        if (left >= (long long)count) return (long long)count;
        if (left > 0) return left;
        fd_name(fd, name, sizeof name);
        note(op, name);
        return -1;
    }
    if (!should_fail(OP_WRITE)) return (long long)count;
    fd_name(fd, name, sizeof name);
    note(op, name);
    return -1;
}

ssize_t write(int fd, const void *buf, size_t count) {
    long long n = write_allowance(fd, count, "write");
    if (n < 0) { errno = fault_errno; return -1; }
    return real_write(fd, buf, (size_t)n);
}

ssize_t pwrite(int fd, const void *buf, size_t count, off_t offset) {
    long long n = write_allowance(fd, count, "pwrite");
    if (n < 0) { errno = fault_errno; return -1; }
    return real_pwrite(fd, buf, (size_t)n, offset);
}

ssize_t pwrite64(int fd, const void *buf, size_t count, off_t offset) {
    long long n = write_allowance(fd, count, "pwrite64");
    if (n < 0) { errno = fault_errno; return -1; }
    return real_pwrite64(fd, buf, (size_t)n, offset);
}

ssize_t writev(int fd, const struct iovec *iov, int iovcnt) {
    size_t total = 0;
    for (int i = 0; i < iovcnt; i++) total += iov[i].iov_len;
    long long n = write_allowance(fd, total, "writev");
    if (n < 0) { errno = fault_errno; return -1; }
    if ((size_t)n == total) return real_writev(fd, iov, iovcnt);
    return n > 0 ? real_write(fd, iov[0].iov_base, (size_t)n < iov[0].iov_len ? (size_t)n : iov[0].iov_len) : 0;
}

static int sync_common(int fd, int (*real)(int), const char *op) {
    if (is_tracked(fd) && should_fail(OP_FSYNC)) {
        char name[PATH_MAX];
        fd_name(fd, name, sizeof name);
        note(op, name);
        errno = fault_errno;
        return -1;
    }
    return real(fd);
}

int fsync(int fd) { return sync_common(fd, real_fsync, "fsync"); }
int fdatasync(int fd) { return sync_common(fd, real_fdatasync, "fdatasync"); }

int close(int fd) {
    if (fd >= 0 && fd < MAX_FD) atomic_store(&tracked[fd], 0);
    return real_close(fd);
}

static int writes(int flags) { return (flags & (O_WRONLY | O_RDWR | O_CREAT | O_TRUNC)) != 0; }

static int open_common(int dirfd, const char *path, int flags, mode_t mode, int use_at, int large) {
    char abs[PATH_MAX];
    absolute(dirfd, path, abs, sizeof abs);
    if (writes(flags) && matches(abs) && should_fail(OP_OPEN)) {
        note("open", abs);
        errno = fault_errno;
        return -1;
    }
    int fd;
    if (use_at) fd = large ? real_openat64(dirfd, path, flags, mode) : real_openat(dirfd, path, flags, mode);
    else fd = large ? real_open64(path, flags, mode) : real_open(path, flags, mode);
    track(fd, abs);
    return fd;
}

#define MODE_ARG(flags) \
    mode_t mode = 0; \
    if ((flags) & (O_CREAT | __O_TMPFILE)) { va_list ap; va_start(ap, flags); mode = va_arg(ap, mode_t); va_end(ap); }

int open(const char *path, int flags, ...) { MODE_ARG(flags); return open_common(AT_FDCWD, path, flags, mode, 0, 0); }
int open64(const char *path, int flags, ...) { MODE_ARG(flags); return open_common(AT_FDCWD, path, flags, mode, 0, 1); }
int openat(int dirfd, const char *path, int flags, ...) {
    MODE_ARG(flags);
    return open_common(dirfd, path, flags, mode, 1, 0);
}
int openat64(int dirfd, const char *path, int flags, ...) {
    MODE_ARG(flags);
    return open_common(dirfd, path, flags, mode, 1, 1);
}

int mkdir(const char *path, mode_t mode) {
    char abs[PATH_MAX];
    absolute(AT_FDCWD, path, abs, sizeof abs);
    if (matches(abs) && should_fail(OP_OPEN)) {
        struct stat st;
        if (stat(path, &st) == 0) { errno = EEXIST; return -1; } /* as on a real read-only filesystem */
        note("mkdir", abs);
        errno = fault_errno;
        return -1;
    }
    return real_mkdir(path, mode);
}

/* Count a successful rename onto ``dst``; the one that reaches FAULTSHIM_ARM_RENAMES arms the shim. */
static void after_rename(const char *dst) {
    if (atomic_load(&armed) || !arm_match_s || !strstr(dst, arm_match_s)) return;
    if (atomic_fetch_add(&renames_seen, 1) + 1 != arm_renames) return;
    atomic_store(&armed, 1);
    if (!pause_flag_s) return;
    int fd = real_open(pause_flag_s, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) real_close(fd);
    struct stat st;
    struct timespec nap = {0, 5 * 1000 * 1000};
    for (int i = 0; i < 24000 && stat(pause_flag_s, &st) == 0; i++) nanosleep(&nap, NULL);
}

static int rename_common(int olddirfd, const char *oldpath, int newdirfd, const char *newpath, unsigned flags,
                         int kind) {
    char src[PATH_MAX], dst[PATH_MAX];
    absolute(olddirfd, oldpath, src, sizeof src);
    absolute(newdirfd, newpath, dst, sizeof dst);
    if ((matches(src) || matches(dst)) && should_fail(OP_RENAME)) {
        note("rename", dst);
        errno = fault_errno;
        return -1;
    }
    int rc;
    if (kind == 0) rc = real_rename(oldpath, newpath);
    else if (kind == 1) rc = real_renameat(olddirfd, oldpath, newdirfd, newpath);
    else rc = real_renameat2(olddirfd, oldpath, newdirfd, newpath, flags);
    if (rc == 0) after_rename(dst);
    return rc;
}

int rename(const char *o, const char *n) { return rename_common(AT_FDCWD, o, AT_FDCWD, n, 0, 0); }
int renameat(int od, const char *o, int nd, const char *n) { return rename_common(od, o, nd, n, 0, 1); }
int renameat2(int od, const char *o, int nd, const char *n, unsigned f) { return rename_common(od, o, nd, n, f, 2); }

static int unlink_common(int dirfd, const char *path, int flags, int at) {
    char abs[PATH_MAX];
    absolute(dirfd, path, abs, sizeof abs);
    if (matches(abs) && should_fail(OP_UNLINK)) {
        note("unlink", abs);
        errno = fault_errno;
        return -1;
    }
    return at ? real_unlinkat(dirfd, path, flags) : real_unlink(path);
}

int unlink(const char *path) { return unlink_common(AT_FDCWD, path, 0, 0); }
int unlinkat(int dirfd, const char *path, int flags) { return unlink_common(dirfd, path, flags, 1); }

static int shifted(clockid_t id) {
    return clock_shift && atomic_load(&armed) && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE);
}

int clock_gettime(clockid_t id, struct timespec *ts) {
    int rc = real_clock_gettime(id, ts);
    if (rc == 0 && shifted(id)) ts->tv_sec += clock_shift;
    return rc;
}

int gettimeofday(struct timeval *tv, void *tz) {
    int rc = real_gettimeofday(tv, tz);
    if (rc == 0 && shifted(CLOCK_REALTIME)) tv->tv_sec += clock_shift;
    return rc;
}

time_t time(time_t *out) {
    time_t now = real_time(NULL);
    if (shifted(CLOCK_REALTIME)) now += clock_shift;
    if (out) *out = now;
    return now;
}
