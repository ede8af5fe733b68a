// Compiled with _GNU_SOURCE (Package.swift): every constant comes from the
// system headers, and the layouts Vanish relies on are checked here.
#include "CLinux.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/connector.h>
#include <sys/fanotify.h>
#include <linux/cn_proc.h>
#include <linux/fs.h>
#include <linux/ioprio.h>
#include <sched.h>
#include <linux/magic.h>
#include <linux/mount.h>
#include <linux/netlink.h>
#include <malloc.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/vfs.h>
#include <unistd.h>

#ifndef _GNU_SOURCE
#error "CLinux must be compiled with _GNU_SOURCE"
#endif

const int VANISH_O_PATH = O_PATH;
const int VANISH_O_DIRECT = O_DIRECT;
const int VANISH_O_NOATIME = O_NOATIME;
const int VANISH_O_TMPFILE = O_TMPFILE;
const unsigned int VANISH_FS_IOC_GETFLAGS = (unsigned int)FS_IOC_GETFLAGS;
const unsigned int VANISH_FS_IOC_SETFLAGS = (unsigned int)FS_IOC_SETFLAGS;
const unsigned int VANISH_FS_IOC_FSGETXATTR = (unsigned int)FS_IOC_FSGETXATTR;
const unsigned int VANISH_FS_IOC_FSSETXATTR = (unsigned int)FS_IOC_FSSETXATTR;
const unsigned int VANISH_IOC_REMOVE_ON_RMDIR = (unsigned int)_IO('v', 0xd1);

int vanish_ioctl_none(int fd, unsigned int cmd) {
    return ioctl(fd, cmd);
}

int vanish_fileattr_ioctl(int fd, unsigned int cmd, const void *in, size_t in_size, void *out, size_t out_size) {
    if (cmd == (unsigned int)FS_IOC_GETFLAGS && out_size >= sizeof(int)) {
        int flags = 0;
        if (ioctl(fd, FS_IOC_GETFLAGS, &flags) != 0) return -errno;
        memcpy(out, &flags, sizeof flags);
        return 0;
    }
    if (cmd == (unsigned int)FS_IOC_SETFLAGS && in_size >= sizeof(int)) {
        int flags;
        memcpy(&flags, in, sizeof flags);
        return ioctl(fd, FS_IOC_SETFLAGS, &flags) != 0 ? -errno : 0;
    }
    if (cmd == (unsigned int)FS_IOC_FSGETXATTR && out_size >= sizeof(struct fsxattr)) {
        struct fsxattr x;
        memset(&x, 0, sizeof x);
        if (ioctl(fd, FS_IOC_FSGETXATTR, &x) != 0) return -errno;
        memcpy(out, &x, sizeof x);
        return 0;
    }
    if (cmd == (unsigned int)FS_IOC_FSSETXATTR && in_size >= sizeof(struct fsxattr)) {
        struct fsxattr x;
        memcpy(&x, in, sizeof x);
        return ioctl(fd, FS_IOC_FSSETXATTR, &x) != 0 ? -errno : 0;
    }
    return -ENOTTY;
}
const int VANISH_AT_EMPTY_PATH = AT_EMPTY_PATH;
const int VANISH_MAX_HANDLE_SZ = MAX_HANDLE_SZ;
const unsigned int VANISH_RENAME_NOREPLACE = RENAME_NOREPLACE;
const unsigned int VANISH_RENAME_EXCHANGE = RENAME_EXCHANGE;
const int VANISH_SEEK_DATA = SEEK_DATA;
const int VANISH_SEEK_HOLE = SEEK_HOLE;
const long VANISH_UTIME_NOW = UTIME_NOW;
const long VANISH_UTIME_OMIT = UTIME_OMIT;
const short VANISH_POLLRDHUP = POLLRDHUP;
const long VANISH_FUSE_SUPER_MAGIC = FUSE_SUPER_MAGIC;
const long VANISH_OVERLAYFS_SUPER_MAGIC = OVERLAYFS_SUPER_MAGIC;

// Kernel ABI facts the Swift side depends on.
_Static_assert(sizeof(struct statx) == 256, "struct statx is 256 bytes");
_Static_assert(sizeof(dev_t) == 8, "dev_t is 64-bit");

