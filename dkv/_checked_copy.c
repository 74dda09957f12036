/* The same-host load's inner loop: copy blocks out of a mapped segment and checksum each copy, without the GIL.
 *
 * copy_and_checksum(segment, dests, offsets, prefixes) -> bytes
 *
 *   segment   a readable buffer (the namespace's mapped segment)
 *   dests     a sequence of writable buffers, one per block; block i is as long as dests[i]
 *   offsets   a sequence of ints: block i lies at segment[offsets[i] : offsets[i] + len(dests[i])]
 *   prefixes  a sequence of bytes: block i's checksum prefix (dkv.checksum.block_prefix)
 *
 * Returns the blocks' checksums, 16 bytes each, back to back: XXH3-128 of prefix || copied bytes in
 * XXH128's canonical (big-endian) form, which is what python-xxhash's xxh3_128(...).digest() gives, so
 * the result compares against dkv.checksum.block_checksum byte for byte. Each block is copied and hashed
 * a chunk at a time, so the hash reads the copy while it is in cache. Every bound is checked before
 * anything is copied (ValueError); the GIL is let go for the copies and hashes of the whole batch.
 * ``KERNEL`` names the build in use: "avx2" where the CPU has it, else "generic" (``use_kernel`` switches).
 * A block of at least ``STREAM_MIN`` bytes (64 KiB) is copied a chunk at a time into a staging buffer of the
 * copying thread's, hashed there, and streamed out to its destination with non-temporal stores: what is hashed
 * is what lands (nothing else writes the stage), the destination is written without being read first, and a
 * large load does not evict the engine's threads' working set from the cache (``set_stream_min`` moves the
 * size, for tests and benchmarks).
 *
 * CheckedCopy(segment, dests, offsets, prefixes, sums) is the same batch shared by threads: each thread's
 * work() claims a few blocks at a time (an atomic counter, no GIL and no lock between claims), copies them
 * and compares their checksums with ``sums`` (the writers', 16 bytes a block), until none is left. So two
 * threads split a batch by what each managed to copy, however late one starts, with one GIL hand-off each
 * (not one a chunk). A mismatch, or stop(), ends every thread's claiming; work() then answers False.
 * work(hold_gil=True) keeps the GIL instead, for a copy of tens of µs on a thread that must not then wait
 * a switch interval for it back.
 *
 * rows_copy(segment, rows, row_bytes, ids, offsets, sizes, sums, head, hashes) makes a CheckedCopy of a
 * load whose destinations are rows of one buffer, straight from a lease's packed slot map, so the caller
 * builds no per-block view, prefix or plan: None when a slot cannot be copied this way.
 *
 * CheckedCopy.post(shares) hands a copy to this module's native threads (see "the pool" below), which run
 * its shares and never take the GIL; result() reads whether it has ended, and wait_ended(timeout) hands
 * each ended copy to Python once (dkv.copy_threads.PostedCopy's watcher). The threads, named
 * "dkv-native-copy", run as batch work at nice ``THREAD_NICE`` (10), or the nice they started with if higher:
 * on a contended core the engine's threads go first.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <semaphore.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "_checked_copy.h"

typedef void (*kernel_t)(const dkv_block *, size_t, unsigned char *);
static kernel_t kernel = dkv_copy_hash_generic;
atomic_size_t dkv_stream_min = DKV_STREAM_MIN;

typedef struct {
    Py_buffer dest;
    PyObject *prefix; /* a reference held while the GIL is let go */
} held_t;

/* One batch's blocks, every bound checked, with the buffers and prefixes they point into held. */
typedef struct {
    Py_buffer segment;
    int has_segment;
    Py_ssize_t n;
    Py_ssize_t taken; /* held[0:taken] hold a destination buffer and a prefix reference */
    held_t *held;
    dkv_block *blocks;
    Py_buffer rows; /* the rows form (rows_copy): every destination is a row of this one buffer */
    int has_rows;
    char *prefix_store; /* the rows form's prefixes, built here: head || hash, back to back */
} batch_t;

static void batch_release(batch_t *b) {
    for (Py_ssize_t i = 0; i < b->taken; i++) {
        PyBuffer_Release(&b->held[i].dest);
        Py_XDECREF(b->held[i].prefix);
    }
    b->taken = 0;
    PyMem_Free(b->blocks);
    PyMem_Free(b->held);
    b->blocks = NULL;
    b->held = NULL;
    if (b->has_segment) {
        PyBuffer_Release(&b->segment);
        b->has_segment = 0;
    }
    if (b->has_rows) {
        PyBuffer_Release(&b->rows);
        b->has_rows = 0;
    }
    PyMem_Free(b->prefix_store);
    b->prefix_store = NULL;
}

