/* Plain messages (DESIGN §13) in C: what a client that knows only the proto sends and reads, at the
 * cost of our own client's fast path (issue 40: in Python, 5.7 us a message to encode a send and
 * 1 us to build its receipts; the decoded pull likewise). Each function is the twin of a Python
 * path in broker/daemon/plain.py that stays the reference: it takes the common case and answers
 * None for anything else, and the Python path then answers exactly as it always did (its errors
 * included). Parity tests: tests/test_plain_native.py.
 *
 * Protobuf wire (the encoding spec): a field is a varint tag (number << 3 | wire type), then a
 * varint (type 0), 8 bytes (1), a varint length and that many bytes (2) or 4 bytes (5); varints
 * are little-endian base 128, at most 10 bytes. Records (docs/formats/commitlog.md):
 *
 *     u32 record_bytes (after this field) | u16 key_len | u16 props_len | key | props | body
 *     props = repeated (u16 name_len | name | u16 value_len | value)
 *
 * encode_plain(request, queues_of, rotation, producer_id, yield_every) -> (groups, layout) | None
 *
 *     ``request``: the wire bytes of a SendRequest the protobuf parser accepted (so every string
 *     is UTF-8). Its plain messages (field 4) framed into records, one group per (topic, queue)
 *     in the order first met: ``groups`` a list of (topic, queue_id, records, count,
 *     base_sequence) and ``layout`` bytes of three native int64 per message in request order
 *     (its group, its rank in the group, its record's position in the group's records), which
 *     ``receipts`` reads. Queue choice as plain.encode: queue_id if set, else
 *     ``crc32c(key) % queues`` (``key_crc32c``), else one queue per topic (``rotation`` plus the number of
 *     such messages before the topic's first one).
 *     None (plain.encode decides) for: a timer message or a negative deliver_at_ms, a topic of
 *     the broker's ("__"), one ``queues_of`` does not know or a queue out of its range, a key or
 *     properties too large for a record, a property name of the broker's or given twice, more
 *     than TOPICS_MAX topics, an idempotent send (``producer_id``) whose messages do not each
 *     name a queue and a sequence following the previous one of its queue, anything unexpected.
 *     Every ``yield_every`` messages (0: never) it lets other threads take the interpreter lock.
 *
 * key_crc32c(key) -> int
 *
 *     The CRC32C of ``key``, as the crc32c library computes it (tests/test_plain_native.py compares
 *     them): the hash that places a keyed message. Byte by byte from a table, in C: keys are short,
 *     and a call into the library per key cost 0.2 us of Python call (two thirds of encode_plain's
 *     time for 1,000 keyed messages of 1 KiB).
 *
 * split_plain(request) -> (rest, count) | None
 *
 *     A SendRequest's plain messages checked as the protobuf parser would check them, without
 *     parsing them: ``count`` of them (field 4), and ``rest`` the request's other fields, byte
 *     for byte, for the parser (a 1 MiB request of 1,000 messages took the parser 0.35-1 ms,
 *     most of it copying the bodies into fresh memory). Each message's fields: topic and key
 *     strings in UTF-8, queue_id, deliver_at_ms and sequence varints, body bytes, properties map
 *     entries of two UTF-8 strings. None (the parser reads it all) for anything else: a field or
 *     wire type not in that list, a tag or length longer than 5 bytes, a varint past 64 bits,
 *     a field running past its message. So whatever it answers, the parser accepts.
 *
 * receipts(layout, groups) -> bytes
 *
 *     The SendResponse field ``message_receipts`` (number 2), one MessageReceipt per message in
 *     request order, as protobuf serialises them (fields in number order, zeros left out);
 *     ``groups``: per group (topic as bytes, queue_id, base_queue_offset, records_at, duplicate),
 *     ``records_at`` the commit offset of its first record. Parsers take fields in any order, so
 *     the bytes follow the rest of the response (wire.py does the same for pulls).
 *
 * decode_pulled(batches, skip_first, count, head) -> bytes | None
 *
 *     ``head`` (the response's other fields, serialised) followed by the PullResponse field
 *     ``messages`` (number 7): the ``count`` records after the first
 *     ``skip_first`` of ``batches`` (whole batches back to back) as PulledMessages, with the
 *     timer fields ``__deliver_at_ms`` and ``__timer_offset`` read into their own fields and the
 *     four timer properties left out of ``properties``. None (plain.decode decides, leniently)
 *     for a batch or record whose framing does not hold, a key or property that is not UTF-8,
 *     properties that do not fill their length, a timer field of more than 19 digits or past
 *     int64, a store time past int64. From RELEASE_LOCK_BYTES of batches on, it walks and
 *     copies without the interpreter lock.
 *
 * popped(batches, skip_first, count, queue_id, delivery_count, lease, topic, decode) -> bytes | None
 *
 *     The PopResponse field ``messages`` (number 1) for one leased run: each message with its
 *     run's queue and delivery count, the batch's commit offset and its own receipt handle
 *     (``lease.<offset in hex>.topic``), and either its encoded record or (``decode``) its key,
 *     body, properties and timer fields as ``decode_pulled`` reads them; None as it says.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_utf8.h"

#define RECORD_HEAD_BYTES 8
#define BATCH_HEADER_BYTES 64
#define KEY_BYTES_MAX 0xFFFF
#define PROPS_BYTES_MAX 0xFFFF
#define TOPICS_MAX 16          /* distinct topics of one request taken here */
#define PROPS_MAX 64           /* properties of one message taken here */
#define DIGITS_MAX 19
/* As _framing.c: above this many bytes a walk lets other threads run; below it the hand-over
 * would cost more than the walk. */
#define RELEASE_LOCK_BYTES (4 * 1024 * 1024)

enum { VARINT = 0, I64 = 1, LEN = 2, I32 = 5 };

/* ---- reading the wire ---- */