// Newer than Debian 12's kernel headers (6.1): numbers from the kernel's
// unified syscall table, the same on every architecture.
#ifndef SYS_fchmodat2
#define SYS_fchmodat2 452
#endif
#ifndef SYS_getxattrat
#define SYS_getxattrat 464
#endif
#ifndef SYS_listxattrat
#define SYS_listxattrat 465
#endif

int vanish_renameat2(int olddirfd, const char *oldpath, int newdirfd, const char *newpath, unsigned int flags) {
    return renameat2(olddirfd, oldpath, newdirfd, newpath, flags);
}

static void fill_stat(const struct statx *xp, struct stat *st) {
    const struct statx x = *xp;
    memset(st, 0, sizeof *st);
    st->st_dev = makedev(x.stx_dev_major, x.stx_dev_minor);
    st->st_ino = x.stx_ino;
    st->st_nlink = x.stx_nlink;
    st->st_mode = x.stx_mode;
    st->st_uid = x.stx_uid;
    st->st_gid = x.stx_gid;
    st->st_rdev = makedev(x.stx_rdev_major, x.stx_rdev_minor);
    st->st_size = (off_t)x.stx_size;
    st->st_blksize = x.stx_blksize;
    st->st_blocks = (blkcnt_t)x.stx_blocks;
    st->st_atim.tv_sec = x.stx_atime.tv_sec; st->st_atim.tv_nsec = x.stx_atime.tv_nsec;
    st->st_mtim.tv_sec = x.stx_mtime.tv_sec; st->st_mtim.tv_nsec = x.stx_mtime.tv_nsec;
    st->st_ctim.tv_sec = x.stx_ctime.tv_sec; st->st_ctim.tv_nsec = x.stx_ctime.tv_nsec;
}

int vanish_statx_stat(int dirfd, const char *path, int flags, struct stat *st, uint64_t *birth, uint64_t *attributes) {
    struct statx x;
    if (statx(dirfd, path, flags, STATX_BASIC_STATS | STATX_BTIME, &x) != 0) return -1;
    if (attributes) *attributes = x.stx_attributes & x.stx_attributes_mask;
    fill_stat(&x, st);
    if (birth) *birth = (x.stx_mask & STATX_BTIME) ? (uint64_t)x.stx_btime.tv_sec * 1000000000u + x.stx_btime.tv_nsec : 0;
    return 0;
}

int vanish_lstat_cached(int dirfd, const char *path, struct stat *st, uint64_t *mount_id) {
    struct statx x;
    int flags = AT_SYMLINK_NOFOLLOW | AT_NO_AUTOMOUNT | AT_STATX_DONT_SYNC;
    if (statx(dirfd, path, flags, STATX_BASIC_STATS | STATX_MNT_ID, &x) != 0) return -1;
    if (!(x.stx_mask & STATX_MNT_ID)) { errno = ENOSYS; return -1; }
    fill_stat(&x, st);
    *mount_id = x.stx_mnt_id;
    return 0;
}

int vanish_mount_id(int dirfd, const char *path, uint64_t *id) {
    struct statx x;
    int flags = AT_SYMLINK_NOFOLLOW | (path[0] == 0 ? AT_EMPTY_PATH : 0);
    if (statx(dirfd, path, flags, STATX_MNT_ID, &x) != 0) return -1;
    if (!(x.stx_mask & STATX_MNT_ID)) { errno = ENOSYS; return -1; }
    *id = x.stx_mnt_id;
    return 0;
}

int vanish_stat_birth(int dirfd, const char *path, int flags, struct stat *st, uint64_t *birth) {
    return vanish_statx_stat(dirfd, path, flags, st, birth, NULL);
}

int vanish_attributes_protected(uint64_t attributes) {
    return (attributes & (STATX_ATTR_IMMUTABLE | STATX_ATTR_APPEND)) != 0;
}

int vanish_fchmodat2(int dirfd, const char *path, mode_t mode, int flags) {
    return (int)syscall(SYS_fchmodat2, dirfd, path, mode, flags);
}

// struct sched_attr (linux/sched/types.h clashes with glibc's sched.h).
struct vanish_sched_attr {
    uint32_t size, sched_policy;
    uint64_t sched_flags;
    int32_t sched_nice;
    uint32_t sched_priority;
    uint64_t sched_runtime, sched_deadline, sched_period;
    uint32_t sched_util_min, sched_util_max;
};

