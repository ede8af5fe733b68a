// The C side of Vanish: libfuse3's low-level API plus the Linux calls and
// constants that Swift's Glibc module does not import (it is built without
// _GNU_SOURCE, and defining it here would clash with that module). Every
// wrapper is a raw syscall so nothing depends on glibc feature macros.
#ifndef VANISH_CFUSE_H
#define VANISH_CFUSE_H

#define FUSE_USE_VERSION 314

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <dirent.h>
#include <malloc.h>
#include <sys/file.h>
#include <sys/xattr.h>
#include <linux/falloc.h>
#include <spawn.h>
#include <signal.h>
#include <sys/socket.h>
#include <linux/netlink.h>
#include <linux/connector.h>
#include <linux/cn_proc.h>
#include <sys/prctl.h>
#include <sys/vfs.h>
#include <linux/magic.h>
#include <fuse_lowlevel.h>

// Flags hidden behind _GNU_SOURCE. Values are the kernel ABI, identical on
// x86_64 and aarch64 except O_DIRECT.
#define VANISH_O_PATH 010000000
#if defined(__aarch64__)
#define VANISH_O_DIRECT 0200000
#else
#define VANISH_O_DIRECT 040000
#endif
#define VANISH_AT_EMPTY_PATH 0x1000
#define VANISH_RENAME_NOREPLACE 1u
#define VANISH_RENAME_EXCHANGE 2u
#define VANISH_RENAME_WHITEOUT 4u
#define VANISH_SEEK_DATA 3
#define VANISH_SEEK_HOLE 4
static const long VANISH_UTIME_NOW = (1l << 30) - 1l;
static const long VANISH_UTIME_OMIT = (1l << 30) - 2l;

static inline int vanish_renameat2(int olddirfd, const char *oldpath, int newdirfd,
                                   const char *newpath, unsigned int flags) {
    return (int)syscall(SYS_renameat2, olddirfd, oldpath, newdirfd, newpath, flags);
}

// struct statx as the kernel lays it out (256 bytes).
struct vanish_statx_timestamp { int64_t tv_sec; uint32_t tv_nsec; int32_t reserved; };
struct vanish_statx {
    uint32_t mask, blksize;
    uint64_t attributes;
    uint32_t nlink, uid, gid;
    uint16_t mode, spare0;
    uint64_t ino, size, blocks, attributes_mask;
    struct vanish_statx_timestamp atime, btime, ctime, mtime;
    uint32_t rdev_major, rdev_minor, dev_major, dev_minor;
    uint64_t spare[14];
};

static inline dev_t vanish_makedev(uint32_t major, uint32_t minor) {
    return ((dev_t)(major & 0xfffff000u) << 32) | ((dev_t)(major & 0xfffu) << 8) |
           ((dev_t)(minor & 0xffffff00u) << 12) | (dev_t)(minor & 0xffu);
}

/// statx(2) into a struct stat, with the inode's birth time in nanoseconds
/// (0 where the filesystem keeps none): unlike its number, which a new
/// file gets as soon as the old one is freed, it tells two inodes apart.
/// `attributes`, if not NULL, gets stx_attributes (STATX_ATTR_IMMUTABLE 0x10,
/// STATX_ATTR_APPEND 0x20, ...).
static inline int vanish_statx_stat(int dirfd, const char *path, int flags, struct stat *st, uint64_t *birth,
                                    uint64_t *attributes) {
    struct vanish_statx x;
    if (syscall(SYS_statx, dirfd, path, flags, 0x7ffu /* STATX_BASIC_STATS */ | 0x800u /* STATX_BTIME */, &x) != 0)
        return -1;
    if (attributes) *attributes = x.attributes & x.attributes_mask;
    memset(st, 0, sizeof *st);
    st->st_dev = vanish_makedev(x.dev_major, x.dev_minor);
    st->st_ino = x.ino;
    st->st_nlink = x.nlink;
    st->st_mode = x.mode;
    st->st_uid = x.uid;
    st->st_gid = x.gid;
    st->st_rdev = vanish_makedev(x.rdev_major, x.rdev_minor);
    st->st_size = (off_t)x.size;
    st->st_blksize = x.blksize;
    st->st_blocks = (blkcnt_t)x.blocks;
    st->st_atim.tv_sec = x.atime.tv_sec; st->st_atim.tv_nsec = x.atime.tv_nsec;
    st->st_mtim.tv_sec = x.mtime.tv_sec; st->st_mtim.tv_nsec = x.mtime.tv_nsec;
    st->st_ctim.tv_sec = x.ctime.tv_sec; st->st_ctim.tv_nsec = x.ctime.tv_nsec;
    if (birth) *birth = (x.mask & 0x800u) ? (uint64_t)x.btime.tv_sec * 1000000000u + x.btime.tv_nsec : 0;
    return 0;
}

