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

/* Strings: made empty under the GIL (cheap), filled without it (where their fresh pages
 * fault in), so that two threads can fill the halves of a column side by side. */

/* Copy n bytes; nonzero when one of them is not 7-bit ASCII. Eight at a time. */
static int copy_ascii(char *dst, const char *src, size_t n) {
    uint64_t acc = 0, w;
    size_t k = 0;
    for (; k + 8 <= n; k += 8) {
        memcpy(&w, src + k, 8);
        memcpy(dst + k, &w, 8);
        acc |= w;
    }
    for (; k < n; k++) {
        dst[k] = src[k];
        acc |= (unsigned char)src[k];
    }
    return (acc & 0x8080808080808080ULL) != 0;
}

static PyObject *empty_strings(PyObject *self, PyObject *args) {
    PyObject *bounds;
    int is_str;
    if (!PyArg_ParseTuple(args, "O!p", &PyList_Type, &bounds, &is_str))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(bounds) - 1;
    if (n < 0)
        return PyList_New(0);
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    Py_ssize_t prev = PyLong_AsSsize_t(PyList_GET_ITEM(bounds, 0));
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t next = PyLong_AsSsize_t(PyList_GET_ITEM(bounds, i + 1));
        if ((prev == -1 || next == -1) && PyErr_Occurred()) {
            Py_DECREF(out);
            return NULL;
        }
        if (next < prev) {
            Py_DECREF(out);
            return PyErr_Format(PyExc_ValueError, "bounds decrease at item %zd", i);
        }
        PyObject *item = is_str ? PyUnicode_New(next - prev, 127)
                                : PyBytes_FromStringAndSize(NULL, next - prev);
        if (item == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, item);
        prev = next;
    }
    return out;
}

static PyObject *fill_strings(PyObject *self, PyObject *args) {
    /* fill_strings(items, start, stop, data_address, bounds) -> True, or False when a
     * str item would get a byte >= 128 (then the items are garbage: drop them). */
    PyObject *items, *bounds;
    Py_ssize_t start, stop;
    unsigned long long data;
    if (!PyArg_ParseTuple(args, "O!nnKO!", &PyList_Type, &items, &start, &stop, &data,
                          &PyList_Type, &bounds))
        return NULL;
    if (start < 0 || stop > PyList_GET_SIZE(items) || start > stop ||
        PyList_GET_SIZE(bounds) != PyList_GET_SIZE(items) + 1)
        return PyErr_Format(PyExc_ValueError, "bad range or bounds");
    Py_ssize_t count = stop - start;
    char **dst = PyMem_Malloc(sizeof(char *) * (count + 1));
    Py_ssize_t *at = PyMem_Malloc(sizeof(Py_ssize_t) * (count + 1));
    if (dst == NULL || at == NULL) {
        PyMem_Free(dst);
        PyMem_Free(at);
        return PyErr_NoMemory();
    }
    int is_str = count && PyUnicode_Check(PyList_GET_ITEM(items, start));
    const char *bad = NULL;
    for (Py_ssize_t i = 0; i <= count && bad == NULL; i++) {
        at[i] = PyLong_AsSsize_t(PyList_GET_ITEM(bounds, start + i));
        if (at[i] < 0 || (i > 0 && at[i] < at[i - 1]))
            bad = "bounds are not non-decreasing offsets";
        if (i == count || bad != NULL)
            break;
        PyObject *item = PyList_GET_ITEM(items, start + i);
        Py_ssize_t size;
        if (is_str && PyUnicode_Check(item) && PyUnicode_IS_COMPACT_ASCII(item)) {
            size = PyUnicode_GET_LENGTH(item);
            dst[i] = (char *)PyUnicode_DATA(item);
        } else if (!is_str && PyBytes_Check(item)) {
            size = PyBytes_GET_SIZE(item);
            dst[i] = PyBytes_AS_STRING(item);
        } else {
            bad = "items are not all empty ASCII str or all bytes";
            break;
        }
        at[i + 1] = PyLong_AsSsize_t(PyList_GET_ITEM(bounds, start + i + 1));
        if (at[i + 1] - at[i] != size) /* never write past an item */
            bad = "an item's length differs from its bounds";
    }
    if (bad != NULL || PyErr_Occurred()) {
        PyMem_Free(dst);
        PyMem_Free(at);
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, bad);
        return NULL;
    }
    int high = 0;
    Py_BEGIN_ALLOW_THREADS
    const char *base = (const char *)(uintptr_t)data;
    for (Py_ssize_t i = 0; i < count; i++) {
        size_t n = (size_t)(at[i + 1] - at[i]);
        if (is_str)
            high |= copy_ascii(dst[i], base + at[i], n);
        else
            memcpy(dst[i], base + at[i], n);
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(dst);
    PyMem_Free(at);
    return PyBool_FromLong(!high);
}

static PyMethodDef methods[] = {
    {"copy", copy, METH_VARARGS,
     "copy(dst, src, n): copy n bytes between addresses with streaming stores, without the GIL"},
    {"empty_strings", empty_strings, METH_VARARGS,
     "empty_strings(bounds, is_str): items of lengths bounds[i+1]-bounds[i], not filled"},
    {"fill_strings", fill_strings, METH_VARARGS,
     "fill_strings(items, start, stop, data_address, bounds): fill items[start:stop]"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastcopy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fastcopy(void) { return PyModule_Create(&module); }