int vanish_thread_set_slice(uint32_t microseconds) {
    errno = 0;
    int nice = getpriority(PRIO_PROCESS, 0);
    if (nice == -1 && errno) return -1;
    struct vanish_sched_attr attr = { .size = sizeof attr, .sched_policy = SCHED_OTHER, .sched_nice = nice,
                                      .sched_runtime = (uint64_t)microseconds * 1000 };
    return (int)syscall(SYS_sched_setattr, 0, &attr, 0);
}

int vanish_pidfd_open(pid_t pid) {
    return (int)syscall(SYS_pidfd_open, pid, 0);
}

int vanish_pidfd_send_signal(int pidfd, int sig) {
    return (int)syscall(SYS_pidfd_send_signal, pidfd, sig, NULL, 0);
}

int vanish_faccessat2(int dirfd, const char *path, int mode, int flags) {
    return (int)syscall(SYS_faccessat2, dirfd, path, mode, flags);
}

ssize_t vanish_copy_file_range(int fd_in, off_t *off_in, int fd_out, off_t *off_out, size_t len, unsigned int flags) {
    return copy_file_range(fd_in, off_in, fd_out, off_out, len, flags);
}

int vanish_fallocate(int fd, int mode, off_t offset, off_t len) {
    return fallocate(fd, mode, offset, len);
}

long vanish_filesystem_type(int fd) {
    struct statfs fs;
    return fstatfs(fd, &fs) == 0 ? (long)fs.f_type : -1;
}

const long VANISH_EXT4_SUPER_MAGIC = EXT4_SUPER_MAGIC;
const long VANISH_XFS_SUPER_MAGIC = XFS_SUPER_MAGIC;
const long VANISH_BTRFS_SUPER_MAGIC = BTRFS_SUPER_MAGIC;
const long VANISH_TMPFS_MAGIC = TMPFS_MAGIC;
const long VANISH_NFS_SUPER_MAGIC = NFS_SUPER_MAGIC;
const long VANISH_CIFS_SUPER_MAGIC = CIFS_SUPER_MAGIC;
const long VANISH_SMB2_SUPER_MAGIC = SMB2_SUPER_MAGIC;
const long VANISH_SMB_SUPER_MAGIC = SMB_SUPER_MAGIC;
const long VANISH_CEPH_SUPER_MAGIC = CEPH_SUPER_MAGIC;
const long VANISH_AFS_FS_MAGIC = AFS_FS_MAGIC;
const long VANISH_V9FS_MAGIC = V9FS_MAGIC;

long vanish_filesystem_type_at(const char *path) {
    struct statfs fs;
    return statfs(path, &fs) == 0 ? (long)fs.f_type : -1;
}

// struct xattr_args of Linux 6.13 (not in Debian 12's headers).
struct vanish_xattr_args { uint64_t value; uint32_t size; uint32_t flags; };

ssize_t vanish_getxattrat(int dirfd, const char *path, const char *name, void *value, size_t size) {
    struct vanish_xattr_args args = { (uint64_t)(uintptr_t)value, (uint32_t)size, 0 };
    return (ssize_t)syscall(SYS_getxattrat, dirfd, path, AT_SYMLINK_NOFOLLOW, name, &args, sizeof(args));
}

ssize_t vanish_listxattrat(int dirfd, const char *path, char *list, size_t size) {
    return (ssize_t)syscall(SYS_listxattrat, dirfd, path, AT_SYMLINK_NOFOLLOW, list, size);
}

int vanish_set_thread_name(const char *name) {
    return prctl(PR_SET_NAME, (unsigned long)name, 0ul, 0ul, 0ul);
}

const int VANISH_IOPRIO_CLASS_IDLE = IOPRIO_CLASS_IDLE;
const int VANISH_IOPRIO_CLASS_BE = IOPRIO_CLASS_BE;
const int VANISH_IOPRIO_BE_LOWEST = IOPRIO_BE_NR - 1;
const int VANISH_SCHED_OTHER = SCHED_OTHER;
const int VANISH_SCHED_BATCH = SCHED_BATCH;
const int VANISH_SCHED_IDLE = SCHED_IDLE;

int vanish_ioprio_set_thread(int tid, int ioprio_class, int data) {
    return (int)syscall(SYS_ioprio_set, IOPRIO_WHO_PROCESS, tid, IOPRIO_PRIO_VALUE(ioprio_class, data));
}