static inline int vanish_stat_birth(int dirfd, const char *path, int flags, struct stat *st, uint64_t *birth) {
    return vanish_statx_stat(dirfd, path, flags, st, birth, NULL);
}

/* fchmodat2 (Linux 6.6): chmod of the inode behind an O_PATH fd with AT_EMPTY_PATH. */
static inline int vanish_fchmodat2(int dirfd, const char *path, mode_t mode, int flags) {
    return (int)syscall(452 /* SYS_fchmodat2 */, dirfd, path, mode, flags);
}

/* fstatfs(2)'s f_type (the filesystem's magic number), or -1. */
static inline long vanish_filesystem_type(int fd) {
    struct statfs fs;
    return fstatfs(fd, &fs) == 0 ? (long)fs.f_type : -1;
}

static const long VANISH_FUSE_SUPER_MAGIC = FUSE_SUPER_MAGIC;
static const long VANISH_OVERLAYFS_SUPER_MAGIC = OVERLAYFS_SUPER_MAGIC;

/* statfs(2)'s f_type for a path, or -1. */
static inline long vanish_filesystem_type_at(const char *path) {
    struct statfs fs;
    return statfs(path, &fs) == 0 ? (long)fs.f_type : -1;
}

/* prctl(PR_SET_NAME): the calling thread's name (15 bytes kept). prctl is
   variadic, which Swift cannot call. */
static inline int vanish_set_thread_name(const char *name) {
    return prctl(PR_SET_NAME, (unsigned long)name, 0ul, 0ul, 0ul);
}

static inline ssize_t vanish_copy_file_range(int fd_in, off_t *off_in, int fd_out,
                                             off_t *off_out, size_t len, unsigned int flags) {
    return (ssize_t)syscall(SYS_copy_file_range, fd_in, off_in, fd_out, off_out, len, flags);
}

static inline int vanish_fallocate(int fd, int mode, off_t offset, off_t len) {
    return (int)syscall(SYS_fallocate, fd, mode, offset, len);
}

static inline int vanish_faccessat2(int dirfd, const char *path, int mode, int flags) {
    return (int)syscall(SYS_faccessat2, dirfd, path, mode, flags);
}

// getxattrat/listxattrat (Linux 6.13): xattrs of a name relative to a
// directory fd, without opening the file. Same numbers on x86_64 and arm64.
#ifndef SYS_getxattrat
#define SYS_getxattrat 464
#endif
#ifndef SYS_listxattrat
#define SYS_listxattrat 465
#endif
struct vanish_xattr_args { uint64_t value; uint32_t size; uint32_t flags; };

static inline ssize_t vanish_getxattrat(int dirfd, const char *path, const char *name, void *value, size_t size) {
    struct vanish_xattr_args args = { (uint64_t)(uintptr_t)value, (uint32_t)size, 0 };
    return (ssize_t)syscall(SYS_getxattrat, dirfd, path, AT_SYMLINK_NOFOLLOW, name, &args, sizeof(args));
}

