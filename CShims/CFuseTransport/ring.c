// FUSE over io_uring beneath libfuse 3.14, which knows nothing of it. See
// ring.h and docs/design.md ("Requests over io_uring").
//
// The kernel puts each request on the queue of the CPU its caller runs on,
// into one of that queue's registered entries, and completes the entry's
// FETCH in the task that submitted it. So a thread that blocks in a handler
// holds up every entry it submitted: here each thread has one entry and an
// io_uring of its own. It waits for a request in its entry, runs it through
// libfuse (`fuse_session_process_buf`) on the caller's CPU with no hand-off,
// and sends the reply with the COMMIT_AND_FETCH that waits for its next
// request: one io_uring_enter per request.
//
// A handler that blocks (a slow or stalled backing filesystem, an fsync)
// holds only its own entry; the kernel gives new requests to the other
// threads' entries. When every thread of a queue is busy, the watchdog (or
// a handler that says it may block) adds one, up to `max_threads_per_queue`.
//
// A reply from another thread than the entry's (libfuse allows replying
// later from anywhere) is left in the entry and the owner, which waits for
// it, woken to commit it: only an entry's owner touches its io_uring.
//
// Lock order: a queue's `lock` is a leaf.

#define FUSE_USE_VERSION 314

#include "ring.h"
#include "channel.h"
#include "CFuseTransport.h"
#include "CLinux.h"

#include <errno.h>
#include <fuse_lowlevel.h>
#include <liburing.h>
#include <linux/fuse.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

// The kernel's io_uring protocol for FUSE (include/uapi/linux/fuse.h, 7.42);
// Debian 12's header (7.38) has none of it.
enum { ring_in_out_size = 128, ring_op_in_size = 128 };
struct ring_ent_in_out {
    uint64_t flags;
    uint64_t commit_id;
    uint32_t payload_sz;
    uint32_t padding;
    uint64_t reserved;
};
struct ring_header {
    char in_out[ring_in_out_size];
    char op_in[ring_op_in_size];
    struct ring_ent_in_out ent;
};
struct ring_cmd {
    uint64_t flags;
    uint64_t commit_id;
    uint16_t qid;
    uint8_t padding[6];
};
enum { ring_cmd_register = 1, ring_cmd_commit_and_fetch = 2 };
_Static_assert(sizeof(struct ring_header) == 288, "fuse_uring_req_header is 288 bytes");
_Static_assert(sizeof(struct ring_cmd) <= 80, "the command fits the SQE128 command area");

enum { threads_per_queue_at_start = 4, max_threads_per_queue = 16 };
static const uint64_t stall_ns = 500 * 1000;

struct queue;

// A thread of a queue, with its entry and its io_uring.
struct worker {
    struct queue *queue;
    pthread_t thread;
    struct io_uring ring;
    struct ring_header *header;
    char *payload;             // the payload buffer the kernel fills
    char *request;             // the request copied whole for libfuse (see `serve`)
    uint64_t commit_id;
    _Atomic uint64_t unique;   // the request being served (0: none, or answered)
    int registered;            // its REGISTER completed once
    int polling;               // its poll of stop_fd is queued
    uint64_t busy_since;       // when its handler began (0: waiting); under the queue's lock
    int answered;              // the reply is in the entry; under the queue's lock
    pthread_cond_t answer;     // signalled when another thread answered
    struct iovec iov[2];       // its entry's header and payload, as registered
};

struct queue {
    struct vanish_ring *ring;
    int qid;
    pthread_mutex_t lock;
    int count;                 // workers made (never fewer: they stop only with the ring)
    int idle;                  // workers waiting for a request
    _Atomic int spinning;      // a worker watches its entry after a reply
    _Atomic pid_t last_caller; // whose request this queue served last
    _Atomic int one_caller;    // its last two requests came from one caller
    _Atomic uint64_t watches;  // replies after which a worker watched its entry
    struct worker *workers[max_threads_per_queue];
};