static int read_varint(const unsigned char *b, Py_ssize_t *pos, Py_ssize_t end, uint64_t *out) {
    uint64_t v = 0;
    for (int shift = 0; shift < 70 && *pos < end; shift += 7) {
        unsigned char c = b[(*pos)++];
        v |= (uint64_t)(c & 0x7F) << shift;
        if (!(c & 0x80)) {
            *out = v;
            return 1;
        }
    }
    return 0;
}

struct field {
    uint32_t number;
    int wire;
    uint64_t value;  /* a varint's */
    Py_ssize_t a, z; /* a length-delimited field's bytes */
};

/* The field at *pos (before ``end``) into *f. 0 for what this reader does not take (groups, a
 * field running past ``end``). */
static int next_field(const unsigned char *b, Py_ssize_t *pos, Py_ssize_t end, struct field *f) {
    uint64_t tag;
    if (!read_varint(b, pos, end, &tag) || (tag >> 3) == 0 || (tag >> 3) > 0x1FFFFFFF)
        return 0;
    f->number = (uint32_t)(tag >> 3);
    f->wire = (int)(tag & 7);
    switch (f->wire) {
    case VARINT:
        return read_varint(b, pos, end, &f->value);
    case I64:
        if (end - *pos < 8)
            return 0;
        *pos += 8;
        return 1;
    case I32:
        if (end - *pos < 4)
            return 0;
        *pos += 4;
        return 1;
    case LEN: {
        uint64_t n;
        if (!read_varint(b, pos, end, &n) || n > (uint64_t)(end - *pos))
            return 0;
        f->a = *pos;
        f->z = *pos + (Py_ssize_t)n;
        *pos = f->z;
        return 1;
    }
    default:
        return 0;
    }
}

/* ---- writing the wire: each writer returns the bytes it takes and writes only when w is set ---- */

static Py_ssize_t put_varint(unsigned char *w, uint64_t v) {
    Py_ssize_t n = 0;
    do {
        unsigned char c = (unsigned char)(v & 0x7F);
        v >>= 7;
        if (v)
            c |= 0x80;
        if (w)
            w[n] = c;
        n++;
    } while (v);
    return n;
}

static Py_ssize_t put_uint_field(unsigned char *w, unsigned char tag, uint64_t v) {
    if (v == 0)
        return 0;
    if (w)
        w[0] = tag;
    return 1 + put_varint(w ? w + 1 : NULL, v);
}

static Py_ssize_t put_bytes_field(unsigned char *w, unsigned char tag, const unsigned char *s, Py_ssize_t n,
                                  int keep_empty) {
    if (n == 0 && !keep_empty)
        return 0;
    if (w)
        w[0] = tag;
    Py_ssize_t at = 1 + put_varint(w ? w + 1 : NULL, (uint64_t)n);
    if (w)
        memcpy(w + at, s, (size_t)n);
    return at + n;
}

static void put_le16(unsigned char *w, uint32_t v) {
    w[0] = (unsigned char)v;
    w[1] = (unsigned char)(v >> 8);
}

static uint32_t le16(const unsigned char *p) { return (uint32_t)p[0] | ((uint32_t)p[1] << 8); }

static uint32_t le32(const unsigned char *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static uint64_t le64(const unsigned char *p) { return (uint64_t)le32(p) | ((uint64_t)le32(p + 4) << 32); }

/* ---- encode_plain ---- */

struct prop {
    Py_ssize_t name_at, name_len, value_at, value_len;
};

struct message {
    Py_ssize_t group, rank, position;
    Py_ssize_t at, end; /* its bytes in the request, walked again for its properties */
    Py_ssize_t key_at, key_len, body_at, body_len, props_bytes;
};

struct topic {
    Py_ssize_t at, len; /* its name in the request */
    PyObject *name;     /* str */
    Py_ssize_t queues;
    Py_ssize_t *group_of; /* per queue: its group, or -1 */
    Py_ssize_t keyless;   /* the queue of its messages with neither queue_id nor key, or -1 */
};

struct group {
    Py_ssize_t topic, queue, count, bytes;
    int64_t first_sequence;
    uint64_t last_sequence; /* an idempotent group's (sequences are >= 0) */
    PyObject *records;
};

struct encoding {
    const unsigned char *b;
    struct topic topics[TOPICS_MAX];
    Py_ssize_t ntopics;
    struct group *groups;
    Py_ssize_t ngroups, groups_cap;
    struct message *messages;
    Py_ssize_t nmessages, messages_cap;
    long rotation; /* the next keyless topic's queue, before % its queues */
    Py_ssize_t yield_every; /* messages between two hand-overs of the interpreter lock (0: never) */
};

/* A long encode in a pool thread lets the event loop and the flusher in now and then (as
 * plain._maybe_yield does for the Python path): nothing here touches a Python object meanwhile. */
static void maybe_yield(const struct encoding *e, Py_ssize_t done) {
    if (e->yield_every > 0 && done % e->yield_every == e->yield_every - 1) {
        Py_BEGIN_ALLOW_THREADS
        Py_END_ALLOW_THREADS
    }
}

/* The properties (map entries, field 5) of the message in [at, end): each name and value, last
 * occurrence of a field winning as protobuf's does. -1: not taken here (too many, a name given
 * twice or of the broker's, an entry with another field or malformed). Else how many. */
static Py_ssize_t message_props(const unsigned char *b, Py_ssize_t at, Py_ssize_t end, struct prop *props) {
    Py_ssize_t n = 0, pos = at;
    while (pos < end) {
        struct field f;
        if (!next_field(b, &pos, end, &f))
            return -1;
        if (f.number != 5)
            continue;
        if (f.wire != LEN || n == PROPS_MAX)
            return -1;
        struct prop p = {f.a, 0, f.a, 0};
        for (Py_ssize_t e = f.a; e < f.z;) {
            struct field ef;
            if (!next_field(b, &e, f.z, &ef))
                return -1;
            /* an entry with any other field is not in protobuf's map (upb keeps it as unknown) */
            if ((ef.number != 1 && ef.number != 2) || ef.wire != LEN)
                return -1;
            if (ef.number == 1) {
                p.name_at = ef.a;
                p.name_len = ef.z - ef.a;
            } else {
                p.value_at = ef.a;
                p.value_len = ef.z - ef.a;
            }
        }
        if (p.name_len >= 2 && b[p.name_at] == '_' && b[p.name_at + 1] == '_')
            return -1;
        for (Py_ssize_t i = 0; i < n; i++)
            if (props[i].name_len == p.name_len && memcmp(b + props[i].name_at, b + p.name_at, (size_t)p.name_len) == 0)
                return -1;
        props[n++] = p;
    }
    return n;
}

static Py_ssize_t write_props(const unsigned char *b, const struct prop *props, Py_ssize_t n, unsigned char *w) {
    Py_ssize_t at = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        put_le16(w + at, (uint32_t)props[i].name_len);
        memcpy(w + at + 2, b + props[i].name_at, (size_t)props[i].name_len);
        at += 2 + props[i].name_len;
        put_le16(w + at, (uint32_t)props[i].value_len);
        memcpy(w + at + 2, b + props[i].value_at, (size_t)props[i].value_len);
        at += 2 + props[i].value_len;
    }
    return at;
}

