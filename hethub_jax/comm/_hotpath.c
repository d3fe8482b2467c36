/* Hot path of MPIHostBridge.send / .recv(out=) for repeated messages (hethub_jax/comm/mpi.py).
 *
 * Why C: in MPICH's shared-memory transport (CMA single copy, on by default in the mpich wheel) a
 * large message is copied inside an MPI call of the receiver, and every instruction the receiver
 * runs between entering recv and that call, or between the copy and returning, adds to the
 * message's time, as does everything the sender runs before posting the payload. In Python these
 * paths cost a few microseconds each (interpreter state is cold after a 1 MiB copy); here they cost
 * a few hundred nanoseconds. Measured on a 1 MiB ping-pong (docs/benchmarks.md): 0.92-0.93 of raw
 * mpi4py Send/Recv with the Python paths, 0.98 with posting in C and checks in Python,
 * 1.00-1.08 with the checks here too (measured on a slower VM).
 *
 * Scope: the fast paths of repeated messages, whole: the checks that decide whether a call may
 * take them (exact numpy.ndarray, C-contiguous, the dtype object and shape of the entry its tag
 * or channel last used, ranks and tags in range, no receive waiting for its header), the posting
 * of the two messages of the bridge's wire protocol (payload on MPI tag tag2+1, header on tag2;
 * see mpi.py), a bounded busy-poll (spin) on them and, for a receive, the comparison of the
 * arrived header with the expected one. A call that does not qualify returns False before
 * posting anything and mpi.py takes its general path. Deadlines, timeouts, cancellation, header
 * decoding and error messages stay in Python: when the spin budget runs out or MPI reports an
 * error, the functions return the still-active request handles and mpi.py continues with mpi4py
 * Request objects made from them. The bridge's state (dicts, scratch buffer) stays Python
 * objects, owned and updated by mpi.py; this module only reads them.
 *
 * ABI: handles are passed as the integers mpi4py's `.handle` gives (MPICH: the C int,
 * sign-extended to 64 bits). mpi.py imports this module only after checking that COMM_WORLD,
 * BYTE and REQUEST_NULL below equal mpi4py's, i.e. that both use the same MPI library and ABI.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <mpi.h>
#include <limits.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

/* Version of the calls mpi.py makes (send/recv/init and the state tuple); mpi.py ignores a
 * module built from another version (e.g. a stale in-place build) and runs its Python paths. */
#define HOTPATH_INTERFACE 2

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* mpi4py's integer form of a handle: the C value, sign-extended to 64 bits. */
#define HANDLE_TO_PY(h) PyLong_FromUnsignedLongLong((unsigned long long)(long long)(intptr_t)(h))
#define PY_TO_HANDLE(type, v) ((type)(intptr_t)(long long)(v))

/* Test r[0], then r[1], ... until each has completed, for at most spin_s seconds (the clock is read
 * every 16 tests; after 0.2 ms the CPU is yielded every 256 tests so oversubscribed ranks still run,
 * as in base.poll_until). Returns 1 if all completed, 0 if the budget ran out; *err gets the MPI
 * error code of a failed test (then returns 0 at once). Runs without the GIL. */
static int spin(MPI_Request *r, int n, double spin_s, int *err) {
    unsigned long k = 0;
    double start = -1.0;
    for (int i = 0; i < n; i++) {
        for (;;) {
            int flag = 0;
            int e = MPI_Test(&r[i], &flag, MPI_STATUS_IGNORE);
            if (e != MPI_SUCCESS) {
                *err = e;
                return 0;
            }
            if (flag)
                break;
            if (++k & 15)
                continue;
            double t = now_s();
            if (start < 0.0)
                start = t;
            else if (t - start >= spin_s)
                return 0;
            if (!(k & 255) && t - start > 2e-4)
                sched_yield();
        }
    }
    return 1;
}

