// See CFuseTransport.h; the state is a session's `struct vanish_transport` (state.h).
#include "state.h"
#include "ring.h"

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
#include <stdlib.h>
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

// O_TMPFILE: libfuse 3.14 does not know FUSE_TMPFILE (kernel 6.1) and
// answers ENOSYS, after which the kernel fails every O_TMPFILE open with
// EOPNOTSUPP. Its body is FUSE_CREATE's (fuse_create_in, then the dentry's
// name, which for a tmpfile is always "/", never a real entry's name), so it
// is handed to libfuse as a CREATE, and the transport's create (`t_create`)
// gives it to the filesystem's tmpfile operation by that name.
enum { tmpfile_request_size = sizeof(struct fuse_in_header) + sizeof(struct fuse_create_in) + 2 };

// A STATX request is handed to libfuse as the GETATTR it begins with. Its
// reply is a fuse_statx_out: built whole by vanish_reply_attr_birth, or,
// for a reply libfuse built as a fuse_attr_out, rewritten on its way out.
// The requests so handed over are known by their ids until their replies.
enum { statx_request_size = sizeof(struct fuse_in_header) + sizeof(struct vanish_fuse_statx_in) };

static int statx_remember(struct vanish_transport *t, uint64_t unique) {
    pthread_mutex_lock(&t->statx_lock);
    for (int i = 0; i < statx_slots; i++) {
        if (t->statx_requests[i] == 0) {
            t->statx_requests[i] = unique;
            atomic_fetch_add(&t->statx_pending, 1);
            pthread_mutex_unlock(&t->statx_lock);
            return 1;
        }
    }
    pthread_mutex_unlock(&t->statx_lock);
    return 0;  // all taken: left a STATX, which libfuse answers ENOSYS
}

static int statx_forget(struct vanish_transport *t, uint64_t unique) {
    if (!atomic_load_explicit(&t->statx_pending, memory_order_acquire)) return 0;
    pthread_mutex_lock(&t->statx_lock);
    for (int i = 0; i < statx_slots; i++) {
        if (t->statx_requests[i] == unique) {
            t->statx_requests[i] = 0;
            atomic_fetch_sub(&t->statx_pending, 1);
            pthread_mutex_unlock(&t->statx_lock);
            return 1;
        }
    }
    pthread_mutex_unlock(&t->statx_lock);
    return 0;
}

// Renames a request libfuse 3.14 does not know into the one it is brought
// as; 1 for a STATX handed over as GETATTR.
static int rename_unknown(struct vanish_transport *t, void *buf, size_t n) {
    struct fuse_in_header *in = buf;
    if (n == tmpfile_request_size && in->opcode == FUSE_TMPFILE && t->tmpfile &&
        memcmp((char *)buf + n - 2, "/", 2) == 0) {
        in->opcode = FUSE_CREATE;
    } else if (n == statx_request_size && in->opcode == vanish_fuse_statx_opcode && in->unique != 0 &&
               statx_remember(t, in->unique)) {
        in->opcode = FUSE_GETATTR;
        return 1;
    }
    return 0;
}

// What every request gets on arrival, read from /dev/fuse or from a ring
// (the channels' `received` hook).
static void transport_received(struct vanish_transport *t, void *request, size_t n) {
    order_received(t, request);
    if (n == tmpfile_request_size || n == statx_request_size) rename_unknown(t, request, n);
}

