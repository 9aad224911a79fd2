/* The steady part of a streamed reply, relayed outside the interpreter (docs/benchmarks.md, section 1).
 *
 * Once a stream's first token is out, each later chunk only has to go from the decode engine's
 * socket to the client's. In Python that costs a loop wake, a protocol callback and a handful of
 * calls per chunk: 1.4-2x nginx's CPU per chunk on 2 cores. Here one thread per gateway process
 * does it with one epoll wait, one recv and one send per chunk, and gives the stream back to
 * Python (pd/native_relay.py) at the first thing Python must see:
 *
 *   END             the engine's last chunk (size 0): Python's HTTP parser completes the reply;
 *   HANDBACK        a chunk holding an error event or an aborted request's, or the usage event when asked to watch for it,
 *                   or any chunk past the request's deadline, or framing this does not read;
 *   ENGINE_LOST     the engine closed the connection or failed a read;
 *   CLIENT_BLOCKED  the client's socket did not take a whole write (a slow client) or failed;
 *   IDLE            the engine sent nothing for the stream's idle timeout;
 *   CANCELLED       Python stopped waiting (its client left): what was relayed still comes back.
 *
 * What was read and not relayed ("leftover") goes back starting at a chunk boundary, so Python's
 * parser carries on where this stopped. Both sockets are dup()ed: the event loop keeps its own
 * descriptors and may close them at any time without this thread writing to a reused number.
 * The engine's HTTP/1.1 chunk framing is relayed as it came (the client's reply is chunked too),
 * so nothing is re-framed: a chunk costs its read, a copy into the stream's record, and its send.
 * Inter-token gaps are counted per token event, not per read: a read that brings several events
 * (a burst) counts its gap since the last token event for the first of them and 0 for each other,
 * as a client reading the socket sees them. A token event is an SSE event ("\n\n"-ended) but
 * `data: [DONE]` and the usage-only event (`"choices":[]`): pdserve/gateway/token_gaps.py counts alike.
 * Times are CLOCK_MONOTONIC seconds, Python's time.perf_counter() and time.monotonic() on Linux.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

enum { END, HANDBACK, ENGINE_LOST, CLIENT_BLOCKED, IDLE, CANCELLED };

#define THREAD_NAME "pdserve-relay"   /* what top -H and /proc/PID/task/TID/comm show; 15 bytes at most */
#define READ_BYTES 65536
#define MAX_CHUNK_HEADER 4096   /* a size line longer than this is not vLLM's framing: Python judges it */
#define IDLE_SWEEP_S 0.1

static const char ERROR_MARK[] = "data: {\"error\"";   /* relay.py's ENGINE_ERROR_EVENT */
static const char USAGE_MARK[] = "\"usage\":{";        /* pd/first_token.py's USAGE_MARK */
static const char ABORT_MARK[] = "\"finish_reason\":\"abort\"";  /* gateway/decode_leg.py's ENGINE_ABORT_MARK */
static const char EVENT_END[] = "\n\n";                  /* gateway/token_gaps.py's marks, alike */
static const char DONE_EVENT[] = "data: [DONE]";
static const char USAGE_ONLY_MARK[] = "\"choices\":[]";

typedef struct {
    char *data;
    size_t len, cap;
} Buf;

static int buf_add(Buf *buf, const char *bytes, size_t count) {
    if (buf->len + count > buf->cap) {
        size_t cap = buf->cap ? buf->cap : 4096;
        while (cap < buf->len + count) cap *= 2;
        char *data = realloc(buf->data, cap);
        if (data == NULL) return -1;
        buf->data = data;
        buf->cap = cap;
    }
    memcpy(buf->data + buf->len, bytes, count);
    buf->len += count;
    return 0;
}

static void buf_drop_front(Buf *buf, size_t count) {
    memmove(buf->data, buf->data + count, buf->len - count);
    buf->len -= count;
}

typedef struct Stream {
    struct Stream *next;
    long long id;
    int engine_fd, client_fd, watch_usage, reason;
    Buf in;       /* read from the engine, not yet relayed */
    Buf payload;  /* the relayed chunks' data, without framing: the stream's resume record */
    Buf unsent;   /* relayed framing the client's socket did not take */
    double previous_s, deadline_s, idle_timeout_s, last_bytes_s, gap_sum_s;
    long long token_events;
    long long *gap_counts;
} Stream;

