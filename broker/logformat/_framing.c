/* Record walks in C, each the twin of a Python walk that stays the reference (issue 18: a Python
 * loop per record was 14% of the event loop's time at 1,000 records per send, and 40% of the loop
 * plus 41% of the view dispatcher when scheduling timers), and the record encoder (a quarter of a
 * Python client's CPU per send of 1,000 messages). Parity tests: tests/test_batch_format.py.
 *
 * check(records, expected_count) -> None, or ValueError. The same rules and the same messages as
 * broker.logformat.batch.record_positions (docs/formats/commitlog.md):
 *
 *     u32 record_bytes (after this field) | u16 key_len | u16 props_len | key | props | body
 *
 * every record holds its own head (record_bytes >= 4 + key_len + props_len) and ends inside the
 * buffer; the walk stops as soon as it met the declared count and bytes remain. All integers are
 * little-endian, read byte by byte (no alignment or host-order assumption).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_utf8.h"

#define RECORD_HEAD_BYTES 8
/* Above this size the walk lets other threads run (it holds the buffer, not Python objects).
 * Below it, giving the interpreter lock up would cost more than the walk: getting it back can wait a
 * switch interval behind another thread. */
#define RELEASE_LOCK_BYTES (4 * 1024 * 1024)

enum outcome { WALK_OK, WALK_MORE, WALK_TRUNCATED, WALK_BAD_LENGTH, WALK_FEWER };

struct walk {
    Py_ssize_t expected; /* the declared count */
    enum outcome outcome;
    Py_ssize_t count; /* records walked */
    Py_ssize_t pos;   /* where the walk stopped */
    uint32_t size;    /* the bad length, for WALK_BAD_LENGTH */
};

static uint32_t le32(const unsigned char *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static uint32_t le16(const unsigned char *p) { return (uint32_t)p[0] | ((uint32_t)p[1] << 8); }

static void walk_records(const unsigned char *buf, Py_ssize_t end, Py_ssize_t expected, struct walk *w) {
    Py_ssize_t pos = 0, count = 0;
    w->expected = expected;
    while (pos < end) {
        if (count == expected) {
            w->outcome = WALK_MORE;
            w->count = count;
            w->pos = pos;
            return;
        }
        if (end - pos < RECORD_HEAD_BYTES) {
            w->outcome = WALK_TRUNCATED;
            w->count = count;
            w->pos = pos;
            return;
        }
        uint32_t size = le32(buf + pos);
        uint32_t head = 4 + le16(buf + pos + 4) + le16(buf + pos + 6);
        /* end - pos - 4 >= 4 here: no overflow in the comparison */
        if (size < head || (uint64_t)size > (uint64_t)(end - pos - 4)) {
            w->outcome = WALK_BAD_LENGTH;
            w->count = count;
            w->pos = pos;
            w->size = size;
            return;
        }
        count++;
        pos += 4 + (Py_ssize_t)size;
    }
    w->outcome = count == expected ? WALK_OK : WALK_FEWER;
    w->count = count;
    w->pos = pos;
}

/* A walk over a buffer argument and one size argument (``format``: "y*n:name"), without the
 * interpreter lock when the buffer is large. 0 when the arguments do not parse. */
typedef void (*walk_fn)(const unsigned char *buf, Py_ssize_t end, Py_ssize_t n, void *out);

static int run_walk(PyObject *args, const char *format, walk_fn fn, void *out) {
    Py_buffer view;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, format, &view, &n))
        return 0;
    if (view.len >= RELEASE_LOCK_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        fn((const unsigned char *)view.buf, view.len, n, out);
        Py_END_ALLOW_THREADS
    } else {
        fn((const unsigned char *)view.buf, view.len, n, out);
    }
    PyBuffer_Release(&view);
    return 1;
}

static void walk_records_fn(const unsigned char *buf, Py_ssize_t end, Py_ssize_t n, void *out) {
    walk_records(buf, end, n, (struct walk *)out);
}

