/* A leased lookup's per-key run over the store's index, in C (dkv.store.Store._pin_present, one shard).
 *
 * bind(block_type)
 *
 *   Learns where ``offset``, ``size``, ``pins`` and ``checksum`` lie in instances of ``block_type``
 *   (dkv.store.Block, a slots dataclass: each field is a member descriptor of type T_OBJECT_EX).
 *   Must be called once before pin_run / pin_all / unpin_all; only instances of exactly that type are accepted.
 *
 * pin_run(column, hashes, start, mask, held, depths, tally, offsets, sizes, sums) -> int
 *
 *   For i = start, start + 1, ...: the block ``column.get(hashes[i])``, where ``column`` is a dict
 *   {hash: block} of one namespace, leaf and shard (dkv.store.Store.columns).
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
 * pin_run_shards(blocks, namespace, leaf, hashes, shards, start, mask, pinned, tally) -> int
 *
 *   The same run for a lookup over ``shards`` > 1 tensor-parallel shards, where a hash is present only
 *   when every shard's block is: for i = start, ...: the blocks of (namespace, leaf, s, hashes[i]) for
 *   s < shards.
 *     one absent       mask gets False, nothing pinned for the hash;
 *     one off the host (and not yet in ``pinned``) the run stops and returns i, nothing done for it;
 *     else             each block whose key is not yet in ``pinned`` gets one more pin, and every key is
 *                      set in ``pinned`` to i (a key is pinned once per lookup, at its last depth; the
 *                      dict keeps first-pin order); mask gets True.
 *   ``tally`` as for pin_run. Every block pinned before an error has its key in ``pinned``.
 *
 * slot_map(blocks, covered, namespace, leaf, hashes, shards, offsets, sizes, sums)
 *
 *   A lease's packed slot map over hashes x shards (hash-major), appended to the three bytearrays: for
 *   each key (namespace, leaf, s, hash) that ``covered`` (a dict or set of keys) holds, its block's
 *   (offset, size, checksum), else, or where the block has no checksum or lies off the host tier,
 *   (-1, 0, 16 zero bytes). Nothing is pinned or changed.
 *
 * stamp_run(held, depths, stamp, order) -> (next order, entries)
 *
 *   One use of each block of ``held`` still in the store's index (its ``indexed`` is True), in order: its
 *   stamp set to ``stamp``, its depth to ``depths[i]`` and its order to ``order``, ``order + 1``, ...; one
 *   on the host tier (offset >= 0) also gets the recency entry (stamp, -depth, order, block) in
 *   ``entries[tenant]`` (a new dict of new lists, each sorted ascending). A block no longer indexed is
 *   skipped. Every entry is checked before any block is changed.
 *
 * live_entries(heap) -> list
 *
 *   The recency entries (stamp, -depth, order, block) of ``heap`` still live, in the order found: those
 *   whose block is indexed, on the host tier (offset >= 0) and of that very order.
 *
 * unpin_all(held) -> int
 *
 *   One pin less on each block of the list ``held`` (a block listed twice loses two); returns how many
 *   reached 0. Every entry is checked to be a block holding a pin before any is changed.
 *
 * pin_all(held) -> int
 *
 *   One pin more on each block of the list ``held`` (a block listed twice gains two); returns how many
 *   went from 0 to pinned. Every entry is checked to be a block before any is changed.
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
static Py_ssize_t at_key = -1, at_stamp = -1, at_depth = -1, at_order = -1, at_tenant = -1, at_indexed = -1;
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
    Py_ssize_t offset, size, pins, checksum, key, stamp, depth, order, tenant, indexed;
    if (field_at(type, "offset", &offset) < 0 || field_at(type, "size", &size) < 0 ||
        field_at(type, "pins", &pins) < 0 || field_at(type, "checksum", &checksum) < 0 ||
        field_at(type, "key", &key) < 0 || field_at(type, "stamp", &stamp) < 0 ||
        field_at(type, "depth", &depth) < 0 || field_at(type, "order", &order) < 0 ||
        field_at(type, "tenant", &tenant) < 0 || field_at(type, "indexed", &indexed) < 0) {
        return NULL;
    }
    Py_INCREF(type);
    Py_XSETREF(block_type, (PyTypeObject *)type);
    at_offset = offset;
    at_size = size;
    at_pins = pins;
    at_checksum = checksum;
    at_key = key;
    at_stamp = stamp;
    at_depth = depth;
    at_order = order;
    at_tenant = tenant;
    at_indexed = indexed;
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

/* A run's tally: a list holding one int. */
static int is_tally(PyObject *tally) {
    return PyList_Check(tally) && PyList_GET_SIZE(tally) == 1 && PyLong_Check(PyList_GET_ITEM(tally, 0));
}

