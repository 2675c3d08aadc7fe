/* rlferry.weights.delta._fastdiff: a delta push's diff and a delta's apply on the CPU.
 *
 * diff: each tensor is compared with its base as integers of its element size in one
 * pass over both; the pass writes each block's count, each changed element's value and
 * offset (the record's layout, `_record.layout`), and the changed elements into the
 * base. Tensors of more than 2 * MIN_SPLIT blocks are cut in two pieces: the front one
 * writes its values and offsets forward from the start of their regions, the back one
 * backward (blocks last to first) from their ends, so the two never meet while the
 * tensor is sparse; one small move joins them. Each piece goes in runs of RUN blocks
 * (the back piece's runs last to first, the blocks of a run first to last: read
 * backward, memory runs 3x slower): a run is compared (masks kept, the base updated),
 * then its changes written. The pieces of all tensors of a call go to the threads
 * largest first, without the GIL. A tensor's pieces add each run's changes to a shared
 * total: once it passes `nmax` (the most changes a sparse record may carry), they stop
 * writing the record and only count and update the base (the tensor goes dense; its
 * base already holds it).
 *
 * apply: the changed elements of a delta written into a tensor, the blocks cut among
 * threads at the same count of changes; nothing is written (False) when the counts do
 * not add up to the changes or an offset falls past the tensor's end.
 *
 * AVX-512 (F, BW, VL, VBMI2: compare to a mask, compress values and offsets) where the
 * CPU has it, checked at run time; plain C elsewhere. Built when a C compiler is there
 * at install; without it rlferry diffs and applies with torch ops.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifndef _WIN32
#include <pthread.h>
#define RLFERRY_THREADS 1
#endif
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
#include <immintrin.h>
#define RLFERRY_AVX512 1
#endif

#define BLOCK 256
#define RUN 64         /* blocks compared before their changes are written */
#define MIN_SPLIT 256  /* blocks (64 Ki elements) a piece has at least */
#define MAX_THREADS 64

typedef struct {
    const uint8_t *a; /* the new tensor */
    uint8_t *b;       /* its base, updated */
    uint8_t *data;    /* the record: room for values_at + nmax * (isz + 1) bytes */
    int64_t numel, nmax, blocks, values_at, split;
    int isz, plain; /* plain: the plain C kernels whatever the CPU has */
    int64_t total;   /* changes found by its pieces so far (atomic) */
    int left;        /* pieces not done (atomic) */
    int64_t found[2]; /* changes of the front and the back piece */
} job_t;

typedef struct {
    job_t *job;
    int back;
    int64_t size;
} piece_t;

/* ---- one block: compare (base updated, masks out), then write values and offsets ---- */

typedef int (*compare_fn)(const uint8_t *a, uint8_t *b, int len, uint64_t *m);
typedef void (*write_fn)(const uint8_t *a, int len, const uint64_t *m, uint8_t *vp,
                         uint8_t *op);

#define GENERIC(T, NAME)                                                                   \
    static int compare_##NAME(const uint8_t *a_, uint8_t *b_, int len, uint64_t *m) {      \
        const T *a = (const T *)a_;                                                        \
        T *b = (T *)b_;                                                                    \
        int k = 0;                                                                         \
        for (int g = 0; g * 64 < len; g++) {                                               \
            int end = len - g * 64 < 64 ? len - g * 64 : 64;                               \
            uint64_t mm = 0;                                                               \
            for (int j = 0; j < end; j++)                                                  \
                mm |= (uint64_t)(a[g * 64 + j] != b[g * 64 + j]) << j;                     \
            if (mm) {                                                                      \
                memcpy(b + g * 64, a + g * 64, (size_t)end * sizeof(T));                   \
                k += __builtin_popcountll(mm);                                             \
            }                                                                              \
            m[g] = mm;                                                                     \
        }                                                                                  \
        return k;                                                                          \
    }                                                                                      \
    static void write_##NAME(const uint8_t *a_, int len, const uint64_t *m, uint8_t *vp,   \
                             uint8_t *op) {                                                \
        const T *a = (const T *)a_;                                                        \
        for (int g = 0; g * 64 < len; g++) {                                               \
            for (uint64_t mm = m[g]; mm; mm &= mm - 1) {                                   \
                int j = g * 64 + __builtin_ctzll(mm);                                      \
                memcpy(vp, a + j, sizeof(T));                                              \
                vp += sizeof(T);                                                           \
                *op++ = (uint8_t)j;                                                        \
            }                                                                              \
        }                                                                                  \
    }

