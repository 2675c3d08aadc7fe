/* rlferry.wire._fastcopy: one large copy with non-temporal (streaming) stores.
 *
 * A copy of tens of MB into shared memory goes at memory bandwidth. Ordinary
 * stores first read every destination line into the cache (read for ownership),
 * so a copy moves 3 bytes per byte copied; streaming stores write around the
 * cache and move 2. glibc's memmove switches to them only above a threshold
 * derived from the cache size (often larger than one copy), so rlferry makes
 * the choice itself for the copies it knows are large. Built when a C compiler
 * is there at install; without it rlferry falls back to libc memmove.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define RLFERRY_STREAM 1
#endif

static void stream_copy(char *dst, const char *src, size_t n) {
#ifdef RLFERRY_STREAM
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    for (; n >= 64; n -= 64, dst += 64, src += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
    memcpy(dst, src, n);
    _mm_sfence(); /* the streamed lines are visible before the caller goes on */
#else
    memcpy(dst, src, n);
#endif
}

static PyObject *copy(PyObject *self, PyObject *args) {
    unsigned long long dst, src, n;
    if (!PyArg_ParseTuple(args, "KKK", &dst, &src, &n))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    stream_copy((char *)(uintptr_t)dst, (const char *)(uintptr_t)src, (size_t)n);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy", copy, METH_VARARGS,
     "copy(dst, src, n): copy n bytes between addresses with streaming stores, without the GIL"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastcopy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fastcopy(void) { return PyModule_Create(&module); }