static inline ssize_t vanish_listxattrat(int dirfd, const char *path, char *list, size_t size) {
    return (ssize_t)syscall(SYS_listxattrat, dirfd, path, AT_SYMLINK_NOFOLLOW, list, size);
}

/// ioprio_set(IOPRIO_WHO_PROCESS, tid (0 = this thread), class << 13 | data).
static inline int vanish_ioprio_set_thread(int tid, int ioprio_class, int data) {
    return (int)syscall(SYS_ioprio_set, 1, tid, (ioprio_class << 13) | data);
}

// A signal that does nothing but break the blocking call of the one thread
// it is sent to (pthread_kill): installed without SA_RESTART, so that call
// returns EINTR and its caller looks at its exit flag again.
static inline void vanish_wake_handler(int sig) { (void)sig; }
static inline int vanish_install_wake_handler(int sig) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = vanish_wake_handler;
    sigemptyset(&sa.sa_mask);
    return sigaction(sig, &sa, NULL);
}

static inline pid_t vanish_gettid(void) { return (pid_t)syscall(SYS_gettid); }

/// The reply that lets libfuse splice file data straight from `fd` to the
/// kernel without copying it through user space.
static inline int vanish_reply_fd_data(fuse_req_t req, int fd, off_t offset, size_t size) {
    struct fuse_bufvec buf = FUSE_BUFVEC_INIT(size);
    buf.buf[0].flags = (enum fuse_buf_flags)(FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK);
    buf.buf[0].fd = fd;
    buf.buf[0].pos = offset;
    return fuse_reply_data(req, &buf, FUSE_BUF_SPLICE_MOVE);
}

/// pipe2(O_CLOEXEC).
static inline int vanish_pipe_cloexec(int fds[2]) { return (int)syscall(SYS_pipe2, fds, O_CLOEXEC); }

/// fcntl(F_SETPIPE_SZ): resizes a pipe; returns its new capacity or -1.
static inline int vanish_pipe_resize(int fd, int bytes) { return fcntl(fd, 1024 + 7, bytes); }

/// Copies the request's buffer (memory or pipe) into `fd` at `offset`;
/// returns bytes written or -errno.
static inline ssize_t vanish_write_buf_to_fd(struct fuse_bufvec *in, int fd, off_t offset) {
    struct fuse_bufvec out = FUSE_BUFVEC_INIT(fuse_buf_size(in));
    out.buf[0].flags = (enum fuse_buf_flags)(FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK);
    out.buf[0].fd = fd;
    out.buf[0].pos = offset;
    return fuse_buf_copy(&out, in, (enum fuse_buf_copy_flags)0);
}

/// Kept behind a function because libfuse >= 3.17 turns fuse_session_new into
/// a macro.
static inline struct fuse_session *vanish_session_new(struct fuse_args *args,
                                                      const struct fuse_lowlevel_ops *ops,
                                                      void *userdata) {
    return fuse_session_new(args, ops, sizeof(*ops), userdata);
}

static inline const char *vanish_dirent_name(const struct dirent *d) { return d->d_name; }

/// name_to_handle_at(2) into a caller's buffer: writes the handle type (4
/// bytes) and the handle into `out` and returns its length, or -1 with errno.
/// The handle names the inode and its generation, so it survives renames
/// and remounts and is not reused for another file: Vanish's file id.
/// (struct file_handle needs _GNU_SOURCE, which Swift's Glibc module clashes with.)
static inline int vanish_file_handle(int dirfd, const char *name, int flags, unsigned char *out, int capacity) {
    struct { unsigned int bytes; int type; unsigned char data[128]; } h;
    int mount_id;
    h.bytes = sizeof(h.data);
    if (syscall(SYS_name_to_handle_at, dirfd, name, &h, &mount_id, flags) != 0) return -1;
    if ((int)h.bytes + 4 > capacity) { errno = EOVERFLOW; return -1; }
    memcpy(out, &h.type, 4);
    memcpy(out + 4, h.data, h.bytes);
    return (int)h.bytes + 4;
}