/* None if both requests completed; else (mpi_error_code, payload_request, header_request) with the
 * handles of requests not yet completed (REQUEST_NULL for completed or never posted ones). */
static PyObject *result(int done, int err, MPI_Request payload, MPI_Request header) {
    if (done && err == MPI_SUCCESS)
        Py_RETURN_NONE;
    PyObject *a = HANDLE_TO_PY(payload), *b = HANDLE_TO_PY(header);
    PyObject *t = (a && b) ? Py_BuildValue("(iOO)", err, a, b) : NULL;
    Py_XDECREF(a);
    Py_XDECREF(b);
    return t;
}

/* The bridge's fixed per-communicator state, a tuple built once in MPIHostBridge.__init__:
 * (comm handle, last_sent dict, pending dict, size, max_tag, hot_spin_s, spin_s, hscratch, expected).
 * The dicts and the bytearray are the bridge's own objects (mutated in place, never replaced). */
typedef struct {
    MPI_Comm comm;
    PyObject *last_sent, *pending, *hscratch, *expected; /* borrowed from the tuple */
    long size, max_tag;
    double hot_spin, spin_s;
} state_t;

static PyObject *ndarray_type; /* numpy.ndarray, set by init() */
static PyObject *str_dtype;    /* interned "dtype" */

static int parse_state(PyObject *st, state_t *s) {
    if (!PyTuple_CheckExact(st) || PyTuple_GET_SIZE(st) != 9) {
        PyErr_SetString(PyExc_TypeError, "_hotpath: bad bridge state tuple");
        return -1;
    }
    s->comm = PY_TO_HANDLE(MPI_Comm, PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(st, 0)));
    s->last_sent = PyTuple_GET_ITEM(st, 1);
    s->pending = PyTuple_GET_ITEM(st, 2);
    s->size = PyLong_AsLong(PyTuple_GET_ITEM(st, 3));
    s->max_tag = PyLong_AsLong(PyTuple_GET_ITEM(st, 4));
    s->hot_spin = PyFloat_AsDouble(PyTuple_GET_ITEM(st, 5));
    s->spin_s = PyFloat_AsDouble(PyTuple_GET_ITEM(st, 6));
    s->hscratch = PyTuple_GET_ITEM(st, 7);
    s->expected = PyTuple_GET_ITEM(st, 8);
    if (PyErr_Occurred())
        return -1;
    if (!PyDict_Check(s->last_sent) || !PyDict_Check(s->pending) || !PyDict_Check(s->expected)) {
        PyErr_SetString(PyExc_TypeError, "_hotpath: bad bridge state tuple");
        return -1;
    }
    return 0;
}

/* A plain (not bool) Python int in [0, hi] as a C int; -1 if it is not one (no error set). */
static int small_int(PyObject *v, long hi) {
    if (!PyLong_CheckExact(v))
        return -1;
    long x = PyLong_AsLong(v);
    if (x == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    return (x < 0 || x > hi || x > INT_MAX) ? -1 : (int)x;
}

/* Spin budget of one call: hot_spin when timeout is None, else min(timeout, spin_s); -1 when
 * timeout is not a number >= 0 (no error set: the Python path validates and reports it). */
static double spin_budget(const state_t *s, PyObject *timeout) {
    if (timeout == Py_None)
        return s->hot_spin;
    double t = PyFloat_AsDouble(timeout);
    if (t == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        return -1.0;
    }
    if (!(t >= 0.0))
        return -1.0;
    return t < s->spin_s ? t : s->spin_s;
}

/* 1 if array x (buffer b) has exactly the dtype object `dtype` (identity, as Python's `is`) and
 * the shape in tuple `shape`; 0 if not; -1 with an error set. */
static int same_kind(PyObject *x, const Py_buffer *b, PyObject *dtype, PyObject *shape) {
    PyObject *d = PyObject_GetAttr(x, str_dtype);
    if (d == NULL)
        return -1;
    int same = d == dtype;
    Py_DECREF(d);
    if (!same || !PyTuple_CheckExact(shape) || PyTuple_GET_SIZE(shape) != b->ndim)
        return 0;
    for (int i = 0; i < b->ndim; i++) {
        Py_ssize_t n = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, i));
        if (n == -1 && PyErr_Occurred())
            return -1;
        if (n != b->shape[i])
            return 0;
    }
    return 1;
}