static PyObject *check(PyObject *self, PyObject *args) {
    Py_ssize_t expected;
    struct walk w;
    (void)self;
    if (!run_walk(args, "y*n:check", walk_records_fn, &w))
        return NULL;
    expected = w.expected;
    switch (w.outcome) {
    case WALK_OK:
        Py_RETURN_NONE;
    case WALK_MORE:
        PyErr_Format(PyExc_ValueError, "batch declares %zd records but holds more", expected);
        return NULL;
    case WALK_TRUNCATED:
        PyErr_Format(PyExc_ValueError, "record %zd truncated at byte %zd", w.count, w.pos);
        return NULL;
    case WALK_BAD_LENGTH:
        PyErr_Format(PyExc_ValueError, "record %zd has bad length %lu at byte %zd", w.count, (unsigned long)w.size, w.pos);
        return NULL;
    case WALK_FEWER:
    default:
        PyErr_Format(PyExc_ValueError, "batch declares %zd records but holds %zd", expected, w.count);
        return NULL;
    }
}

enum content { CONTENT_OK, CONTENT_KEY, CONTENT_PROPS, CONTENT_NAME, CONTENT_VALUE, CONTENT_RESERVED };

struct content_walk {
    enum content outcome;
    Py_ssize_t record; /* the record at fault */
    Py_ssize_t prop;   /* its property at fault */
};

/* For records whose framing is already checked: every key, property name and value is UTF-8, the
 * properties fill their length exactly, and from the property ``leading_reserved`` on no name starts
 * with "__" (the broker's; a scheduled record's first three are its timer fields). */
static void walk_contents(const unsigned char *buf, Py_ssize_t end, Py_ssize_t leading_reserved, struct content_walk *w) {
    Py_ssize_t pos = 0, record = 0;
    w->outcome = CONTENT_OK;
    while (pos < end) {
        uint32_t size = le32(buf + pos);
        Py_ssize_t key_len = le16(buf + pos + 4), props_len = le16(buf + pos + 6);
        const unsigned char *key = buf + pos + RECORD_HEAD_BYTES;
        const unsigned char *p = key + key_len, *pe = p + props_len;
        Py_ssize_t prop = 0;
        w->record = record;
        if (!utf8_ok(key, key_len)) {
            w->outcome = CONTENT_KEY;
            return;
        }
        while (p < pe) {
            w->prop = prop;
            if (pe - p < 4) {
                w->outcome = CONTENT_PROPS;
                return;
            }
            Py_ssize_t name_len = le16(p);
            if (pe - p - 4 < name_len) {
                w->outcome = CONTENT_PROPS;
                return;
            }
            const unsigned char *name = p + 2, *v = name + name_len + 2;
            Py_ssize_t value_len = le16(name + name_len);
            if (pe - v < value_len) {
                w->outcome = CONTENT_PROPS;
                return;
            }
            if (!utf8_ok(name, name_len)) {
                w->outcome = CONTENT_NAME;
                return;
            }
            if (!utf8_ok(v, value_len)) {
                w->outcome = CONTENT_VALUE;
                return;
            }
            if (prop >= leading_reserved && name_len >= 2 && name[0] == '_' && name[1] == '_') {
                w->outcome = CONTENT_RESERVED;
                return;
            }
            p = v + value_len;
            prop++;
        }
        record++;
        pos += 4 + (Py_ssize_t)size;
    }
}

static void walk_contents_fn(const unsigned char *buf, Py_ssize_t end, Py_ssize_t n, void *out) {
    walk_contents(buf, end, n, (struct content_walk *)out);
}

static PyObject *check_contents(PyObject *self, PyObject *args) {
    struct content_walk w;
    (void)self;
    if (!run_walk(args, "y*n:check_contents", walk_contents_fn, &w))
        return NULL;
    switch (w.outcome) {
    case CONTENT_OK:
        Py_RETURN_NONE;
    case CONTENT_KEY:
        PyErr_Format(PyExc_ValueError, "record %zd: its key is not UTF-8", w.record);
        return NULL;
    case CONTENT_PROPS:
        PyErr_Format(PyExc_ValueError, "record %zd: property %zd runs past the record's properties", w.record, w.prop);
        return NULL;
    case CONTENT_NAME:
        PyErr_Format(PyExc_ValueError, "record %zd: the name of property %zd is not UTF-8", w.record, w.prop);
        return NULL;
    case CONTENT_VALUE:
        PyErr_Format(PyExc_ValueError, "record %zd: the value of property %zd is not UTF-8", w.record, w.prop);
        return NULL;
    case CONTENT_RESERVED:
    default:
        PyErr_Format(PyExc_ValueError, "record %zd: property %zd has a reserved name (names starting with __ "
                     "belong to the broker)", w.record, w.prop);
        return NULL;
    }
}

