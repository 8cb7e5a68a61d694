/*
 * OTLP ExportTraceServiceRequest wire decoder: the ingest hot path.
 *
 * The protobuf runtime's Python objects cost about 2 us per attribute, and
 * building Arrow arrays from Python values tens of microseconds per column.
 * This walks the wire format once and writes the spans straight into Arrow's
 * columnar layout (validity bitmaps, values, offsets), so Python only wraps
 * finished buffers. collector/receive/otlpwire.py is its twin on the protobuf runtime,
 * for where this is not built; both return the same result for every body
 * (tests/collector/receive/test_decode_differential.py).
 *
 * traces(bodies: list[bytes], wanted: tuple[tuple[str, str, str], ...], max_attributes: int) -> dict
 *   Decodes several requests at once, so that what costs per call (in Python
 *   and in Arrow) is paid once for all of them. The dict holds:
 *   resources: one dict of attributes per ResourceSpans, all requests'
 *   owners: the index of the request each resource came from
 *   spans: the number of spans
 *   columns: {name: tuple of Arrow buffers}: resource (int32, the index in
 *     resources), trace_id, span_id, parent_span_id (binary; null when empty),
 *     name (utf8), start, end (uint64, ns), then one per wanted (column, key,
 *     type) attribute (type "q" int64, "i" int32, "d" float64, "s" utf8; null
 *     where absent), then attrs: the span's other attributes as a JSON object
 *     (utf8; null when it has none). Fixed-width columns are (validity, values),
 *     variable-width ones (validity, offsets, data); validity is None when no
 *     cell is null. Spans are in request order.
 *   odd: (span, column, value) for each wanted attribute sent with another
 *     type than its column's (the cell is null; the caller coerces or rejects).
 *   crowded: the spans with more than max_attributes attributes (their cells
 *     are null; the caller rejects them). Past that many a span's attributes
 *     are skipped unread, and its other keys are found through a hash table,
 *     so that a span costs time linear in its size whatever it holds.
 *   errors: (request index, message) for each malformed request; none of its
 *     spans are in the columns. A request is malformed when the protobuf
 *     runtime would refuse it (a field that does not parse, a string that is
 *     not UTF-8, anywhere in the schema; messages nested past MAX_NESTING),
 *     or when an attribute value read is nested past MAX_DEPTH.
 *
 * entries(body, points, limit) counts the resources, scopes and items of a
 * request of any signal, so that one with too many is refused before decoding.
 *
 * Every read is bounds-checked. Unknown fields, and known ones sent with another
 * wire type, are skipped, as protobuf requires, so newer OTLP versions decode.
 * Repeated occurrences of a singular field are read as protobuf reads them: the
 * last scalar wins, messages merge.
 * Field numbers: opentelemetry-proto, trace/v1/trace.proto, common/v1/common.proto,
 * resource/v1/resource.proto.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_DEPTH 16    /* attribute values (arrays, kvlists) nested in one another */
#define MAX_NESTING 100 /* messages and groups: the protobuf runtime's recursion limit */

typedef struct {
    const uint8_t *p;
    const uint8_t *end;
} Reader;

static int fail(const char *what) {
    PyErr_Format(PyExc_ValueError, "malformed OTLP protobuf: %s", what);
    return -1;
}

static int read_varint(Reader *r, uint64_t *out) {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
        if (r->p >= r->end) return fail("truncated varint");
        uint8_t b = *r->p++;
        v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) {
            *out = v;
            return 0;
        }
    }
    return fail("varint too long");
}

static int read_fixed64(Reader *r, uint64_t *out) {
    if (r->end - r->p < 8) return fail("truncated fixed64");
    memcpy(out, r->p, 8); /* protobuf is little-endian, as is every target we build on */
    r->p += 8;
    return 0;
}

/* A length-delimited field: a sub-reader over its bytes. */
static int read_len(Reader *r, Reader *sub) {
    uint64_t n;
    if (read_varint(r, &n) < 0) return -1;
    if (n > (uint64_t)(r->end - r->p)) return fail("length past end of message");
    sub->p = r->p;
    sub->end = r->p + n;
    r->p += n;
    return 0;
}

static int read_tag(Reader *r, uint32_t *field, uint32_t *wire) {
    uint64_t tag;
    if (read_varint(r, &tag) < 0) return -1;
    if (tag > UINT32_MAX) return fail("tag past 32 bits");
    *field = (uint32_t)(tag >> 3);
    *wire = (uint32_t)(tag & 7);
    if (*field == 0) return fail("field number 0");
    return 0;
}

/* Skip one field's value; groups (deprecated, wire types 3/4) are skipped to their end tag.
   `depth`: how deep the field is, messages and groups counted. */
static int skip_group(Reader *r, uint32_t field, int depth);

static int skip_field(Reader *r, uint32_t field, uint32_t wire, int depth) {
    uint64_t v;
    Reader sub;
    switch (wire) {
    case 0: return read_varint(r, &v);
    case 1: return read_fixed64(r, &v);
    case 2: return read_len(r, &sub);
    case 3: return skip_group(r, field, depth + 1);
    case 5:
        if (r->end - r->p < 4) return fail("truncated fixed32");
        r->p += 4;
        return 0;
    default: return fail("unexpected wire type");
    }
}

static int skip_group(Reader *r, uint32_t field, int depth) {
    uint32_t f, w;
    if (depth > MAX_NESTING) return fail("groups nested too deep");
    for (;;) {
        if (read_tag(r, &f, &w) < 0) return -1;
        if (w == 4) return f == field ? 0 : fail("mismatched end of group");
        if (skip_field(r, f, w, depth) < 0) return -1;
    }
}

