// How libfuse's workers receive requests. See workers.h.
#define FUSE_USE_VERSION 314

#include "workers.h"
#include "ring.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/fuse.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdatomic.h>
#include <sys/ioctl.h>
#include <sys/uio.h>
#include <sched.h>
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
// Lock order: `lock` is a leaf; nothing blocks while it is held.

struct worker {
    sem_t wake;
    struct worker *next;
    int ready;
};

static _Atomic uint64_t spin_ns;    // 0: libfuse's own way (every idle worker in read(2))
static _Atomic int spin_fd = -1;    // the non-blocking clone (-1: none)
static int session_fd = -1;
static pthread_once_t spin_once = PTHREAD_ONCE_INIT;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t watchdog_wake = PTHREAD_COND_INITIALIZER;
static struct worker *waiting;      // LIFO: the last to wait has the warmest cache
static int receiving;               // a worker is receiving (spinning or in read(2))
static uint64_t unattended_since;   // when the last receiver took a request (0: someone receives)
static uint64_t last_request;       // when a request was last received
static int watchdog_state;          // 0: not started, 1: running, 2: asked to stop
static pthread_t watchdog_thread;

// The request this worker serves came through `spin_fd`: its reply must go
// back there, since the kernel finds a request by the fd it was read from.
static _Thread_local int served_from_clone;
// The receiver's last request came soon after it asked: requests are close.
static _Atomic int requests_close;
// The caller (thread id) of the last request someone waits for, and
// whether the one before was from the same caller: one caller is making
// one call after another.
static _Atomic pid_t last_caller;
static _Atomic int one_caller;
static _Thread_local struct worker self;

static const uint64_t polite_after_ns = 10 * 1000;
static const uint64_t stall_ns = 500 * 1000;
static const uint64_t watchdog_tick_ns = 1000 * 1000;
static const uint64_t watchdog_idle_ns = 1000 * 1000 * 1000;

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ULL + (uint64_t)t.tv_nsec;
}