pid_t vanish_gettid(void) { return gettid(); }

static void vanish_wake_handler(int sig) { (void)sig; }

int vanish_install_wake_handler(int sig) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = vanish_wake_handler;
    sigemptyset(&sa.sa_mask);
    return sigaction(sig, &sa, NULL);
}

int vanish_pipe_cloexec(int fds[2]) { return pipe2(fds, O_CLOEXEC); }

int vanish_pipe_resize(int fd, int bytes) { return fcntl(fd, F_SETPIPE_SZ, bytes); }

const char *vanish_dirent_name(const struct dirent *d) { return d->d_name; }
unsigned int vanish_major(dev_t dev) { return major(dev); }
unsigned int vanish_minor(dev_t dev) { return minor(dev); }

int vanish_file_handle(int dirfd, const char *name, int flags, unsigned char *out, int capacity) {
    struct { struct file_handle h; unsigned char data[MAX_HANDLE_SZ]; } h;
    int mount_id;
    h.h.handle_bytes = MAX_HANDLE_SZ;
    if (name_to_handle_at(dirfd, name, &h.h, &mount_id, flags) != 0) return -1;
    if ((int)h.h.handle_bytes + 4 > capacity) { errno = EOVERFLOW; return -1; }
    memcpy(out, &h.h.handle_type, 4);
    memcpy(out + 4, h.h.f_handle, h.h.handle_bytes);
    return (int)h.h.handle_bytes + 4;
}

int vanish_open_by_handle(int mount_fd, const unsigned char *in, int length, int flags) {
    struct { struct file_handle h; unsigned char data[MAX_HANDLE_SZ]; } h;
    if (length < 4 || length - 4 > MAX_HANDLE_SZ) { errno = EINVAL; return -1; }
    memcpy(&h.h.handle_type, in, 4);
    h.h.handle_bytes = (unsigned)(length - 4);
    memcpy(h.h.f_handle, in + 4, (size_t)(length - 4));
    return open_by_handle_at(mount_fd, &h.h, flags);
}

#define VANISH_FAN_ENTRY_MASK (FAN_CREATE | FAN_DELETE | FAN_MOVED_FROM | FAN_MOVED_TO)
#define VANISH_FAN_OBJECT_MASK (FAN_ATTRIB | FAN_MODIFY | FAN_DELETE_SELF | FAN_MOVE_SELF)
const uint64_t VANISH_FAN_ENTRY_CHANGED = VANISH_FAN_ENTRY_MASK;
const uint64_t VANISH_FAN_OBJECT_CHANGED = VANISH_FAN_OBJECT_MASK;
const uint64_t VANISH_FAN_DATA_CHANGED = FAN_MODIFY;
const uint64_t VANISH_FAN_Q_OVERFLOW = FAN_Q_OVERFLOW;