static int utf8_valid(const uint8_t *p, const uint8_t *end) {
    while (p < end) {
        uint8_t c = *p;
        uint64_t eight;
        if (end - p >= 8 && (memcpy(&eight, p, 8), !(eight & 0x8080808080808080u))) { /* ASCII, 8 at a time */
            p += 8;
            continue;
        }
        if (c < 0x80) {
            p++;
            continue;
        }
        int n = (c & 0xe0) == 0xc0 ? 1 : (c & 0xf0) == 0xe0 ? 2 : (c & 0xf8) == 0xf0 ? 3 : -1;
        if (n < 0 || end - p <= n || (n == 1 && c < 0xc2)) return 0;
        uint32_t cp = c & (0x3f >> n);
        for (int i = 1; i <= n; i++) {
            if ((p[i] & 0xc0) != 0x80) return 0;
            cp = (cp << 6) | (p[i] & 0x3f);
        }
        if ((n == 2 && (cp < 0x800 || (cp >= 0xd800 && cp <= 0xdfff))) || (n == 3 && (cp < 0x10000 || cp > 0x10ffff)))
            return 0;
        p += n + 1;
    }
    return 1;
}


/* The schema of a trace export, as far as the protobuf runtime checks it: for each message, the
   type of its length-delimited fields by number (S a string, else a message; 0 not checked). */
enum { M_REQUEST = 1, M_RESOURCE_SPANS, M_RESOURCE, M_ENTITY_REF, M_SCOPE_SPANS, M_SCOPE, M_SPAN, M_EVENT, M_LINK,
       M_STATUS, M_KEY_VALUE, M_ANY_VALUE, M_ARRAY, M_KVLIST, M_COUNT };
#define S 0xff
static const uint8_t SCHEMA[M_COUNT][16] = {
    [M_REQUEST] = {[1] = M_RESOURCE_SPANS},
    [M_RESOURCE_SPANS] = {[1] = M_RESOURCE, [2] = M_SCOPE_SPANS, [3] = S},
    [M_RESOURCE] = {[1] = M_KEY_VALUE, [3] = M_ENTITY_REF},
    [M_ENTITY_REF] = {[1] = S, [2] = S, [3] = S, [4] = S},
    [M_SCOPE_SPANS] = {[1] = M_SCOPE, [2] = M_SPAN, [3] = S},
    [M_SCOPE] = {[1] = S, [2] = S, [3] = M_KEY_VALUE},
    [M_SPAN] = {[3] = S, [5] = S, [9] = M_KEY_VALUE, [11] = M_EVENT, [13] = M_LINK, [15] = M_STATUS},
    [M_EVENT] = {[2] = S, [3] = M_KEY_VALUE},
    [M_LINK] = {[3] = S, [4] = M_KEY_VALUE},
    [M_STATUS] = {[2] = S},
    [M_KEY_VALUE] = {[1] = S, [2] = M_ANY_VALUE},
    [M_ANY_VALUE] = {[1] = S, [5] = M_ARRAY, [6] = M_KVLIST},
    [M_ARRAY] = {[1] = M_ANY_VALUE},
    [M_KVLIST] = {[1] = M_KEY_VALUE},
};

/* -1 where the protobuf runtime would refuse a message of this type: it checks every field it
   knows, where this decoder reads only some, and refuses what these skip (a malformed scope, an
   event name that is not UTF-8). */
static int check(Reader r, int type, int depth) {
    uint32_t field, wire;
    if (depth > MAX_NESTING) return fail("messages nested too deep");
    while (r.p < r.end) {
        Reader s;
        if (read_tag(&r, &field, &wire) < 0) return -1;
        int kind = field < 16 && wire == 2 ? SCHEMA[type][field] : 0;
        if (!kind) {
            if (skip_field(&r, field, wire, depth) < 0) return -1;
        } else if (read_len(&r, &s) < 0) {
            return -1;
        } else if (kind == S ? !utf8_valid(s.p, s.end) && fail("string is not UTF-8") : check(s, kind, depth + 1)) {
            return -1;
        }
    }
    return 0;
}


/* An AnyValue's oneof: its last field on the wire, and where the run of that field began, since
   protobuf merges occurrences of a message field (arrays and kvlists concatenate). */
typedef struct {
    uint32_t kind; /* the field number; 0: none */
    uint64_t v;    /* bool, int or double bits */
    Reader last;   /* a string or bytes */
    Reader run;    /* from the first field of the last run of `kind` to the end */
} Any;

static int read_any(Reader r, Any *a) {
    uint32_t field, wire;
    *a = (Any){0, 0, {NULL, NULL}, r};
    while (r.p < r.end) {
        const uint8_t *at = r.p;
        if (read_tag(&r, &field, &wire) < 0) return -1;
        if ((field == 2 || field == 3) && wire == 0) {
            if (read_varint(&r, &a->v) < 0) return -1;
        } else if (field == 4 && wire == 1) {
            if (read_fixed64(&r, &a->v) < 0) return -1;
        } else if ((field == 1 || field == 5 || field == 6 || field == 7) && wire == 2) {
            if (read_len(&r, &a->last) < 0) return -1;
        } else {
            if (skip_field(&r, field, wire, 0) < 0) return -1;
            continue;
        }
        if (field != a->kind) a->run.p = at;
        a->kind = field;
    }
    return 0;
}

/* The entries (field 1) of an array or kvlist AnyValue, over all its merged occurrences. */
typedef struct {
    Reader run, payload;
    uint32_t kind;
} Entries;

static Entries entries_of(const Any *a) { return (Entries){a->run, {NULL, NULL}, a->kind}; }

/* 1 and the next entry, 0 at the end, -1 on error. */
static int next_entry(Entries *it, Reader *entry) {
    uint32_t field, wire;
    for (;;) {
        while (it->payload.p < it->payload.end) {
            if (read_tag(&it->payload, &field, &wire) < 0) return -1;
            if (field == 1 && wire == 2) return read_len(&it->payload, entry) < 0 ? -1 : 1;
            if (skip_field(&it->payload, field, wire, 0) < 0) return -1;
        }
        if (it->run.p >= it->run.end) return 0;
        if (read_tag(&it->run, &field, &wire) < 0) return -1;
        if (field == it->kind && wire == 2) {
            if (read_len(&it->run, &it->payload) < 0) return -1;
        } else if (skip_field(&it->run, field, wire, 0) < 0) {
            return -1;
        }
    }
}

