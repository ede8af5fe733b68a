// What a channel (libfuse's workers reading /dev/fuse, workers.c; the
// io_uring queues, ring.c) tells the transport it belongs to. A channel
// calls only these hooks, never the transport or another channel, so either
// can go (the ring with libfuse >= 3.17's own) without touching the other.
// Internal to the transport.
#ifndef VANISH_CHANNEL_H
#define VANISH_CHANNEL_H

#include <stddef.h>

struct vanish_channel_hooks {
    void *transport;
    // Every request, as it arrives, before libfuse sees it (it may rename the opcode).
    void (*received)(void *transport, void *request, size_t size);
    // The calling thread is about to serve requests of this transport.
    void (*thread_serves)(void *transport);
};

#endif