typedef struct {
    PyObject_HEAD
    pthread_t thread;
    pthread_mutex_t lock;
    int epoll_fd, control_fd, wake_fd, is_started, is_stopping;
    double *bounds_s;
    Py_ssize_t bound_count;
    Stream *submitted, *running, *finished;  /* submitted and finished: under lock; running: the thread's */
    long long *cancels;
    size_t cancel_count, cancel_cap;
} Relay;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void signal_fd(int fd) {
    uint64_t one = 1;
    ssize_t written = write(fd, &one, sizeof one);
    (void)written;  /* a full eventfd counter is already a signal */
}

static void stream_free(Stream *stream) {
    free(stream->in.data);
    free(stream->payload.data);
    free(stream->unsent.data);
    free(stream->gap_counts);
    free(stream);
}

static void stream_close_fds(Relay *relay, Stream *stream) {
    epoll_ctl(relay->epoll_fd, EPOLL_CTL_DEL, stream->engine_fd, NULL);
    close(stream->engine_fd);
    close(stream->client_fd);
}

static void unlink_running(Relay *relay, Stream *stream) {
    for (Stream **link = &relay->running; *link != NULL; link = &(*link)->next) {
        if (*link == stream) {
            *link = stream->next;
            return;
        }
    }
}

/* Hand the stream back to Python: off the thread's list, onto the finished one, and wake the loop. */
static void finish(Relay *relay, Stream *stream, int reason) {
    stream->reason = reason;
    unlink_running(relay, stream);
    stream_close_fds(relay, stream);
    pthread_mutex_lock(&relay->lock);
    stream->next = relay->finished;
    relay->finished = stream;
    pthread_mutex_unlock(&relay->lock);
    signal_fd(relay->wake_fd);
}

static Py_ssize_t bucket_of(const Relay *relay, double gap_s) {
    Py_ssize_t bucket = 0;  /* bisect_left, as GapCounts.observe */
    while (bucket < relay->bound_count && relay->bounds_s[bucket] < gap_s) bucket++;
    return bucket;
}

static long long count_mark(const char *data, size_t len, const char *mark, size_t mark_len) {
    long long count = 0;
    for (const char *at = data; (at = memmem(at, len - (size_t)(at - data), mark, mark_len)) != NULL; at += mark_len) {
        count++;
    }
    return count;
}

/* The token events in relayed data: its events less `data: [DONE]` and the usage-only one. */
static long long count_token_events(const char *data, size_t len) {
    long long events = count_mark(data, len, EVENT_END, sizeof EVENT_END - 1)
                       - count_mark(data, len, DONE_EVENT, sizeof DONE_EVENT - 1)
                       - count_mark(data, len, USAGE_ONLY_MARK, sizeof USAGE_ONLY_MARK - 1);
    return events > 0 ? events : 0;
}

/* A read's token events: the first one's gap since the last token event, 0 for each other. */
static void observe_events(Relay *relay, Stream *stream, double at_s, long long events) {
    if (events <= 0) return;
    double gap_s = at_s - stream->previous_s;
    stream->gap_counts[bucket_of(relay, gap_s)]++;
    stream->gap_counts[bucket_of(relay, 0.0)] += events - 1;
    stream->gap_sum_s += gap_s;
    stream->previous_s = at_s;
    stream->token_events += events;
}

/* Where the complete chunks ahead end, relayable; *reason is set (else -1) at a chunk Python must
 * see, and the returned end is then that chunk's start. Their data go to the stream's payload. */
static size_t relayable_end(Stream *stream, int *reason) {
    const char *data = stream->in.data;
    size_t len = stream->in.len, pos = 0;
    *reason = -1;
    while (pos < len) {
        const char *line_end = memmem(data + pos, len - pos, "\r\n", 2);
        if (line_end == NULL) {
            if (len - pos > MAX_CHUNK_HEADER) *reason = HANDBACK;
            return pos;
        }
        size_t size = 0, digits = 0;
        for (const char *c = data + pos; c < line_end && *c != ';'; c++, digits++) {
            int value = (*c >= '0' && *c <= '9') ? *c - '0' : (*c >= 'a' && *c <= 'f') ? *c - 'a' + 10
                      : (*c >= 'A' && *c <= 'F') ? *c - 'A' + 10 : -1;
            if (value < 0 || digits >= 15) {
                *reason = HANDBACK;
                return pos;
            }
            size = size * 16 + (size_t)value;
        }
        if (digits == 0) {
            *reason = HANDBACK;
            return pos;
        }
        if (size == 0) {
            *reason = END;
            return pos;
        }
        size_t body = (size_t)(line_end - data) + 2;
        if (len - body < size + 2) return pos;  /* the rest of this chunk is still on its way */
        if (memcmp(data + body + size, "\r\n", 2) != 0
            || memmem(data + body, size, ERROR_MARK, sizeof ERROR_MARK - 1) != NULL
            || memmem(data + body, size, ABORT_MARK, sizeof ABORT_MARK - 1) != NULL
            || (stream->watch_usage && memmem(data + body, size, USAGE_MARK, sizeof USAGE_MARK - 1) != NULL)) {
            *reason = HANDBACK;
            return pos;
        }
        if (buf_add(&stream->payload, data + body, size) < 0) {
            *reason = HANDBACK;
            return pos;
        }
        pos = body + size + 2;
    }
    return pos;
}