/* A KeyValue's key ("" when absent, as protobuf reads it) and value ({NULL} when absent). A value
   sent more than once is the concatenation of its occurrences, which is how protobuf merges them;
   the concatenation is a bytes object that `keep` holds. */
static int kv_fields(Reader r, Reader *key, Reader *value, PyObject *keep) {
    static const uint8_t empty[1] = {0};
    Reader all = r;
    uint32_t field, wire;
    Py_ssize_t values = 0, size = 0;
    *key = (Reader){empty, empty};
    *value = (Reader){NULL, NULL};
    while (r.p < r.end) {
        if (read_tag(&r, &field, &wire) < 0) return -1;
        if (field == 1 && wire == 2) {
            if (read_len(&r, key) < 0) return -1;
        } else if (field == 2 && wire == 2) {
            if (read_len(&r, value) < 0) return -1;
            values++;
            size += value->end - value->p;
        } else if (skip_field(&r, field, wire, 0) < 0) {
            return -1;
        }
    }
    if (values < 2) return 0;
    PyObject *merged = PyBytes_FromStringAndSize(NULL, size);
    if (!merged || PyList_Append(keep, merged) < 0) {
        Py_XDECREF(merged);
        return -1;
    }
    Py_DECREF(merged);
    uint8_t *out = (uint8_t *)PyBytes_AS_STRING(merged);
    *value = (Reader){out, out + size};
    for (r = all; r.p < r.end;) { /* read once already: cannot fail */
        Reader s = {NULL, NULL};
        read_tag(&r, &field, &wire);
        if (field == 2 && wire == 2) {
            read_len(&r, &s);
            memcpy(out, s.p, s.end - s.p);
            out += s.end - s.p;
        } else if (field == 1 && wire == 2) {
            read_len(&r, &s);
        } else {
            skip_field(&r, field, wire, 0);
        }
    }
    return 0;
}

/* Key/value pairs by key, a later value replacing an earlier one's in its place: open addressing
   over the keys, so that n pairs cost time linear in n whatever the keys. */
typedef struct {
    Reader *key, *value;
    Py_ssize_t n, cap;
    int32_t *index; /* 1 + the pair's position, 0 empty; cap * 2 slots */
} Pairs;

static void pairs_free(Pairs *s) {
    PyMem_Free(s->key);
    PyMem_Free(s->value);
    PyMem_Free(s->index);
    *s = (Pairs){0};
}

static void pairs_clear(Pairs *s) {
    if (s->n) memset(s->index, 0, 2 * s->cap * sizeof(int32_t));
    s->n = 0;
}

static size_t pairs_slot(const Pairs *s, Reader key) {
    size_t h = 14695981039346656037u; /* FNV-1a */
    Py_ssize_t len = key.end - key.p;
    for (const uint8_t *p = key.p; p < key.end; p++) h = (h ^ *p) * 1099511628211u;
    for (size_t at = h & (2 * s->cap - 1);; at = (at + 1) & (2 * s->cap - 1)) {
        int32_t i = s->index[at] - 1;
        if (i < 0 || (s->key[i].end - s->key[i].p == len && memcmp(s->key[i].p, key.p, len) == 0)) return at;
    }
}

static int pairs_put(Pairs *s, Reader key, Reader value) {
    if (s->n == s->cap) { /* grow, cap a power of two */
        Py_ssize_t cap = s->cap ? 2 * s->cap : 8;
        if (cap > INT32_MAX / 2) return fail("too many attributes");
        Reader *k = PyMem_Realloc(s->key, cap * sizeof(Reader)), *v = k ? PyMem_Realloc(s->value, cap * sizeof(Reader)) : NULL;
        int32_t *index = v ? PyMem_Calloc(2 * cap, sizeof(int32_t)) : NULL;
        if (k) s->key = k;
        if (v) s->value = v;
        if (!index) {
            PyErr_NoMemory();
            return -1;
        }
        PyMem_Free(s->index);
        s->index = index;
        s->cap = cap;
        for (Py_ssize_t i = 0; i < s->n; i++) s->index[pairs_slot(s, s->key[i])] = (int32_t)i + 1;
    }
    size_t at = pairs_slot(s, key);
    if (s->index[at]) {
        s->value[s->index[at] - 1] = value;
    } else {
        s->index[at] = (int32_t)s->n + 1;
        s->key[s->n] = key;
        s->value[s->n++] = value;
    }
    return 0;
}

/* A kvlist's entries, over all its merged occurrences, by key. */
static int kvlist_pairs(const Any *a, Pairs *pairs, PyObject *keep) {
    Entries it = entries_of(a);
    Reader e, key, value;
    int more;
    while ((more = next_entry(&it, &e)) != 0) {
        if (more < 0 || kv_fields(e, &key, &value, keep) < 0 || pairs_put(pairs, key, value) < 0) return -1;
    }
    return 0;
}

static PyObject *any_value(Reader r, int depth, PyObject *keep);

/* One KeyValue of a resource into dict[key] = value (a later key replaces an earlier one's value). */
static int key_value(Reader r, PyObject *dict, int depth, PyObject *keep) {
    Reader k, v;
    if (kv_fields(r, &k, &v, keep) < 0) return -1;
    PyObject *key = PyUnicode_DecodeUTF8((const char *)k.p, k.end - k.p, "strict");
    PyObject *value = !key ? NULL : v.p ? any_value(v, depth, keep) : Py_NewRef(Py_None);
    int rc = value ? PyDict_SetItem(dict, key, value) : -1;
    Py_XDECREF(key);
    Py_XDECREF(value);
    return rc;
}

