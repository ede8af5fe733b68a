// How libfuse's workers receive requests (workers.c): one receiver at a
// time, spinning while requests come close together. Internal to the
// transport, which calls it; it calls only its hooks (channel.h).
#ifndef VANISH_WORKERS_H
#define VANISH_WORKERS_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/types.h>

#include "channel.h"

struct iovec;
struct receiver;

// A session's receiving workers. Lock order: `lock` is a leaf.
struct vanish_receivers {
    const struct vanish_channel_hooks *hooks;
    _Atomic uint64_t spin_ns;       // 0: libfuse's own way (every idle worker in read(2))
    _Atomic int spin_fd;            // the non-blocking clone (-1: none)
    int session_fd;
    _Atomic int clone_tried;        // the first receiver after INIT opens the clone
    pthread_mutex_t lock;
    pthread_cond_t watchdog_wake;
    struct receiver *waiting;       // LIFO: the last to wait has the warmest cache
    int receiving;                  // a worker is receiving (spinning or in read(2))
    uint64_t unattended_since;      // when the last receiver took a request (0: someone receives)
    uint64_t last_request;          // when a request was last received
    int watchdog_state;             // 0: not started, 1: running, 2: asked to stop, 3: could not start
    pthread_t watchdog_thread;
    // The receiver's last request came soon after it asked: requests are close.
    _Atomic int requests_close;
    // The caller (thread id) of the last request someone waits for, and
    // whether the one before was from the same caller: one caller is making
    // one call after another.
    _Atomic pid_t last_caller;
    _Atomic int one_caller;
    // When the last read brought forgets while the ring serves every other
    // request (0: it brought anything else): see `receivers_received`.
    _Atomic uint64_t forget_read_at;
    // Forgets read from the device (the nodes in them), and the reads that brought them.
    _Atomic uint64_t forgets;
    _Atomic uint64_t forget_reads;
};

void receivers_init(struct vanish_receivers *r, const struct vanish_channel_hooks *hooks);
void receivers_destroy(struct vanish_receivers *r);

/// Receives one request with `call` (a read or a splice, from the fd it is
/// given) for libfuse: `fd` is the session's device. Before the session is
/// `initialized` (INIT answered), or with spinning off, just `call(fd)`.
ssize_t receivers_receive(struct vanish_receivers *r, int fd, int initialized,
                          ssize_t (*call)(int from, void *context), void *context);

/// What a worker read from the device (its opcode; `nodes` a forget
/// names), and whether the ring serves the session's requests: paces the
/// next read after a forget.
void receivers_received(struct vanish_receivers *r, uint32_t opcode, uint32_t nodes, int ring_serves);

/// Writes a reply to the fd its request came from.
ssize_t receivers_write_reply(struct vanish_receivers *r, int fd, const struct iovec *iov, int count);

/// Where a spliced reply of this worker goes, for `fd` the one libfuse chose.
int receivers_reply_fd(struct vanish_receivers *r, int fd);

/// From the start of every request a caller waits for, with its caller's
/// thread id (on the thread serving it): lets another worker receive if
/// callers are queueing.
void receivers_caller_begins(struct vanish_receivers *r, pid_t caller);

/// From a handler that may take long, on the thread serving it: another
/// worker receives meanwhile.
void receivers_may_block(struct vanish_receivers *r);

void receivers_configure(struct vanish_receivers *r, int device_fd, uint32_t spin_microseconds);
uint32_t receivers_spin_microseconds(struct vanish_receivers *r);
/// Stops the watchdog and closes the clone (after the loop ended).
void receivers_close(struct vanish_receivers *r);

#endif
