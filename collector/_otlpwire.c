/*
 * OTLP ExportTraceServiceRequest wire decoder: the ingest hot path.
 *
 * The protobuf runtime's Python objects cost about 2 us per attribute; this
 * walks the wire format once and returns columns of plain Python values that
 * pyarrow converts whole, so no Python code runs per span.
 *
 * traces(body: bytes, keys: tuple[str, ...]) -> (resources, columns)
 *   resources: one dict of attributes per ResourceSpans
 *   columns: lists, one cell per span: resource index, trace_id, span_id,
 *     parent_span_id (None when empty), name, start_ns, end_ns, then one
 *     column per wanted attribute key (None where absent), then a dict of the
 *     span's other attributes (None when it has none).
 *
 * Every read is bounds-checked; malformed input raises ValueError. Unknown
 * fields are skipped, as protobuf requires, so newer OTLP versions decode.
 * Field numbers: opentelemetry-proto, trace/v1/trace.proto, common/v1/common.proto.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
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

static PyObject *bytes_of(Reader *s) {
    return PyBytes_FromStringAndSize((const char *)s->p, s->end - s->p);
}

/* The attribute keys the caller wants as columns, as UTF-8 for memcmp. */
typedef struct {
    Py_ssize_t n;
    const char **key;
    Py_ssize_t *len;
} Keys;

/* Column layout of traces()' result. */
enum { COL_RESOURCE, COL_TRACE_ID, COL_SPAN_ID, COL_PARENT, COL_NAME, COL_START, COL_END, COL_KEYS };

static int append(PyObject *list, PyObject *item) {
    /* steals item */
    if (!item) return -1;
    int rc = PyList_Append(list, item);
    Py_DECREF(item);
    return rc;
}

/* One KeyValue of a span: into its column slot when wanted, else into `other`. */
static int span_attribute(Reader *r, const Keys *keys, PyObject **slots, PyObject **other) {
    Reader key = {NULL, NULL}, val = {NULL, NULL};
    uint32_t field, wire;
    while (r->p < r->end) {
        if (read_tag(r, &field, &wire) < 0) return -1;
        if (field == 1 && wire == 2) {
            if (read_len(r, &key) < 0) return -1;
        } else if (field == 2 && wire == 2) {
            if (read_len(r, &val) < 0) return -1;
        } else if (skip_field(r, field, wire, 0) < 0) {
            return -1;
        }
    }
    if (!key.p) return 0;
    Py_ssize_t klen = key.end - key.p;
    PyObject *value;
    if (val.p) {
        value = any_value(&val, 0);
    } else {
        value = Py_None;
        Py_INCREF(value);
    }
    if (!value) return -1;
    for (Py_ssize_t i = 0; i < keys->n; i++) {
        if (keys->len[i] == klen && memcmp(keys->key[i], key.p, klen) == 0) {
            Py_XSETREF(slots[i], value);
            return 0;
        }
    }
    PyObject *name = PyUnicode_DecodeUTF8((const char *)key.p, klen, "strict");
    if (!name || (!*other && !(*other = PyDict_New()))) {
        Py_XDECREF(name);
        Py_DECREF(value);
        return -1;
    }
    int rc = PyDict_SetItem(*other, name, value);
    Py_DECREF(name);
    Py_DECREF(value);
    return rc;
}

/* One Span message -> one cell appended to every column. */
static int span(Reader *r, const Keys *keys, PyObject *columns, PyObject *resource) {
    PyObject *trace_id = NULL, *span_id = NULL, *parent = NULL, *name = NULL, *other = NULL;
    PyObject **slots = PyMem_Calloc(keys->n ? keys->n : 1, sizeof(PyObject *));
    uint64_t start = 0, end = 0;
    uint32_t field, wire;
    int rc = -1;
    if (!slots) return -1;
    while (r->p < r->end) {
        Reader s;
        if (read_tag(r, &field, &wire) < 0) goto done;
        if (wire == 2 && (field == 1 || field == 2 || field == 4 || field == 5 || field == 9)) {
            if (read_len(r, &s) < 0) goto done;
            switch (field) {
            case 1: Py_XSETREF(trace_id, bytes_of(&s)); if (!trace_id) goto done; break;
            case 2: Py_XSETREF(span_id, bytes_of(&s)); if (!span_id) goto done; break;
            case 4: Py_XSETREF(parent, s.p == s.end ? NULL : bytes_of(&s)); break;
            case 5:
                Py_XSETREF(name, PyUnicode_DecodeUTF8((const char *)s.p, s.end - s.p, "strict"));
                if (!name) goto done;
                break;
            case 9: if (span_attribute(&s, keys, slots, &other) < 0) goto done; break;
            }
        } else if (field == 7 && wire == 1) {
            if (read_fixed64(r, &start) < 0) goto done;
        } else if (field == 8 && wire == 1) {
            if (read_fixed64(r, &end) < 0) goto done;
        } else if (skip_field(r, field, wire, 0) < 0) {
            goto done;
        }
    }
#define CELL(obj) ((obj) ? (Py_INCREF(obj), (obj)) : (Py_INCREF(Py_None), Py_None))
    if (append(PyList_GET_ITEM(columns, COL_RESOURCE), CELL(resource)) < 0) goto done;
    if (append(PyList_GET_ITEM(columns, COL_TRACE_ID), CELL(trace_id)) < 0) goto done;
    if (append(PyList_GET_ITEM(columns, COL_SPAN_ID), CELL(span_id)) < 0) goto done;
    if (append(PyList_GET_ITEM(columns, COL_PARENT), CELL(parent)) < 0) goto done;
    if (append(PyList_GET_ITEM(columns, COL_NAME), name ? CELL(name) : PyUnicode_FromString("")) < 0) goto done;
    if (append(PyList_GET_ITEM(columns, COL_START), PyLong_FromUnsignedLongLong(start)) < 0) goto done;
    if (append(PyList_GET_ITEM(columns, COL_END), PyLong_FromUnsignedLongLong(end)) < 0) goto done;
    for (Py_ssize_t i = 0; i < keys->n; i++)
        if (append(PyList_GET_ITEM(columns, COL_KEYS + i), CELL(slots[i])) < 0) goto done;
    if (append(PyList_GET_ITEM(columns, COL_KEYS + keys->n), CELL(other)) < 0) goto done;
#undef CELL
    rc = 0;
done:
    for (Py_ssize_t i = 0; i < keys->n; i++) Py_XDECREF(slots[i]);
    PyMem_Free(slots);
    Py_XDECREF(trace_id); Py_XDECREF(span_id); Py_XDECREF(parent); Py_XDECREF(name); Py_XDECREF(other);
    return rc;
}

