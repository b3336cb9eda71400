/*
 * hookcli.engine._fastreduce: the statistics of a dense float32 / bfloat16 / float16 buffer in one pass.
 *
 * Why: on CPU a hooked activation is usually no longer in cache, so the cost of `stats` is the
 * number of times each activation is read. torch needs four passes for what hookcli reports
 * (sum, aminmax, dot for the sum of squares, and a compare-and-sum for the zero count); this
 * reads each element once and keeps everything in registers. See benchmarks/README.md.
 *
 * Optional: setup.py builds it when a C compiler is present, and hookcli.engine.stats falls back to
 * the torch reductions when it is missing. Plain C and the CPython API only (no torch headers),
 * so it builds in a second and does not depend on the torch version.
 *
 * Memory: the kernel is handed a buffer-protocol object, never an address. It asks the exporter for
 * C-contiguous memory and checks the item format, size and alignment itself, so a strided view or a
 * wrong dtype raises instead of being read past its end.
 *
 * Numerics: the power sums of x, x^2, x^3 and x^4 (from which hookcli.engine.stats derives the central
 * moments up to the fourth, for the mean, std and kurtosis) are accumulated in float64 in 16 independent lanes per thread
 * (float32 squares cannot overflow a double; bfloat16 and float16 widen to float32 exactly); min/max ignore NaN (the caller counts NaN/Inf with
 * torch when the sum is not finite, which happens exactly when the buffer holds one). `centred` is a
 * second pass, only for data with a large offset: the power sums of x - shift (the corrected two-pass
 * algorithm), where power sums about 0 would cancel the central moments' digits (float32 x^4 < 1.2e154 and
 * no sum of them overflows a double).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#define LANES 16
/* int32 lane counters are flushed into the int64 total long before they could overflow */
#define FLUSH_BLOCKS ((int64_t)1 << 24)
/* below this many elements per thread, starting threads costs more than it saves */
#define MIN_PER_THREAD ((int64_t)1 << 15)
#define MAX_THREADS 256

typedef struct {
    double sum;
    double sumsq;
    double sumcube; /* sum of x^3 */
    double sumquad; /* sum of x^4 */
    float lo;
    float hi;
    int64_t zeros;
} partial_t;

/* One build that uses AVX-512 or AVX2 where the CPU has them (GCC function multiversioning). */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define HK_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define HK_CLONES
#endif

/* Element loaders: every dtype is reduced as float32 values (exactly: both halves widen losslessly).
 * Conversions are integer bit operations and selects, so the compiler vectorises them on any x86-64
 * level (a _Float16 cast compiles to a library call per element here). */
static inline float bits_to_float(uint32_t bits) {
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

static inline uint32_t float_to_bits(float v) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    return bits;
}

static inline float load_float32(const void *x, int64_t i) { return ((const float *)x)[i]; }

/* bfloat16 is the top half of a float32 */
static inline float load_bfloat16(const void *x, int64_t i) {
    return bits_to_float((uint32_t)((const uint16_t *)x)[i] << 16);
}

/* IEEE half -> float32, exact for every input (normal, subnormal, zero, inf, NaN): F. Giesen's
 * branch-free conversion. Subnormals are renormalised by a float subtraction of 2^-14. */
static inline float load_float16(const void *x, int64_t i) {
    const uint32_t h = ((const uint16_t *)x)[i];
    const uint32_t shifted_exp = 0x7c00u << 13;       /* half's exponent mask, moved to float's place */
    const uint32_t magnitude = (h & 0x7fffu) << 13;  /* exponent and mantissa bits */
    const uint32_t exp = magnitude & shifted_exp;
    const uint32_t normal = magnitude + ((uint32_t)(127 - 15) << 23);
    const uint32_t inf_nan = normal + ((uint32_t)(128 - 16) << 23);
    const uint32_t subnormal =
        float_to_bits(bits_to_float(normal + (1u << 23)) - bits_to_float((uint32_t)113 << 23));
    const uint32_t bits = exp == shifted_exp ? inf_nan : (exp == 0 ? subnormal : normal);
    return bits_to_float(bits | (h & 0x8000u) << 16);
}

