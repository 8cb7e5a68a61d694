/*
 * OTLP ExportTraceServiceRequest wire decoder: the ingest hot path.
 *
 * The protobuf runtime's Python objects cost about 2 us per attribute, and
 * building Arrow arrays from Python values tens of microseconds per column.
 * This walks the wire format once and writes the spans straight into Arrow's
 * columnar layout (validity bitmaps, values, offsets), so Python only wraps
 * finished buffers.
 *
 * traces(bodies: list[bytes], wanted: tuple[tuple[str, str], ...], max_attributes: int)
 *     -> (resources, owners, spans, columns, odd, crowded, errors)
 *   Decodes several requests at once, so that what costs per call (in Python
 *   and in Arrow) is paid once for all of them.
 *   resources: one dict of attributes per ResourceSpans, all requests'
 *   owners: the index of the request each resource came from
 *   spans: the number of spans
 *   columns: one tuple of Arrow buffers per column, in this order:
 *     resource index (int32), trace_id, span_id, parent_span_id (binary; null
 *     when empty), name (utf8), start_ns, end_ns (uint64), then one per wanted
 *     (key, type) attribute (type "q" int64, "i" int32, "d" float64, "s" utf8;
 *     null where absent), then the span's other attributes as a JSON object
 *     (utf8; null when it has none). Fixed-width columns are (validity, values),
 *     variable-width ones (validity, offsets, data); validity is None when no
 *     cell is null. Spans are in request order.
 *   odd: (span, column, value) for each wanted attribute sent with another
 *     type than its column's (the cell is null; the caller coerces or rejects).
 *   crowded: the spans with more than max_attributes attributes (their cells
 *     are null; the caller rejects them). Past that many a span's attributes
 *     are skipped unread, and its other keys are found through a hash table,
 *     so that a span costs time linear in its size whatever it holds.
 *   errors: (request index, message) for each malformed request (one that
 *     does not parse, or has strings that are not UTF-8); none of its spans
 *     are in the columns.
 *
 * entries(body, points, limit) counts the resources, scopes and items of a
 * request of any signal, so that one with too many is refused before decoding.
 *
 * Every read is bounds-checked. Unknown fields are skipped, as protobuf requires,
 * so newer OTLP versions decode.
 * Field numbers: opentelemetry-proto, trace/v1/trace.proto, common/v1/common.proto.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_DEPTH 16

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
    *field = (uint32_t)(tag >> 3);
    *wire = (uint32_t)(tag & 7);
    if (*field == 0) return fail("field number 0");
    return 0;
}

/* Skip one field's value; groups (deprecated, wire types 3/4) are skipped to their end tag. */
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
    if (depth > MAX_DEPTH) return fail("groups nested too deep");
    for (;;) {
        if (read_tag(r, &f, &w) < 0) return -1;
        if (w == 4) return f == field ? 0 : fail("mismatched end of group");
        if (skip_field(r, f, w, depth) < 0) return -1;
    }
}


static PyObject *any_value(Reader *r, int depth);

/* KeyValue list entries -> dict[key] = value; used for attributes and kvlist_value. */
static int key_value(Reader *r, PyObject *dict, int depth) {
    PyObject *key = NULL, *value = NULL;
    uint32_t field, wire;
    while (r->p < r->end) {
        if (read_tag(r, &field, &wire) < 0) goto error;
        if (field == 1 && wire == 2) {
            Reader s;
            if (read_len(r, &s) < 0) goto error;
            Py_XDECREF(key);
            key = PyUnicode_DecodeUTF8((const char *)s.p, s.end - s.p, "strict");
            if (!key) goto error;
        } else if (field == 2 && wire == 2) {
            Reader s;
            if (read_len(r, &s) < 0) goto error;
            Py_XDECREF(value);
            value = any_value(&s, depth + 1);
            if (!value) goto error;
        } else if (skip_field(r, field, wire, 0) < 0) {
            goto error;
        }
    }
    if (key) {
        if (PyDict_SetItem(dict, key, value ? value : Py_None) < 0) goto error;
    }
    Py_XDECREF(key);
    Py_XDECREF(value);
    return 0;
error:
    Py_XDECREF(key);
    Py_XDECREF(value);
    return -1;
}

