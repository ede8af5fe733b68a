// How libfuse's workers receive requests. See workers.h.
#define FUSE_USE_VERSION 314

#include "workers.h"
#include "CLinux.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/fuse.h>
#include <pthread.h>
#include <semaphore.h>
#include <stddef.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/uio.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

// A program that makes one call after another (a shell, `tar x`, a build
// step) sends its next request a few microseconds after the reply to its
// last. libfuse keeps every idle worker asleep in read(2), and waking one,
// on another CPU, costs more here than serving most requests. So:
//
// - While one caller makes call after call, one worker at a time receives:
//   it spins for up to `spin_ns`, reading a non-blocking clone of the
//   device (the same request queue) while the calls come that close
//   together, then sleeps in read(2). The other idle workers wait here, not
//   in the kernel, so a request wakes nobody.
// - The receiver hands its place to a waiting worker before it serves a
//   request of another caller than the last, or one whose handler says it
//   may block (`vanish_workers_may_block`); while callers alternate, idle
//   workers wait in the kernel as libfuse has them.
// - A watchdog hands it over when the receiver has been serving for longer
//   than `stall_ns` (a cold disk), so no request waits behind a slow one
//   for long.
//
// - While it receives for one caller, the receiver runs on that caller's
//   CPU (read from /proc every `follow_ns`), as a ring's thread does: the
//   caller blocks in its call, the receiver (yielding to it until then)
//   reads the request with nothing to wake on another CPU, and its reply
//   wakes the caller where it slept. Across CPUs each round trip woke an
//   idle one (`rm -rf` of 10k files: 479 ms against 316 ms, harness).
//
// Over io_uring the device carries only forgets and interrupts, and the
// one worker left there sleeps in read(2). Every `rm` of a file evicts its
// inode, and the kernel's FORGET woke that worker from inside the unlink:
// a wake-up on the other CPU that was a third of `rm -rf`'s own time. Once
// the ring has served a request, a worker that read forgets reads again at
// most `forget_pace_ns` later: the forgets queue in the
// kernel meanwhile, come as one BATCH_FORGET, and find nobody to wake. An
// interrupt read then waits up to that long too.
//
// Lock order: `lock` is a leaf; nothing blocks while it is held.

// A worker waiting to become the receiver.
struct receiver {
    sem_t wake;
    struct receiver *next;
    int ready;
};

// The request this worker serves came through `spin_fd`: its reply must go
// back there, since the kernel finds a request by the fd it was read from.
static _Thread_local int served_from_clone;
static _Thread_local struct receiver self;
static _Thread_local int has_semaphore;

static const uint64_t polite_after_ns = 10 * 1000;
static const uint64_t stall_ns = 500 * 1000;
static const uint64_t watchdog_tick_ns = 1000 * 1000;
static const uint64_t watchdog_idle_ns = 1000 * 1000 * 1000;
static const uint64_t forget_pace_ns = 1000 * 1000;
// How often a receiver pinned to its caller's CPU reads where the caller runs now.
static const uint64_t follow_ns = 2 * 1000 * 1000;

// The CPU this worker is pinned to while it receives for `pinned_for`
// (-1: none), when it last read where that caller runs, and its own
// affinity to go back to.
static _Thread_local int pinned_cpu = -1;
static _Thread_local pid_t pinned_for;
static _Thread_local uint64_t pinned_at;
static _Thread_local cpu_set_t own_cpus;

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ULL + (uint64_t)t.tv_nsec;
}

void receivers_init(struct vanish_receivers *r, const struct vanish_channel_hooks *hooks) {
    memset(r, 0, sizeof *r);
    r->hooks = hooks;
    r->spin_fd = -1;
    r->session_fd = -1;
    pthread_mutex_init(&r->lock, NULL);
    pthread_cond_init(&r->watchdog_wake, NULL);
}

void receivers_destroy(struct vanish_receivers *r) {
    receivers_close(r);
    pthread_mutex_destroy(&r->lock);
    pthread_cond_destroy(&r->watchdog_wake);
}

