/* Waits that poll for a short while, without the GIL, before the caller sleeps (dkv.polling).
 *
 * recv_spin(fd, buffer, spin_ns) -> int
 *
 *   fd        a socket's descriptor (blocking or not: every receive here is MSG_DONTWAIT)
 *   buffer    a writable C-contiguous buffer; what arrives is read into its start
 *   spin_ns   how long to poll, in nanoseconds (0: one attempt)
 *
 *   The count of bytes read (> 0); 0 when the peer closed the stream; -1 when nothing arrived within
 *   spin_ns (the caller then waits in a blocking receive). Any other failure raises OSError.
 *
 * wait_flag(flag, spin_ns) -> bool
 *
 *   flag      a C-contiguous buffer whose first byte another thread sets to non-zero (then leaves set)
 *   spin_ns   how long to poll, in nanoseconds
 *
 *   True once the byte reads non-zero, False when spin_ns ran out first (the caller then sleeps on its
 *   own lock). The byte is read with acquire order: what the setting thread wrote before it is seen.
 *
 * Both release the GIL throughout, so the process's other threads run meanwhile.
 *
 * peer_closed(fd) -> bool
 *
 *   fd        a stream socket's descriptor
 *
 *   True when the peer closed its end (a non-blocking peek reads end-of-stream) or the socket failed
 *   (a closed socket's descriptor, -1, included);
 *   False when nothing is waiting to be read, or something is. Takes no bytes; holds the GIL (it never
 *   waits). The same answer as a Python peek (socket.recv(1, MSG_PEEK | MSG_DONTWAIT) == b""), without
 *   the exception a Python peek raises on every call that finds nothing: asked before each request a
 *   calling thread sends on its channel.
 *
 * recv_now(fd, buffer) -> int
 *
 *   One receive of what has arrived (MSG_DONTWAIT), holding the GIL (it never waits): the count of bytes
 *   read into buffer's start (> 0), 0 when the peer closed the stream, -1 when nothing had arrived. Any
 *   other failure raises OSError. What a thread that polls a reply between other work calls: neither the
 *   GIL let go (another thread would take it, see dkv.held_gil) nor an exception made when nothing came.
 *
 * Why: a thread asleep is woken by the kernel when its reply lands or its lock is released; where the
 * core it slept on had gone idle, that wake-up costs tens of µs on a virtual machine (an interrupt to a
 * halted vCPU), a third of a same-host lookup's round trip (scripts/bench.py). A thread that polls
 * stays on its core and sees it at once, for the price of that core's time while it waits.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <sys/socket.h>
#include <time.h>

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static PyObject *recv_spin(PyObject *Py_UNUSED(self), PyObject *args) {
    int fd;
    Py_buffer view;
    long long spin_ns;
    if (!PyArg_ParseTuple(args, "iw*L", &fd, &view, &spin_ns)) {
        return NULL;
    }
    ssize_t got = -1;
    int failure = 0;
    Py_BEGIN_ALLOW_THREADS
    long long until = now_ns() + (spin_ns > 0 ? spin_ns : 0);
    for (;;) {
        ssize_t n = recv(fd, view.buf, (size_t)view.len, MSG_DONTWAIT);
        if (n >= 0) {
            got = n;
            break;
        }
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
            failure = errno;
            break;
        }
        if (now_ns() >= until) {
            break;
        }
        relax();
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (failure) {
        errno = failure;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromSsize_t(got);
}

static PyObject *wait_flag(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer view;
    long long spin_ns;
    if (!PyArg_ParseTuple(args, "y*L", &view, &spin_ns)) {
        return NULL;
    }
    if (view.len < 1) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "wait_flag needs a buffer of at least one byte");
        return NULL;
    }
    const unsigned char *flag = (const unsigned char *)view.buf;
    int set = 0;
    Py_BEGIN_ALLOW_THREADS
    long long until = now_ns() + (spin_ns > 0 ? spin_ns : 0);
    /* the clock is read every 64 polls: a poll is a load, the clock a vDSO call */
    for (unsigned polls = 0;; polls++) {
        if (__atomic_load_n(flag, __ATOMIC_ACQUIRE)) {
            set = 1;
            break;
        }
        if ((polls & 63) == 63 && now_ns() >= until) {
            break;
        }
        relax();
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyBool_FromLong(set);
}

static PyObject *recv_now(PyObject *Py_UNUSED(self), PyObject *args) {
    int fd;
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "iw*", &fd, &view)) {
        return NULL;
    }
    ssize_t n;
    do {
        n = recv(fd, view.buf, (size_t)view.len, MSG_DONTWAIT);
    } while (n < 0 && errno == EINTR);
    int failure = n < 0 && errno != EAGAIN && errno != EWOULDBLOCK ? errno : 0;
    PyBuffer_Release(&view);
    if (failure) {
        errno = failure;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromSsize_t(n < 0 ? -1 : n);
}

static PyObject *peer_closed(PyObject *Py_UNUSED(self), PyObject *arg) {
    long value = PyLong_AsLong(arg);
    if (value == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (value < 0) {
        Py_RETURN_TRUE; /* a closed socket's fileno(): no use either */
    }
    if (value > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "peer_closed needs a file descriptor");
        return NULL;
    }
    int fd = (int)value;
    char byte;
    ssize_t n;
    do {
        n = recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
    } while (n < 0 && errno == EINTR);
    if (n > 0 || (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))) {
        Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE; /* 0: end of stream; any other failure: the socket is no use either */
}

static PyMethodDef methods[] = {
    {"recv_spin", recv_spin, METH_VARARGS,
     "recv_spin(fd, buffer, spin_ns) -> int: poll the socket for up to spin_ns without the GIL; the bytes "
     "read into buffer's start (> 0), 0 when the peer closed, -1 when nothing came in time. OSError otherwise."},
    {"wait_flag", wait_flag, METH_VARARGS,
     "wait_flag(flag, spin_ns) -> bool: poll the buffer's first byte for up to spin_ns without the GIL; "
     "True once another thread set it non-zero, False when the time ran out first."},
    {"recv_now", recv_now, METH_VARARGS,
     "recv_now(fd, buffer) -> int: one receive of what has arrived, holding the GIL; the bytes read into "
     "buffer's start (> 0), 0 when the peer closed, -1 when nothing had arrived. OSError otherwise."},
    {"peer_closed", peer_closed, METH_O,
     "peer_closed(fd) -> bool: True when a non-blocking peek finds the stream's end (or the socket failed); "
     "takes no bytes."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "dkv._spin", NULL, -1, methods};

PyMODINIT_FUNC PyInit__spin(void) { return PyModule_Create(&module); }
