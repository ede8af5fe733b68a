// The Linux calls and constants Swift's Glibc module does not import: it is
// built without _GNU_SOURCE, so O_PATH, renameat2, statx, struct
// file_handle and their kin are invisible to Swift. linux.c is compiled
// with _GNU_SOURCE and exports them from the system headers, as swift-nio's
// CNIOLinux does; nothing here is a value typed by hand. This header itself
// needs no feature macro, so Swift can import it next to Glibc.
#ifndef VANISH_CLINUX_H
#define VANISH_CLINUX_H

#include <dirent.h>
#include <spawn.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/xattr.h>
#include <linux/falloc.h>

// Flags and values hidden behind _GNU_SOURCE.
extern const int VANISH_O_PATH;
extern const int VANISH_O_DIRECT;
extern const int VANISH_O_NOATIME;
extern const int VANISH_O_TMPFILE;
/// The inode-flag ioctls (lsattr/chattr, xfs_io's fsxattr), as the 32-bit
/// command numbers FUSE carries.
extern const unsigned int VANISH_FS_IOC_GETFLAGS;
extern const unsigned int VANISH_FS_IOC_SETFLAGS;
extern const unsigned int VANISH_FS_IOC_FSGETXATTR;
extern const unsigned int VANISH_FS_IOC_FSSETXATTR;
/// Vanish's own directory ioctl (no argument): the caller's next rmdir of
/// this directory, while it is open, removes it with all it holds in one step.
extern const unsigned int VANISH_IOC_REMOVE_ON_RMDIR;
/// ioctl(2) with no argument (Swift cannot call the variadic one).
int vanish_ioctl_none(int fd, unsigned int cmd);
/// Runs one of those ioctls on `fd` with `in` (in_size bytes) as its argument
/// and copies the result into `out` (out_size bytes). The flags ioctls take
/// an int whatever their number says; fsxattr ones a struct fsxattr. Returns
/// 0 or -errno (-ENOTTY for any other command or a size that does not fit).
int vanish_fileattr_ioctl(int fd, unsigned int cmd, const void *in, size_t in_size, void *out, size_t out_size);
extern const int VANISH_AT_EMPTY_PATH;
/// The largest file handle name_to_handle_at gives (bytes, without its type).
extern const int VANISH_MAX_HANDLE_SZ;
extern const unsigned int VANISH_RENAME_NOREPLACE;
extern const unsigned int VANISH_RENAME_EXCHANGE;
extern const int VANISH_SEEK_DATA;
extern const int VANISH_SEEK_HOLE;
extern const long VANISH_UTIME_NOW;
extern const long VANISH_UTIME_OMIT;
extern const short VANISH_POLLRDHUP;
extern const long VANISH_FUSE_SUPER_MAGIC;
extern const long VANISH_OVERLAYFS_SUPER_MAGIC;

int vanish_renameat2(int olddirfd, const char *oldpath, int newdirfd, const char *newpath, unsigned int flags);

/// statx(2) into a struct stat, with the inode's birth time in nanoseconds
/// (0 where the filesystem keeps none): unlike its number, which a new
/// file gets as soon as the old one is freed, it tells two inodes apart.
/// `attributes`, if not NULL, gets stx_attributes masked by what the
/// filesystem supports (STATX_ATTR_IMMUTABLE, STATX_ATTR_APPEND, ...).
int vanish_statx_stat(int dirfd, const char *path, int flags, struct stat *st, uint64_t *birth, uint64_t *attributes);
/// lstat of `path` in `dirfd` from what the kernel has cached
/// (AT_STATX_DONT_SYNC: no request to a FUSE server or NFS server), with the
/// id of the mount it is on (STATX_MNT_ID).
int vanish_lstat_cached(int dirfd, const char *path, struct stat *st, uint64_t *mount_id);
int vanish_stat_birth(int dirfd, const char *path, int flags, struct stat *st, uint64_t *birth);
/// Whether stx_attributes says immutable or append-only.
int vanish_attributes_protected(uint64_t attributes);

/// The calling thread's EEVDF slice (Linux 6.12+; older kernels ignore it for
/// normal tasks): `microseconds` (100 to 100000), or 0 for the kernel's. Its
/// nice value stays. A new thread inherits its creator's: background threads
/// started from a request thread give it back. 0 or -1 (errno).
int vanish_thread_set_slice(uint32_t microseconds);
/// pidfd_open(2) and pidfd_send_signal(2) (Linux 5.3, 5.1): a process that
/// cannot be mistaken for a later one with its pid.
int vanish_pidfd_open(pid_t pid);
int vanish_pidfd_send_signal(int pidfd, int sig);
/// fchmodat2 (Linux 6.6): chmod of the inode behind an O_PATH fd with AT_EMPTY_PATH.
int vanish_fchmodat2(int dirfd, const char *path, mode_t mode, int flags);
int vanish_faccessat2(int dirfd, const char *path, int mode, int flags);