GENERIC(uint8_t, g1)
GENERIC(uint16_t, g2)
GENERIC(uint32_t, g4)
GENERIC(uint64_t, g8)

#ifdef RLFERRY_AVX512
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi2,popcnt")))

/* Chunks of 64 bytes: W elements each, masks of W bits (one uint64_t a chunk). The tail
 * of a block (len < BLOCK, the tensor's last) is read with masked loads. */
#define AVX512_KERNELS(NAME, W, MASK_T, SFX, CMP, CMASK, IOTA_T, IOTA, OADD, OCOMP, OSTORE,  \
                       FULL)                                                               \
    AVX512 static int compare_##NAME(const uint8_t *a, uint8_t *b, int len, uint64_t *m) { \
        int k = 0;                                                                         \
        if (len == BLOCK) { /* unmasked loads, a fixed count: 3x faster than masked */     \
            for (int c = 0; c < BLOCK / W; c++) {                                          \
                __m512i va = _mm512_loadu_si512(a + c * 64);                               \
                __m512i vb = _mm512_loadu_si512(b + c * 64);                               \
                MASK_T ne = CMP((MASK_T)FULL, va, vb);                                     \
                if (ne) /* the equal elements too: a plain store, no masked one */         \
                    _mm512_storeu_si512(b + c * 64, va);                                   \
                m[c] = (uint64_t)ne;                                                       \
                k += (int)_mm_popcnt_u64((uint64_t)ne);                                    \
            }                                                                              \
            return k;                                                                      \
        }                                                                                  \
        for (int c = 0; c * W < len; c++) {                                                \
            int rem = len - c * W;                                                         \
            MASK_T lm = rem >= W ? (MASK_T)FULL : (MASK_T)((1ULL << rem) - 1);             \
            __m512i va = _mm512_maskz_loadu_##SFX(lm, a + c * 64);                         \
            __m512i vb = _mm512_maskz_loadu_##SFX(lm, b + c * 64);                         \
            MASK_T ne = CMP(lm, va, vb);                                                   \
            if (ne)                                                                        \
                _mm512_mask_storeu_##SFX(b + c * 64, ne, va);                              \
            m[c] = (uint64_t)ne;                                                           \
            k += (int)_mm_popcnt_u64((uint64_t)ne);                                        \
        }                                                                                  \
        return k;                                                                          \
    }                                                                                      \
    AVX512 static void write_##NAME(const uint8_t *a, int len, const uint64_t *m,         \
                                    uint8_t *vp, uint8_t *op) {                            \
        const IOTA_T iota = IOTA;                                                          \
        for (int c = 0; c * W < len; c++) {                                                \
            MASK_T ne = (MASK_T)m[c];                                                      \
            if (!ne)                                                                       \
                continue;                                                                  \
            int cnt = (int)_mm_popcnt_u64((uint64_t)ne);                                   \
            MASK_T wm = (MASK_T)((cnt == 64) ? ~0ULL : ((1ULL << cnt) - 1));               \
            __m512i va = _mm512_maskz_loadu_##SFX(ne, a + c * 64);                         \
            _mm512_mask_storeu_##SFX(vp, wm, _mm512_maskz_compress_##SFX(ne, va));         \
            OSTORE(op, CMASK(wm), OCOMP(CMASK(ne), OADD(iota, c * W)));                    \
            vp += cnt * (64 / W);                                                          \
            op += cnt;                                                                     \
        }                                                                                  \
    }

