/* A leased lookup's per-key run over the store's index, in C (dkv.store.Store._pin_present, one shard).
 *
 * bind(block_type)
 *
 *   Learns where ``offset``, ``size``, ``pins`` and ``checksum`` lie in instances of ``block_type``
 *   (dkv.store.Block, a slots dataclass: each field is a member descriptor of type T_OBJECT_EX).
 *   Must be called once before pin_run / unpin_all; only instances of exactly that type are accepted.
 *
 * pin_run(blocks, namespace, leaf, hashes, start, mask, held, depths, tally, offsets, sizes, sums) -> int
 *
 *   For i = start, start + 1, ...: the block ``blocks.get((namespace, leaf, 0, hashes[i]))``.
 *     absent           mask gets False, the slot map (-1, 0, 16 zero bytes);
 *     off the host     (its offset < 0) the run stops and returns i, nothing done for it: the caller
 *                      brings it back (or reports it absent) and runs again from i + 1;
 *     on the host      its pins go up by one, it is appended to ``held`` and i to ``depths``, mask gets
 *                      True, and the slot map its (offset, size, checksum), or (-1, 0, zeros) where it
 *                      has no checksum (None).
 *   Returns len(hashes) when every hash was seen. ``tally[0]`` grows by the number of blocks whose pins
 *   went from 0 to 1, also when this raises midway, so the caller's count of pinned blocks stays true;
 *   every block pinned before an error is in ``held`` (the caller gives those pins back).
 *   ``offsets``/``sizes`` (bytearrays) get one native int64 each per hash seen, ``sums`` (a bytearray)
 *   16 bytes; all three None: no slot map.
 *
 * unpin_all(held) -> int
 *
 *   One pin less on each block of the list ``held`` (a block listed twice loses two); returns how many
 *   reached 0. Every entry is checked to be a block holding a pin before any is changed.
 *
 * On valid input these do exactly what their Python twins in dkv.store_runs do; the tests run both over
 * the same stores and compare every output and every block's pins.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <string.h>

#define CHECKSUM_SIZE 16

static PyTypeObject *block_type = NULL;
static Py_ssize_t at_offset = -1, at_size = -1, at_pins = -1, at_checksum = -1;
static PyObject *zero = NULL;
static const unsigned char no_sum[CHECKSUM_SIZE] = {0};

#define FIELD(obj, at) (*(PyObject **)((char *)(obj) + (at)))

static int field_at(PyObject *type, const char *name, Py_ssize_t *at) {
    PyObject *descr = PyObject_GetAttrString(type, name);
    if (descr == NULL) {
        return -1;
    }
    int ok = Py_IS_TYPE(descr, &PyMemberDescr_Type);
    if (ok) {
        PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
        ok = member->type == T_OBJECT_EX && !(member->flags & READONLY);
        *at = member->offset;
    }
    Py_DECREF(descr);
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "%s.%s is not a writable slot", ((PyTypeObject *)type)->tp_name, name);
        return -1;
    }
    return 0;
}

static PyObject *bind(PyObject *Py_UNUSED(self), PyObject *type) {
    if (!PyType_Check(type)) {
        PyErr_SetString(PyExc_TypeError, "bind() takes the block type");
        return NULL;
    }
    Py_ssize_t offset, size, pins, checksum;
    if (field_at(type, "offset", &offset) < 0 || field_at(type, "size", &size) < 0 ||
        field_at(type, "pins", &pins) < 0 || field_at(type, "checksum", &checksum) < 0) {
        return NULL;
    }
    Py_INCREF(type);
    Py_XSETREF(block_type, (PyTypeObject *)type);
    at_offset = offset;
    at_size = size;
    at_pins = pins;
    at_checksum = checksum;
    Py_RETURN_NONE;
}

/* A field's int value; -1 with an exception set when the slot is empty or not an int. */
static int field_int(PyObject *block, Py_ssize_t at, const char *name, long long *out) {
    PyObject *value = FIELD(block, at);
    if (value == NULL || !PyLong_Check(value)) {
        PyErr_Format(PyExc_TypeError, "a block's %s is not an int", name);
        return -1;
    }
    *out = PyLong_AsLongLong(value);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int is_block(PyObject *obj) {
    if (block_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "dkv._store_index.bind() was not called");
        return 0;
    }
    if (!Py_IS_TYPE(obj, block_type)) {
        PyErr_Format(PyExc_TypeError, "expected a %s, got %s", block_type->tp_name, Py_TYPE(obj)->tp_name);
        return 0;
    }
    return 1;
}

