// See CFuseTransport.h. One session per process: the state is global.
#define FUSE_USE_VERSION 314

#include "CFuseTransport.h"
#include "ring.h"
#include "workers.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/fuse.h>
#include <linux/ioctl.h>
#include <stdatomic.h>
#include <stddef.h>
#include <string.h>
#include <linux/capability.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/uio.h>
#include <unistd.h>
#include <fuse_lowlevel.h>
#include <sched.h>
#include <time.h>

// Debian 12's <linux/fuse.h> is protocol 7.38; passthrough is 7.40 (Linux
// 6.9). What it lacks is defined from the kernel's include/uapi/linux/fuse.h.
#ifndef FUSE_PASSTHROUGH
#define FUSE_PASSTHROUGH (1ULL << 37)
#endif
#ifndef FUSE_DIRECT_IO_ALLOW_MMAP
#define FUSE_DIRECT_IO_ALLOW_MMAP (1ULL << 36)
#endif
#ifndef FOPEN_PASSTHROUGH
#define FOPEN_PASSTHROUGH (1 << 7)
#endif
#ifndef FUSE_DEV_IOC_BACKING_OPEN
struct fuse_backing_map {
    int32_t fd;
    uint32_t flags;
    uint64_t padding;
};
#define FUSE_DEV_IOC_BACKING_OPEN _IOW(FUSE_DEV_IOC_MAGIC, 1, struct fuse_backing_map)
#define FUSE_DEV_IOC_BACKING_CLOSE _IOW(FUSE_DEV_IOC_MAGIC, 2, uint32_t)
#endif

// 7.40 names two fields 7.38 calls unused/padding: check where they sit.
#define INIT_OUT_MAX_STACK_DEPTH offsetof(struct fuse_init_out, unused)
#define OPEN_OUT_BACKING_ID offsetof(struct fuse_open_out, padding)
_Static_assert(sizeof(struct fuse_init_out) == 64, "fuse_init_out is 64 bytes");
_Static_assert(INIT_OUT_MAX_STACK_DEPTH == 36, "max_stack_depth follows flags2");
_Static_assert(sizeof(struct fuse_open_out) == 16, "fuse_open_out is 16 bytes");
_Static_assert(OPEN_OUT_BACKING_ID == 12, "backing_id follows open_flags");
_Static_assert(sizeof(struct fuse_backing_map) == 16, "fuse_backing_map is 16 bytes");
_Static_assert(sizeof(struct fuse_entry_out) % 8 == 0, "a create reply's open part follows its entry unpadded");

// FUSE_STATX (protocol 7.39, Linux 6.6): the kernel asks for it when a
// program wants a birth time, and falls back to GETATTR (no birth time) once
// it is answered ENOSYS, as libfuse 3.14 does. Defined from the kernel's
// include/uapi/linux/fuse.h under names of our own: Debian 12's header is 7.38.
enum { vanish_fuse_statx_opcode = 52 };
struct vanish_fuse_sx_time { int64_t tv_sec; uint32_t tv_nsec; int32_t reserved; };
struct vanish_fuse_statx {
    uint32_t mask, blksize;
    uint64_t attributes;
    uint32_t nlink, uid, gid;
    uint16_t mode, spare0;
    uint64_t ino, size, blocks, attributes_mask;
    struct vanish_fuse_sx_time atime, btime, ctime, mtime;
    uint32_t rdev_major, rdev_minor, dev_major, dev_minor;
    uint64_t spare2[14];
};
struct vanish_fuse_statx_in { uint32_t getattr_flags, reserved; uint64_t fh; uint32_t sx_flags, sx_mask; };
struct vanish_fuse_statx_out {
    uint64_t attr_valid;
    uint32_t attr_valid_nsec, flags;
    uint64_t spare[2];
    struct vanish_fuse_statx stat;
};
_Static_assert(sizeof(struct vanish_fuse_statx) == 256, "fuse_statx is 256 bytes");
_Static_assert(offsetof(struct vanish_fuse_statx, btime) == 80, "btime follows atime");
_Static_assert(sizeof(struct vanish_fuse_statx_out) == 288, "fuse_statx_out is 288 bytes");
_Static_assert(sizeof(struct vanish_fuse_statx_in) == 24, "fuse_statx_in is 24 bytes");
_Static_assert(offsetof(struct vanish_fuse_statx_in, fh) == offsetof(struct fuse_getattr_in, fh),
               "fuse_statx_in begins as fuse_getattr_in");