/// posix_spawn_file_actions_addclosefrom_np (glibc 2.34), which Swift's Glibc
/// module does not import: a spawned child gets no descriptor above `from`,
/// so it cannot hold open files of a mount it knows nothing about.
static inline int vanish_spawn_closefrom(posix_spawn_file_actions_t *actions, int from) {
    return posix_spawn_file_actions_addclosefrom_np(actions, from);
}

/// A netlink socket on the kernel's process events connector, subscribed:
/// it hears of every fork, exec, rename (PR_SET_NAME) and exit on the
/// machine. -1 with errno where that is not allowed (it needs CAP_NET_ADMIN).
/// `rcvbuf`: the socket's queue in bytes (SO_RCVBUFFORCE, root only), so a
/// burst of process churn is not dropped.
static inline int vanish_proc_events_open(int rcvbuf) {
    int fd = socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_CONNECTOR);
    if (fd < 0) return -1;
    (void)setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &rcvbuf, sizeof rcvbuf);
    struct sockaddr_nl addr = { .nl_family = AF_NETLINK, .nl_groups = CN_IDX_PROC };
    struct __attribute__((packed)) {
        struct nlmsghdr nl;
        struct cn_msg cn;
        enum proc_cn_mcast_op op;
    } listen;
    memset(&listen, 0, sizeof listen);
    listen.nl.nlmsg_len = sizeof listen;
    listen.nl.nlmsg_type = NLMSG_DONE;
    listen.cn.id.idx = CN_IDX_PROC;
    listen.cn.id.val = CN_VAL_PROC;
    listen.cn.len = sizeof listen.op;
    listen.op = PROC_CN_MCAST_LISTEN;
    if (bind(fd, (struct sockaddr *)&addr, sizeof addr) != 0 || send(fd, &listen, sizeof listen, 0) < 0) {
        int saved = errno;
        close(fd);
        errno = saved;
        return -1;
    }
    return fd;
}

/// From `len` bytes that recv gave on that socket: the thread ids whose
/// /proc/PID/comm may now show another name (exec, PR_SET_NAME) or that
/// no longer name the same thread (exit). Returns the count, or -1 if
/// there were more than `cap`.
static inline int vanish_proc_events_changed(const void *buf, int len, pid_t *out, int cap) {
    int n = 0;
    for (const struct nlmsghdr *nh = buf; NLMSG_OK(nh, len); nh = NLMSG_NEXT(nh, len)) {
        if (n + 2 > cap) return -1;
        if (nh->nlmsg_type != NLMSG_DONE) continue;
        const struct cn_msg *cn = NLMSG_DATA(nh);
        if (cn->id.idx != CN_IDX_PROC || cn->id.val != CN_VAL_PROC) continue;
        const struct proc_event *ev = (const void *)cn->data;
        switch (ev->what) {
        case PROC_EVENT_EXEC:
            // The thread that exec'd becomes its group's leader.
            out[n++] = ev->event_data.exec.process_pid;
            out[n++] = ev->event_data.exec.process_tgid;
            break;
        case PROC_EVENT_COMM:
            out[n++] = ev->event_data.comm.process_pid;
            break;
        case PROC_EVENT_EXIT:
            out[n++] = ev->event_data.exit.process_pid;
            break;
        default:
            break;
        }
    }
    return n;
}

/// mallopt(M_MMAP_THRESHOLD): blocks of `bytes` and more get pages of their
/// own, given back when freed. Setting it also stops glibc from raising the
/// threshold after each such free, which put large blocks (a map sized for
/// a burst of files) in the arenas, where they stayed.
static inline int vanish_set_mmap_threshold(int bytes) {
    return mallopt(M_MMAP_THRESHOLD, bytes);
}

/// malloc_trim(0): hands the free pages of every malloc arena back to the
/// kernel (glibc returns only the top of the main heap by itself).
static inline int vanish_malloc_trim(void) {
    return malloc_trim(0);
}

#endif