/* An AnyValue as a plain Python value, as collector/receive/otlpwire.py's value() reads it. */
static PyObject *any_value(Reader r, int depth, PyObject *keep) {
    Any a;
    if (depth > MAX_DEPTH) {
        fail("attribute values nested too deep");
        return NULL;
    }
    if (read_any(r, &a) < 0) return NULL;
    switch (a.kind) {
    case 1: return PyUnicode_DecodeUTF8((const char *)a.last.p, a.last.end - a.last.p, "strict");
    case 2: return PyBool_FromLong(a.v != 0);
    case 3: return PyLong_FromLongLong((long long)a.v);
    case 4: {
        double d;
        memcpy(&d, &a.v, 8);
        return PyFloat_FromDouble(d);
    }
    case 5: {
        PyObject *out = PyList_New(0);
        Entries it = entries_of(&a);
        Reader e;
        int more;
        while (out && (more = next_entry(&it, &e)) != 0) {
            PyObject *item = more < 0 ? NULL : any_value(e, depth + 1, keep);
            if (!item || PyList_Append(out, item) < 0) Py_CLEAR(out);
            Py_XDECREF(item);
        }
        return out;
    }
    case 6: {
        Pairs pairs = {0};
        PyObject *out = kvlist_pairs(&a, &pairs, keep) < 0 ? NULL : PyDict_New();
        for (Py_ssize_t i = 0; out && i < pairs.n; i++) {
            Reader k = pairs.key[i], v = pairs.value[i];
            PyObject *key = PyUnicode_DecodeUTF8((const char *)k.p, k.end - k.p, "strict");
            PyObject *item = !key ? NULL : v.p ? any_value(v, depth + 1, keep) : Py_NewRef(Py_None);
            if (!item || PyDict_SetItem(out, key, item) < 0) Py_CLEAR(out);
            Py_XDECREF(key);
            Py_XDECREF(item);
        }
        pairs_free(&pairs);
        return out;
    }
    case 7: return PyBytes_FromStringAndSize((const char *)a.last.p, a.last.end - a.last.p);
    default: Py_RETURN_NONE;
    }
}


/* A growable byte buffer. */
typedef struct {
    char *data;
    Py_ssize_t len, cap;
} Buf;

static int grow(Buf *b, Py_ssize_t more) {
    if (b->len + more <= b->cap) return 0;
    Py_ssize_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + more) cap *= 2;
    char *data = PyMem_Realloc(b->data, cap);
    if (!data) {
        PyErr_NoMemory();
        return -1;
    }
    b->data = data;
    b->cap = cap;
    return 0;
}

static int put(Buf *b, const void *p, Py_ssize_t n) {
    if (n == 0) return 0; /* an empty buffer's data is NULL, and memcpy(NULL, p, 0) is undefined */
    if (grow(b, n) < 0) return -1;
    memcpy(b->data + b->len, p, n);
    b->len += n;
    return 0;
}

static int puts_(Buf *b, const char *s) { return put(b, s, strlen(s)); }

/* One Arrow column being filled, a cell per span. */
typedef struct {
    char type; /* q int64, i int32, d float64, u uint64, s utf8, b binary */
    Buf valid, values, offsets;
    Py_ssize_t nulls;
} Column;

static int fixed_width(char type) { return type == 'i' ? 4 : 8; }
static int var_width(char type) { return type == 's' || type == 'b'; }

/* Start a cell: mark it valid or null (values of a null cell are zeros, as Arrow allows). */
static int cell(Column *c, Py_ssize_t row, int valid) {
    if (row % 8 == 0) {
        uint8_t zero = 0;
        if (put(&c->valid, &zero, 1) < 0) return -1;
    }
    if (valid)
        c->valid.data[row / 8] |= (uint8_t)(1 << (row % 8));
    else
        c->nulls++;
    return 0;
}

static int cell_bytes(Column *c, Py_ssize_t row, const uint8_t *p, Py_ssize_t n, int valid) {
    if (cell(c, row, valid) < 0) return -1;
    if (row == 0) {
        int32_t zero = 0;
        if (put(&c->offsets, &zero, 4) < 0) return -1;
    }
    if (valid && put(&c->values, p, n) < 0) return -1;
    if (c->values.len > INT32_MAX) return fail("column larger than 2 GiB");
    int32_t offset = (int32_t)c->values.len;
    return put(&c->offsets, &offset, 4);
}

static int cell_fixed(Column *c, Py_ssize_t row, const void *value, int valid) {
    static const uint8_t zeros[8] = {0};
    if (cell(c, row, valid) < 0) return -1;
    return put(&c->values, valid ? value : zeros, fixed_width(c->type));
}

/* The column as a tuple of bytes objects: (validity or None, values) or (validity or None, offsets, data). */
static PyObject *column_buffers(Column *c, Py_ssize_t rows) {
    if (rows == 0) return PyTuple_New(0);
    PyObject *valid = c->nulls ? PyBytes_FromStringAndSize(c->valid.data, c->valid.len) : Py_NewRef(Py_None);
    PyObject *values = PyBytes_FromStringAndSize(c->values.data ? c->values.data : "", c->values.len);
    PyObject *out = NULL;
    if (valid && values) {
        if (var_width(c->type)) {
            PyObject *offsets = PyBytes_FromStringAndSize(c->offsets.data, c->offsets.len);
            if (offsets) out = PyTuple_Pack(3, valid, offsets, values);
            Py_XDECREF(offsets);
        } else {
            out = PyTuple_Pack(2, valid, values);
        }
    }
    Py_XDECREF(valid);
    Py_XDECREF(values);
    return out;
}

/* AnyValues as JSON, as collector/receive/otlpwire.py writes them: json.dumps(ensure_ascii=False), bytes as hex,
   non-finite doubles as null. */