const uint64_t VANISH_FUSE_PASSTHROUGH = FUSE_PASSTHROUGH;
const uint64_t VANISH_FUSE_PARALLEL_DIROPS = FUSE_PARALLEL_DIROPS;
const uint64_t VANISH_FUSE_HANDLE_KILLPRIV_V2 = FUSE_HANDLE_KILLPRIV_V2;
const uint64_t VANISH_FUSE_DIRECT_IO_ALLOW_MMAP = FUSE_DIRECT_IO_ALLOW_MMAP;

static const uint64_t negotiable = FUSE_PASSTHROUGH | FUSE_PARALLEL_DIROPS | FUSE_HANDLE_KILLPRIV_V2 |
                                   FUSE_DIRECT_IO_ALLOW_MMAP;

static _Atomic uint64_t init_unique;   // the INIT request's id, once read
static _Atomic uint64_t offered;       // its flags | flags2 << 32
static _Atomic uint64_t wanted;        // set by the init callback
static _Atomic uint32_t stack_depth;
static _Atomic uint64_t granted;       // what the INIT reply said
static _Atomic int init_done;
static struct fuse_session *session;
static _Atomic int ring_mode;          // VANISH_RING_*
static _Atomic int ring_error;         // errno of a ring that could not be made
static _Atomic int ring_asked;         // the INIT reply asks for the ring

// O_TMPFILE: libfuse 3.14 does not know FUSE_TMPFILE (kernel 6.1) and
// answers ENOSYS, after which the kernel fails every O_TMPFILE open with
// EOPNOTSUPP. Its body is FUSE_CREATE's (fuse_create_in, then the dentry's
// name, which for a tmpfile is always "/", never a real entry's name), so it
// is handed to libfuse as a CREATE and the create handler tells it by that
// name (vanish_is_tmpfile_name).
enum { tmpfile_request_size = sizeof(struct fuse_in_header) + sizeof(struct fuse_create_in) + 2 };

// A STATX request is handed to libfuse as the GETATTR it begins with, and
// its reply, libfuse's fuse_attr_out, is written out as a fuse_statx_out
// with the birth time the getattr handler gave (vanish_reply_attr_birth).
// The requests so handed over are known by their ids until their replies.
// One slot per worker that may hold a STATX at once (`threads=` is at most 256),
// so the table never fills; if it did, the request would stay a STATX.
enum { statx_request_size = sizeof(struct fuse_in_header) + sizeof(struct vanish_fuse_statx_in), statx_slots = 256 };
static pthread_mutex_t statx_lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t statx_requests[statx_slots];  // 0: free
static _Atomic int statx_pending;

static int statx_remember(uint64_t unique) {
    pthread_mutex_lock(&statx_lock);
    for (int i = 0; i < statx_slots; i++) {
        if (statx_requests[i] == 0) {
            statx_requests[i] = unique;
            atomic_fetch_add(&statx_pending, 1);
            pthread_mutex_unlock(&statx_lock);
            return 1;
        }
    }
    pthread_mutex_unlock(&statx_lock);
    return 0;  // all taken: left a STATX, which libfuse answers ENOSYS
}

static int statx_forget(uint64_t unique) {
    if (!atomic_load_explicit(&statx_pending, memory_order_acquire)) return 0;
    pthread_mutex_lock(&statx_lock);
    for (int i = 0; i < statx_slots; i++) {
        if (statx_requests[i] == unique) {
            statx_requests[i] = 0;
            atomic_fetch_sub(&statx_pending, 1);
            pthread_mutex_unlock(&statx_lock);
            return 1;
        }
    }
    pthread_mutex_unlock(&statx_lock);
    return 0;
}