/* Fill ``b`` (zeroed by the caller) from the Python arguments; -1 with an exception set (release it then). */
static int batch_take(batch_t *b, PyObject *segment_obj, PyObject *dests_obj, PyObject *offsets_obj,
                      PyObject *prefixes_obj) {
    if (PyObject_GetBuffer(segment_obj, &b->segment, PyBUF_SIMPLE) < 0) {
        return -1;
    }
    b->has_segment = 1;
    int rc = -1;
    PyObject *dests = NULL, *offsets = NULL, *prefixes = NULL;
    dests = PySequence_Fast(dests_obj, "dests must be a sequence");
    offsets = dests ? PySequence_Fast(offsets_obj, "offsets must be a sequence") : NULL;
    prefixes = offsets ? PySequence_Fast(prefixes_obj, "prefixes must be a sequence") : NULL;
    if (!prefixes) {
        goto done;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(dests);
    if (PySequence_Fast_GET_SIZE(offsets) != n || PySequence_Fast_GET_SIZE(prefixes) != n) {
        PyErr_SetString(PyExc_ValueError, "one offset and one prefix per destination");
        goto done;
    }
    b->n = n;
    b->held = PyMem_Calloc(n ? n : 1, sizeof(held_t));
    b->blocks = PyMem_Calloc(n ? n : 1, sizeof(dkv_block));
    if (!b->held || !b->blocks) {
        PyErr_NoMemory();
        goto done;
    }
    const Py_buffer *segment = &b->segment;
    for (Py_ssize_t i = 0; i < n; i++) {
        held_t *held = &b->held[i];
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(dests, i), &held->dest, PyBUF_WRITABLE) < 0) {
            goto done;
        }
        b->taken = i + 1;
        Py_ssize_t len = held->dest.len;
        PyObject *index = PyNumber_Index(PySequence_Fast_GET_ITEM(offsets, i)); /* ints, numpy ints */
        if (!index) {
            goto done;
        }
        Py_ssize_t offset = PyLong_AsSsize_t(index);
        Py_DECREF(index);
        if (offset == -1 && PyErr_Occurred()) {
            goto done;
        }
        if (offset < 0 || len > segment->len || offset > segment->len - len) {
            PyErr_Format(PyExc_ValueError, "block %zd (%zd bytes at %zd) lies outside the segment of %zd bytes",
                         i, len, offset, segment->len);
            goto done;
        }
        PyObject *prefix = PySequence_Fast_GET_ITEM(prefixes, i);
        if (!PyBytes_Check(prefix)) {
            PyErr_SetString(PyExc_TypeError, "prefixes must be bytes");
            goto done;
        }
        Py_INCREF(prefix);
        held->prefix = prefix;
        b->blocks[i] = (dkv_block){
            .src = (const char *)segment->buf + offset,
            .dest = (char *)held->dest.buf,
            .len = (size_t)len,
            .prefix = PyBytes_AS_STRING(prefix),
            .prefix_len = (size_t)PyBytes_GET_SIZE(prefix),
        };
    }
    rc = 0;
done:
    Py_XDECREF(prefixes);
    Py_XDECREF(offsets);
    Py_XDECREF(dests);
    return rc;
}

static PyObject *copy_and_checksum(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *segment_obj, *dests_obj, *offsets_obj, *prefixes_obj;
    if (!PyArg_ParseTuple(args, "OOOO", &segment_obj, &dests_obj, &offsets_obj, &prefixes_obj)) {
        return NULL;
    }
    batch_t batch = {0};
    PyObject *result = NULL;
    if (batch_take(&batch, segment_obj, dests_obj, offsets_obj, prefixes_obj) == 0) {
        result = PyBytes_FromStringAndSize(NULL, batch.n * DKV_CHECKSUM_SIZE);
        if (result) {
            unsigned char *out = (unsigned char *)PyBytes_AS_STRING(result);
            kernel_t run = kernel;
            Py_BEGIN_ALLOW_THREADS
            run(batch.blocks, (size_t)batch.n, out);
            Py_END_ALLOW_THREADS
        }
    }
    batch_release(&batch);
    return result;
}

/* ---- CheckedCopy: one batch that several threads copy and check together ---------------------------------- */

#define GRAIN_BYTES (256 * 1024) /* blocks claimed at a time: few claims, and the threads end close together */
#define MAX_GRAIN 64

#define MAX_POOL_THREADS 8
#define THREAD_NICE 10 /* the native copy threads' nice value at least (see pool_thread) */

/* One share of a posted copy: a work() on a pool thread. Held in the copy itself (see post()). */
typedef struct share {
    struct CheckedCopyObject *copy;
    struct share *next;
} share_t;

typedef struct CheckedCopyObject {
    PyObject_HEAD
    batch_t batch;
    unsigned char *expected; /* the writers' checksums, 16 bytes a block, in block order */
    size_t grain;            /* blocks a claim takes */
    atomic_size_t next;      /* the first block no thread has claimed */
    atomic_int stopped;      /* a block failed its checksum, or stop() was called: claim nothing more */
    /* posted to the pool (post()): */
    kernel_t run;            /* the kernel in use when it was posted */
    atomic_int pending;      /* shares queued or running */
    atomic_int failed;       /* a share answered False */
    atomic_int state;        /* NOT_POSTED, POSTED, or ENDED once every share has ended */
    pid_t posted_pid;
    struct CheckedCopyObject *next_ended; /* the pool's list of ended copies not yet taken (under pool.ended_mu) */
    share_t shares[MAX_POOL_THREADS];     /* its shares, queued by post(): no allocation on either side */
} CheckedCopyObject;

enum { NOT_POSTED = 0, POSTED = 1, ENDED = 2 };

/* How many blocks a claim takes (about GRAIN_BYTES), and nothing claimed yet. */
static void set_grain(CheckedCopyObject *self) {
    Py_ssize_t n = self->batch.n;
    size_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        total += self->batch.blocks[i].len;
    }
    size_t average = n ? total / (size_t)n : 0;
    size_t grain = average ? GRAIN_BYTES / average : MAX_GRAIN;
    self->grain = grain < 1 ? 1 : grain > MAX_GRAIN ? MAX_GRAIN : grain;
    atomic_init(&self->next, 0);
    atomic_init(&self->stopped, 0);
}

static void pool_forget(CheckedCopyObject *self);

static void CheckedCopy_dealloc(CheckedCopyObject *self) {
    pool_forget(self);
    batch_release(&self->batch);
    PyMem_Free(self->expected);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int CheckedCopy_init(CheckedCopyObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"segment", "dests", "offsets", "prefixes", "sums", NULL};
    PyObject *segment_obj, *dests_obj, *offsets_obj, *prefixes_obj;
    Py_buffer sums;
    if (self->batch.blocks || self->expected) {
        PyErr_SetString(PyExc_RuntimeError, "a CheckedCopy is made once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOy*", kwlist, &segment_obj, &dests_obj, &offsets_obj,
                                     &prefixes_obj, &sums)) {
        return -1;
    }
    int rc = -1;
    if (batch_take(&self->batch, segment_obj, dests_obj, offsets_obj, prefixes_obj) < 0) {
        goto done;
    }
    Py_ssize_t n = self->batch.n;
    if (sums.len != n * DKV_CHECKSUM_SIZE) {
        PyErr_Format(PyExc_ValueError, "sums must be %d bytes a block: %zd bytes for %zd blocks",
                     DKV_CHECKSUM_SIZE, sums.len, n);
        goto done;
    }
    self->expected = PyMem_Malloc(sums.len ? (size_t)sums.len : 1);
    if (!self->expected) {
        PyErr_NoMemory();
        goto done;
    }
    memcpy(self->expected, sums.buf, (size_t)sums.len);
    set_grain(self);
    rc = 0;
done:
    PyBuffer_Release(&sums);
    if (rc < 0) {
        batch_release(&self->batch);
        PyMem_Free(self->expected);
        self->expected = NULL;
    }
    return rc;
}