// The CPU thread `tid` last ran on (field 39 of /proc/TID/stat), or -1.
static int cpu_of(pid_t tid) {
    char path[48], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)tid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return -1;
    buf[n] = 0;
    // The command name may hold spaces and parentheses: count from its end.
    char *p = strrchr(buf, ')');
    if (!p) return -1;
    int field = 2;
    for (p++; *p && field < 39; p++)
        if (*p == ' ') field++;
    if (field != 39 || *p < '0' || *p > '9') return -1;
    return atoi(p);
}

// Back to the affinity the worker had before it followed a caller.
static void unpin(void) {
    if (pinned_cpu < 0) return;
    sched_setaffinity(0, sizeof own_cpus, &own_cpus);
    pinned_cpu = -1;
}

// Runs this worker on the CPU `caller` last ran on, reading it again every
// `follow_ns` (a caller seldom moves while it makes call after call).
static void follow(pid_t caller) {
    uint64_t now = now_ns();
    if (pinned_cpu >= 0 && pinned_for == caller && now - pinned_at < follow_ns) return;
    pinned_for = caller;
    pinned_at = now;
    int cpu = caller > 0 ? cpu_of(caller) : -1;
    if (cpu == pinned_cpu) return;
    if (pinned_cpu < 0 && sched_getaffinity(0, sizeof own_cpus, &own_cpus) != 0) return;
    if (cpu < 0 || cpu >= CPU_SETSIZE || !CPU_ISSET(cpu, &own_cpus)) {
        unpin();
        return;
    }
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    if (sched_setaffinity(0, sizeof one, &one) == 0) pinned_cpu = cpu;
}