/* ``tally[0] += newly``, keeping an exception already set (the run's own error is the one raised);
 * -1 (with its own error set) only where the addition itself fails. */
static int add_to_tally(PyObject *tally, Py_ssize_t newly) {
    PyObject *exc_type, *exc_value, *exc_tb;
    PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
    PyObject *count = PyLong_FromSsize_t(newly);
    PyObject *now = count ? PyNumber_Add(PyList_GET_ITEM(tally, 0), count) : NULL;
    Py_XDECREF(count);
    if (now == NULL) {
        Py_XDECREF(exc_type);
        Py_XDECREF(exc_value);
        Py_XDECREF(exc_tb);
        return -1;
    }
    PyList_SetItem(tally, 0, now); /* steals now */
    PyErr_Restore(exc_type, exc_value, exc_tb);
    return 0;
}

static PyObject *pin_run(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "pin_run() takes 10 arguments");
        return NULL;
    }
    PyObject *column = args[0], *hashes_obj = args[1];
    PyObject *mask = args[3], *held = args[4], *depths = args[5], *tally = args[6];
    PyObject *offsets = args[7], *sizes = args[8], *sums = args[9];
    if (!PyDict_Check(column) || !PyList_Check(mask) || !PyList_Check(held) || !PyList_Check(depths) ||
        !is_tally(tally)) {
        PyErr_SetString(PyExc_TypeError, "pin_run(dict, hashes, start, list, list, list, [int], ...)");
        return NULL;
    }
    int with_slots = offsets != Py_None;
    if (with_slots ? !(PyByteArray_Check(offsets) && PyByteArray_Check(sizes) && PyByteArray_Check(sums))
                   : (sizes != Py_None || sums != Py_None)) {
        PyErr_SetString(PyExc_TypeError, "offsets, sizes and sums: three bytearrays, or all None");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[2]);
    if (start == -1 && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *hashes = PySequence_Fast(hashes_obj, "hashes must be a sequence");
    if (hashes == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hashes);
    PyObject **items = PySequence_Fast_ITEMS(hashes);
    PyObject *result = NULL;
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
        PyObject *block = PyDict_GetItemWithError(column, items[i]); /* borrowed */
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
    if (newly && add_to_tally(tally, newly) < 0) { /* kept true whether or not this raised */
        Py_CLEAR(result);
    }
    Py_DECREF(hashes);
    return result;
}

#define MAX_SHARDS 64 /* dkv.keys.MAX_TP_SHARDS */