static int claim_and_check(CheckedCopyObject *self, kernel_t run) {
    const dkv_block *blocks = self->batch.blocks;
    const size_t n = (size_t)self->batch.n, grain = self->grain;
    unsigned char got[MAX_GRAIN * DKV_CHECKSUM_SIZE];
    int ok = 1;
    for (;;) {
        if (atomic_load(&self->stopped)) {
            ok = 0; /* failed elsewhere, or stopped: this share is not known to be whole */
            break;
        }
        size_t first = atomic_fetch_add(&self->next, grain);
        if (first >= n) {
            break;
        }
        size_t count = n - first < grain ? n - first : grain;
        run(blocks + first, count, got);
        if (memcmp(got, self->expected + first * DKV_CHECKSUM_SIZE, count * DKV_CHECKSUM_SIZE) != 0) {
            atomic_store(&self->stopped, 1);
            ok = 0;
            break;
        }
    }
    return ok;
}

/* ---- the pool: native threads that run posted shares without ever taking the GIL ---------------------------
 *
 * post(shares) queues a copy's shares; a pool thread takes one, runs claim_and_check and, ending the copy's
 * last share, marks it ENDED and puts it on the ended list (what wait_ended() hands to Python). A pool
 * thread touches no Python object and no reference count: a posted copy stays alive until it has ENDED
 * and is off the ended list, which its dealloc waits for (it stops the copy first, so that takes at most
 * one claim). The threads are made on first use, detached, with every signal blocked; in a forked child
 * the pool starts empty (its queued shares are dropped, ended as failed) and is made again when used.
 *
 * Posting takes no lock a pool thread holds. The poster is the engine's scheduler thread; the pool threads
 * run as batch work and are preempted whenever anything else wakes, so a lock they share with the poster is
 * sometimes held by a preempted thread. Traced on the 2-core machine (perf sched, the bench's scheduler
 * section): the slowest load() calls slept 0.5-1.9 ms in post() on the pool's one mutex until the copy
 * thread holding it ran again. So a post pushes its shares onto ``incoming`` with one compare-and-swap and
 * gives the pool one wake-up token (``wake``, a semaphore); the threads take shares under their own mutex
 * (``mu``: taking from the queue, making threads, forking), and ended copies are listed under another
 * (``ended_mu``). A thread that takes a share and sees more queued passes a token on, so each push is
 * covered by a token until its shares are taken, and the poster wakes one thread, not one per share. */

static struct {
    _Atomic(share_t *) incoming; /* posted shares not yet queued, newest first: pushed without a lock */
    sem_t wake;                  /* wake-up tokens: at least one while shares wait (see above) */
    pthread_mutex_t mu;          /* head/tail, making threads, forking */
    share_t *head, *tail;        /* the queue, oldest first (under mu) */
    pthread_mutex_t ended_mu;
    pthread_cond_t ended;        /* a copy ended (under ended_mu) */
    CheckedCopyObject *ended_list;
    atomic_int threads;          /* started in this process */
    int ready;                   /* wake is initialised (module init) */
} pool = {NULL, {{0}}, PTHREAD_MUTEX_INITIALIZER, NULL, NULL, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
          NULL, 0, 0};

/* Under pool.ended_mu: one share of ``copy`` ended (``ok``: it verified everything it claimed). */
static void share_ended_locked(CheckedCopyObject *copy, int ok) {
    if (!ok) {
        atomic_store(&copy->failed, 1);
    }
    if (atomic_fetch_sub(&copy->pending, 1) == 1) {
        atomic_store(&copy->state, ENDED);
        copy->next_ended = pool.ended_list;
        pool.ended_list = copy;
        pthread_cond_broadcast(&pool.ended);
    }
}

/* Under pool.mu: move what was posted since onto the queue, oldest first. */
static void pool_take_incoming_locked(void) {
    share_t *newest = atomic_exchange(&pool.incoming, NULL);
    share_t *oldest = NULL;
    while (newest) { /* reversed: the queue runs oldest first */
        share_t *next = newest->next;
        newest->next = oldest;
        oldest = newest;
        newest = next;
    }
    if (!oldest) {
        return;
    }
    if (pool.tail) {
        pool.tail->next = oldest;
    } else {
        pool.head = oldest;
    }
    for (pool.tail = oldest; pool.tail->next; pool.tail = pool.tail->next) {
    }
}

static void *pool_thread(void *Py_UNUSED(arg)) {
    /* SCHED_BATCH: a copy thread woken by post() takes an idle core, or waits for the running thread's turn to
     * end; it never preempts the thread that posted (the engine's scheduler thread). Its share of the CPU is
     * unchanged. (Measured, a 64-block load() while 256 x 256 KiB loads run: post() 23-36 -> 13 us on average,
     * calls over 300 us 3-5 -> 0-1 in 1000.) Where the policy cannot be set, the thread runs as it is.
     * At THREAD_NICE its share of a contended CPU is small: a copy is background work, and where the cores are
     * oversubscribed the engine's scheduler thread and the loop thread go first. On idle cores it runs at full
     * speed (the weight only matters between runnable threads on one core). */
    struct sched_param batch = {0};
    (void)sched_setscheduler(0, SCHED_BATCH, &batch);
    id_t self = (id_t)syscall(SYS_gettid);
    errno = 0;
    int current = getpriority(PRIO_PROCESS, self); /* this thread's own, on Linux (-1 is a valid value) */
    if (errno == 0 && current < THREAD_NICE) {     /* never below what the process already runs at */
        (void)setpriority(PRIO_PROCESS, self, THREAD_NICE);
    }
    (void)pthread_setname_np(pthread_self(), "dkv-native-copy");
    for (;;) {
        while (sem_wait(&pool.wake) != 0) { /* EINTR: every signal is blocked here, but wait again regardless */
        }
        pthread_mutex_lock(&pool.mu);
        pool_take_incoming_locked();
        share_t *share = pool.head;
        if (share) {
            pool.head = share->next;
            if (!pool.head) {
                pool.tail = NULL;
            }
        }
        int more = pool.head != NULL;
        pthread_mutex_unlock(&pool.mu);
        if (more) {
            sem_post(&pool.wake); /* the next thread is woken here, not by the posting thread */
        }
        if (!share) {
            continue; /* a token whose shares another thread took with its own */
        }
        CheckedCopyObject *copy = share->copy; /* the share lives in the copy: nothing to free */
        int ok = claim_and_check(copy, copy->run);
        pthread_mutex_lock(&pool.ended_mu);
        share_ended_locked(copy, ok);
        pthread_mutex_unlock(&pool.ended_mu); /* nothing of the copy is touched after this */
    }
    return NULL;
}

