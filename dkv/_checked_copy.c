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
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "_checked_copy.h"

typedef void (*kernel_t)(const dkv_block *, size_t, unsigned char *);
static kernel_t kernel = dkv_copy_hash_generic;

typedef struct {
    Py_buffer dest;
    PyObject *prefix; /* a reference held while the GIL is let go */
} held_t;

static PyObject *copy_and_checksum(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *segment_obj, *dests_obj, *offsets_obj, *prefixes_obj;
    if (!PyArg_ParseTuple(args, "OOOO", &segment_obj, &dests_obj, &offsets_obj, &prefixes_obj)) {
        return NULL;
    }
    Py_buffer segment;
    if (PyObject_GetBuffer(segment_obj, &segment, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    PyObject *dests = NULL, *offsets = NULL, *prefixes = NULL, *result = NULL;
    held_t *held = NULL;
    dkv_block *blocks = NULL;
    Py_ssize_t n = 0, taken = 0;

    dests = PySequence_Fast(dests_obj, "dests must be a sequence");
    offsets = dests ? PySequence_Fast(offsets_obj, "offsets must be a sequence") : NULL;
    prefixes = offsets ? PySequence_Fast(prefixes_obj, "prefixes must be a sequence") : NULL;
    if (!prefixes) {
        goto done;
    }
    n = PySequence_Fast_GET_SIZE(dests);
    if (PySequence_Fast_GET_SIZE(offsets) != n || PySequence_Fast_GET_SIZE(prefixes) != n) {
        PyErr_SetString(PyExc_ValueError, "one offset and one prefix per destination");
        goto done;
    }
    held = PyMem_Calloc(n ? n : 1, sizeof(held_t));
    blocks = PyMem_Calloc(n ? n : 1, sizeof(dkv_block));
    if (!held || !blocks) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(dests, i), &held[i].dest, PyBUF_WRITABLE) < 0) {
            goto done;
        }
        taken = i + 1;
        Py_ssize_t len = held[i].dest.len;
        PyObject *index = PyNumber_Index(PySequence_Fast_GET_ITEM(offsets, i)); /* ints, numpy ints */
        if (!index) {
            goto done;
        }
        Py_ssize_t offset = PyLong_AsSsize_t(index);
        Py_DECREF(index);
        if (offset == -1 && PyErr_Occurred()) {
            goto done;
        }
        if (offset < 0 || len > segment.len || offset > segment.len - len) {
            PyErr_Format(PyExc_ValueError, "block %zd (%zd bytes at %zd) lies outside the segment of %zd bytes",
                         i, len, offset, segment.len);
            goto done;
        }
        PyObject *prefix = PySequence_Fast_GET_ITEM(prefixes, i);
        if (!PyBytes_Check(prefix)) {
            PyErr_SetString(PyExc_TypeError, "prefixes must be bytes");
            goto done;
        }
        Py_INCREF(prefix);
        held[i].prefix = prefix;
        blocks[i] = (dkv_block){
            .src = (const char *)segment.buf + offset,
            .dest = (char *)held[i].dest.buf,
            .len = (size_t)len,
            .prefix = PyBytes_AS_STRING(prefix),
            .prefix_len = (size_t)PyBytes_GET_SIZE(prefix),
        };
    }
    result = PyBytes_FromStringAndSize(NULL, n * DKV_CHECKSUM_SIZE);
    if (result) {
        unsigned char *out = (unsigned char *)PyBytes_AS_STRING(result);
        Py_BEGIN_ALLOW_THREADS
        kernel(blocks, (size_t)n, out);
        Py_END_ALLOW_THREADS
    }
done:
    for (Py_ssize_t i = 0; i < taken; i++) {
        PyBuffer_Release(&held[i].dest);
        Py_XDECREF(held[i].prefix);
    }
    PyMem_Free(blocks);
    PyMem_Free(held);
    Py_XDECREF(prefixes);
    Py_XDECREF(offsets);
    Py_XDECREF(dests);
    PyBuffer_Release(&segment);
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

static PyMethodDef methods[] = {
    {"use_kernel", use_kernel, METH_O,
     "use_kernel(name): use the 'generic' or the 'avx2' build from now on (tests compare them; KERNEL says which)."},
    {"copy_and_checksum", copy_and_checksum, METH_VARARGS,
     "copy_and_checksum(segment, dests, offsets, prefixes) -> bytes: copy each block out of the segment into "
     "its destination and return the copies' checksums (16 bytes each), without the GIL."},
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
    PyObject *m = PyModule_Create(&module);
    if (!m) {
        return NULL;
    }
    const char *name = "generic";
    if (avx2_usable()) {
        kernel = dkv_copy_hash_avx2;
        name = "avx2";
    }
    if (PyModule_AddStringConstant(m, "KERNEL", name) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