/* ScopeSpans{scope = 1; repeated Span spans = 2}. */
static int scope_spans(Reader *r, const Keys *keys, PyObject *columns, PyObject *resource) {
    uint32_t field, wire;
    while (r->p < r->end) {
        Reader s;
        if (read_tag(r, &field, &wire) < 0) return -1;
        if (field == 2 && wire == 2) {
            if (read_len(r, &s) < 0 || span(&s, keys, columns, resource) < 0) return -1;
        } else if (skip_field(r, field, wire, 0) < 0) {
            return -1;
        }
    }
    return 0;
}

/* ResourceSpans{resource = 1 (Resource{repeated KeyValue attributes = 1}); repeated ScopeSpans = 2}. */
static int resource_spans(Reader *r, const Keys *keys, PyObject *columns, PyObject *resources) {
    PyObject *attrs = PyDict_New();
    PyObject *index = PyLong_FromSsize_t(PyList_GET_SIZE(resources));
    uint32_t field, wire;
    int rc = -1;
    if (!attrs || !index || PyList_Append(resources, attrs) < 0) goto done;
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
            if (read_len(r, &s) < 0 || scope_spans(&s, keys, columns, index) < 0) goto done;
        } else if (skip_field(r, field, wire, 0) < 0) {
            goto done;
        }
    }
    rc = 0;
done:
    Py_XDECREF(attrs);
    Py_XDECREF(index);
    return rc;
}

static PyObject *traces(PyObject *module, PyObject *args) {
    Py_buffer view;
    PyObject *key_tuple, *resources = NULL, *columns = NULL, *out = NULL;
    Keys keys = {0, NULL, NULL};
    if (!PyArg_ParseTuple(args, "y*O!", &view, &PyTuple_Type, &key_tuple)) return NULL;
    keys.n = PyTuple_GET_SIZE(key_tuple);
    keys.key = PyMem_Calloc(keys.n + 1, sizeof(char *));
    keys.len = PyMem_Calloc(keys.n + 1, sizeof(Py_ssize_t));
    if (!keys.key || !keys.len) goto done;
    for (Py_ssize_t i = 0; i < keys.n; i++) {
        keys.key[i] = PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(key_tuple, i), &keys.len[i]);
        if (!keys.key[i]) goto done;
    }
    resources = PyList_New(0);
    columns = PyList_New(COL_KEYS + keys.n + 1);
    if (!resources || !columns) goto done;
    for (Py_ssize_t i = 0; i < COL_KEYS + keys.n + 1; i++) {
        PyObject *col = PyList_New(0);
        if (!col) goto done;
        PyList_SET_ITEM(columns, i, col);
    }
    Reader r = {(const uint8_t *)view.buf, (const uint8_t *)view.buf + view.len};
    uint32_t field, wire;
    while (r.p < r.end) {
        Reader s;
        if (read_tag(&r, &field, &wire) < 0) goto done;
        if (field == 1 && wire == 2) {
            if (read_len(&r, &s) < 0 || resource_spans(&s, &keys, columns, resources) < 0) goto done;
        } else if (skip_field(&r, field, wire, 0) < 0) {
            goto done;
        }
    }
    out = PyTuple_Pack(2, resources, columns);
done:
    PyBuffer_Release(&view);
    PyMem_Free(keys.key);
    PyMem_Free(keys.len);
    Py_XDECREF(resources);
    Py_XDECREF(columns);
    return out;
}

static PyMethodDef methods[] = {
    {"traces", traces, METH_VARARGS,
     "traces(body, keys) -> (resource attribute dicts, columns): an ExportTraceServiceRequest as\n"
     "columns of plain Python values: resource index, trace_id, span_id, parent_span_id, name,\n"
     "start_ns, end_ns, one column per wanted attribute key, then a dict of the other attributes."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_otlpwire", NULL, -1, methods};

PyMODINIT_FUNC PyInit__otlpwire(void) { return PyModule_Create(&module); }