/* Around a fork: the forking thread holds both locks, so the child's copy of the queue and the list is whole. */
static void pool_before_fork(void) {
    pthread_mutex_lock(&pool.mu);
    pthread_mutex_lock(&pool.ended_mu);
}

static void pool_after_fork_in_parent(void) {
    pthread_mutex_unlock(&pool.ended_mu);
    pthread_mutex_unlock(&pool.mu);
}

static void pool_after_fork_in_child(void) {
    pthread_mutex_init(&pool.mu, NULL);
    pthread_mutex_init(&pool.ended_mu, NULL);
    pthread_cond_init(&pool.ended, NULL);
    sem_init(&pool.wake, 0, 0);
    atomic_store(&pool.threads, 0); /* the parent's are not here */
    pool_take_incoming_locked();    /* no other thread here: nothing else pushes or takes */
    share_t *share = pool.head;
    pool.head = pool.tail = NULL;
    while (share) { /* queued, never to run here: ended as failed */
        share_t *next = share->next;
        atomic_store(&share->copy->stopped, 1);
        share_ended_locked(share->copy, 0);
        share = next;
    }
}

/* Under pool.mu: at least ``wanted`` threads (as many as could be made); -1 when there are none. */
static int pool_grow_locked(int wanted) {
    if (atomic_load(&pool.threads) >= wanted) {
        return 0;
    }
    static int at_fork = 0;
    if (!at_fork) {
        if (pthread_atfork(pool_before_fork, pool_after_fork_in_parent, pool_after_fork_in_child) != 0) {
            return -1;
        }
        at_fork = 1;
    }
    sigset_t all, before;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &before); /* the pool's threads inherit it: signals stay Python's */
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    while (atomic_load(&pool.threads) < wanted) {
        pthread_t thread;
        if (pthread_create(&thread, &attr, pool_thread, NULL) != 0) {
            break;
        }
        atomic_fetch_add(&pool.threads, 1);
    }
    pthread_attr_destroy(&attr);
    pthread_sigmask(SIG_SETMASK, &before, NULL);
    return atomic_load(&pool.threads) ? 0 : -1;
}

static PyObject *CheckedCopy_post(CheckedCopyObject *self, PyObject *arg) {
    long shares = PyLong_AsLong(arg);
    if (shares == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (shares < 1 || shares > MAX_POOL_THREADS) {
        PyErr_Format(PyExc_ValueError, "post() takes 1 to %d shares", MAX_POOL_THREADS);
        return NULL;
    }
    if (!self->expected) {
        PyErr_SetString(PyExc_RuntimeError, "CheckedCopy was not made");
        return NULL;
    }
    if (atomic_load(&self->state) != NOT_POSTED) {
        PyErr_SetString(PyExc_RuntimeError, "a CheckedCopy is posted once");
        return NULL;
    }
    if (atomic_load(&pool.threads) < shares) { /* first use (or a forked child's): the only time post() locks */
        pthread_mutex_lock(&pool.mu);
        int grown = pool_grow_locked((int)shares);
        pthread_mutex_unlock(&pool.mu);
        if (grown < 0) {
            PyErr_SetString(PyExc_RuntimeError, "no native copy thread could be started");
            return NULL;
        }
    }
    self->run = kernel;
    self->posted_pid = getpid();
    atomic_store(&self->pending, (int)shares);
    atomic_store(&self->state, POSTED);
    /* The shares, chained newest first (share 0 oldest), pushed in one compare-and-swap. */
    for (long i = 0; i < shares; i++) {
        self->shares[i] = (share_t){.copy = self, .next = i ? &self->shares[i - 1] : NULL};
    }
    share_t *oldest = &self->shares[0], *newest = &self->shares[shares - 1];
    share_t *head = atomic_load(&pool.incoming);
    do {
        oldest->next = head; /* after what was posted before */
    } while (!atomic_compare_exchange_weak(&pool.incoming, &head, newest));
    sem_post(&pool.wake); /* one token: the thread that takes a share passes one on while more are queued */
    Py_RETURN_NONE;
}

static PyObject *CheckedCopy_result(CheckedCopyObject *self, PyObject *Py_UNUSED(ignored)) {
    if (atomic_load(&self->state) != ENDED) {
        Py_RETURN_NONE;
    }
    return PyBool_FromLong(!atomic_load(&self->failed));
}

/* wait_ended(timeout) -> list: the posted copies that ended since the last call (each once), waiting up to
 * ``timeout`` seconds without the GIL for one when there is none. */
static PyObject *wait_ended(PyObject *Py_UNUSED(module), PyObject *arg) {
    double timeout = PyFloat_AsDouble(arg);
    if (timeout == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&pool.ended_mu);
    if (!pool.ended_list && timeout > 0) {
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        time_t whole = (time_t)timeout;
        long nanos = until.tv_nsec + (long)((timeout - (double)whole) * 1e9);
        until.tv_sec += whole + nanos / 1000000000L;
        until.tv_nsec = nanos % 1000000000L;
        while (!pool.ended_list) {
            if (pthread_cond_timedwait(&pool.ended, &pool.ended_mu, &until) == ETIMEDOUT) {
                break;
            }
        }
    }
    pthread_mutex_unlock(&pool.ended_mu);
    Py_END_ALLOW_THREADS
    PyObject *ended = PyList_New(0);
    if (!ended) {
        return NULL;
    }
    /* taken with the GIL held: a copy on the list cannot be freed meanwhile (its dealloc takes it off first) */
    pthread_mutex_lock(&pool.ended_mu);
    CheckedCopyObject *copy = pool.ended_list;
    pool.ended_list = NULL;
    pthread_mutex_unlock(&pool.ended_mu);
    int failed = 0;
    while (copy) {
        CheckedCopyObject *next = copy->next_ended;
        copy->next_ended = NULL;
        if (!failed && PyList_Append(ended, (PyObject *)copy) < 0) {
            failed = 1;
        }
        copy = next;
    }
    if (failed) {
        Py_DECREF(ended);
        return NULL;
    }
    return ended;
}

/* Before a posted copy is freed: stop it, wait for its shares to end, and take it off the ended list. */
static void pool_forget(CheckedCopyObject *self) {
    if (atomic_load(&self->state) == NOT_POSTED || self->posted_pid != getpid()) {
        return; /* never posted, or posted in the parent of this forked child: no thread here uses it */
    }
    atomic_store(&self->stopped, 1);
    while (atomic_load(&self->state) != ENDED) { /* at most one claim: no pool thread needs the GIL */
        struct timespec pause = {0, 20000};
        nanosleep(&pause, NULL);
    }
    pthread_mutex_lock(&pool.ended_mu);
    for (CheckedCopyObject **at = &pool.ended_list; *at; at = &(*at)->next_ended) {
        if (*at == self) {
            *at = self->next_ended;
            break;
        }
    }
    pthread_mutex_unlock(&pool.ended_mu);
}

static PyObject *CheckedCopy_work(CheckedCopyObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"hold_gil", NULL};
    int hold_gil = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|p", kwlist, &hold_gil)) {
        return NULL;
    }
    if (!self->expected) {
        PyErr_SetString(PyExc_RuntimeError, "CheckedCopy was not made");
        return NULL;
    }
    kernel_t run = kernel;
    int ok;
    if (hold_gil) {
        ok = claim_and_check(self, run);
    } else {
        Py_BEGIN_ALLOW_THREADS
        ok = claim_and_check(self, run);
        Py_END_ALLOW_THREADS
    }
    return PyBool_FromLong(ok);
}

