// FUSE over io_uring beneath libfuse 3.14 (ring.c). Internal to the
// transport: Swift sees it through CFuseTransport.h.
#ifndef VANISH_RING_H
#define VANISH_RING_H

#include <stdint.h>
#include <sys/types.h>

struct fuse_session;
struct iovec;

/// The INIT flag that asks for the ring (protocol 7.42, in flags2).
#define VANISH_RING_INIT_FLAG (1ULL << 41)

struct vanish_channel_hooks;
struct vanish_ring;
struct vanish_ring_info;

/// Before the INIT reply is written: makes every queue (one io_uring per
/// possible CPU, its buffers sized for `max_payload` bytes) of session `se` and their threads, which wait for `ring_start`. A
/// receiver watches its queue for `spin_ns` after each reply before it
/// sleeps. 0 with the ring in `made`, or -errno with nothing left behind
/// (the reply then does not ask for the ring).
int ring_prepare(const struct vanish_channel_hooks *hooks, struct fuse_session *se, size_t max_payload,
                 uint64_t spin_ns, struct vanish_ring **made);

/// After the INIT reply was written: the threads register their entries
/// and serve.
void ring_start(struct vanish_ring *ring);

/// Whether `unique` is a request read from the ring; if so the reply in
/// `iov` is committed there and its length returned in `written`.
int ring_reply(struct vanish_ring *ring, uint64_t unique, const struct iovec *iov, int count, ssize_t *written);

/// From a handler that may take long, on a ring thread: another thread of
/// its queue takes new requests meanwhile. 0 if not on a ring thread.
int ring_may_block(void);

/// Whether the ring has brought a request and is not stopping: the kernel
/// then sends every request there but forgets and interrupts.
int ring_serves(const struct vanish_ring *ring);

/// Stops the threads and frees the ring (after the /dev/fuse loop ended,
/// or when the INIT reply could not be sent).
void ring_stop(struct vanish_ring *ring);

void ring_info(const struct vanish_ring *ring, struct vanish_ring_info *info);

#endif