/* Grow ``buf`` (a bytearray) by ``more`` bytes; returns where they start, or NULL with an exception. */
static char *grow(PyObject *buf, Py_ssize_t more) {
    Py_ssize_t had = PyByteArray_GET_SIZE(buf);
    if (PyByteArray_Resize(buf, had + more) < 0) {
        return NULL;
    }
    return PyByteArray_AS_STRING(buf) + had;
}

static PyObject *pin_run(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 12) {
        PyErr_SetString(PyExc_TypeError, "pin_run() takes 12 arguments");
        return NULL;
    }
    PyObject *blocks = args[0], *namespace = args[1], *leaf = args[2], *hashes_obj = args[3];
    PyObject *mask = args[5], *held = args[6], *depths = args[7], *tally = args[8];
    PyObject *offsets = args[9], *sizes = args[10], *sums = args[11];
    if (!PyDict_Check(blocks) || !PyList_Check(mask) || !PyList_Check(held) || !PyList_Check(depths) ||
        !PyList_Check(tally) || PyList_GET_SIZE(tally) != 1 || !PyLong_Check(PyList_GET_ITEM(tally, 0))) {
        PyErr_SetString(PyExc_TypeError, "pin_run(dict, ns, leaf, hashes, start, list, list, list, [int], ...)");
        return NULL;
    }
    int with_slots = offsets != Py_None;
    if (with_slots ? !(PyByteArray_Check(offsets) && PyByteArray_Check(sizes) && PyByteArray_Check(sums))
                   : (sizes != Py_None || sums != Py_None)) {
        PyErr_SetString(PyExc_TypeError, "offsets, sizes and sums: three bytearrays, or all None");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[4]);
    if (start == -1 && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *hashes = PySequence_Fast(hashes_obj, "hashes must be a sequence");
    if (hashes == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hashes);
    PyObject **items = PySequence_Fast_ITEMS(hashes);
    PyObject *key = NULL, *result = NULL;
    char *at_offsets = NULL, *at_sizes = NULL, *at_sums = NULL;
    Py_ssize_t newly = 0, i = start, reserved = 0;
    if (start < 0 || start > n) {
        PyErr_SetString(PyExc_ValueError, "start out of range");
        goto done;
    }
    if (with_slots) {  /* room for every hash left; what the run does not use is given back at the end */
        reserved = n - start;
        if (!(at_offsets = grow(offsets, 8 * reserved)) || !(at_sizes = grow(sizes, 8 * reserved)) ||
            !(at_sums = grow(sums, CHECKSUM_SIZE * reserved))) {
            goto done;
        }
    }
    for (; i < n; i++) {
        Py_XSETREF(key, PyTuple_Pack(4, namespace, leaf, zero, items[i])); /* a new one each: tuples may cache their hash */
        if (key == NULL) {
            goto done;
        }
        PyObject *block = PyDict_GetItemWithError(blocks, key); /* borrowed */
        long long offset = -1, size = 0, pins = 0;
        const unsigned char *sum = no_sum;
        if (block == NULL) {
            if (PyErr_Occurred() || PyList_Append(mask, Py_False) < 0) {
                goto done;
            }
        } else {
            if (!is_block(block) || field_int(block, at_offset, "offset", &offset) < 0) {
                goto done;
            }
            if (offset < 0) {
                break; /* off the host tier: the caller's */
            }
            if (field_int(block, at_pins, "pins", &pins) < 0) {
                goto done;
            }
            PyObject *checksum = FIELD(block, at_checksum);
            if (checksum == NULL || (checksum != Py_None && !(PyBytes_Check(checksum) &&
                                                              PyBytes_GET_SIZE(checksum) == CHECKSUM_SIZE))) {
                PyErr_SetString(PyExc_TypeError, "a block's checksum is neither None nor 16 bytes");
                goto done;
            }
            if (checksum == Py_None) {
                offset = -1;
            } else {
                sum = (const unsigned char *)PyBytes_AS_STRING(checksum);
                if (field_int(block, at_size, "size", &size) < 0) {
                    goto done;
                }
            }
            /* everything that can fail comes before the pin; once ``held`` has the block it is pinned */
            PyObject *more = PyLong_FromLongLong(pins + 1);
            PyObject *depth = more ? PyLong_FromSsize_t(i) : NULL;
            if (depth == NULL || PyList_Append(mask, Py_True) < 0 || PyList_Append(depths, depth) < 0 ||
                PyList_Append(held, block) < 0) {
                Py_XDECREF(more);
                Py_XDECREF(depth);
                goto done;
            }
            Py_DECREF(depth);
            Py_SETREF(FIELD(block, at_pins), more);
            if (pins == 0) {
                newly++;
            }
        }
        if (with_slots) {
            Py_ssize_t j = i - start;
            int64_t o = (int64_t)offset, s = (int64_t)(offset < 0 ? 0 : size);
            memcpy(at_offsets + 8 * j, &o, 8);
            memcpy(at_sizes + 8 * j, &s, 8);
            memcpy(at_sums + CHECKSUM_SIZE * j, sum, CHECKSUM_SIZE);
        }
    }
    result = PyLong_FromSsize_t(i);
done:
    if (with_slots && reserved) {  /* give back the room not written (the whole of it on an early error) */
        Py_ssize_t unused = reserved - (i - start);
        PyObject *exc_type, *exc_value, *exc_tb;
        PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
        int shrunk = (!at_offsets || PyByteArray_Resize(offsets, PyByteArray_GET_SIZE(offsets) - 8 * unused) == 0) &&
                     (!at_sizes || PyByteArray_Resize(sizes, PyByteArray_GET_SIZE(sizes) - 8 * unused) == 0) &&
                     (!at_sums || PyByteArray_Resize(sums, PyByteArray_GET_SIZE(sums) - CHECKSUM_SIZE * unused) == 0);
        if (exc_type != NULL) {
            PyErr_Restore(exc_type, exc_value, exc_tb); /* the first error is the one to raise */
        } else if (!shrunk) {
            Py_CLEAR(result); /* a buffer someone holds a view of cannot shrink: its error is raised */
        }
    }
    if (newly) { /* kept true whether or not this raised */
        PyObject *exc_type, *exc_value, *exc_tb;
        PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
        PyObject *was = PyList_GET_ITEM(tally, 0);
        PyObject *count = PyLong_FromSsize_t(newly);
        PyObject *now = count ? PyNumber_Add(was, count) : NULL;
        Py_XDECREF(count);
        if (now != NULL) {
            PyList_SetItem(tally, 0, now); /* steals now */
            PyErr_Restore(exc_type, exc_value, exc_tb);
        } else {
            Py_XDECREF(exc_type);
            Py_XDECREF(exc_value);
            Py_XDECREF(exc_tb);
            Py_CLEAR(result);
        }
    }
    Py_XDECREF(key);
    Py_DECREF(hashes);
    return result;
}