static PyObject *CheckedCopy_stop(CheckedCopyObject *self, PyObject *Py_UNUSED(ignored)) {
    atomic_store(&self->stopped, 1);
    Py_RETURN_NONE;
}

static PyObject *CheckedCopy_len(CheckedCopyObject *self, void *Py_UNUSED(closure)) {
    return PyLong_FromSsize_t(self->batch.n);
}

static PyMethodDef CheckedCopy_methods[] = {
    {"work", (PyCFunction)(void (*)(void))CheckedCopy_work, METH_VARARGS | METH_KEYWORDS,
     "work(hold_gil=False) -> bool: without the GIL (with it where hold_gil: a copy of tens of µs on a "
     "thread that must not wait for the GIL back), claim blocks a few at a time, copy each and compare its checksum with "
     "the writer's, until none is left. False when a block failed its checksum (here or on another thread) "
     "or stop() was called: no thread claims a block after that. Any number of threads may work at once; "
     "each block is copied by exactly one."},
    {"post", (PyCFunction)CheckedCopy_post, METH_O,
     "post(shares): queue the copy on the native pool as ``shares`` shares (1-8), each a work() on a native "
     "thread that never takes the GIL; returns at once. Once. result() says when every share has ended."},
    {"result", (PyCFunction)CheckedCopy_result, METH_NOARGS,
     "result() -> bool | None: None until every posted share has ended; then True when every block was "
     "copied and verified, False otherwise (a checksum failed, or stop())."},
    {"stop", (PyCFunction)CheckedCopy_stop, METH_NOARGS,
     "stop(): any thread: no block is claimed after this (blocks being copied finish; work() answers False)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef CheckedCopy_getset[] = {
    {"blocks", (getter)CheckedCopy_len, NULL, "the batch's block count", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject CheckedCopyType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "dkv._checked_copy.CheckedCopy",
    .tp_doc = "CheckedCopy(segment, dests, offsets, prefixes, sums): copy_and_checksum's batch, shared by "
              "the threads that call work(), checked against the writers' sums (16 bytes a block) as it goes.",
    .tp_basicsize = sizeof(CheckedCopyObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)CheckedCopy_init,
    .tp_dealloc = (destructor)CheckedCopy_dealloc,
    .tp_methods = CheckedCopy_methods,
    .tp_getset = CheckedCopy_getset,
};

/* The length of the first of ``hashes`` (a PySequence_Fast; 0 when empty), which every other must have; -1 with
 * TypeError set when it is not bytes. */
static Py_ssize_t hash_length(PyObject *hashes) {
    if (!PySequence_Fast_GET_SIZE(hashes)) {
        return 0;
    }
    PyObject *first = PySequence_Fast_GET_ITEM(hashes, 0);
    if (!PyBytes_Check(first)) {
        PyErr_SetString(PyExc_TypeError, "hashes must be bytes");
        return -1;
    }
    return PyBytes_GET_SIZE(first);
}

/* Block i of a rows form (rows_copy, recv_rows): its hash (borrowed), and its row in *id; NULL with an exception set
 * when the hash is not bytes of hash_len or the row is not one of row_count. */
static PyObject *row_of(PyObject *hashes, PyObject *ids, Py_ssize_t i, Py_ssize_t hash_len, Py_ssize_t row_count,
                        Py_ssize_t *id) {
    PyObject *hash = PySequence_Fast_GET_ITEM(hashes, i);
    if (!PyBytes_Check(hash) || PyBytes_GET_SIZE(hash) != hash_len) {
        PyErr_SetString(PyExc_ValueError, "hashes must be bytes, all as long as the first");
        return NULL;
    }
    *id = PyNumber_AsSsize_t(PySequence_Fast_GET_ITEM(ids, i), PyExc_OverflowError);
    if (*id == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (*id < 0 || *id >= row_count) {
        PyErr_Format(PyExc_ValueError, "row %zd is outside the %zd rows", *id, row_count);
        return NULL;
    }
    return hash;
}

/* rows_copy(segment, rows, row_bytes, ids, offsets, sizes, sums, head, hashes) -> CheckedCopy | None */
static PyObject *rows_copy(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *segment_obj, *rows_obj, *ids_obj, *hashes_obj;
    Py_ssize_t row_bytes;
    Py_buffer offsets, sizes, sums, head;
    if (!PyArg_ParseTuple(args, "OOnOy*y*y*y*O", &segment_obj, &rows_obj, &row_bytes, &ids_obj, &offsets, &sizes,
                          &sums, &head, &hashes_obj)) {
        return NULL;
    }
    CheckedCopyObject *copy = (CheckedCopyObject *)CheckedCopyType.tp_alloc(&CheckedCopyType, 0);
    PyObject *ids = NULL, *hashes = NULL, *result = NULL;
    if (!copy) {
        goto done;
    }
    batch_t *b = &copy->batch;
    if (PyObject_GetBuffer(segment_obj, &b->segment, PyBUF_SIMPLE) < 0) {
        goto done;
    }
    b->has_segment = 1;
    if (PyObject_GetBuffer(rows_obj, &b->rows, PyBUF_WRITABLE) < 0) {
        goto done;
    }
    b->has_rows = 1;
    ids = PySequence_Fast(ids_obj, "ids must be a sequence");
    hashes = ids ? PySequence_Fast(hashes_obj, "hashes must be a sequence") : NULL;
    if (!hashes) {
        goto done;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hashes);
    if (PySequence_Fast_GET_SIZE(ids) != n || row_bytes <= 0) {
        PyErr_SetString(PyExc_ValueError, "one id per hash, and rows of at least one byte");
        goto done;
    }
    if (offsets.len < n * 8 || sizes.len < n * 8 || sums.len < n * DKV_CHECKSUM_SIZE) {
        PyErr_SetString(PyExc_ValueError, "the slot map does not cover every hash");
        goto done;
    }
    Py_ssize_t hash_len = hash_length(hashes);
    if (hash_len < 0) {
        goto done;
    }
    size_t prefix_len = (size_t)head.len + (size_t)hash_len;
    b->n = n;
    b->blocks = PyMem_Calloc(n ? n : 1, sizeof(dkv_block));
    b->prefix_store = PyMem_Malloc(n ? n * prefix_len : 1);
    copy->expected = PyMem_Malloc(n ? n * DKV_CHECKSUM_SIZE : 1);
    if (!b->blocks || !b->prefix_store || !copy->expected) {
        PyErr_NoMemory();
        goto done;
    }
    const char *src = b->segment.buf;
    char *dest = b->rows.buf;
    Py_ssize_t row_count = b->rows.len / row_bytes;
    int copyable = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t id;
        PyObject *hash = row_of(hashes, ids, i, hash_len, row_count, &id);
        if (!hash) {
            goto done;
        }
        long long offset, size;
        memcpy(&offset, (const char *)offsets.buf + 8 * i, 8);
        memcpy(&size, (const char *)sizes.buf + 8 * i, 8);
        if (offset < 0 || size != row_bytes || row_bytes > b->segment.len || offset > b->segment.len - row_bytes) {
            copyable = 0; /* no checksum (-1), another size, or outside the mapping: not this way */
            break;
        }
        char *prefix = b->prefix_store + (size_t)i * prefix_len;
        memcpy(prefix, head.buf, (size_t)head.len);
        memcpy(prefix + head.len, PyBytes_AS_STRING(hash), (size_t)hash_len);
        b->blocks[i] = (dkv_block){
            .src = src + offset,
            .dest = dest + id * row_bytes,
            .len = (size_t)row_bytes,
            .prefix = prefix,
            .prefix_len = prefix_len,
        };
    }
    if (!copyable) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    memcpy(copy->expected, sums.buf, (size_t)n * DKV_CHECKSUM_SIZE);
    set_grain(copy);
    result = Py_NewRef((PyObject *)copy);
done:
    Py_XDECREF(hashes);
    Py_XDECREF(ids);
    Py_XDECREF((PyObject *)copy);
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&sizes);
    PyBuffer_Release(&sums);
    PyBuffer_Release(&head);
    return result;
}

/* One target of recv_rows: its rows buffer held while the GIL is let go. */
typedef struct {
    Py_buffer rows;
    int has_rows;
} rows_held_t;

static int by_dest(const void *a, const void *b) {
    const dkv_block *x = *(const dkv_block *const *)a, *y = *(const dkv_block *const *)b;
    return x->dest < y->dest ? -1 : x->dest > y->dest;
}

/* Add target ``t`` (rows, row_bytes, ids, head, hashes) to ``blocks`` from ``*at``: -1 with an exception set. */
static int take_target(PyObject *t, rows_held_t *held, dkv_block *blocks, Py_ssize_t *at, Py_ssize_t total,
                       char **prefix_at, const char *prefix_end) {
    PyObject *rows_obj, *ids_obj, *hashes_obj;
    Py_ssize_t row_bytes;
    Py_buffer head;
    if (!PyTuple_Check(t) || !PyArg_ParseTuple(t, "OnOy*O", &rows_obj, &row_bytes, &ids_obj, &head, &hashes_obj)) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "a target is a tuple (rows, row_bytes, ids, head, hashes)");
        }
        return -1;
    }
    int rc = -1;
    PyObject *ids = NULL, *hashes = NULL;
    if (PyObject_GetBuffer(rows_obj, &held->rows, PyBUF_WRITABLE) < 0) {
        goto done;
    }
    held->has_rows = 1;
    ids = PySequence_Fast(ids_obj, "ids must be a sequence");
    hashes = ids ? PySequence_Fast(hashes_obj, "hashes must be a sequence") : NULL;
    if (!hashes) {
        goto done;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hashes);
    if (PySequence_Fast_GET_SIZE(ids) != n || row_bytes <= 0 || *at + n > total) {
        PyErr_SetString(PyExc_ValueError, "one id per hash, rows of at least one byte, one checksum per block");
        goto done;
    }
    Py_ssize_t hash_len = hash_length(hashes);
    if (hash_len < 0) {
        goto done;
    }
    size_t prefix_len = (size_t)head.len + (size_t)hash_len;
    if ((size_t)(prefix_end - *prefix_at) < (size_t)n * prefix_len) {
        PyErr_SetString(PyExc_ValueError, "the targets' prefixes outgrow their room");
        goto done;
    }
    Py_ssize_t row_count = held->rows.len / row_bytes;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t id;
        PyObject *hash = row_of(hashes, ids, i, hash_len, row_count, &id);
        if (!hash) {
            goto done;
        }
        char *prefix = *prefix_at;
        memcpy(prefix, head.buf, (size_t)head.len);
        memcpy(prefix + head.len, PyBytes_AS_STRING(hash), (size_t)hash_len);
        *prefix_at += prefix_len;
        blocks[(*at)++] = (dkv_block){.dest = (char *)held->rows.buf + id * row_bytes, .len = (size_t)row_bytes,
                                      .prefix = prefix, .prefix_len = prefix_len};
    }
    rc = 0;
