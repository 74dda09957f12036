/* The hash-list check every lookup, probe, touch, read and write runs on each side, in one C pass.
 *
 * plain_hashes(values) -> bool
 *
 *   True when ``values`` is a list or a tuple whose every item is exactly ``bytes`` (not a subclass, not a
 *   bytearray) of 8 or 32 bytes (dkv.keys.HASH_LENGTHS), else False; never raises for any input.
 *   dkv.keys.plain_hashes_python is its Python twin; the tests compare the two on every length 0..64
 *   and on mixed and foreign items.
 *
 * plain_block_ids(ids, pages) -> list[int] | None
 *
 *   A new list of ``ids`` when it is a list or a tuple of exactly ``int`` (not bool, not a numpy integer),
 *   each in ``1..pages-1`` and no two alike: a transfer's block ids as the scheduler thread checks them on
 *   every load and offload (connector.transfer_plan). None for anything else, never an exception for any
 *   ``ids``: the caller then checks them the general way, which says what is wrong.
 *   connector.transfer_plan.plain_block_ids_python is its Python twin; the tests hold the two to the same
 *   answers.
 *
 * pack_hashes(values) -> bytes | None
 *
 *   The hashes of ``values`` back to back, when it is a non-empty list or tuple of exactly ``bytes``, all
 *   8 or all 32 long: a lookup's, probe's or touch's hashes as they travel packed (dkv.wire); None for
 *   anything else (mixed lengths among them), never an exception for any ``values``.
 *
 * split_hashes(packed, size) -> list[bytes]
 *
 *   ``packed`` (bytes) cut into hashes of ``size`` (8 or 32) bytes each, as the node reads a packed list.
 *   ValueError when ``size`` is neither or ``len(packed)`` is not a multiple of it; TypeError for a packed
 *   that is not exactly bytes.
 *
 * dkv.keys.pack_hashes_python and split_hashes_python are their Python twins; the tests hold each pair to
 * the same answers.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

static PyObject *plain_hashes(PyObject *Py_UNUSED(self), PyObject *values) {
    if (!PyList_CheckExact(values) && !PyTuple_CheckExact(values)) {
        Py_RETURN_FALSE;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(values);
    PyObject **items = PySequence_Fast_ITEMS(values);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = items[i];
        if (!PyBytes_CheckExact(item)) {
            Py_RETURN_FALSE;
        }
        Py_ssize_t length = PyBytes_GET_SIZE(item);
        if (length != 8 && length != 32) {
            Py_RETURN_FALSE;
        }
    }
    Py_RETURN_TRUE;
}

/* Open addressing over a power-of-two table of at least twice ``n`` slots; 0 marks an empty slot (ids >= 1). */
static int all_distinct(const long long *values, Py_ssize_t n) {
    size_t size = 16;
    while (size < (size_t)n * 2) {
        size <<= 1;
    }
    long long stack[256];
    long long *table = size <= 256 ? stack : PyMem_Calloc(size, sizeof(long long));
    if (!table) {
        return -1;
    }
    if (table == stack) {
        memset(stack, 0, size * sizeof(long long));
    }
    int distinct = 1;
    for (Py_ssize_t i = 0; i < n && distinct; i++) {
        size_t at = ((size_t)values[i] * 0x9E3779B97F4A7C15ull) & (size - 1);
        while (table[at] != 0) {
            if (table[at] == values[i]) {
                distinct = 0;
                break;
            }
            at = (at + 1) & (size - 1);
        }
        table[at] = values[i];
    }
    if (table != stack) {
        PyMem_Free(table);
    }
    return distinct;
}