// Renames a request libfuse 3.14 does not know into the one it is brought as.
static void rename_unknown(void *buf, size_t n) {
    struct fuse_in_header *in = buf;
    if (n == tmpfile_request_size && in->opcode == FUSE_TMPFILE &&
        memcmp((char *)buf + n - 2, "/", 2) == 0) {
        in->opcode = FUSE_CREATE;
    } else if (n == statx_request_size && in->opcode == vanish_fuse_statx_opcode && in->unique != 0 &&
               statx_remember(in->unique)) {
        in->opcode = FUSE_GETATTR;
    }
}

// Which request each worker thread is handling, so that events are
// recorded in the order the kernel gave the requests their ids: a RELEASE
// (which ends a program's writing session, queued before its close()
// returned) handled beside that program's next request must not be
// recorded after it. A slot per thread, claimed on its first request.
#define ORDER_SLOTS 256
static _Atomic uint64_t order_unique[ORDER_SLOTS];  // 0: not handling a request
static _Atomic uint32_t order_opcode[ORDER_SLOTS];
static _Atomic int order_slots_used;
static _Thread_local int order_slot = -1;
static _Thread_local uint64_t order_current;

static void order_idle(void) {
    if (order_slot >= 0) atomic_store_explicit(&order_unique[order_slot], 0, memory_order_release);
    order_current = 0;
}

static void order_begin(const struct fuse_in_header *in) {
    if (order_slot < 0) {
        int slot = atomic_fetch_add(&order_slots_used, 1);
        if (slot >= ORDER_SLOTS) { atomic_fetch_sub(&order_slots_used, 1); return; }
        order_slot = slot;
    }
    atomic_store_explicit(&order_opcode[order_slot], in->opcode, memory_order_relaxed);
    atomic_store_explicit(&order_unique[order_slot], in->unique, memory_order_release);
    order_current = in->unique;
}

// The requests whose handlers record changes (events).
static int order_records_changes(uint32_t opcode) {
    switch (opcode) {
    case FUSE_RELEASE: case FUSE_CREATE: case FUSE_MKNOD: case FUSE_MKDIR: case FUSE_SYMLINK:
    case FUSE_LINK: case FUSE_UNLINK: case FUSE_RMDIR: case FUSE_RENAME: case FUSE_RENAME2:
    case FUSE_SETATTR: case FUSE_SETXATTR: case FUSE_REMOVEXATTR: case FUSE_IOCTL:
        return 1;
    default:
        return 0;
    }
}

// Over io_uring a request is not seen in the kernel's order: the thread an
// entry belongs to may run after another's, and a RELEASE (background) may
// be dispatched after the caller's next request. So there, a change also
// waits until every request the kernel numbered before it has arrived
// (request ids go up by 2: FUSE_INT_REQ_BIT marks interrupts). `seen_low`:
// every id below it arrived (or was given up on after a wait timed out);
// `seen` holds the ones above it, in a window of `seen_window` ids.
enum { seen_window = 8192 };
static pthread_mutex_t seen_lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic uint64_t seen_low;
static uint8_t seen[seen_window / 8];

static int seen_bit(uint64_t unique) {
    uint64_t i = (unique / 2) % seen_window;
    return (seen[i / 8] >> (i % 8)) & 1;
}

static void set_seen_bit(uint64_t unique, int on) {
    uint64_t i = (unique / 2) % seen_window;
    if (on) seen[i / 8] |= (uint8_t)(1u << (i % 8));
    else seen[i / 8] &= (uint8_t)~(1u << (i % 8));
}

// Moves `seen_low` past `up_to` (0: only past what arrived). Under seen_lock.
static void advance_seen_locked(uint64_t up_to) {
    uint64_t low = atomic_load_explicit(&seen_low, memory_order_relaxed);
    while (low <= up_to || seen_bit(low)) {
        set_seen_bit(low, 0);
        low += 2;
    }
    atomic_store_explicit(&seen_low, low, memory_order_release);
}