done:
    Py_XDECREF(hashes);
    Py_XDECREF(ids);
    PyBuffer_Release(&head);
    return rc;
}

/* recv_rows(fd, targets, sums, first, timeout) -> bytes (one verdict a block) */
static PyObject *recv_rows(PyObject *Py_UNUSED(module), PyObject *args) {
    int fd;
    PyObject *targets_obj;
    Py_buffer sums, first;
    double timeout;
    if (!PyArg_ParseTuple(args, "iOy*y*d", &fd, &targets_obj, &sums, &first, &timeout)) {
        return NULL;
    }
    PyObject *targets = NULL, *verdicts = NULL, *result = NULL;
    rows_held_t *held = NULL;
    dkv_block *blocks = NULL;
    const dkv_block **order = NULL;
    char *prefixes = NULL;
    Py_ssize_t count = 0;
    targets = PySequence_Fast(targets_obj, "targets must be a sequence");
    if (!targets) {
        goto done;
    }
    count = PySequence_Fast_GET_SIZE(targets);
    Py_ssize_t n = sums.len / DKV_CHECKSUM_SIZE;
    if (sums.len % DKV_CHECKSUM_SIZE || !(timeout >= 0)) {
        PyErr_SetString(PyExc_ValueError, "16-byte checksums, one a block, and a timeout >= 0");
        goto done;
    }
    size_t room = 0; /* the prefixes' room: head and hash of every block, bounded by what the targets name */
    for (Py_ssize_t k = 0; k < count; k++) {
        PyObject *t = PySequence_Fast_GET_ITEM(targets, k);
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 5 || !PyBytes_Check(PyTuple_GET_ITEM(t, 3))) {
            PyErr_SetString(PyExc_TypeError, "a target is a tuple (rows, row_bytes, ids, head: bytes, hashes)");
            goto done;
        }
        PyObject *hashes = PyTuple_GET_ITEM(t, 4);
        Py_ssize_t hn = PySequence_Size(hashes);
        if (hn < 0) {
            goto done;
        }
        Py_ssize_t hash_len = 0;
        if (hn) {
            PyObject *first_hash = PySequence_GetItem(hashes, 0);
            if (!first_hash) {
                goto done;
            }
            hash_len = PyBytes_Check(first_hash) ? PyBytes_GET_SIZE(first_hash) : 0; /* (else refused below) */
            Py_DECREF(first_hash);
        }
        room += (size_t)hn * ((size_t)PyBytes_GET_SIZE(PyTuple_GET_ITEM(t, 3)) + (size_t)hash_len);
    }
    held = PyMem_Calloc(count ? count : 1, sizeof(rows_held_t));
    blocks = PyMem_Calloc(n ? n : 1, sizeof(dkv_block));
    order = PyMem_Malloc((n ? n : 1) * sizeof(dkv_block *));
    prefixes = PyMem_Malloc(room ? room : 1);
    verdicts = PyBytes_FromStringAndSize(NULL, n);
    if (!held || !blocks || !order || !prefixes || !verdicts) {
        if (!PyErr_Occurred()) {
            PyErr_NoMemory();
        }
        goto done;
    }
    Py_ssize_t at = 0;
    char *prefix_at = prefixes;
    for (Py_ssize_t k = 0; k < count; k++) {
        if (take_target(PySequence_Fast_GET_ITEM(targets, k), &held[k], blocks, &at, n, &prefix_at,
                        prefixes + room) < 0) {
            goto done;
        }
    }
    if (at != n) {
        PyErr_SetString(PyExc_ValueError, "one 16-byte checksum per block the targets name");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        order[i] = &blocks[i];
    }
    qsort(order, (size_t)n, sizeof(dkv_block *), by_dest); /* no two blocks may land on the same bytes */
    for (Py_ssize_t i = 1; i < n; i++) {
        if (order[i - 1]->dest + order[i - 1]->len > order[i]->dest) {
            PyErr_SetString(PyExc_ValueError, "two blocks would land on the same row");
            goto done;
        }
    }
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    long long deadline = (long long)now.tv_sec * 1000000000LL + now.tv_nsec + (long long)(timeout * 1e9);
    int rc;
    int (*receive)(int, const dkv_block *, size_t, const unsigned char *, unsigned char *, const char *, size_t,
                   long long) = kernel == dkv_copy_hash_avx2 ? dkv_recv_hash_avx2 : dkv_recv_hash_generic;
    Py_BEGIN_ALLOW_THREADS
    rc = receive(fd, blocks, (size_t)n, sums.buf, (unsigned char *)PyBytes_AS_STRING(verdicts), first.buf,
                 (size_t)first.len, deadline);
    Py_END_ALLOW_THREADS
    if (rc == -ETIMEDOUT) {
        PyErr_Format(PyExc_TimeoutError, "the blocks' bytes did not arrive within %.1f s", timeout);
    } else if (rc == -EPIPE) {
        PyErr_SetString(PyExc_ConnectionResetError, "the stream ended before the blocks' bytes did");
    } else if (rc < 0) {
        errno = -rc;
        PyErr_SetFromErrno(PyExc_OSError);
    } else {
        result = Py_NewRef(verdicts);
    }