static int json_string(Buf *b, const uint8_t *p, const uint8_t *end) {
    if (!utf8_valid(p, end)) return fail("string is not UTF-8");
    if (put(b, "\"", 1) < 0) return -1;
    for (; p < end; p++) {
        char esc[8];
        const char *out = NULL;
        switch (*p) {
        case '"': out = "\\\""; break;
        case '\\': out = "\\\\"; break;
        case '\n': out = "\\n"; break;
        case '\r': out = "\\r"; break;
        case '\t': out = "\\t"; break;
        case '\b': out = "\\b"; break;
        case '\f': out = "\\f"; break;
        default:
            if (*p < 0x20) {
                snprintf(esc, sizeof esc, "\\u%04x", *p);
                out = esc;
            }
        }
        if (out ? puts_(b, out) < 0 : put(b, p, 1) < 0) return -1;
    }
    return put(b, "\"", 1);
}


static int json_key_value(Buf *b, Reader key, Reader value, int depth, PyObject *keep);

/* A kvlist as a JSON object, a later key replacing an earlier one's value in its place (as in a dict). */
static int json_kvlist(Buf *b, const Any *a, int depth, PyObject *keep) {
    Pairs pairs = {0};
    int rc = -1;
    if (kvlist_pairs(a, &pairs, keep) < 0) goto done;
    if (put(b, "{", 1) < 0) goto done;
    for (Py_ssize_t i = 0; i < pairs.n; i++) {
        if ((i && puts_(b, ", ") < 0) || json_key_value(b, pairs.key[i], pairs.value[i], depth + 1, keep) < 0)
            goto done;
    }
    rc = put(b, "}", 1);
done:
    pairs_free(&pairs);
    return rc;
}

static int json_any(Buf *b, Reader r, int depth, PyObject *keep) {
    Any a;
    char number[64];
    if (depth > MAX_DEPTH) return fail("attribute values nested too deep");
    if (read_any(r, &a) < 0) return -1;
    switch (a.kind) {
    case 1: return json_string(b, a.last.p, a.last.end);
    case 2: return puts_(b, a.v ? "true" : "false");
    case 3:
        snprintf(number, sizeof number, "%lld", (long long)a.v);
        return puts_(b, number);
    case 4: {
        double d;
        memcpy(&d, &a.v, 8);
        if (!isfinite(d)) return puts_(b, "null");
        char *repr = PyOS_double_to_string(d, 'r', 0, Py_DTSF_ADD_DOT_0, NULL);
        if (!repr) return -1;
        int rc = puts_(b, repr);
        PyMem_Free(repr);
        return rc;
    }
    case 5: {
        Entries it = entries_of(&a);
        Reader e;
        int more, first = 1;
        if (put(b, "[", 1) < 0) return -1;
        while ((more = next_entry(&it, &e)) != 0) {
            if (more < 0 || (!first && puts_(b, ", ") < 0) || json_any(b, e, depth + 1, keep) < 0) return -1;
            first = 0;
        }
        return put(b, "]", 1);
    }
    case 6: return json_kvlist(b, &a, depth, keep);
    case 7:
        if (put(b, "\"", 1) < 0) return -1;
        for (const uint8_t *p = a.last.p; p < a.last.end; p++) {
            snprintf(number, sizeof number, "%02x", *p);
            if (put(b, number, 2) < 0) return -1;
        }
        return put(b, "\"", 1);
    default: return puts_(b, "null");
    }
}

static int json_key_value(Buf *b, Reader key, Reader value, int depth, PyObject *keep) {
    if (json_string(b, key.p, key.end) < 0 || puts_(b, ": ") < 0) return -1;
    if (!value.p) return puts_(b, "null");
    return json_any(b, value, depth, keep);
}

/* What the caller asked for, and the columns being filled. */
typedef struct {
    Py_ssize_t n_wanted;
    const char **key;
    Py_ssize_t *key_len;
    PyObject **name; /* the columns' names: COL_WANTED + n_wanted + 1 */
    Column *col;     /* as many */
    Py_ssize_t rows;
    PyObject *odd;
    PyObject *keep; /* bytes that readers point into: merged values */
    Buf json;       /* scratch: one span's other attributes */
    Reader *slot;   /* per span: the value of each wanted key */
    Pairs others;   /* per span: its other attributes */
    Py_ssize_t max_attributes, n_attributes;
    PyObject *crowded; /* rows of spans with more than max_attributes attributes */
} Decoder;

enum { COL_RESOURCE, COL_TRACE_ID, COL_SPAN_ID, COL_PARENT, COL_NAME, COL_START, COL_END, COL_WANTED };
static const char FIXED_TYPES[COL_WANTED] = {'i', 'b', 'b', 'b', 's', 'u', 'u'};
static const char *FIXED_NAMES[COL_WANTED] = {"resource", "trace_id", "span_id", "parent_span_id", "name", "start", "end"};