int vanish_fanotify_watch(int mount_fd) {
    int fd = fanotify_init(FAN_CLASS_NOTIF | FAN_CLOEXEC | FAN_UNLIMITED_QUEUE | FAN_REPORT_DFID_NAME | FAN_REPORT_FID,
                           O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    if (fanotify_mark(fd, FAN_MARK_ADD | FAN_MARK_FILESYSTEM,
                      VANISH_FAN_ENTRY_MASK | VANISH_FAN_OBJECT_MASK | FAN_ONDIR, mount_fd, NULL) != 0) {
        int saved = errno;
        close(fd);
        errno = saved;
        return -1;
    }
    return fd;
}

/// Copies a record's file handle into `out` in vanish_file_handle's form.
static int copy_fan_handle(const struct file_handle *h, const unsigned char *end, unsigned char *out) {
    if ((const unsigned char *)h->f_handle > end || h->handle_bytes > 128
        || (const unsigned char *)h->f_handle + h->handle_bytes > end) return 0;
    memcpy(out, &h->handle_type, 4);
    memcpy(out + 4, h->f_handle, h->handle_bytes);
    return 4 + (int)h->handle_bytes;
}

int vanish_fanotify_event(const unsigned char *buffer, int length, int *offset, struct vanish_fan_event *out) {
    int at = *offset;
    if (length - at < (int)sizeof(struct fanotify_event_metadata)) return 0;
    const struct fanotify_event_metadata *m = (const void *)(buffer + at);
    if (m->event_len < sizeof *m || (int)m->event_len > length - at) return 0;
    *offset = at + (int)m->event_len;
    out->mask = m->mask;
    out->pid = m->pid;
    out->dir_length = 0;
    out->object_length = 0;
    out->name = NULL;
    if (m->fd >= 0) close(m->fd);
    const unsigned char *end = buffer + at + m->event_len;
    const unsigned char *p = buffer + at + m->metadata_len;
    while (p + sizeof(struct fanotify_event_info_header) <= end) {
        const struct fanotify_event_info_header *h = (const void *)p;
        if (h->len < sizeof *h || p + h->len > end) break;
        if (h->len >= sizeof(struct fanotify_event_info_fid) + sizeof(struct file_handle)) {
            const struct fanotify_event_info_fid *fid = (const void *)p;
            const struct file_handle *fh = (const void *)fid->handle;
            const unsigned char *record_end = p + h->len;
            if (h->info_type == FAN_EVENT_INFO_TYPE_DFID_NAME || h->info_type == FAN_EVENT_INFO_TYPE_DFID) {
                out->dir_length = copy_fan_handle(fh, record_end, out->dir_handle);
                const char *name = (const char *)fh->f_handle + fh->handle_bytes;
                if (h->info_type == FAN_EVENT_INFO_TYPE_DFID_NAME && out->dir_length > 0
                    && (const unsigned char *)name < record_end && memchr(name, 0, (size_t)(record_end - (const unsigned char *)name)))
                    out->name = name;
            } else if (h->info_type == FAN_EVENT_INFO_TYPE_FID) {
                out->object_length = copy_fan_handle(fh, record_end, out->object_handle);
            }
        }
        p += h->len;
    }
    // An event on a directory itself names it as its own directory, with ".".
    if (out->name && strcmp(out->name, ".") == 0 && out->object_length == 0) {
        memcpy(out->object_handle, out->dir_handle, (size_t)out->dir_length);
        out->object_length = out->dir_length;
        out->dir_length = 0;
        out->name = NULL;
    }
    return 1;
}

int vanish_spawn_closefrom(posix_spawn_file_actions_t *actions, int from) {
    return posix_spawn_file_actions_addclosefrom_np(actions, from);
}

int vanish_proc_events_open(int rcvbuf) {
    int fd = socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_CONNECTOR);
    if (fd < 0) return -1;
    (void)setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &rcvbuf, sizeof rcvbuf);
    struct sockaddr_nl addr = { .nl_family = AF_NETLINK, .nl_groups = CN_IDX_PROC };
    // nlmsghdr, cn_msg, then the operation, as one netlink message.
    char message[NLMSG_SPACE(sizeof(struct cn_msg) + sizeof(enum proc_cn_mcast_op))] __attribute__((aligned(NLMSG_ALIGNTO)));
    memset(message, 0, sizeof message);
    struct nlmsghdr *nl = (struct nlmsghdr *)message;
    struct cn_msg *cn = NLMSG_DATA(nl);
    nl->nlmsg_len = NLMSG_LENGTH(sizeof(struct cn_msg) + sizeof(enum proc_cn_mcast_op));
    nl->nlmsg_type = NLMSG_DONE;
    cn->id.idx = CN_IDX_PROC;
    cn->id.val = CN_VAL_PROC;
    cn->len = sizeof(enum proc_cn_mcast_op);
    enum proc_cn_mcast_op op = PROC_CN_MCAST_LISTEN;
    memcpy(cn->data, &op, sizeof op);
    if (bind(fd, (struct sockaddr *)&addr, sizeof addr) != 0 || send(fd, nl, nl->nlmsg_len, 0) < 0) {
        int saved = errno;
        close(fd);
        errno = saved;
        return -1;
    }
    return fd;
}