// Once, by the first receiver after INIT.
static void open_spin_fd(struct vanish_receivers *r) {
    int fd = open("/dev/fuse", O_RDWR | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return;
    uint32_t master = (uint32_t)r->session_fd;
    if (ioctl(fd, FUSE_DEV_IOC_CLONE, &master) != 0) {
        close(fd);
        return;
    }
    atomic_store(&r->spin_fd, fd);
}

// Makes the most recent waiting worker the receiver. Under `lock`.
static void hand_over_locked(struct vanish_receivers *r) {
    struct receiver *w = r->waiting;
    if (!w || r->receiving) return;
    r->waiting = w->next;
    r->receiving = 1;
    r->unattended_since = 0;
    w->ready = 1;
    sem_post(&w->wake);
}

static void *watchdog(void *arg) {
    struct vanish_receivers *r = arg;
    pthread_setname_np(pthread_self(), "vanish-workers");
    vanish_thread_set_slice(0);  // not a request thread: the kernel's slice
    pthread_mutex_lock(&r->lock);
    while (r->watchdog_state == 1) {
        uint64_t now = now_ns();
        if (!r->unattended_since && now - r->last_request > watchdog_idle_ns) {
            // Idle: sleep until requests come again (stop_receiving signals).
            pthread_cond_wait(&r->watchdog_wake, &r->lock);
            continue;
        }
        if (r->unattended_since && now - r->unattended_since > stall_ns) hand_over_locked(r);
        pthread_mutex_unlock(&r->lock);
        struct timespec tick = { 0, (long)watchdog_tick_ns };
        nanosleep(&tick, NULL);
        pthread_mutex_lock(&r->lock);
    }
    pthread_mutex_unlock(&r->lock);
    return NULL;
}

struct waiting_args { struct vanish_receivers *r; struct receiver *me; };

static void stop_waiting(void *arg) {
    // Cancelled while waiting (the loop ends): leave the list.
    struct waiting_args *a = arg;
    struct vanish_receivers *r = a->r;
    pthread_mutex_lock(&r->lock);
    for (struct receiver **p = &r->waiting; *p; p = &(*p)->next) {
        if (*p == a->me) {
            *p = a->me->next;
            break;
        }
    }
    if (a->me->ready) r->receiving = 0;
    pthread_mutex_unlock(&r->lock);
}

// Waits until this worker may receive. Returns with `receiving` set for it.
static void become_receiver(struct vanish_receivers *r) {
    pthread_mutex_lock(&r->lock);
    if (r->watchdog_state == 0) {
        r->watchdog_state = 1;
        if (pthread_create(&r->watchdog_thread, NULL, watchdog, r) != 0) r->watchdog_state = 3;
    }
    if (!r->receiving) {
        r->receiving = 1;
        r->unattended_since = 0;
        pthread_mutex_unlock(&r->lock);
        return;
    }
    if (!has_semaphore) {
        sem_init(&self.wake, 0, 0);
        has_semaphore = 1;
    }
    self.ready = 0;
    self.next = r->waiting;
    r->waiting = &self;
    pthread_mutex_unlock(&r->lock);
    struct waiting_args a = { r, &self };
    pthread_cleanup_push(stop_waiting, &a);
    while (sem_wait(&self.wake) != 0) {}  // EINTR: a signal, keep waiting
    pthread_cleanup_pop(0);
}

// The receiver got a request (or an error): someone else receives next.
static void stop_receiving(struct vanish_receivers *r) {
    uint64_t now = now_ns();
    pthread_mutex_lock(&r->lock);
    r->receiving = 0;
    r->unattended_since = now;
    if (now - r->last_request > watchdog_idle_ns) pthread_cond_signal(&r->watchdog_wake);
    r->last_request = now;
    pthread_mutex_unlock(&r->lock);
}

void receivers_caller_begins(struct vanish_receivers *r, pid_t caller) {
    // Another caller than the last one waiting for a reply: callers are
    // making calls side by side, so another worker receives while this one
    // serves, as libfuse would have it.
    if (!atomic_load_explicit(&r->spin_ns, memory_order_relaxed)) return;
    pid_t last = atomic_exchange_explicit(&r->last_caller, caller, memory_order_relaxed);
    atomic_store_explicit(&r->one_caller, last == caller, memory_order_relaxed);
    if (last != caller) {
        pthread_mutex_lock(&r->lock);
        hand_over_locked(r);
        pthread_mutex_unlock(&r->lock);
    }
}

void receivers_may_block(struct vanish_receivers *r) {
    if (!atomic_load_explicit(&r->spin_ns, memory_order_relaxed)) return;
    pthread_mutex_lock(&r->lock);
    hand_over_locked(r);
    pthread_mutex_unlock(&r->lock);
}

void receivers_received(struct vanish_receivers *r, uint32_t opcode, uint32_t nodes, int ring_serves) {
    int forget = opcode == FUSE_FORGET || opcode == FUSE_BATCH_FORGET;
    if (forget) {
        atomic_fetch_add_explicit(&r->forgets, nodes, memory_order_relaxed);
        atomic_fetch_add_explicit(&r->forget_reads, 1, memory_order_relaxed);
    }
    int pace = ring_serves && forget;
    atomic_store_explicit(&r->forget_read_at, pace ? now_ns() : 0, memory_order_relaxed);
}

// After a forget read less than `forget_pace_ns` ago, waits out the rest
// (as the receiver: the watchdog hands over only from a slow handler).
static void pace_after_forget(struct vanish_receivers *r) {
    uint64_t at = atomic_load_explicit(&r->forget_read_at, memory_order_relaxed);
    if (!at) return;
    uint64_t since = now_ns() - at;
    if (since >= forget_pace_ns) return;
    struct timespec wait = { 0, (long)(forget_pace_ns - since) };
    nanosleep(&wait, NULL);
}

ssize_t receivers_receive(struct vanish_receivers *r, int fd, int initialized,
                          ssize_t (*call)(int from, void *context), void *context) {
    uint64_t budget = atomic_load_explicit(&r->spin_ns, memory_order_relaxed);
    served_from_clone = 0;
    r->hooks->thread_serves(r->hooks->transport);
    if (!budget || !initialized) {
        unpin();
        if (!atomic_load_explicit(&r->forget_read_at, memory_order_relaxed)) return call(fd, context);
        // Forgets stream in: one worker at a time reads, paced, so no
        // other waits in read(2) for a forget to wake it.
        become_receiver(r);
        pace_after_forget(r);
        ssize_t n = call(fd, context);
        int saved = errno;
        stop_receiving(r);
        errno = saved;
        return n;
    }
    int untried = 0;
    if (atomic_compare_exchange_strong(&r->clone_tried, &untried, 1)) open_spin_fd(r);
    int from = atomic_load_explicit(&r->spin_fd, memory_order_relaxed);
    if (from < 0) return call(fd, context);

    // Several callers at once: every idle worker waits in the kernel, as
    // libfuse has them, and the CPUs are the callers'.
    if (!atomic_load_explicit(&r->one_caller, memory_order_relaxed)) {
        unpin();
        return call(fd, context);
    }
    become_receiver(r);
    follow(atomic_load_explicit(&r->last_caller, memory_order_relaxed));
    // While the caller's requests come close together, spin: without
    // yielding at first, then yielding to anything else that wants this CPU
    // (the statahead threads, the kernel's I/O threads).
    int spin = atomic_load_explicit(&r->requests_close, memory_order_relaxed);
    uint64_t start = spin ? now_ns() : 0;
    ssize_t n;
    for (;;) {
        n = call(from, context);
        if (n >= 0 || errno != EAGAIN || !spin) break;
        uint64_t spun = now_ns() - start;
        if (spun >= budget) break;
        // On the caller's CPU, every look first lets the caller run.
        if (spun >= polite_after_ns || pinned_cpu >= 0) sched_yield();
    }
    if (n >= 0 || errno != EAGAIN) {
        int saved = errno;
        served_from_clone = n > 0;
        stop_receiving(r);
        errno = saved;
        return n;
    }
    uint64_t asked = now_ns();
    n = call(fd, context);
    int saved = errno;
    atomic_store_explicit(&r->requests_close, n > 0 && now_ns() - asked < budget, memory_order_relaxed);
    stop_receiving(r);
    errno = saved;
    return n;
}

ssize_t receivers_write_reply(struct vanish_receivers *r, int fd, const struct iovec *iov, int count) {
    const struct fuse_out_header *out = iov[0].iov_base;
    int clone = atomic_load_explicit(&r->spin_fd, memory_order_relaxed);
    if (out->unique == 0 || clone < 0) return writev(fd, iov, count);
    int first = served_from_clone ? clone : fd;
    ssize_t n = writev(first, iov, count);
    // A reply not found there (to an INTERRUPT of a request another worker
    // read) goes to the other fd.
    if (n < 0 && errno == ENOENT) n = writev(first == fd ? clone : fd, iov, count);
    return n;
}

int receivers_reply_fd(struct vanish_receivers *r, int fd) {
    int clone = atomic_load_explicit(&r->spin_fd, memory_order_relaxed);
    return served_from_clone && clone >= 0 ? clone : fd;
}

void receivers_configure(struct vanish_receivers *r, int device_fd, uint32_t spin_microseconds) {
    r->session_fd = device_fd;
    atomic_store(&r->spin_ns, (uint64_t)spin_microseconds * 1000);
}

uint32_t receivers_spin_microseconds(struct vanish_receivers *r) {
    return (uint32_t)(atomic_load_explicit(&r->spin_ns, memory_order_relaxed) / 1000);
}

void receivers_close(struct vanish_receivers *r) {
    atomic_store(&r->spin_ns, 0);
    pthread_mutex_lock(&r->lock);
    int running = r->watchdog_state == 1;
    if (running) r->watchdog_state = 2;
    pthread_cond_signal(&r->watchdog_wake);
    pthread_mutex_unlock(&r->lock);
    if (running) pthread_join(r->watchdog_thread, NULL);
    int fd = atomic_exchange(&r->spin_fd, -1);
    if (fd >= 0) close(fd);
}