/* Digits only (1..19 of them) to an unsigned value; 0 if anything else (the caller then defers to
 * the Python code, which has the exact rules and messages). */
static int parse_digits(const unsigned char *p, Py_ssize_t n, uint64_t *out) {
    uint64_t v = 0;
    if (n < 1 || n > 19)
        return 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (p[i] < '0' || p[i] > '9')
            return 0;
        v = v * 10 + (uint64_t)(p[i] - '0'); /* 19 digits < 2^64: no overflow */
    }
    *out = v;
    return 1;
}

/* scheduled_ok(records, deliver_at_name, target, latest_ms) -> bool
 *
 * For records whose framing is already checked: True when every record is a valid scheduled
 * record (timer_props.check_scheduled's rules: the first property is ``deliver_at_name`` with 1-19
 * digits no later than ``latest_ms``, then the bytes ``target``, all inside the record's props).
 * False when any record is not, or is one this walk does not judge: the caller then runs the
 * Python check, which raises with the exact message. True is only ever said of a batch the Python
 * check accepts (a parity test holds it to that). */
static PyObject *scheduled_ok(PyObject *self, PyObject *args) {
    Py_buffer rec, name, target;
    long long latest;
    int ok = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*L:scheduled_ok", &rec, &name, &target, &latest))
        return NULL;
    const unsigned char *buf = (const unsigned char *)rec.buf;
    Py_ssize_t end = rec.len, pos = 0;
    if (latest < 0)
        ok = 0;
    while (ok && pos < end) {
        if (end - pos < RECORD_HEAD_BYTES) {
            ok = 0;
            break;
        }
        uint32_t size = le32(buf + pos);
        Py_ssize_t key_len = le16(buf + pos + 4), props_len = le16(buf + pos + 6);
        if ((uint64_t)size > (uint64_t)(end - pos - 4) || (Py_ssize_t)size < 4 + key_len + props_len) {
            ok = 0;
            break;
        }
        Py_ssize_t p0 = pos + RECORD_HEAD_BYTES + key_len, props_end = p0 + props_len;
        if (props_len < name.len + 2 || memcmp(buf + p0, name.buf, (size_t)name.len) != 0) {
            ok = 0;
            break;
        }
        Py_ssize_t vat = p0 + name.len, vlen = le16(buf + vat), tat = vat + 2 + vlen;
        uint64_t at;
        if (tat > props_end || !parse_digits(buf + vat + 2, vlen, &at) || at > (uint64_t)latest ||
            tat + target.len > props_end || memcmp(buf + tat, target.buf, (size_t)target.len) != 0) {
            ok = 0;
            break;
        }
        pos += 4 + (Py_ssize_t)size;
    }
    PyBuffer_Release(&rec);
    PyBuffer_Release(&name);
    PyBuffer_Release(&target);
    return PyBool_FromLong(ok);
}

/* leading_ints(batch, start, end, name, skip, count) -> (positions, values) or None
 *
 * timer_props._leading_ints for a batch read back from the log: in every record from ``start`` to
 * ``end``, skip ``skip`` properties, expect property ``name`` and read its value as an integer.
 * None when anything is not as the log's writers make it (a record out of bounds, another name,
 * a value that is not 1-19 digits below 2^63, a record count other than ``count``): the caller runs
 * the Python walk, which raises or parses with the exact rules. */