#define CMP8(l, x, y) _mm512_mask_cmpneq_epi8_mask(l, x, y)
#define CMP16(l, x, y) _mm512_mask_cmpneq_epi16_mask(l, x, y)
#define CMP32(l, x, y) _mm512_mask_cmpneq_epi32_mask(l, x, y)
#define CMP64(l, x, y) _mm512_mask_cmpneq_epi64_mask(l, x, y)
#define ID(m) (m)
#define TO16(m) ((__mmask16)(m))
#define ADD512(v, o) _mm512_add_epi8(v, _mm512_set1_epi8((char)(o)))
#define ADD256(v, o) _mm256_add_epi8(v, _mm256_set1_epi8((char)(o)))
#define ADD128(v, o) _mm_add_epi8(v, _mm_set1_epi8((char)(o)))
#define IOTA64                                                                             \
    _mm512_set_epi8(63, 62, 61, 60, 59, 58, 57, 56, 55, 54, 53, 52, 51, 50, 49, 48, 47, 46,  \
                    45, 44, 43, 42, 41, 40, 39, 38, 37, 36, 35, 34, 33, 32, 31, 30, 29, 28,  \
                    27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10,  \
                    9, 8, 7, 6, 5, 4, 3, 2, 1, 0)
#define IOTA32                                                                             \
    _mm256_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19,   \
                     20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31)
#define IOTA16 _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)

AVX512_KERNELS(v1, 64, __mmask64, epi8, CMP8, ID, __m512i, IOTA64, ADD512,
               _mm512_maskz_compress_epi8, _mm512_mask_storeu_epi8, ~0ULL)
AVX512_KERNELS(v2, 32, __mmask32, epi16, CMP16, ID, __m256i, IOTA32, ADD256,
               _mm256_maskz_compress_epi8, _mm256_mask_storeu_epi8, 0xFFFFFFFFu)
AVX512_KERNELS(v4, 16, __mmask16, epi32, CMP32, ID, __m128i, IOTA16, ADD128,
               _mm_maskz_compress_epi8, _mm_mask_storeu_epi8, 0xFFFFu)
AVX512_KERNELS(v8, 8, __mmask8, epi64, CMP64, TO16, __m128i, IOTA16, ADD128,
               _mm_maskz_compress_epi8, _mm_mask_storeu_epi8, 0xFFu)
#endif

static compare_fn compares[9], plain_compares[9];
static write_fn writes[9], plain_writes[9];

static void choose_kernels(void) {
    compares[1] = compare_g1, compares[2] = compare_g2;
    compares[4] = compare_g4, compares[8] = compare_g8;
    writes[1] = write_g1, writes[2] = write_g2, writes[4] = write_g4, writes[8] = write_g8;
    memcpy(plain_compares, compares, sizeof(compares));
    memcpy(plain_writes, writes, sizeof(writes));
#ifdef RLFERRY_AVX512
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi2")) {
        compares[1] = compare_v1, compares[2] = compare_v2;
        compares[4] = compare_v4, compares[8] = compare_v8;
        writes[1] = write_v1, writes[2] = write_v2, writes[4] = write_v4, writes[8] = write_v8;
    }
#endif
}

/* ---- a piece of a tensor: its blocks in one pass; the changes it found ---- */