/* A shard count in [1, MAX_SHARDS]; -1 with an exception set otherwise. */
static int shards_arg(PyObject *obj, Py_ssize_t *shards) {
    *shards = PyLong_AsSsize_t(obj);
    if (*shards == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (*shards < 1 || *shards > MAX_SHARDS) {
        PyErr_SetString(PyExc_ValueError, "shards out of range");
        return -1;
    }
    return 0;
}

static PyObject *pin_run_shards(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "pin_run_shards() takes 9 arguments");
        return NULL;
    }
    PyObject *blocks = args[0], *namespace = args[1], *leaf = args[2], *hashes_obj = args[3];
    PyObject *mask = args[6], *pinned = args[7], *tally = args[8];
    if (!PyDict_Check(blocks) || !PyList_Check(mask) || !PyDict_Check(pinned) || !is_tally(tally)) {
        PyErr_SetString(PyExc_TypeError, "pin_run_shards(dict, ns, leaf, hashes, shards, start, list, dict, [int])");
        return NULL;
    }
    Py_ssize_t shards, start = PyLong_AsSsize_t(args[5]);
    if ((start == -1 && PyErr_Occurred()) || shards_arg(args[4], &shards) < 0) {
        return NULL;
    }
    PyObject *hashes = PySequence_Fast(hashes_obj, "hashes must be a sequence");
    if (hashes == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hashes), newly = 0, i = start, made = 0;
    PyObject **items = PySequence_Fast_ITEMS(hashes);
    PyObject *keys[MAX_SHARDS], *found[MAX_SHARDS], *shard_ids[MAX_SHARDS];
    PyObject *result = NULL;
    for (Py_ssize_t s = 0; s < shards; s++) {
        keys[s] = NULL;
        shard_ids[s] = PyLong_FromSsize_t(s);
        if (shard_ids[s] == NULL) {
            goto done;
        }
        made = s + 1;
    }
    if (start < 0 || start > n) {
        PyErr_SetString(PyExc_ValueError, "start out of range");
        goto done;
    }
    for (; i < n; i++) {
        int absent = 0, off_host = 0;
        for (Py_ssize_t s = 0; s < shards; s++) { /* every shard's block, before anything is pinned */
            Py_XSETREF(keys[s], PyTuple_Pack(4, namespace, leaf, shard_ids[s], items[i]));
            if (keys[s] == NULL) {
                goto done;
            }
            found[s] = PyDict_GetItemWithError(blocks, keys[s]); /* borrowed */
            if (found[s] == NULL) {
                if (PyErr_Occurred()) {
                    goto done;
                }
                absent = 1;
                break;
            }
        }
        for (Py_ssize_t s = 0; !absent && s < shards; s++) {
            long long offset;
            if (!is_block(found[s]) || field_int(found[s], at_offset, "offset", &offset) < 0) {
                goto done;
            }
            if (offset < 0) {
                int known = PyDict_Contains(pinned, keys[s]);
                if (known < 0) {
                    goto done;
                }
                off_host |= !known;
            }
        }
        if (off_host) {
            break; /* brought back (or not) by the caller */
        }
        if (absent) {
            if (PyList_Append(mask, Py_False) < 0) {
                goto done;
            }
            continue;
        }
        PyObject *depth = PyLong_FromSsize_t(i);
        if (depth == NULL) {
            goto done;
        }
        for (Py_ssize_t s = 0; s < shards; s++) {
            int known = PyDict_Contains(pinned, keys[s]);
            long long pins = 0;
            PyObject *more = NULL;
            if (known < 0 || (!known && (field_int(found[s], at_pins, "pins", &pins) < 0 ||
                                         (more = PyLong_FromLongLong(pins + 1)) == NULL))) {
                Py_DECREF(depth);
                goto done;
            }
            if (PyDict_SetItem(pinned, keys[s], depth) < 0) { /* the key goes in before its pin */
                Py_XDECREF(more);
                Py_DECREF(depth);
                goto done;
            }
            if (!known) {
                Py_SETREF(FIELD(found[s], at_pins), more);
                if (pins == 0) {
                    newly++;
                }
            }
        }
        Py_DECREF(depth);
        if (PyList_Append(mask, Py_True) < 0) {
            goto done;
        }
    }
    result = PyLong_FromSsize_t(i);
done:
    if (newly && add_to_tally(tally, newly) < 0) { /* kept true whether or not this raised */
        Py_CLEAR(result);
    }
    for (Py_ssize_t s = 0; s < made; s++) {
        Py_XDECREF(keys[s]);
        Py_DECREF(shard_ids[s]);
    }
    Py_DECREF(hashes);
    return result;
}

