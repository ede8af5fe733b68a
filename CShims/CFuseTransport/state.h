// The transport's state: one `struct vanish_transport` per session, made
// by FUSEKit's Session and given to libfuse as the session's userdata, so
// every hook and reply helper finds it from what libfuse hands them. Nothing
// here is process-global. Internal to the transport.
//
// Thread-locals, each because libfuse 3.14 runs a request's handler and its
// reply on the thread that received it and hands neither a context of ours
// (3.17 finds the ring entry from the request; these go with this file):
// - `vanish_thread` (order.c): the request the thread serves, its id and its
//   session, for the order table, STATX replies and the thread's slice. A
//   handler asks with its `fuse_req` (`vanish_order_wait_for_earlier`);
//   3.14 keeps the request's id inside that opaque struct, so the id is
//   found here, from the thread serving it.
// - ring.c `me`: the ring worker the thread is, for `ring_may_block` from a
//   handler that only has libfuse's request.
// - workers.c `served_from_clone`, `self`, `has_semaphore`: a libfuse
//   worker's receiving state (where its reply goes, its place among waiting
//   receivers), which libfuse's loop gives no slot for.
// - transport.c `pipe_reader`, `pipe_reader_of`: a read end of the
//   thread's splice pipe, which libfuse keeps per thread too.
// The channels (workers.c, ring.c) reach the transport only through the
// hooks of channel.h, and never each other.
//
// Lock order: statx_lock, order.seen_lock, receivers.lock and each ring
// queue's lock are leaves; none is held while taking another.
#ifndef VANISH_STATE_H
#define VANISH_STATE_H

#define FUSE_USE_VERSION 314

#include "CFuseTransport.h"
#include "channel.h"
#include "workers.h"
#include "CLinux.h"

#include <fuse_lowlevel.h>
#include <linux/fuse.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/types.h>

struct vanish_ring;

// One STATX slot per worker that may hold one at once (`threads=` is at
// most 256), so the table never fills; if it did, the request would stay a
// STATX, which libfuse answers ENOSYS.
enum { statx_slots = 256 };

// A slot per thread in the order table (see order.c).
enum { order_slots = 256 };

// Over io_uring, the window of request ids whose arrival is tracked.
enum { seen_window = 8192 };

struct vanish_order {
    _Atomic uint64_t unique[order_slots];   // 0: not handling a request
    _Atomic uint32_t opcode[order_slots];
    _Atomic int slots_used;
    // Over io_uring: every id below `seen_low` arrived (or was given up
    // on); `seen` holds the ones above it.
    _Atomic int tracks_arrival;
    pthread_mutex_t seen_lock;
    _Atomic uint64_t seen_low;
    uint8_t seen[seen_window / 8];
};

struct vanish_transport {
    struct vanish_transport_head head;  // first: what FUSEKit reads inline
    struct fuse_session *session;
    // The filesystem's create, which the transport's own create calls for
    // every CREATE that is not an O_TMPFILE open, and its tmpfile.
    void (*create)(fuse_req_t, fuse_ino_t, const char *, mode_t, struct fuse_file_info *);
    vanish_tmpfile_op tmpfile;

    // INIT, as read and as answered.
    _Atomic uint64_t init_unique;   // the INIT request's id, once read
    _Atomic uint64_t offered;       // its flags | flags2 << 32
    _Atomic uint64_t wanted;        // set by the init callback
    _Atomic uint32_t stack_depth;
    _Atomic uint64_t granted;       // what the INIT reply said
    _Atomic int init_done;

    // FUSE over io_uring.
    _Atomic int ring_mode;          // VANISH_RING_*
    _Atomic int ring_error;         // errno of a ring that could not be made
    _Atomic int ring_asked;         // the INIT reply asks for the ring
    struct vanish_ring *ring;       // its queues, from INIT until close
    uint32_t ring_spin_us;          // how long its workers watch after a reply
    uint32_t slice_us;              // request threads' EEVDF slice (0: the kernel's)

    // STATX requests handed to libfuse as GETATTR, by id, until answered.
    pthread_mutex_t statx_lock;
    uint64_t statx_requests[statx_slots];  // 0: free
    _Atomic int statx_pending;

    struct vanish_order order;
    // The channels: libfuse's workers and the ring, which reach the
    // transport only through `hooks`.
    struct vanish_channel_hooks hooks;
    struct vanish_receivers receivers;
};

// What the calling thread serves.
struct vanish_thread {
    struct vanish_transport *transport;  // the session of its last request (NULL: none yet)
    int order_slot;                      // its slot + 1 in that session's order table (0: none)
    uint64_t unique;                     // the request it handles now (0: none, or answered)
    fuse_req_t req;                      // libfuse's for it, once its handler began
    struct vanish_transport *sliced;     // the session whose slice it has (transport_thread_serves)
};
extern _Thread_local struct vanish_thread vanish_thread;

// order.c: requests recorded in the kernel's order.
void order_received(struct vanish_transport *t, const struct fuse_in_header *in);
// The calling thread serves `t` (a request it has not seen the header of).
void order_thread_serves(struct vanish_transport *t);
void order_idle(void);
void order_init(struct vanish_order *o);
void order_destroy(struct vanish_order *o);

#endif