static int64_t diff_piece(job_t *j, int back) {
    const int isz = j->isz;
    const int64_t b0 = back ? j->split : 0, b1 = back ? j->blocks : j->split;
    compare_fn compare = (j->plain ? plain_compares : compares)[isz];
    write_fn write = (j->plain ? plain_writes : writes)[isz];
    int16_t *counts = (int16_t *)j->data;
    uint8_t *ends = j->data ? j->data + j->values_at + j->nmax * isz : NULL;
    uint8_t *vp = back ? ends : (j->data ? j->data + j->values_at : NULL);
    uint8_t *op = back ? (ends ? ends + j->nmax : NULL) : ends;
    uint64_t m[RUN][BLOCK / 8];
    int ks[RUN];
    int64_t n = 0;
    int dense = j->nmax < 1;
    for (int64_t r = 0; r < b1 - b0; r += RUN) {
        int cnt = b1 - b0 - r < RUN ? (int)(b1 - b0 - r) : RUN;
        int64_t first = back ? b1 - r - cnt : b0 + r; /* the back piece's runs last first */
        int64_t kr = 0;
        for (int i = 0; i < cnt; i++) { /* blocks forward in a run: the prefetchers follow */
            int64_t at = (first + i) * BLOCK;
            int len = j->numel - at < BLOCK ? (int)(j->numel - at) : BLOCK;
            ks[i] = compare(j->a + at * isz, j->b + at * isz, len, m[i]);
            kr += ks[i];
        }
        n += kr;
        if (n > j->nmax)
            dense = 1;
        /* both pieces add each run's changes before writing them: of two runs, the one
         * added last sees both, so their records never overlap while the tensor is sparse */
        if (j->split < j->blocks && __atomic_add_fetch(&j->total, kr, __ATOMIC_RELAXED) > j->nmax)
            dense = 1;
        if (dense)
            continue;
        if (back)
            vp -= kr * isz, op -= kr;
        uint8_t *v = vp, *o = op;
        for (int i = 0; i < cnt; i++) {
            int64_t at = (first + i) * BLOCK;
            counts[first + i] = (int16_t)ks[i];
            if (ks[i]) {
                int len = j->numel - at < BLOCK ? (int)(j->numel - at) : BLOCK;
                write(j->a + at * isz, len, m[i], v, o);
                v += (int64_t)ks[i] * isz;
                o += ks[i];
            }
        }
        if (!back)
            vp = v, op = o;
    }
    return n;
}

/* The record of a tensor sparse: the back piece's values and both pieces' offsets moved
 * next to the front piece's values. */
static void join(job_t *j) {
    int64_t nf = j->found[0], nb = j->found[1], n = nf + nb;
    if (n == 0 || n > j->nmax)
        return;
    uint8_t *v = j->data + j->values_at, *ends = v + j->nmax * j->isz;
    memmove(v + nf * j->isz, ends - nb * j->isz, (size_t)(nb * j->isz));
    memmove(v + n * j->isz, ends, (size_t)nf);
    memmove(v + n * j->isz + nf, ends + j->nmax - nb, (size_t)nb);
    memset(j->data + 2 * j->blocks, 0, (size_t)(j->values_at - 2 * j->blocks));
}

typedef struct {
    piece_t *pieces;
    int64_t count;
    int64_t next; /* atomic */
} work_t;

static void *diff_work(void *arg) {
    work_t *w = (work_t *)arg;
    for (;;) {
        int64_t i = __atomic_fetch_add(&w->next, 1, __ATOMIC_RELAXED);
        if (i >= w->count)
            return NULL;
        piece_t *p = &w->pieces[i];
        p->job->found[p->back] = diff_piece(p->job, p->back);
        if (__atomic_sub_fetch(&p->job->left, 1, __ATOMIC_ACQ_REL) == 0)
            join(p->job);
    }
}

/* Run `work(arg)` on `threads` threads (this one too); fewer when one cannot start. */
static void run_threads(void *(*work)(void *), void *args, size_t arg_size, int threads) {
#ifdef RLFERRY_THREADS
    pthread_t ids[MAX_THREADS];
    int started = 0;
    for (int t = 1; t < threads; t++) {
        if (pthread_create(&ids[started], NULL, work, (char *)args + t * arg_size) != 0)
            break;
        started++;
    }
    work(args);
    for (int t = 0; t < started; t++)
        pthread_join(ids[t], NULL);
#else
    (void)arg_size;
    (void)threads;
    work(args);
#endif
}

static int by_size(const void *x, const void *y) {
    int64_t a = ((const piece_t *)x)->size, b = ((const piece_t *)y)->size;
    return (a < b) - (a > b);
}

static int get_u64(PyObject *seq, Py_ssize_t i, unsigned long long *out) {
    *out = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(seq, i));
    return PyErr_Occurred() ? -1 : 0;
}