static PyObject *slot_map(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "slot_map() takes 9 arguments");
        return NULL;
    }
    PyObject *blocks = args[0], *covered = args[1], *namespace = args[2], *leaf = args[3], *hashes_obj = args[4];
    PyObject *offsets = args[6], *sizes = args[7], *sums = args[8];
    if (!PyDict_Check(blocks) || !(PyDict_Check(covered) || PyAnySet_Check(covered)) ||
        !PyByteArray_Check(offsets) || !PyByteArray_Check(sizes) || !PyByteArray_Check(sums)) {
        PyErr_SetString(PyExc_TypeError, "slot_map(dict, dict or set, ns, leaf, hashes, shards, 3 bytearrays)");
        return NULL;
    }
    Py_ssize_t shards;
    if (shards_arg(args[5], &shards) < 0) {
        return NULL;
    }
    PyObject *hashes = PySequence_Fast(hashes_obj, "hashes must be a sequence");
    if (hashes == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hashes), entries = n * shards, made = 0;
    PyObject **items = PySequence_Fast_ITEMS(hashes);
    PyObject *shard_ids[MAX_SHARDS];
    PyObject *result = NULL;
    char *at_offsets, *at_sizes, *at_sums;
    for (Py_ssize_t s = 0; s < shards; s++) {
        if ((shard_ids[s] = PyLong_FromSsize_t(s)) == NULL) {
            goto done;
        }
        made = s + 1;
    }
    /* the entries are staged and appended only once all are known: an error while reading the blocks
     * leaves the buffers as they were */
    char *staged = PyMem_Malloc(entries ? entries * (16 + CHECKSUM_SIZE) : 1);
    if (staged == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0, j = 0; i < n; i++) {
        for (Py_ssize_t s = 0; s < shards; s++, j++) {
            long long offset = -1, size = 0;
            const unsigned char *sum = no_sum;
            PyObject *key = PyTuple_Pack(4, namespace, leaf, shard_ids[s], items[i]);
            if (key == NULL) {
                PyMem_Free(staged);
                goto done;
            }
            int held = PySequence_Contains(covered, key);
            PyObject *block = held > 0 ? PyDict_GetItemWithError(blocks, key) : NULL; /* borrowed */
            Py_DECREF(key);
            if (held < 0 || (block == NULL && PyErr_Occurred())) {
                PyMem_Free(staged);
                goto done;
            }
            if (block != NULL) {
                if (!is_block(block) || field_int(block, at_offset, "offset", &offset) < 0) {
                    PyMem_Free(staged);
                    goto done;
                }
                PyObject *checksum = FIELD(block, at_checksum);
                if (checksum == NULL || (checksum != Py_None && !(PyBytes_Check(checksum) &&
                                                                  PyBytes_GET_SIZE(checksum) == CHECKSUM_SIZE))) {
                    PyErr_SetString(PyExc_TypeError, "a block's checksum is neither None nor 16 bytes");
                    PyMem_Free(staged);
                    goto done;
                }
                if (checksum == Py_None || offset < 0) {
                    offset = -1;
                } else {
                    sum = (const unsigned char *)PyBytes_AS_STRING(checksum);
                    if (field_int(block, at_size, "size", &size) < 0) {
                        PyMem_Free(staged);
                        goto done;
                    }
                }
            }
            int64_t o = (int64_t)offset, z = (int64_t)(offset < 0 ? 0 : size);
            memcpy(staged + 8 * j, &o, 8);
            memcpy(staged + 8 * (entries + j), &z, 8);
            memcpy(staged + 16 * entries + CHECKSUM_SIZE * j, sum, CHECKSUM_SIZE);
        }
    }
    if ((at_offsets = grow(offsets, 8 * entries)) != NULL) {
        memcpy(at_offsets, staged, 8 * entries);
        if ((at_sizes = grow(sizes, 8 * entries)) != NULL) {
            memcpy(at_sizes, staged + 8 * entries, 8 * entries);
            if ((at_sums = grow(sums, CHECKSUM_SIZE * entries)) != NULL) {
                memcpy(at_sums, staged + 16 * entries, CHECKSUM_SIZE * entries);
                result = Py_NewRef(Py_None);
            }
        }
    }
    PyMem_Free(staged);
done:
    for (Py_ssize_t s = 0; s < made; s++) {
        Py_DECREF(shard_ids[s]);
    }
    Py_DECREF(hashes);
    return result;
}

#define NEGATED_KEPT 4096 /* -depth for depths below this: made once and kept (a use's depths repeat) */
static PyObject *negated[NEGATED_KEPT];

/* -depth (a new reference), kept for small depths; NULL with an exception set. */
static PyObject *negated_depth(PyObject *depth) {
    long d = PyLong_AsLong(depth);
    if (d == -1 && PyErr_Occurred()) {
        PyErr_Clear(); /* (a depth beyond a C long: negated the general way) */
    } else if (d >= 0 && d < NEGATED_KEPT) {
        if (negated[d] == NULL && (negated[d] = PyLong_FromLong(-d)) == NULL) {
            return NULL;
        }
        return Py_NewRef(negated[d]);
    }
    return PyNumber_Negative(depth);
}