done:
    if (held) {
        for (Py_ssize_t k = 0; k < count; k++) {
            if (held[k].has_rows) {
                PyBuffer_Release(&held[k].rows);
            }
        }
    }
    PyMem_Free(held);
    PyMem_Free(blocks);
    PyMem_Free((void *)order);
    PyMem_Free(prefixes);
    Py_XDECREF(verdicts);
    Py_XDECREF(targets);
    PyBuffer_Release(&sums);
    PyBuffer_Release(&first);
    return result;
}

static int avx2_usable(void) {
#if defined(__GNUC__) && defined(__x86_64__)
    __builtin_cpu_init();
    return dkv_avx2_built() && __builtin_cpu_supports("avx2");
#else
    return 0;
#endif
}

static PyObject *use_kernel(PyObject *module, PyObject *arg) {
    const char *name = PyUnicode_Check(arg) ? PyUnicode_AsUTF8(arg) : NULL;
    if (!name) {
        PyErr_SetString(PyExc_TypeError, "use_kernel takes a kernel's name");
        return NULL;
    }
    if (strcmp(name, "generic") == 0) {
        kernel = dkv_copy_hash_generic;
    } else if (strcmp(name, "avx2") == 0 && avx2_usable()) {
        kernel = dkv_copy_hash_avx2;
    } else {
        PyErr_Format(PyExc_ValueError, "no kernel %R here (avx2 needs a CPU with it and a GCC build)", arg);
        return NULL;
    }
    if (PyModule_AddStringConstant(module, "KERNEL", name) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *set_stream_min(PyObject *Py_UNUSED(module), PyObject *arg) {
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "set_stream_min takes a size >= 0");
        return NULL;
    }
    return PyLong_FromSize_t(atomic_exchange(&dkv_stream_min, (size_t)n));
}