/* Post the bridge's two messages (data on MPI tag tag2+1, header on tag2) to or from peer and
 * spin on them without the GIL: a send tests the payload first, a receive the header first.
 * Returns None if both completed, else the (err, payload, header) tuple of result(). */
static PyObject *post_and_spin(MPI_Comm comm, Py_buffer *db, void *hbuf, int hlen, int peer,
                               int tag2, double spin_s, int is_recv, int *completed) {
    MPI_Request r[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL}; /* in test order */
    MPI_Request *rd = &r[is_recv ? 1 : 0], *rh = &r[is_recv ? 0 : 1];
    int err = MPI_SUCCESS, done = 0;
    Py_BEGIN_ALLOW_THREADS
    if (is_recv) {
        err = MPI_Irecv(db->buf, (int)db->len, MPI_BYTE, peer, tag2 + 1, comm, rd);
        if (err == MPI_SUCCESS)
            err = MPI_Irecv(hbuf, hlen, MPI_BYTE, peer, tag2, comm, rh);
    } else {
        err = MPI_Isend(db->buf, (int)db->len, MPI_BYTE, peer, tag2 + 1, comm, rd);
        if (err == MPI_SUCCESS)
            err = MPI_Isend(hbuf, hlen, MPI_BYTE, peer, tag2, comm, rh);
    }
    if (err == MPI_SUCCESS)
        done = spin(r, 2, spin_s, &err);
    Py_END_ALLOW_THREADS
    *completed = done && err == MPI_SUCCESS;
    return result(done, err, *rd, *rh);
}

/* Get x's buffer if x is an exact numpy.ndarray that is C-contiguous (and writable if asked) with
 * 0 < bytes <= 2**31-1 (min_len 1) or 0 <= bytes (min_len 0). 1: got it; 0: not such an array
 * (no error set). */