static PyObject *leading_ints(PyObject *self, PyObject *args) {
    Py_buffer view, name;
    Py_ssize_t start, end, skip, count, i = 0;
    PyObject *positions = NULL, *values = NULL, *result = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*nny*nn:leading_ints", &view, &start, &end, &name, &skip, &count))
        return NULL;
    const unsigned char *buf = (const unsigned char *)view.buf;
    if (start < 0 || end > view.len || start > end || skip < 0 || count < 0 || count > (end - start) / RECORD_HEAD_BYTES + 1)
        goto fallback;
    positions = PyList_New(count);
    values = PyList_New(count);
    if (positions == NULL || values == NULL)
        goto error;
    Py_ssize_t pos = start;
    while (pos < end) {
        if (end - pos < RECORD_HEAD_BYTES || i == count)
            goto fallback;
        uint32_t size = le32(buf + pos);
        if ((uint64_t)size > (uint64_t)(end - pos - 4))
            goto fallback;
        Py_ssize_t record_end = pos + 4 + (Py_ssize_t)size;
        Py_ssize_t p = pos + RECORD_HEAD_BYTES + le16(buf + pos + 4);
        for (Py_ssize_t k = 0; k < skip; k++) { /* a property: u16 name length, name, u16 value length, value */
            if (p + 2 > record_end)
                goto fallback;
            p += 2 + le16(buf + p);
            if (p + 2 > record_end)
                goto fallback;
            p += 2 + le16(buf + p);
        }
        if (p + name.len + 2 > record_end || memcmp(buf + p, name.buf, (size_t)name.len) != 0)
            goto fallback;
        Py_ssize_t vlen = le16(buf + p + name.len);
        uint64_t v;
        if (p + name.len + 2 + vlen > record_end || !parse_digits(buf + p + name.len + 2, vlen, &v) || v > (uint64_t)INT64_MAX)
            goto fallback;
        PyObject *po = PyLong_FromSsize_t(pos), *vo = PyLong_FromLongLong((long long)v);
        if (po == NULL || vo == NULL) {
            Py_XDECREF(po);
            Py_XDECREF(vo);
            goto error;
        }
        PyList_SET_ITEM(positions, i, po);
        PyList_SET_ITEM(values, i, vo);
        i++;
        pos = record_end;
    }
    if (i != count)
        goto fallback;
    result = PyTuple_Pack(2, positions, values);
    goto done;
fallback:
    result = Py_None;
    Py_INCREF(result);
    goto done;
error:
    result = NULL;
done:
    Py_XDECREF(positions);
    Py_XDECREF(values);
    PyBuffer_Release(&view);
    PyBuffer_Release(&name);
    return result;
}

/* encode_records(items) -> (records, positions) or None
 *
 * batch._encode_records_py for a list of (body, key, props) triples of bytes: the records (each
 * u32 record_bytes | u16 key_len | u16 props_len | key | props | body) in one bytes object, and
 * each record's start. One pass sums the sizes, one copies: no object per record but its
 * position. None for anything else (a sequence that is not a list or tuple, an item that is not a
 * 3-tuple of exact bytes, a key or props of 65,536 bytes or more, a record of 4 GiB or more): the
 * Python twin encodes it, or raises the error it always did. */