static ssize_t read_request(struct vanish_transport *t, int fd, void *buf, size_t len) {
    order_idle();
    ssize_t n = read(fd, buf, len);
    if (n >= (ssize_t)sizeof(struct fuse_in_header)) {
        transport_received(t, buf, (size_t)n);
        const struct fuse_in_header *in = buf;
        uint32_t nodes = 1;
        if (in->opcode == FUSE_BATCH_FORGET && n >= (ssize_t)(sizeof *in + sizeof(struct fuse_batch_forget_in)))
            nodes = ((const struct fuse_batch_forget_in *)(in + 1))->count;
        receivers_received(&t->receivers, in->opcode, nodes, t->ring && ring_serves(t->ring));
    }
    if (n >= (ssize_t)(sizeof(struct fuse_in_header) + offsetof(struct fuse_init_in, unused)) &&
        !atomic_load_explicit(&t->init_done, memory_order_relaxed)) {
        const struct fuse_in_header *in = buf;
        if (in->opcode == FUSE_INIT) {
            const struct fuse_init_in *arg = (const void *)(in + 1);
            uint64_t flags = arg->flags;
            if (flags & FUSE_INIT_EXT) flags |= (uint64_t)arg->flags2 << 32;
            atomic_store(&t->offered, flags);
            atomic_store(&t->init_unique, in->unique);
        }
    }
    return n;
}

struct read_args { struct vanish_transport *t; void *buf; size_t len; };

static ssize_t read_from(int from, void *context) {
    struct read_args *a = context;
    return read_request(a->t, from, a->buf, a->len);
}

static ssize_t t_read(int fd, void *buf, size_t len, void *userdata) {
    struct vanish_transport *t = userdata;
    struct read_args a = { t, buf, len };
    return receivers_receive(&t->receivers, fd, atomic_load_explicit(&t->init_done, memory_order_acquire),
                             read_from, &a);
}

// Adds the wanted flags to the INIT reply in `body` (a copy) and records them.
static void patch_init(struct vanish_transport *t, struct fuse_init_out *out) {
    uint64_t offered = atomic_load(&t->offered);
    uint64_t add = atomic_load(&t->wanted) & offered;
    // The kernel ignores passthrough beside write-back caching: say so here too.
    if (out->flags & FUSE_WRITEBACK_CACHE) add &= ~FUSE_PASSTHROUGH;
    uint64_t flags = (uint64_t)out->flags | (uint64_t)out->flags2 << 32;
    if (add >> 32) {
        if (!(offered & FUSE_INIT_EXT)) add &= 0xffffffffULL;
        else flags |= FUSE_INIT_EXT;
    }
    flags |= add;
    out->flags = (uint32_t)flags;
    out->flags2 = (uint32_t)(flags >> 32);
    if (add & FUSE_PASSTHROUGH) {
        uint32_t depth = atomic_load(&t->stack_depth);
        memcpy((char *)out + INIT_OUT_MAX_STACK_DEPTH, &depth, sizeof depth);
    }
    // The ring is asked for only once its queues exist: from the reply on,
    // the kernel sends requests nowhere else.
    if (vanish_transport_ring_wanted(t)) {
        size_t page = (size_t)sysconf(_SC_PAGESIZE);
        size_t payload = out->max_write;
        if ((size_t)out->max_pages * page > payload) payload = (size_t)out->max_pages * page;
        if (payload < FUSE_MIN_READ_BUFFER) payload = FUSE_MIN_READ_BUFFER;
        uint64_t spin = (uint64_t)t->ring_spin_us * 1000;
        int r = ring_prepare(&t->hooks, t->session, payload, spin, &t->ring);
        if (r == 0) {
            flags = (uint64_t)out->flags | (uint64_t)out->flags2 << 32 | FUSE_INIT_EXT | VANISH_RING_INIT_FLAG;
            out->flags = (uint32_t)flags;
            out->flags2 = (uint32_t)(flags >> 32);
            add |= VANISH_RING_INIT_FLAG;
            atomic_store(&t->ring_asked, 1);
            atomic_store(&t->order.tracks_arrival, 1);
        } else {
            atomic_store(&t->ring_error, -r);
        }
    }
    atomic_store(&t->granted, add);
}

// A reply goes where its request came from: a ring's entry, or the /dev/fuse fd it was read from.
static ssize_t write_reply(struct vanish_transport *t, int fd, const struct iovec *iov, int count) {
    const struct fuse_out_header *out = iov[0].iov_base;
    ssize_t written;
    if (t->ring && ring_reply(t->ring, out->unique, iov, count, &written)) return written;
    return receivers_write_reply(&t->receivers, fd, iov, count);
}