/* reduce_range_<dtype>: 16 independent lanes the compiler vectorises; the tail is done one by one. */
#define DEFINE_REDUCE_RANGE(DTYPE)                                                                  \
    HK_CLONES static void reduce_range_##DTYPE(const void *x, int64_t n, partial_t *out) {          \
        double sum[LANES] = {0}, sumsq[LANES] = {0}, cube[LANES] = {0}, quad[LANES] = {0};         \
        float lo[LANES], hi[LANES];                                                                 \
        int64_t zeros = 0;                                                                          \
        for (int j = 0; j < LANES; j++) {                                                           \
            lo[j] = INFINITY;                                                                       \
            hi[j] = -INFINITY;                                                                      \
        }                                                                                           \
        const int64_t blocks = n / LANES;                                                           \
        int64_t b = 0;                                                                              \
        while (b < blocks) {                                                                        \
            const int64_t end = blocks - b > FLUSH_BLOCKS ? b + FLUSH_BLOCKS : blocks;              \
            int32_t zero[LANES] = {0};                                                              \
            for (; b < end; b++) {                                                                  \
                for (int j = 0; j < LANES; j++) {                                                   \
                    const float v = load_##DTYPE(x, b * LANES + j);                                 \
                    const double d = (double)v, d2 = d * d;                                         \
                    sum[j] += d;                                                                    \
                    sumsq[j] += d2;                                                                 \
                    cube[j] += d2 * d;                                                              \
                    quad[j] += d2 * d2;                                                             \
                    lo[j] = v < lo[j] ? v : lo[j];                                                  \
                    hi[j] = v > hi[j] ? v : hi[j];                                                  \
                    zero[j] += (v == 0.0f);                                                         \
                }                                                                                   \
            }                                                                                       \
            for (int j = 0; j < LANES; j++) zeros += zero[j];                                       \
        }                                                                                           \
        double s = 0.0, q = 0.0, c = 0.0, f = 0.0;                                                  \
        float l = INFINITY, h = -INFINITY;                                                          \
        for (int j = 0; j < LANES; j++) {                                                           \
            s += sum[j];                                                                            \
            q += sumsq[j];                                                                          \
            c += cube[j];                                                                           \
            f += quad[j];                                                                           \
            l = lo[j] < l ? lo[j] : l;                                                              \
            h = hi[j] > h ? hi[j] : h;                                                              \
        }                                                                                           \
        for (int64_t i = blocks * LANES; i < n; i++) {                                              \
            const float v = load_##DTYPE(x, i);                                                     \
            const double d = (double)v, d2 = d * d;                                                 \
            s += d;                                                                                 \
            q += d2;                                                                                \
            c += d2 * d;                                                                            \
            f += d2 * d2;                                                                           \
            l = v < l ? v : l;                                                                      \
            h = v > h ? v : h;                                                                      \
            zeros += (v == 0.0f);                                                                   \
        }                                                                                           \
        out->sum = s;                                                                               \
        out->sumsq = q;                                                                             \
        out->sumcube = c;                                                                           \
        out->sumquad = f;                                                                           \
        out->lo = l;                                                                                \
        out->hi = h;                                                                                \
        out->zeros = zeros;                                                                         \
    }

DEFINE_REDUCE_RANGE(float32)
DEFINE_REDUCE_RANGE(bfloat16)
DEFINE_REDUCE_RANGE(float16)

/* centred_range_<dtype>: sums of d = x - shift and of d^2, d^3, d^4 in float64 lanes (into out->sum,
 * sumsq, sumcube, sumquad): the second pass for data with a large offset, where the power sums about 0
 * would cancel the central moments' digits. */
#define DEFINE_CENTRED_RANGE(DTYPE)                                                                 \
    HK_CLONES static void centred_range_##DTYPE(const void *x, int64_t n, double shift, partial_t *out) { \
        double sum[LANES] = {0}, sumsq[LANES] = {0}, cube[LANES] = {0}, quad[LANES] = {0};         \
        const int64_t blocks = n / LANES;                                                           \
        for (int64_t b = 0; b < blocks; b++) {                                                      \
            for (int j = 0; j < LANES; j++) {                                                       \
                const double d = (double)load_##DTYPE(x, b * LANES + j) - shift, d2 = d * d;        \
                sum[j] += d;                                                                        \
                sumsq[j] += d2;                                                                     \
                cube[j] += d2 * d;                                                                  \
                quad[j] += d2 * d2;                                                                 \
            }                                                                                       \
        }                                                                                           \
        double s = 0.0, q = 0.0, c = 0.0, f = 0.0;                                                  \
        for (int j = 0; j < LANES; j++) {                                                           \
            s += sum[j];                                                                            \
            q += sumsq[j];                                                                          \
            c += cube[j];                                                                           \
            f += quad[j];                                                                           \
        }                                                                                           \
        for (int64_t i = blocks * LANES; i < n; i++) {                                              \
            const double d = (double)load_##DTYPE(x, i) - shift, d2 = d * d;                        \
            s += d;                                                                                 \
            q += d2;                                                                                \
            c += d2 * d;                                                                            \
            f += d2 * d2;                                                                           \
        }                                                                                           \
        out->sum = s;                                                                               \
        out->sumsq = q;                                                                             \
        out->sumcube = c;                                                                           \
        out->sumquad = f;                                                                           \
        out->lo = INFINITY;                                                                         \
        out->hi = -INFINITY;                                                                        \
        out->zeros = 0;                                                                             \
    }