static void mark_seen(uint64_t unique) {
    if (unique & 1 || !atomic_load_explicit(&ring_asked, memory_order_relaxed)) return;
    pthread_mutex_lock(&seen_lock);
    uint64_t low = atomic_load_explicit(&seen_low, memory_order_relaxed);
    if (low == 0) atomic_store_explicit(&seen_low, low = unique, memory_order_relaxed);  // the first after INIT
    if (unique >= low) {
        // Far ahead: what falls out of the window is given up on.
        if ((unique - low) / 2 >= seen_window) advance_seen_locked(unique - 2 * seen_window);
        set_seen_bit(unique, 1);
        advance_seen_locked(0);
    }
    pthread_mutex_unlock(&seen_lock);
}

static int all_earlier_seen(uint64_t unique) {
    if (!atomic_load_explicit(&ring_asked, memory_order_relaxed)) return 1;
    return atomic_load_explicit(&seen_low, memory_order_acquire) > unique;
}

void vanish_order_done(void) { order_idle(); }

int vanish_order_wait_for_earlier(uint64_t timeout_ns) {
    if (order_current == 0) return 1;
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        int earlier = 0;
        int used = atomic_load_explicit(&order_slots_used, memory_order_relaxed);
        if (used > ORDER_SLOTS) used = ORDER_SLOTS;
        for (int i = 0; i < used && !earlier; i++) {
            if (i == order_slot) continue;
            uint64_t u = atomic_load_explicit(&order_unique[i], memory_order_acquire);
            earlier = u != 0 && u < order_current &&
                      order_records_changes(atomic_load_explicit(&order_opcode[i], memory_order_relaxed));
        }
        if (!earlier && all_earlier_seen(order_current)) return 1;
        clock_gettime(CLOCK_MONOTONIC, &now);
        uint64_t elapsed = (uint64_t)(now.tv_sec - start.tv_sec) * 1000000000u + (uint64_t)(now.tv_nsec - start.tv_nsec);
        if (elapsed >= timeout_ns) {
            // An id that never came (a request the kernel dropped before
            // sending it): no later change waits for it again.
            if (!all_earlier_seen(order_current)) {
                pthread_mutex_lock(&seen_lock);
                advance_seen_locked(order_current);
                pthread_mutex_unlock(&seen_lock);
            }
            return 0;
        }
        sched_yield();
    }
}

// What every request gets on arrival, read from /dev/fuse or from a ring.
void vanish_transport_received(void *request, size_t n) {
    order_idle();
    order_begin(request);
    mark_seen(((const struct fuse_in_header *)request)->unique);
    if (n == tmpfile_request_size || n == statx_request_size) rename_unknown(request, n);
}

static ssize_t read_request(int fd, void *buf, size_t len) {
    order_idle();
    ssize_t n = read(fd, buf, len);
    if (n >= (ssize_t)sizeof(struct fuse_in_header)) vanish_transport_received(buf, (size_t)n);
    if (n >= (ssize_t)(sizeof(struct fuse_in_header) + offsetof(struct fuse_init_in, unused)) &&
        !atomic_load_explicit(&init_done, memory_order_relaxed)) {
        const struct fuse_in_header *in = buf;
        if (in->opcode == FUSE_INIT) {
            const struct fuse_init_in *arg = (const void *)(in + 1);
            uint64_t flags = arg->flags;
            if (flags & FUSE_INIT_EXT) flags |= (uint64_t)arg->flags2 << 32;
            atomic_store(&offered, flags);
            atomic_store(&init_unique, in->unique);
        }
    }
    return n;
}

struct read_args { void *buf; size_t len; };

static ssize_t read_from(int from, void *context) {
    struct read_args *a = context;
    return read_request(from, a->buf, a->len);
}

static ssize_t t_read(int fd, void *buf, size_t len, void *userdata) {
    (void)userdata;
    struct read_args a = { buf, len };
    return vanish_workers_receive(fd, atomic_load_explicit(&init_done, memory_order_acquire), read_from, &a);
}