static void free_encoding(struct encoding *e) {
    for (Py_ssize_t i = 0; i < e->ntopics; i++) {
        Py_XDECREF(e->topics[i].name);
        free(e->topics[i].group_of);
    }
    for (Py_ssize_t i = 0; i < e->ngroups; i++)
        Py_XDECREF(e->groups[i].records);
    free(e->groups);
    free(e->messages);
}

/* The topic named by [at, at + len): its index, -1 on a Python error, -2 for not taken here. */
static Py_ssize_t find_topic(struct encoding *e, Py_ssize_t at, Py_ssize_t len, PyObject *queues_of) {
    for (Py_ssize_t i = 0; i < e->ntopics; i++)
        if (e->topics[i].len == len && memcmp(e->b + e->topics[i].at, e->b + at, (size_t)len) == 0)
            return i;
    if (e->ntopics == TOPICS_MAX || (len >= 2 && e->b[at] == '_' && e->b[at + 1] == '_'))
        return -2;
    PyObject *name = PyUnicode_DecodeUTF8((const char *)e->b + at, len, NULL);
    if (name == NULL)
        return -1;
    PyObject *queues = PyObject_CallOneArg(queues_of, name);
    if (queues == NULL) {
        Py_DECREF(name);
        return -1;
    }
    Py_ssize_t count = queues == Py_None ? -1 : PyLong_AsSsize_t(queues);
    Py_DECREF(queues);
    if (count == -1 && PyErr_Occurred()) {
        Py_DECREF(name);
        return -1;
    }
    if (count <= 0 || count > 0x10000) {
        Py_DECREF(name);
        return -2;
    }
    struct topic *t = &e->topics[e->ntopics];
    t->group_of = malloc(sizeof(Py_ssize_t) * (size_t)count);
    if (t->group_of == NULL) {
        Py_DECREF(name);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t q = 0; q < count; q++)
        t->group_of[q] = -1;
    t->at = at;
    t->len = len;
    t->name = name;
    t->queues = count;
    t->keyless = -1;
    return e->ntopics++;
}

static int grow(void **items, Py_ssize_t *cap, Py_ssize_t need, size_t size) {
    if (need <= *cap)
        return 1;
    Py_ssize_t next = *cap ? *cap * 2 : 16;
    while (next < need)
        next *= 2;
    void *more = realloc(*items, (size_t)next * size);
    if (more == NULL) {
        PyErr_NoMemory();
        return 0;
    }
    *items = more;
    *cap = next;
    return 1;
}

static uint32_t crc32c_table[256]; /* CRC32C (Castagnoli, reflected 0x82F63B78), one byte at a time */

static void crc32c_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        crc32c_table[i] = c;
    }
}

