/* Page copies between L1 and L2 host memory with streaming (non-temporal) stores.
 *
 * Why native: a restore copies ~100 MB while the network suffix and the transport threads
 * want the same cores. glibc's memcpy writes a 128 KiB page with ordinary stores (it only
 * streams above ~3/4 of the last-level cache, 190 MB on the VM this was measured on), so
 * every destination line is first read for ownership; streaming stores skip that read and
 * the copy takes ~1.4x less CPU per byte. One call copies a whole list of pages with the GIL
 * released, instead of one Python-level memmove per (page, buffer).
 *
 * copy(dst, src, item): dst and src are buffers of native uint64 addresses, equally long;
 * copies item bytes from each src[i] to dst[i]. The caller has checked every address.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>

static void stream_copy(char *d, const char *s, size_t n) {
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;
    if (head > n) head = n;
    memcpy(d, s, head);
    d += head; s += head; n -= head;
    size_t blocks = n / 64;
    for (size_t i = 0; i < blocks; i++, d += 64, s += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)s);
        __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)d, a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), c);
        _mm_stream_si128((__m128i *)(d + 48), e);
    }
    memcpy(d, s, n % 64);
}
#define STREAMING 1
#else
static void stream_copy(char *d, const char *s, size_t n) { memcpy(d, s, n); }
#define STREAMING 0
#endif

static PyObject *ntcopy_copy(PyObject *self, PyObject *args) {
    Py_buffer dst, src;
    unsigned long long item;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*K", &dst, &src, &item))
        return NULL;
    if (dst.len != src.len || dst.len % 8 != 0) {
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        PyErr_SetString(PyExc_ValueError, "dst and src must be equally long uint64 buffers");
        return NULL;
    }
    const uint64_t *d = (const uint64_t *)dst.buf, *s = (const uint64_t *)src.buf;
    Py_ssize_t n = dst.len / 8;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        stream_copy((char *)(uintptr_t)d[i], (const char *)(uintptr_t)s[i], (size_t)item);
#if STREAMING
    _mm_sfence(); /* streamed lines are visible to other cores before we return */
#endif
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy", ntcopy_copy, METH_VARARGS, "copy(dst, src, item): item bytes from each src to dst"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ntcopy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__ntcopy(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "STREAMING", STREAMING) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