static int get_i64(PyObject *seq, Py_ssize_t i, int64_t *out) {
    *out = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
    return PyErr_Occurred() ? -1 : 0;
}

static int parse_job(PyObject *item, job_t *j) {
    PyObject *t = PySequence_Fast(item, "a job is a tuple");
    if (t == NULL)
        return -1;
    unsigned long long a, b, data;
    int64_t isz = 0;
    int bad = PySequence_Fast_GET_SIZE(t) != 7;
    if (!bad)
        bad = get_u64(t, 0, &a) || get_u64(t, 1, &b) || get_u64(t, 2, &data) ||
              get_i64(t, 3, &j->numel) || get_i64(t, 4, &isz) || get_i64(t, 5, &j->nmax) ||
              get_i64(t, 6, &j->values_at);
    Py_DECREF(t);
    if (PyErr_Occurred())
        return -1;
    if (bad || j->numel < 0 || (isz != 1 && isz != 2 && isz != 4 && isz != 8) ||
        (j->numel > 0 && (a == 0 || b == 0)) || (j->nmax >= 1 && data == 0)) {
        PyErr_SetString(PyExc_ValueError,
                        "a job is (new, base, data, numel, itemsize 1/2/4/8, nmax, values_at)");
        return -1;
    }
    j->a = (const uint8_t *)(uintptr_t)a;
    j->b = (uint8_t *)(uintptr_t)b;
    j->data = (uint8_t *)(uintptr_t)data;
    j->isz = (int)isz;
    j->blocks = (j->numel + BLOCK - 1) / BLOCK;
    j->split = j->blocks;
    j->total = 0;
    j->found[0] = j->found[1] = 0;
    return 0;
}

static int clamp_threads(int threads) {
    return threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
}

static PyObject *diff(PyObject *self, PyObject *args) {
    PyObject *list;
    int threads, plain = 0;
    if (!PyArg_ParseTuple(args, "O!i|p", &PyList_Type, &list, &threads, &plain))
        return NULL;
    threads = clamp_threads(threads);
    Py_ssize_t count = PyList_GET_SIZE(list);
    job_t *jobs = PyMem_Calloc((size_t)count + 1, sizeof(job_t));
    piece_t *pieces = PyMem_Calloc(2 * (size_t)count + 1, sizeof(piece_t));
    if (jobs == NULL || pieces == NULL) {
        PyMem_Free(jobs), PyMem_Free(pieces);
        return PyErr_NoMemory();
    }
    int64_t npieces = 0, bytes = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        job_t *j = &jobs[i];
        if (parse_job(PyList_GET_ITEM(list, i), j) < 0) {
            PyMem_Free(jobs), PyMem_Free(pieces);
            return NULL;
        }
        j->plain = plain;
        bytes += j->numel * j->isz;
        if (threads > 1 && j->blocks >= 2 * MIN_SPLIT)
            j->split = j->blocks / 2;
        j->left = j->split < j->blocks ? 2 : 1;
        pieces[npieces++] = (piece_t){j, 0, j->split * BLOCK * j->isz};
        if (j->split < j->blocks)
            pieces[npieces++] = (piece_t){j, 1, (j->blocks - j->split) * BLOCK * j->isz};
    }
    if (bytes < ((int64_t)MIN_SPLIT * BLOCK * 4))
        threads = 1;
    Py_BEGIN_ALLOW_THREADS
    qsort(pieces, (size_t)npieces, sizeof(piece_t), by_size);
    work_t work = {pieces, npieces, 0};
    run_threads(diff_work, &work, 0, threads); /* every thread takes from the one queue */
    Py_END_ALLOW_THREADS
    PyObject *out = PyList_New(count);
    for (Py_ssize_t i = 0; out != NULL && i < count; i++) {
        PyObject *n = PyLong_FromLongLong(jobs[i].found[0] + jobs[i].found[1]);
        if (n == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, n);
    }
    PyMem_Free(jobs), PyMem_Free(pieces);
    return out;
}