static uint32_t crc32c_of(const unsigned char *p, Py_ssize_t n) {
    uint32_t c = 0xFFFFFFFFu;
    for (Py_ssize_t i = 0; i < n; i++)
        c = crc32c_table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

/* 1: taken; 0: not taken here (None); -1: a Python error. */
static int take_message(struct encoding *e, Py_ssize_t at, Py_ssize_t end, PyObject *queues_of, int idempotent) {
    const unsigned char *b = e->b;
    Py_ssize_t topic_at = at, topic_len = 0, key_at = at, key_len = 0, body_at = at, body_len = 0;
    int has_queue = 0, has_sequence = 0;
    uint64_t queue_id = 0, deliver_at = 0, sequence = 0;
    Py_ssize_t pos = at;
    while (pos < end) {
        struct field f;
        if (!next_field(b, &pos, end, &f))
            return 0;
        int want_len = f.number == 1 || f.number == 3 || f.number == 4 || f.number == 5;
        int want_varint = f.number == 2 || f.number == 6 || f.number == 7;
        if ((want_len && f.wire != LEN) || (want_varint && f.wire != VARINT))
            return 0;
        switch (f.number) {
        case 1: topic_at = f.a; topic_len = f.z - f.a; break;
        case 2: has_queue = 1; queue_id = f.value & 0xFFFFFFFFu; break;
        case 3: key_at = f.a; key_len = f.z - f.a; break;
        case 4: body_at = f.a; body_len = f.z - f.a; break;
        case 6: deliver_at = f.value; break;
        case 7: has_sequence = 1; sequence = f.value; break;
        default: break; /* properties are walked below; unknown fields are ignored, as protobuf's are */
        }
    }
    if (deliver_at != 0 || key_len > KEY_BYTES_MAX)
        return 0;
    struct prop props[PROPS_MAX];
    Py_ssize_t nprops = message_props(b, at, end, props);
    if (nprops < 0)
        return 0;
    Py_ssize_t props_bytes = 0;
    for (Py_ssize_t i = 0; i < nprops; i++)
        props_bytes += 4 + props[i].name_len + props[i].value_len;
    if (props_bytes > PROPS_BYTES_MAX)
        return 0;
    Py_ssize_t ti = find_topic(e, topic_at, topic_len, queues_of);
    if (ti < 0)
        return ti == -1 ? -1 : 0;
    struct topic *t = &e->topics[ti];
    Py_ssize_t q;
    if (has_queue) {
        if (queue_id >= (uint64_t)t->queues)
            return 0;
        q = (Py_ssize_t)queue_id;
    } else if (key_len > 0) {
        q = (Py_ssize_t)(crc32c_of(b + key_at, key_len) % (uint32_t)t->queues);
    } else {
        /* as plain.encode: every keyless message takes a turn, a topic's first one its queue */
        unsigned long turn = (unsigned long)e->rotation++;
        if (t->keyless < 0)
            t->keyless = (Py_ssize_t)(turn % (unsigned long)t->queues);
        q = t->keyless;
    }
    if (idempotent && (!has_queue || !has_sequence || (int64_t)sequence < 0))
        return 0;
    Py_ssize_t gi = t->group_of[q];
    if (gi < 0) {
        if (!grow((void **)&e->groups, &e->groups_cap, e->ngroups + 1, sizeof(struct group)))
            return -1;
        gi = e->ngroups++;
        struct group *g = &e->groups[gi];
        memset(g, 0, sizeof(*g));
        g->topic = ti;
        g->queue = q;
        g->first_sequence = idempotent ? (int64_t)sequence : -1;
        g->last_sequence = sequence - 1; /* unsigned: wraps, defined */
        t->group_of[q] = gi;
    }
    struct group *g = &e->groups[gi];
    if (idempotent && sequence != g->last_sequence + 1)
        return 0;
    g->last_sequence = sequence;
    Py_ssize_t record = RECORD_HEAD_BYTES + key_len + props_bytes + body_len;
    if ((uint64_t)record - 4 > 0xFFFFFFFFu || g->bytes > PY_SSIZE_T_MAX - record)
        return 0;
    if (!grow((void **)&e->messages, &e->messages_cap, e->nmessages + 1, sizeof(struct message)))
        return -1;
    struct message *m = &e->messages[e->nmessages++];
    m->group = gi;
    m->rank = g->count++;
    m->position = g->bytes;
    m->at = at;
    m->end = end;
    m->key_at = key_at;
    m->key_len = key_len;
    m->body_at = body_at;
    m->body_len = body_len;
    m->props_bytes = props_bytes;
    g->bytes += record;
    return 1;
}

static int write_records(struct encoding *e) {
    for (Py_ssize_t i = 0; i < e->ngroups; i++) {
        e->groups[i].records = PyBytes_FromStringAndSize(NULL, e->groups[i].bytes);
        if (e->groups[i].records == NULL)
            return 0;
    }
    struct prop props[PROPS_MAX];
    for (Py_ssize_t i = 0; i < e->nmessages; i++) {
        maybe_yield(e, i);
        struct message *m = &e->messages[i];
        struct group *g = &e->groups[m->group];
        unsigned char *w = (unsigned char *)PyBytes_AS_STRING(g->records) + m->position;
        uint32_t size = (uint32_t)(4 + m->key_len + m->props_bytes + m->body_len);
        w[0] = (unsigned char)size;
        w[1] = (unsigned char)(size >> 8);
        w[2] = (unsigned char)(size >> 16);
        w[3] = (unsigned char)(size >> 24);
        put_le16(w + 4, (uint32_t)m->key_len);
        put_le16(w + 6, (uint32_t)m->props_bytes);
        w += RECORD_HEAD_BYTES;
        memcpy(w, e->b + m->key_at, (size_t)m->key_len);
        w += m->key_len;
        if (m->props_bytes) {
            Py_ssize_t n = message_props(e->b, m->at, m->end, props);
            w += write_props(e->b, props, n, w);
        }
        memcpy(w, e->b + m->body_at, (size_t)m->body_len);
    }
    return 1;
}

static PyObject *encoded_result(struct encoding *e) {
    PyObject *groups = PyList_New(e->ngroups);
    PyObject *layout = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)sizeof(int64_t) * 3 * e->nmessages);
    if (groups == NULL || layout == NULL) {
        Py_XDECREF(groups);
        Py_XDECREF(layout);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < e->ngroups; i++) {
        struct group *g = &e->groups[i];
        PyObject *item = Py_BuildValue("(OnOnL)", e->topics[g->topic].name, g->queue, g->records, g->count,
                                       (long long)g->first_sequence);
        if (item == NULL) {
            Py_DECREF(groups);
            Py_DECREF(layout);
            return NULL;
        }
        PyList_SET_ITEM(groups, i, item);
    }
    int64_t *out = (int64_t *)(void *)PyBytes_AS_STRING(layout);
    for (Py_ssize_t i = 0; i < e->nmessages; i++) {
        out[3 * i] = e->messages[i].group;
        out[3 * i + 1] = e->messages[i].rank;
        out[3 * i + 2] = e->messages[i].position;
    }
    PyObject *result = PyTuple_Pack(2, groups, layout);
    Py_DECREF(groups);
    Py_DECREF(layout);
    return result;
}

static PyObject *encode_plain(PyObject *self, PyObject *args) {
    Py_buffer request;
    PyObject *queues_of;
    long rotation;
    unsigned long long producer_id;
    Py_ssize_t yield_every;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*OlKn:encode_plain", &request, &queues_of, &rotation, &producer_id, &yield_every))
        return NULL;
    struct encoding e;
    memset(&e, 0, sizeof(e));
    e.b = (const unsigned char *)request.buf;
    e.rotation = rotation;
    e.yield_every = yield_every;
    PyObject *result = NULL;
    int taken = 1;
    Py_ssize_t pos = 0, end = request.len;
    while (pos < end && taken == 1) {
        struct field f;
        if (!next_field(e.b, &pos, end, &f)) {
            taken = 0;
            break;
        }
        if (f.number == 4) {
            maybe_yield(&e, e.nmessages);
            taken = f.wire == LEN ? take_message(&e, f.a, f.z, queues_of, producer_id != 0) : 0;
        }
    }
    if (taken == 1 && e.nmessages > 0) {
        if (write_records(&e))
            result = encoded_result(&e);
    } else if (taken != -1) {
        result = Py_NewRef(Py_None);
    }
    free_encoding(&e);
    PyBuffer_Release(&request);
    return result;
}