// Adds the wanted flags to the INIT reply in `body` (a copy) and records them.
static void patch_init(struct fuse_init_out *out) {
    uint64_t add = atomic_load(&wanted) & atomic_load(&offered);
    // The kernel ignores passthrough beside write-back caching: say so here too.
    if (out->flags & FUSE_WRITEBACK_CACHE) add &= ~FUSE_PASSTHROUGH;
    uint64_t flags = (uint64_t)out->flags | (uint64_t)out->flags2 << 32;
    if (add >> 32) {
        if (!(atomic_load(&offered) & FUSE_INIT_EXT)) add &= 0xffffffffULL;
        else flags |= FUSE_INIT_EXT;
    }
    flags |= add;
    out->flags = (uint32_t)flags;
    out->flags2 = (uint32_t)(flags >> 32);
    if (add & FUSE_PASSTHROUGH) {
        uint32_t depth = atomic_load(&stack_depth);
        memcpy((char *)out + INIT_OUT_MAX_STACK_DEPTH, &depth, sizeof depth);
    }
    // The ring is asked for only once its queues exist: from the reply on,
    // the kernel sends requests nowhere else.
    if (vanish_transport_ring_wanted()) {
        size_t page = (size_t)sysconf(_SC_PAGESIZE);
        size_t payload = out->max_write;
        if ((size_t)out->max_pages * page > payload) payload = (size_t)out->max_pages * page;
        if (payload < FUSE_MIN_READ_BUFFER) payload = FUSE_MIN_READ_BUFFER;
        uint64_t spin = (uint64_t)vanish_workers_spin_microseconds() * 1000;
        int r = ring_prepare(session, fuse_session_fd(session), payload, spin);
        if (r == 0) {
            flags = (uint64_t)out->flags | (uint64_t)out->flags2 << 32 | FUSE_INIT_EXT | VANISH_RING_INIT_FLAG;
            out->flags = (uint32_t)flags;
            out->flags2 = (uint32_t)(flags >> 32);
            add |= VANISH_RING_INIT_FLAG;
            atomic_store(&ring_asked, 1);
        } else {
            atomic_store(&ring_error, -r);
        }
    }
    atomic_store(&granted, add);
}

// The birth time (ns; 0: unknown) of the attributes being replied on this
// thread (vanish_reply_attr_birth): libfuse writes a reply synchronously.
static _Thread_local uint64_t reply_birth;

// Writes libfuse's GETATTR reply to a STATX request as the kernel expects it.
static ssize_t write_statx_reply(int fd, const struct fuse_out_header *out, const struct fuse_attr_out *a) {
    struct vanish_fuse_statx_out x;
    memset(&x, 0, sizeof x);
    x.attr_valid = a->attr_valid;
    x.attr_valid_nsec = a->attr_valid_nsec;
    struct vanish_fuse_statx *s = &x.stat;
    s->mask = STATX_BASIC_STATS;
    s->blksize = a->attr.blksize;
    s->nlink = a->attr.nlink;
    s->uid = a->attr.uid;
    s->gid = a->attr.gid;
    s->mode = (uint16_t)a->attr.mode;
    s->ino = a->attr.ino;
    s->size = a->attr.size;
    s->blocks = a->attr.blocks;
    s->atime = (struct vanish_fuse_sx_time){ (int64_t)a->attr.atime, a->attr.atimensec, 0 };
    s->mtime = (struct vanish_fuse_sx_time){ (int64_t)a->attr.mtime, a->attr.mtimensec, 0 };
    s->ctime = (struct vanish_fuse_sx_time){ (int64_t)a->attr.ctime, a->attr.ctimensec, 0 };
    s->rdev_major = major(a->attr.rdev);
    s->rdev_minor = minor(a->attr.rdev);
    if (reply_birth) {
        s->mask |= STATX_BTIME;
        s->btime = (struct vanish_fuse_sx_time){ (int64_t)(reply_birth / 1000000000ULL),
                                                 (uint32_t)(reply_birth % 1000000000ULL), 0 };
    }
    struct fuse_out_header header = *out;
    header.len = sizeof header + sizeof x;
    struct iovec patched[2] = { { &header, sizeof header }, { &x, sizeof x } };
    return vanish_workers_write_reply(fd, patched, 2, out->unique);
}