/* ---- apply: a delta's changed elements written into a tensor ---- */

typedef struct {
    uint8_t *t;
    const int16_t *counts;
    const uint8_t *offsets, *values;
    int64_t b0, b1, first; /* its blocks, and the changes before them */
    int isz;
} apply_t;

#define SCATTER(T)                                                                         \
    {                                                                                      \
        T *t = (T *)w->t;                                                                  \
        const T *v = (const T *)w->values;                                                 \
        for (int64_t blk = w->b0; blk < w->b1; blk++) {                                    \
            T *to = t + blk * BLOCK;                                                       \
            for (int c = w->counts[blk]; c > 0; c--, k++) {                                \
                T x;                                                                       \
                memcpy(&x, v + k, sizeof(T));                                              \
                to[w->offsets[k]] = x;                                                     \
            }                                                                              \
        }                                                                                  \
    }

static void *apply_work(void *arg) {
    apply_t *w = (apply_t *)arg;
    int64_t k = w->first;
    switch (w->isz) {
    case 1:
        SCATTER(uint8_t) break;
    case 2:
        SCATTER(uint16_t) break;
    case 4:
        SCATTER(uint32_t) break;
    default:
        SCATTER(uint64_t) break;
    }
    return NULL;
}

static PyObject *apply(PyObject *self, PyObject *args) {
    unsigned long long t, counts, offsets, values;
    long long numel, changed;
    int isz, threads;
    if (!PyArg_ParseTuple(args, "KLiKKKLi", &t, &numel, &isz, &counts, &offsets, &values,
                          &changed, &threads))
        return NULL;
    if (numel < 0 || changed < 0 || (isz != 1 && isz != 2 && isz != 4 && isz != 8)) {
        PyErr_SetString(PyExc_ValueError, "bad numel, changed or itemsize");
        return NULL;
    }
    threads = clamp_threads(threads);
    if (changed < (int64_t)MIN_SPLIT * BLOCK)
        threads = 1;
    int64_t blocks = (numel + BLOCK - 1) / BLOCK;
    const int16_t *cs = (const int16_t *)(uintptr_t)counts;
    apply_t works[MAX_THREADS];
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    int64_t seen = 0, blk = 0;
    for (int w = 0; w < threads; w++) {
        int64_t until = changed * (w + 1) / threads, first = seen;
        int64_t b0 = blk;
        while (blk < blocks && (seen < until || w == threads - 1)) {
            if (cs[blk] < 0 || cs[blk] > BLOCK)
                bad = 1;
            seen += cs[blk++];
        }
        works[w] = (apply_t){(uint8_t *)(uintptr_t)t, cs, (const uint8_t *)(uintptr_t)offsets,
                             (const uint8_t *)(uintptr_t)values, b0, blk, first, isz};
    }
    if (seen != changed)
        bad = 1;
    /* the last block may be short: its offsets must fall inside the tensor */
    int64_t tail = numel - (blocks - 1) * BLOCK;
    if (!bad && blocks > 0 && tail < BLOCK) {
        const uint8_t *os = (const uint8_t *)(uintptr_t)offsets;
        for (int64_t k = changed - cs[blocks - 1]; k < changed; k++)
            if (os[k] >= tail)
                bad = 1;
    }
    if (!bad)
        run_threads(apply_work, works, sizeof(apply_t), threads);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(!bad);
}

static PyMethodDef methods[] = {
    {"diff", diff, METH_VARARGS,
     "diff(jobs, threads, plain=False) -> changes per job; a job: (new, base, data, numel, "
     "itemsize, nmax, values_at); plain: the plain C kernels whatever the CPU has"},
    {"apply", apply, METH_VARARGS,
     "apply(tensor, numel, itemsize, counts, offsets, values, changed, threads) -> False "
     "(nothing written) when the counts or offsets do not fit the tensor"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastdiff", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fastdiff(void) {
    choose_kernels();
    return PyModule_Create(&module);
}