static void open_spin_fd(void) {
    int fd = open("/dev/fuse", O_RDWR | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return;
    uint32_t master = (uint32_t)session_fd;
    if (ioctl(fd, FUSE_DEV_IOC_CLONE, &master) != 0) {
        close(fd);
        return;
    }
    spin_fd = fd;
}

// Makes the most recent waiting worker the receiver. Under `lock`.
static void hand_over_locked(void) {
    struct worker *w = waiting;
    if (!w || receiving) return;
    waiting = w->next;
    receiving = 1;
    unattended_since = 0;
    w->ready = 1;
    sem_post(&w->wake);
}

static void *watchdog(void *arg) {
    (void)arg;
    pthread_setname_np(pthread_self(), "vanish-workers");
    pthread_mutex_lock(&lock);
    while (watchdog_state == 1) {
        uint64_t now = now_ns();
        if (!unattended_since && now - last_request > watchdog_idle_ns) {
            // Idle: sleep until requests come again (stop_receiving signals).
            pthread_cond_wait(&watchdog_wake, &lock);
            continue;
        }
        if (unattended_since && now - unattended_since > stall_ns) hand_over_locked();
        pthread_mutex_unlock(&lock);
        struct timespec tick = { 0, (long)watchdog_tick_ns };
        nanosleep(&tick, NULL);
        pthread_mutex_lock(&lock);
    }
    pthread_mutex_unlock(&lock);
    return NULL;
}

static void stop_waiting(void *arg) {
    // Cancelled while waiting (the loop ends): leave the list.
    struct worker *me = arg;
    pthread_mutex_lock(&lock);
    for (struct worker **p = &waiting; *p; p = &(*p)->next) {
        if (*p == me) {
            *p = me->next;
            break;
        }
    }
    if (me->ready) receiving = 0;
    pthread_mutex_unlock(&lock);
}

// Waits until this worker may receive. Returns with `receiving` set for it.
static void become_receiver(void) {
    pthread_mutex_lock(&lock);
    if (watchdog_state == 0) {
        watchdog_state = 1;
        if (pthread_create(&watchdog_thread, NULL, watchdog, NULL) != 0) watchdog_state = 3;
    }
    if (!receiving) {
        receiving = 1;
        unattended_since = 0;
        pthread_mutex_unlock(&lock);
        return;
    }
    static _Thread_local int has_semaphore;
    if (!has_semaphore) {
        sem_init(&self.wake, 0, 0);
        has_semaphore = 1;
    }
    self.ready = 0;
    self.next = waiting;
    waiting = &self;
    pthread_mutex_unlock(&lock);
    pthread_cleanup_push(stop_waiting, &self);
    while (sem_wait(&self.wake) != 0) {}  // EINTR: a signal, keep waiting
    pthread_cleanup_pop(0);
}

// The receiver got a request (or an error): someone else receives next.
static void stop_receiving(void) {
    uint64_t now = now_ns();
    pthread_mutex_lock(&lock);
    receiving = 0;
    unattended_since = now;
    if (now - last_request > watchdog_idle_ns) pthread_cond_signal(&watchdog_wake);
    last_request = now;
    pthread_mutex_unlock(&lock);
}

void vanish_workers_begin(pid_t caller) {
    // Another caller than the last one waiting for a reply: callers are
    // making calls side by side, so another worker receives while this one
    // serves, as libfuse would have it.
    if (!atomic_load_explicit(&spin_ns, memory_order_relaxed)) return;
    pid_t last = atomic_exchange_explicit(&last_caller, caller, memory_order_relaxed);
    atomic_store_explicit(&one_caller, last == caller, memory_order_relaxed);
    if (last != caller) {
        pthread_mutex_lock(&lock);
        hand_over_locked();
        pthread_mutex_unlock(&lock);
    }
}

void vanish_workers_may_block(void) {
    if (ring_may_block()) return;
    if (!atomic_load_explicit(&spin_ns, memory_order_relaxed)) return;
    pthread_mutex_lock(&lock);
    hand_over_locked();
    pthread_mutex_unlock(&lock);
}

ssize_t vanish_workers_receive(int fd, int initialized, ssize_t (*call)(int from, void *context), void *context) {
    uint64_t budget = atomic_load_explicit(&spin_ns, memory_order_relaxed);
    served_from_clone = 0;
    if (!budget || !initialized) return call(fd, context);
    pthread_once(&spin_once, open_spin_fd);
    int from = spin_fd;
    if (from < 0) return call(fd, context);

    // Several callers at once: every idle worker waits in the kernel, as
    // libfuse has them, and the CPUs are the callers'.
    if (!atomic_load_explicit(&one_caller, memory_order_relaxed)) return call(fd, context);
    become_receiver();
    // While the caller's requests come close together, spin: without
    // yielding at first, then yielding to anything else that wants this CPU
    // (the statahead threads, the kernel's I/O threads).
    int spin = atomic_load_explicit(&requests_close, memory_order_relaxed);
    uint64_t start = spin ? now_ns() : 0;
    ssize_t n;
    for (;;) {
        n = call(from, context);
        if (n >= 0 || errno != EAGAIN || !spin) break;
        uint64_t spun = now_ns() - start;
        if (spun >= budget) break;
        if (spun >= polite_after_ns) sched_yield();
    }
    if (n >= 0 || errno != EAGAIN) {
        int saved = errno;
        served_from_clone = n > 0;
        stop_receiving();
        errno = saved;
        return n;
    }
    uint64_t asked = now_ns();
    n = call(fd, context);
    int saved = errno;
    atomic_store_explicit(&requests_close, n > 0 && now_ns() - asked < budget, memory_order_relaxed);
    stop_receiving();
    errno = saved;
    return n;
}

ssize_t vanish_workers_write_reply(int fd, const struct iovec *iov, int count, uint64_t unique) {
    ssize_t written;
    if (ring_reply(unique, iov, count, &written)) return written;
    int clone = spin_fd;
    if (unique == 0 || clone < 0) return writev(fd, iov, count);
    int first = served_from_clone ? clone : fd;
    ssize_t n = writev(first, iov, count);
    // A reply not found there (to an INTERRUPT of a request another worker
    // read) goes to the other fd.
    if (n < 0 && errno == ENOENT) n = writev(first == fd ? clone : fd, iov, count);
    return n;
}

int vanish_workers_reply_fd(int fd) { return served_from_clone && spin_fd >= 0 ? spin_fd : fd; }

void vanish_workers_configure(int device_fd, uint32_t spin_microseconds) {
    session_fd = device_fd;
    atomic_store(&spin_ns, (uint64_t)spin_microseconds * 1000);
}

uint32_t vanish_workers_spin_microseconds(void) {
    return (uint32_t)(atomic_load_explicit(&spin_ns, memory_order_relaxed) / 1000);
}

void vanish_workers_close(void) {
    atomic_store(&spin_ns, 0);
    pthread_mutex_lock(&lock);
    int running = watchdog_state == 1;
    if (running) watchdog_state = 2;
    pthread_cond_signal(&watchdog_wake);
    pthread_mutex_unlock(&lock);
    if (running) pthread_join(watchdog_thread, NULL);
    int fd = atomic_exchange(&spin_fd, -1);
    if (fd >= 0) close(fd);
}