static PyObject *plain_block_ids(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "plain_block_ids(ids, pages)");
        return NULL;
    }
    PyObject *ids = args[0];
    long long pages = PyLong_AsLongLong(args[1]);
    if (pages == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (!PyList_CheckExact(ids) && !PyTuple_CheckExact(ids)) {
        Py_RETURN_NONE;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(ids);
    PyObject **items = PySequence_Fast_ITEMS(ids);
    long long small[256];
    long long *values = n <= 256 ? small : PyMem_Malloc((size_t)n * sizeof(long long));
    if (!values) {
        return PyErr_NoMemory();
    }
    int plain = 1;
    for (Py_ssize_t i = 0; i < n && plain; i++) {
        PyObject *item = items[i];
        if (!PyLong_CheckExact(item)) {
            plain = 0;
            break;
        }
        int overflow = 0;
        long long value = PyLong_AsLongLongAndOverflow(item, &overflow);
        if (overflow || value < 1 || value >= pages) {
            plain = 0;
            break;
        }
        values[i] = value;
    }
    if (plain) {
        plain = all_distinct(values, n);
    }
    if (values != small) {
        PyMem_Free(values);
    }
    if (plain < 0) {
        return PyErr_NoMemory();
    }
    if (!plain) {
        Py_RETURN_NONE;
    }
    PyObject *copy = PyList_New(n);
    if (!copy) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_INCREF(items[i]);
        PyList_SET_ITEM(copy, i, items[i]);
    }
    return copy;
}

static PyObject *pack_hashes(PyObject *Py_UNUSED(self), PyObject *values) {
    if (!PyList_CheckExact(values) && !PyTuple_CheckExact(values)) {
        Py_RETURN_NONE;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(values);
    PyObject **items = PySequence_Fast_ITEMS(values);
    if (n == 0 || !PyBytes_CheckExact(items[0])) {
        Py_RETURN_NONE;
    }
    Py_ssize_t size = PyBytes_GET_SIZE(items[0]);
    if (size != 8 && size != 32) {
        Py_RETURN_NONE;
    }
    for (Py_ssize_t i = 1; i < n; i++) {
        if (!PyBytes_CheckExact(items[i]) || PyBytes_GET_SIZE(items[i]) != size) {
            Py_RETURN_NONE;
        }
    }
    if (n > PY_SSIZE_T_MAX / size) {
        Py_RETURN_NONE;
    }
    PyObject *packed = PyBytes_FromStringAndSize(NULL, n * size);
    if (packed == NULL) {
        return NULL;
    }
    char *at = PyBytes_AS_STRING(packed);
    for (Py_ssize_t i = 0; i < n; i++) {
        memcpy(at + i * size, PyBytes_AS_STRING(items[i]), (size_t)size);
    }
    return packed;
}

static PyObject *split_hashes(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "split_hashes(packed, size)");
        return NULL;
    }
    PyObject *packed = args[0];
    if (!PyBytes_CheckExact(packed)) {
        PyErr_SetString(PyExc_TypeError, "split_hashes: packed hashes must be bytes");
        return NULL;
    }
    Py_ssize_t size = PyLong_Check(args[1]) ? PyLong_AsSsize_t(args[1]) : -1;
    if (size == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t total = PyBytes_GET_SIZE(packed);
    if ((size != 8 && size != 32) || total % size != 0) {
        PyErr_Format(PyExc_ValueError, "packed hashes: %zd bytes do not cut into hashes of 8 or 32 bytes (size %zd)",
                     total, size);
        return NULL;
    }
    Py_ssize_t n = total / size;
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        return NULL;
    }
    const char *at = PyBytes_AS_STRING(packed);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *hash = PyBytes_FromStringAndSize(at + i * size, size);
        if (hash == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, hash);
    }
    return out;
}

static PyMethodDef methods[] = {
    {"pack_hashes", pack_hashes, METH_O,
     "pack_hashes(values): the hashes back to back when all are plain bytes of one length, 8 or 32; else None."},
    {"split_hashes", (PyCFunction)(void (*)(void))split_hashes, METH_FASTCALL,
     "split_hashes(packed, size): packed hashes cut into a list of bytes of size 8 or 32 each."},
    {"plain_hashes", plain_hashes, METH_O, "True when a list or tuple holds only bytes of 8 or 32 bytes each."},
    {"plain_block_ids", (PyCFunction)(void (*)(void))plain_block_ids, METH_FASTCALL,
     "plain_block_ids(ids, pages): a new list of ids when they are plain ints in 1..pages-1, no two alike; else None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "dkv._hash_check", NULL, -1, methods};

PyMODINIT_FUNC PyInit__hash_check(void) { return PyModule_Create(&module); }