// Converts `a`, the attributes of a GETATTR reply, with the birth time
// (ns since the epoch; 0: unknown), into the STATX reply `x`.
static void fill_statx(struct vanish_fuse_statx_out *x, const struct fuse_attr_out *a, uint64_t birth) {
    memset(x, 0, sizeof *x);
    x->attr_valid = a->attr_valid;
    x->attr_valid_nsec = a->attr_valid_nsec;
    struct vanish_fuse_statx *s = &x->stat;
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
    if (birth) {
        s->mask |= STATX_BTIME;
        s->btime = (struct vanish_fuse_sx_time){ (int64_t)(birth / 1000000000ULL), (uint32_t)(birth % 1000000000ULL), 0 };
    }
}

static ssize_t t_writev(int fd, struct iovec *iov, int count, void *userdata) {
    struct vanish_transport *t = userdata;
    const struct fuse_out_header *out = iov[0].iov_base;
    // Answered: what it recorded is recorded.
    if (out->unique != 0 && out->unique == vanish_thread.unique) order_idle();
    // A GETATTR reply libfuse built for a STATX (fuse_reply_attr, not
    // vanish_reply_attr_birth): sent as the fuse_statx_out the kernel waits for.
    if (out->unique != 0 && statx_forget(t, out->unique) && out->error == 0 && count == 2 &&
        iov[1].iov_len == sizeof(struct fuse_attr_out)) {
        struct vanish_fuse_statx_out x;
        fill_statx(&x, iov[1].iov_base, 0);
        struct fuse_out_header header = *out;
        header.len = sizeof header + sizeof x;
        struct iovec patched[2] = { { &header, sizeof header }, { &x, sizeof x } };
        return write_reply(t, fd, patched, 2);
    }
    if (out->error == 0 && out->unique != 0 && count >= 2 && !atomic_load_explicit(&t->init_done, memory_order_relaxed) &&
        out->unique == atomic_load(&t->init_unique) && iov[1].iov_len == sizeof(struct fuse_init_out)) {
        struct fuse_init_out body;
        struct iovec patched[2] = { iov[0], { &body, sizeof body } };
        memcpy(&body, iov[1].iov_base, sizeof body);
        patch_init(t, &body);
        // Over the ring, /dev/fuse carries only forgets and interrupts:
        // nothing to spin for.
        if (atomic_load(&t->ring_asked)) receivers_configure(&t->receivers, fd, 0);
        atomic_store(&t->init_done, 1);
        ssize_t n = write_reply(t, fd, patched, 2);
        if (t->ring) {
            if (n > 0) ring_start(t->ring);
            else {
                ring_stop(t->ring);
                t->ring = NULL;
            }
        }
        return n;
    }
    return write_reply(t, fd, iov, count);
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
static void rename_spliced(struct vanish_transport *t, int pipe_writer, size_t size) {
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
    // A spliced request is not otherwise seen here: a STATX's reply needs its id.
    if (rename_unknown(t, request, (size_t)n)) vanish_thread.unique = ((struct fuse_in_header *)request)->unique;
    if (write(pipe_writer, request, (size_t)n) != n) {
        // Cannot happen with an empty pipe of at least a page; if it did,
        // libfuse would find a short request and answer it with an error.
    }
}

static ssize_t t_splice_receive(int fdin, off_t *offin, int fdout, off_t *offout, size_t len, unsigned int flags,
                                void *userdata) {
    struct vanish_transport *t = userdata;
    struct splice_args a = { offin, fdout, offout, len, flags };
    // A spliced request's header stays in the pipe: not ordered.
    order_idle();
    order_thread_serves(t);
    ssize_t n = receivers_receive(&t->receivers, fdin, atomic_load_explicit(&t->init_done, memory_order_acquire),
                                  splice_from, &a);
    if (n == tmpfile_request_size || n == statx_request_size) rename_spliced(t, fdout, (size_t)n);
    return n;
}

static ssize_t t_splice_send(int fdin, off_t *offin, int fdout, off_t *offout, size_t len, unsigned int flags,
                             void *userdata) {
    struct vanish_transport *t = userdata;
    // libfuse splices only replies to the device.
    return splice(fdin, offin, receivers_reply_fd(&t->receivers, fdout), offout, len, flags);
}

// Every CREATE libfuse hands the filesystem comes here first: the one of
// "/" is an O_TMPFILE open (see tmpfile_request_size).
static void t_create(fuse_req_t req, fuse_ino_t parent, const char *name, mode_t mode, struct fuse_file_info *fi) {
    struct vanish_transport *t = fuse_req_userdata(req);
    if (t->tmpfile && name[0] == '/' && name[1] == 0) t->tmpfile(req, parent, mode, fi);
    else if (t->create) t->create(req, parent, name, mode, fi);
    else fuse_reply_err(req, ENOSYS);
}

static void transport_thread_serves(struct vanish_transport *t);
static void hook_received(void *t, void *request, size_t size) { transport_received(t, request, size); }
static void hook_thread_serves(void *t) { transport_thread_serves(t); }

struct vanish_transport *vanish_transport_new(void *owner) {
    struct vanish_transport *t = calloc(1, sizeof *t);
    if (!t) return NULL;
    t->head.owner = owner;
    pthread_mutex_init(&t->statx_lock, NULL);
    order_init(&t->order);
    t->hooks = (struct vanish_channel_hooks){ t, hook_received, hook_thread_serves };
    receivers_init(&t->receivers, &t->hooks);
    return t;
}

// Gives the calling request thread `t`'s slice, once per thread (the
// channels' `thread_serves` hook).
static void transport_thread_serves(struct vanish_transport *t) {
    if (!t->slice_us || vanish_thread.sliced == t) return;
    vanish_thread.sliced = t;
    // A shorter slice than the others' wins the CPU when the thread wakes
    // for a request (EEVDF picks the earliest deadline), without a larger share.
    vanish_thread_set_slice(t->slice_us);
}

void vanish_transport_set_slice(struct vanish_transport *t, uint32_t microseconds) {
    t->slice_us = microseconds;
}


void vanish_transport_free(struct vanish_transport *t) {
    if (!t) return;
    vanish_transport_close(t);
    receivers_destroy(&t->receivers);
    order_destroy(&t->order);
    pthread_mutex_destroy(&t->statx_lock);
    if (vanish_thread.transport == t) vanish_thread = (struct vanish_thread){ 0 };
    free(t);
}

struct fuse_session *vanish_transport_session_new(struct vanish_transport *t, struct fuse_args *args,
                                                  const struct fuse_lowlevel_ops *ops, vanish_tmpfile_op tmpfile) {
    struct fuse_lowlevel_ops mine = *ops;
    t->create = ops->create;
    t->tmpfile = tmpfile;
    if (ops->create || tmpfile) mine.create = t_create;
    // libfuse copies the table.
    t->session = fuse_session_new(args, &mine, sizeof mine, t);
    return t->session;
}

int vanish_transport_install(struct vanish_transport *t, int fd) {
    static const struct fuse_custom_io io = {
        .writev = t_writev,
        .read = t_read,
        .splice_receive = t_splice_receive,
        .splice_send = t_splice_send,
    };
    return fuse_session_custom_io(t->session, &io, fd);
}

ssize_t vanish_transport_receive_hook(struct vanish_transport *t, int fd, void *buf, size_t len) {
    return t_read(fd, buf, len, t);
}

ssize_t vanish_transport_reply_hook(struct vanish_transport *t, int fd, struct iovec *iov, int count) {
    return t_writev(fd, iov, count, t);
}

uint64_t vanish_transport_offered(const struct vanish_transport *t) { return atomic_load(&t->offered); }

uint64_t vanish_transport_request(struct vanish_transport *t, uint64_t want, uint32_t max_stack_depth) {
    want &= negotiable;
    atomic_store(&t->stack_depth, max_stack_depth);
    atomic_store(&t->wanted, want);
    uint64_t offered = atomic_load(&t->offered);
    uint64_t got = want & offered;
    if (got >> 32 && !(offered & FUSE_INIT_EXT)) got &= 0xffffffffULL;
    return got;
}

uint64_t vanish_transport_granted(const struct vanish_transport *t) { return atomic_load(&t->granted); }

int vanish_transport_device_fd(const struct vanish_transport *t) {
    return t->session ? fuse_session_fd(t->session) : -1;
}

void vanish_transport_set_spin(struct vanish_transport *t, uint32_t microseconds) {
    receivers_configure(&t->receivers, fuse_session_fd(t->session), microseconds);
}

void vanish_transport_set_ring_spin(struct vanish_transport *t, uint32_t microseconds) {
    t->ring_spin_us = microseconds;
}

uint32_t vanish_transport_spin_microseconds(struct vanish_transport *t) {
    if (t->ring && atomic_load(&t->ring_asked)) {
        struct vanish_ring_info info;
        ring_info(t->ring, &info);
        return info.spin_microseconds;
    }
    return receivers_spin_microseconds(&t->receivers);
}

void vanish_transport_close(struct vanish_transport *t) {
    if (t->ring) {
        ring_stop(t->ring);
        t->ring = NULL;
    }
    receivers_close(&t->receivers);
}

void vanish_transport_set_ring(struct vanish_transport *t, int mode) { atomic_store(&t->ring_mode, mode); }

int vanish_transport_ring_wanted(const struct vanish_transport *t) {
    uint64_t offered = atomic_load(&t->offered);
    return atomic_load(&t->ring_mode) != VANISH_RING_OFF && (offered & VANISH_RING_INIT_FLAG) && (offered & FUSE_INIT_EXT);
}

void vanish_transport_ring_info(const struct vanish_transport *t, struct vanish_ring_info *info) {
    memset(info, 0, sizeof *info);
    if (t->ring) ring_info(t->ring, info);
    info->mode = atomic_load(&t->ring_mode);
    info->error = atomic_load(&t->ring_error);
    info->offered = (atomic_load(&t->offered) & VANISH_RING_INIT_FLAG) != 0;
    info->forgets = atomic_load_explicit(&t->receivers.forgets, memory_order_relaxed);
    info->forget_reads = atomic_load_explicit(&t->receivers.forget_reads, memory_order_relaxed);
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

int vanish_reply_open_backing(fuse_req_t req, const struct fuse_file_info *fi, int32_t backing_id) {
    if (backing_id <= 0) return fuse_reply_open(req, fi);
    struct fuse_open_out o;
    fill_open(&o, fi, backing_id);
    struct iovec iov = { &o, sizeof o };
    return fuse_reply_iov(req, &iov, 1);
}

void vanish_request_begin(fuse_req_t req, pid_t caller, int awaited) {
    vanish_thread.req = req;
    if (awaited) receivers_caller_begins(&((struct vanish_transport *)fuse_req_userdata(req))->receivers, caller);
}

void vanish_workers_may_block(void) {
    if (ring_may_block()) return;
    struct vanish_transport *t = vanish_thread.transport;
    if (t) receivers_may_block(&t->receivers);
}

int vanish_reply_attr_birth(fuse_req_t req, const struct stat *st, double timeout, uint64_t birth) {
    struct vanish_transport *t = fuse_req_userdata(req);
    struct vanish_thread *me = &vanish_thread;
    // A STATX this thread is serving (its handler replies on the thread
    // that received it): the fuse_statx_out, built whole.
    if (me->req == req && me->unique && me->transport == t && statx_forget(t, me->unique)) {
        struct fuse_attr_out a;
        memset(&a, 0, sizeof a);
        a.attr_valid = timeout_sec(timeout);
        a.attr_valid_nsec = timeout_nsec(timeout);
        fill_attr(&a.attr, st);
        struct vanish_fuse_statx_out x;
        fill_statx(&x, &a, birth);
        struct iovec iov = { &x, sizeof x };
        return fuse_reply_iov(req, &iov, 1);
    }
    return fuse_reply_attr(req, st, timeout);
}

int vanish_reply_create_backing(fuse_req_t req, const struct fuse_entry_param *e,
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