static PyObject *encode_records(PyObject *self, PyObject *items) {
    (void)self;
    if (!PyList_CheckExact(items) && !PyTuple_CheckExact(items))
        Py_RETURN_NONE;
    PyObject *seq = PySequence_Fast(items, "items");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    /* Allocated before ``item`` is read: a list is tracked by the garbage collector, and a
     * collection (finalizers run Python code) could change ``items`` under the two passes. Nothing
     * allocated after this point is tracked (bytes, ints). */
    PyObject *positions = PyList_New(n);
    if (positions == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    PyObject **item = PySequence_Fast_ITEMS(seq);
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = item[i];
        if (!PyTuple_CheckExact(t) || PyTuple_GET_SIZE(t) != 3)
            goto fallback;
        PyObject *body = PyTuple_GET_ITEM(t, 0), *key = PyTuple_GET_ITEM(t, 1), *props = PyTuple_GET_ITEM(t, 2);
        if (!PyBytes_CheckExact(body) || !PyBytes_CheckExact(key) || !PyBytes_CheckExact(props))
            goto fallback;
        Py_ssize_t klen = PyBytes_GET_SIZE(key), plen = PyBytes_GET_SIZE(props), blen = PyBytes_GET_SIZE(body);
        if (klen > 0xFFFF || plen > 0xFFFF || (uint64_t)blen > (uint64_t)0xFFFFFFFFu - 4 - (uint64_t)(klen + plen))
            goto fallback;
        Py_ssize_t record = RECORD_HEAD_BYTES + klen + plen + blen;
        if (total > PY_SSIZE_T_MAX - record)
            goto fallback;
        total += record;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, total);
    if (out == NULL) {
        Py_DECREF(positions);
        Py_DECREF(seq);
        return NULL;
    }
    unsigned char *w = (unsigned char *)PyBytes_AS_STRING(out);
    Py_ssize_t pos = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = item[i];
        PyObject *body = PyTuple_GET_ITEM(t, 0), *key = PyTuple_GET_ITEM(t, 1), *props = PyTuple_GET_ITEM(t, 2);
        Py_ssize_t klen = PyBytes_GET_SIZE(key), plen = PyBytes_GET_SIZE(props), blen = PyBytes_GET_SIZE(body);
        PyObject *po = PyLong_FromSsize_t(pos);
        if (po == NULL) {
            Py_DECREF(out);
            Py_DECREF(positions);
            Py_DECREF(seq);
            return NULL;
        }
        PyList_SET_ITEM(positions, i, po);
        uint32_t size = (uint32_t)(4 + klen + plen + blen);
        unsigned char *h = w + pos;
        h[0] = (unsigned char)size;
        h[1] = (unsigned char)(size >> 8);
        h[2] = (unsigned char)(size >> 16);
        h[3] = (unsigned char)(size >> 24);
        h[4] = (unsigned char)klen;
        h[5] = (unsigned char)(klen >> 8);
        h[6] = (unsigned char)plen;
        h[7] = (unsigned char)(plen >> 8);
        pos += RECORD_HEAD_BYTES;
        memcpy(w + pos, PyBytes_AS_STRING(key), (size_t)klen);
        pos += klen;
        memcpy(w + pos, PyBytes_AS_STRING(props), (size_t)plen);
        pos += plen;
        memcpy(w + pos, PyBytes_AS_STRING(body), (size_t)blen);
        pos += blen;
    }
    Py_DECREF(seq);
    PyObject *result = PyTuple_Pack(2, out, positions);
    Py_DECREF(out);
    Py_DECREF(positions);
    return result;
fallback:
    Py_DECREF(positions);
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

/* gather(blob, positions, piece, out, out_at) -> int
 *
 * Copies one piece of each record at ``positions`` (a contiguous buffer of native int64, each a
 * record's start in ``blob``) back to back into the writable ``out`` from byte ``out_at``, and
 * returns where the copies ended. ``piece`` is 0 for the key, 1 for the properties, 2 for the
 * body. The columnar reader's gather (spark_connector/decode.py): one pass and one copy per
 * piece instead of Arrow's ``take`` and a concatenation. Its twin is that path, kept in Python.
 * Nothing is trusted: a position outside ``blob``, a record head whose key and properties do not
 * fit its length, a record that ends past ``blob`` or pieces that do not fit in ``out`` raise
 * ValueError (``out`` may then hold the pieces before the bad record). Each position is read with
 * memcpy (no alignment assumption; native byte order, as numpy's int64 writes it), and pieces
 * are copied with memmove, so even an ``out`` that overlaps ``blob`` is defined behaviour. */
static PyObject *gather(PyObject *self, PyObject *args) {
    Py_buffer blob, positions, out;
    int piece;
    Py_ssize_t at;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*iw*n:gather", &blob, &positions, &piece, &out, &at))
        return NULL;
    const char *error = NULL;
    Py_ssize_t bad = -1;
    Py_ssize_t n = positions.len / (Py_ssize_t)sizeof(int64_t);
    if (piece < 0 || piece > 2 || positions.len % (Py_ssize_t)sizeof(int64_t) != 0 || at < 0 || at > out.len) {
        error = piece < 0 || piece > 2 ? "gather: piece must be 0, 1 or 2"
                : at < 0 || at > out.len ? "gather: out_at outside the output"
                : "gather: positions must be whole int64 values";
        goto done;
    }
    const unsigned char *buf = (const unsigned char *)blob.buf;
    const unsigned char *pos = (const unsigned char *)positions.buf;
    unsigned char *w = (unsigned char *)out.buf;
    PyThreadState *state = NULL;
    if (blob.len >= RELEASE_LOCK_BYTES) /* what this call may copy is at most the blob */
        state = PyEval_SaveThread();
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t p;
        memcpy(&p, pos + i * (Py_ssize_t)sizeof(int64_t), sizeof p);
        if (p < 0 || p > (int64_t)blob.len - RECORD_HEAD_BYTES) {
            error = "gather: a record position outside the pulled bytes";
            bad = i;
            break;
        }
        uint64_t size = le32(buf + p), klen = le16(buf + p + 4), plen = le16(buf + p + 6);
        if (size < 4 + klen + plen || (uint64_t)p + 4 + size > (uint64_t)blob.len) {
            error = "gather: a record whose length does not hold its key and properties, or that ends past the pulled bytes";
            bad = i;
            break;
        }
        uint64_t start = (uint64_t)p + RECORD_HEAD_BYTES, len = klen;
        if (piece >= 1) {
            start += klen;
            len = plen;
        }
        if (piece == 2) {
            start += plen;
            len = size - 4 - klen - plen;
        }
        if (len > (uint64_t)(out.len - at)) {
            error = "gather: the gathered pieces do not fit in the output";
            bad = i;
            break;
        }
        memmove(w + at, buf + start, (size_t)len);
        at += (Py_ssize_t)len;
    }
    if (state != NULL)
        PyEval_RestoreThread(state);
