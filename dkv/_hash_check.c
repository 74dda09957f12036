/* The hash-list check every lookup, probe, touch, read and write runs on each side, in one C pass.
 *
 * plain_hashes(values) -> bool
 *
 *   True when ``values`` is a list or a tuple whose every item is exactly ``bytes`` (not a subclass, not a
 *   bytearray) of 8 or 32 bytes (dkv.keys.HASH_LENGTHS), else False; never raises for any input.
 *   dkv.keys.plain_hashes_python is its Python twin; the tests compare the two on every length 0..64
 *   and on mixed and foreign items.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

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

static PyMethodDef methods[] = {
    {"plain_hashes", plain_hashes, METH_O, "True when a list or tuple holds only bytes of 8 or 32 bytes each."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "dkv._hash_check", NULL, -1, methods};

PyMODINIT_FUNC PyInit__hash_check(void) { return PyModule_Create(&module); }
