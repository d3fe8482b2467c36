/* Hot path of MPIHostBridge.send / .recv(out=) for repeated messages (hethub_jax/comm/mpi.py).
 *
 * Why C: in MPICH's shared-memory transport (CMA single copy, on by default in the mpich wheel) a
 * large message is copied inside an MPI call of the receiver, and every instruction the receiver
 * runs between entering recv and that call, or between the copy and returning, adds to the
 * message's time, as does everything the sender runs before posting the payload. In Python these
 * paths cost a few microseconds each (interpreter state is cold after a 1 MiB copy); here they cost
 * a few hundred nanoseconds. Measured on a 1 MiB ping-pong: 0.92-0.93 of raw mpi4py Send/Recv
 * with the Python paths, 0.98 with this module (docs/benchmarks.md).
 *
 * Scope: only the posting of the two messages of the bridge's wire protocol (payload on MPI tag
 * tag2+1, header on tag2; see mpi.py) and a bounded busy-poll (spin) on them. All checks (dtype,
 * shape, header contents), deadlines, timeouts, cancellation and errors stay in Python: when the
 * spin budget runs out or MPI reports an error, the functions return the still-active request
 * handles and mpi.py continues with mpi4py Request objects made from them.
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
#include <time.h>

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

static int check_len(Py_buffer *b) {
    if (b->len > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "payload above 2**31-1 bytes: use the chunked path");
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(send_doc,
"send(comm, payload, header, dest, tag2, spin_s) -> None | (err, payload_req, header_req)\n\n"
"Post MPI_Isend of payload's bytes (C-contiguous buffer, < 2**31 bytes) on MPI tag tag2+1, then\n"
"of header's bytes on tag2, to rank dest of communicator handle comm; test them (payload first)\n"
"for at most spin_s seconds without the GIL. None: both sent. Otherwise the MPI error code (0 if\n"
"the time ran out) and the handles of the requests still active, which the caller must complete\n"
"while keeping both buffers alive. Raises BufferError (not C-contiguous) or ValueError (too large)\n"
"before posting anything.");

/* send() and recv(): args (comm, data, header, peer, tag2, spin_s). Posts data on MPI tag tag2+1
 * and header on tag2, then spins: a send tests data first, a receive the header first. */
static PyObject *post_and_spin(PyObject *args, int is_recv) {
    unsigned long long comm_h;
    PyObject *data, *header;
    int peer, tag2;
    double spin_s;
    if (!PyArg_ParseTuple(args, "KOOiid", &comm_h, &data, &header, &peer, &tag2, &spin_s))
        return NULL;
    int wflag = is_recv ? PyBUF_WRITABLE : 0;
    Py_buffer db, hb;
    if (PyObject_GetBuffer(data, &db, PyBUF_C_CONTIGUOUS | wflag) < 0)
        return NULL;
    if (check_len(&db) < 0 || PyObject_GetBuffer(header, &hb, PyBUF_SIMPLE | wflag) < 0) {
        PyBuffer_Release(&db);
        return NULL;
    }
    MPI_Comm comm = PY_TO_HANDLE(MPI_Comm, comm_h);
    MPI_Request r[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL}; /* in test order */
    MPI_Request *rd = &r[is_recv ? 1 : 0], *rh = &r[is_recv ? 0 : 1];
    int err = MPI_SUCCESS, done = 0;
    Py_BEGIN_ALLOW_THREADS
    if (is_recv) {
        err = MPI_Irecv(db.buf, (int)db.len, MPI_BYTE, peer, tag2 + 1, comm, rd);
        if (err == MPI_SUCCESS)
            err = MPI_Irecv(hb.buf, (int)hb.len, MPI_BYTE, peer, tag2, comm, rh);
    } else {
        err = MPI_Isend(db.buf, (int)db.len, MPI_BYTE, peer, tag2 + 1, comm, rd);
        if (err == MPI_SUCCESS)
            err = MPI_Isend(hb.buf, (int)hb.len, MPI_BYTE, peer, tag2, comm, rh);
    }
    if (err == MPI_SUCCESS)
        done = spin(r, 2, spin_s, &err);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&db);
    PyBuffer_Release(&hb);
    return result(done, err, *rd, *rh);
}

static PyObject *hp_send(PyObject *self, PyObject *args) { return post_and_spin(args, 0); }

PyDoc_STRVAR(recv_doc,
"recv(comm, out, hbuf, source, tag2, spin_s) -> None | (err, payload_req, header_req)\n\n"
"Post MPI_Irecv into out (writable C-contiguous buffer, < 2**31 bytes) on MPI tag tag2+1, then\n"
"into hbuf (writable) on tag2, from rank source of communicator handle comm; test them (header\n"
"first) for at most spin_s seconds without the GIL. None: both arrived (contents unchecked).\n"
"Otherwise as send(). Raises BufferError or ValueError before posting anything.");

static PyObject *hp_recv(PyObject *self, PyObject *args) { return post_and_spin(args, 1); }

static PyMethodDef methods[] = {
    {"send", hp_send, METH_VARARGS, send_doc},
    {"recv", hp_recv, METH_VARARGS, recv_doc},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_hotpath",
    "C hot path of MPIHostBridge send/recv (see _hotpath.c); used only through hethub_jax.comm.mpi.",
    -1, methods};

PyMODINIT_FUNC PyInit__hotpath(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    /* compile-time handle values, compared with mpi4py's at import (same library and ABI) */
    if (PyModule_AddObject(m, "COMM_WORLD", HANDLE_TO_PY(MPI_COMM_WORLD)) < 0 ||
        PyModule_AddObject(m, "BYTE", HANDLE_TO_PY(MPI_BYTE)) < 0 ||
        PyModule_AddObject(m, "REQUEST_NULL", HANDLE_TO_PY(MPI_REQUEST_NULL)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