done:
    PyBuffer_Release(&blob);
    PyBuffer_Release(&positions);
    PyBuffer_Release(&out);
    if (error != NULL) {
        if (bad >= 0)
            PyErr_Format(PyExc_ValueError, "%s (record %zd)", error, bad);
        else
            PyErr_SetString(PyExc_ValueError, error);
        return NULL;
    }
    return PyLong_FromSsize_t(at);
}

/* span(batch, start, end, skip, count) -> (begin, stop) | None
 *
 * batch.record_span: where record ``skip`` (0-based) of ``batch[start:end]`` (a batch's records)
 * begins and where the ``count`` records from it end, as positions in ``batch``. None when the
 * framing does not hold that many records (a record without its head, or ending past ``end``). */
static PyObject *span(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t start, end, skip, count;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*nnnn:span", &view, &start, &end, &skip, &count))
        return NULL;
    const unsigned char *buf = (const unsigned char *)view.buf;
    PyObject *result = Py_None;
    /* at most one record per RECORD_HEAD_BYTES: no larger skip or count can be met (nor overflow) */
    Py_ssize_t most = (end - start) / RECORD_HEAD_BYTES + 1;
    if (start >= 0 && end <= view.len && start <= end && skip >= 0 && count >= 0 && skip <= most && count <= most) {
        Py_ssize_t pos = start, begin = -1, i = 0, total = skip + count;
        while (i < total) {
            if (i == skip)
                begin = pos;
            if (end - pos < RECORD_HEAD_BYTES)
                break;
            uint32_t size = le32(buf + pos);
            if (size < 4 + le16(buf + pos + 4) + le16(buf + pos + 6) || (uint64_t)size > (uint64_t)(end - pos - 4))
                break;
            pos += 4 + (Py_ssize_t)size;
            i++;
        }
        if (i == total) {
            if (begin < 0) /* count == 0 */
                begin = pos;
            result = Py_BuildValue("(nn)", begin, pos);
            PyBuffer_Release(&view);
            return result;
        }
    }
    PyBuffer_Release(&view);
    Py_INCREF(result);
    return result;
}

static PyMethodDef methods[] = {
    {"check", check, METH_VARARGS, "check(records, expected_count): raise ValueError on bad record framing."},
    {"check_contents", check_contents, METH_VARARGS, "check_contents(records, leading_reserved): raise ValueError on a "
     "key or property that is not UTF-8, malformed properties or a reserved name."},
    {"scheduled_ok", scheduled_ok, METH_VARARGS, "scheduled_ok(records, name, target, latest_ms) -> bool."},
    {"leading_ints", leading_ints, METH_VARARGS, "leading_ints(batch, start, end, name, skip, count) -> (positions, values) | None."},
    {"encode_records", encode_records, METH_O, "encode_records(items) -> (records, positions) | None."},
    {"span", span, METH_VARARGS, "span(batch, start, end, skip, count) -> (begin, stop) | None: a run of records' bytes."},
    {"gather", gather, METH_VARARGS, "gather(blob, positions, piece, out, out_at) -> end: one piece of each record, back to back."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_framing",
    .m_doc = "Record framing walk in C.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__framing(void) { return PyModule_Create(&module); }