static ssize_t t_writev(int fd, struct iovec *iov, int count, void *userdata) {
    (void)userdata;
    const struct fuse_out_header *out = iov[0].iov_base;
    // Answered: what it recorded is recorded.
    if (out->unique != 0 && out->unique == order_current) order_idle();
    if (out->unique != 0 && statx_forget(out->unique) && out->error == 0) {
        if (count == 2 && iov[1].iov_len == sizeof(struct fuse_attr_out)) {
            return write_statx_reply(fd, out, iov[1].iov_base);
        }
    }
    if (out->error == 0 && out->unique != 0 && count >= 2) {
        if (!atomic_load_explicit(&init_done, memory_order_relaxed) &&
            out->unique == atomic_load(&init_unique) && iov[1].iov_len == sizeof(struct fuse_init_out)) {
            struct fuse_init_out body;
            struct iovec patched[2] = { iov[0], { &body, sizeof body } };
            memcpy(&body, iov[1].iov_base, sizeof body);
            patch_init(&body);
            // Over the ring, /dev/fuse carries only forgets and interrupts:
            // nothing to spin for.
            if (atomic_load(&ring_asked)) vanish_workers_configure(fd, 0);
            atomic_store(&init_done, 1);
            ssize_t n = vanish_workers_write_reply(fd, patched, 2, out->unique);
            if (atomic_load(&ring_asked)) {
                if (n > 0) ring_start();
                else ring_stop();
            }
            return n;
        }
    }
    return vanish_workers_write_reply(fd, iov, count, out->unique);
}

// What libfuse does without custom io, with spinning on receive (libfuse
// splices requests in when the filesystem takes SPLICE_READ); a spliced
// reply goes where its request came from.
struct splice_args { off_t *offin; int fdout; off_t *offout; size_t len; unsigned int flags; };

static ssize_t splice_from(int from, void *context) {
    struct splice_args *a = context;
    return splice(from, a->offin, a->fdout, a->offout, a->len, a->flags);
}

// A read end of this thread's pipe from libfuse (which keeps only the write
// end's number at hand here), opened through /proc, and the pipe it is of.
static _Thread_local int pipe_reader = -1;
static _Thread_local ino_t pipe_reader_of;
static pthread_key_t pipe_reader_key;
static pthread_once_t pipe_reader_once = PTHREAD_ONCE_INIT;

static void close_pipe_reader(void *fd) { close((int)(intptr_t)fd - 1); }
static void make_pipe_reader_key(void) { pthread_key_create(&pipe_reader_key, close_pipe_reader); }

// A spliced request of a tmpfile's or a statx's size (some LOOKUPs, UNLINKs,
// FLUSHes and RELEASEs have them too) is taken out of the pipe libfuse
// spliced it into, renamed if it is one of those, and put back: libfuse
// copies a small spliced request out of its pipe itself, with no hook between.
static void rename_spliced(int pipe_writer, size_t size) {
    struct stat st;
    if (fstat(pipe_writer, &st) != 0) return;
    if (pipe_reader < 0 || pipe_reader_of != st.st_ino) {
        if (pipe_reader >= 0) close(pipe_reader);
        char path[40];
        snprintf(path, sizeof path, "/proc/self/fd/%d", pipe_writer);
        pipe_reader = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
        if (pipe_reader < 0) return;
        pipe_reader_of = st.st_ino;
        pthread_once(&pipe_reader_once, make_pipe_reader_key);
        pthread_setspecific(pipe_reader_key, (void *)(intptr_t)(pipe_reader + 1));
    }
    char request[statx_request_size > tmpfile_request_size ? statx_request_size : tmpfile_request_size];
    // libfuse empties its pipe after each request, so this one is all it holds.
    ssize_t n = read(pipe_reader, request, size);
    if (n <= 0) return;
    rename_unknown(request, (size_t)n);
    if (write(pipe_writer, request, (size_t)n) != n) {
        // Cannot happen with an empty pipe of at least a page; if it did,
        // libfuse would find a short request and answer it with an error.
    }
}