static PyObject *unpin_all(PyObject *Py_UNUSED(self), PyObject *held) {
    if (!PyList_Check(held)) {
        PyErr_SetString(PyExc_TypeError, "unpin_all() takes a list of blocks");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(held), reached = 0;
    for (Py_ssize_t i = 0; i < n; i++) { /* check every entry before changing any */
        long long pins;
        PyObject *block = PyList_GET_ITEM(held, i);
        if (!is_block(block) || field_int(block, at_pins, "pins", &pins) < 0) {
            return NULL;
        }
        if (pins < 1) {
            PyErr_SetString(PyExc_ValueError, "unpin_all() of a block that holds no pin");
            return NULL;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *block = PyList_GET_ITEM(held, i);
        long long pins = PyLong_AsLongLong(FIELD(block, at_pins)); /* re-read: a block may be listed twice */
        PyObject *less = PyLong_FromLongLong(pins - 1);
        if (less == NULL) {
            return NULL;
        }
        Py_SETREF(FIELD(block, at_pins), less);
        if (pins == 1) {
            reached++;
        }
    }
    return PyLong_FromSsize_t(reached);
}

static PyMethodDef methods[] = {
    {"bind", bind, METH_O, "Learn where a block type's fields lie (call once, before the others)."},
    {"pin_run", (PyCFunction)(void (*)(void))pin_run, METH_FASTCALL,
     "Pin the host-tier blocks of a run of hashes, stopping at the first off the host tier."},
    {"unpin_all", unpin_all, METH_O, "One pin less on each block of a list; how many reached 0."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "dkv._store_index", NULL, -1, methods};

PyMODINIT_FUNC PyInit__store_index(void) {
    zero = PyLong_FromLong(0);
    if (zero == NULL) {
        return NULL;
    }
    return PyModule_Create(&module);
}
