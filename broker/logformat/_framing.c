/* The record framing walk of a send, in C (issue 18: the Python loop was 14% of the event loop's
 * time at 1,000 records per send).
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

#define RECORD_HEAD_BYTES 8
/* Above this size the walk lets other threads run (it holds the buffer, not Python objects).
 * Below it, giving the interpreter lock up would cost more than the walk: getting it back can wait a
 * switch interval behind another thread. */
#define RELEASE_LOCK_BYTES (4 * 1024 * 1024)

enum outcome { WALK_OK, WALK_MORE, WALK_TRUNCATED, WALK_BAD_LENGTH, WALK_FEWER };

struct walk {
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

static PyObject *check(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t expected;
    struct walk w;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*n:check", &view, &expected))
        return NULL;
    if (view.len >= RELEASE_LOCK_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        walk_records((const unsigned char *)view.buf, view.len, expected, &w);
        Py_END_ALLOW_THREADS
    } else {
        walk_records((const unsigned char *)view.buf, view.len, expected, &w);
    }
    PyBuffer_Release(&view);
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

static PyMethodDef methods[] = {
    {"check", check, METH_VARARGS, "check(records, expected_count): raise ValueError on bad record framing."},
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