/* ---- receipts ---- */

struct receipt_group {
    const unsigned char *topic;
    Py_ssize_t topic_len;
    uint64_t queue_id, base_queue_offset, records_at;
    int duplicate;
};

static Py_ssize_t put_receipt(unsigned char *w, const struct receipt_group *g, int64_t rank, int64_t position) {
    unsigned char head[16];
    Py_ssize_t inner = put_bytes_field(NULL, 0x0A, g->topic, g->topic_len, 0) + put_uint_field(NULL, 0x10, g->queue_id) +
                       put_uint_field(NULL, 0x18, g->base_queue_offset + (uint64_t)rank) +
                       put_uint_field(NULL, 0x20, g->records_at + (uint64_t)position) + (g->duplicate ? 2 : 0);
    head[0] = 0x12;
    Py_ssize_t at = 1 + put_varint(head + 1, (uint64_t)inner);
    if (w == NULL)
        return at + inner;
    memcpy(w, head, (size_t)at);
    at += put_bytes_field(w + at, 0x0A, g->topic, g->topic_len, 0);
    at += put_uint_field(w + at, 0x10, g->queue_id);
    at += put_uint_field(w + at, 0x18, g->base_queue_offset + (uint64_t)rank);
    at += put_uint_field(w + at, 0x20, g->records_at + (uint64_t)position);
    if (g->duplicate) {
        w[at++] = 0x28;
        w[at++] = 1;
    }
    return at;
}

static PyObject *receipts(PyObject *self, PyObject *args) {
    Py_buffer layout;
    PyObject *groups;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*O!:receipts", &layout, &PyList_Type, &groups))
        return NULL;
    /* a tuple of its own: converting an item cannot change what the pointers below point into */
    PyObject *held = PyList_AsTuple(groups);
    if (held == NULL) {
        PyBuffer_Release(&layout);
        return NULL;
    }
    Py_ssize_t ngroups = PyTuple_GET_SIZE(held), n = layout.len / (Py_ssize_t)(3 * sizeof(int64_t));
    struct receipt_group *gs = calloc((size_t)(ngroups ? ngroups : 1), sizeof(*gs));
    PyObject *out = NULL;
    if (gs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < ngroups; i++) {
        PyObject *topic;
        unsigned long long queue_id, base, records_at;
        int duplicate;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(held, i), "O!KKKp:receipt group", &PyBytes_Type, &topic, &queue_id,
                              &base, &records_at, &duplicate))
            goto done;
        gs[i].topic = (const unsigned char *)PyBytes_AS_STRING(topic);
        gs[i].topic_len = PyBytes_GET_SIZE(topic);
        gs[i].queue_id = queue_id;
        gs[i].base_queue_offset = base;
        gs[i].records_at = records_at;
        gs[i].duplicate = duplicate;
    }
    const unsigned char *raw = layout.buf;
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t v[3];
        memcpy(v, raw + i * (Py_ssize_t)sizeof(v), sizeof(v));
        if (v[0] < 0 || v[0] >= ngroups) {
            PyErr_SetString(PyExc_ValueError, "receipt layout names a group it was not given");
            goto done;
        }
        total += put_receipt(NULL, &gs[v[0]], v[1], v[2]);
    }
    out = PyBytes_FromStringAndSize(NULL, total);
    if (out == NULL)
        goto done;
    unsigned char *w = (unsigned char *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t v[3];
        memcpy(v, raw + i * (Py_ssize_t)sizeof(v), sizeof(v));
        w += put_receipt(w, &gs[v[0]], v[1], v[2]);
    }
done:
    free(gs);
    Py_DECREF(held);
    PyBuffer_Release(&layout);
    return out;
}

/* ---- decode_pulled ---- */

static const char DELIVER_AT[] = "__deliver_at_ms", TIMER_OFFSET[] = "__timer_offset", TARGET_TOPIC[] = "__topic",
                  TARGET_QUEUE[] = "__queue";

static int named(const unsigned char *s, Py_ssize_t n, const char *name) {
    return n == (Py_ssize_t)strlen(name) && memcmp(s, name, (size_t)n) == 0;
}

/* plain.field_number: 1-19 ASCII digits; 0 (absent) for anything else. */
static uint64_t field_number(const unsigned char *s, Py_ssize_t n) {
    if (s == NULL || n < 1 || n > DIGITS_MAX)
        return 0;
    uint64_t v = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9')
            return 0;
        v = v * 10 + (uint64_t)(s[i] - '0');
    }
    return v;
}

/* The tags (field << 3 | wire type) of a message's fields in its answer; 0: the message has no such field. */
struct shape {
    unsigned char outer; /* the message in its response */
    unsigned char queue_id, queue_offset, commit_offset, store_time, record, handle, delivery, key, body, props,
        deliver_at, timer_offset;
    int batch_commit_offset; /* commit_offset is the batch's (a popped message's), not the record's */
};

/* PullResponse.messages (7): PulledMessage. PopResponse.messages (1): PoppedMessage, decoded or with its record. */
static const struct shape PULLED = {0x3A, 0, 0x08, 0x10, 0x18, 0, 0, 0, 0x22, 0x2A, 0x32, 0x38, 0x40, 0};
static const struct shape POPPED_DECODED = {0x0A, 0x08, 0x10, 0x18, 0x20, 0, 0x32, 0x38, 0x42, 0x4A, 0x52, 0x58, 0x60, 1};
static const struct shape POPPED_RECORD = {0x0A, 0x08, 0x10, 0x18, 0x20, 0x2A, 0x32, 0x38, 0, 0, 0, 0, 0, 1};

/* What a popped message carries beside its record: its run's queue and delivery count, and its
 * receipt handle ``lease.<offset in hex>.topic`` (broker/groups/receipts.py run_handle, one message). */