static PyObject *stamp_run(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "stamp_run() takes 4 arguments");
        return NULL;
    }
    PyObject *held = args[0], *depths = args[1], *stamp = args[2];
    if (!PyList_Check(held) || !PyList_Check(depths) || !PyLong_Check(stamp) ||
        PyList_GET_SIZE(held) != PyList_GET_SIZE(depths)) {
        PyErr_SetString(PyExc_TypeError, "stamp_run(list, list of as many ints, int, order)");
        return NULL;
    }
    long long order = PyLong_AsLongLong(args[3]);
    if (order == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(held);
    for (Py_ssize_t i = 0; i < n; i++) { /* check every entry before changing any */
        PyObject *block = PyList_GET_ITEM(held, i);
        long long offset;
        if (!is_block(block) || field_int(block, at_offset, "offset", &offset) < 0) {
            return NULL;
        }
        if (!PyLong_Check(PyList_GET_ITEM(depths, i)) || FIELD(block, at_tenant) == NULL ||
            FIELD(block, at_indexed) == NULL) {
            PyErr_SetString(PyExc_TypeError, "stamp_run() of a block without a tenant or indexed, or a depth not an int");
            return NULL;
        }
    }
    PyObject *entries = PyDict_New();
    if (entries == NULL) {
        return NULL;
    }
    PyObject *tenant = NULL, *list = NULL; /* (borrowed) the last block's credential and its list */
    int rising = 1;                         /* every stamped block deeper than the one before it */
    long long last_depth = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *block = PyList_GET_ITEM(held, i);
        if (FIELD(block, at_indexed) != Py_True) {
            continue; /* evicted, cleared or replaced since: a stamp never touches it */
        }
        PyObject *depth = PyList_GET_ITEM(depths, i);
        long long d = PyLong_AsLongLong(depth);
        if (d == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            rising = 0;
        } else {
            rising = rising && d > last_depth;
            last_depth = d;
        }
        PyObject *at = PyLong_FromLongLong(order);
        if (at == NULL) {
            goto fail;
        }
        if (PyLong_AsLongLong(FIELD(block, at_offset)) >= 0) {
            if (FIELD(block, at_tenant) != tenant) {
                tenant = FIELD(block, at_tenant);
                list = PyDict_GetItemWithError(entries, tenant);
                if (list == NULL) {
                    if (PyErr_Occurred() || (list = PyList_New(0)) == NULL) {
                        Py_DECREF(at);
                        goto fail;
                    }
                    int set = PyDict_SetItem(entries, tenant, list);
                    Py_DECREF(list); /* (the dict holds it) */
                    if (set < 0) {
                        Py_DECREF(at);
                        goto fail;
                    }
                }
            }
            PyObject *negative = negated_depth(depth);
            PyObject *entry = negative ? PyTuple_Pack(4, stamp, negative, at, block) : NULL;
            Py_XDECREF(negative);
            if (entry == NULL || PyList_Append(list, entry) < 0) {
                Py_XDECREF(entry);
                Py_DECREF(at);
                goto fail;
            }
            Py_DECREF(entry);
        }
        Py_INCREF(stamp);
        Py_SETREF(FIELD(block, at_stamp), stamp);
        Py_INCREF(depth);
        Py_SETREF(FIELD(block, at_depth), depth);
        Py_SETREF(FIELD(block, at_order), at);
        order++;
    }
    /* each list ascending: (stamp, -depth, order) with one stamp, so deepest first; blocks found in rising depth
     * (a lookup's usual order) were listed in exactly the reverse order */
    Py_ssize_t pos = 0;
    PyObject *name, *made;
    while (PyDict_Next(entries, &pos, &name, &made)) {
        if (rising ? PyList_Reverse(made) < 0 : PyList_Sort(made) < 0) {
            goto fail;
        }
    }
    PyObject *next = PyLong_FromLongLong(order);
    PyObject *result = next ? PyTuple_Pack(2, next, entries) : NULL;
    Py_XDECREF(next);
    Py_DECREF(entries);
    return result;