/* A wanted attribute's cell, typed; a value of another type becomes null plus an `odd` entry. */
static int wanted_cell(Decoder *d, Py_ssize_t i, Reader value) {
    Column *c = &d->col[COL_WANTED + i];
    Any a = {0};
    if (value.p && read_any(value, &a) < 0) return -1;
    if (a.kind == 0) /* absent, or an empty AnyValue: null */
        return var_width(c->type) ? cell_bytes(c, d->rows, NULL, 0, 0) : cell_fixed(c, d->rows, NULL, 0);
    int64_t i64 = (int64_t)a.v;
    if (c->type == 's' && a.kind == 1) {
        if (!utf8_valid(a.last.p, a.last.end)) return fail("string is not UTF-8");
        return cell_bytes(c, d->rows, a.last.p, a.last.end - a.last.p, 1);
    }
    if (c->type == 'q' && a.kind == 3) return cell_fixed(c, d->rows, &i64, 1);
    if (c->type == 'i' && a.kind == 3 && i64 >= INT32_MIN && i64 <= INT32_MAX) {
        int32_t i32 = (int32_t)i64;
        return cell_fixed(c, d->rows, &i32, 1);
    }
    if (c->type == 'd' && (a.kind == 3 || a.kind == 4)) {
        double x;
        if (a.kind == 3)
            x = (double)i64;
        else
            memcpy(&x, &a.v, 8);
        return cell_fixed(c, d->rows, &x, 1);
    }
    PyObject *sent = any_value(value, 0, d->keep);
    PyObject *entry = sent ? Py_BuildValue("(nOO)", d->rows, d->name[COL_WANTED + i], sent) : NULL;
    Py_XDECREF(sent);
    if (!entry || PyList_Append(d->odd, entry) < 0) {
        Py_XDECREF(entry);
        return -1;
    }
    Py_DECREF(entry);
    return var_width(c->type) ? cell_bytes(c, d->rows, NULL, 0, 0) : cell_fixed(c, d->rows, NULL, 0);
}

/* One KeyValue of a span: into its wanted slot, else kept for the JSON of other attributes.
   Past max_attributes the span is refused (its row is noted in `crowded`) and the rest only skipped,
   so the work per span is bounded whatever it sends. */
static int span_attribute(Decoder *d, Reader r) {
    Reader key, value;
    if (++d->n_attributes > d->max_attributes) return 0;
    if (kv_fields(r, &key, &value, d->keep) < 0) return -1;
    Py_ssize_t klen = key.end - key.p;
    for (Py_ssize_t i = 0; i < d->n_wanted; i++) {
        if (d->key_len[i] == klen && memcmp(d->key[i], key.p, klen) == 0) {
            d->slot[i] = value.p ? value : (Reader){key.end, key.end}; /* present, maybe empty */
            return 0;
        }
    }
    return pairs_put(&d->others, key, value);
}

static int id_cell(Column *c, Py_ssize_t row, Reader id, int null_when_empty) {
    int valid = !(null_when_empty && id.p == id.end);
    return cell_bytes(c, row, id.p, id.end - id.p, valid);
}

/* One Span message -> one cell in every column. */
static int span(Decoder *d, Reader *r, int32_t resource) {
    static const uint8_t none[1] = {0};
    Reader trace_id = {none, none}, span_id = {none, none}, parent = {none, none}, name = {none, none};
    uint64_t start = 0, end = 0;
    uint32_t field, wire;
    memset(d->slot, 0, d->n_wanted * sizeof(Reader));
    pairs_clear(&d->others);
    d->n_attributes = 0;
    while (r->p < r->end) {
        Reader s;
        if (read_tag(r, &field, &wire) < 0) return -1;
        if (wire == 2 && (field == 1 || field == 2 || field == 4 || field == 5 || field == 9)) {
            if (read_len(r, &s) < 0) return -1;
            switch (field) {
            case 1: trace_id = s; break;
            case 2: span_id = s; break;
            case 4: parent = s; break;
            case 5: name = s; break;
            case 9: if (span_attribute(d, s) < 0) return -1; break;
            }
        } else if (field == 7 && wire == 1) {
            if (read_fixed64(r, &start) < 0) return -1;
        } else if (field == 8 && wire == 1) {
            if (read_fixed64(r, &end) < 0) return -1;
        } else if (skip_field(r, field, wire, 0) < 0) {
            return -1;
        }
    }
    if (!utf8_valid(name.p, name.end)) return fail("span name is not UTF-8");
    Py_ssize_t row = d->rows;
    if (d->n_attributes > d->max_attributes) { /* refused: a row of nulls the caller filters out */
        PyObject *at = PyLong_FromSsize_t(row);
        int rc = at ? PyList_Append(d->crowded, at) : -1;
        Py_XDECREF(at);
        if (rc < 0) return -1;
        memset(d->slot, 0, d->n_wanted * sizeof(Reader));
        pairs_clear(&d->others);
    }
    if (cell_fixed(&d->col[COL_RESOURCE], row, &resource, 1) < 0 ||
        id_cell(&d->col[COL_TRACE_ID], row, trace_id, 0) < 0 || id_cell(&d->col[COL_SPAN_ID], row, span_id, 0) < 0 ||
        id_cell(&d->col[COL_PARENT], row, parent, 1) < 0 ||
        cell_bytes(&d->col[COL_NAME], row, name.p, name.end - name.p, 1) < 0 ||
        cell_fixed(&d->col[COL_START], row, &start, 1) < 0 || cell_fixed(&d->col[COL_END], row, &end, 1) < 0)
        return -1;
    for (Py_ssize_t i = 0; i < d->n_wanted; i++)
        if (wanted_cell(d, i, d->slot[i]) < 0) return -1;
    Column *json = &d->col[COL_WANTED + d->n_wanted];
    d->json.len = 0;
    if (d->others.n) {
        if (put(&d->json, "{", 1) < 0) return -1;
        for (Py_ssize_t i = 0; i < d->others.n; i++) {
            if ((i && puts_(&d->json, ", ") < 0) ||
                json_key_value(&d->json, d->others.key[i], d->others.value[i], 0, d->keep) < 0)
                return -1;
        }
        if (put(&d->json, "}", 1) < 0) return -1;
    }
    if (cell_bytes(json, row, (const uint8_t *)d->json.data, d->json.len, d->others.n > 0) < 0) return -1;
    d->rows++;
    return 0;
}

/* ScopeSpans{scope = 1; repeated Span spans = 2}. */
static int scope_spans(Decoder *d, Reader *r, int32_t resource) {
    uint32_t field, wire;
    while (r->p < r->end) {
        Reader s;
        if (read_tag(r, &field, &wire) < 0) return -1;
        if (field == 2 && wire == 2) {
            if (read_len(r, &s) < 0 || span(d, &s, resource) < 0) return -1;
        } else if (skip_field(r, field, wire, 0) < 0) {
            return -1;
        }
    }
    return 0;
}