struct run_extra {
    uint64_t queue_id, delivery_count;
    const unsigned char *lease, *topic;
    Py_ssize_t lease_len, topic_len;
};

static Py_ssize_t put_handle(unsigned char *w, unsigned char tag, const struct run_extra *x, uint64_t offset) {
    char hex[17];
    int digits = snprintf(hex, sizeof(hex), "%llx", (unsigned long long)offset);
    Py_ssize_t n = x->lease_len + 1 + digits + 1 + x->topic_len;
    Py_ssize_t at = 1 + put_varint(w ? w + 1 : NULL, (uint64_t)n);
    if (w == NULL)
        return at + n;
    w[0] = tag;
    memcpy(w + at, x->lease, (size_t)x->lease_len);
    at += x->lease_len;
    w[at++] = '.';
    memcpy(w + at, hex, (size_t)digits);
    at += digits;
    w[at++] = '.';
    memcpy(w + at, x->topic, (size_t)x->topic_len);
    return at + x->topic_len;
}

/* One message (with its outer tag and length) of the record at ``r`` of a batch whose header is at
 * ``h``, in ``shape``; written at w when set. -1: not taken here. */
static Py_ssize_t put_message(unsigned char *w, const struct shape *sh, const struct run_extra *x, const unsigned char *h,
                              const unsigned char *r, uint64_t queue_offset, uint64_t commit_offset) {
    uint32_t size = le32(r), key_len = le16(r + 4), props_len = le16(r + 6);
    const unsigned char *key = r + RECORD_HEAD_BYTES, *props = key + key_len, *body = props + props_len;
    Py_ssize_t body_len = (Py_ssize_t)size + 4 - RECORD_HEAD_BYTES - key_len - props_len;
    const unsigned char *deliver_at = NULL, *timer_offset = NULL;
    Py_ssize_t deliver_at_len = 0, timer_offset_len = 0, entries = 0;
    if (sh->key) { /* decoded: every key, name and value UTF-8, the timer fields read out */
        if (!utf8_ok(key, key_len))
            return -1;
        for (uint32_t at = 0; at < props_len;) {
            if (props_len - at < 4)
                return -1;
            uint32_t n = le16(props + at);
            if (props_len - at - 4 < n)
                return -1;
            const unsigned char *name = props + at + 2;
            uint32_t v = le16(props + at + 2 + n);
            if (props_len - at - 4 - n < v)
                return -1;
            const unsigned char *value = name + n + 2;
            at += 4 + n + v;
            if (!utf8_ok(name, n) || !utf8_ok(value, v))
                return -1;
            if (named(name, n, DELIVER_AT)) {
                deliver_at = value;
                deliver_at_len = v;
            } else if (named(name, n, TIMER_OFFSET)) {
                timer_offset = value;
                timer_offset_len = v;
            } else if (!named(name, n, TARGET_TOPIC) && !named(name, n, TARGET_QUEUE)) {
                Py_ssize_t entry = put_bytes_field(NULL, 0x0A, name, n, 1) + put_bytes_field(NULL, 0x12, value, v, 1);
                entries += 1 + put_varint(NULL, (uint64_t)entry) + entry;
            }
        }
    }
    uint64_t deliver_at_ms = field_number(deliver_at, deliver_at_len), offset = field_number(timer_offset, timer_offset_len);
    if (deliver_at_ms > (uint64_t)INT64_MAX)
        return -1;
    uint64_t store_time_ms = le64(h + 32);
    if (sh->batch_commit_offset)
        commit_offset = le64(h + 16);
    Py_ssize_t inner = (sh->queue_id ? put_uint_field(NULL, sh->queue_id, x->queue_id) : 0) +
                       put_uint_field(NULL, sh->queue_offset, queue_offset) +
                       put_uint_field(NULL, sh->commit_offset, commit_offset) +
                       put_uint_field(NULL, sh->store_time, store_time_ms) +
                       (sh->record ? put_bytes_field(NULL, sh->record, r, (Py_ssize_t)size + 4, 0) : 0) +
                       (sh->handle ? put_handle(NULL, sh->handle, x, queue_offset) : 0) +
                       (sh->delivery ? put_uint_field(NULL, sh->delivery, x->delivery_count) : 0);
    if (sh->key)
        inner += put_bytes_field(NULL, sh->key, key, key_len, 0) + put_bytes_field(NULL, sh->body, body, body_len, 0) +
                 entries + put_uint_field(NULL, sh->deliver_at, deliver_at_ms) +
                 put_uint_field(NULL, sh->timer_offset, offset);
    Py_ssize_t head = 1 + put_varint(NULL, (uint64_t)inner);
    if (w == NULL)
        return head + inner;
    w[0] = sh->outer;
    Py_ssize_t at = 1 + put_varint(w + 1, (uint64_t)inner);
    if (sh->queue_id)
        at += put_uint_field(w + at, sh->queue_id, x->queue_id);
    at += put_uint_field(w + at, sh->queue_offset, queue_offset);
    at += put_uint_field(w + at, sh->commit_offset, commit_offset);
    at += put_uint_field(w + at, sh->store_time, store_time_ms);
    if (sh->record)
        at += put_bytes_field(w + at, sh->record, r, (Py_ssize_t)size + 4, 0);
    if (sh->handle)
        at += put_handle(w + at, sh->handle, x, queue_offset);
    if (sh->delivery)
        at += put_uint_field(w + at, sh->delivery, x->delivery_count);
    if (!sh->key)
        return at;
    at += put_bytes_field(w + at, sh->key, key, key_len, 0);
    at += put_bytes_field(w + at, sh->body, body, body_len, 0);
    for (uint32_t p = 0; p < props_len;) {
        uint32_t n = le16(props + p);
        const unsigned char *name = props + p + 2;
        uint32_t v = le16(props + p + 2 + n);
        const unsigned char *value = name + n + 2;
        p += 4 + n + v;
        if (named(name, n, DELIVER_AT) || named(name, n, TIMER_OFFSET) || named(name, n, TARGET_TOPIC) ||
            named(name, n, TARGET_QUEUE))
            continue;
        Py_ssize_t entry = put_bytes_field(NULL, 0x0A, name, n, 1) + put_bytes_field(NULL, 0x12, value, v, 1);
        w[at] = sh->props;
        at += 1 + put_varint(w + at + 1, (uint64_t)entry);
        at += put_bytes_field(w + at, 0x0A, name, n, 1);
        at += put_bytes_field(w + at, 0x12, value, v, 1);
    }
    at += put_uint_field(w + at, sh->deliver_at, deliver_at_ms);
    at += put_uint_field(w + at, sh->timer_offset, offset);
    return at;
}

