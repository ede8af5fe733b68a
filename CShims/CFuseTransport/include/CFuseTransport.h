// The FUSE transport: libfuse 3.14 serves the whole protocol, and this layer,
// installed with fuse_session_custom_io, passes every request and reply
// through unchanged except for what 3.14 does not know: the INIT reply's
// newer flags (passthrough, parallel dirops, killpriv v2, direct_io mmap,
// io_uring), FUSE_TMPFILE, given to the filesystem's tmpfile operation, and
// FUSE_STATX, answered with a birth time. Open and create replies that carry
// a backing id (passthrough) are built here whole. Requests come over
// /dev/fuse (workers.c) or io_uring (ring.c).
//
// One `struct vanish_transport` per session holds all of it: FUSEKit's
// Session makes it, gives it to libfuse as the session's userdata (so the
// filesystem's own object is its `owner`), and frees it after the session.
#ifndef VANISH_CFUSETRANSPORT_H
#define VANISH_CFUSETRANSPORT_H

#include <stdint.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>

struct fuse_session;
struct fuse_req;
struct fuse_args;
struct fuse_file_info;
struct fuse_entry_param;
struct fuse_lowlevel_ops;

/// INIT flags (64-bit: flags | flags2 << 32) this layer can negotiate.
extern const uint64_t VANISH_FUSE_PASSTHROUGH;
extern const uint64_t VANISH_FUSE_PARALLEL_DIROPS;
extern const uint64_t VANISH_FUSE_HANDLE_KILLPRIV_V2;
extern const uint64_t VANISH_FUSE_DIRECT_IO_ALLOW_MMAP;

struct vanish_transport;

/// The start of every transport: what FUSEKit reads on each request.
struct vanish_transport_head {
    void *owner;
};

/// The `owner` given to vanish_transport_new, from a session's userdata
/// (`fuse_req_userdata`, or what the init and destroy operations get).
static inline void *vanish_transport_owner(void *userdata) {
    return ((struct vanish_transport_head *)userdata)->owner;
}

/// A transport for one session, its filesystem `owner`; NULL without memory.
struct vanish_transport *vanish_transport_new(void *owner);

/// Frees it, after its session was destroyed (closing it first if needed).
void vanish_transport_free(struct vanish_transport *t);

/// An O_TMPFILE open in `parent`: FUSE_TMPFILE, which libfuse 3.14 does not know.
typedef void (*vanish_tmpfile_op)(struct fuse_req *req, uint64_t parent, mode_t mode, struct fuse_file_info *fi);

/// `fuse_session_new` with the transport as the session's userdata, the
/// operations `ops` and, for O_TMPFILE opens, `tmpfile` (NULL: refused, as
/// libfuse 3.14 refuses them). NULL if libfuse refused the arguments.
struct fuse_session *vanish_transport_session_new(struct vanish_transport *t, struct fuse_args *args,
                                                  const struct fuse_lowlevel_ops *ops, vanish_tmpfile_op tmpfile);

/// Installs the transport on its session, serving `fd`: the mounted
/// session's /dev/fuse fd (or, in tests, a pipe). Call once, after
/// fuse_session_mount and before the loop. 0 or -errno.
int vanish_transport_install(struct vanish_transport *t, int fd);

/// The flags the kernel offered in its INIT request (0 before it came).
uint64_t vanish_transport_offered(const struct vanish_transport *t);

/// From the filesystem's init operation: ask for `want` (of the flags above)
/// and, with passthrough, the stacking depth the kernel is told. Returns what
/// will be granted: what the kernel offered of `want`. The INIT reply is
/// patched as it is written.
uint64_t vanish_transport_request(struct vanish_transport *t, uint64_t want, uint32_t max_stack_depth);

/// What the INIT reply granted (after it was sent).
uint64_t vanish_transport_granted(const struct vanish_transport *t);

/// How workers receive requests over /dev/fuse (workers.c): with
/// `spin_microseconds` above 0, one at a time, reading on that long after a
/// reply while requests come that close together; with 0, libfuse's way.
/// Call before the loop.
void vanish_transport_set_spin(struct vanish_transport *t, uint32_t spin_microseconds);
/// How long a ring worker watches its entry after a reply (µs), yielding its
/// CPU to the program meanwhile. Call before the loop.
void vanish_transport_set_ring_spin(struct vanish_transport *t, uint32_t spin_microseconds);
// The EEVDF slice (µs, 100 to 100000; 0: the kernel's) each request thread takes when it starts serving.
void vanish_transport_set_slice(struct vanish_transport *t, uint32_t microseconds);

/// The session's /dev/fuse fd (-1 before the session exists), for
/// registering backing files.
int vanish_transport_device_fd(const struct vanish_transport *t);