/* The engine's socket is readable: read once, relay the complete chunks, stop where Python must see. */
static void service(Relay *relay, Stream *stream, double at_s) {
    char bytes[READ_BYTES];
    ssize_t count = recv(stream->engine_fd, bytes, sizeof bytes, MSG_DONTWAIT);
    if (count < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    if (count <= 0) {
        finish(relay, stream, ENGINE_LOST);
        return;
    }
    if (buf_add(&stream->in, bytes, (size_t)count) < 0) {
        finish(relay, stream, HANDBACK);
        return;
    }
    stream->last_bytes_s = at_s;
    if (at_s > stream->deadline_s) {  /* Python writes the deadline's error event */
        finish(relay, stream, HANDBACK);
        return;
    }
    size_t payload_before = stream->payload.len;
    int reason;
    size_t end = relayable_end(stream, &reason);
    if (end > 0) {
        ssize_t sent = send(stream->client_fd, stream->in.data, end, MSG_DONTWAIT | MSG_NOSIGNAL);
        size_t taken = sent > 0 ? (size_t)sent : 0;
        observe_events(relay, stream, at_s, count_token_events(stream->payload.data + payload_before,
                                                                 stream->payload.len - payload_before));
        if (taken < end) {
            if (buf_add(&stream->unsent, stream->in.data + taken, end - taken) < 0) {
                stream->payload.len = payload_before;  /* nothing of this read counts as relayed */
                finish(relay, stream, HANDBACK);
                return;
            }
            reason = CLIENT_BLOCKED;
        }
        buf_drop_front(&stream->in, end);
    }
    if (reason >= 0) finish(relay, stream, reason);
}

static void sweep_idle(Relay *relay, double at_s) {
    Stream *stream = relay->running;
    while (stream != NULL) {
        Stream *next = stream->next;
        if (at_s - stream->last_bytes_s > stream->idle_timeout_s) finish(relay, stream, IDLE);
        stream = next;
    }
}

/* Take in what Python submitted and cancelled since the last look; false once asked to stop. */
static int take_control(Relay *relay) {
    uint64_t ignored;
    ssize_t got = read(relay->control_fd, &ignored, sizeof ignored);
    (void)got;
    pthread_mutex_lock(&relay->lock);
    Stream *submitted = relay->submitted;
    relay->submitted = NULL;
    size_t cancel_count = relay->cancel_count;
    long long *cancels = relay->cancels;
    relay->cancels = NULL;
    relay->cancel_count = relay->cancel_cap = 0;
    int is_stopping = relay->is_stopping;
    pthread_mutex_unlock(&relay->lock);
    while (submitted != NULL) {
        Stream *stream = submitted;
        submitted = stream->next;
        struct epoll_event event = {.events = EPOLLIN, .data.ptr = stream};
        stream->next = relay->running;
        relay->running = stream;
        if (epoll_ctl(relay->epoll_fd, EPOLL_CTL_ADD, stream->engine_fd, &event) < 0) finish(relay, stream, ENGINE_LOST);
    }
    for (size_t index = 0; index < cancel_count; index++) {
        for (Stream *stream = relay->running; stream != NULL; stream = stream->next) {
            if (stream->id == cancels[index]) {  /* Python stopped waiting: it takes back what was relayed */
                finish(relay, stream, CANCELLED);
                break;
            }
        }
    }
    free(cancels);
    return !is_stopping;
}

static void *run(void *arg) {
    Relay *relay = arg;
    struct epoll_event events[256];
    double swept_s = now_s();
    for (;;) {
        int ready = epoll_wait(relay->epoll_fd, events, 256, (int)(IDLE_SWEEP_S * 1000));
        double at_s = now_s();
        int has_control = 0;
        for (int index = 0; index < ready; index++) {
            if (events[index].data.ptr == NULL) has_control = 1;
            else service(relay, events[index].data.ptr, at_s);
        }
        if (has_control && !take_control(relay)) break;
        if (at_s - swept_s >= IDLE_SWEEP_S) {
            sweep_idle(relay, at_s);
            swept_s = at_s;
        }
    }
    while (relay->running != NULL) {
        Stream *stream = relay->running;
        relay->running = stream->next;
        stream_close_fds(relay, stream);
        stream_free(stream);
    }
    return NULL;
}

/* Python side */

static void drop_list(Stream *stream, int close_fds) {
    while (stream != NULL) {
        Stream *next = stream->next;
        if (close_fds) {
            close(stream->engine_fd);
            close(stream->client_fd);
        }
        stream_free(stream);
        stream = next;
    }
}

static const char *bytes_of(const Buf *buf) { return buf->data != NULL ? buf->data : ""; }

static int Relay_init(Relay *self, PyObject *args, PyObject *kwds) {
    static char *keywords[] = {"wake_fd", "bounds_s", NULL};
    PyObject *bounds;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iO", keywords, &self->wake_fd, &bounds)) return -1;
    if (self->is_started) {
        PyErr_SetString(PyExc_RuntimeError, "the relay is already running");
        return -1;
    }
    PyObject *sequence = PySequence_Fast(bounds, "bounds_s must be a sequence of seconds");
    if (sequence == NULL) return -1;
    self->bound_count = PySequence_Fast_GET_SIZE(sequence);
    self->bounds_s = calloc((size_t)self->bound_count + 1, sizeof(double));
    for (Py_ssize_t index = 0; index < self->bound_count; index++) {
        self->bounds_s[index] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(sequence, index));
    }
    Py_DECREF(sequence);
    if (PyErr_Occurred()) return -1;
    pthread_mutex_init(&self->lock, NULL);
    self->epoll_fd = epoll_create1(EPOLL_CLOEXEC);
    self->control_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    struct epoll_event control = {.events = EPOLLIN, .data.ptr = NULL};
    if (self->epoll_fd < 0 || self->control_fd < 0
        || epoll_ctl(self->epoll_fd, EPOLL_CTL_ADD, self->control_fd, &control) < 0
        || pthread_create(&self->thread, NULL, run, self) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    pthread_setname_np(self->thread, THREAD_NAME);  /* a name only: nothing depends on it taking */
    self->is_started = 1;
    return 0;
}

static PyObject *Relay_close(Relay *self, PyObject *Py_UNUSED(ignored)) {
    if (self->is_started) {
        pthread_mutex_lock(&self->lock);
        self->is_stopping = 1;
        pthread_mutex_unlock(&self->lock);
        signal_fd(self->control_fd);
        Py_BEGIN_ALLOW_THREADS
        pthread_join(self->thread, NULL);
        Py_END_ALLOW_THREADS
        self->is_started = 0;
        drop_list(self->submitted, 1);  /* never reached the thread: their descriptors are still open */
        drop_list(self->finished, 0);
        self->submitted = self->finished = NULL;
        close(self->epoll_fd);
        close(self->control_fd);
    }
    Py_RETURN_NONE;
}

static PyObject *Relay_submit(Relay *self, PyObject *args, PyObject *kwds) {
    static char *keywords[] = {"stream_id", "engine_fd", "client_fd", "previous_s", "deadline_s", "idle_timeout_s",
                               "watch_usage", NULL};
    long long id;
    int engine_fd, client_fd, watch_usage;
    double previous_s, deadline_s, idle_timeout_s;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Liidddp", keywords, &id, &engine_fd, &client_fd, &previous_s,
                                     &deadline_s, &idle_timeout_s, &watch_usage)) return NULL;
    if (!self->is_started) {
        PyErr_SetString(PyExc_RuntimeError, "the relay is closed");
        return NULL;
    }
    Stream *stream = calloc(1, sizeof *stream);
    if (stream == NULL || (stream->gap_counts = calloc((size_t)self->bound_count + 1, sizeof(long long))) == NULL) {
        free(stream);
        return PyErr_NoMemory();
    }
    stream->engine_fd = fcntl(engine_fd, F_DUPFD_CLOEXEC, 0);
    stream->client_fd = stream->engine_fd < 0 ? -1 : fcntl(client_fd, F_DUPFD_CLOEXEC, 0);
    if (stream->client_fd < 0) {
        if (stream->engine_fd >= 0) close(stream->engine_fd);
        stream_free(stream);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    stream->id = id;
    stream->previous_s = previous_s;
    stream->deadline_s = deadline_s;
    stream->idle_timeout_s = idle_timeout_s;
    stream->watch_usage = watch_usage;
    stream->last_bytes_s = now_s();
    pthread_mutex_lock(&self->lock);
    stream->next = self->submitted;
    self->submitted = stream;
    pthread_mutex_unlock(&self->lock);
    signal_fd(self->control_fd);
    Py_RETURN_NONE;
}