struct blob {
    const unsigned char *buf;
    Py_ssize_t len;
};

/* Walks the records the answer holds; with w unset it only measures. -1: not taken here. Touches no
 * Python object: it may run without the interpreter lock. */
static Py_ssize_t put_pulled_all(unsigned char *w, const struct shape *sh, const struct run_extra *x,
                                 const struct blob *blobs, Py_ssize_t nblobs, Py_ssize_t skip_first, Py_ssize_t count) {
    Py_ssize_t total = 0, done = 0, skip = skip_first;
    for (Py_ssize_t i = 0; i < nblobs && done < count; i++) {
        const unsigned char *buf = blobs[i].buf;
        Py_ssize_t len = blobs[i].len, pos = 0;
        while (pos < len && done < count) {
            if (len - pos < BATCH_HEADER_BYTES)
                return -1;
            const unsigned char *h = buf + pos;
            uint32_t batch_bytes = le32(h), topic_len = h[58];
            if (le16(h + 8) != 0x4D54 || h[10] != 1 || batch_bytes < BATCH_HEADER_BYTES + topic_len ||
                (Py_ssize_t)batch_bytes > len - pos || le64(h + 32) > (uint64_t)INT64_MAX)
                return -1;
            uint64_t base_offset = le64(h + 16), queue_offset = le64(h + 24);
            for (uint32_t r = BATCH_HEADER_BYTES + topic_len; r < batch_bytes && done < count; queue_offset++) {
                if (batch_bytes - r < RECORD_HEAD_BYTES)
                    return -1;
                uint32_t size = le32(h + r);
                if (size < 4 + le16(h + r + 4) + le16(h + r + 6) || size > batch_bytes - r - 4)
                    return -1;
                if (skip > 0) {
                    skip--;
                } else {
                    Py_ssize_t n = put_message(w ? w + total : NULL, sh, x, h, h + r, queue_offset, base_offset + r);
                    if (n < 0)
                        return -1;
                    total += n;
                    done++;
                }
                r += 4 + size;
            }
            pos += batch_bytes;
        }
    }
    return total;
}

/* ``head`` and the messages of ``batches`` (skip_first, count) in ``sh``; None when not taken here. */
static PyObject *answer(PyObject *batches, Py_ssize_t skip_first, Py_ssize_t count, const Py_buffer *head,
                        const struct shape *sh, const struct run_extra *x) {
    /* a tuple of its own holds every blob while the walks run, whatever happens to the list */
    PyObject *held = PyList_AsTuple(batches), *out = NULL;
    Py_ssize_t nblobs = held != NULL ? PyTuple_GET_SIZE(held) : 0, bytes = 0;
    struct blob *blobs = held != NULL ? calloc((size_t)(nblobs ? nblobs : 1), sizeof(*blobs)) : NULL;
    Py_ssize_t total, wrote;
    int release;
    if (held != NULL && blobs == NULL)
        PyErr_NoMemory();
    if (blobs == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < nblobs; i++) {
        PyObject *blob = PyTuple_GET_ITEM(held, i);
        if (!PyBytes_CheckExact(blob)) {
            out = Py_NewRef(Py_None);
            goto done;
        }
        blobs[i].buf = (const unsigned char *)PyBytes_AS_STRING(blob);
        blobs[i].len = PyBytes_GET_SIZE(blob);
        bytes += blobs[i].len;
    }
    release = bytes >= RELEASE_LOCK_BYTES;
    if (release) {
        Py_BEGIN_ALLOW_THREADS
        total = put_pulled_all(NULL, sh, x, blobs, nblobs, skip_first, count);
        Py_END_ALLOW_THREADS
    } else {
        total = put_pulled_all(NULL, sh, x, blobs, nblobs, skip_first, count);
    }
    if (total < 0) {
        out = Py_NewRef(Py_None);
        goto done;
    }
    out = PyBytes_FromStringAndSize(NULL, head->len + total);
    if (out == NULL)
        goto done;
    unsigned char *w = (unsigned char *)PyBytes_AS_STRING(out);
    memcpy(w, head->buf, (size_t)head->len);
    if (release) {
        Py_BEGIN_ALLOW_THREADS
        wrote = put_pulled_all(w + head->len, sh, x, blobs, nblobs, skip_first, count);
        Py_END_ALLOW_THREADS
    } else {
        wrote = put_pulled_all(w + head->len, sh, x, blobs, nblobs, skip_first, count);
    }
    if (wrote != total) {
        Py_CLEAR(out);
        PyErr_SetString(PyExc_RuntimeError, "the answer's walks wrote other than they measured");
    }
done:
    free(blobs);
    Py_XDECREF(held);
    return out;
}

static PyObject *decode_pulled(PyObject *self, PyObject *args) {
    PyObject *batches;
    Py_ssize_t skip_first, count;
    Py_buffer head;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!nny*:decode_pulled", &PyList_Type, &batches, &skip_first, &count, &head))
        return NULL;
    PyObject *out = answer(batches, skip_first, count, &head, &PULLED, NULL);
    PyBuffer_Release(&head);
    return out;
}