/* ResourceSpans{resource = 1 (Resource{repeated KeyValue attributes = 1}); repeated ScopeSpans = 2}. */
static int resource_spans(Decoder *d, Reader *r, PyObject *resources) {
    PyObject *attrs = PyDict_New();
    int32_t index = (int32_t)PyList_GET_SIZE(resources);
    uint32_t field, wire;
    int rc = -1;
    if (!attrs || PyList_Append(resources, attrs) < 0) goto done;
    while (r->p < r->end) {
        Reader s;
        if (read_tag(r, &field, &wire) < 0) goto done;
        if (field == 1 && wire == 2) {
            if (read_len(r, &s) < 0) goto done;
            while (s.p < s.end) {
                Reader kv;
                if (read_tag(&s, &field, &wire) < 0) goto done;
                if (field == 1 && wire == 2) {
                    if (read_len(&s, &kv) < 0 || key_value(kv, attrs, 0, d->keep) < 0) goto done;
                } else if (skip_field(&s, field, wire, 0) < 0) {
                    goto done;
                }
            }
        } else if (field == 2 && wire == 2) {
            if (read_len(r, &s) < 0 || scope_spans(d, &s, index) < 0) goto done;
        } else if (skip_field(r, field, wire, 0) < 0) {
            goto done;
        }
    }
    rc = 0;
done:
    Py_XDECREF(attrs);
    return rc;
}

/* Where the columns stood before a body, to drop what a malformed body half-wrote. */
typedef struct {
    Py_ssize_t valid, values, offsets, nulls;
} Mark;

static void mark(Decoder *d, Mark *m, Py_ssize_t n_columns) {
    for (Py_ssize_t i = 0; i < n_columns; i++)
        m[i] = (Mark){d->col[i].valid.len, d->col[i].values.len, d->col[i].offsets.len, d->col[i].nulls};
}

static void rewind_to(Decoder *d, const Mark *m, Py_ssize_t n_columns, Py_ssize_t rows) {
    for (Py_ssize_t i = 0; i < n_columns; i++) {
        Column *c = &d->col[i];
        c->valid.len = m[i].valid;
        c->values.len = m[i].values;
        c->offsets.len = m[i].offsets;
        c->nulls = m[i].nulls;
        if (rows % 8) c->valid.data[rows / 8] &= (uint8_t)((1 << (rows % 8)) - 1);
    }
    d->rows = rows;
}

/* One ExportTraceServiceRequest body into the columns, once checked whole. */
static int request(Decoder *d, PyObject *body, PyObject *resources) {
    Py_buffer view;
    if (PyObject_GetBuffer(body, &view, PyBUF_SIMPLE) < 0) return -1;
    Reader r = {(const uint8_t *)view.buf, (const uint8_t *)view.buf + view.len};
    uint32_t field, wire;
    int rc = check(r, M_REQUEST, 0);
    while (rc == 0 && r.p < r.end) {
        Reader s;
        if (read_tag(&r, &field, &wire) < 0) {
            rc = -1;
        } else if (field == 1 && wire == 2) {
            rc = read_len(&r, &s) < 0 || resource_spans(d, &s, resources) < 0 ? -1 : 0;
        } else {
            rc = skip_field(&r, field, wire, 0);
        }
    }
    PyBuffer_Release(&view);
    return rc;
}


