// How libfuse's workers receive requests (workers.c): one receiver at a
// time, spinning while requests come close together. Internal to the
// transport; Swift sees vanish_workers_may_block through CFuseTransport.h.
#ifndef VANISH_WORKERS_H
#define VANISH_WORKERS_H

#include <stdint.h>
#include <sys/types.h>

struct iovec;

/// Receives one request with `call` (a read or a splice, from the fd it is
/// given) for libfuse: `fd` is the session's device. Before the session is
/// `initialized` (INIT answered), or with spinning off, just `call(fd)`.
ssize_t vanish_workers_receive(int fd, int initialized, ssize_t (*call)(int from, void *context), void *context);

/// Writes a reply to the fd its request came from.
ssize_t vanish_workers_write_reply(int fd, const struct iovec *iov, int count, uint64_t unique);

/// Where a spliced reply of this worker goes, for `fd` the one libfuse chose.
int vanish_workers_reply_fd(int fd);

void vanish_workers_configure(int device_fd, uint32_t spin_microseconds);
void vanish_workers_close(void);

#endif