/// setfsuid(2), setfsgid(2) and setgroups(2) of the calling thread alone
/// (the raw syscalls; glibc's wrappers change every thread). setfsuid and
/// setfsgid return the previous id, as the syscalls do.
int vanish_thread_setfsuid(uid_t uid);
int vanish_thread_setfsgid(gid_t gid);
int vanish_thread_setgroups(size_t count, const gid_t *groups);

/// Sets the calling thread's umask alone and returns the one it had, or -1
/// with errno. The first call on a thread gives it file-system attributes
/// of its own (unshare(CLONE_FS): umask, and a cwd and root the daemon does
/// not use), so the process's and other threads' umasks stay as they are.
int vanish_thread_umask(mode_t mask);

/// Forks a process that unlinks `path` (if it is still the file it is now)
/// once this process is gone, however it ended (SIGKILL included): it waits
/// for EOF on a pipe whose write end only this process holds. `argv_area`
/// (the process's argv strings, `argv_length` bytes) is overwritten in the
/// child so that it does not pass for the daemon. Returns its pid or -1.
pid_t vanish_fork_unlinker(const char *path, char *argv_area, size_t argv_length);

/// Mount attributes for access times (linux/mount.h).
extern const uint64_t VANISH_MOUNT_ATTR_ATIME_MASK;
extern const uint64_t VANISH_MOUNT_ATTR_RELATIME;
extern const uint64_t VANISH_MOUNT_ATTR_NOATIME;
extern const uint64_t VANISH_MOUNT_ATTR_STRICTATIME;
extern const uint64_t VANISH_MOUNT_ATTR_NODIRATIME;
/// open_tree(path, OPEN_TREE_CLONE) and mount_setattr on the copy: an O_PATH
/// fd on a private, unattached copy of the mount at `path` with `attr_set`
/// set and `attr_clr` cleared (needs CAP_SYS_ADMIN). -1 with errno.
int vanish_open_tree_clone(const char *path, uint64_t attr_set, uint64_t attr_clr);

/// SO_PEERCRED of a connected Unix socket: who the peer was when it connected.
int vanish_peer_credentials(int fd, pid_t *pid, uid_t *uid, gid_t *gid);
/// SO_PEERGROUPS: the peer's supplementary groups when it connected, from
/// the socket itself (a pid's /proc entry may belong to another process by
/// the time it is read). Returns how many there are (more than `capacity`:
/// call again with room for that many), or -1 with errno.
int vanish_peer_groups(int fd, gid_t *groups, int capacity);
ssize_t vanish_copy_file_range(int fd_in, off_t *off_in, int fd_out, off_t *off_out, size_t len, unsigned int flags);
int vanish_fallocate(int fd, int mode, off_t offset, off_t len);

/// fstatfs(2)'s f_type (the filesystem's magic number), or -1.
long vanish_filesystem_type(int fd);
/// Filesystem magic numbers (<linux/magic.h>, and the network ones it lacks).
extern const long VANISH_EXT4_SUPER_MAGIC;
extern const long VANISH_XFS_SUPER_MAGIC;
extern const long VANISH_BTRFS_SUPER_MAGIC;
extern const long VANISH_TMPFS_MAGIC;
extern const long VANISH_NFS_SUPER_MAGIC;
extern const long VANISH_CIFS_SUPER_MAGIC;
extern const long VANISH_SMB2_SUPER_MAGIC;
extern const long VANISH_SMB_SUPER_MAGIC;
extern const long VANISH_CEPH_SUPER_MAGIC;
extern const long VANISH_AFS_FS_MAGIC;
extern const long VANISH_V9FS_MAGIC;
/// statfs(2)'s f_type for a path, or -1.
long vanish_filesystem_type_at(const char *path);

// getxattrat/listxattrat (Linux 6.13): xattrs of a name relative to a
// directory fd, without opening the file.
ssize_t vanish_getxattrat(int dirfd, const char *path, const char *name, void *value, size_t size);
ssize_t vanish_listxattrat(int dirfd, const char *path, char *list, size_t size);

/// prctl(PR_SET_NAME): the calling thread's name (15 bytes kept). prctl is
/// variadic, which Swift cannot call.
int vanish_set_thread_name(const char *name);
/// ioprio_set(IOPRIO_WHO_PROCESS, tid (0 = this thread), IOPRIO_PRIO_VALUE(class, data)).
int vanish_ioprio_set_thread(int tid, int ioprio_class, int data);
/// The I/O scheduling classes ioprio_set takes, and the lowest best-effort level.
extern const int VANISH_IOPRIO_CLASS_IDLE;
extern const int VANISH_IOPRIO_CLASS_BE;
extern const int VANISH_IOPRIO_BE_LOWEST;
/// The scheduling policies sched_setscheduler takes (SCHED_IDLE and
/// SCHED_BATCH are hidden behind _GNU_SOURCE).
extern const int VANISH_SCHED_OTHER;
extern const int VANISH_SCHED_BATCH;
extern const int VANISH_SCHED_IDLE;
pid_t vanish_gettid(void);
/// A handler that does nothing but break the blocking call of the one
/// thread a signal is sent to (pthread_kill): installed without
/// SA_RESTART, so that call returns EINTR and its caller looks again.
int vanish_install_wake_handler(int sig);