int vanish_proc_events_changed(const void *buf, int len, pid_t *out, int cap) {
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

int vanish_set_mmap_threshold(int bytes) { return mallopt(M_MMAP_THRESHOLD, bytes); }

int vanish_malloc_trim(void) { return malloc_trim(0); }

// The raw syscalls change the calling thread's credentials only; glibc's
// wrappers of the same names change every thread of the process.
int vanish_thread_setfsuid(uid_t uid) { return (int)syscall(SYS_setfsuid, uid); }
int vanish_thread_setfsgid(gid_t gid) { return (int)syscall(SYS_setfsgid, gid); }
int vanish_thread_setgroups(size_t count, const gid_t *groups) {
    return (int)syscall(SYS_setgroups, count, groups);
}

static _Thread_local int thread_has_own_fs;

int vanish_thread_umask(mode_t mask) {
    if (!thread_has_own_fs) {
        if (unshare(CLONE_FS) != 0) return -1;
        thread_has_own_fs = 1;
    }
    return (int)umask(mask);
}

int vanish_peer_credentials(int fd, pid_t *pid, uid_t *uid, gid_t *gid) {
    struct ucred cred;
    socklen_t len = sizeof(cred);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return -1;
    if (len != sizeof(cred)) { errno = EINVAL; return -1; }
    *pid = cred.pid;
    *uid = cred.uid;
    *gid = cred.gid;
    return 0;
}

int vanish_peer_groups(int fd, gid_t *groups, int capacity) {
    socklen_t len = (socklen_t)(capacity * (int)sizeof(gid_t));
    if (getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups, &len) != 0) {
        if (errno == ERANGE) return (int)(len / sizeof(gid_t));
        return -1;
    }
    return (int)(len / sizeof(gid_t));
}

pid_t vanish_fork_unlinker(const char *path, char *argv_area, size_t argv_length) {
    struct stat made;
    if (lstat(path, &made) != 0) return -1;
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0) return -1;
    pid_t pid = fork();
    if (pid < 0) {
        close(fds[0]);
        close(fds[1]);
        return -1;
    }
    if (pid == 0) {
        // The child of a threaded process: async-signal-safe calls only.
        // It holds nothing of the parent's but the pipe's read end (no
        // /dev/fuse fd, which would keep the mount alive), is out of the
        // terminal's process group, and ignores the signals that stop the
        // daemon, so it outlives whatever ends the daemon.
        if (dup2(fds[0], 0) != 0) _exit(1);
        close_range(1, ~0U, 0);
        setsid();
        if (chdir("/") != 0) _exit(1);
        struct sigaction ignore;
        memset(&ignore, 0, sizeof(ignore));
        ignore.sa_handler = SIG_IGN;
        sigaction(SIGINT, &ignore, NULL);
        sigaction(SIGTERM, &ignore, NULL);
        sigaction(SIGHUP, &ignore, NULL);
        // Not the daemon's command line: ps and pgrep must not take it for one.
        static const char title[] = "vanish-unlinker";
        if (argv_area != NULL && argv_length > sizeof(title)) {
            memset(argv_area, 0, argv_length);
            memcpy(argv_area, title, sizeof(title));
        }
        prctl(PR_SET_NAME, title, 0, 0, 0);
        char byte;
        while (read(0, &byte, 1) < 0 && errno == EINTR) {}
        struct stat now;
        if (lstat(path, &now) == 0 && now.st_dev == made.st_dev && now.st_ino == made.st_ino) unlink(path);
        _exit(0);
    }
    close(fds[0]);
    // The write end stays open, close-on-exec, for the daemon's life.
    return pid;
}

const uint64_t VANISH_MOUNT_ATTR_ATIME_MASK = MOUNT_ATTR__ATIME;
const uint64_t VANISH_MOUNT_ATTR_RELATIME = MOUNT_ATTR_RELATIME;
const uint64_t VANISH_MOUNT_ATTR_NOATIME = MOUNT_ATTR_NOATIME;
const uint64_t VANISH_MOUNT_ATTR_STRICTATIME = MOUNT_ATTR_STRICTATIME;
const uint64_t VANISH_MOUNT_ATTR_NODIRATIME = MOUNT_ATTR_NODIRATIME;

int vanish_open_tree_clone(const char *path, uint64_t attr_set, uint64_t attr_clr) {
    int fd = (int)syscall(SYS_open_tree, AT_FDCWD, path, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
    if (fd < 0) return -1;
    struct mount_attr attr;
    memset(&attr, 0, sizeof(attr));
    attr.attr_set = attr_set;
    attr.attr_clr = attr_clr;
    if (syscall(SYS_mount_setattr, fd, "", AT_EMPTY_PATH, &attr, sizeof(attr)) != 0) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    return fd;
}