struct vanish_ring {
    const struct vanish_channel_hooks *hooks;
    struct fuse_session *se;
    int device_fd;
    uint64_t spin_ns;
    int queue_count;
    size_t payload_size, header_size, request_size;
    struct queue *queues;
    int stop_fd;  // an eventfd every worker's io_uring polls: written to stop them
    _Atomic int stopping;
    _Atomic int active;
    _Atomic int served;        // a request came over the ring
    _Atomic int thread_count;
    _Atomic uint64_t last_request;
    _Atomic int busy;  // handlers running now
    pthread_t watchdog;
    int watchdog_running;
    pthread_mutex_t start_lock;
    pthread_cond_t start_cond;
    int started;
};

static _Thread_local struct worker *me;

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ULL + (uint64_t)t.tv_nsec;
}

static void *map_buffer(size_t size) {
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

// Queues the entry's next command: REGISTER until it has one, then
// COMMIT_AND_FETCH. By its worker only.
static void queue_command(struct worker *w) {
    struct vanish_ring *rg = w->queue->ring;
    struct io_uring_sqe *sqe = io_uring_get_sqe(&w->ring);
    if (!sqe) return;  // one entry, one SQE: never full
    memset(sqe, 0, 128);
    sqe->opcode = IORING_OP_URING_CMD;
    sqe->flags = IOSQE_FIXED_FILE;
    sqe->fd = 0;
    sqe->cmd_op = w->registered ? ring_cmd_commit_and_fetch : ring_cmd_register;
    io_uring_sqe_set_data(sqe, w);
    struct ring_cmd *cmd = (struct ring_cmd *)sqe->cmd;
    cmd->qid = (uint16_t)w->queue->qid;
    if (w->registered) {
        cmd->commit_id = w->commit_id;
    } else {
        // With the first command, the poll that wakes the worker to stop.
        struct io_uring_sqe *poll = w->polling ? NULL : io_uring_get_sqe(&w->ring);
        if (poll) {
            w->polling = 1;
            io_uring_prep_poll_add(poll, rg->stop_fd, POLLIN);
            io_uring_sqe_set_data(poll, NULL);
        }
        w->iov[0] = (struct iovec){ w->header, sizeof(struct ring_header) };
        w->iov[1] = (struct iovec){ w->payload, rg->payload_size };
        sqe->addr = (uint64_t)(uintptr_t)w->iov;
        sqe->len = 2;
    }
}

static void free_worker(struct worker *w) {
    struct vanish_ring *rg = w->queue->ring;
    if (w->ring.ring_fd >= 0) io_uring_queue_exit(&w->ring);
    if (w->header) munmap(w->header, rg->header_size);
    if (w->payload) munmap(w->payload, rg->payload_size);
    if (w->request) munmap(w->request, rg->request_size);
    pthread_cond_destroy(&w->answer);
    free(w);
}

static struct worker *make_worker(struct queue *q) {
    struct vanish_ring *rg = q->ring;
    struct worker *w = calloc(1, sizeof *w);
    if (!w) return NULL;
    w->queue = q;
    w->ring.ring_fd = -1;
    pthread_cond_init(&w->answer, NULL);
    struct io_uring_params params;
    memset(&params, 0, sizeof params);
    params.flags = IORING_SETUP_SQE128;
    int files[1] = { rg->device_fd };
    w->header = map_buffer(rg->header_size);
    w->payload = map_buffer(rg->payload_size);
    w->request = map_buffer(rg->request_size);
    if (!w->header || !w->payload || !w->request || io_uring_queue_init_params(2, &w->ring, &params) < 0 ||
        io_uring_register_files(&w->ring, files, 1) < 0) {
        if (w->ring.ring_fd < 0) w->ring.ring_fd = -1;
        free_worker(w);
        return NULL;
    }
    return w;
}

static void *worker_thread(void *arg);

// Adds a worker to `q` and starts it. Under the queue's lock. 0 or -errno.
static int add_worker_locked(struct queue *q) {
    struct vanish_ring *rg = q->ring;
    if (q->count >= max_threads_per_queue || atomic_load(&rg->stopping)) return -EAGAIN;
    struct worker *w = make_worker(q);
    if (!w) return -ENOMEM;
    int r = pthread_create(&w->thread, NULL, worker_thread, w);
    if (r != 0) {
        free_worker(w);
        return -r;
    }
    q->workers[q->count++] = w;
    atomic_fetch_add(&rg->thread_count, 1);
    return 0;
}

// Runs the request the entry holds through libfuse, as the kernel gave it.
static void serve(struct worker *w) {
    struct vanish_ring *rg = w->queue->ring;
    struct fuse_in_header *in = (struct fuse_in_header *)w->header->in_out;
    uint32_t payload = w->header->ent.payload_sz;
    w->commit_id = w->header->ent.commit_id;
    size_t length = in->len;
    if (length < sizeof *in + payload || length - sizeof *in - payload > ring_op_in_size ||
        payload > rg->payload_size) {
        // Not a request the protocol allows: answer it, never leave it.
        struct fuse_out_header *out = (struct fuse_out_header *)w->header->in_out;
        uint64_t unique = in->unique;
        memset(out, 0, sizeof *out);
        out->unique = unique;
        out->error = -EIO;
        out->len = sizeof *out;
        w->header->ent.payload_sz = 0;
        w->answered = 1;
        return;
    }
    // A copy of its own: a handler may read the request (a name) after its
    // reply, when the entry holds the reply and then the next request, as
    // a /dev/fuse worker's request stays in its buffer until its next read.
    size_t op = length - sizeof *in - payload;
    char *request = w->request;
    memcpy(request, in, sizeof *in);
    memcpy(request + sizeof *in, w->header->op_in, op);
    memcpy(request + sizeof *in + op, w->payload, payload);
    atomic_store_explicit(&w->unique, in->unique, memory_order_release);
    atomic_store_explicit(&rg->last_request, now_ns(), memory_order_relaxed);
    struct queue *q = w->queue;
    pid_t last = atomic_exchange_explicit(&q->last_caller, (pid_t)in->pid, memory_order_relaxed);
    atomic_store_explicit(&q->one_caller, last == (pid_t)in->pid, memory_order_relaxed);
    rg->hooks->received(rg->hooks->transport, request, length);
    struct fuse_buf buf = { .size = length, .flags = 0, .mem = request, .fd = -1, .pos = 0 };
    fuse_session_process_buf(rg->se, &buf);
}

// Waits for the entry's next request (sending the reply it holds, if any).
// 0, or the command's -errno; -ECANCELED when the ring stops.
static int next_request(struct worker *w) {
    struct queue *q = w->queue;
    struct vanish_ring *rg = q->ring;
    int spin = 0;
    // Only while one caller makes call after call (as over /dev/fuse): with
    // several (git's parallel lstats), a request comes to the entry of a
    // watcher that is runnable but not running, and on a busy CPU it waits
    // there for the watcher's turn behind every other task, where a
    // sleeping thread would have been woken ahead of them.
    if (rg->spin_ns && w->registered && atomic_load_explicit(&q->one_caller, memory_order_relaxed)) {
        int none = 0;
        spin = atomic_compare_exchange_strong(&q->spinning, &none, 1);
    }
    int r = 0;
    if (spin) {
        // A program's next call comes a few microseconds after the reply,
        // from the CPU it ran on. Sleeping now makes the kernel wake this
        // thread for it, and the program tends to be woken on the other,
        // idle CPU, whose thread then must be woken in turn: watch the
        // entry a while, yielding the CPU to the program meanwhile.
        atomic_fetch_add_explicit(&q->watches, 1, memory_order_relaxed);
        r = io_uring_submit(&w->ring);
        uint64_t start = now_ns();
        while (!io_uring_cq_ready(&w->ring) && now_ns() - start < rg->spin_ns) sched_yield();
        atomic_store(&q->spinning, 0);
    }
    for (;;) {
        if (r >= 0 && !io_uring_cq_ready(&w->ring)) r = io_uring_submit_and_wait(&w->ring, 1);
        if (r < 0 && r != -EINTR && r != -EBUSY) return r;
        r = 0;
        struct io_uring_cqe *cqe;
        if (io_uring_cq_ready(&w->ring) && io_uring_peek_cqe(&w->ring, &cqe) == 0) {
            int res = cqe->res;
            void *data = io_uring_cqe_get_data(cqe);
            io_uring_cqe_seen(&w->ring, cqe);
            return data ? res : -ECANCELED;
        }
        if (atomic_load(&rg->stopping)) return -ECANCELED;
    }
}

static void *worker_thread(void *arg) {
    struct worker *w = arg;
    struct queue *q = w->queue;
    struct vanish_ring *rg = q->ring;
    me = w;
    rg->hooks->thread_serves(rg->hooks->transport);
    char name[16];
    snprintf(name, sizeof name, "vanish-ring-%d", q->qid);
    pthread_setname_np(pthread_self(), name);
    // The kernel queued these requests from this CPU: serve them there.
    cpu_set_t cpus;
    CPU_ZERO(&cpus);
    CPU_SET(q->qid, &cpus);
    sched_setaffinity(0, sizeof cpus, &cpus);

    pthread_mutex_lock(&rg->start_lock);
    while (!rg->started) pthread_cond_wait(&rg->start_cond, &rg->start_lock);
    pthread_mutex_unlock(&rg->start_lock);

    queue_command(w);  // REGISTER
    pthread_mutex_lock(&q->lock);
    q->idle++;
    pthread_mutex_unlock(&q->lock);
    while (!atomic_load(&rg->stopping)) {
        int res = next_request(w);
        if (atomic_load(&rg->stopping)) break;
        if (res == -EINTR || res == -EAGAIN) {
            // A REGISTER before the kernel took INIT, or interrupted: again.
            queue_command(w);
            continue;
        }
        if (res < 0) {
            // -ENOTCONN, -ENODEV, -ECANCELED: the connection ended (unmount).
            if (res != -ENOTCONN && res != -ENODEV && res != -ECANCELED)
                fprintf(stderr, "vanish: io_uring queue %d: %s\n", q->qid, strerror(-res));
            break;
        }
        w->registered = 1;
        if (!atomic_load_explicit(&rg->served, memory_order_relaxed)) atomic_store(&rg->served, 1);
        pthread_mutex_lock(&q->lock);
        q->idle--;
        w->busy_since = now_ns();
        w->answered = 0;
        pthread_mutex_unlock(&q->lock);
        atomic_fetch_add_explicit(&rg->busy, 1, memory_order_relaxed);
        serve(w);
        atomic_fetch_sub_explicit(&rg->busy, 1, memory_order_relaxed);
        pthread_mutex_lock(&q->lock);
        // Answered later by another thread: wait for it (the entry is ours).
        while (!w->answered && !atomic_load(&rg->stopping)) pthread_cond_wait(&w->answer, &q->lock);
        w->busy_since = 0;
        q->idle++;
        pthread_mutex_unlock(&q->lock);
        queue_command(w);  // COMMIT_AND_FETCH
    }
    return NULL;
}

static void *watchdog(void *arg) {
    struct vanish_ring *rg = arg;
    pthread_setname_np(pthread_self(), "vanish-ringdog");
    vanish_thread_set_slice(0);  // not a request thread: the kernel's slice
    while (!atomic_load(&rg->stopping)) {
        uint64_t now = now_ns();
        int recent = now - atomic_load_explicit(&rg->last_request, memory_order_relaxed) < 1000000000ULL;
        for (int i = 0; i < rg->queue_count && recent; i++) {
            struct queue *q = &rg->queues[i];
            pthread_mutex_lock(&q->lock);
            int stalled = 0;
            for (int j = 0; j < q->count && !stalled; j++)
                stalled = q->workers[j]->busy_since && now - q->workers[j]->busy_since > stall_ns;
            if (stalled && q->idle == 0) add_worker_locked(q);
            pthread_mutex_unlock(&q->lock);
        }
        // Every millisecond while a handler runs, every 5 ms between
        // requests, every 50 ms once none came for a second.
        int busy = atomic_load_explicit(&rg->busy, memory_order_relaxed) > 0;
        struct timespec tick = { 0, busy ? 1000000L : recent ? 5000000L : 50000000L };
        nanosleep(&tick, NULL);
    }
    return NULL;
}

int ring_prepare(const struct vanish_channel_hooks *hooks, struct fuse_session *se, size_t max_payload,
                 uint64_t spin_ns, struct vanish_ring **made) {
    long possible = sysconf(_SC_NPROCESSORS_CONF);
    if (possible < 1 || possible > 4096) return -EINVAL;
    long page = sysconf(_SC_PAGESIZE);
    struct vanish_ring *rg = calloc(1, sizeof *rg);
    if (!rg) return -ENOMEM;
    rg->hooks = hooks;
    rg->se = se;
    rg->device_fd = fuse_session_fd(se);
    rg->spin_ns = spin_ns;
    rg->payload_size = (max_payload + (size_t)page - 1) / (size_t)page * (size_t)page;
    rg->header_size = (size_t)page;
    rg->request_size = (size_t)page + rg->payload_size;  // the in and op headers, then the payload
    rg->stop_fd = eventfd(0, EFD_CLOEXEC);
    rg->queues = calloc((size_t)possible, sizeof(struct queue));
    if (rg->stop_fd < 0 || !rg->queues) {
        int e = rg->stop_fd < 0 ? errno : ENOMEM;
        if (rg->stop_fd >= 0) close(rg->stop_fd);
        free(rg->queues);
        free(rg);
        return -e;
    }
    rg->queue_count = (int)possible;
    pthread_mutex_init(&rg->start_lock, NULL);
    pthread_cond_init(&rg->start_cond, NULL);
    int r = 0;
    for (int i = 0; i < rg->queue_count; i++) {
        struct queue *q = &rg->queues[i];
        q->ring = rg;
        q->qid = i;
        pthread_mutex_init(&q->lock, NULL);
    }
    for (int i = 0; i < rg->queue_count && r == 0; i++) {
        struct queue *q = &rg->queues[i];
        pthread_mutex_lock(&q->lock);
        for (int j = 0; j < threads_per_queue_at_start && r == 0; j++) r = add_worker_locked(q);
        pthread_mutex_unlock(&q->lock);
    }
    if (r == 0) {
        r = -pthread_create(&rg->watchdog, NULL, watchdog, rg);
        rg->watchdog_running = r == 0;
    }
    if (r != 0) {
        ring_stop(rg);
        return r;
    }
    *made = rg;
    return 0;
}

void ring_start(struct vanish_ring *rg) {
    atomic_store(&rg->active, 1);
    pthread_mutex_lock(&rg->start_lock);
    rg->started = 1;
    pthread_cond_broadcast(&rg->start_cond);
    pthread_mutex_unlock(&rg->start_lock);
}

static struct worker *find_worker(struct vanish_ring *rg, uint64_t unique) {
    if (me && me->queue->ring == rg && atomic_load_explicit(&me->unique, memory_order_acquire) == unique) return me;
    for (int i = 0; i < rg->queue_count; i++) {
        struct queue *q = &rg->queues[i];
        pthread_mutex_lock(&q->lock);
        int n = q->count;
        pthread_mutex_unlock(&q->lock);
        for (int j = 0; j < n; j++) {
            struct worker *w = q->workers[j];
            if (atomic_load_explicit(&w->unique, memory_order_acquire) == unique) return w;
        }
    }
    return NULL;
}

int ring_reply(struct vanish_ring *rg, uint64_t unique, const struct iovec *iov, int count, ssize_t *written) {
    if (unique == 0 || !atomic_load_explicit(&rg->active, memory_order_relaxed)) return 0;
    struct worker *w = find_worker(rg, unique);
    if (!w) return 0;
    // Claimed once: a second reply to the same request finds nothing.
    uint64_t expected = unique;
    if (!atomic_compare_exchange_strong(&w->unique, &expected, 0)) return 0;
    struct fuse_out_header *out = (struct fuse_out_header *)w->header->in_out;
    memcpy(out, iov[0].iov_base, sizeof *out);
    size_t length = 0;
    for (int i = 1; i < count; i++) {
        if (length + iov[i].iov_len > rg->payload_size) {
            out->error = -EIO;
            length = 0;
            break;
        }
        memcpy(w->payload + length, iov[i].iov_base, iov[i].iov_len);
        length += iov[i].iov_len;
    }
    w->header->ent.payload_sz = (uint32_t)length;
    out->len = (uint32_t)(sizeof *out + length);
    // The owner sends it with its next wait, once its handler returned.
    struct queue *q = w->queue;
    pthread_mutex_lock(&q->lock);
    w->answered = 1;
    if (w != me) pthread_cond_signal(&w->answer);
    pthread_mutex_unlock(&q->lock);
    *written = (ssize_t)(sizeof *out + length);
    return 1;
}

int ring_may_block(void) {
    struct worker *w = me;
    if (!w) return 0;
    struct queue *q = w->queue;
    pthread_mutex_lock(&q->lock);
    // This one's entry is taken until the handler returns: keep one free.
    if (q->idle == 0) add_worker_locked(q);
    pthread_mutex_unlock(&q->lock);
    return 1;
}

int ring_serves(const struct vanish_ring *rg) {
    return atomic_load_explicit(&rg->active, memory_order_relaxed) &&
           atomic_load_explicit(&rg->served, memory_order_relaxed);
}

void ring_stop(struct vanish_ring *rg) {
    atomic_store(&rg->stopping, 1);
    atomic_store(&rg->active, 0);
    pthread_mutex_lock(&rg->start_lock);
    rg->started = 1;
    pthread_cond_broadcast(&rg->start_cond);
    pthread_mutex_unlock(&rg->start_lock);
    if (rg->watchdog_running) pthread_join(rg->watchdog, NULL);
    rg->watchdog_running = 0;
    // Wakes every worker waiting in the kernel (its poll of stop_fd completes).
    uint64_t one = 1;
    if (write(rg->stop_fd, &one, sizeof one) != sizeof one) {
        // An eventfd write of 1 fails only on overflow: it cannot.
    }
    for (int i = 0; i < rg->queue_count; i++) {
        struct queue *q = &rg->queues[i];
        // No worker is added once stopping is set.
        pthread_mutex_lock(&q->lock);
        int n = q->count;
        for (int j = 0; j < n; j++) pthread_cond_signal(&q->workers[j]->answer);
        pthread_mutex_unlock(&q->lock);
        for (int j = 0; j < n; j++) {
            struct worker *w = q->workers[j];
            pthread_join(w->thread, NULL);
            free_worker(w);
        }
        q->count = 0;
        pthread_mutex_destroy(&q->lock);
    }
    pthread_mutex_destroy(&rg->start_lock);
    pthread_cond_destroy(&rg->start_cond);
    close(rg->stop_fd);
    free(rg->queues);
    free(rg);
}

void ring_info(const struct vanish_ring *rg, struct vanish_ring_info *info) {
    info->active = atomic_load(&rg->active);
    info->queues = rg->queue_count;
    info->threads = atomic_load(&rg->thread_count);
    info->depth = rg->queue_count ? info->threads / rg->queue_count : 0;
    info->spin_microseconds = (uint32_t)(rg->spin_ns / 1000);
    info->watches = 0;
    for (int i = 0; i < rg->queue_count; i++)
        info->watches += atomic_load_explicit(&rg->queues[i].watches, memory_order_relaxed);
    info->buffer_bytes = (uint64_t)info->threads * (rg->header_size + rg->payload_size + rg->request_size);
}