DEFINE_CENTRED_RANGE(float32)
DEFINE_CENTRED_RANGE(bfloat16)
DEFINE_CENTRED_RANGE(float16)

typedef void (*range_fn)(const void *x, int64_t n, partial_t *out);
typedef void (*centred_fn)(const void *x, int64_t n, double shift, partial_t *out);

typedef struct {
    const char *name;
    range_fn range;
    centred_fn centred;
    Py_ssize_t itemsize;
    const char *formats; /* the buffer-protocol item formats (struct module codes) accepted */
} kind_t;

static const kind_t KINDS[] = {
    {"float32", reduce_range_float32, centred_range_float32, 4, "f"},
    {"bfloat16", reduce_range_bfloat16, centred_range_bfloat16, 2, "hH"},
    {"float16", reduce_range_float16, centred_range_float16, 2, "e"},
};
#define N_KINDS ((int)(sizeof KINDS / sizeof KINDS[0]))

/* One pass on up to `threads` threads: `reduce_range` when `centred` is 0, else `centred_range` with
 * `shift` (then only the sum and sumsq fields of `total` are meaningful). */
static void reduce_parallel(const kind_t *kind, const char *x, int64_t n, int threads, int centred, double shift,
                            partial_t *total) {
    partial_t parts[MAX_THREADS];
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if ((int64_t)threads > n / MIN_PER_THREAD) threads = (int)(n / MIN_PER_THREAD);
    if (threads < 1) threads = 1;
    if (threads == 1) { /* no parallel region to enter: small buffers are most calls */
        if (centred) kind->centred(x, n, shift, total);
        else kind->range(x, n, total);
        return;
    }
    /* equal ranges, each starting on a 64-element boundary of the buffer */
    int64_t per = (n + threads - 1) / threads;
    per = (per + 63) & ~(int64_t)63;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static, 1) if (threads > 1)
#endif
    for (int t = 0; t < threads; t++) {
        int64_t start = (int64_t)t * per, stop = start + per;
        if (start > n) start = n;
        if (stop > n) stop = n;
        if (centred) kind->centred(x + start * kind->itemsize, stop - start, shift, &parts[t]);
        else kind->range(x + start * kind->itemsize, stop - start, &parts[t]);
    }
    *total = parts[0];
    for (int t = 1; t < threads; t++) {
        total->sum += parts[t].sum;
        total->sumsq += parts[t].sumsq;
        total->sumcube += parts[t].sumcube;
        total->sumquad += parts[t].sumquad;
        total->lo = parts[t].lo < total->lo ? parts[t].lo : total->lo;
        total->hi = parts[t].hi > total->hi ? parts[t].hi : total->hi;
        total->zeros += parts[t].zeros;
    }
}

PyDoc_STRVAR(reduce_doc,
             "reduce(buffer, dtype, threads) -> (sum, sum of x**2, sum of x**3, sum of x**4, min, max, zero_count)\n\n"
             "One pass over the values of `buffer`, any object with the buffer protocol that can give\n"
             "C-contiguous memory (a NumPy array: Tensor.numpy()), on up to `threads` OpenMP threads,\n"
             "without holding the GIL. `dtype` (a name in DTYPES) says how to read the items and must\n"
             "agree with the buffer's format: float32 'f', float16 'e', bfloat16 the raw 16-bit\n"
             "integers 'h' or 'H' (the buffer protocol has no bfloat16). A strided, misaligned or\n"
             "mistyped buffer raises (BufferError / ValueError) instead of being read. Sums are float64;\n"
             "min and max ignore NaN (inf and -inf for an empty buffer).");

/* The item format a buffer must declare for each kind: native order, optionally spelled '@'/'='. */
static int format_matches(const kind_t *kind, const char *format) {
    if (format == NULL) format = "B"; /* the buffer protocol's default: unsigned bytes */
    if (format[0] == '@' || format[0] == '=') format++;
#if PY_LITTLE_ENDIAN
    else if (format[0] == '<') format++;
#else
    else if (format[0] == '>' || format[0] == '!') format++;
#endif
    if (format[0] == '\0' || format[1] != '\0') return 0;
    return strchr(kind->formats, format[0]) != NULL;
}

/* Export `obj`'s memory into `view` and check it is one C-contiguous, aligned block of `dtype`'s items;
 * sets *kind. Returns 0, or -1 with an exception set (and nothing left to release). */