static ssize_t t_splice_receive(int fdin, off_t *offin, int fdout, off_t *offout, size_t len, unsigned int flags,
                                void *userdata) {
    (void)userdata;
    struct splice_args a = { offin, fdout, offout, len, flags };
    // A spliced request's header stays in the pipe: not ordered.
    order_idle();
    ssize_t n = vanish_workers_receive(fdin, atomic_load_explicit(&init_done, memory_order_acquire), splice_from, &a);
    if (n == tmpfile_request_size || n == statx_request_size) rename_spliced(fdout, (size_t)n);
    return n;
}

static ssize_t t_splice_send(int fdin, off_t *offin, int fdout, off_t *offout, size_t len, unsigned int flags,
                             void *userdata) {
    (void)userdata;
    // libfuse splices only replies to the device.
    return splice(fdin, offin, vanish_workers_reply_fd(fdout), offout, len, flags);
}

ssize_t vanish_transport_receive_hook(int fd, void *buf, size_t len) { return t_read(fd, buf, len, NULL); }
ssize_t vanish_transport_reply_hook(int fd, struct iovec *iov, int count) { return t_writev(fd, iov, count, NULL); }

int vanish_transport_install(struct fuse_session *se) {
    session = se;
    static const struct fuse_custom_io io = {
        .writev = t_writev,
        .read = t_read,
        .splice_receive = t_splice_receive,
        .splice_send = t_splice_send,
    };
    return fuse_session_custom_io(se, &io, fuse_session_fd(se));
}

uint64_t vanish_transport_offered(void) { return atomic_load(&offered); }

uint64_t vanish_transport_request(uint64_t want, uint32_t max_stack_depth) {
    want &= negotiable;
    atomic_store(&stack_depth, max_stack_depth);
    atomic_store(&wanted, want);
    uint64_t got = want & atomic_load(&offered);
    if (got >> 32 && !(atomic_load(&offered) & FUSE_INIT_EXT)) got &= 0xffffffffULL;
    return got;
}

uint64_t vanish_transport_granted(void) { return atomic_load(&granted); }

void vanish_transport_set_spin(struct fuse_session *se, uint32_t microseconds) {
    vanish_workers_configure(fuse_session_fd(se), microseconds);
}

void vanish_transport_close(void) {
    ring_stop();
    vanish_workers_close();
}

void vanish_transport_set_ring(int mode) { atomic_store(&ring_mode, mode); }

int vanish_transport_ring_wanted(void) {
    return atomic_load(&ring_mode) != VANISH_RING_OFF && (atomic_load(&offered) & VANISH_RING_INIT_FLAG) &&
           (atomic_load(&offered) & FUSE_INIT_EXT);
}

void vanish_transport_ring_info(struct vanish_ring_info *info) {
    memset(info, 0, sizeof *info);
    ring_info(info);
    info->mode = atomic_load(&ring_mode);
    info->error = atomic_load(&ring_error);
    info->offered = (atomic_load(&offered) & VANISH_RING_INIT_FLAG) != 0;
}

// An open reply as libfuse 3.14 builds it (its fill_open), with what it
// cannot say: the passthrough flag and the backing id. Built whole here and
// sent as it is, rather than patched on its way out.
static void fill_open(struct fuse_open_out *o, const struct fuse_file_info *fi, int32_t backing_id) {
    memset(o, 0, sizeof *o);
    o->fh = fi->fh;
    if (fi->direct_io) o->open_flags |= FOPEN_DIRECT_IO;
    if (fi->keep_cache) o->open_flags |= FOPEN_KEEP_CACHE;
    if (fi->cache_readdir) o->open_flags |= FOPEN_CACHE_DIR;
    if (fi->nonseekable) o->open_flags |= FOPEN_NONSEEKABLE;
    if (fi->noflush) o->open_flags |= FOPEN_NOFLUSH;
    o->open_flags |= FOPEN_PASSTHROUGH;
    memcpy((char *)o + OPEN_OUT_BACKING_ID, &backing_id, sizeof backing_id);
}

// libfuse's timeouts in whole seconds and nanoseconds (its calc_timeout_sec/_nsec).
static uint64_t timeout_sec(double t) {
    if (t > (double)UINT64_MAX) return UINT64_MAX;
    return t < 0.0 ? 0 : (uint64_t)t;
}

