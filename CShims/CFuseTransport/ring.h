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

/// Before the INIT reply is written: makes every queue (one io_uring per
/// possible CPU, its buffers sized for `max_payload` bytes) and its first
/// thread, which waits for `ring_start`. A receiver watches its queue for
/// `spin_ns` after each reply before it sleeps. 0, or -errno with nothing
/// left behind (the reply then does not ask for the ring).
int ring_prepare(struct fuse_session *se, int device_fd, size_t max_payload, uint64_t spin_ns);

/// After the INIT reply was written: the threads register their entries
/// and serve.
void ring_start(void);

/// Whether `unique` is a request read from a ring; if so the reply in
/// `iov` is committed there and its length returned in `written`.
int ring_reply(uint64_t unique, const struct iovec *iov, int count, ssize_t *written);

/// From a handler that may take long, on a ring thread: another thread of
/// its queue takes new requests meanwhile. 0 if not on a ring thread.
int ring_may_block(void);

/// Stops and frees everything (after the /dev/fuse loop ended).
void ring_stop(void);

struct vanish_ring_info;
void ring_info(struct vanish_ring_info *info);

/// Set up by transport.c: what it does to every request it receives
/// (renames, ordering), applied to ring requests too.
void vanish_transport_received(void *request, size_t size);

#endif
