/* Whether buffers lie back to back in memory, in one C pass (a payload message's span: dkv.transport._span).
 *
 * buffer_run(buffers, writable) -> (address, nbytes) | None
 *
 *   buffers   a sequence of objects with the buffer protocol, each C-contiguous (and writable, with
 *             ``writable``)
 *
 *   (address, nbytes): where the first starts and how many bytes they cover together, when each starts
 *   where the one before it ends; None when one does not (or there are none). An item that does not
 *   export such a buffer raises (TypeError or BufferError): the caller then asks another way. Nothing is
 *   held once it returns: the caller keeps the buffers alive while it uses the address.
 *   dkv.transport._span_python is its Python twin (ucxx's Array per buffer); the tests compare the two.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *buffer_run(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *buffers_obj;
    int writable;
    if (!PyArg_ParseTuple(args, "Op", &buffers_obj, &writable)) {
        return NULL;
    }
    PyObject *buffers = PySequence_Fast(buffers_obj, "buffers must be a sequence");
    if (!buffers) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(buffers);
    const char *start = NULL, *end = NULL;
    int apart = n == 0;
    for (Py_ssize_t i = 0; i < n && !apart; i++) {
        Py_buffer view;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(buffers, i), &view,
                               PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) {
            Py_DECREF(buffers);
            return NULL;
        }
        if (i == 0) {
            start = end = (const char *)view.buf;
        }
        if ((const char *)view.buf != end) {
            apart = 1;
        }
        end += view.len;
        PyBuffer_Release(&view);
    }
    Py_DECREF(buffers);
    if (apart) {
        Py_RETURN_NONE;
    }
    return Py_BuildValue("(Nn)", PyLong_FromVoidPtr((void *)start), (Py_ssize_t)(end - start));
}

static PyMethodDef methods[] = {
    {"buffer_run", buffer_run, METH_VARARGS,
     "buffer_run(buffers, writable) -> (address, nbytes) | None: where C-contiguous buffers that lie back to "
     "back start, and how long they are together; None when they do not lie back to back."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "dkv._buffer_run", NULL, -1, methods};

PyMODINIT_FUNC PyInit__buffer_run(void) { return PyModule_Create(&module); }