static PyObject *Relay_cancel(Relay *self, PyObject *arg) {
    long long id = PyLong_AsLongLong(arg);
    if (id == -1 && PyErr_Occurred()) return NULL;
    pthread_mutex_lock(&self->lock);
    if (self->cancel_count == self->cancel_cap) {
        size_t cap = self->cancel_cap ? self->cancel_cap * 2 : 16;
        long long *cancels = realloc(self->cancels, cap * sizeof *cancels);
        if (cancels == NULL) {
            pthread_mutex_unlock(&self->lock);
            return PyErr_NoMemory();
        }
        self->cancels = cancels;
        self->cancel_cap = cap;
    }
    self->cancels[self->cancel_count++] = id;
    pthread_mutex_unlock(&self->lock);
    signal_fd(self->control_fd);
    Py_RETURN_NONE;
}

/* One tuple per stream handed back since the last call:
 * (stream_id, reason, leftover, unsent, payload, token_events, gap_counts, gap_sum_s, previous_s, last_bytes_s). */
static PyObject *Relay_take_finished(Relay *self, PyObject *Py_UNUSED(ignored)) {
    pthread_mutex_lock(&self->lock);
    Stream *finished = self->finished;
    self->finished = NULL;
    pthread_mutex_unlock(&self->lock);
    PyObject *result = PyList_New(0);
    while (finished != NULL) {
        Stream *stream = finished;
        finished = stream->next;
        PyObject *counts = result == NULL ? NULL : PyTuple_New(self->bound_count + 1);
        for (Py_ssize_t index = 0; counts != NULL && index <= self->bound_count; index++) {
            PyTuple_SET_ITEM(counts, index, PyLong_FromLongLong(stream->gap_counts[index]));
        }
        PyObject *item = counts == NULL ? NULL : Py_BuildValue(
            "(Liy#y#y#LNddd)", stream->id, stream->reason, bytes_of(&stream->in), (Py_ssize_t)stream->in.len,
            bytes_of(&stream->unsent), (Py_ssize_t)stream->unsent.len, bytes_of(&stream->payload),
            (Py_ssize_t)stream->payload.len, stream->token_events, counts, stream->gap_sum_s, stream->previous_s,
            stream->last_bytes_s);
        if (item == NULL || PyList_Append(result, item) < 0) Py_CLEAR(result);
        Py_XDECREF(item);
        stream_free(stream);
    }
    return result;
}