static int array_buffer(PyObject *x, Py_buffer *b, int writable, Py_ssize_t min_len) {
    if ((PyObject *)Py_TYPE(x) != ndarray_type)
        return 0;
    if (PyObject_GetBuffer(x, b, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) {
        PyErr_Clear(); /* not C-contiguous, read-only, or a dtype without buffer export */
        return 0;
    }
    if (b->len < min_len || b->len > INT_MAX) {
        PyBuffer_Release(b);
        return 0;
    }
    return 1;
}

/* One call of send() or recv(): its arguments and the bridge state they refer to. */
typedef struct {
    state_t s;
    PyObject *arr, *peer, *tag; /* borrowed: x or out, dest or source, tag */
    double spin_s;
} call_t;

/* Common start of send() and recv(): unpack (state, array, peer, tag, timeout), parse the state
 * and work out the spin budget. 1: go on; 0: not applicable, a receive waits for its header or the
 * timeout is no number >= 0 (the caller returns False); -1: an error is set. */
static int begin_call(PyObject *args, const char *name, call_t *c) {
    PyObject *st, *timeout;
    if (!PyArg_UnpackTuple(args, name, 5, 5, &st, &c->arr, &c->peer, &c->tag, &timeout) ||
        parse_state(st, &c->s) < 0)
        return -1;
    if (PyDict_GET_SIZE(c->s.pending) != 0)
        return 0;
    c->spin_s = spin_budget(&c->s, timeout);
    return c->spin_s >= 0.0;
}

PyDoc_STRVAR(send_doc,
"send(state, x, dest, tag, timeout) -> None | False | (err, payload_req, header_req)\n\n"
"MPIHostBridge.send's fast path. If no receive waits for its header (state's pending dict is\n"
"empty), x is a C-contiguous numpy.ndarray whose dtype (the same object) and shape are those of\n"
"the entry last_sent[tag] = (dtype, shape, header bytes, MPI header tag) and dest is a rank:\n"
"post MPI_Isend of x's bytes on the MPI header tag + 1, then of the header, and test them\n"
"(payload first) without the GIL for at most spin_s seconds (state's hot spin when timeout is\n"
"None, else min(timeout, spin_s)). None: both sent. False: not applicable, nothing posted (the\n"
"caller takes its general path). Otherwise the MPI error code (0 if the time ran out) and the\n"
"handles of the requests still active, which the caller must complete while keeping x and the\n"
"header alive.");

static PyObject *hp_send(PyObject *self, PyObject *args) {
    call_t c;
    int go = begin_call(args, "send", &c);
    if (go <= 0)
        return go < 0 ? NULL : Py_NewRef(Py_False);
    int peer = small_int(c.peer, c.s.size - 1);
    if (peer < 0 || !PyLong_CheckExact(c.tag))
        Py_RETURN_FALSE;
    PyObject *ent = PyDict_GetItemWithError(c.s.last_sent, c.tag); /* borrowed */
    if (ent == NULL) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_FALSE;
    }
    if (!PyTuple_CheckExact(ent) || PyTuple_GET_SIZE(ent) != 4 ||
        !PyBytes_CheckExact(PyTuple_GET_ITEM(ent, 2))) {
        PyErr_SetString(PyExc_TypeError, "_hotpath: bad last_sent entry");
        return NULL;
    }
    int tag2 = small_int(PyTuple_GET_ITEM(ent, 3), INT_MAX - 1);
    Py_buffer db;
    if (tag2 < 0 || !array_buffer(c.arr, &db, 0, 0))
        Py_RETURN_FALSE;
    int same = same_kind(c.arr, &db, PyTuple_GET_ITEM(ent, 0), PyTuple_GET_ITEM(ent, 1));
    if (same <= 0) {
        PyBuffer_Release(&db);
        if (same < 0)
            return NULL;
        Py_RETURN_FALSE;
    }
    PyObject *hdr = PyTuple_GET_ITEM(ent, 2);
    Py_INCREF(hdr); /* the entry may be replaced while the GIL is released */
    int completed;
    PyObject *res = post_and_spin(c.s.comm, &db, PyBytes_AS_STRING(hdr), (int)PyBytes_GET_SIZE(hdr),
                                  peer, tag2, c.spin_s, 0, &completed);
    Py_DECREF(hdr);
    PyBuffer_Release(&db);
    return res;
}

PyDoc_STRVAR(recv_doc,
"recv(state, out, source, tag, timeout) -> out | None | False | (err, payload_req, header_req)\n\n"
"MPIHostBridge.recv(out=)'s fast path. If no receive waits for its header, out is a writeable\n"
"C-contiguous numpy.ndarray of 1 .. 2**31-1 bytes and source and tag are a rank and a user tag\n"
"(0 .. max_tag): post MPI_Irecv into out on MPI tag 2*tag+1, then into state's hscratch on\n"
"2*tag, and test them (header first) without the GIL for at most the spin budget (as send).\n"
"out: both arrived and the header equals the one of expected[(source, tag)] = (dtype, shape,\n"
"header bytes), whose dtype (the same object) and shape are out's. None: both arrived, header\n"
"not checked or different (hscratch holds it). False: not applicable, nothing posted. Otherwise\n"
"as send().");

