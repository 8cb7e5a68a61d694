/*
 * OTLP ExportTraceServiceRequest wire decoder: the ingest hot path.
 *
 * The protobuf runtime's Python objects cost about 2 us per attribute; this
 * walks the wire format once and returns plain Python values, so the
 * collector's Python code only maps known attribute names onto columns.
 *
 * traces(body: bytes) -> list[(resource_attrs: dict, spans: list[span])]
 * span = (trace_id: bytes, span_id: bytes, parent_span_id: bytes, name: str,
 *         start_ns: int, end_ns: int, attrs: dict)
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

static int skip(Reader *r, uint32_t wire) {
    uint64_t v;
    Reader sub;
    switch (wire) {
    case 0: return read_varint(r, &v);
    case 1: return read_fixed64(r, &v);
    case 2: return read_len(r, &sub);
    case 5:
        if (r->end - r->p < 4) return fail("truncated fixed32");
        r->p += 4;
        return 0;
    default: return fail("unsupported wire type");
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
        } else if (skip(r, wire) < 0) {
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
                    if (skip(&s, wire) < 0) Py_CLEAR(next);
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
                    if (skip(&s, wire) < 0) Py_CLEAR(next);
                    continue;
                }
                if (read_len(&s, &e) < 0 || key_value(&e, next, depth + 1) < 0) Py_CLEAR(next);
            }
        } else if (field == 7 && wire == 2) { /* bytes_value */
            if (read_len(r, &s) < 0) goto error;
            next = PyBytes_FromStringAndSize((const char *)s.p, s.end - s.p);
        } else {
            if (skip(r, wire) < 0) goto error;
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

static PyObject *span(Reader *r) {
    PyObject *trace_id = NULL, *span_id = NULL, *parent = NULL, *name = NULL, *attrs = PyDict_New();
    uint64_t start = 0, end = 0;
    uint32_t field, wire;
    if (!attrs) return NULL;
    while (r->p < r->end) {
        Reader s;
        if (read_tag(r, &field, &wire) < 0) goto error;
        if (wire == 2 && (field == 1 || field == 2 || field == 4 || field == 5 || field == 9)) {
            if (read_len(r, &s) < 0) goto error;
            switch (field) {
            case 1: Py_XSETREF(trace_id, bytes_of(&s)); if (!trace_id) goto error; break;
            case 2: Py_XSETREF(span_id, bytes_of(&s)); if (!span_id) goto error; break;
            case 4: Py_XSETREF(parent, bytes_of(&s)); if (!parent) goto error; break;
            case 5:
                Py_XSETREF(name, PyUnicode_DecodeUTF8((const char *)s.p, s.end - s.p, "strict"));
                if (!name) goto error;
                break;
            case 9: if (key_value(&s, attrs, 0) < 0) goto error; break;
            }
        } else if (field == 7 && wire == 1) {
            if (read_fixed64(r, &start) < 0) goto error;
        } else if (field == 8 && wire == 1) {
            if (read_fixed64(r, &end) < 0) goto error;
        } else if (skip(r, wire) < 0) {
            goto error;
        }
    }
    PyObject *out = Py_BuildValue("(OOOOKKO)", trace_id ? trace_id : Py_None, span_id ? span_id : Py_None,
                                  parent ? parent : Py_None, name ? name : Py_None,
                                  (unsigned long long)start, (unsigned long long)end, attrs);
    Py_XDECREF(trace_id); Py_XDECREF(span_id); Py_XDECREF(parent); Py_XDECREF(name); Py_DECREF(attrs);
    return out;
error:
    Py_XDECREF(trace_id); Py_XDECREF(span_id); Py_XDECREF(parent); Py_XDECREF(name); Py_DECREF(attrs);
    return NULL;
}

/* ScopeSpans{scope = 1; repeated Span spans = 2} -> appended to `spans`. */
static int scope_spans(Reader *r, PyObject *spans) {
    uint32_t field, wire;
    while (r->p < r->end) {
        Reader s;
        if (read_tag(r, &field, &wire) < 0) return -1;
        if (field == 2 && wire == 2) {
            if (read_len(r, &s) < 0) return -1;
            PyObject *item = span(&s);
            if (!item) return -1;
            int rc = PyList_Append(spans, item);
            Py_DECREF(item);
            if (rc < 0) return -1;
        } else if (skip(r, wire) < 0) {
            return -1;
        }
    }
    return 0;
}

/* ResourceSpans{resource = 1 (Resource{repeated KeyValue attributes = 1}); repeated ScopeSpans = 2}. */
static PyObject *resource_spans(Reader *r) {
    PyObject *attrs = PyDict_New(), *spans = PyList_New(0);
    uint32_t field, wire;
    if (!attrs || !spans) goto error;
    while (r->p < r->end) {
        Reader s;
        if (read_tag(r, &field, &wire) < 0) goto error;
        if (field == 1 && wire == 2) {
            if (read_len(r, &s) < 0) goto error;
            while (s.p < s.end) {
                Reader kv;
                if (read_tag(&s, &field, &wire) < 0) goto error;
                if (field == 1 && wire == 2) {
                    if (read_len(&s, &kv) < 0 || key_value(&kv, attrs, 0) < 0) goto error;
                } else if (skip(&s, wire) < 0) {
                    goto error;
                }
            }
        } else if (field == 2 && wire == 2) {
            if (read_len(r, &s) < 0 || scope_spans(&s, spans) < 0) goto error;
        } else if (skip(r, wire) < 0) {
            goto error;
        }
    }
    PyObject *out = PyTuple_Pack(2, attrs, spans);
    Py_DECREF(attrs);
    Py_DECREF(spans);
    return out;
error:
    Py_XDECREF(attrs);
    Py_XDECREF(spans);
    return NULL;
}

static PyObject *traces(PyObject *module, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    Reader r = {(const uint8_t *)view.buf, (const uint8_t *)view.buf + view.len};
    PyObject *out = PyList_New(0);
    uint32_t field, wire;
    while (out && r.p < r.end) {
        Reader s;
        if (read_tag(&r, &field, &wire) < 0) { Py_CLEAR(out); break; }
        if (field == 1 && wire == 2) {
            if (read_len(&r, &s) < 0) { Py_CLEAR(out); break; }
            PyObject *item = resource_spans(&s);
            if (!item || PyList_Append(out, item) < 0) Py_CLEAR(out);
            Py_XDECREF(item);
        } else if (skip(&r, wire) < 0) {
            Py_CLEAR(out);
        }
    }
    PyBuffer_Release(&view);
    return out;
}

static PyMethodDef methods[] = {
    {"traces", traces, METH_O, "Decode an ExportTraceServiceRequest into plain Python values."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_otlpwire", NULL, -1, methods};

PyMODINIT_FUNC PyInit__otlpwire(void) { return PyModule_Create(&module); }