static PyMethodDef methods[] = {
    {"set_stream_min", set_stream_min, METH_O,
     "set_stream_min(n) -> int: from now on stream blocks of at least n bytes to their destinations (see "
     "STREAM_MIN); returns the size it replaces. For tests and benchmarks."},
    {"use_kernel", use_kernel, METH_O,
     "use_kernel(name): use the 'generic' or the 'avx2' build from now on (tests compare them; KERNEL says which)."},
    {"copy_and_checksum", copy_and_checksum, METH_VARARGS,
     "copy_and_checksum(segment, dests, offsets, prefixes) -> bytes: copy each block out of the segment into "
     "its destination and return the copies' checksums (16 bytes each), without the GIL."},
    {"wait_ended", wait_ended, METH_O,
     "wait_ended(timeout) -> list[CheckedCopy]: the posted copies whose shares have all ended since the last "
     "call, each once; waits up to ``timeout`` seconds for one, without the GIL."},
    {"recv_rows", recv_rows, METH_VARARGS,
     "recv_rows(fd, targets, sums, first, timeout) -> bytes: receive blocks back to back from the stream socket fd "
     "(``first``: bytes of them already read), target by target, each target a tuple (rows, row_bytes, ids, head, "
     "hashes) whose block i goes into rows[ids[i] * row_bytes:][:row_bytes], hashed as it lands (prefix head || "
     "hashes[i]) and compared with its checksum in ``sums`` (16 bytes a block, in the same order); one verdict "
     "byte a block (1: it matched). Without the GIL. Every bound is checked first (ValueError, TypeError; no two "
     "blocks on the same bytes). TimeoutError past ``timeout`` s, ConnectionResetError when the stream ends "
     "first, OSError when a receive fails: the rows then hold partial bytes."},
    {"rows_copy", rows_copy, METH_VARARGS,
     "rows_copy(segment, rows, row_bytes, ids, offsets, sizes, sums, head, hashes) -> CheckedCopy | None: a "
     "CheckedCopy of len(hashes) blocks into rows of one buffer (block i into rows[ids[i] * row_bytes:][:row_bytes]) "
     "from the slots a slot map gives in order (offsets and sizes: native int64 each; sums: 16 bytes each; "
     "at least len(hashes) of each), prefix i being head || hashes[i]. None when a slot has no checksum "
     "(offset -1), is not row_bytes long or lies outside the segment: not copyable this way."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "dkv._checked_copy",
    .m_doc = "The same-host load's checked copy, without the GIL.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__checked_copy(void) {
    if (PyType_Ready(&CheckedCopyType) < 0) {
        return NULL;
    }
    if (!pool.ready) {
        if (sem_init(&pool.wake, 0, 0) != 0) {
            PyErr_SetFromErrno(PyExc_OSError);
            return NULL;
        }
        pool.ready = 1;
    }
    PyObject *m = PyModule_Create(&module);
    if (!m) {
        return NULL;
    }
    Py_INCREF(&CheckedCopyType);
    if (PyModule_AddObject(m, "CheckedCopy", (PyObject *)&CheckedCopyType) < 0) {
        Py_DECREF(&CheckedCopyType);
        Py_DECREF(m);
        return NULL;
    }
    const char *name = "generic";
    if (avx2_usable()) {
        kernel = dkv_copy_hash_avx2;
        name = "avx2";
    }
    if (PyModule_AddStringConstant(m, "KERNEL", name) < 0 ||
        PyModule_AddIntConstant(m, "STREAM_MIN", DKV_STREAM_MIN) < 0 ||
        PyModule_AddIntConstant(m, "THREAD_NICE", THREAD_NICE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
