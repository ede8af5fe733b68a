// Changes recorded in the order the kernel gave their requests ids. See
// vanish_order_wait_for_earlier in CFuseTransport.h.
//
// Which request each thread is handling is kept in a table (a slot per
// thread, claimed on its first request), so that a RELEASE (which ends a
// program's writing session, queued before its close() returned) handled
// beside that program's next request is not recorded after it.
//
// Over io_uring a request is not even seen in the kernel's order: the
// thread an entry belongs to may run after another's, and a RELEASE
// (background) may be dispatched after the caller's next request. So there
// a change also waits until every request the kernel numbered before it has
// arrived (ids go up by 2: FUSE_INT_REQ_BIT marks interrupts).
#include "state.h"

#include <sched.h>
#include <string.h>
#include <time.h>

_Thread_local struct vanish_thread vanish_thread;

void order_init(struct vanish_order *o) {
    memset(o, 0, sizeof *o);
    pthread_mutex_init(&o->seen_lock, NULL);
}

void order_destroy(struct vanish_order *o) { pthread_mutex_destroy(&o->seen_lock); }

void order_idle(void) {
    struct vanish_thread *me = &vanish_thread;
    if (me->order_slot) atomic_store_explicit(&me->transport->order.unique[me->order_slot - 1], 0, memory_order_release);
    me->unique = 0;
    me->req = NULL;
}

static int seen_bit(const struct vanish_order *o, uint64_t unique) {
    uint64_t i = (unique / 2) % seen_window;
    return (o->seen[i / 8] >> (i % 8)) & 1;
}

static void set_seen_bit(struct vanish_order *o, uint64_t unique, int on) {
    uint64_t i = (unique / 2) % seen_window;
    if (on) o->seen[i / 8] |= (uint8_t)(1u << (i % 8));
    else o->seen[i / 8] &= (uint8_t)~(1u << (i % 8));
}

// Moves `seen_low` past `up_to` (0: only past what arrived). Under seen_lock.
static void advance_seen_locked(struct vanish_order *o, uint64_t up_to) {
    uint64_t low = atomic_load_explicit(&o->seen_low, memory_order_relaxed);
    while (low <= up_to || seen_bit(o, low)) {
        set_seen_bit(o, low, 0);
        low += 2;
    }
    atomic_store_explicit(&o->seen_low, low, memory_order_release);
}

static void mark_seen(struct vanish_order *o, uint64_t unique) {
    if (unique & 1 || !atomic_load_explicit(&o->tracks_arrival, memory_order_relaxed)) return;
    pthread_mutex_lock(&o->seen_lock);
    uint64_t low = atomic_load_explicit(&o->seen_low, memory_order_relaxed);
    if (low == 0) atomic_store_explicit(&o->seen_low, low = unique, memory_order_relaxed);  // the first after INIT
    if (unique >= low) {
        // Far ahead: what falls out of the window is given up on.
        if ((unique - low) / 2 >= seen_window) advance_seen_locked(o, unique - 2 * seen_window);
        set_seen_bit(o, unique, 1);
        advance_seen_locked(o, 0);
    }
    pthread_mutex_unlock(&o->seen_lock);
}

static int all_earlier_seen(struct vanish_order *o, uint64_t unique) {
    if (!atomic_load_explicit(&o->tracks_arrival, memory_order_relaxed)) return 1;
    return atomic_load_explicit(&o->seen_low, memory_order_acquire) > unique;
}

void order_thread_serves(struct vanish_transport *t) {
    struct vanish_thread *me = &vanish_thread;
    if (me->transport != t) {
        // A thread of another session (tests make several): a slot there.
        me->transport = t;
        me->order_slot = 0;
    }
}

void order_received(struct vanish_transport *t, const struct fuse_in_header *in) {
    struct vanish_thread *me = &vanish_thread;
    order_idle();
    order_thread_serves(t);
    struct vanish_order *o = &t->order;
    if (!me->order_slot) {
        int slot = atomic_fetch_add(&o->slots_used, 1);
        if (slot < order_slots) me->order_slot = slot + 1;
        else atomic_fetch_sub(&o->slots_used, 1);
    }
    if (me->order_slot) {
        atomic_store_explicit(&o->opcode[me->order_slot - 1], in->opcode, memory_order_relaxed);
        atomic_store_explicit(&o->unique[me->order_slot - 1], in->unique, memory_order_release);
    }
    me->unique = in->unique;
    mark_seen(o, in->unique);
}

// The requests whose handlers record changes (events).
static int records_changes(uint32_t opcode) {
    switch (opcode) {
    case FUSE_RELEASE: case FUSE_CREATE: case FUSE_MKNOD: case FUSE_MKDIR: case FUSE_SYMLINK:
    case FUSE_LINK: case FUSE_UNLINK: case FUSE_RMDIR: case FUSE_RENAME: case FUSE_RENAME2:
    case FUSE_SETATTR: case FUSE_SETXATTR: case FUSE_REMOVEXATTR: case FUSE_IOCTL:
        return 1;
    default:
        return 0;
    }
}

// How much longer than its timeout a change waits for an earlier one that is being handled.
enum { handling_wait_factor = 4 };

// libfuse 3.14 keeps a request's id inside its opaque fuse_req, so the id
// is found from the thread serving `req`, which is the thread that received
// it (3.17 finds the ring entry from the request itself).
static int serves(const struct vanish_thread *me, fuse_req_t req) {
    return req && me->req == req && me->unique != 0 && me->transport;
}

void vanish_order_done(fuse_req_t req) {
    if (serves(&vanish_thread, req)) order_idle();
}

int vanish_order_wait_for_earlier(fuse_req_t req, uint64_t timeout_ns) {
    struct vanish_thread *me = &vanish_thread;
    if (!serves(me, req)) return 1;
    uint64_t current = me->unique;
    struct vanish_order *o = &me->transport->order;
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        int earlier = 0;
        int used = atomic_load_explicit(&o->slots_used, memory_order_relaxed);
        if (used > order_slots) used = order_slots;
        for (int i = 0; i < used && !earlier; i++) {
            if (i == me->order_slot - 1) continue;
            uint64_t u = atomic_load_explicit(&o->unique[i], memory_order_acquire);
            earlier = u != 0 && u < current &&
                      records_changes(atomic_load_explicit(&o->opcode[i], memory_order_relaxed));
        }
        int arrived = all_earlier_seen(o, current);
        if (!earlier && arrived) return 1;
        clock_gettime(CLOCK_MONOTONIC, &now);
        uint64_t elapsed = (uint64_t)(now.tv_sec - start.tv_sec) * 1000000000u + (uint64_t)(now.tv_nsec - start.tv_nsec);
        // An earlier change being handled will be recorded: it is worth
        // waiting for longer (a loaded machine, a RELEASE reading its file
        // to tell a copy) than an id that has not arrived, which may never.
        if (elapsed >= (earlier ? handling_wait_factor * timeout_ns : timeout_ns)) {
            // An id that never came (a request the kernel dropped before
            // sending it): no later change waits for it again.
            if (!all_earlier_seen(o, current)) {
                pthread_mutex_lock(&o->seen_lock);
                advance_seen_locked(o, current);
                pthread_mutex_unlock(&o->seen_lock);
            }
            return 0;
        }
        sched_yield();
    }
}