static uint32_t timeout_nsec(double t) {
    double f = t - (double)timeout_sec(t);
    if (f < 0.0) return 0;
    return f >= 0.999999999 ? 999999999 : (uint32_t)(f * 1.0e9);
}

// A struct stat as the kernel's fuse_attr (libfuse's convert_stat).
static void fill_attr(struct fuse_attr *a, const struct stat *st) {
    a->ino = st->st_ino;
    a->mode = st->st_mode;
    a->nlink = (uint32_t)st->st_nlink;
    a->uid = st->st_uid;
    a->gid = st->st_gid;
    a->rdev = (uint32_t)st->st_rdev;
    a->size = (uint64_t)st->st_size;
    a->blksize = (uint32_t)st->st_blksize;
    a->blocks = (uint64_t)st->st_blocks;
    a->atime = (uint64_t)st->st_atim.tv_sec;
    a->mtime = (uint64_t)st->st_mtim.tv_sec;
    a->ctime = (uint64_t)st->st_ctim.tv_sec;
    a->atimensec = (uint32_t)st->st_atim.tv_nsec;
    a->mtimensec = (uint32_t)st->st_mtim.tv_nsec;
    a->ctimensec = (uint32_t)st->st_ctim.tv_nsec;
}

int vanish_reply_open_backing(struct fuse_req *req, const struct fuse_file_info *fi, int32_t backing_id) {
    if (backing_id <= 0) return fuse_reply_open(req, fi);
    struct fuse_open_out o;
    fill_open(&o, fi, backing_id);
    struct iovec iov = { &o, sizeof o };
    return fuse_reply_iov(req, &iov, 1);
}

int vanish_reply_attr_birth(struct fuse_req *req, const struct stat *st, double timeout, uint64_t birth) {
    reply_birth = birth;
    int r = fuse_reply_attr(req, st, timeout);
    reply_birth = 0;
    return r;
}

int vanish_reply_create_backing(struct fuse_req *req, const struct fuse_entry_param *e,
                                const struct fuse_file_info *fi, int32_t backing_id) {
    if (backing_id <= 0) return fuse_reply_create(req, e, fi);
    // Passthrough came with protocol 7.40: the entry is never the 7.8 compat size here.
    struct { struct fuse_entry_out entry; struct fuse_open_out open; } body;
    memset(&body, 0, sizeof body);
    body.entry.nodeid = e->ino;
    body.entry.generation = e->generation;
    body.entry.entry_valid = timeout_sec(e->entry_timeout);
    body.entry.entry_valid_nsec = timeout_nsec(e->entry_timeout);
    body.entry.attr_valid = timeout_sec(e->attr_timeout);
    body.entry.attr_valid_nsec = timeout_nsec(e->attr_timeout);
    fill_attr(&body.entry.attr, &e->attr);
    fill_open(&body.open, fi, backing_id);
    struct iovec iov = { &body, sizeof body };
    return fuse_reply_iov(req, &iov, 1);
}

int32_t vanish_backing_open(int devfd, int fd) {
    struct fuse_backing_map map = { .fd = fd, .flags = 0, .padding = 0 };
    int r = ioctl(devfd, FUSE_DEV_IOC_BACKING_OPEN, &map);
    return r < 0 ? -errno : r;
}

int vanish_backing_close(int devfd, int32_t backing_id) {
    uint32_t id = (uint32_t)backing_id;
    return ioctl(devfd, FUSE_DEV_IOC_BACKING_CLOSE, &id) < 0 ? -errno : 0;
}

int vanish_has_cap_sys_admin(void) {
    struct __user_cap_header_struct header = { .version = _LINUX_CAPABILITY_VERSION_3, .pid = 0 };
    struct __user_cap_data_struct data[_LINUX_CAPABILITY_U32S_3];
    memset(data, 0, sizeof data);
    if (syscall(SYS_capget, &header, data) != 0) return 0;
    return (data[CAP_SYS_ADMIN / 32].effective >> (CAP_SYS_ADMIN % 32)) & 1;
}

int vanish_is_tmpfile_name(const char *name) { return name[0] == '/' && name[1] == 0; }