static PyObject *popped(PyObject *self, PyObject *args) {
    PyObject *batches;
    Py_ssize_t skip_first, count;
    unsigned long long queue_id, delivery_count;
    Py_buffer lease, topic;
    int decode;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!nnKKy*y*p:popped", &PyList_Type, &batches, &skip_first, &count, &queue_id,
                          &delivery_count, &lease, &topic, &decode))
        return NULL;
    struct run_extra x = {queue_id, delivery_count, lease.buf, topic.buf, lease.len, topic.len};
    Py_buffer none = {0};
    none.buf = "";
    PyObject *out = answer(batches, skip_first, count, &none, decode ? &POPPED_DECODED : &POPPED_RECORD, &x);
    PyBuffer_Release(&lease);
    PyBuffer_Release(&topic);
    return out;
}

/* ---- plain messages checked without the parser ---- */

/* The field at *pos as next_field reads it, refusing what the parser might not take as this
 * reader does: a tag or a length longer than 5 bytes (upb refuses both, where next_field reads up
 * to 10), a varint of 10 bytes past 64 bits. */
static int checked_field(const unsigned char *b, Py_ssize_t *pos, Py_ssize_t end, struct field *f) {
    Py_ssize_t tag_at = *pos, tag_end = *pos;
    while (tag_end < end && (b[tag_end] & 0x80))
        tag_end++;
    if (tag_end - tag_at >= 5 || !next_field(b, pos, end, f))
        return 0;
    if (f->wire == VARINT && *pos - (tag_end + 1) == 10 && b[*pos - 1] > 1)
        return 0;
    if (f->wire == LEN && f->a - (tag_end + 1) > 5)
        return 0;
    return 1;
}

static int utf8_field(const unsigned char *b, const struct field *f) {
    return f->wire == LEN && utf8_ok(b + f->a, f->z - f->a);
}

/* A properties map entry: a name (1) and a value (2), both UTF-8 strings. */
static int map_entry_ok(const unsigned char *b, Py_ssize_t at, Py_ssize_t end) {
    for (Py_ssize_t pos = at; pos < end;) {
        struct field f;
        if (!checked_field(b, &pos, end, &f) || (f.number != 1 && f.number != 2) || !utf8_field(b, &f))
            return 0;
    }
    return 1;
}

static int plain_message_ok(const unsigned char *b, Py_ssize_t at, Py_ssize_t end) {
    for (Py_ssize_t pos = at; pos < end;) {
        struct field f;
        if (!checked_field(b, &pos, end, &f))
            return 0;
        switch (f.number) {
        case 1: /* topic */
        case 3: /* key */
            if (!utf8_field(b, &f))
                return 0;
            break;
        case 4: /* body */
            if (f.wire != LEN)
                return 0;
            break;
        case 2: /* queue_id */
        case 6: /* deliver_at_ms */
        case 7: /* sequence */
            if (f.wire != VARINT)
                return 0;
            break;
        case 5: /* properties */
            if (f.wire != LEN || !map_entry_ok(b, f.a, f.z))
                return 0;
            break;
        default:
            return 0;
        }
    }
    return 1;
}

static PyObject *split_plain(PyObject *self, PyObject *args) {
    Py_buffer request;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*:split_plain", &request))
        return NULL;
    const unsigned char *b = (const unsigned char *)request.buf;
    Py_ssize_t end = request.len, rest_bytes = 0, count = 0, pos = 0;
    int ok = 1;
    while (pos < end && ok) {
        struct field f;
        Py_ssize_t at = pos;
        if (!checked_field(b, &pos, end, &f))
            ok = 0;
        else if (f.number != 4)
            rest_bytes += pos - at;
        else if (f.wire != LEN || !plain_message_ok(b, f.a, f.z))
            ok = 0;
        else
            count++;
    }
    PyObject *result = NULL;
    if (!ok) {
        result = Py_NewRef(Py_None);
    } else {
        PyObject *rest = PyBytes_FromStringAndSize(NULL, rest_bytes);
        if (rest != NULL) {
            unsigned char *start = (unsigned char *)PyBytes_AS_STRING(rest), *w = start;
            for (pos = 0; pos < end;) { /* the same walk as above (the bytes are immutable): it holds */
                struct field f;
                Py_ssize_t at = pos;
                if (!checked_field(b, &pos, end, &f) || (f.number != 4 && w - start + (pos - at) > rest_bytes))
                    break;
                if (f.number != 4) {
                    memcpy(w, b + at, (size_t)(pos - at));
                    w += pos - at;
                }
            }
            if (pos != end || w - start != rest_bytes) {
                Py_DECREF(rest);
                PyErr_SetString(PyExc_RuntimeError, "split_plain's second walk differs from its first");
            } else {
                result = Py_BuildValue("(Nn)", rest, count);
            }
        }
    }
    PyBuffer_Release(&request);
    return result;
}

static PyObject *key_crc32c(PyObject *self, PyObject *args) {
    Py_buffer key;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*:key_crc32c", &key))
        return NULL;
    uint32_t c = crc32c_of((const unsigned char *)key.buf, key.len);
    PyBuffer_Release(&key);
    return PyLong_FromUnsignedLong(c);
}

static PyMethodDef methods[] = {
    {"encode_plain", encode_plain, METH_VARARGS,
     "encode_plain(request, queues_of, rotation, producer_id, yield_every) -> (groups, layout) | None."},
    {"key_crc32c", key_crc32c, METH_VARARGS, "key_crc32c(key) -> the CRC32C of key, as crc32c.crc32c computes it."},
    {"split_plain", split_plain, METH_VARARGS,
     "split_plain(request) -> (the request's fields but its plain messages, how many) | None."},
    {"receipts", receipts, METH_VARARGS, "receipts(layout, groups) -> SendResponse.message_receipts as wire bytes."},
    {"popped", popped, METH_VARARGS,
     "popped(batches, skip_first, count, queue_id, delivery_count, lease, topic, decode) -> PopResponse.messages "
     "of one run as wire bytes | None."},
    {"decode_pulled", decode_pulled, METH_VARARGS,
     "decode_pulled(batches, skip_first, count, head) -> head + PullResponse.messages as wire bytes | None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_plainwire", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__plainwire(void) {
    crc32c_init();
    return PyModule_Create(&module);
}
