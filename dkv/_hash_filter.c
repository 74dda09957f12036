/* A filter of block hashes: bits in a bytearray, set for hashes learned and probed for hashes asked, in one C pass.
 *
 * The connector's memory of what its node holds (connector.held_blocks) is exact: dicts keyed by the hash
 * bytes. Asked about the fresh hashes of an offload, which it almost never holds, each dict probe misses in
 * every cache level on a scheduler thread whose caches the model step (or a copy) has just swept: a probe is a
 * chain of dependent loads (the index table, then the entry), and the interpreter takes them one after another.
 * Measured, 64 fresh hashes against 64 Ki remembered: 3.6 us warm, 42 us cold. The bits here answer "surely
 * not held" for almost all of them with loads that do not depend on each other, so the processor overlaps
 * their misses; the dicts are asked only about what the bits cannot rule out.
 *
 * mark(bits, hashes) -> None
 *
 *   Sets the FILTER_PROBES bits of every hash in ``hashes`` (a list or tuple of bytes of at least 8 bytes)
 *   in ``bits`` (a bytearray whose length is a power of two). TypeError/ValueError for anything else, with
 *   nothing set.
 *
 * maybe(hashes, *bits) -> list[int] | None
 *
 *   The indexes into ``hashes`` of those whose every probed bit is set in at least one of ``bits`` (bytearrays
 *   as mark() takes, or None, skipped), in order; None when there is none (the usual answer, with no list
 *   made). Never a false negative: a hash marked in one of ``bits`` is always among them. Errors as mark().
 *
 * A hash's bits come from its first 8 bytes (block hashes are digests: their bytes are already uniform),
 * mixed by two multiplications so that a hash with structure in its low bytes (a counter) spreads too.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define FILTER_PROBES 2
#define MAX_BITS_SETS 4

typedef struct {
    uint8_t *bytes;
    uint64_t mask; /* bits - 1 */
} bits_t;

static inline uint64_t probe_bit(uint64_t key, int probe, uint64_t mask) {
    static const uint64_t multipliers[FILTER_PROBES] = {0x9E3779B97F4A7C15ULL, 0xC2B2AE3D27D4EB4FULL};
    uint64_t x = key * multipliers[probe];
    return (x ^ (x >> 29)) & mask;
}

static inline uint64_t key_of(PyObject *item) {
    uint64_t key;
    memcpy(&key, PyBytes_AS_STRING(item), sizeof key);
    return key;
}

/* ``obj`` as bits to probe or mark: a bytearray whose length is a power of two (at least 1 byte). */
static int bits_of(PyObject *obj, bits_t *out) {
    if (!PyByteArray_CheckExact(obj)) {
        PyErr_SetString(PyExc_TypeError, "the filter's bits must be a bytearray");
        return -1;
    }
    Py_ssize_t length = PyByteArray_GET_SIZE(obj);
    if (length <= 0 || (length & (length - 1)) != 0) {
        PyErr_Format(PyExc_ValueError, "the filter's bits must be a power of two bytes long, not %zd", length);
        return -1;
    }
    out->bytes = (uint8_t *)PyByteArray_AS_STRING(obj);
    out->mask = (uint64_t)length * 8 - 1;
    return 0;
}

/* ``hashes`` as a list or tuple of bytes of at least 8 bytes each; its items in *items, its length returned. */
static Py_ssize_t hashes_of(PyObject *hashes, PyObject ***items) {
    if (!PyList_CheckExact(hashes) && !PyTuple_CheckExact(hashes)) {
        PyErr_SetString(PyExc_TypeError, "hashes must be a list or a tuple of bytes");
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hashes);
    PyObject **got = PySequence_Fast_ITEMS(hashes);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyBytes_CheckExact(got[i]) || PyBytes_GET_SIZE(got[i]) < 8) {
            PyErr_Format(PyExc_TypeError, "hash %zd is not bytes of at least 8 bytes", i);
            return -1;
        }
    }
    *items = got;
    return n;
}

static PyObject *mark(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "mark(bits, hashes) takes 2 arguments");
        return NULL;
    }
    bits_t bits;
    PyObject **items;
    if (bits_of(args[0], &bits) < 0) {
        return NULL;
    }
    Py_ssize_t n = hashes_of(args[1], &items);
    if (n < 0) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t key = key_of(items[i]);
        for (int p = 0; p < FILTER_PROBES; p++) {
            uint64_t bit = probe_bit(key, p, bits.mask);
            bits.bytes[bit >> 3] |= (uint8_t)(1u << (bit & 7));
        }
    }
    Py_RETURN_NONE;
}

static inline int marked(const bits_t *bits, uint64_t key) {
    int all = 1;
    for (int p = 0; p < FILTER_PROBES; p++) { /* no early exit: the loads stay independent of each other */
        uint64_t bit = probe_bit(key, p, bits->mask);
        all &= (bits->bytes[bit >> 3] >> (bit & 7)) & 1;
    }
    return all;
}

static PyObject *maybe(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 1 + MAX_BITS_SETS) {
        PyErr_Format(PyExc_TypeError, "maybe(hashes, *bits) takes 1 to %d arguments", 1 + MAX_BITS_SETS);
        return NULL;
    }
    bits_t sets[MAX_BITS_SETS];
    int count = 0;
    for (Py_ssize_t a = 1; a < nargs; a++) {
        if (args[a] == Py_None) {
            continue;
        }
        if (bits_of(args[a], &sets[count]) < 0) {
            return NULL;
        }
        count++;
    }
    PyObject **items;
    Py_ssize_t n = hashes_of(args[0], &items);
    if (n < 0) {
        return NULL;
    }
    PyObject *found = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t key = key_of(items[i]);
        int hit = 0;
        for (int s = 0; s < count; s++) {
            hit |= marked(&sets[s], key);
        }
        if (!hit) {
            continue;
        }
        if (!found && !(found = PyList_New(0))) {
            return NULL;
        }
        PyObject *index = PyLong_FromSsize_t(i);
        if (!index || PyList_Append(found, index) < 0) {
            Py_XDECREF(index);
            Py_DECREF(found);
            return NULL;
        }
        Py_DECREF(index);
    }
    if (!found) {
        Py_RETURN_NONE;
    }
    return found;
}

static PyMethodDef methods[] = {
    {"mark", (PyCFunction)(void (*)(void))mark, METH_FASTCALL,
     "mark(bits, hashes): set every hash's bits in the bytearray bits (a power of two bytes long)."},
    {"maybe", (PyCFunction)(void (*)(void))maybe, METH_FASTCALL,
     "maybe(hashes, *bits): indexes of the hashes whose bits are all set in one of bits (None skipped); None if none."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "dkv._hash_filter", NULL, -1, methods};

PyMODINIT_FUNC PyInit__hash_filter(void) { return PyModule_Create(&module); }