static int acquire(PyObject *obj, const char *dtype, Py_buffer *view, const kind_t **kind) {
    *kind = NULL;
    for (int k = 0; k < N_KINDS; k++) {
        if (strcmp(KINDS[k].name, dtype) == 0) *kind = &KINDS[k];
    }
    if (*kind == NULL) {
        PyErr_Format(PyExc_ValueError, "unsupported dtype %s", dtype);
        return -1;
    }
    /* The exporter refuses (BufferError/ValueError) when its memory is not one C-contiguous block:
     * a stride-0 (expanded), sliced-with-step or transposed array never reaches the loops above. */
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    const char *problem = NULL;
    if (!PyBuffer_IsContiguous(view, 'C')) problem = "buffer is not C-contiguous";
    else if (view->itemsize != (*kind)->itemsize || !format_matches(*kind, view->format))
        problem = "buffer's item format does not match dtype";
    else if (view->len % (*kind)->itemsize != 0) problem = "buffer length is not a whole number of items";
    else if (view->len > 0 && (view->buf == NULL || (uintptr_t)view->buf % (uintptr_t)(*kind)->itemsize != 0))
        problem = "buffer is not aligned to its item size";
    if (problem != NULL) {
        PyErr_Format(PyExc_ValueError, "%s (dtype %s, format '%s', itemsize %zd)", problem, dtype,
                     view->format ? view->format : "B", view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* One pass (see reduce_parallel) over the values of buffer-protocol object `obj`, after `acquire`
 * checked it, without holding the GIL. Returns 0, or -1 with an exception set. */
static int run_pass(PyObject *obj, const char *dtype, int threads, int centred, double shift, partial_t *total) {
    Py_buffer view;
    const kind_t *kind;
    if (acquire(obj, dtype, &view, &kind) < 0) return -1;
    const int64_t numel = (int64_t)(view.len / kind->itemsize);
    if (numel > 0) {
        /* the buffer stays exported (its owner alive and its memory in place) until released */
        Py_BEGIN_ALLOW_THREADS
        reduce_parallel(kind, (const char *)view.buf, numel, threads, centred, shift, total);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&view);
    return 0;
}

static PyObject *reduce(PyObject *self, PyObject *args) {
    PyObject *obj;
    const char *dtype;
    int threads;
    (void)self;
    if (!PyArg_ParseTuple(args, "Osi", &obj, &dtype, &threads)) return NULL;
    partial_t total = {0.0, 0.0, 0.0, 0.0, INFINITY, -INFINITY, 0};
    if (run_pass(obj, dtype, threads, 0, 0.0, &total) < 0) return NULL;
    return Py_BuildValue("(ddddddL)", total.sum, total.sumsq, total.sumcube, total.sumquad, (double)total.lo,
                         (double)total.hi, (long long)total.zeros);
}

PyDoc_STRVAR(centred_doc,
             "centred(buffer, dtype, threads, shift) -> sums of d, d**2, d**3, d**4 for d = x - shift\n\n"
             "A second pass over the values of `buffer` (taken and checked as by `reduce`), in float64:\n"
             "with `shift` near the mean it gives the central moments of data with a large offset without\n"
             "the cancellation of power sums about 0 (the corrected two-pass algorithm).");

static PyObject *centred(PyObject *self, PyObject *args) {
    PyObject *obj;
    const char *dtype;
    int threads;
    double shift;
    (void)self;
    if (!PyArg_ParseTuple(args, "Osid", &obj, &dtype, &threads, &shift)) return NULL;
    partial_t total = {0.0, 0.0, 0.0, 0.0, INFINITY, -INFINITY, 0};
    if (run_pass(obj, dtype, threads, 1, shift, &total) < 0) return NULL;
    return Py_BuildValue("(dddd)", total.sum, total.sumsq, total.sumcube, total.sumquad);
}

static PyObject *has_openmp(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
#ifdef _OPENMP
    Py_RETURN_TRUE;
#else
    Py_RETURN_FALSE;
#endif
}

static PyMethodDef methods[] = {
    {"reduce", reduce, METH_VARARGS, reduce_doc},
    {"centred", centred, METH_VARARGS, centred_doc},
    {"has_openmp", has_openmp, METH_NOARGS, "Whether this build runs on several threads."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "hookcli._fastreduce",
    "One-pass float32 statistics for hookcli (optional C speed-up).", -1, methods,
};

/* Bump with every change to the functions' signatures or results: hookcli.engine.kernel ignores a
 * build whose ABI differs (an editable install keeps an old .so until `pip install -e .` again). */
#define HK_ABI 5

PyMODINIT_FUNC PyInit__fastreduce(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    PyObject *dtypes = PyTuple_New(N_KINDS);
    for (int k = 0; dtypes != NULL && k < N_KINDS; k++) {
        PyObject *name = PyUnicode_FromString(KINDS[k].name);
        if (name == NULL) Py_CLEAR(dtypes);
        else PyTuple_SET_ITEM(dtypes, k, name);
    }
    if (PyModule_AddIntConstant(m, "ABI", HK_ABI) < 0 || dtypes == NULL ||
        PyModule_AddObject(m, "DTYPES", dtypes) < 0) {
        Py_XDECREF(dtypes);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