static PyObject *traces(PyObject *module, PyObject *args) {
    PyObject *bodies, *wanted, *resources = NULL, *owners = NULL, *errors = NULL, *columns = NULL, *out = NULL;
    Mark *marks = NULL;
    Decoder d;
    memset(&d, 0, sizeof d);
    if (!PyArg_ParseTuple(args, "O!O!n", &PyList_Type, &bodies, &PyTuple_Type, &wanted, &d.max_attributes))
        return NULL;
    if (d.max_attributes < 1 || d.max_attributes > (1 << 20)) {
        PyErr_SetString(PyExc_ValueError, "max_attributes must be in [1, 2**20]");
        return NULL;
    }
    d.n_wanted = PyTuple_GET_SIZE(wanted);
    Py_ssize_t n_columns = COL_WANTED + d.n_wanted + 1;
    d.key = PyMem_Calloc(d.n_wanted + 1, sizeof(char *));
    d.key_len = PyMem_Calloc(d.n_wanted + 1, sizeof(Py_ssize_t));
    d.slot = PyMem_Calloc(d.n_wanted + 1, sizeof(Reader));
    d.col = PyMem_Calloc(n_columns, sizeof(Column));
    d.name = PyMem_Calloc(n_columns, sizeof(PyObject *));
    marks = PyMem_Calloc(n_columns, sizeof(Mark));
    d.odd = PyList_New(0);
    d.crowded = PyList_New(0);
    d.keep = PyList_New(0);
    resources = PyList_New(0);
    owners = PyList_New(0);
    errors = PyList_New(0);
    if (!d.key || !d.key_len || !d.slot || !d.col || !d.name || !marks || !d.odd || !d.crowded || !d.keep ||
        !resources || !owners || !errors)
        goto done;
    for (Py_ssize_t i = 0; i < COL_WANTED; i++) {
        d.col[i].type = FIXED_TYPES[i];
        if (!(d.name[i] = PyUnicode_FromString(FIXED_NAMES[i]))) goto done;
    }
    for (Py_ssize_t i = 0; i < d.n_wanted; i++) {
        const char *type;
        PyObject *name;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(wanted, i), "Us#s", &name, &d.key[i], &d.key_len[i], &type)) goto done;
        if (strlen(type) != 1 || !strchr("qids", type[0])) {
            PyErr_Format(PyExc_ValueError, "unknown column type %s", type);
            goto done;
        }
        d.col[COL_WANTED + i].type = type[0];
        d.name[COL_WANTED + i] = Py_NewRef(name);
    }
    d.col[n_columns - 1].type = 's';
    if (!(d.name[n_columns - 1] = PyUnicode_FromString("attrs"))) goto done;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(bodies); i++) {
        Py_ssize_t rows = d.rows, odd = PyList_GET_SIZE(d.odd), crowded = PyList_GET_SIZE(d.crowded),
                   before = PyList_GET_SIZE(resources);
        mark(&d, marks, n_columns);
        if (request(&d, PyList_GET_ITEM(bodies, i), resources) == 0) {
            PyObject *owner = PyLong_FromSsize_t(i);
            for (Py_ssize_t j = before; owner && j < PyList_GET_SIZE(resources); j++)
                if (PyList_Append(owners, owner) < 0) Py_CLEAR(owner);
            if (!owner) goto done;
            Py_DECREF(owner);
            continue;
        }
        if (!PyErr_ExceptionMatches(PyExc_ValueError)) goto done;
        /* a malformed body: its spans are dropped, the others stay */
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        PyObject *entry = Py_BuildValue("(nN)", i, value ? PyObject_Str(value) : PyUnicode_FromString("malformed"));
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(traceback);
        if (!entry || PyList_Append(errors, entry) < 0) {
            Py_XDECREF(entry);
            goto done;
        }
        Py_DECREF(entry);
        rewind_to(&d, marks, n_columns, rows);
        if (PyList_SetSlice(d.odd, odd, PY_SSIZE_T_MAX, NULL) < 0 ||
            PyList_SetSlice(d.crowded, crowded, PY_SSIZE_T_MAX, NULL) < 0 ||
            PyList_SetSlice(resources, before, PY_SSIZE_T_MAX, NULL) < 0)
            goto done;
    }
    columns = PyDict_New();
    if (!columns) goto done;
    for (Py_ssize_t i = 0; i < n_columns; i++) {
        PyObject *buffers = column_buffers(&d.col[i], d.rows);
        int rc = buffers ? PyDict_SetItem(columns, d.name[i], buffers) : -1;
        Py_XDECREF(buffers);
        if (rc < 0) goto done;
    }
    out = Py_BuildValue("{sOsOsnsOsOsOsO}", "resources", resources, "owners", owners, "spans", d.rows, "columns",
                        columns, "odd", d.odd, "crowded", d.crowded, "errors", errors);
done:
    if (d.col) {
        for (Py_ssize_t i = 0; i < n_columns; i++) {
            PyMem_Free(d.col[i].valid.data);
            PyMem_Free(d.col[i].values.data);
            PyMem_Free(d.col[i].offsets.data);
        }
    }
    if (d.name) {
        for (Py_ssize_t i = 0; i < n_columns; i++) Py_XDECREF(d.name[i]);
    }
    PyMem_Free(d.col);
    PyMem_Free(d.name);
    PyMem_Free(marks);
    PyMem_Free(d.key);
    PyMem_Free(d.key_len);
    PyMem_Free(d.slot);
    pairs_free(&d.others);
    PyMem_Free(d.json.data);
    Py_XDECREF(d.odd);
    Py_XDECREF(d.crowded);
    Py_XDECREF(d.keep);
    Py_XDECREF(resources);
    Py_XDECREF(owners);
    Py_XDECREF(errors);
    Py_XDECREF(columns);
    return out;
}

/* Entries of one export request, counted on the wire: resources (field 1 of the request), scopes
   (field 2 of those), items (field 2 of scopes: spans, metrics, log records) and, at level 3 with
   `points`, metrics' data points (field 1 of a metric's gauge, sum, histogram, exponential histogram
   or summary). Only tags and lengths are read, nothing is allocated. */
static int count_entries(Reader *r, int level, int points, Py_ssize_t limit, Py_ssize_t *n) {
    uint32_t field, wire;
    while (r->p < r->end && *n <= limit) {
        Reader s;
        if (read_tag(r, &field, &wire) < 0) return -1;
        int child = level == 0   ? field == 1
                    : level < 3 ? field == 2
                    : level == 3 ? field == 5 || field == 7 || field == 9 || field == 10 || field == 11
                                 : field == 1;
        if (!child || wire != 2) {
            if (skip_field(r, field, wire, 0) < 0) return -1;
            continue;
        }
        if (read_len(r, &s) < 0) return -1;
        if (level != 3) ++*n;
        if ((level < 2 || (points && level < 4)) && count_entries(&s, level + 1, points, limit, n) < 0) return -1;
    }
    return 0;
}

static PyObject *entries(PyObject *module, PyObject *args) {
    Py_buffer view;
    int points;
    Py_ssize_t limit, n = 0;
    if (!PyArg_ParseTuple(args, "y*pn", &view, &points, &limit)) return NULL;
    Reader r = {(const uint8_t *)view.buf, (const uint8_t *)view.buf + view.len};
    if (count_entries(&r, 0, points, limit, &n) < 0) PyErr_Clear(); /* malformed: the decoder says why */
    PyBuffer_Release(&view);
    return PyLong_FromSsize_t(n);
}

static PyMethodDef methods[] = {
    {"entries", entries, METH_VARARGS,
     "entries(body, points, limit) -> int: resources, scopes and items (with points, metrics' data points too)\n"
     "of an export request, counted up to just past limit; a malformed body counts as far as it reads."},
    {"traces", traces, METH_VARARGS,
     "traces(bodies, wanted, max_attributes) -> {resources, owners, spans, columns, odd, crowded, errors}:\n"
     "ExportTraceServiceRequests in Arrow's columnar layout; see the module's source for the columns."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_otlpwire", NULL, -1, methods};

PyMODINIT_FUNC PyInit__otlpwire(void) { return PyModule_Create(&module); }