/// pipe2(O_CLOEXEC).
int vanish_pipe_cloexec(int fds[2]);
/// fcntl(F_SETPIPE_SZ): resizes a pipe; returns its new capacity or -1.
int vanish_pipe_resize(int fd, int bytes);

const char *vanish_dirent_name(const struct dirent *d);
/// The id of the mount `path` in `dirfd` is on (statx STATX_MNT_ID, Linux
/// 5.8+; AT_EMPTY_PATH with ""): a rename works only within one mount.
/// Returns 0, or -1 with errno set.
int vanish_mount_id(int dirfd, const char *path, uint64_t *id);
/// A device number's major and minor parts (the macros from <sys/sysmacros.h>).
unsigned int vanish_major(dev_t dev);
unsigned int vanish_minor(dev_t dev);

/// name_to_handle_at(2) into a caller's buffer: writes the handle type (4
/// bytes) and the handle into `out` and returns its length, or -1 with errno.
/// The handle names the inode and its generation, so it survives renames
/// and remounts and is not reused for another file: Vanish's file id.
int vanish_file_handle(int dirfd, const char *name, int flags, unsigned char *out, int capacity);

/// One event read from a fanotify fd made by `vanish_fanotify_watch`.
struct vanish_fan_event {
    uint64_t mask;
    int pid;
    /// The directory the event names an entry of, in `vanish_file_handle`'s
    /// form (type, then handle); `dir_length` 0 if none.
    int dir_length;
    unsigned char dir_handle[4 + 128];
    /// The entry's name in that directory (in the read buffer), or NULL.
    const char *name;
    /// The object the event is about, likewise; `object_length` 0 if none.
    int object_length;
    unsigned char object_handle[4 + 128];
};

/// A fanotify fd reporting, by file handle and name, entries made, removed
/// and moved and attributes and data changed anywhere on the filesystem of
/// `mount_fd` (FAN_MARK_FILESYSTEM; needs CAP_SYS_ADMIN), with an unlimited
/// queue. Returns the fd, or -1 with errno.
int vanish_fanotify_watch(int mount_fd);

/// Decodes the event at `*offset` of the `length` bytes read from that fd
/// into `out` and moves `*offset` past it. Returns 1, or 0 when no whole
/// event is left.
int vanish_fanotify_event(const unsigned char *buffer, int length, int *offset, struct vanish_fan_event *out);

extern const uint64_t VANISH_FAN_ENTRY_CHANGED;   // created, deleted, moved from or to
extern const uint64_t VANISH_FAN_OBJECT_CHANGED;  // attributes or data changed, deleted or moved itself
extern const uint64_t VANISH_FAN_DATA_CHANGED;    // data changed (FAN_MODIFY)
extern const uint64_t VANISH_FAN_Q_OVERFLOW;

/// open_by_handle_at(2) of a handle in `vanish_file_handle`'s form (type,
/// then the handle; `length` bytes in all) on the filesystem of `mount_fd`.
/// Needs CAP_DAC_READ_SEARCH. Returns the fd, or -1 with errno.
int vanish_open_by_handle(int mount_fd, const unsigned char *in, int length, int flags);

/// posix_spawn_file_actions_addclosefrom_np (glibc 2.34): a spawned child
/// gets no descriptor above `from`, so it cannot hold open files of a mount
/// it knows nothing about.
int vanish_spawn_closefrom(posix_spawn_file_actions_t *actions, int from);

/// A netlink socket on the kernel's process events connector, subscribed:
/// it hears of every fork, exec, rename (PR_SET_NAME) and exit on the
/// machine. -1 with errno where that is not allowed (it needs CAP_NET_ADMIN).
/// `rcvbuf`: the socket's queue in bytes (SO_RCVBUFFORCE, root only).
int vanish_proc_events_open(int rcvbuf);
/// From `len` bytes that recv gave on that socket: the thread ids whose
/// /proc/PID/comm may now show another name (exec, PR_SET_NAME) or that
/// no longer name the same thread (exit). Returns the count, or -1 if
/// there were more than `cap`.
int vanish_proc_events_changed(const void *buf, int len, pid_t *out, int cap);

/// mallopt(M_MMAP_THRESHOLD): blocks of `bytes` and more get pages of their
/// own, given back when freed (and glibc stops raising the threshold).
int vanish_set_mmap_threshold(int bytes);
/// malloc_trim(0): hands the free pages of every malloc arena back to the kernel.
int vanish_malloc_trim(void);

#endif