static PyObject *hp_recv(PyObject *self, PyObject *args) {
    call_t c;
    int go = begin_call(args, "recv", &c);
    if (go <= 0)
        return go < 0 ? NULL : Py_NewRef(Py_False);
    int peer = small_int(c.peer, c.s.size - 1), t = small_int(c.tag, c.s.max_tag);
    Py_buffer db;
    if (peer < 0 || t < 0 || !array_buffer(c.arr, &db, 1, 1))
        Py_RETURN_FALSE;
    /* the header this receive accepts without decoding: expected[(source, tag)], if its dtype
     * and shape are out's (looked up before posting: after the copy only returning is left) */
    PyObject *want = NULL, *key = PyTuple_Pack(2, c.peer, c.tag);
    PyObject *ent = key ? PyDict_GetItemWithError(c.s.expected, key) : NULL;
    Py_XDECREF(key);
    if (ent == NULL && PyErr_Occurred()) {
        PyBuffer_Release(&db);
        return NULL;
    }
    if (ent != NULL) {
        int same = -1;
        if (PyTuple_CheckExact(ent) && PyTuple_GET_SIZE(ent) == 3 &&
            PyBytes_CheckExact(PyTuple_GET_ITEM(ent, 2)))
            same = same_kind(c.arr, &db, PyTuple_GET_ITEM(ent, 0), PyTuple_GET_ITEM(ent, 1));
        else
            PyErr_SetString(PyExc_TypeError, "_hotpath: bad expected entry");
        if (same < 0) {
            PyBuffer_Release(&db);
            return NULL;
        }
        if (same) {
            want = PyTuple_GET_ITEM(ent, 2);
            Py_INCREF(want);
        }
    }
    Py_buffer hb;
    if (PyObject_GetBuffer(c.s.hscratch, &hb, PyBUF_SIMPLE | PyBUF_WRITABLE) < 0) {
        Py_XDECREF(want);
        PyBuffer_Release(&db);
        return NULL;
    }
    int completed;
    PyObject *res = post_and_spin(c.s.comm, &db, hb.buf, (int)hb.len, peer, 2 * t, c.spin_s, 1,
                                  &completed);
    if (res != NULL && completed && want != NULL && hb.len >= PyBytes_GET_SIZE(want) &&
        memcmp(hb.buf, PyBytes_AS_STRING(want), (size_t)PyBytes_GET_SIZE(want)) == 0) {
        Py_DECREF(res);
        Py_INCREF(c.arr);
        res = c.arr;
    }
    Py_XDECREF(want);
    PyBuffer_Release(&hb);
    PyBuffer_Release(&db);
    return res;
}

PyDoc_STRVAR(init_doc, "init(ndarray_type): the numpy.ndarray type (exact type of fast-path arrays).");

static PyObject *hp_init(PyObject *self, PyObject *arg) {
    if (!PyType_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "init() takes the numpy.ndarray type");
        return NULL;
    }
    Py_INCREF(arg);
    Py_XSETREF(ndarray_type, arg);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"send", hp_send, METH_VARARGS, send_doc},
    {"recv", hp_recv, METH_VARARGS, recv_doc},
    {"init", hp_init, METH_O, init_doc},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_hotpath",
    "C hot path of MPIHostBridge send/recv (see _hotpath.c); used only through hethub_jax.comm.mpi.",
    -1, methods};

PyMODINIT_FUNC PyInit__hotpath(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    str_dtype = PyUnicode_InternFromString("dtype");
    if (str_dtype == NULL) {
        Py_DECREF(m);
        return NULL;
    }
    /* compile-time handle values, compared with mpi4py's at import (same library and ABI) */
    if (PyModule_AddObject(m, "COMM_WORLD", HANDLE_TO_PY(MPI_COMM_WORLD)) < 0 ||
        PyModule_AddObject(m, "BYTE", HANDLE_TO_PY(MPI_BYTE)) < 0 ||
        PyModule_AddObject(m, "REQUEST_NULL", HANDLE_TO_PY(MPI_REQUEST_NULL)) < 0 ||
        PyModule_AddIntConstant(m, "INTERFACE", HOTPATH_INTERFACE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