/// The spin in effect (µs; 0: libfuse's way), for `vanish status`.
uint32_t vanish_transport_spin_microseconds(struct vanish_transport *t);

/// Whether requests may come over io_uring (FUSE_OVER_IO_URING, kernel 6.14+
/// with the fuse module's enable_uring set): VANISH_RING_AUTO asks for it
/// where the kernel offers it. Call before the loop.
enum { VANISH_RING_OFF = 0, VANISH_RING_AUTO = 1 };
void vanish_transport_set_ring(struct vanish_transport *t, int mode);

/// From the init operation: whether the INIT reply will ask for the ring
/// (the mode allows it and the kernel offered it). Splicing does not
/// mix with it: replies are written into the ring's buffers.
int vanish_transport_ring_wanted(const struct vanish_transport *t);

struct vanish_ring_info {
    int mode;               // as set (VANISH_RING_*)
    int active;             // requests come over io_uring
    int offered;            // the kernel offered it in INIT
    int error;              // errno of a ring that could not be made (0: none)
    int queues;             // one per possible CPU
    int depth;              // entries per queue
    int threads;            // threads serving the queues now
    uint32_t spin_microseconds;  // how long a receiver watches its queue after a reply
    uint64_t buffer_bytes;  // mapped for the entries' buffers (touched as used)
    uint64_t forgets;       // nodes forgotten in forgets read from /dev/fuse
    uint64_t forget_reads;  // the reads that brought them
    uint64_t watches;       // replies after which a ring thread watched its entry
};
void vanish_transport_ring_info(const struct vanish_transport *t, struct vanish_ring_info *info);

/// Closes what the transport opened and stops its threads (once the loop
/// has ended), so the session's own fd is the last one on the connection.
void vanish_transport_close(struct vanish_transport *t);

/// The transport's receive and reply hooks as libfuse calls them, on any fd
/// (a pipe), for tests that drive its rewrites with recorded requests and
/// replies, without a mount.
ssize_t vanish_transport_receive_hook(struct vanish_transport *t, int fd, void *buf, size_t len);
ssize_t vanish_transport_reply_hook(struct vanish_transport *t, int fd, struct iovec *iov, int count);

// What a request handler calls, on the thread serving its request.

/// First, from every request's handler: `awaited` when its caller waits
/// for the reply, with the caller's thread id (lets another worker receive
/// if callers are queueing).
void vanish_request_begin(struct fuse_req *req, pid_t caller, int awaited);

/// From a handler about to do something that may take long (an fsync, a
/// wait for another thread): lets another worker receive meanwhile.
void vanish_workers_may_block(void);

/// From the handler of `req`, about to record a change (an event): waits
/// until no other worker is handling a change-recording request the kernel
/// sent earlier (a smaller request id), and over io_uring until every
/// earlier request arrived, so changes are recorded in the kernel's order:
/// up to `timeout_ns` for requests yet to arrive, four times that for ones
/// being handled. 1 if none was left (or `req` is not being served here:
/// answered already, or never begun), 0 on timeout.
int vanish_order_wait_for_earlier(struct fuse_req *req, uint64_t timeout_ns);

/// From the handler of `req`, which has recorded all it will record and is
/// about to wait (for the kernel to drop an entry, which may need a lock a
/// later request holds while it waits in vanish_order_wait_for_earlier):
/// later changes need not wait for it any more.
void vanish_order_done(struct fuse_req *req);

/// `fuse_reply_attr`, with the file's birth time (ns since the epoch; 0:
/// unknown), which goes out when the request was a FUSE_STATX.
int vanish_reply_attr_birth(struct fuse_req *req, const struct stat *st, double timeout, uint64_t birth);

/// fuse_reply_open / fuse_reply_create, with the reply marked passthrough to
/// `backing_id` (from vanish_backing_open) when it is above 0.
int vanish_reply_open_backing(struct fuse_req *req, const struct fuse_file_info *fi, int32_t backing_id);
int vanish_reply_create_backing(struct fuse_req *req, const struct fuse_entry_param *e,
                                const struct fuse_file_info *fi, int32_t backing_id);

/// FUSE_DEV_IOC_BACKING_OPEN on the session's device: registers `fd` as a
/// backing file; returns its id (> 0) or -errno.
int32_t vanish_backing_open(int devfd, int fd);

/// FUSE_DEV_IOC_BACKING_CLOSE: 0 or -errno.
int vanish_backing_close(int devfd, int32_t backing_id);

/// Whether this process has CAP_SYS_ADMIN in its effective set, which
/// registering backing files needs.
int vanish_has_cap_sys_admin(void);

#endif