static PyObject *any_value(Reader *r, int depth) {
    if (depth > MAX_DEPTH) {
        fail("attribute values nested too deep");
        return NULL;
    }
    PyObject *out = NULL;
    uint32_t field, wire;
    while (r->p < r->end) {
        if (read_tag(r, &field, &wire) < 0) goto error;
        PyObject *next = NULL;
        uint64_t v;
        Reader s;
        if (field == 1 && wire == 2) { /* string_value */
            if (read_len(r, &s) < 0) goto error;
            next = PyUnicode_DecodeUTF8((const char *)s.p, s.end - s.p, "strict");
        } else if (field == 2 && wire == 0) { /* bool_value */
            if (read_varint(r, &v) < 0) goto error;
            next = PyBool_FromLong(v != 0);
        } else if (field == 3 && wire == 0) { /* int_value */
            if (read_varint(r, &v) < 0) goto error;
            next = PyLong_FromLongLong((long long)v);
        } else if (field == 4 && wire == 1) { /* double_value */
            double d;
            if (read_fixed64(r, &v) < 0) goto error;
            memcpy(&d, &v, 8);
            next = PyFloat_FromDouble(d);
        } else if (field == 5 && wire == 2) { /* array_value: ArrayValue{repeated AnyValue values = 1} */
            if (read_len(r, &s) < 0) goto error;
            next = PyList_New(0);
            while (next && s.p < s.end) {
                Reader e;
                if (read_tag(&s, &field, &wire) < 0) { Py_CLEAR(next); break; }
                if (field != 1 || wire != 2) {
                    if (skip_field(&s, field, wire, 0) < 0) Py_CLEAR(next);
                    continue;
                }
                if (read_len(&s, &e) < 0) { Py_CLEAR(next); break; }
                PyObject *item = any_value(&e, depth + 1);
                if (!item || PyList_Append(next, item) < 0) Py_CLEAR(next);
                Py_XDECREF(item);
            }
        } else if (field == 6 && wire == 2) { /* kvlist_value: KeyValueList{repeated KeyValue values = 1} */
            if (read_len(r, &s) < 0) goto error;
            next = PyDict_New();
            while (next && s.p < s.end) {
                Reader e;
                if (read_tag(&s, &field, &wire) < 0) { Py_CLEAR(next); break; }
                if (field != 1 || wire != 2) {
                    if (skip_field(&s, field, wire, 0) < 0) Py_CLEAR(next);
                    continue;
                }
                if (read_len(&s, &e) < 0 || key_value(&e, next, depth + 1) < 0) Py_CLEAR(next);
            }
        } else if (field == 7 && wire == 2) { /* bytes_value */
            if (read_len(r, &s) < 0) goto error;
            next = PyBytes_FromStringAndSize((const char *)s.p, s.end - s.p);
        } else {
            if (skip_field(r, field, wire, 0) < 0) goto error;
            continue;
        }
        if (!next) goto error;
        Py_XSETREF(out, next); /* a oneof: the last value on the wire wins */
    }
    if (!out) Py_RETURN_NONE;
    return out;
error:
    Py_XDECREF(out);
    return NULL;
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

static int utf8_valid(const uint8_t *p, const uint8_t *end) {
    while (p < end) {
        uint8_t c = *p;
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

/* An AnyValue as JSON, as Python's json.dumps(default=bytes.hex) writes it; non-finite doubles as null. */
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

static int json_key_value(Buf *b, Reader key, Reader value, int depth);

static int json_any(Buf *b, Reader *r, int depth) {
    if (depth > MAX_DEPTH) return fail("attribute values nested too deep");
    Reader last = {NULL, NULL};
    uint32_t field, wire, kind = 0;
    uint64_t v = 0;
    while (r->p < r->end) { /* a oneof: the last value on the wire wins */
        if (read_tag(r, &field, &wire) < 0) return -1;
        if ((field == 2 || field == 3) && wire == 0) {
            if (read_varint(r, &v) < 0) return -1;
        } else if (field == 4 && wire == 1) {
            if (read_fixed64(r, &v) < 0) return -1;
        } else if ((field == 1 || field == 5 || field == 6 || field == 7) && wire == 2) {
            if (read_len(r, &last) < 0) return -1;
        } else {
            if (skip_field(r, field, wire, 0) < 0) return -1;
            continue;
        }
        kind = field;
    }
    char number[64];
    switch (kind) {
    case 1: return json_string(b, last.p, last.end);
    case 2: return puts_(b, v ? "true" : "false");
    case 3:
        snprintf(number, sizeof number, "%lld", (long long)v);
        return puts_(b, number);
    case 4: {
        double d;
        memcpy(&d, &v, 8);
        if (!isfinite(d)) return puts_(b, "null");
        char *repr = PyOS_double_to_string(d, 'r', 0, Py_DTSF_ADD_DOT_0, NULL);
        if (!repr) return -1;
        int rc = puts_(b, repr);
        PyMem_Free(repr);
        return rc;
    }
    case 5:
    case 6: { /* ArrayValue / KeyValueList: repeated field 1 */
        int first = 1;
        if (put(b, kind == 5 ? "[" : "{", 1) < 0) return -1;
        while (last.p < last.end) {
            Reader e;
            if (read_tag(&last, &field, &wire) < 0) return -1;
            if (field != 1 || wire != 2) {
                if (skip_field(&last, field, wire, 0) < 0) return -1;
                continue;
            }
            if (read_len(&last, &e) < 0 || (!first && puts_(b, ", ") < 0)) return -1;
            first = 0;
            if (kind == 5) {
                if (json_any(b, &e, depth + 1) < 0) return -1;
            } else {
                Reader key = {NULL, NULL}, value = {NULL, NULL};
                while (e.p < e.end) {
                    if (read_tag(&e, &field, &wire) < 0) return -1;
                    if (field == 1 && wire == 2) {
                        if (read_len(&e, &key) < 0) return -1;
                    } else if (field == 2 && wire == 2) {
                        if (read_len(&e, &value) < 0) return -1;
                    } else if (skip_field(&e, field, wire, 0) < 0) {
                        return -1;
                    }
                }
                if (json_key_value(b, key, value, depth + 1) < 0) return -1;
            }
        }
        return put(b, kind == 5 ? "]" : "}", 1);
    }
    case 7:
        if (put(b, "\"", 1) < 0) return -1;
        for (const uint8_t *p = last.p; p < last.end; p++) {
            snprintf(number, sizeof number, "%02x", *p);
            if (put(b, number, 2) < 0) return -1;
        }
        return put(b, "\"", 1);
    default: return puts_(b, "null");
    }
}

static int json_key_value(Buf *b, Reader key, Reader value, int depth) {
    static const uint8_t empty[1] = {0};
    if (json_string(b, key.p ? key.p : empty, key.p ? key.end : empty) < 0 || puts_(b, ": ") < 0) return -1;
    if (!value.p) return puts_(b, "null");
    return json_any(b, &value, depth);
}

/* What the caller asked for, and the columns being filled. */
typedef struct {
    Py_ssize_t n_wanted;
    const char **key;
    Py_ssize_t *key_len;
    Column *col; /* COL_WANTED + n_wanted + 1 */
    Py_ssize_t rows;
    PyObject *odd;
    Buf json;     /* scratch: one span's other attributes */
    Reader *slot; /* per span: the last value of each wanted key */
    Reader *other_key, *other_value; /* max_attributes entries */
    Py_ssize_t n_other;
    int32_t *index;   /* open addressing over other_key: 1 + its position, 0 empty; n_index slots */
    Py_ssize_t n_index;
    Py_ssize_t max_attributes, n_attributes;
    PyObject *crowded; /* rows of spans with more than max_attributes attributes */
} Decoder;

enum { COL_RESOURCE, COL_TRACE_ID, COL_SPAN_ID, COL_PARENT, COL_NAME, COL_START, COL_END, COL_WANTED };
static const char FIXED_TYPES[COL_WANTED] = {'i', 'b', 'b', 'b', 's', 'u', 'u'};

/* A wanted attribute's cell, typed; a value of another type becomes null plus an `odd` entry. */
static int wanted_cell(Decoder *d, Py_ssize_t i, Reader value) {
    Column *c = &d->col[COL_WANTED + i];
    Reader r = value, s = {NULL, NULL};
    uint32_t field = 0, wire, kind = 0;
    uint64_t v = 0;
    while (r.p && r.p < r.end) {
        if (read_tag(&r, &field, &wire) < 0) return -1;
        if ((field == 2 || field == 3) && wire == 0) {
            if (read_varint(&r, &v) < 0) return -1;
        } else if (field == 4 && wire == 1) {
            if (read_fixed64(&r, &v) < 0) return -1;
        } else if ((field == 1 || field == 5 || field == 6 || field == 7) && wire == 2) {
            if (read_len(&r, &s) < 0) return -1;
        } else {
            if (skip_field(&r, field, wire, 0) < 0) return -1;
            continue;
        }
        kind = field;
    }
    if (!value.p || kind == 0) /* absent, or an empty AnyValue: null */
        return var_width(c->type) ? cell_bytes(c, d->rows, NULL, 0, 0) : cell_fixed(c, d->rows, NULL, 0);
    int64_t i64 = (int64_t)v;
    if (c->type == 's' && kind == 1) {
        if (!utf8_valid(s.p, s.end)) return fail("string is not UTF-8");
        return cell_bytes(c, d->rows, s.p, s.end - s.p, 1);
    }
    if (c->type == 'q' && kind == 3) return cell_fixed(c, d->rows, &i64, 1);
    if (c->type == 'i' && kind == 3 && i64 >= INT32_MIN && i64 <= INT32_MAX) {
        int32_t i32 = (int32_t)i64;
        return cell_fixed(c, d->rows, &i32, 1);
    }
    if (c->type == 'd' && (kind == 3 || kind == 4)) {
        double x;
        if (kind == 3)
            x = (double)i64;
        else
            memcpy(&x, &v, 8);
        return cell_fixed(c, d->rows, &x, 1);
    }
    Reader again = value;
    PyObject *sent = any_value(&again, 0);
    PyObject *entry = sent ? Py_BuildValue("(nnO)", d->rows, i, sent) : NULL;
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
static int span_attribute(Decoder *d, Reader *r) {
    Reader key = {NULL, NULL}, value = {NULL, NULL};
    uint32_t field, wire;
    if (++d->n_attributes > d->max_attributes) return 0;
    while (r->p < r->end) {
        if (read_tag(r, &field, &wire) < 0) return -1;
        if (field == 1 && wire == 2) {
            if (read_len(r, &key) < 0) return -1;
        } else if (field == 2 && wire == 2) {
            if (read_len(r, &value) < 0) return -1;
        } else if (skip_field(r, field, wire, 0) < 0) {
            return -1;
        }
    }
    if (!key.p) return 0;
    Py_ssize_t klen = key.end - key.p;
    for (Py_ssize_t i = 0; i < d->n_wanted; i++) {
        if (d->key_len[i] == klen && memcmp(d->key[i], key.p, klen) == 0) {
            d->slot[i] = value.p ? value : (Reader){key.end, key.end}; /* present, maybe empty */
            return 0;
        }
    }
    /* a repeated key: the last value wins, in the first place */
    size_t h = 14695981039346656037u; /* FNV-1a */
    for (const uint8_t *p = key.p; p < key.end; p++) h = (h ^ *p) * 1099511628211u;
    for (size_t at = h & (d->n_index - 1);; at = (at + 1) & (d->n_index - 1)) {
        int32_t i = d->index[at] - 1;
        if (i < 0) {
            d->index[at] = (int32_t)d->n_other + 1;
            d->other_key[d->n_other] = key;
            d->other_value[d->n_other++] = value;
            return 0;
        }
        if (d->other_key[i].end - d->other_key[i].p == klen && memcmp(d->other_key[i].p, key.p, klen) == 0) {
            d->other_value[i] = value;
            return 0;
        }
    }
}

static void forget_others(Decoder *d) {
    if (d->n_other) memset(d->index, 0, d->n_index * sizeof(int32_t));
    d->n_other = 0;
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
    forget_others(d);
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
            case 9: if (span_attribute(d, &s) < 0) return -1; break;
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
        forget_others(d);
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
    if (d->n_other) {
        if (put(&d->json, "{", 1) < 0) return -1;
        for (Py_ssize_t i = 0; i < d->n_other; i++) {
            if ((i && puts_(&d->json, ", ") < 0) || json_key_value(&d->json, d->other_key[i], d->other_value[i], 0) < 0)
                return -1;
        }
        if (put(&d->json, "}", 1) < 0) return -1;
    }
    if (cell_bytes(json, row, (const uint8_t *)d->json.data, d->json.len, d->n_other > 0) < 0) return -1;
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
                    if (read_len(&s, &kv) < 0 || key_value(&kv, attrs, 0) < 0) goto done;
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

/* One ExportTraceServiceRequest body into the columns. */
static int request(Decoder *d, PyObject *body, PyObject *resources) {
    Py_buffer view;
    if (PyObject_GetBuffer(body, &view, PyBUF_SIMPLE) < 0) return -1;
    Reader r = {(const uint8_t *)view.buf, (const uint8_t *)view.buf + view.len};
    uint32_t field, wire;
    int rc = 0;
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
    for (d.n_index = 2; d.n_index < 2 * d.max_attributes; d.n_index *= 2) {
    }
    d.n_wanted = PyTuple_GET_SIZE(wanted);
    Py_ssize_t n_columns = COL_WANTED + d.n_wanted + 1;
    d.key = PyMem_Calloc(d.n_wanted + 1, sizeof(char *));
    d.key_len = PyMem_Calloc(d.n_wanted + 1, sizeof(Py_ssize_t));
    d.slot = PyMem_Calloc(d.n_wanted + 1, sizeof(Reader));
    d.col = PyMem_Calloc(n_columns, sizeof(Column));
    d.other_key = PyMem_Calloc(d.max_attributes, sizeof(Reader));
    d.other_value = PyMem_Calloc(d.max_attributes, sizeof(Reader));
    d.index = PyMem_Calloc(d.n_index, sizeof(int32_t));
    marks = PyMem_Calloc(n_columns, sizeof(Mark));
    d.odd = PyList_New(0);
    d.crowded = PyList_New(0);
    resources = PyList_New(0);
    owners = PyList_New(0);
    errors = PyList_New(0);
    if (!d.key || !d.key_len || !d.slot || !d.col || !d.other_key || !d.other_value || !d.index || !marks || !d.odd ||
        !d.crowded || !resources || !owners || !errors)
        goto done;
    for (Py_ssize_t i = 0; i < COL_WANTED; i++) d.col[i].type = FIXED_TYPES[i];
    for (Py_ssize_t i = 0; i < d.n_wanted; i++) {
        const char *type;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(wanted, i), "s#s", &d.key[i], &d.key_len[i], &type)) goto done;
        if (strlen(type) != 1 || !strchr("qids", type[0])) {
            PyErr_Format(PyExc_ValueError, "unknown column type %s", type);
            goto done;
        }
        d.col[COL_WANTED + i].type = type[0];
    }
    d.col[n_columns - 1].type = 's';
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
    columns = PyList_New(n_columns);
    if (!columns) goto done;
    for (Py_ssize_t i = 0; i < n_columns; i++) {
        PyObject *buffers = column_buffers(&d.col[i], d.rows);
        if (!buffers) goto done;
        PyList_SET_ITEM(columns, i, buffers);
    }
    out = Py_BuildValue("(OOnOOOO)", resources, owners, d.rows, columns, d.odd, d.crowded, errors);
done:
    if (d.col) {
        for (Py_ssize_t i = 0; i < n_columns; i++) {
            PyMem_Free(d.col[i].valid.data);
            PyMem_Free(d.col[i].values.data);
            PyMem_Free(d.col[i].offsets.data);
        }
    }
    PyMem_Free(d.col);
    PyMem_Free(marks);
    PyMem_Free(d.key);
    PyMem_Free(d.key_len);
    PyMem_Free(d.slot);
    PyMem_Free(d.other_key);
    PyMem_Free(d.other_value);
    PyMem_Free(d.index);
    PyMem_Free(d.json.data);
    Py_XDECREF(d.odd);
    Py_XDECREF(d.crowded);
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
     "traces(bodies, wanted, max_attributes) -> (resources, owners, spans, columns, odd, crowded, errors):\n"
     "ExportTraceServiceRequests"
     "in Arrow's columnar layout; see the module's source for the columns."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_otlpwire", NULL, -1, methods};

PyMODINIT_FUNC PyInit__otlpwire(void) { return PyModule_Create(&module); }