static void Relay_dealloc(Relay *self) {
    PyObject *ignored = Relay_close(self, NULL);
    Py_XDECREF(ignored);
    free(self->bounds_s);
    free(self->cancels);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Relay_methods[] = {
    {"submit", (PyCFunction)(void (*)(void))Relay_submit, METH_VARARGS | METH_KEYWORDS,
     "Relay a stream from now on (both descriptors are duplicated); it comes back through take_finished()."},
    {"cancel", (PyCFunction)Relay_cancel, METH_O,
     "Stop relaying a stream: it comes back through take_finished() as CANCELLED, with what was relayed."},
    {"take_finished", (PyCFunction)Relay_take_finished, METH_NOARGS, "The streams handed back since the last call."},
    {"close", (PyCFunction)Relay_close, METH_NOARGS, "Stop the thread; streams still relayed are dropped."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RelayType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "pdserve.pd._chunk_relay.Relay",
    .tp_basicsize = sizeof(Relay),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A thread relaying streams' chunks from engine sockets to client sockets.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Relay_init,
    .tp_dealloc = (destructor)Relay_dealloc,
    .tp_methods = Relay_methods,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "_chunk_relay", .m_size = -1};

PyMODINIT_FUNC PyInit__chunk_relay(void) {
    if (PyType_Ready(&RelayType) < 0) return NULL;
    PyObject *created = PyModule_Create(&module);
    if (created == NULL) return NULL;
    if (PyModule_AddObjectRef(created, "Relay", (PyObject *)&RelayType) < 0
        || PyModule_AddIntConstant(created, "END", END) < 0 || PyModule_AddIntConstant(created, "HANDBACK", HANDBACK) < 0
        || PyModule_AddIntConstant(created, "ENGINE_LOST", ENGINE_LOST) < 0
        || PyModule_AddIntConstant(created, "CLIENT_BLOCKED", CLIENT_BLOCKED) < 0
        || PyModule_AddIntConstant(created, "IDLE", IDLE) < 0
        || PyModule_AddIntConstant(created, "CANCELLED", CANCELLED) < 0
        || PyModule_AddStringConstant(created, "THREAD_NAME", THREAD_NAME) < 0) {
        Py_DECREF(created);
        return NULL;
    }
    return created;
}