fail:
    Py_DECREF(entries);
    return NULL;
}

static PyObject *live_entries(PyObject *Py_UNUSED(self), PyObject *heap) {
    if (!PyList_Check(heap)) {
        PyErr_SetString(PyExc_TypeError, "live_entries() takes a list");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(heap);
    PyObject *live = PyList_New(0);
    if (live == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *entry = PyList_GET_ITEM(heap, i);
        if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 4) {
            PyErr_SetString(PyExc_TypeError, "a recency entry is a tuple (stamp, -depth, order, block)");
            goto fail;
        }
        PyObject *block = PyTuple_GET_ITEM(entry, 3);
        long long offset;
        if (!is_block(block) || field_int(block, at_offset, "offset", &offset) < 0) {
            goto fail;
        }
        if (offset < 0 || FIELD(block, at_indexed) != Py_True) {
            continue;
        }
        int same = PyObject_RichCompareBool(FIELD(block, at_order), PyTuple_GET_ITEM(entry, 2), Py_EQ);
        if (same < 0 || (same && PyList_Append(live, entry) < 0)) {
            goto fail;
        }
    }
    return live;
fail:
    Py_DECREF(live);
    return NULL;
}

/* One pin more (step 1) or less (step -1) on each block of the list ``held``, every entry checked first (a block,
 * and for a pin less, one holding a pin); how many went from unpinned to pinned, or back. ``name`` names the
 * caller in errors. */
static PyObject *step_pins(PyObject *held, int step, const char *name) {
    if (!PyList_Check(held)) {
        PyErr_Format(PyExc_TypeError, "%s() takes a list of blocks", name);
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(held), reached = 0;
    for (Py_ssize_t i = 0; i < n; i++) { /* check every entry before changing any */
        long long pins;
        PyObject *block = PyList_GET_ITEM(held, i);
        if (!is_block(block) || field_int(block, at_pins, "pins", &pins) < 0) {
            return NULL;
        }
        if (pins < (step < 0 ? 1 : 0)) {
            PyErr_Format(PyExc_ValueError, step < 0 ? "%s() of a block that holds no pin"
                                                    : "%s() of a block with a negative pin count", name);
            return NULL;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *block = PyList_GET_ITEM(held, i);
        long long pins = PyLong_AsLongLong(FIELD(block, at_pins)); /* re-read: a block may be listed twice */
        PyObject *stepped = PyLong_FromLongLong(pins + step);
        if (stepped == NULL) {
            return NULL;
        }
        Py_SETREF(FIELD(block, at_pins), stepped);
        if (pins == (step < 0 ? 1 : 0)) {
            reached++;
        }
    }
    return PyLong_FromSsize_t(reached);
}

static PyObject *unpin_all(PyObject *Py_UNUSED(self), PyObject *held) {
    return step_pins(held, -1, "unpin_all");
}

static PyObject *pin_all(PyObject *Py_UNUSED(self), PyObject *held) {
    return step_pins(held, 1, "pin_all");
}

static PyMethodDef methods[] = {
    {"bind", bind, METH_O, "Learn where a block type's fields lie (call once, before the others)."},
    {"pin_run", (PyCFunction)(void (*)(void))pin_run, METH_FASTCALL,
     "Pin the host-tier blocks of a run of hashes, stopping at the first off the host tier."},
    {"pin_run_shards", (PyCFunction)(void (*)(void))pin_run_shards, METH_FASTCALL,
     "pin_run over several tensor-parallel shards: a hash is present when every shard's block is."},
    {"slot_map", (PyCFunction)(void (*)(void))slot_map, METH_FASTCALL,
     "A lease's packed slot map over hashes x shards, appended to three bytearrays."},
    {"stamp_run", (PyCFunction)(void (*)(void))stamp_run, METH_FASTCALL,
     "One use of each still-indexed block: stamp, depth and order set, host blocks' recency entries listed."},
    {"live_entries", live_entries, METH_O,
     "The recency entries still live: their block indexed, on the host tier, of that order."},
    {"unpin_all", unpin_all, METH_O, "One pin less on each block of a list; how many reached 0."},
    {"pin_all", pin_all, METH_O, "One pin more on each block of a list; how many went from 0 to pinned."},
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
