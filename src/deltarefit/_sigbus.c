/* A SIGBUS handler for the command line: one line naming the file, then exit.
 *
 * Checkpoints are read through mmap. When another process truncates a mapped file (``truncate``, a
 * ``cp`` over it in place) a read of a page past its new end raises SIGBUS, which Python cannot turn
 * into an exception: its own handler would return into the faulting load, forever. This handler, for
 * the CLI process only (``deltarefit.cli`` installs it), writes
 *   deltarefit: error: PATH: truncated by another process while mapped (SIGBUS); ...
 * naming the mapped file the fault address lies in (looked up in /proc/self/maps), and exits with
 * status 4 (CheckpointError's), as a kill would leave it: an apply is journaled and resumes on a rerun.
 * Only async-signal-safe calls (open, read, write, close, _exit) are made.
 */
#define _GNU_SOURCE
#include <Python.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

static char maps_buf[1 << 16];

static void put(const char *s) {
    size_t n = strlen(s);
    while (n > 0) {
        ssize_t k = write(2, s, n);
        if (k <= 0)
            return;
        s += k;
        n -= (size_t)k;
    }
}

static uintptr_t hex(const char **p) {
    uintptr_t v = 0;
    for (;; (*p)++) {
        char c = **p;
        if (c >= '0' && c <= '9') v = v * 16 + (uintptr_t)(c - '0');
        else if (c >= 'a' && c <= 'f') v = v * 16 + (uintptr_t)(c - 'a' + 10);
        else return v;
    }
}

/* The path of the mapping holding addr, copied into out (empty if not found). */
static void mapped_path(uintptr_t addr, char *out, size_t cap) {
    out[0] = 0;
    int fd = open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return;
    size_t have = 0;
    for (;;) {
        ssize_t k = read(fd, maps_buf + have, sizeof(maps_buf) - 1 - have);
        if (k <= 0 && have == 0)
            break;
        have += k > 0 ? (size_t)k : 0;
        maps_buf[have] = 0;
        char *nl = memchr(maps_buf, '\n', have);
        if (nl == NULL) {
            if (k > 0 && have < sizeof(maps_buf) - 1)
                continue;
            nl = maps_buf + have; /* last line, or one longer than the buffer */
        }
        *nl = 0;
        const char *p = maps_buf;
        uintptr_t lo = hex(&p);
        if (*p == '-') {
            p++;
            uintptr_t hi = hex(&p);
            if (addr >= lo && addr < hi) {
                const char *path = strchr(maps_buf, '/');
                if (path != NULL) {
                    strncpy(out, path, cap - 1);
                    out[cap - 1] = 0;
                }
                break;
            }
        }
        size_t used = (size_t)(nl - maps_buf) + 1;
        if (used >= have) {
            have = 0;
            if (k <= 0)
                break;
        } else {
            memmove(maps_buf, maps_buf + used, have - used);
            have -= used;
        }
    }
    close(fd);
}

static char path_buf[4096];

static void on_sigbus(int sig, siginfo_t *info, void *ctx) {
    (void)sig;
    (void)ctx;
    mapped_path((uintptr_t)info->si_addr, path_buf, sizeof(path_buf));
    put("deltarefit: error: ");
    put(path_buf[0] ? path_buf : "a mapped file");
    put(": truncated by another process while mapped (SIGBUS); nothing more was written or recorded as "
        "verified; stop that process, then run again (an apply resumes)\n");
    _exit(4);
}

static PyObject *py_install(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, NULL) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"install", py_install, METH_NOARGS,
     "install(): on SIGBUS, print one line naming the mapped file and exit 4 (for the CLI process)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_sigbus", "SIGBUS as one line (the CLI's).", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__sigbus(void) { return PyModule_Create(&module); }
